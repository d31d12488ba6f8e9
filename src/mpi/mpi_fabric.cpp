// MpiFabric: the fabric across processes. Rank 0 drives (executor, ModelMemory); every
// other rank serves one CpuEngine. See include/sluice/mpi_fabric.hpp for the protocol.
#include "sluice/mpi_fabric.hpp"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "engine_worker.hpp"
#include "sluice/error.hpp"
#include "sluice/topology.hpp"

namespace sluice {
namespace {

enum class Op : std::int32_t { forward = 1, backward = 2, stop = 3, probe = 4, probe_echo = 5 };

struct ChunkMeta {
  std::int64_t packets = 0;
  std::uint32_t first_output = 0;
  std::uint32_t outputs = 0;
};

// Chunks travel in frames: one Ibcast moves several chunks (an hindexed datatype over
// their packet buffers, no copy), so small chunks do not pay MPI's per-message cost.
constexpr std::int32_t kMaxFrameChunks = 64;

/// What the receivers need to post a frame's broadcast; chunks 0: the stream has ended.
struct FrameMeta {
  std::int32_t chunks = 0;
  std::int32_t unused = 0;
  ChunkMeta chunk[kMaxFrameChunks];
};

/// A frame's chunks: pointers for rank 0, buffers being filled on the engine ranks.
struct Frame {
  std::vector<ChunkPtr> chunks;
  FrameMeta meta() const {
    FrameMeta m;
    m.chunks = static_cast<std::int32_t>(chunks.size());
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      m.chunk[i] = {static_cast<std::int64_t>(chunks[i]->packets.size()), chunks[i]->first_output,
                    chunks[i]->outputs};
    }
    return m;
  }
};

// One datatype over a frame's packet buffers, with absolute addresses (used with
// MPI_BOTTOM).
MPI_Datatype chunks_type(const std::vector<const Packet*>& buffers,
                         const std::vector<std::size_t>& sizes);
MPI_Datatype packet_type();

/// Broadcast from rank 0 at the start of every operation.
struct Command {
  std::int32_t op = 0;
  std::int32_t want_dx = 0;  ///< any engine wants dX (then dX is gathered)
  std::uint32_t kind = 0, outputs = 0, inputs = 0, unused = 0;
  std::uint64_t nnz = 0;
  FrameMeta first;  ///< the stream's first frame
};

/// Scattered from rank 0: one engine's share of the operation.
struct Job {
  std::int64_t tokens = 0;
  std::int32_t lanes = 1;
  std::int32_t want_dx = 0;
};

/// Gathered to rank 0 after every operation.
struct Reply {
  double busy_seconds = 0, intake_seconds = 0;
  std::uint64_t packets = 0, bytes = 0;
  std::uint64_t grad_packets = 0;
  std::uint32_t grad_kind = 0, grad_outputs = 0, grad_inputs = 0, unused = 0;
  std::uint64_t grad_nnz = 0;
};

/// Engine options as rank 0 sends them, and what each engine rank resolved.
struct WireEngine {
  std::int32_t lanes = 0, blocks = 0, tile_tokens = 0, threads = 0;
  std::int32_t isa = -1, pin = 0;
  std::int64_t l2_bytes = 0;
};

void mpi_check(int rc, const char* what);

// Waits like MPI_Waitall, but gives the core away between polls: MPI waits spin, and the
// engine's own thread (or, on a shared node, another rank) needs that core to work.
void wait_all(int count, MPI_Request* requests, const char* what) {
  while (true) {
    int done = 0;
    mpi_check(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), what);
    if (done) return;
    std::this_thread::yield();
  }
}

void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(rc, text, &length);
    throw IoError(std::string("MpiFabric: ") + what + " failed: " + std::string(text, length));
  }
}

int to_count(std::uint64_t n, const char* what) {
  if (n > static_cast<std::uint64_t>(INT_MAX)) {
    throw ResourceError(std::string("MpiFabric: ") + what + " of " + std::to_string(n) +
                        " elements is over MPI's int count; use smaller batches or chunks");
  }
  return static_cast<int>(n);
}

// Gradient streams come back point to point, engine by engine, with this tag.
constexpr int kGradientTag = 17;

// Copies a strided view into a contiguous buffer, row after row.
void pack(ConstMatrixView m, float* out) {
  for (std::int64_t r = 0; r < m.rows; ++r) {
    std::memcpy(out + r * m.cols, m.row(r), static_cast<std::size_t>(m.cols) * sizeof(float));
  }
}
void unpack(const float* in, MutableMatrixView m) {
  for (std::int64_t r = 0; r < m.rows; ++r) {
    std::memcpy(m.row(r), in + r * m.cols, static_cast<std::size_t>(m.cols) * sizeof(float));
  }
}

using Worker = detail::EngineWorker;

