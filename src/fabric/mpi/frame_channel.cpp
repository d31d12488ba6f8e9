#include "fabric/mpi/frame_channel.hpp"

#include <algorithm>
#include <deque>
#include <iterator>
#include <string>

#include "fabric/mpi/direct_read.hpp"
#include "sluice/error.hpp"

namespace sluice::mpi {

FrameMeta Frame::meta(Precision precision) const {
  FrameMeta m;
  m.chunks = static_cast<std::int32_t>(chunks.size());
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    m.chunk[i] = {static_cast<std::int64_t>(chunks[i]->size()), chunks[i]->first_output,
                  chunks[i]->outputs,
                  reinterpret_cast<std::uintptr_t>(packet_data(*chunks[i], precision))};
  }
  return m;
}

void check_frame(const FrameMeta& meta) {
  if (meta.chunks < 0 || meta.chunks > kMaxFrameChunks) {
    throw FormatError("MpiFabric: a frame of " + std::to_string(meta.chunks) + " chunks");
  }
}

// --- rank 0 ----------------------------------------------------------------------------

Frame FrameSender::pull(StreamSource& source, std::size_t budget) const {
  if (budget == 0) budget = std::min(options_.frame_bytes, kFirstFrameBytes);
  Frame f;
  f.budget = budget;
  std::size_t bytes = 0;
  while (static_cast<std::int32_t>(f.chunks.size()) < kMaxFrameChunks &&
         (f.chunks.empty() || bytes < budget)) {
    ChunkPtr c = source.next();
    if (!c) break;
    to_count(c->byte_size(), "a stream chunk's bytes");
    bytes += c->byte_size();
    f.chunks.push_back(std::move(c));
  }
  return f;
}

// Frame i's bytes and frame i+1's sizes go out together, up to `window` frames in flight.
// With direct reads only the sizes and addresses go out, and a frame is in flight until
// every engine has said it read it.
void FrameSender::send(StreamSource& source, Frame first, SentStream* kept) const {
  struct InFlight {
    Frame frame;
    FrameMeta next;
    std::vector<MPI_Request> requests;
  };
  std::deque<std::unique_ptr<InFlight>> flight;
  auto retire = [&] {
    std::vector<MPI_Request>& r = flight.front()->requests;
    link_->wait_all(static_cast<int>(r.size()), r.data(), "stream broadcast");
    flight.pop_front();
  };
  const MPI_Comm comm = link_->comm();
  Frame current = std::move(first);
  const Precision precision = source.header().precision;
  std::vector<const void*> buffers;
  std::vector<std::size_t> sizes;
  if (kept != nullptr) kept->precision = precision;
  while (!current.chunks.empty()) {
    buffers.clear();
    sizes.clear();
    for (const ChunkPtr& c : current.chunks) {
      buffers.push_back(packet_data(*c, precision));
      sizes.push_back(c->size());
    }
    auto f = std::make_unique<InFlight>();
    Frame next = pull(source, std::min(options_.frame_bytes, 2 * current.budget));
    f->next = next.meta(precision);
    if (options_.direct) {
      f->requests.assign(static_cast<std::size_t>(link_->size()), MPI_REQUEST_NULL);
      for (int k = 1; k < link_->size(); ++k) {
        mpi_check(MPI_Irecv(nullptr, 0, MPI_BYTE, k, kFrameReadTag, comm,
                            &f->requests[static_cast<std::size_t>(k)]),
                  "stream broadcast");
      }
    } else {
      f->requests.assign(2, MPI_REQUEST_NULL);
      MPI_Datatype type = chunks_type(precision, buffers, sizes);
      // MPI_BOTTOM + absolute addresses: rank 0 only reads these buffers.
      const int rc = MPI_Ibcast(MPI_BOTTOM, 1, type, 0, comm, &f->requests[1]);
      MPI_Type_free(&type);  // freed when the broadcast is done with it
      mpi_check(rc, "stream broadcast");
    }
    mpi_check(MPI_Ibcast(&f->next, sizeof(FrameMeta), MPI_BYTE, 0, comm, &f->requests[0]),
              "stream broadcast");
    if (kept != nullptr) {
      for (const ChunkPtr& c : current.chunks) {
        const std::uint64_t v = kept->tags.add(*c, precision);
        kept->chunks.push_back(c);
        kept->chunk_values.push_back(v);
        kept->packets += c->size();
        kept->values += v;
      }
    }
    f->frame = std::move(current);
    flight.push_back(std::move(f));
    while (flight.size() >= options_.window) retire();
    current = std::move(next);
  }
  while (!flight.empty()) retire();
}

// --- engine ranks ----------------------------------------------------------------------

struct FrameReceiver::Posted {
  std::vector<ChunkPtr> chunks;
  FrameMeta next;
  MPI_Request data = MPI_REQUEST_NULL, meta = MPI_REQUEST_NULL;
  bool meta_read = false;  // `next` was acted on (posted, or it ended the stream)
};

