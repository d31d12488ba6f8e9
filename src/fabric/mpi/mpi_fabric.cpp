// MpiFabric: the fabric across processes. Rank 0 drives (executor, ModelMemory); every
// other rank serves one CpuEngine. See include/sluice/mpi_fabric.hpp for the protocol.
#include "sluice/mpi_fabric.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#if defined(__linux__)
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <random>
#define SLUICE_MPI_DIRECT_READ 1
#endif

#include "engine/engine_worker.hpp"
#include "engine/kernels/gradient_layout.hpp"
#include "fabric/gradient_tree.hpp"
#include "sluice/error.hpp"
#include "sluice/topology.hpp"
#include "stream/chunk_pool.hpp"

namespace sluice {
namespace {

enum class Op : std::int32_t {
  forward = 1,
  backward = 2,
  stop = 3,
  probe = 4,
  probe_echo = 5,
  // Layer operations on the engines' activation stores.
  load_batch = 6,
  forward_layer = 7,
  loss = 8,
  backward_layer = 9,
  gather_output = 10,
  layer_activations = 11,
  load_samples = 12,
};

struct ChunkMeta {
  std::int64_t packets = 0;
  std::uint32_t first_output = 0;
  std::uint32_t outputs = 0;
  std::uint64_t address = 0;  ///< of the packets in rank 0's memory, for direct reads
};

const void* packet_data(const StreamChunk& c, Precision precision);

// Chunks travel in frames: one Ibcast moves several chunks (an hindexed datatype over
// their packet buffers, no copy), so small chunks do not pay MPI's per-message cost.
constexpr std::int32_t kMaxFrameChunks = 64;
// Frames start at this many bytes and double up to MpiFabricOptions::frame_bytes, so
// that the engines start on the first chunks sooner.
constexpr std::size_t kFirstFrameBytes = std::size_t{256} << 10;

/// What the receivers need to post a frame's broadcast; chunks 0: the stream has ended.
struct FrameMeta {
  std::int32_t chunks = 0;
  std::int32_t unused = 0;
  ChunkMeta chunk[kMaxFrameChunks];
};

/// A frame's chunks: pointers for rank 0, buffers being filled on the engine ranks.
struct Frame {
  std::vector<ChunkPtr> chunks;
  std::size_t budget = 0;  ///< the bytes it was pulled to (the last chunk may go past)
  FrameMeta meta(Precision precision) const {
    FrameMeta m;
    m.chunks = static_cast<std::int32_t>(chunks.size());
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      m.chunk[i] = {static_cast<std::int64_t>(chunks[i]->size()), chunks[i]->first_output,
                    chunks[i]->outputs,
                    reinterpret_cast<std::uintptr_t>(packet_data(*chunks[i], precision))};
    }
    return m;
  }
};

/// Engine ranks: received frames on their way from the receiving (main) thread to the
/// engine's thread. A frame is handed over whole, one lock and at most one wake-up per
/// frame: a wake-up per chunk costs two context switches on the core that also drives the
/// transfer, which stalls (Open MPI's shared-memory transport copies on both sides, so the
/// receiver must keep polling) for ~10% of a broadcast. `push` blocks while `capacity`
/// chunks wait.
class FrameChannel {
 public:
  explicit FrameChannel(std::size_t capacity) : capacity_(std::max<std::size_t>(1, capacity)) {}

  void push(std::vector<ChunkPtr> frame) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return waiting_ < capacity_; });
    waiting_ += frame.size();
    frames_.push_back(std::move(frame));
    changed_.notify_all();
  }
  void close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
    changed_.notify_all();
  }
  /// The next frame; empty once closed and drained.
  std::vector<ChunkPtr> pop() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return !frames_.empty() || closed_; });
    if (frames_.empty()) return {};
    std::vector<ChunkPtr> frame = std::move(frames_.front());
    frames_.pop_front();
    waiting_ -= frame.size();
    changed_.notify_all();
    return frame;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::vector<ChunkPtr>> frames_;
  std::size_t waiting_ = 0, capacity_;
  bool closed_ = false;
};

/// The engine's view of a FrameChannel: chunk by chunk.
class FrameStreamSource final : public StreamSource {
 public:
  FrameStreamSource(StreamHeader header, FrameChannel& channel)
      : header_(header), channel_(&channel) {}
  const StreamHeader& header() const override { return header_; }
  ChunkPtr next() override {
    if (at_ == frame_.size()) {
      frame_ = channel_->pop();
      at_ = 0;
      if (frame_.empty()) return nullptr;
    }
    return std::move(frame_[at_++]);  // the engine alone decides how long a chunk lives
  }

 private:
  StreamHeader header_;
  FrameChannel* channel_;
  std::vector<ChunkPtr> frame_;
  std::size_t at_ = 0;
};

// One datatype over a frame's packet buffers (of the stream's precision), with absolute
// addresses (used with MPI_BOTTOM).
MPI_Datatype chunks_type(Precision precision, const std::vector<const void*>& buffers,
                         const std::vector<std::size_t>& sizes);

/// Broadcast from rank 0 at the start of every operation.
struct Command {
  std::int32_t op = 0;
  std::int32_t want_dx = 0;  ///< any engine wants dX (then dX is gathered)
  std::uint32_t kind = 0, outputs = 0, inputs = 0;
  std::uint32_t precision = 0;  ///< the weight stream's: which packets its frames carry
  std::uint32_t order = 0;      ///< by output or by input: which of outputs/inputs is X's
  std::uint32_t unused = 0;
  std::uint64_t nnz = 0;
  // Layer operations: the layer, flags (see kFlag...), the batch's tokens.
  std::int32_t layer = 0;
  std::int32_t flags = 0;
  std::int64_t total_tokens = 0;
  FrameMeta first;  ///< the stream's first frame
};
// Command::flags of the layer operations.
constexpr std::int32_t kFlagLabels = 1;    // load_batch: labels follow
constexpr std::int32_t kFlagTargets = 2;   // load_batch: targets follow
constexpr std::int32_t kFlagTraining = 4;  // load_batch: a training pass
constexpr std::int32_t kFlagBias = 8;      // forward_layer: a bias follows; backward: wanted
constexpr std::int32_t kFlagDelta = 16;    // loss: the delta is wanted

/// An engine's LossSums on the wire.
struct WireLoss {
  double loss = 0;
  std::int64_t correct = 0, tokens = 0, non_finite = 0;
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
  double arrival_seconds = 0, overlapped_seconds = 0;
  std::uint64_t packets = 0, bytes = 0;
  std::uint64_t grad_packets = 0;
  std::uint64_t grad_values = 0;  ///< weight packets in the gradient stream: values sent
  std::uint32_t grad_kind = 0, grad_outputs = 0, grad_inputs = 0, grad_order = 0;
  std::uint64_t grad_nnz = 0;
};

/// Engine options as rank 0 sends them, and what each engine rank resolved.
struct WireEngine {
  std::int32_t lanes = 0, blocks = 0, tile_tokens = 0, threads = 0;
  std::int32_t isa = -1, pin = 0, shares = 0, unused = 0;
  std::int64_t tile_cache_bytes = 0;
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

// Gradient values travel up the engines' reduction tree, and to rank 0, with this tag.
constexpr int kGradientTag = 17;
// With direct reads, each engine tells rank 0 it has read a frame with this tag.
constexpr int kFrameReadTag = 18;

/// What rank 0 tells the engine ranks at the start, to decide on direct reads: its process,
/// and a word of its memory they must read back.
struct DirectProbe {
  std::int32_t wanted = 0;  ///< shared_memory and every rank on rank 0's node
  std::int32_t unused = 0;
  std::int64_t pid = 0;
  std::uint64_t address = 0;
  std::uint64_t expected[2] = {0, 0};
};

#ifdef SLUICE_MPI_DIRECT_READ
// Copies rank 0's buffers (`remote`, in process `pid`) into ours, by one system call (a
// single copy, the one Open MPI's shared-memory transport makes for a contiguous message;
// a frame of several chunk buffers would go through its bounce buffers instead, two
// copies and a handshake every 32 KB). False if the OS refuses (errno says why).
bool read_remote(std::int64_t pid, std::vector<iovec>& local, std::vector<iovec>& remote,
                 std::size_t bytes) {
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = process_vm_readv(static_cast<pid_t>(pid), local.data(), local.size(),
                                       remote.data(), remote.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<std::size_t>(n);
    // A partial read (the kernel stops at a page it cannot take): skip what was read.
    auto advance = [](std::vector<iovec>& v, std::size_t k) {
      std::size_t i = 0;
      for (; i < v.size() && k >= v[i].iov_len; ++i) k -= v[i].iov_len;
      v.erase(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i));
      if (!v.empty()) {
        v.front().iov_base = static_cast<char*>(v.front().iov_base) + k;
        v.front().iov_len -= k;
      }
    };
    advance(local, static_cast<std::size_t>(n));
    advance(remote, static_cast<std::size_t>(n));
  }
  return true;
}
#endif