MPI_Datatype packet_type() {
  static const MPI_Datatype type = [] {
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Type_contiguous(sizeof(Packet), MPI_BYTE, &t);
    MPI_Type_commit(&t);
    return t;
  }();
  return type;
}

MPI_Datatype chunks_type(const std::vector<const Packet*>& buffers,
                         const std::vector<std::size_t>& sizes) {
  std::vector<int> lengths;
  std::vector<MPI_Aint> addresses;
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    MPI_Aint address = 0;
    MPI_Get_address(buffers[i], &address);
    addresses.push_back(address);
    lengths.push_back(to_count(sizes[i], "a stream chunk"));
  }
  MPI_Datatype type = MPI_DATATYPE_NULL;
  mpi_check(MPI_Type_create_hindexed(static_cast<int>(buffers.size()), lengths.data(),
                                     addresses.data(), packet_type(), &type),
            "MPI_Type_create_hindexed");
  mpi_check(MPI_Type_commit(&type), "MPI_Type_commit");
  return type;
}

}  // namespace

[[noreturn]] void abort_all_ranks(const char* what) {
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "sluice[rank %d]: %s\n", rank, what);
  std::fflush(stderr);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

[[noreturn]] void abort_all_ranks(const std::exception& error) {
  abort_all_ranks(error.what());
}

struct MpiFabric::Impl {
  MpiFabricOptions options;
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 0;
  bool stopped = false;
  std::vector<std::unique_ptr<CpuEngine>> twins;  // rank 0: geometry and counters of each engine
  std::unique_ptr<CpuEngine> engine;              // engine ranks
  std::unique_ptr<Worker> worker;
  // Engine ranks: chunk buffers of earlier operations, reused (no fresh pages to fault in
  // and zero for every layer).
  std::vector<std::shared_ptr<StreamChunk>> pool;
  // Rank 0: one buffer of gradient values per engine, reused.
  std::vector<std::unique_ptr<Packet[]>> gradient_buffers;
  // Rank 0: the chunks of the gradient streams handed out, reused once released.
  std::vector<std::shared_ptr<StreamChunk>> result_pool;
  // Engine ranks: the gradient stream as one message, reused.
  std::unique_ptr<Packet[]> send_buffer;
  std::uint64_t send_capacity = 0;
  std::size_t gradient_capacity = 0;

  std::int32_t engines() const { return size - 1; }

  // --- rank 0 ---------------------------------------------------------------------

