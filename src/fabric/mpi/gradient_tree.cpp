#include "fabric/mpi/gradient_tree.hpp"

#include <algorithm>
#include <cstdio>
#include <string>

#include "fabric/gradient_tree.hpp"
#include "sluice/error.hpp"

namespace sluice::mpi {
namespace {

// A summed gradient stream larger than this is written around the caches.
constexpr std::uint64_t kStreamingBytes = std::uint64_t{16} << 20;

std::uint64_t segments_of(std::uint64_t values) {
  return (values + kSegmentValues - 1) / kSegmentValues;
}

}  // namespace

GradientTree::GradientTree(Link& link, MPI_Comm pair)
    : link_(&link), pair_(pair), layout_(&detail::gradient_layout(default_isa())) {}

GradientTree::~GradientTree() = default;

// Ranks 0 and 1 together: a shared window of at least `needed` floats (the stream's
// packets, which bound its values), made when the gradients outgrow it (both see the same
// counts). Whether it worked is agreed; if not, the fabric keeps to messages.
void GradientTree::ensure_window(std::uint64_t needed) {
  if (pair_ == MPI_COMM_NULL || window_failed_) return;
  if (window_ != MPI_WIN_NULL && needed <= window_capacity_) return;
  free_window();
  const std::uint64_t capacity = std::max(needed, kSegmentValues);
  const bool owner = link_->rank() == 0;
  const MPI_Aint bytes = owner ? static_cast<MPI_Aint>(capacity * sizeof(float)) : 0;
  void* base = nullptr;
  int ok = MPI_Win_allocate_shared(bytes, sizeof(float), MPI_INFO_NULL, pair_, &base, &window_) ==
           MPI_SUCCESS;
  if (ok && !owner) {
    MPI_Aint size = 0;
    int unit = 0;
    ok = MPI_Win_shared_query(window_, 0, &size, &unit, &base) == MPI_SUCCESS &&
         static_cast<std::uint64_t>(size) >= capacity * sizeof(float);
  }
  link_->allreduce_min(ok, pair_, "window check");
  if (!ok) {
    if (window_ != MPI_WIN_NULL) MPI_Win_free(&window_);
    window_ = MPI_WIN_NULL;
    window_failed_ = true;
    return;
  }
  window_values_ = static_cast<float*>(base);
  window_capacity_ = capacity;
}

void GradientTree::free_window() {
  if (window_ != MPI_WIN_NULL) mpi_check(MPI_Win_free(&window_), "MPI_Win_free");
  window_ = MPI_WIN_NULL;
  window_values_ = nullptr;
  window_capacity_ = 0;
}

// Values are packed from the chunks and sent segment by segment, so packing, adding and
// sending overlap along the tree.
std::uint32_t GradientTree::send(const WeightStream& gradient) {
  const auto k = static_cast<std::size_t>(link_->rank() - 1);
  const std::vector<std::size_t> children =
      detail::tree_children(k, static_cast<std::size_t>(link_->engines()));
  const int parent = k == 0 ? 0 : static_cast<int>(detail::tree_parent(k)) + 1;
  const std::uint64_t total = gradient.header.nnz;
  const std::uint64_t segments = segments_of(total);
  // Room for every packet: a stream with more weights than its header says is caught
  // below, after packing, not by writing past the buffer. Engine 0 packs straight into
  // rank 0's window if there is one.
  ensure_window(gradient.packet_count());
  const bool shared = k == 0 && window_ != MPI_WIN_NULL;
  float* mine = shared ? window_values_ : nullptr;
  if (!shared) {
    values_.resize(std::max(total, gradient.packet_count()));
    mine = values_.data();
  }
  if (child_values_.size() < children.size()) child_values_.resize(children.size());
  const MPI_Comm comm = link_->comm();
  std::vector<MPI_Request> receives(children.size() * segments, MPI_REQUEST_NULL);
  for (std::size_t c = 0; c < children.size(); ++c) {
    child_values_[c].resize(total);
    for (std::uint64_t s = 0; s < segments; ++s) {
      const std::uint64_t offset = s * kSegmentValues;
      const auto count = static_cast<int>(std::min(kSegmentValues, total - offset));
      mpi_check(MPI_Irecv(child_values_[c].data() + offset, count, MPI_FLOAT,
                          static_cast<int>(children[c]) + 1, kGradientTag, comm,
                          &receives[c * segments + s]),
                "gradient receive");
    }
  }
  if (shared) mpi_check(MPI_Win_lock_all(MPI_MODE_NOCHECK, window_), "MPI_Win_lock_all");
  std::vector<MPI_Request> sends(segments, MPI_REQUEST_NULL);
  auto finish_segment = [&](std::uint64_t s) {
    const std::uint64_t offset = s * kSegmentValues;
    const std::uint64_t count = std::min(kSegmentValues, total - offset);
    float* sum = mine + offset;
    for (std::size_t c = 0; c < children.size(); ++c) {
      link_->wait(receives[c * segments + s], "gradient receive");
      const float* theirs = child_values_[c].data() + offset;
      for (std::uint64_t j = 0; j < count; ++j) sum[j] += theirs[j];
    }
    if (shared) {  // the sum is in rank 0's memory: make it visible, then say so
      mpi_check(MPI_Win_sync(window_), "MPI_Win_sync");
      mpi_check(MPI_Isend(nullptr, 0, MPI_BYTE, 0, kGradientTag, comm, &sends[s]), "gradient send");
    } else {
      mpi_check(
          MPI_Isend(sum, static_cast<int>(count), MPI_FLOAT, parent, kGradientTag, comm, &sends[s]),
          "gradient send");
    }
  };
  TagChecksum tags;
  std::uint64_t packed = 0, next_segment = 0;
  for (const ChunkPtr& c : gradient.chunks) {
    packed += tags.add(*c, gradient.header.precision, mine + packed);
    while (next_segment < segments &&
           std::min(total, (next_segment + 1) * kSegmentValues) <= packed) {
      finish_segment(next_segment++);
    }
  }
  if (packed != total) {
    throw FormatError("MpiFabric: engine " + std::to_string(k) + "'s gradient stream has " +
                      std::to_string(packed) + " weight packets, its header says " +
                      std::to_string(total));
  }
  if (shared) mpi_check(MPI_Win_unlock_all(window_), "MPI_Win_unlock_all");
  link_->wait_all(static_cast<int>(sends.size()), sends.data(), "gradient send");
  return tags.checksum();
}

void GradientTree::check_replies(const SentStream& sent, const std::vector<Reply>& replies) const {
  const Reply& a = replies[1];
  for (std::size_t k = 0; k + 1 < replies.size(); ++k) {
    const Reply& b = replies[k + 1];
    if (b.grad_packets != sent.packets || b.grad_values != sent.values) {
      throw FormatError("MpiFabric: engine " + std::to_string(k) + " (rank " +
                        std::to_string(k + 1) + ")'s gradient stream has " +
                        std::to_string(b.grad_packets) + " packets, " +
                        std::to_string(b.grad_values) + " of them weights; the weight stream " +
                        std::to_string(sent.packets) + " and " + std::to_string(sent.values));
    }
    if (a.grad_kind != b.grad_kind || a.grad_outputs != b.grad_outputs ||
        a.grad_inputs != b.grad_inputs || a.grad_nnz != b.grad_nnz ||
        a.grad_order != b.grad_order) {
      throw FormatError("MpiFabric: engines 0 and " + std::to_string(k) +
                        " return gradient streams with different headers");
    }
  }
}

void GradientTree::check_checksums(const SentStream& sent) {
  std::vector<std::uint32_t> checksums(static_cast<std::size_t>(link_->size()));
  const std::uint32_t none = 0;
  link_->gather(&none, 1, MPI_UINT32_T, checksums.data(), "checksum gather");
  const std::uint32_t expected = sent.tags.checksum();
  for (std::size_t k = 0; k + 1 < checksums.size(); ++k) {
    if (checksums[k + 1] != expected) {
      char text[256];
      std::snprintf(text, sizeof text,
                    "MpiFabric: engine %zu (rank %zu) returned a gradient stream whose tags or "
                    "control packets differ from the weight stream's (tag checksum %08x, "
                    "expected %08x)",
                    k, k + 1, checksums[k + 1], expected);
      throw FormatError(text);
    }
  }
}

// The sum comes from engine 0 segment by segment; each chunk of the result is laid out as
// soon as its values are in: the tags and control packets of the chunk rank 0 sent, the
// summed values.
WeightStream GradientTree::collect(const SentStream& sent, const std::vector<Reply>& replies) {
  check_replies(sent, replies);
  const double start = MPI_Wtime();  // every engine has its gradient stream
  const std::uint64_t total = sent.values;
  const std::uint64_t segments = segments_of(total);
  ensure_window(sent.packets);
  // With the window, a segment's message is empty: it says engine 0 has written that
  // segment's sum into it. Without, it carries the values.
  const float* sums = window_values_;
  if (window_ == MPI_WIN_NULL) {
    values_.resize(total);
    sums = values_.data();
  } else {
    mpi_check(MPI_Win_lock_all(MPI_MODE_NOCHECK, window_), "MPI_Win_lock_all");
  }
  std::vector<MPI_Request> requests(segments, MPI_REQUEST_NULL);
  for (std::uint64_t s = 0; s < segments; ++s) {
    const std::uint64_t offset = s * kSegmentValues;
    const auto count = static_cast<int>(std::min(kSegmentValues, total - offset));
    const int rc = window_ != MPI_WIN_NULL ? MPI_Irecv(nullptr, 0, MPI_BYTE, 1, kGradientTag,
                                                       link_->comm(), &requests[s])
                                           : MPI_Irecv(values_.data() + offset, count, MPI_FLOAT, 1,
                                                       kGradientTag, link_->comm(), &requests[s]);
    mpi_check(rc, "gradient receive");
  }
  WeightStream result;
  const Reply& r = replies[1];
  result.header.kind = static_cast<StreamKind>(r.grad_kind);
  result.header.outputs = r.grad_outputs;
  result.header.inputs = r.grad_inputs;
  result.header.nnz = r.grad_nnz;
  result.header.precision = Precision::fp32;  // gradients always travel in fp32
  result.header.order = static_cast<StreamOrder>(r.grad_order);
  std::uint64_t at = 0, arrived = 0, next_segment = 0;
  const bool streaming = sent.packets * sizeof(Packet) > kStreamingBytes;
  for (std::size_t i = 0; i < sent.chunks.size(); ++i) {
    const StreamChunk& c = *sent.chunks[i];
    const std::uint64_t need = at + sent.chunk_values[i];
    while (arrived < need) {
      link_->wait(requests[next_segment], "gradient receive");
      if (window_ != MPI_WIN_NULL) mpi_check(MPI_Win_sync(window_), "MPI_Win_sync");
      arrived = std::min(total, ++next_segment * kSegmentValues);
    }
    // A chunk of an earlier gradient that ModelMemory is done with: fresh pages cost
    // more here than the copy itself.
    std::shared_ptr<StreamChunk> chunk = result_pool_->take(sent.chunks.size());
    chunk->first_output = c.first_output;
    chunk->outputs = c.outputs;
    chunk->packets.resize(c.size());
    if (sent.precision == Precision::bf16) {
      layout_->bf16(c.packets_bf16.data(), c.size(), sums + at, chunk->packets.data(), streaming);
    } else {
      layout_->fp32(c.packets.data(), c.size(), sums + at, chunk->packets.data(), streaming);
    }
    at = need;
    result.chunks.push_back(std::move(chunk));
  }
  link_->wait_all(static_cast<int>(requests.size()), requests.data(), "gradient receive");
  if (window_ != MPI_WIN_NULL) mpi_check(MPI_Win_unlock_all(window_), "MPI_Win_unlock_all");
  check_checksums(sent);
  last_seconds_ = MPI_Wtime() - start;
  return result;
}

}  // namespace sluice::mpi