// Gradient values travel in segments of this many floats: the reduction tree and rank 0's
// unpacking work on one segment while the next is in transfer.
constexpr std::uint64_t kSegmentValues = std::uint64_t{1} << 18;

// A summed gradient stream larger than this is written around the caches.
constexpr std::uint64_t kStreamingBytes = std::uint64_t{16} << 20;

// --- the tag checksum ------------------------------------------------------------------
// Rank 0 knows every tag and control packet of a gradient stream (they are the weight
// stream's), so only values travel; each engine's checksum of its stream's tags proves it
// returned them in the order rank 0 expects. The checksum is CRC-32C, in four lanes: the
// tags in order, two to a 64-bit word (the first in the low half), word j into lane
// j mod 4, an odd last tag alone into the next lane; then the CRC-32C of the word count
// and the four lanes. x86-64 has an instruction for CRC-32C (three cycles' latency, one
// per cycle throughput, hence the lanes); the table CRC-32 of crc32.hpp runs at ~2 GB/s
// here, as long as the whole transfer. Other CPUs compute the same values by table.

constexpr std::uint32_t kCrc32cPolynomial = 0x82F6'3B78U;  // Castagnoli, reflected

constexpr std::array<std::uint32_t, 256> make_crc32c_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1U) != 0 ? kCrc32cPolynomial ^ (c >> 1) : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<std::uint32_t, 256> kCrc32cTable = make_crc32c_table();

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SLUICE_MPI_HW_CRC 1
#endif

// One CRC-32C step over the 8 bytes of `word` (little-endian), without pre- or
// post-inversion, as the crc32 instruction computes it.
template <bool kHardware>
inline std::uint32_t crc32c_word(std::uint32_t crc, std::uint64_t word) {
#ifdef SLUICE_MPI_HW_CRC
  if constexpr (kHardware) {
    std::uint64_t c = crc;
    asm("crc32q %1, %0" : "+r"(c) : "rm"(word));  // SSE4.2; callers check the CPU has it
    return static_cast<std::uint32_t>(c);
  }
#endif
  for (int b = 0; b < 8; ++b, word >>= 8) crc = (crc >> 8) ^ kCrc32cTable[(crc ^ word) & 0xFFU];
  return crc;
}

inline std::uint32_t crc32c_tag(std::uint32_t crc, std::uint32_t tag) {
  for (int b = 0; b < 4; ++b, tag >>= 8) crc = (crc >> 8) ^ kCrc32cTable[(crc ^ tag) & 0xFFU];
  return crc;
}

/// The tags of a stream, chunk by chunk (chunk boundaries do not matter), into the
/// checksum above; optionally the weight packets' values out, as fp32, in one pass.
class TagScanner {
 public:
  /// The chunk's packets of the stream's precision; returns its number of weight packets.
  std::uint64_t add(const StreamChunk& chunk, Precision precision, float* values = nullptr) {
#ifdef SLUICE_MPI_HW_CRC
    static const bool hardware = __builtin_cpu_supports("sse4.2");
#else
    constexpr bool hardware = false;
#endif
    if (precision == Precision::bf16) {
      return hardware ? scan<true>(chunk.packets_bf16, values)
                      : scan<false>(chunk.packets_bf16, values);
    }
    return hardware ? scan<true>(chunk.packets, values) : scan<false>(chunk.packets, values);
  }

  std::uint32_t checksum() const {
    std::uint32_t lanes[4] = {lane_[0], lane_[1], lane_[2], lane_[3]};
    if (pending_) lanes[words_ % 4] = crc32c_tag(lanes[words_ % 4], pending_tag_);
    std::uint32_t c = crc32c_word<false>(~0U, words_ * 2 + (pending_ ? 1 : 0));
    c = crc32c_word<false>(c, lanes[0] | (std::uint64_t{lanes[1]} << 32));
    c = crc32c_word<false>(c, lanes[2] | (std::uint64_t{lanes[3]} << 32));
    return ~c;
  }

 private:
  template <bool kHardware, typename P>
  std::uint64_t scan(const std::vector<P, ChunkAllocator<P>>& packets, float* values) {
    const P* p = packets.data();
    const std::size_t n = packets.size();
    std::uint64_t written = 0;
    auto value = [&](const P& q) {
      if (!is_control(q)) {
        if (values != nullptr) values[written] = value_of(q);
        ++written;
      }
    };
    auto word = [&](std::size_t i) {
      return tag_of(p[i]) | (std::uint64_t{tag_of(p[i + 1])} << 32);
    };
    auto one_word = [&](std::size_t i) {
      lane_[words_ % 4] = crc32c_word<kHardware>(lane_[words_ % 4], word(i));
      ++words_;
      value(p[i]);
      value(p[i + 1]);
    };
    std::size_t i = 0;
    if (pending_ && n > 0) {  // the odd tag of the previous chunk and this chunk's first
      lane_[words_ % 4] = crc32c_word<kHardware>(
          lane_[words_ % 4], pending_tag_ | (std::uint64_t{tag_of(p[0])} << 32));
      ++words_;
      value(p[0]);
      pending_ = false;
      i = 1;
    }
    for (; i + 2 <= n && words_ % 4 != 0; i += 2) one_word(i);
    std::uint32_t c0 = lane_[0], c1 = lane_[1], c2 = lane_[2], c3 = lane_[3];
    for (; i + 8 <= n; i += 8) {
      c0 = crc32c_word<kHardware>(c0, word(i));
      c1 = crc32c_word<kHardware>(c1, word(i + 2));
      c2 = crc32c_word<kHardware>(c2, word(i + 4));
      c3 = crc32c_word<kHardware>(c3, word(i + 6));
      for (std::size_t k = 0; k < 8; ++k) value(p[i + k]);
      words_ += 4;
    }
    lane_[0] = c0, lane_[1] = c1, lane_[2] = c2, lane_[3] = c3;
    for (; i + 2 <= n; i += 2) one_word(i);
    if (i < n) {
      pending_ = true;
      pending_tag_ = tag_of(p[i]);
      value(p[i]);
    }
    return written;
  }

  std::uint32_t lane_[4] = {~0U, ~0U, ~0U, ~0U};
  std::uint64_t words_ = 0;  ///< 64-bit words folded into the lanes so far
  bool pending_ = false;     ///< an odd tag waits for the next chunk's first
  std::uint32_t pending_tag_ = 0;
};

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

template <typename P>
MPI_Datatype packet_type() {
  static const MPI_Datatype type = [] {
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Type_contiguous(sizeof(P), MPI_BYTE, &t);
    MPI_Type_commit(&t);
    return t;
  }();
  return type;
}

// A chunk's packet buffer of the stream's precision; the other one must be empty.
const void* packet_data(const StreamChunk& c, Precision precision) {
  const bool bf16 = precision == Precision::bf16;
  if (bf16 ? !c.packets.empty() : !c.packets_bf16.empty()) {
    throw FormatError(std::string("MpiFabric: a chunk of an ") + to_string(precision) +
                      " stream (outputs from " + std::to_string(c.first_output) +
                      ") carries packets of the other precision");
  }
  return bf16 ? static_cast<const void*>(c.packets_bf16.data())
              : static_cast<const void*>(c.packets.data());
}