  void send_command(Op op, const StreamHeader& h, bool want_dx, const Frame& first) {
    Command c;
    c.op = static_cast<std::int32_t>(op);
    c.want_dx = want_dx ? 1 : 0;
    c.kind = static_cast<std::uint32_t>(h.kind);
    c.outputs = h.outputs;
    c.inputs = h.inputs;
    c.nnz = h.nnz;
    c.first = first.meta();
    mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, comm), "command broadcast");
  }

  void scatter_jobs(std::span<const Placement* const> placements,
                    std::span<const ConstMatrixView> xs, std::span<MutableMatrixView* const> dxs) {
    std::vector<Job> jobs(static_cast<std::size_t>(size));
    for (int k = 0; k < engines(); ++k) {
      Job& j = jobs[static_cast<std::size_t>(k) + 1];
      j.tokens = xs[static_cast<std::size_t>(k)].cols;
      j.lanes = placements[static_cast<std::size_t>(k)]->lanes;
      j.want_dx = !dxs.empty() && dxs[static_cast<std::size_t>(k)] != nullptr ? 1 : 0;
    }
    Job mine;
    mpi_check(
        MPI_Scatter(jobs.data(), sizeof(Job), MPI_BYTE, &mine, sizeof(Job), MPI_BYTE, 0, comm),
        "job scatter");
    // Placements: lane_of (one int per input feature), then lane_nnz (one per lane).
    std::vector<int> counts(static_cast<std::size_t>(size), 0), displs(counts.size(), 0);
    std::vector<std::int32_t> lane_of;
    std::vector<std::int64_t> lane_nnz;
    for (int k = 0; k < engines(); ++k) {
      const Placement& p = *placements[static_cast<std::size_t>(k)];
      counts[static_cast<std::size_t>(k) + 1] = to_count(p.lane_of.size(), "a placement");
      displs[static_cast<std::size_t>(k) + 1] = to_count(lane_of.size(), "the placements");
      lane_of.insert(lane_of.end(), p.lane_of.begin(), p.lane_of.end());
    }
    mpi_check(MPI_Scatterv(lane_of.data(), counts.data(), displs.data(), MPI_INT32_T, nullptr, 0,
                           MPI_INT32_T, 0, comm),
              "placement scatter");
    for (int k = 0; k < engines(); ++k) {
      const Placement& p = *placements[static_cast<std::size_t>(k)];
      counts[static_cast<std::size_t>(k) + 1] = to_count(p.lane_nnz.size(), "a placement");
      displs[static_cast<std::size_t>(k) + 1] = to_count(lane_nnz.size(), "the placements");
      lane_nnz.insert(lane_nnz.end(), p.lane_nnz.begin(), p.lane_nnz.end());
    }
    mpi_check(MPI_Scatterv(lane_nnz.data(), counts.data(), displs.data(), MPI_INT64_T, nullptr, 0,
                           MPI_INT64_T, 0, comm),
              "placement scatter");
  }

  // Each engine's token slice, packed, by one Scatterv.
  void scatter_matrices(std::span<const ConstMatrixView> ms) {
    std::vector<int> counts(static_cast<std::size_t>(size), 0), displs(counts.size(), 0);
    std::uint64_t total = 0;
    for (int k = 0; k < engines(); ++k) {
      const ConstMatrixView& m = ms[static_cast<std::size_t>(k)];
      const auto n = static_cast<std::uint64_t>(m.rows * m.cols);
      counts[static_cast<std::size_t>(k) + 1] = to_count(n, "a token slice");
      displs[static_cast<std::size_t>(k) + 1] = to_count(total, "a batch");
      total += n;
    }
    to_count(total, "a batch");
    std::vector<float> buffer(total);
    for (int k = 0; k < engines(); ++k) {
      pack(ms[static_cast<std::size_t>(k)],
           buffer.data() + displs[static_cast<std::size_t>(k) + 1]);
    }
    mpi_check(MPI_Scatterv(buffer.data(), counts.data(), displs.data(), MPI_FLOAT, nullptr, 0,
                           MPI_FLOAT, 0, comm),
              "batch scatter");
  }

  // The engines' results (Y or dX), gathered into the caller's views; a null view: none.
  void gather_matrices(const std::vector<MutableMatrixView*>& ms) {
    std::vector<int> counts(static_cast<std::size_t>(size), 0), displs(counts.size(), 0);
    std::uint64_t total = 0;
    for (int k = 0; k < engines(); ++k) {
      const MutableMatrixView* m = ms[static_cast<std::size_t>(k)];
      const auto n = m == nullptr ? 0 : static_cast<std::uint64_t>(m->rows * m->cols);
      counts[static_cast<std::size_t>(k) + 1] = to_count(n, "a token slice");
      displs[static_cast<std::size_t>(k) + 1] = to_count(total, "a batch");
      total += n;
    }
    to_count(total, "a batch");
    std::vector<float> buffer(total);
    mpi_check(MPI_Gatherv(nullptr, 0, MPI_FLOAT, buffer.data(), counts.data(), displs.data(),
                          MPI_FLOAT, 0, comm),
              "result gather");
    for (int k = 0; k < engines(); ++k) {
      if (MutableMatrixView* m = ms[static_cast<std::size_t>(k)]) {
        unpack(buffer.data() + displs[static_cast<std::size_t>(k) + 1], *m);
      }
    }
  }

  // Takes chunks for one frame: up to frame_bytes (at least one chunk), kMaxFrameChunks.
  Frame pull_frame(StreamSource& source) {
    Frame f;
    std::size_t bytes = 0;
    while (static_cast<std::int32_t>(f.chunks.size()) < kMaxFrameChunks &&
           (f.chunks.empty() || bytes < options.frame_bytes)) {
      ChunkPtr c = source.next();
      if (!c) break;
      to_count(c->packets.size() * sizeof(Packet), "a stream chunk's bytes");
      bytes += c->packets.size() * sizeof(Packet);
      f.chunks.push_back(std::move(c));
    }
    return f;
  }

  // Pipelined broadcast: frame i's bytes and frame i+1's sizes go out together, up to
  // `window` frames in flight. `kept` collects the chunks (backward checks the gradient
  // streams' tags against them and lays the sum out like them).
  void broadcast_stream(StreamSource& source, Frame first, std::vector<ChunkPtr>* kept) {
    struct InFlight {
      Frame frame;
      FrameMeta next;
      MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    };
    std::deque<std::unique_ptr<InFlight>> flight;
    auto retire = [&] {
      wait_all(2, flight.front()->requests, "stream broadcast");
      flight.pop_front();
    };
    Frame current = std::move(first);
    std::vector<const Packet*> buffers;
    std::vector<std::size_t> sizes;
    while (!current.chunks.empty()) {
      buffers.clear();
      sizes.clear();
      for (const ChunkPtr& c : current.chunks) {
        if (kept != nullptr) kept->push_back(c);
        buffers.push_back(c->packets.data());
        sizes.push_back(c->packets.size());
      }
      auto f = std::make_unique<InFlight>();
      Frame next = pull_frame(source);
      f->next = next.meta();
      MPI_Datatype type = chunks_type(buffers, sizes);
      // MPI_BOTTOM + absolute addresses: rank 0 only reads these buffers.
      const int rc = MPI_Ibcast(MPI_BOTTOM, 1, type, 0, comm, &f->requests[0]);
      MPI_Type_free(&type);  // freed when the broadcast is done with it
      mpi_check(rc, "stream broadcast");
      mpi_check(MPI_Ibcast(&f->next, sizeof(FrameMeta), MPI_BYTE, 0, comm, &f->requests[1]),
                "stream broadcast");
      f->frame = std::move(current);
      flight.push_back(std::move(f));
      while (flight.size() >= options.window) retire();
      current = std::move(next);
    }
    while (!flight.empty()) retire();
  }

  std::vector<Reply> gather_replies() {
    std::vector<Reply> replies(static_cast<std::size_t>(size));
    Reply mine;
    mpi_check(MPI_Gather(&mine, sizeof(Reply), MPI_BYTE, replies.data(), sizeof(Reply), MPI_BYTE, 0,
                         comm),
              "reply gather");
    for (int k = 0; k < engines(); ++k) {
      const Reply& r = replies[static_cast<std::size_t>(k) + 1];
      EngineCounters& c = twins[static_cast<std::size_t>(k)]->counters();
      c.busy_seconds += r.busy_seconds;
      c.intake_seconds += r.intake_seconds;
      c.packets += r.packets;
      c.bytes += r.bytes;
    }
    return replies;
  }

  // After the engines' replies: each engine's gradient packets (tags and values) into a
  // buffer of its own, kept from call to call; every tag checked against the stream rank 0
  // sent; the values summed in reduce_gradients' tree order; one stream laid out like the
  // chunks rank 0 sent.
  WeightStream collect_gradients(const std::vector<ChunkPtr>& sent) {
    const auto n = static_cast<std::size_t>(engines());
    const std::vector<Reply> replies = gather_replies();
    std::uint64_t packets = 0;
    for (const ChunkPtr& c : sent) packets += c->packets.size();
    for (std::size_t k = 0; k < n; ++k) {
      const Reply& a = replies[1];
      const Reply& b = replies[k + 1];
      if (b.grad_packets != packets) {
        throw FormatError("MpiFabric: engine " + std::to_string(k) + "'s gradient stream has " +
                          std::to_string(b.grad_packets) + " packets, the weight stream " +
                          std::to_string(packets));
      }
      if (a.grad_kind != b.grad_kind || a.grad_outputs != b.grad_outputs ||
          a.grad_inputs != b.grad_inputs || a.grad_nnz != b.grad_nnz) {
        throw FormatError("MpiFabric: engines 0 and " + std::to_string(k) +
                          " return gradient streams with different headers");
      }
    }
    if (gradient_capacity < packets) gradient_buffers.clear();
    while (gradient_buffers.size() < n) {
      gradient_buffers.emplace_back(new Packet[std::max<std::uint64_t>(packets, 1)]);
    }
    gradient_capacity = std::max(gradient_capacity, packets);
    std::vector<MPI_Request> requests(n, MPI_REQUEST_NULL);
    for (std::size_t k = 0; k < n; ++k) {
      mpi_check(MPI_Irecv(gradient_buffers[k].get(), to_count(packets, "a gradient stream"),
                          packet_type(), static_cast<int>(k) + 1, kGradientTag, comm, &requests[k]),
                "gradient receive");
    }
    wait_all(static_cast<int>(requests.size()), requests.data(), "gradient receive");
    for (std::size_t k = 0; k < n; ++k) {
      const Packet* mine = gradient_buffers[k].get();
      for (const ChunkPtr& c : sent) {
        for (const Packet& p : c->packets) {
          if (mine->tag != p.tag) {
            throw FormatError("MpiFabric: engine " + std::to_string(k) +
                              "'s gradient stream has tag " + std::to_string(mine->tag) +
                              " at packet " + std::to_string(mine - gradient_buffers[k].get()) +
                              " where the weight stream has " + std::to_string(p.tag));
          }
          ++mine;
        }
      }
    }
    // The sum in reduce_gradients' tree order (at distance d, i absorbs i + d; control
    // packets keep engine i's value): the same float additions as LocalFabric makes.
    for (std::size_t d = 1; d < n; d *= 2) {
      for (std::size_t i = 0; i + d < n; i += 2 * d) {
        Packet* a = gradient_buffers[i].get();
        const Packet* b = gradient_buffers[i + d].get();
        for (std::uint64_t j = 0; j < packets; ++j) {
          if (!is_control(a[j])) a[j].value += b[j].value;
        }
      }
    }
    WeightStream result;
    const Reply& r = replies[1];
    result.header.kind = static_cast<StreamKind>(r.grad_kind);
    result.header.outputs = r.grad_outputs;
    result.header.inputs = r.grad_inputs;
    result.header.nnz = r.grad_nnz;
    const Packet* at = gradient_buffers[0].get();
    std::size_t cursor = 0;  // in result_pool
    for (const ChunkPtr& c : sent) {
      // A chunk nobody else holds any more (ModelMemory is done with that gradient) is
      // reused: fresh pages cost more here than the copy itself.
      while (cursor < result_pool.size() && result_pool[cursor].use_count() > 1) ++cursor;
      if (cursor == result_pool.size()) result_pool.push_back(std::make_shared<StreamChunk>());
      std::shared_ptr<StreamChunk> chunk = result_pool[cursor++];
      chunk->first_output = c->first_output;
      chunk->outputs = c->outputs;
      chunk->packets.assign(at, at + c->packets.size());
      at += c->packets.size();
      result.chunks.push_back(std::move(chunk));
    }
    return result;
  }

  // --- engine ranks ---------------------------------------------------------------

  Job receive_job(std::uint32_t inputs, Placement& placement) {
    Job job;
    mpi_check(MPI_Scatter(nullptr, 0, MPI_BYTE, &job, sizeof(Job), MPI_BYTE, 0, comm),
              "job scatter");
    placement.lanes = job.lanes;
    placement.lane_of.resize(inputs);
    placement.lane_nnz.resize(static_cast<std::size_t>(job.lanes));
    mpi_check(MPI_Scatterv(nullptr, nullptr, nullptr, MPI_INT32_T, placement.lane_of.data(),
                           to_count(inputs, "a placement"), MPI_INT32_T, 0, comm),
              "placement scatter");
    mpi_check(MPI_Scatterv(nullptr, nullptr, nullptr, MPI_INT64_T, placement.lane_nnz.data(),
                           job.lanes, MPI_INT64_T, 0, comm),
              "placement scatter");
    return job;
  }

  DenseMatrix receive_matrix(std::int64_t rows, std::int64_t cols) {
    std::vector<float> buffer(static_cast<std::size_t>(rows * cols));
    mpi_check(MPI_Scatterv(nullptr, nullptr, nullptr, MPI_FLOAT, buffer.data(),
                           to_count(buffer.size(), "a token slice"), MPI_FLOAT, 0, comm),
              "batch scatter");
    DenseMatrix m(rows, cols);
    unpack(buffer.data(), m.view());
    return m;
  }

  void send_matrix(const DenseMatrix* m) {
    std::vector<float> buffer;
    if (m != nullptr) {
      buffer.resize(static_cast<std::size_t>(m->rows() * m->cols()));
      pack(m->view(), buffer.data());
    }
    mpi_check(MPI_Gatherv(buffer.data(), to_count(buffer.size(), "a token slice"), MPI_FLOAT,
                          nullptr, nullptr, nullptr, MPI_FLOAT, 0, comm),
              "result gather");
  }

  // Receives frame after frame; the next frame's broadcast is posted before this one's
  // chunks go to the engine, so the transfer goes on while the engine works.
  void receive_stream(const FrameMeta& first, StreamChannel& channel,
                      std::vector<std::shared_ptr<StreamChunk>>& used) {
    struct Posted {
      std::vector<std::shared_ptr<StreamChunk>> chunks;
      FrameMeta next;
      MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    };
    auto post = [&](const FrameMeta& meta) {
      auto p = std::make_unique<Posted>();
      std::vector<const Packet*> buffers;
      std::vector<std::size_t> sizes;
      for (std::int32_t i = 0; i < meta.chunks; ++i) {
        std::shared_ptr<StreamChunk> chunk;
        if (pool.empty()) {
          chunk = std::make_shared<StreamChunk>();
        } else {
          chunk = std::move(pool.back());
          pool.pop_back();
        }
        used.push_back(chunk);
        chunk->first_output = meta.chunk[i].first_output;
        chunk->outputs = meta.chunk[i].outputs;
        chunk->packets.resize(static_cast<std::size_t>(meta.chunk[i].packets));
        buffers.push_back(chunk->packets.data());
        sizes.push_back(chunk->packets.size());
        p->chunks.push_back(std::move(chunk));
      }
      MPI_Datatype type = chunks_type(buffers, sizes);
      const int rc = MPI_Ibcast(MPI_BOTTOM, 1, type, 0, comm, &p->requests[0]);
      MPI_Type_free(&type);
      mpi_check(rc, "stream broadcast");
      mpi_check(MPI_Ibcast(&p->next, sizeof(FrameMeta), MPI_BYTE, 0, comm, &p->requests[1]),
                "stream broadcast");
      return p;
    };
    if (first.chunks < 0 || first.chunks > kMaxFrameChunks) {
      throw FormatError("MpiFabric: a frame of " + std::to_string(first.chunks) + " chunks");
    }
    std::unique_ptr<Posted> current = first.chunks > 0 ? post(first) : nullptr;
    while (current) {
      wait_all(2, current->requests, "stream broadcast");
      const FrameMeta& next = current->next;
      if (next.chunks < 0 || next.chunks > kMaxFrameChunks) {
        throw FormatError("MpiFabric: a frame of " + std::to_string(next.chunks) + " chunks");
      }
      std::unique_ptr<Posted> following = next.chunks > 0 ? post(next) : nullptr;
      for (auto& c : current->chunks) channel.push(std::move(c));
      current = std::move(following);
    }
    channel.close();
  }

  void serve_one(const Command& cmd) {
    const bool backward = cmd.op == static_cast<std::int32_t>(Op::backward);
    const bool echo = cmd.op == static_cast<std::int32_t>(Op::probe_echo);
    const bool probe = echo || cmd.op == static_cast<std::int32_t>(Op::probe);
    const bool returns_gradient = backward || echo;
    Placement placement;
    Job job;
    DenseMatrix x, y, dy, dx;
    if (!probe) {
      job = receive_job(cmd.inputs, placement);
      x = receive_matrix(cmd.inputs, job.tokens);
    }
    if (probe) {
    } else if (backward) {
      dy = receive_matrix(cmd.outputs, job.tokens);
      if (job.want_dx) dx = DenseMatrix(cmd.inputs, job.tokens);
    } else {
      y = DenseMatrix(cmd.outputs, job.tokens);
    }
    StreamHeader header;
    header.kind = static_cast<StreamKind>(cmd.kind);
    header.outputs = cmd.outputs;
    header.inputs = cmd.inputs;
    header.nnz = cmd.nnz;
    StreamChannel channel(options.window * kMaxFrameChunks);
    const EngineCounters before = engine->counters();
    WeightStream gradient;
    std::exception_ptr error;
    std::future<void> done = worker->post([&] {
      ChannelStreamSource source(header, channel);
      try {
        if (probe) {  // no engine: the stream is taken in, and for echo handed back
          while (ChunkPtr c = source.next()) {
            if (echo) gradient.chunks.push_back(std::move(c));
          }
          gradient.header = header;
          gradient.header.kind = StreamKind::gradient;
        } else if (backward) {
          MutableMatrixView dx_view = dx.view();
          gradient = engine->backward(source, placement, x.view(), dy.view(),
                                      job.want_dx ? &dx_view : nullptr);
        } else {
          engine->forward(source, placement, x.view(), y.view());
        }
      } catch (...) {
        error = std::current_exception();
      }
      try {  // a failed engine drains its channel, so the receiving thread never blocks
        while (channel.pop() != nullptr) {
        }
      } catch (...) {
      }
    });
    std::vector<std::shared_ptr<StreamChunk>> used;
    receive_stream(cmd.first, channel, used);
    done.get();
    if (error) std::rethrow_exception(error);
    // The engine has let go of the chunks: their buffers serve the next operation.
    pool.insert(pool.end(), std::make_move_iterator(used.begin()),
                std::make_move_iterator(used.end()));

    if (probe) {
    } else if (!backward) {
      send_matrix(&y);
    } else if (cmd.want_dx) {
      send_matrix(job.want_dx ? &dx : nullptr);
    }
    Reply reply;
    const EngineCounters& after = engine->counters();
    reply.busy_seconds = after.busy_seconds - before.busy_seconds;
    reply.intake_seconds = after.intake_seconds - before.intake_seconds;
    reply.packets = after.packets - before.packets;
    reply.bytes = after.bytes - before.bytes;
    if (returns_gradient) {
      reply.grad_kind = static_cast<std::uint32_t>(gradient.header.kind);
      reply.grad_outputs = gradient.header.outputs;
      reply.grad_inputs = gradient.header.inputs;
      reply.grad_nnz = gradient.header.nnz;
      reply.grad_packets = gradient.packet_count();
    }
    mpi_check(MPI_Gather(&reply, sizeof(Reply), MPI_BYTE, nullptr, 0, MPI_BYTE, 0, comm),
              "reply gather");
    if (returns_gradient) {
      // One contiguous message (MPI moves that in a single copy on a node, which it does
      // not for a datatype spread over the chunks).
      const std::uint64_t packets = reply.grad_packets;
      if (send_capacity < packets) {
        send_buffer.reset(new Packet[packets]);
        send_capacity = packets;
      }
      Packet* at = send_buffer.get();
      for (const ChunkPtr& c : gradient.chunks) {
        at = std::copy(c->packets.begin(), c->packets.end(), at);
      }
      mpi_check(MPI_Send(send_buffer.get(), to_count(packets, "a gradient stream"), packet_type(),
                         0, kGradientTag, comm),
                "gradient send");
    }
  }
};