// Buffers for a frame's chunks (from the pool), into `chunks`, buffers_ and sizes_.
void FrameReceiver::take(const FrameMeta& meta, Precision precision,
                         std::vector<ChunkPtr>& chunks) {
  buffers_.clear();
  sizes_.clear();
  for (std::int32_t i = 0; i < meta.chunks; ++i) {
    std::shared_ptr<StreamChunk> chunk;
    if (pool_.empty()) {
      chunk = std::make_shared<StreamChunk>();
    } else {
      chunk = std::move(pool_.back());
      pool_.pop_back();
    }
    used_.push_back(chunk);
    chunk->first_output = meta.chunk[i].first_output;
    chunk->outputs = meta.chunk[i].outputs;
    const auto packets = static_cast<std::size_t>(meta.chunk[i].packets);
    if (precision == Precision::bf16) {
      chunk->packets.clear();
      chunk->packets_bf16.resize(packets);
      buffers_.push_back(chunk->packets_bf16.data());
    } else {
      chunk->packets_bf16.clear();
      chunk->packets.resize(packets);
      buffers_.push_back(chunk->packets.data());
    }
    sizes_.push_back(packets);
    chunks.push_back(std::move(chunk));
  }
}

std::unique_ptr<FrameReceiver::Posted> FrameReceiver::post(const FrameMeta& meta,
                                                           Precision precision) {
  auto p = std::make_unique<Posted>();
  take(meta, precision, p->chunks);
  MPI_Datatype type = chunks_type(precision, {buffers_.begin(), buffers_.end()}, sizes_);
  const int rc = MPI_Ibcast(MPI_BOTTOM, 1, type, 0, link_->comm(), &p->data);
  MPI_Type_free(&type);
  mpi_check(rc, "stream broadcast");
  mpi_check(MPI_Ibcast(&p->next, sizeof(FrameMeta), MPI_BYTE, 0, link_->comm(), &p->meta),
            "stream broadcast");
  return p;
}

// Up to `window` frames posted; a frame goes to the engine as soon as it is complete, and
// the transfer goes on while the engine works.
void FrameReceiver::receive(const FrameMeta& first, Precision precision, StreamChannel& channel) {
  check_frame(first);
  if (options_.direct) {
    receive_directly(first, precision, channel);
    return;
  }
  std::deque<std::unique_ptr<Posted>> posted;
  bool ended = first.chunks == 0;
  if (!ended) posted.push_back(post(first, precision));
  // Acts on a frame's successor sizes: posts that frame, or notes the stream's end.
  auto follow = [&](Posted& p) {
    p.meta_read = true;
    check_frame(p.next);
    if (p.next.chunks == 0) {
      ended = true;
    } else {
      posted.push_back(post(p.next, precision));
    }
  };
  Link::Clock::time_point since = Link::Clock::now();
  while (!posted.empty()) {
    bool progress = false;
    Posted& newest = *posted.back();
    if (!ended && !newest.meta_read && posted.size() < options_.window) {
      int in = 0;
      mpi_check(MPI_Test(&newest.meta, &in, MPI_STATUS_IGNORE), "stream broadcast");
      if (in) {
        follow(newest);
        progress = true;
      }
    }
    // The oldest frame goes to the engine once complete (after posting its successor,
    // if the window held that back: the transfer goes on first).
    Posted& oldest = *posted.front();
    MPI_Request both[2] = {oldest.data, oldest.meta};
    int done = 0;
    mpi_check(MPI_Testall(2, both, &done, MPI_STATUSES_IGNORE), "stream broadcast");
    oldest.data = both[0];
    oldest.meta = both[1];
    if (done) {
      if (!oldest.meta_read && !ended) follow(oldest);
      channel.push(std::move(oldest.chunks));
      posted.pop_front();
      progress = true;
    }
    if (progress) {
      since = Link::Clock::now();
    } else {
      link_->pause(since, "stream broadcast");
    }
  }
  channel.close();
}

// Each frame is read out of rank 0's memory as soon as its sizes and addresses are in
// (frame i's come with frame i - 1's), then rank 0 is told, so it can let go of the
// chunks, and the frame goes to the engine.
void FrameReceiver::receive_directly(const FrameMeta& first, Precision precision,
                                     StreamChannel& channel) {
  const std::size_t packet_bytes =
      precision == Precision::bf16 ? sizeof(Bf16Packet) : sizeof(Packet);
  std::vector<MPI_Request> said;  // "read" to rank 0, one per frame
  FrameMeta meta = first, next;
  while (meta.chunks > 0) {
    MPI_Request upcoming = MPI_REQUEST_NULL;
    mpi_check(MPI_Ibcast(&next, sizeof(FrameMeta), MPI_BYTE, 0, link_->comm(), &upcoming),
              "stream broadcast");
    std::vector<ChunkPtr> chunks;
    take(meta, precision, chunks);
    read_frame(driver_pid_, meta, buffers_, sizes_, packet_bytes);
    said.push_back(MPI_REQUEST_NULL);
    mpi_check(MPI_Isend(nullptr, 0, MPI_BYTE, 0, kFrameReadTag, link_->comm(), &said.back()),
              "stream broadcast");
    channel.push(std::move(chunks));
    link_->wait(upcoming, "stream broadcast");
    check_frame(next);
    meta = next;
  }
  link_->wait_all(static_cast<int>(said.size()), said.data(), "stream broadcast");
  channel.close();
}

void FrameReceiver::reclaim() {
  pool_.insert(pool_.end(), std::make_move_iterator(used_.begin()),
               std::make_move_iterator(used_.end()));
  used_.clear();
}

}  // namespace sluice::mpi