MPI_Datatype chunks_type(Precision precision, const std::vector<const void*>& buffers,
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
  mpi_check(
      MPI_Type_create_hindexed(
          static_cast<int>(buffers.size()), lengths.data(), addresses.data(),
          precision == Precision::bf16 ? packet_type<Bf16Packet>() : packet_type<Packet>(), &type),
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

namespace {

/// Rank 0: the stream it broadcast, kept for the gradient streams that come back in its
/// order: their tags are checked against it and the sum is laid out like it.
struct SentStream {
  std::vector<ChunkPtr> chunks;
  std::vector<std::uint64_t> chunk_values;  ///< weight packets in each chunk
  Precision precision = Precision::fp32;
  std::uint64_t packets = 0, values = 0;
  TagScanner tags;
};

}  // namespace

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
  // Rank 0: the chunks of the gradient streams handed out, reused once released.
  std::shared_ptr<detail::ChunkPool> result_pool = std::make_shared<detail::ChunkPool>();
  // Gradient values: rank 0's sum as it arrives; an engine's own values, to which it adds
  // its children's in the reduction tree (one buffer per child). Reused from call to call.
  std::vector<float> values;
  std::vector<std::vector<float>> child_values;
  // When engine 0 shares a node with rank 0, the last hop of the gradient sum is shared
  // memory: a window of rank 0's on `pair` (ranks 0 and 1) into which engine 0 packs and
  // sums its values directly, so rank 0 lays out values no one copied. Otherwise (other
  // node, or the MPI cannot make the window) that hop is a send like the others.
  MPI_Comm pair = MPI_COMM_NULL;
  MPI_Win window = MPI_WIN_NULL;
  float* window_values = nullptr;  // rank 0's memory, on ranks 0 and 1
  std::uint64_t window_capacity = 0;
  bool window_failed = false;
  double last_gradient_seconds = 0;  // rank 0
  // Rank 0: what the protocol itself moved (commands, placements, replies) in the current
  // layer operation, for the fabric's counters.
  std::uint64_t bytes_sent = 0, bytes_received = 0;
  // Rank 0: each engine's tokens and the outputs of the batch the engines hold.
  std::vector<std::int64_t> shard_tokens;
  std::vector<std::int64_t> sizes;  // of the model the engines hold a batch for
  std::int64_t outputs = 0;
  // Rank 0: activations gathered for with_layer_activations, until the next call.
  std::vector<DenseMatrix> lent;
  // Engine ranks: the data set attached before serve(), for load_samples.
  const Dataset* dataset = nullptr;
  // Every rank on rank 0's node (and shared_memory): engines read the stream's frames
  // straight from rank 0's memory (read_remote) instead of receiving a broadcast.
  bool direct = false;
  std::int64_t driver_pid = 0;  // engine ranks, for direct reads
  // Rank 0: how each chunk of a summed gradient is laid out (this CPU's best way).
  const detail::GradientLayout& layout = detail::gradient_layout(default_isa());

  std::int32_t engines() const { return size - 1; }

  // Ranks 0 and 1 together: a shared window of at least `needed` floats (the stream's
  // packets, which bound its values), made when the gradients outgrow it (both see the
  // same counts). Whether it worked is agreed; if not, the fabric keeps to sends.
  void ensure_window(std::uint64_t needed) {
    if (pair == MPI_COMM_NULL || window_failed) return;
    if (window != MPI_WIN_NULL && needed <= window_capacity) return;
    free_window();
    const std::uint64_t capacity = std::max(needed, kSegmentValues);
    const MPI_Aint bytes = rank == 0 ? static_cast<MPI_Aint>(capacity * sizeof(float)) : 0;
    void* base = nullptr;
    int ok = MPI_Win_allocate_shared(bytes, sizeof(float), MPI_INFO_NULL, pair, &base, &window) ==
             MPI_SUCCESS;
    if (ok && rank != 0) {
      MPI_Aint size = 0;
      int unit = 0;
      ok = MPI_Win_shared_query(window, 0, &size, &unit, &base) == MPI_SUCCESS &&
           static_cast<std::uint64_t>(size) >= capacity * sizeof(float);
    }
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, pair), "window check");
    if (!ok) {
      if (window != MPI_WIN_NULL) MPI_Win_free(&window);
      window = MPI_WIN_NULL;
      window_failed = true;
      return;
    }
    window_values = static_cast<float*>(base);
    window_capacity = capacity;
  }

  void free_window() {
    if (window != MPI_WIN_NULL) mpi_check(MPI_Win_free(&window), "MPI_Win_free");
    window = MPI_WIN_NULL;
    window_values = nullptr;
    window_capacity = 0;
  }

  // --- rank 0 ---------------------------------------------------------------------

  void send_command(Op op, const StreamHeader& h, bool want_dx, const Frame& first,
                    Command c = {}) {
    c.op = static_cast<std::int32_t>(op);
    c.want_dx = want_dx ? 1 : 0;
    c.kind = static_cast<std::uint32_t>(h.kind);
    c.outputs = h.outputs;
    c.inputs = h.inputs;
    c.nnz = h.nnz;
    c.precision = static_cast<std::uint32_t>(h.precision);
    c.order = static_cast<std::uint32_t>(h.order);
    c.first = first.meta(h.precision);
    mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, comm), "command broadcast");
    bytes_sent += sizeof c;
  }

  void scatter_jobs(std::span<const Placement* const> placements,
                    std::span<const ConstMatrixView> xs, std::span<MutableMatrixView* const> dxs) {
    std::vector<Job> jobs(static_cast<std::size_t>(size));
    for (int k = 0; k < engines(); ++k) {
      Job& j = jobs[static_cast<std::size_t>(k) + 1];
      j.tokens = xs[static_cast<std::size_t>(k)].cols;
      j.want_dx = !dxs.empty() && dxs[static_cast<std::size_t>(k)] != nullptr ? 1 : 0;
    }
    scatter_jobs(placements, std::move(jobs));
  }

  // Each engine's job (jobs[k + 1]; their lanes are set here) and placement.
  void scatter_jobs(std::span<const Placement* const> placements, std::vector<Job> jobs) {
    for (int k = 0; k < engines(); ++k) {
      jobs[static_cast<std::size_t>(k) + 1].lanes = placements[static_cast<std::size_t>(k)]->lanes;
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
    bytes_sent += engines() * sizeof(Job) + lane_of.size() * sizeof(std::int32_t) +
                  lane_nnz.size() * sizeof(std::int64_t);
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

  // Takes chunks for one frame: up to `budget` bytes (at least one chunk; 0: the first
  // frame's, see kFirstFrameBytes), at most kMaxFrameChunks.
  Frame pull_frame(StreamSource& source, std::size_t budget = 0) {
    if (budget == 0) budget = std::min(options.frame_bytes, kFirstFrameBytes);
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

  // Pipelined broadcast: frame i's bytes and frame i+1's sizes go out together, up to
  // `window` frames in flight. With direct reads only the sizes and addresses go out, and
  // a frame is in flight until every engine has said it read it. `kept` collects the
  // chunks and their tag checksum, computed while the frames are in flight.
  void broadcast_stream(StreamSource& source, Frame first, SentStream* kept) {
    struct InFlight {
      Frame frame;
      FrameMeta next;
      std::vector<MPI_Request> requests;
    };
    std::deque<std::unique_ptr<InFlight>> flight;
    auto retire = [&] {
      std::vector<MPI_Request>& r = flight.front()->requests;
      wait_all(static_cast<int>(r.size()), r.data(), "stream broadcast");
      flight.pop_front();
    };
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
      Frame next = pull_frame(source, std::min(options.frame_bytes, 2 * current.budget));
      f->next = next.meta(precision);
      if (direct) {
        f->requests.assign(static_cast<std::size_t>(engines()) + 1, MPI_REQUEST_NULL);
        for (int k = 1; k <= engines(); ++k) {
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
    bytes_received += engines() * sizeof(Reply);
    for (int k = 0; k < engines(); ++k) {
      const Reply& r = replies[static_cast<std::size_t>(k) + 1];
      EngineCounters& c = twins[static_cast<std::size_t>(k)]->counters();
      c.busy_seconds += r.busy_seconds;
      c.intake_seconds += r.intake_seconds;
      c.stream_arrival_seconds += r.arrival_seconds;
      c.overlapped_seconds += r.overlapped_seconds;
      c.packets += r.packets;
      c.bytes += r.bytes;
    }
    return replies;
  }

  // After the engines' replies: the sum of their gradient values, which comes down the
  // engines' reduction tree (see send_gradient) from engine 0, segment by segment; each
  // chunk of the result is laid out as soon as its values are in: the tags and control
  // packets of the chunk rank 0 sent, the summed values. Then every engine's tag checksum
  // is compared with that of the sent stream.
  WeightStream collect_gradients(const SentStream& sent) {
    const auto n = static_cast<std::size_t>(engines());
    const std::vector<Reply> replies = gather_replies();
    for (std::size_t k = 0; k < n; ++k) {
      const Reply& a = replies[1];
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
    const double start = MPI_Wtime();  // every engine has its gradient stream
    const std::uint64_t total = sent.values;
    const std::uint64_t segments = (total + kSegmentValues - 1) / kSegmentValues;
    ensure_window(sent.packets);
    // With the window, a segment's message is empty: it says engine 0 has written that
    // segment's sum into it. Without, it carries the values.
    const float* sums = window_values;
    if (window == MPI_WIN_NULL) {
      values.resize(total);
      sums = values.data();
    } else {
      mpi_check(MPI_Win_lock_all(MPI_MODE_NOCHECK, window), "MPI_Win_lock_all");
    }
    std::vector<MPI_Request> requests(segments, MPI_REQUEST_NULL);
    for (std::uint64_t s = 0; s < segments; ++s) {
      const std::uint64_t offset = s * kSegmentValues;
      const auto count = static_cast<int>(std::min(kSegmentValues, total - offset));
      const int rc = window != MPI_WIN_NULL
                         ? MPI_Irecv(nullptr, 0, MPI_BYTE, 1, kGradientTag, comm, &requests[s])
                         : MPI_Irecv(values.data() + offset, count, MPI_FLOAT, 1, kGradientTag,
                                     comm, &requests[s]);
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
        wait_all(1, &requests[next_segment], "gradient receive");
        if (window != MPI_WIN_NULL) mpi_check(MPI_Win_sync(window), "MPI_Win_sync");
        arrived = std::min(total, ++next_segment * kSegmentValues);
      }
      // A chunk of an earlier gradient that ModelMemory is done with: fresh pages cost
      // more here than the copy itself.
      std::shared_ptr<StreamChunk> chunk = result_pool->take(sent.chunks.size());
      chunk->first_output = c.first_output;
      chunk->outputs = c.outputs;
      chunk->packets.resize(c.size());
      if (sent.precision == Precision::bf16) {
        layout.bf16(c.packets_bf16.data(), c.size(), sums + at, chunk->packets.data(), streaming);
      } else {
        layout.fp32(c.packets.data(), c.size(), sums + at, chunk->packets.data(), streaming);
      }
      at = need;
      result.chunks.push_back(std::move(chunk));
    }
    wait_all(static_cast<int>(requests.size()), requests.data(), "gradient receive");
    if (window != MPI_WIN_NULL) mpi_check(MPI_Win_unlock_all(window), "MPI_Win_unlock_all");
    std::vector<std::uint32_t> checksums(static_cast<std::size_t>(size));
    const std::uint32_t none = 0;
    mpi_check(MPI_Gather(&none, 1, MPI_UINT32_T, checksums.data(), 1, MPI_UINT32_T, 0, comm),
              "checksum gather");
    const std::uint32_t expected = sent.tags.checksum();
    for (std::size_t k = 0; k < n; ++k) {
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
    last_gradient_seconds = MPI_Wtime() - start;
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

  // Direct reads: each frame is read out of rank 0's memory as soon as its sizes and
  // addresses are in (frame i's come with frame i - 1's), then rank 0 is told, so it can
  // let go of the chunks, and the frame goes to the engine.
  template <typename Take, typename Check>
  void receive_stream_directly(const FrameMeta& first, Precision precision, FrameChannel& channel,
                               Take& take, const std::vector<void*>& buffers,
                               const std::vector<std::size_t>& sizes, Check& check) {
#ifdef SLUICE_MPI_DIRECT_READ
    const std::size_t packet_bytes =
        precision == Precision::bf16 ? sizeof(Bf16Packet) : sizeof(Packet);
    std::vector<MPI_Request> said;  // "read" to rank 0, one per frame
    FrameMeta meta = first, next;
    std::vector<iovec> local, remote;
    while (meta.chunks > 0) {
      MPI_Request upcoming = MPI_REQUEST_NULL;
      mpi_check(MPI_Ibcast(&next, sizeof(FrameMeta), MPI_BYTE, 0, comm, &upcoming),
                "stream broadcast");
      std::vector<std::shared_ptr<StreamChunk>> chunks;
      take(meta, chunks);
      local.clear();
      remote.clear();
      std::size_t bytes = 0;
      for (std::size_t i = 0; i < buffers.size(); ++i) {
        const std::size_t n = sizes[i] * packet_bytes;
        if (n == 0) continue;
        local.push_back({buffers[i], n});
        remote.push_back(
            {reinterpret_cast<void*>(static_cast<std::uintptr_t>(meta.chunk[i].address)), n});
        bytes += n;
      }
      if (!read_remote(driver_pid, local, remote, bytes)) {
        throw IoError(
            std::string("MpiFabric: reading a stream frame from rank 0's memory failed: ") +
            std::strerror(errno));
      }
      said.push_back(MPI_REQUEST_NULL);
      mpi_check(MPI_Isend(nullptr, 0, MPI_BYTE, 0, kFrameReadTag, comm, &said.back()),
                "stream broadcast");
      channel.push(
          {std::make_move_iterator(chunks.begin()), std::make_move_iterator(chunks.end())});
      wait_all(1, &upcoming, "stream broadcast");
      check(next);
      meta = next;
    }
    wait_all(static_cast<int>(said.size()), said.data(), "stream broadcast");
    channel.close();
#else
    (void)first, (void)precision, (void)channel, (void)take, (void)buffers, (void)sizes,
        (void)check;
    throw IoError("MpiFabric: direct reads are not available on this system");
#endif
  }

  // Receives the stream's frames with up to `window` of them posted, as rank 0 sends
  // them: frame i's broadcast carries frame i + 1's sizes, which arrive at once (they are
  // small), so frame i + 1 is posted while frame i is still in transfer. A frame goes to
  // the engine as soon as it is complete; the transfer goes on while the engine works.
  void receive_stream(const FrameMeta& first, Precision precision, FrameChannel& channel,
                      std::vector<std::shared_ptr<StreamChunk>>& used) {
    struct Posted {
      std::vector<std::shared_ptr<StreamChunk>> chunks;
      FrameMeta next;
      MPI_Request data = MPI_REQUEST_NULL, meta = MPI_REQUEST_NULL;
      bool meta_read = false;  // `next` was acted on (posted, or it ended the stream)
    };
    auto check = [](const FrameMeta& meta) {
      if (meta.chunks < 0 || meta.chunks > kMaxFrameChunks) {
        throw FormatError("MpiFabric: a frame of " + std::to_string(meta.chunks) + " chunks");
      }
    };
    std::vector<void*> buffers;
    std::vector<std::size_t> sizes;
    // Buffers for a frame's chunks (from the pool), into `chunks`, `buffers` and `sizes`.
    auto take = [&](const FrameMeta& meta, std::vector<std::shared_ptr<StreamChunk>>& chunks) {
      buffers.clear();
      sizes.clear();
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
        const auto packets = static_cast<std::size_t>(meta.chunk[i].packets);
        if (precision == Precision::bf16) {
          chunk->packets.clear();
          chunk->packets_bf16.resize(packets);
          buffers.push_back(chunk->packets_bf16.data());
        } else {
          chunk->packets_bf16.clear();
          chunk->packets.resize(packets);
          buffers.push_back(chunk->packets.data());
        }
        sizes.push_back(packets);
        chunks.push_back(std::move(chunk));
      }
    };
    auto post = [&](const FrameMeta& meta) {
      auto p = std::make_unique<Posted>();
      take(meta, p->chunks);
      MPI_Datatype type = chunks_type(precision, {buffers.begin(), buffers.end()}, sizes);
      const int rc = MPI_Ibcast(MPI_BOTTOM, 1, type, 0, comm, &p->data);
      MPI_Type_free(&type);
      mpi_check(rc, "stream broadcast");
      mpi_check(MPI_Ibcast(&p->next, sizeof(FrameMeta), MPI_BYTE, 0, comm, &p->meta),
                "stream broadcast");
      return p;
    };
    check(first);
    if (direct) {
      receive_stream_directly(first, precision, channel, take, buffers, sizes, check);
      return;
    }
    std::deque<std::unique_ptr<Posted>> posted;
    bool ended = first.chunks == 0;
    if (!ended) posted.push_back(post(first));
    // Acts on a frame's successor sizes: posts that frame, or notes the stream's end.
    auto follow = [&](Posted& p) {
      p.meta_read = true;
      check(p.next);
      if (p.next.chunks == 0) {
        ended = true;
      } else {
        posted.push_back(post(p.next));
      }
    };
    while (!posted.empty()) {
      bool progress = false;
      Posted& newest = *posted.back();
      if (!ended && !newest.meta_read && posted.size() < options.window) {
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
        channel.push({std::make_move_iterator(oldest.chunks.begin()),
                      std::make_move_iterator(oldest.chunks.end())});
        posted.pop_front();
        progress = true;
      }
      if (!progress) std::this_thread::yield();  // as wait_all: the engine needs the core
    }
    channel.close();
  }

  static StreamHeader header_of(const Command& cmd) {
    StreamHeader header;
    header.kind = static_cast<StreamKind>(cmd.kind);
    header.outputs = cmd.outputs;
    header.inputs = cmd.inputs;
    header.nnz = cmd.nnz;
    header.precision = static_cast<Precision>(cmd.precision);
    header.order = static_cast<StreamOrder>(cmd.order);
    if (header.precision != Precision::fp32 && header.precision != Precision::bf16) {
      throw FormatError("MpiFabric: unknown stream precision " + std::to_string(cmd.precision) +
                        " from rank 0");
    }
    if (header.order != StreamOrder::by_output && header.order != StreamOrder::by_input) {
      throw FormatError("MpiFabric: unknown stream order " + std::to_string(cmd.order) +
                        " from rank 0");
    }
    return header;
  }

  // Runs fn(stream) on the engine's thread while this thread receives the stream's
  // frames; a failed engine drains its channel, so the receiving thread never blocks.
  template <typename Fn>
  void run_on_stream(const Command& cmd, const StreamHeader& header, Fn&& fn) {
    FrameChannel channel(options.window * kMaxFrameChunks);
    std::exception_ptr error;
    std::future<void> done = worker->post([&] {
      FrameStreamSource source(header, channel);
      try {
        fn(static_cast<StreamSource&>(source));
      } catch (...) {
        error = std::current_exception();
      }
      try {
        while (!channel.pop().empty()) {
        }
      } catch (...) {
      }
    });
    std::vector<std::shared_ptr<StreamChunk>> used;
    receive_stream(cmd.first, header.precision, channel, used);
    done.get();
    if (error) std::rethrow_exception(error);
    // The engine has let go of the chunks: their buffers serve the next operation.
    pool.insert(pool.end(), std::make_move_iterator(used.begin()),
                std::make_move_iterator(used.end()));
  }

  // The engine's counters since `before` and, if any, its gradient stream's shape; then
  // the gradient itself up the tree, and its checksum.
  void reply(const EngineCounters& before, const WeightStream* gradient) {
    Reply r;
    const EngineCounters& after = engine->counters();
    r.busy_seconds = after.busy_seconds - before.busy_seconds;
    r.intake_seconds = after.intake_seconds - before.intake_seconds;
    r.arrival_seconds = after.stream_arrival_seconds - before.stream_arrival_seconds;
    r.overlapped_seconds = after.overlapped_seconds - before.overlapped_seconds;
    r.packets = after.packets - before.packets;
    r.bytes = after.bytes - before.bytes;
    if (gradient != nullptr) {
      r.grad_kind = static_cast<std::uint32_t>(gradient->header.kind);
      r.grad_outputs = gradient->header.outputs;
      r.grad_inputs = gradient->header.inputs;
      r.grad_order = static_cast<std::uint32_t>(gradient->header.order);
      r.grad_nnz = gradient->header.nnz;
      r.grad_packets = gradient->packet_count();
      r.grad_values = gradient->header.nnz;
    }
    mpi_check(MPI_Gather(&r, sizeof(Reply), MPI_BYTE, nullptr, 0, MPI_BYTE, 0, comm),
              "reply gather");
    if (gradient != nullptr) {
      const std::uint32_t checksum = send_gradient(*gradient);
      mpi_check(MPI_Gather(&checksum, 1, MPI_UINT32_T, nullptr, 0, MPI_UINT32_T, 0, comm),
                "checksum gather");
    }
  }

  void serve_one(const Command& cmd) {
    if (cmd.op >= static_cast<std::int32_t>(Op::load_batch)) {
      serve_layer_op(cmd);
      return;
    }
    const bool backward = cmd.op == static_cast<std::int32_t>(Op::backward);
    const bool echo = cmd.op == static_cast<std::int32_t>(Op::probe_echo);
    const bool probe = echo || cmd.op == static_cast<std::int32_t>(Op::probe);
    const StreamHeader header = header_of(cmd);
    // The layer's shape, whichever way its stream walks it.
    const std::uint32_t inputs = header.layer_inputs(), outputs = header.layer_outputs();
    Placement placement;
    Job job;
    DenseMatrix x, y, dy, dx;
    if (!probe) {
      job = receive_job(inputs, placement);
      x = receive_matrix(inputs, job.tokens);
    }
    if (probe) {
    } else if (backward) {
      dy = receive_matrix(outputs, job.tokens);
      if (job.want_dx) dx = DenseMatrix(inputs, job.tokens);
    } else {
      y = DenseMatrix(outputs, job.tokens);
    }
    const EngineCounters before = engine->counters();
    WeightStream gradient;
    run_on_stream(cmd, header, [&](StreamSource& source) {
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
    });
    if (probe) {
    } else if (!backward) {
      send_matrix(&y);
    } else if (cmd.want_dx) {
      send_matrix(job.want_dx ? &dx : nullptr);
    }
    reply(before, backward || echo ? &gradient : nullptr);
  }

  // --- engine ranks: layer operations on the engine's own activation store ----------

  void serve_layer_op(const Command& cmd) {
    switch (static_cast<Op>(cmd.op)) {
      case Op::load_batch:
        return serve_load(cmd);
      case Op::load_samples:
        return serve_samples(cmd);
      case Op::forward_layer:
      case Op::backward_layer:
        return serve_layer(cmd);
      case Op::loss: {
        const LossSums s = engine->loss((cmd.flags & kFlagDelta) != 0, cmd.total_tokens);
        WireLoss w{s.loss, s.correct, s.tokens, s.non_finite ? 1 : 0};
        mpi_check(MPI_Gather(&w, sizeof w, MPI_BYTE, nullptr, 0, MPI_BYTE, 0, comm), "loss gather");
        return;
      }
      case Op::layer_activations: {
        const ActivationStore& store = engine->store();
        const DenseMatrix x = copy_of(store.in(cmd.layer));
        const DenseMatrix dz = copy_of(
            store.last_delta(store.spec().sizes.at(static_cast<std::size_t>(cmd.layer) + 1)));
        send_matrix(&x);
        send_matrix(&dz);
        return;
      }
      case Op::gather_output: {
        const ActivationStore& store = engine->store();
        DenseMatrix out(0, 0);
        if (store.loaded()) out = copy_of(store.out(store.layers() - 1));
        send_matrix(&out);
        return;
      }
      default:
        throw FormatError("MpiFabric: unknown command " + std::to_string(cmd.op) + " from rank 0");
    }
  }

  static DenseMatrix copy_of(ConstMatrixView m) {
    DenseMatrix c(m.rows, m.cols);
    for (std::int64_t r = 0; r < m.rows; ++r) std::copy(m.row(r), m.row(r) + m.cols, c.row(r));
    return c;
  }

  // Rank 0: the pass's spec after the command (see receive_spec).
  void send_spec(const PassSpec& spec) {
    std::vector<std::int64_t> sizes = spec.sizes;
    std::vector<std::int32_t> activations;
    for (const Activation a : spec.activations) activations.push_back(static_cast<std::int32_t>(a));
    mpi_check(MPI_Bcast(sizes.data(), static_cast<int>(sizes.size()), MPI_INT64_T, 0, comm),
              "spec broadcast");
    mpi_check(
        MPI_Bcast(activations.data(), static_cast<int>(activations.size()), MPI_INT32_T, 0, comm),
        "spec broadcast");
    bytes_sent += sizes.size() * sizeof(std::int64_t) + activations.size() * sizeof(std::int32_t);
  }

  PassSpec receive_spec(const Command& cmd) {
    if (cmd.layer < 1 || cmd.layer > (1 << 20)) {
      throw FormatError("MpiFabric: a pass of " + std::to_string(cmd.layer) + " layers");
    }
    PassSpec spec;
    spec.sizes.resize(static_cast<std::size_t>(cmd.layer) + 1);
    std::vector<std::int32_t> activations(static_cast<std::size_t>(cmd.layer));
    mpi_check(MPI_Bcast(spec.sizes.data(), cmd.layer + 1, MPI_INT64_T, 0, comm), "spec broadcast");
    mpi_check(MPI_Bcast(activations.data(), cmd.layer, MPI_INT32_T, 0, comm), "spec broadcast");
    for (const std::int32_t a : activations) spec.activations.push_back(static_cast<Activation>(a));
    spec.loss = static_cast<Loss>(cmd.kind);
    spec.training = (cmd.flags & kFlagTraining) != 0;
    return spec;
  }

  void serve_samples(const Command& cmd) {
    const PassSpec spec = receive_spec(cmd);
    const std::int64_t tokens = Fabric::shard_of(rank - 1, engines(), cmd.total_tokens).count;
    std::vector<std::int64_t> indices(static_cast<std::size_t>(tokens));
    mpi_check(MPI_Scatterv(nullptr, nullptr, nullptr, MPI_INT64_T, indices.data(),
                           to_count(indices.size(), "a token slice"), MPI_INT64_T, 0, comm),
              "sample scatter");
    if (dataset == nullptr) {
      throw FormatError("MpiFabric: rank " + std::to_string(rank) +
                        " was asked for samples but has no data set attached (attach it on "
                        "every rank before serve(); did loading it fail here?)");
    }
    engine->load_samples(spec, *dataset, indices);
  }

  void serve_load(const Command& cmd) {
    const PassSpec spec = receive_spec(cmd);
    const std::int64_t tokens = Fabric::shard_of(rank - 1, engines(), cmd.total_tokens).count;
    const DenseMatrix x = receive_matrix(spec.sizes.front(), tokens);
    std::vector<int> labels;
    if ((cmd.flags & kFlagLabels) != 0) {
      labels.resize(static_cast<std::size_t>(tokens));
      mpi_check(MPI_Scatterv(nullptr, nullptr, nullptr, MPI_INT, labels.data(),
                             to_count(labels.size(), "a token slice"), MPI_INT, 0, comm),
                "label scatter");
    }
    DenseMatrix targets;
    if ((cmd.flags & kFlagTargets) != 0) targets = receive_matrix(spec.sizes.back(), tokens);
    ShardData shard;
    shard.features = x.view();
    shard.labels = labels;
    if ((cmd.flags & kFlagTargets) != 0) shard.targets = targets.view();
    engine->load_shard(spec, shard);
  }

  void serve_layer(const Command& cmd) {
    const bool backward = cmd.op == static_cast<std::int32_t>(Op::backward_layer);
    const StreamHeader header = header_of(cmd);
    Placement placement;
    receive_job(header.layer_inputs(), placement);
    std::vector<float> bias;
    if (!backward && (cmd.flags & kFlagBias) != 0) {
      bias.resize(header.layer_outputs());
      mpi_check(MPI_Bcast(bias.data(), to_count(bias.size(), "a bias"), MPI_FLOAT, 0, comm),
                "bias broadcast");
    }
    const EngineCounters before = engine->counters();
    WeightStream gradient;
    std::vector<float> bias_gradient;
    const bool with_bias = (cmd.flags & kFlagBias) != 0;
    run_on_stream(cmd, header, [&](StreamSource& source) {
      if (backward) {
        gradient = engine->backward_layer(source, placement, cmd.layer, cmd.want_dx != 0,
                                          with_bias ? &bias_gradient : nullptr);
      } else {
        engine->forward_layer(source, placement, cmd.layer, bias);
      }
    });
    reply(before, backward ? &gradient : nullptr);
    if (backward && with_bias) {
      mpi_check(MPI_Gatherv(bias_gradient.data(), to_count(bias_gradient.size(), "a bias"),
                            MPI_FLOAT, nullptr, nullptr, nullptr, MPI_FLOAT, 0, comm),
                "bias gradient gather");
    }
  }

  // This engine's part of the gradient reduction. The engines form reduce_gradients' tree:
  // engine k absorbs engines k + 1, k + 2, k + 4, ... (while k is a multiple of twice the
  // distance), in that order, and passes the sum to engine k - lowbit(k); engine 0 passes
  // it to rank 0. So the float additions are LocalFabric's, bit for bit, and the same
  // every run. Only the weight packets' values travel (rank 0 knows the tags); they are
  // packed from the chunks and sent segment by segment, so packing, adding and sending
  // overlap along the tree. Returns the checksum of the stream's tags.
  std::uint32_t send_gradient(const WeightStream& gradient) {
    const std::int64_t k = rank - 1, n = engines();
    std::vector<std::int64_t> children;
    for (std::int64_t d = 1; k % (2 * d) == 0 && k + d < n; d *= 2) children.push_back(k + d);
    const int parent = k == 0 ? 0 : static_cast<int>(k - (k & -k)) + 1;
    const std::uint64_t total = gradient.header.nnz;
    const std::uint64_t segments = (total + kSegmentValues - 1) / kSegmentValues;
    // Room for every packet: a stream with more weights than its header says is caught
    // below, after packing, not by writing past the buffer. Engine 0 packs straight into
    // rank 0's window if there is one.
    ensure_window(gradient.packet_count());
    const bool shared = k == 0 && window != MPI_WIN_NULL;
    float* mine = shared ? window_values : nullptr;
    if (!shared) {
      values.resize(std::max(total, gradient.packet_count()));
      mine = values.data();
    }
    if (child_values.size() < children.size()) child_values.resize(children.size());
    std::vector<MPI_Request> receives(children.size() * segments, MPI_REQUEST_NULL);
    for (std::size_t c = 0; c < children.size(); ++c) {
      child_values[c].resize(total);
      for (std::uint64_t s = 0; s < segments; ++s) {
        const std::uint64_t offset = s * kSegmentValues;
        const auto count = static_cast<int>(std::min(kSegmentValues, total - offset));
        mpi_check(MPI_Irecv(child_values[c].data() + offset, count, MPI_FLOAT,
                            static_cast<int>(children[c]) + 1, kGradientTag, comm,
                            &receives[c * segments + s]),
                  "gradient receive");
      }
    }
    if (shared) mpi_check(MPI_Win_lock_all(MPI_MODE_NOCHECK, window), "MPI_Win_lock_all");
    std::vector<MPI_Request> sends(segments, MPI_REQUEST_NULL);
    auto finish_segment = [&](std::uint64_t s) {
      const std::uint64_t offset = s * kSegmentValues;
      const std::uint64_t count = std::min(kSegmentValues, total - offset);
      float* sum = mine + offset;
      for (std::size_t c = 0; c < children.size(); ++c) {
        wait_all(1, &receives[c * segments + s], "gradient receive");
        const float* theirs = child_values[c].data() + offset;
        for (std::uint64_t j = 0; j < count; ++j) sum[j] += theirs[j];
      }
      if (shared) {  // the sum is in rank 0's memory: make it visible, then say so
        mpi_check(MPI_Win_sync(window), "MPI_Win_sync");
        mpi_check(MPI_Isend(nullptr, 0, MPI_BYTE, 0, kGradientTag, comm, &sends[s]),
                  "gradient send");
      } else {
        mpi_check(MPI_Isend(sum, static_cast<int>(count), MPI_FLOAT, parent, kGradientTag, comm,
                            &sends[s]),
                  "gradient send");
      }
    };
    TagScanner tags;
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
    if (shared) mpi_check(MPI_Win_unlock_all(window), "MPI_Win_unlock_all");
    wait_all(static_cast<int>(sends.size()), sends.data(), "gradient send");
    return tags.checksum();
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
  // Errors come back as codes (mpi_check turns them into exceptions, which end every rank
  // with a message), and a window the MPI cannot make is not fatal.
  mpi_check(MPI_Comm_set_errhandler(m.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");

  const EngineOptions& eo = m.options.engine;
  WireEngine wire;
  wire.lanes = eo.geometry.lanes;
  wire.blocks = eo.geometry.blocks;
  wire.tile_tokens = eo.geometry.tile_tokens;
  wire.shares = eo.geometry.shares;
  wire.threads = eo.threads;
  wire.isa = eo.isa ? static_cast<std::int32_t>(*eo.isa) : -1;
  wire.pin = eo.pin_threads ? 1 : 0;
  wire.tile_cache_bytes = eo.tile_cache_bytes;
  mpi_check(MPI_Bcast(&wire, sizeof wire, MPI_BYTE, 0, m.comm), "options broadcast");
  MPI_Comm node = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split_type(m.comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int node_ranks = 1;
  MPI_Comm_size(node, &node_ranks);
  // Does engine 0 (rank 1) share rank 0's node? Rank 0 knows, and tells everyone.
  int pair_shares_node = 0;
  if (m.rank == 0) {
    MPI_Group all = MPI_GROUP_NULL, local = MPI_GROUP_NULL;
    MPI_Comm_group(m.comm, &all);
    MPI_Comm_group(node, &local);
    const int one = 1;
    int in_node = MPI_UNDEFINED;
    MPI_Group_translate_ranks(all, 1, &one, local, &in_node);
    pair_shares_node = in_node != MPI_UNDEFINED && m.options.shared_memory ? 1 : 0;
    MPI_Group_free(&all);
    MPI_Group_free(&local);
  }
  MPI_Comm_free(&node);
  mpi_check(MPI_Bcast(&pair_shares_node, 1, MPI_INT, 0, m.comm), "node broadcast");
  // Direct reads of the stream need every rank on rank 0's node and the OS's leave to read
  // another process's memory: each engine rank reads back a word of rank 0's, and all
  // agree (any refusal, and the stream is broadcast by messages).
  {
    std::uint64_t probe_word[2] = {0, 0};  // read by the engines within the Allreduce below
    DirectProbe probe;
#ifdef SLUICE_MPI_DIRECT_READ
    if (m.rank == 0) {
      std::random_device random;
      probe_word[0] = (std::uint64_t{random()} << 32) | random();
      probe_word[1] = (std::uint64_t{random()} << 32) | random() | 1U;
      // Open MPI's two-sided copy of a frame (rank 0 copies in, the engine copies out,
      // pipelined) needs both processes running at once: with one engine and a core each
      // it measured ~1.0-1.4x MPI_Bcast here, but 0.3-0.6x in half the runs, whenever
      // the engine's own threads or anything else took a core. Each engine reading for
      // itself measured a steady 0.8-0.9x with one engine, and scales with several.
      probe.wanted = m.options.shared_memory && node_ranks == m.size ? 1 : 0;
      probe.pid = getpid();
      probe.address = reinterpret_cast<std::uintptr_t>(&probe_word[0]);
      probe.expected[0] = probe_word[0];
      probe.expected[1] = probe_word[1];
    }
#endif
    mpi_check(MPI_Bcast(&probe, sizeof probe, MPI_BYTE, 0, m.comm), "direct-read probe");
    int ok = probe.wanted;
#ifdef SLUICE_MPI_DIRECT_READ
    if (ok != 0 && m.rank != 0) {
      std::uint64_t seen[2] = {0, 0};
      std::vector<iovec> local{{seen, sizeof seen}};
      std::vector<iovec> remote{
          {reinterpret_cast<void*>(static_cast<std::uintptr_t>(probe.address)), sizeof seen}};
      ok = read_remote(probe.pid, local, remote, sizeof seen) && seen[0] == probe.expected[0] &&
                   seen[1] == probe.expected[1]
               ? 1
               : 0;
    }
#endif
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, m.comm), "direct-read probe");
    m.direct = ok != 0;
    m.driver_pid = probe.pid;
  }
  if (pair_shares_node != 0) {
    mpi_check(MPI_Comm_split(m.comm, m.rank <= 1 ? 0 : MPI_UNDEFINED, m.rank, &m.pair),
              "MPI_Comm_split");
  }

  auto options_from = [](const WireEngine& w) {
    EngineOptions o;
    o.geometry.lanes = w.lanes;
    o.geometry.blocks = w.blocks;
    o.geometry.tile_tokens = w.tile_tokens;
    o.geometry.shares = w.shares;
    o.threads = w.threads;
    if (w.isa >= 0) o.isa = static_cast<Isa>(w.isa);
    o.pin_threads = w.pin != 0;
    o.tile_cache_bytes = w.tile_cache_bytes;
    return o;
  };
  WireEngine resolved = wire;
  if (m.rank != 0) {
    if (resolved.threads <= 0) {
      const int cores = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
      resolved.threads = std::max(1, cores / node_ranks);
    }
    if (resolved.tile_cache_bytes <= 0) {
      resolved.tile_cache_bytes = topology().cache_share_bytes();
    }
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
  if (impl_->pair != MPI_COMM_NULL) MPI_Comm_free(&impl_->pair);
  if (impl_->comm != MPI_COMM_NULL) MPI_Comm_free(&impl_->comm);
}

int MpiFabric::rank() const {
  return impl_->rank;
}

double MpiFabric::last_gradient_seconds() const {
  return impl_->last_gradient_seconds;
}

void MpiFabric::stop() {
  Impl& m = *impl_;
  if (m.rank != 0) throw ShapeError("MpiFabric::stop: only rank 0 stops the fabric");
  if (m.stopped) return;
  Command c;
  c.op = static_cast<std::int32_t>(Op::stop);
  mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
  m.stopped = true;
  m.free_window();  // collective: the engine ranks free it as they leave serve()
}

void MpiFabric::serve() {
  Impl& m = *impl_;
  if (m.rank == 0)
    throw ShapeError("MpiFabric::serve: rank 0 drives the fabric, it does not serve");
  m.dataset = dataset();
  try {
    while (true) {
      Command c;
      mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
      if (c.op == static_cast<std::int32_t>(Op::stop)) {
        m.stopped = true;
        m.free_window();
        return;
      }
      if (c.op < static_cast<std::int32_t>(Op::forward) ||
          c.op > static_cast<std::int32_t>(Op::load_samples)) {
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
    check_slice("X", k, xs[k].rows, xs[k].cols, h.layer_inputs(), xs[k].cols);
    check_slice("dY", k, dys[k].rows, dys[k].cols, h.layer_outputs(), xs[k].cols);
    check_slice("placement", k, placements[k]->features(), 1, h.layer_inputs(), 1);
    if (!dxs.empty() && dxs[k] != nullptr) {
      check_slice("dX", k, dxs[k]->rows, dxs[k]->cols, h.layer_inputs(), xs[k].cols);
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
    SentStream sent;
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
    sum.bias = detail::sum_bias_tree(std::move(biases));
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
    SentStream sent;
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

// --- rank 0: layer operations over the engine ranks' activation stores ----------------

void MpiFabric::load_batch_impl(const PassSpec& spec, const ShardData& batch) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  const auto n = static_cast<std::size_t>(m.engines());
  std::vector<ConstMatrixView> features(n), targets(n);
  std::vector<int> counts(static_cast<std::size_t>(m.size), 0), displs(counts.size(), 0);
  m.shard_tokens.assign(n, 0);
  for (std::size_t k = 0; k < n; ++k) {
    const TokenRange r = shard_of(static_cast<std::int32_t>(k), m.engines(), batch.features.cols);
    const ConstMatrixView& f = batch.features;
    features[k] = {f.data + r.first, f.rows, r.count, f.stride};
    if (batch.targets) {
      const ConstMatrixView& t = *batch.targets;
      targets[k] = {t.data + r.first, t.rows, r.count, t.stride};
    }
    counts[k + 1] = to_count(static_cast<std::uint64_t>(r.count), "a token slice");
    displs[k + 1] = to_count(static_cast<std::uint64_t>(r.first), "a batch");
    m.shard_tokens[k] = r.count;
  }
  m.outputs = spec.sizes.back();
  m.sizes = spec.sizes;
  try {
    m.bytes_sent = 0;
    Command c;
    c.op = static_cast<std::int32_t>(Op::load_batch);
    c.layer = static_cast<std::int32_t>(spec.activations.size());
    c.kind = static_cast<std::uint32_t>(spec.loss);
    c.total_tokens = batch.features.cols;
    c.flags = (batch.labels.empty() ? 0 : kFlagLabels) | (batch.targets ? kFlagTargets : 0) |
              (spec.training ? kFlagTraining : 0);
    mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
    m.send_spec(spec);
    m.scatter_matrices(features);
    if (!batch.labels.empty()) {
      mpi_check(MPI_Scatterv(batch.labels.data(), counts.data(), displs.data(), MPI_INT, nullptr, 0,
                             MPI_INT, 0, m.comm),
                "label scatter");
    }
    if (batch.targets) m.scatter_matrices(targets);
    counters_.driver_bytes_sent += sizeof c + m.bytes_sent;
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
}

void MpiFabric::load_samples_impl(const PassSpec& spec, std::span<const std::int64_t> indices) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  const auto n = static_cast<std::size_t>(m.engines());
  const auto total = static_cast<std::int64_t>(indices.size());
  std::vector<int> counts(static_cast<std::size_t>(m.size), 0), displs(counts.size(), 0);
  m.shard_tokens.assign(n, 0);
  for (std::size_t k = 0; k < n; ++k) {
    const TokenRange r = shard_of(static_cast<std::int32_t>(k), m.engines(), total);
    counts[k + 1] = to_count(static_cast<std::uint64_t>(r.count), "a token slice");
    displs[k + 1] = to_count(static_cast<std::uint64_t>(r.first), "a batch");
    m.shard_tokens[k] = r.count;
  }
  m.outputs = spec.sizes.back();
  m.sizes = spec.sizes;
  try {
    m.bytes_sent = 0;
    Command c;
    c.op = static_cast<std::int32_t>(Op::load_samples);
    c.layer = static_cast<std::int32_t>(spec.activations.size());
    c.kind = static_cast<std::uint32_t>(spec.loss);
    c.total_tokens = total;
    c.flags = kFlagLabels | (spec.training ? kFlagTraining : 0);
    mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
    m.send_spec(spec);
    mpi_check(MPI_Scatterv(indices.data(), counts.data(), displs.data(), MPI_INT64_T, nullptr, 0,
                           MPI_INT64_T, 0, m.comm),
              "sample scatter");
    counters_.driver_bytes_sent += sizeof c + m.bytes_sent;
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
}

void MpiFabric::forward_layer_impl(StreamSource& weights,
                                   std::span<const Placement* const> placements, std::int32_t layer,
                                   std::span<const float> bias) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  const StreamHeader& h = weights.header();
  if (m.shard_tokens.empty()) throw ShapeError("MpiFabric forward_layer: no batch loaded");
  if (!bias.empty() && bias.size() != h.outputs) {
    throw ShapeError("MpiFabric forward_layer: " + std::to_string(bias.size()) + " biases for " +
                     std::to_string(h.outputs) + " outputs");
  }
  for (std::size_t k = 0; k < placements.size(); ++k) {
    check_slice("placement", k, placements[k]->features(), 1, h.inputs, 1);
  }
  try {
    m.bytes_sent = 0;
    m.bytes_received = 0;
    Command c;
    c.layer = layer;
    c.flags = bias.empty() ? 0 : kFlagBias;
    Frame first = m.pull_frame(weights);
    m.send_command(Op::forward_layer, h, false, first, c);
    m.scatter_jobs(placements, std::vector<Job>(static_cast<std::size_t>(m.size)));
    if (!bias.empty()) {
      std::vector<float> b(bias.begin(), bias.end());
      mpi_check(MPI_Bcast(b.data(), to_count(b.size(), "a bias"), MPI_FLOAT, 0, m.comm),
                "bias broadcast");
    }
    m.broadcast_stream(weights, std::move(first), nullptr);
    m.gather_replies();
    counters_.driver_bytes_sent += m.bytes_sent;
    counters_.driver_bytes_received += m.bytes_received;
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
}

std::vector<LossSums> MpiFabric::loss_impl(bool want_delta, std::int64_t total_tokens) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  if (m.shard_tokens.empty()) throw ShapeError("MpiFabric loss: no batch loaded");
  std::vector<LossSums> parts(static_cast<std::size_t>(m.engines()));
  try {
    Command c;
    c.op = static_cast<std::int32_t>(Op::loss);
    c.flags = want_delta ? kFlagDelta : 0;
    c.total_tokens = total_tokens;
    mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
    std::vector<WireLoss> all(static_cast<std::size_t>(m.size));
    WireLoss none;
    mpi_check(
        MPI_Gather(&none, sizeof none, MPI_BYTE, all.data(), sizeof none, MPI_BYTE, 0, m.comm),
        "loss gather");
    for (std::size_t k = 0; k < parts.size(); ++k) {
      const WireLoss& w = all[k + 1];
      parts[k] = {w.loss, w.correct, w.tokens, w.non_finite != 0};
    }
    counters_.driver_bytes_sent += sizeof c;
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
  return parts;
}

ReducedGradient MpiFabric::backward_layer_impl(StreamSource& weights,
                                               std::span<const Placement* const> placements,
                                               std::int32_t layer, bool want_dx, bool with_bias) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  const StreamHeader& h = weights.header();
  if (m.shard_tokens.empty()) throw ShapeError("MpiFabric backward_layer: no batch loaded");
  for (std::size_t k = 0; k < placements.size(); ++k) {
    check_slice("placement", k, placements[k]->features(), 1, h.layer_inputs(), 1);
  }
  const auto n = static_cast<std::size_t>(m.engines());
  ReducedGradient sum;
  try {
    m.bytes_sent = 0;
    m.bytes_received = 0;
    Command c;
    c.layer = layer;
    c.flags = with_bias ? kFlagBias : 0;
    Frame first = m.pull_frame(weights);
    m.send_command(Op::backward_layer, h, want_dx, first, c);
    m.scatter_jobs(placements, std::vector<Job>(static_cast<std::size_t>(m.size)));
    SentStream sent;
    m.broadcast_stream(weights, std::move(first), &sent);
    sum.weights = m.collect_gradients(sent);
    if (with_bias) {
      const auto outputs = static_cast<std::size_t>(h.layer_outputs());
      std::vector<int> counts(static_cast<std::size_t>(m.size), 0), displs(counts.size(), 0);
      for (std::size_t k = 0; k < n; ++k) {
        counts[k + 1] = to_count(outputs, "a bias");
        displs[k + 1] = to_count(k * outputs, "the biases");
      }
      std::vector<float> all(n * outputs);
      mpi_check(MPI_Gatherv(nullptr, 0, MPI_FLOAT, all.data(), counts.data(), displs.data(),
                            MPI_FLOAT, 0, m.comm),
                "bias gradient gather");
      std::vector<std::vector<float>> biases(n);
      for (std::size_t k = 0; k < n; ++k) {
        biases[k].assign(all.begin() + static_cast<std::ptrdiff_t>(k * outputs),
                         all.begin() + static_cast<std::ptrdiff_t>((k + 1) * outputs));
      }
      sum.bias = detail::sum_bias_tree(std::move(biases));
    }
    counters_.driver_bytes_sent += m.bytes_sent;
    counters_.driver_bytes_received += m.bytes_received;
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
  return sum;
}

DenseMatrix MpiFabric::gather_output_impl() {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  if (m.shard_tokens.empty()) throw ShapeError("MpiFabric gather_output: no batch loaded");
  std::int64_t tokens = 0;
  for (const std::int64_t t : m.shard_tokens) tokens += t;
  DenseMatrix y(m.outputs, tokens);
  try {
    Command c;
    c.op = static_cast<std::int32_t>(Op::gather_output);
    mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
    std::vector<MutableMatrixView> parts;
    std::int64_t first = 0;
    for (const std::int64_t t : m.shard_tokens) {
      parts.push_back({y.data() + first, m.outputs, t, y.stride()});
      first += t;
    }
    std::vector<MutableMatrixView*> targets;
    for (auto& p : parts) targets.push_back(&p);
    m.gather_matrices(targets);
    counters_.driver_bytes_sent += sizeof c;
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
  return y;
}

void MpiFabric::layer_activations_impl(std::int32_t layer, std::vector<ConstMatrixView>& xs,
                                       std::vector<ConstMatrixView>& dzs) {
  Impl& m = *impl_;
  check_driver(m.rank, m.stopped);
  if (m.shard_tokens.empty() || layer < 0 ||
      layer + 1 >= static_cast<std::int32_t>(m.sizes.size())) {
    throw ShapeError("MpiFabric layer activations: no layer " + std::to_string(layer) +
                     " in the engines' stores");
  }
  const auto n = static_cast<std::size_t>(m.engines());
  m.lent.clear();
  for (std::size_t k = 0; k < n; ++k) {
    m.lent.emplace_back(m.sizes[static_cast<std::size_t>(layer)], m.shard_tokens[k]);
  }
  for (std::size_t k = 0; k < n; ++k) {
    m.lent.emplace_back(m.sizes[static_cast<std::size_t>(layer) + 1], m.shard_tokens[k]);
  }
  try {
    Command c;
    c.op = static_cast<std::int32_t>(Op::layer_activations);
    c.layer = layer;
    mpi_check(MPI_Bcast(&c, sizeof c, MPI_BYTE, 0, m.comm), "command broadcast");
    for (std::size_t half = 0; half < 2; ++half) {
      std::vector<MutableMatrixView> views;
      for (std::size_t k = 0; k < n; ++k) views.push_back(m.lent[half * n + k].view());
      std::vector<MutableMatrixView*> targets;
      for (auto& v : views) targets.push_back(&v);
      m.gather_matrices(targets);
    }
    counters_.driver_bytes_sent += sizeof c;
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
  for (std::size_t k = 0; k < n; ++k) {
    xs.push_back(m.lent[k].view());
    dzs.push_back(m.lent[n + k].view());
    counters_.driver_bytes_received +=
        static_cast<std::uint64_t>(m.lent[k].rows() * m.lent[k].cols() +
                                   m.lent[n + k].rows() * m.lent[n + k].cols()) *
        sizeof(float);
  }
}

}  // namespace sluice