MpiFabric::MpiFabric(MpiFabricOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = std::move(options);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw ShapeError("MpiFabric: MPI is not initialised (call MPI_Init_thread)");
  if (m.options.window < 1) throw ShapeError("MpiFabric: window must be >= 1");
  mpi_check(MPI_Comm_rank(m.options.comm, &m.rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(m.options.comm, &m.size), "MPI_Comm_size");
  if (m.size < 2) {
    throw ShapeError(
        "MpiFabric: needs at least 2 ranks (rank 0 drives, the others are engines), "
        "got " +
        std::to_string(m.size));
  }
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  const int needed = m.rank == 0 ? MPI_THREAD_SERIALIZED : MPI_THREAD_FUNNELED;
  if (provided < needed) {
    throw ShapeError("MpiFabric: MPI was initialised without enough thread support (rank " +
                     std::to_string(m.rank) + " needs MPI_THREAD_" +
                     (m.rank == 0 ? "SERIALIZED" : "FUNNELED") +
                     "); use MPI_Init_thread with MPI_THREAD_MULTIPLE");
  }
  // A communicator of its own, so the fabric's collectives never match the caller's.
  mpi_check(MPI_Comm_dup(m.options.comm, &m.comm), "MPI_Comm_dup");

  const EngineOptions& eo = m.options.engine;
  WireEngine wire;
  wire.lanes = eo.geometry.lanes;
  wire.blocks = eo.geometry.blocks;
  wire.tile_tokens = eo.geometry.tile_tokens;
  wire.threads = eo.threads;
  wire.isa = eo.isa ? static_cast<std::int32_t>(*eo.isa) : -1;
  wire.pin = eo.pin_threads ? 1 : 0;
  wire.l2_bytes = eo.l2_bytes;
  mpi_check(MPI_Bcast(&wire, sizeof wire, MPI_BYTE, 0, m.comm), "options broadcast");
  MPI_Comm node = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split_type(m.comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int node_ranks = 1;
  MPI_Comm_size(node, &node_ranks);
  MPI_Comm_free(&node);

  auto options_from = [](const WireEngine& w) {
    EngineOptions o;
    o.geometry.lanes = w.lanes;
    o.geometry.blocks = w.blocks;
    o.geometry.tile_tokens = w.tile_tokens;
    o.threads = w.threads;
    if (w.isa >= 0) o.isa = static_cast<Isa>(w.isa);
    o.pin_threads = w.pin != 0;
    o.l2_bytes = w.l2_bytes;
    return o;
  };
  WireEngine resolved = wire;
  if (m.rank != 0) {
    if (resolved.threads <= 0) {
      const int cores = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
      resolved.threads = std::max(1, cores / node_ranks);
    }
    if (resolved.l2_bytes <= 0) resolved.l2_bytes = topology().l2_bytes;
    m.engine = std::make_unique<CpuEngine>(options_from(resolved));
    resolved.isa = static_cast<std::int32_t>(m.engine->isa());
    m.worker = std::make_unique<Worker>();
  }
  std::vector<WireEngine> all(static_cast<std::size_t>(m.rank == 0 ? m.size : 0));
  mpi_check(MPI_Gather(&resolved, sizeof resolved, MPI_BYTE, all.data(), sizeof resolved, MPI_BYTE,
                       0, m.comm),
            "engine gather");
  if (m.rank == 0) {
    // Twins: the same engine as on rank k + 1, for geometry_for (so placements match what
    // that engine would choose) and for its counters.
    for (int k = 1; k < m.size; ++k) {
      EngineOptions o = options_from(all[static_cast<std::size_t>(k)]);
      o.pin_threads = false;
      m.twins.push_back(std::make_unique<CpuEngine>(o));
    }
  }
}

MpiFabric::~MpiFabric() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (impl_->rank == 0) {
    try {
      stop();
    } catch (const std::exception& e) {
      abort_all_ranks(e);
    }
  }
  if (impl_->comm != MPI_COMM_NULL) MPI_Comm_free(&impl_->comm);
}

int MpiFabric::rank() const {
  return impl_->rank;
}

void MpiFabric::stop() {
  Impl& m = *impl_;
  if (m.rank != 0) throw ShapeError("MpiFabric::stop: only rank 0 stops the fabric");
  if (m.stopped) return;
  Command c;
  c.op = static_cast<std::int32_t>(Op::stop);
  mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
  m.stopped = true;
}

void MpiFabric::serve() {
  Impl& m = *impl_;
  if (m.rank == 0)
    throw ShapeError("MpiFabric::serve: rank 0 drives the fabric, it does not serve");
  try {
    while (true) {
      Command c;
      mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
      if (c.op == static_cast<std::int32_t>(Op::stop)) {
        m.stopped = true;
        return;
      }
      if (c.op < static_cast<std::int32_t>(Op::forward) ||
          c.op > static_cast<std::int32_t>(Op::probe_echo)) {
        throw FormatError("MpiFabric: unknown command " + std::to_string(c.op) + " from rank 0");
      }
      m.serve_one(c);
    }
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
}

std::int32_t MpiFabric::engine_count_impl() const {
  return impl_->engines();
}

Engine& MpiFabric::engine_impl(std::int32_t k) {
  Impl& m = *impl_;
  if (m.rank == 0) return *m.twins[static_cast<std::size_t>(k)];
  if (k != m.rank - 1) {
    throw ShapeError("MpiFabric: rank " + std::to_string(m.rank) + " holds engine " +
                     std::to_string(m.rank - 1) + " only, not engine " + std::to_string(k));
  }
  return *m.engine;
}

namespace {

void check_driver(int rank, bool stopped) {
  if (rank != 0) throw ShapeError("MpiFabric: only rank 0 drives the fabric");
  if (stopped) throw ShapeError("MpiFabric: the fabric was stopped");
}

void check_slice(const char* what, std::size_t k, std::int64_t rows, std::int64_t cols,
                 std::int64_t want_rows, std::int64_t want_cols) {
  if (rows != want_rows || cols != want_cols) {
    throw ShapeError(std::string("MpiFabric: ") + what + " of engine " + std::to_string(k) +
                     " is " + std::to_string(rows) + "x" + std::to_string(cols) + ", expected " +
                     std::to_string(want_rows) + "x" + std::to_string(want_cols));
  }
}

}  // namespace

void MpiFabric::forward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                             std::span<const ConstMatrixView> xs,
                             std::span<const MutableMatrixView> ys) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  const StreamHeader& h = weights.header();
  for (std::size_t k = 0; k < xs.size(); ++k) {
    check_slice("X", k, xs[k].rows, xs[k].cols, h.inputs, xs[k].cols);
    check_slice("Y", k, ys[k].rows, ys[k].cols, h.outputs, xs[k].cols);
    check_slice("placement", k, placements[k]->features(), 1, h.inputs, 1);
  }
  // From the command on, every rank is inside the operation: a failure here can only end
  // the job (the others would wait for the rest of the protocol forever).
  try {
    Frame first = m.pull_frame(weights);
    m.send_command(Op::forward, h, false, first);
    m.scatter_jobs(placements, xs, {});
    m.scatter_matrices(xs);
    m.broadcast_stream(weights, std::move(first), nullptr);
    std::vector<MutableMatrixView> outs(ys.begin(), ys.end());
    std::vector<MutableMatrixView*> targets;
    for (auto& y : outs) targets.push_back(&y);
    m.gather_matrices(targets);
    m.gather_replies();
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
}

ReducedGradient MpiFabric::backward_impl(StreamSource& weights,
                                         std::span<const Placement* const> placements,
                                         std::span<const ConstMatrixView> xs,
                                         std::span<const ConstMatrixView> dys,
                                         std::span<MutableMatrixView* const> dxs, bool with_bias) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  const StreamHeader& h = weights.header();
  bool want_dx = false;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    check_slice("X", k, xs[k].rows, xs[k].cols, h.inputs, xs[k].cols);
    check_slice("dY", k, dys[k].rows, dys[k].cols, h.outputs, xs[k].cols);
    check_slice("placement", k, placements[k]->features(), 1, h.inputs, 1);
    if (!dxs.empty() && dxs[k] != nullptr) {
      check_slice("dX", k, dxs[k]->rows, dxs[k]->cols, h.inputs, xs[k].cols);
      want_dx = true;
    }
  }
  const auto n = static_cast<std::size_t>(m.engines());
  ReducedGradient sum;
  try {
    Frame first = m.pull_frame(weights);
    m.send_command(Op::backward, h, want_dx, first);
    m.scatter_jobs(placements, xs, dxs);
    m.scatter_matrices(xs);
    m.scatter_matrices(dys);
    std::vector<ChunkPtr> sent;
    m.broadcast_stream(weights, std::move(first), &sent);
    if (want_dx) {
      std::vector<MutableMatrixView*> targets(n, nullptr);
      for (std::size_t k = 0; k < n; ++k) targets[k] = dxs[k];
      m.gather_matrices(targets);
    }
    sum.weights = m.collect_gradients(sent);
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
  // Row sums of dY exactly as LocalFabric computes them (rank 0 holds dY already), summed
  // in the same tree.
  if (with_bias) {
    std::vector<std::vector<float>> biases(n);
    for (std::size_t k = 0; k < n; ++k) biases[k] = bias_gradient(dys[k]);
    for (std::size_t d = 1; d < n; d *= 2) {
      for (std::size_t i = 0; i + d < n; i += 2 * d) {
        for (std::size_t o = 0; o < biases[i].size(); ++o) biases[i][o] += biases[i + d][o];
      }
    }
    sum.bias = std::move(biases.front());
  }
  return sum;
}

ReducedGradient MpiFabric::probe(StreamSource& stream, bool echo) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  ReducedGradient sum;
  try {
    Frame first = m.pull_frame(stream);
    m.send_command(echo ? Op::probe_echo : Op::probe, stream.header(), false, first);
    std::vector<ChunkPtr> sent;
    m.broadcast_stream(stream, std::move(first), echo ? &sent : nullptr);
    if (echo) {
      sum.weights = m.collect_gradients(sent);
    } else {
      m.gather_replies();
    }
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
  return sum;
}

}  // namespace sluice
