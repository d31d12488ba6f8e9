// CpuEngine: the engine on this machine's cores.
//
// Mapping of the wafer's design onto a CPU:
// * A lane task (p, q) plays engine row p on token block q. Its activation tile
//   (the rows of X it owns x `tile_tokens` tokens) is sized to stay in the core's L2
//   while the whole layer's stream flows past it, once per tile.
// * The intake checks each chunk and routes its packets to the lanes that own their
//   input features (in parallel over chunks).
// * A carriage return ends a lane's accumulation for one output; the accumulator goes to
//   the lane's partial-sum buffer. When the last lane finishes a chunk, that lane walks
//   the ring for the chunk's outputs: the partial sums are added lane after lane, starting
//   one past the lane the next layer wants the output on and ending there. No lane ever
//   waits for another, and the summation order is fixed, so results are bitwise
//   reproducible whatever the thread timing.
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <numeric>
#include <thread>
#include <type_traits>

#include "core/huge_pages.hpp"
#include "core/parallel.hpp"
#include "engine/dense_path.hpp"
#include "engine/kernels/lane_kernels.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/path_cost.hpp"
#include "sluice/topology.hpp"
#include "stream/chunk_pool.hpp"
#include "stream/stream_check.hpp"

namespace sluice {
namespace {

using detail::Bf16LaneRuns;
using detail::Bf16Tile;
using detail::LaneRuns;
using detail::MutableTile;
using detail::Runs;
using detail::Tile;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// One lane's share of one chunk. With a single lane the packets stay in the chunk
/// (no copy) and only the run bounds are recorded.
struct LaneShare {
  std::vector<Packet> packets;           // routed weight packets (empty when P == 1)
  std::vector<Bf16Packet> packets_bf16;  // the same for a bf16 stream
  std::vector<std::uint32_t> begin, end;
  std::vector<std::uint32_t> origin;  // position of each routed packet in the chunk

  std::size_t routed_count() const { return packets.size() + packets_bf16.size(); }
};

/// A lane's routed packets of one format (const or not).
template <typename PacketT, typename Share>
auto& routed(Share& share) {
  if constexpr (std::is_same_v<PacketT, Packet>) {
    return share.packets;
  } else {
    return share.packets_bf16;
  }
}

template <typename PacketT>
const auto& packets_of(const StreamChunk& chunk) {
  if constexpr (std::is_same_v<PacketT, Packet>) {
    return chunk.packets;
  } else {
    return chunk.packets_bf16;
  }
}

struct TakenChunk {
  ChunkPtr chunk;
  std::vector<LaneShare> lanes;

  template <typename PacketT>
  Runs<PacketT> runs(std::int32_t lane) const {
    const LaneShare& s = lanes[lane];
    // One lane reads the chunk in place.
    const PacketT* packets =
        lanes.size() == 1 ? packets_of<PacketT>(*chunk).data() : routed<PacketT>(s).data();
    return {packets, s.begin.data(), s.end.data(), static_cast<std::int64_t>(chunk->outputs)};
  }
};

/// The lanes' shares of a product's chunks, kept between products (per chunk position):
/// routing into fresh vectors cost a page fault per 4 KiB of routed packets (4096 x 32768
/// at 90%, two lanes: the intake took 120 ms a product, 18-19 ms with these kept). Holds
/// at most the largest stream's routed packets; a product's shares come back when it
/// ends, or are dropped if it throws.
using SpareShares = std::vector<std::vector<LaneShare>>;

/// A product's chunks as the intake took them; gives their lanes' vectors back to the
/// spares when the product is done with them.
class TakenChunks {
 public:
  explicit TakenChunks(SpareShares& spares) : spares_(spares) {}
  TakenChunks(const TakenChunks&) = delete;
  TakenChunks& operator=(const TakenChunks&) = delete;
  ~TakenChunks() {
    if (spares_.size() < chunks.size()) spares_.resize(chunks.size());
    for (std::size_t c = 0; c < chunks.size(); ++c) spares_[c] = std::move(chunks[c].lanes);
  }
  SpareShares& spares() { return spares_; }

  std::vector<TakenChunk> chunks;

 private:
  SpareShares& spares_;
};

/// Which activation rows each lane keeps resident, and where: lane p packs its rows
/// (in increasing feature order) into a buffer of its own, so its tile is contiguous and
/// stays in its core's cache without set conflicts from the matrix's row stride.
struct LaneLayout {
  std::vector<std::vector<std::uint32_t>> rows;  // rows[p]: global features of lane p
  std::vector<std::uint32_t> local;  // local[i]: row of feature i in its lane (lanes > 1)

  // Built for every product, so built in passes that do not grow vectors: pushing each
  // feature onto its lane's rows took 6.5 us for 4096 features, 4% of a 99.9% forward.
  explicit LaneLayout(const Placement& placement) : rows(placement.lanes) {
    const std::size_t n = placement.lane_of.size();
    if (placement.lanes == 1) {  // every feature in order; one lane routes nothing
      rows[0].resize(n);
      std::iota(rows[0].begin(), rows[0].end(), 0U);
      return;
    }
    std::vector<std::uint32_t> counts(rows.size(), 0);
    for (const std::int32_t lane : placement.lane_of) ++counts[lane];
    for (std::size_t p = 0; p < rows.size(); ++p) rows[p].resize(counts[p]);
    std::fill(counts.begin(), counts.end(), 0U);
    local.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::int32_t lane = placement.lane_of[i];
      local[i] = counts[lane]++;
      rows[lane][local[i]] = static_cast<std::uint32_t>(i);
    }
  }
};

/// Memory for a lane's resident tile: 2 MiB aligned and backed by huge pages where the
/// kernel allows, because a lane reads its tile at random rows and 4 KiB pages would
/// cost a TLB miss on most of those reads.
class HugePageBuffer {
 public:
  HugePageBuffer() = default;
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;
  ~HugePageBuffer() { std::free(data_); }

  float* data() const { return data_; }
  std::size_t size() const { return size_; }
  void reserve(std::size_t floats) {
    if (floats <= size_) return;
    const std::size_t bytes = detail::whole_huge_pages(floats * sizeof(float));
    void* p = detail::allocate_huge_pages(bytes);
    std::free(data_);
    data_ = static_cast<float*>(p);
    size_ = bytes / sizeof(float);
  }

 private:
  float* data_ = nullptr;
  std::size_t size_ = 0;
};

/// A lane's resident copy of its rows of a matrix, one token tile wide, in fp32 or (for
/// a bf16 stream's activations) bf16. The memory is the running thread's own and
/// outlives the call: allocating and faulting in fresh pages for every layer would cost
/// more than a small layer's whole product. (A lane task never waits, so one thread holds
/// one lane's tile at a time.)
class ResidentTile {
 public:
  ResidentTile() : data_(thread_buffer()) {}

  void resize(std::size_t rows, std::int64_t tile, Precision precision = Precision::fp32) {
    const bool bf16 = precision == Precision::bf16;
    // A one-token tile is one contiguous column (16 KiB for 4096 rows, in L1), not a
    // 64-byte line per element.
    const std::int64_t align = bf16 ? detail::kBf16RowAlign : tile == 1 ? 1 : 16;
    stride_ = static_cast<std::size_t>((tile + align - 1) / align * align);
    data_.reserve(bf16 ? (rows * stride_ + 1) / 2 : rows * stride_);
    rows_ = rows;
  }
  void load(const std::vector<std::uint32_t>& rows, const float* src, std::int64_t src_stride,
            std::int64_t t0, std::int64_t width) {
    for (std::size_t l = 0; l < rows.size(); ++l) {
      std::memcpy(data_.data() + l * stride_, src + rows[l] * src_stride + t0,
                  sizeof(float) * width);
    }
  }
  /// Rounds the rows to bf16 and pads each with zeros to the stride.
  void load_bf16(const std::vector<std::uint32_t>& rows, const float* src, std::int64_t src_stride,
                 std::int64_t t0, std::int64_t width, const detail::Bf16LaneKernels& kernels) {
    auto* dst = reinterpret_cast<std::uint16_t*>(data_.data());
    for (std::size_t l = 0; l < rows.size(); ++l) {
      // Rows asked for ahead: the rounding is work enough to hide their misses behind
      // (bf16 forward ~4% faster; a plain copy of fp32 rows gained nothing from it).
      if (l + 8 < rows.size()) {
        const float* ahead = src + rows[l + 8] * src_stride + t0;
        for (std::int64_t f = 0; f < width; f += 16) __builtin_prefetch(ahead + f, 0, 3);
      }
      kernels.pack(src + rows[l] * src_stride + t0, dst + l * stride_, width,
                   static_cast<std::int64_t>(stride_));
    }
  }
  void zero(std::int64_t width) {
    for (std::size_t l = 0; l < rows_; ++l) std::fill_n(data_.data() + l * stride_, width, 0.0F);
  }
  void store(const std::vector<std::uint32_t>& rows, float* dst, std::int64_t dst_stride,
             std::int64_t t0, std::int64_t width) const {
    for (std::size_t l = 0; l < rows.size(); ++l) {
      std::memcpy(dst + rows[l] * dst_stride + t0, data_.data() + l * stride_,
                  sizeof(float) * width);
    }
  }
  Tile tile() const { return {data_.data(), static_cast<std::int64_t>(stride_)}; }
  MutableTile mutable_tile() { return {data_.data(), static_cast<std::int64_t>(stride_)}; }
  Bf16Tile bf16_tile() const {
    return {reinterpret_cast<const std::uint16_t*>(data_.data()),
            static_cast<std::int64_t>(stride_)};
  }

 private:
  static HugePageBuffer& thread_buffer() {
    thread_local HugePageBuffer buffer;
    return buffer;
  }
  HugePageBuffer& data_;
  std::size_t rows_ = 0, stride_ = 16;
};

/// How lanes hold a layer's activations. Lanes that pack their rows hold a bf16 layer's in
/// bf16. A bf16 layer too sparse to pack, or a single token, keeps X in fp32 (converting
/// all of X would cost more than the product; one token would pad each bf16 row to 32)
/// and the fp32 table's *_bf16_packets kernels read its packets as they are.
struct Holding {
  bool pack;         ///< rows copied into a resident tile
  bool bf16;         ///< ... and held there in bf16
  bool bf16_stream;  ///< the packets are bf16
  Precision precision() const { return bf16 ? Precision::bf16 : Precision::fp32; }
};

Holding holding_for(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs, std::int64_t tokens,
                    Precision precision) {
  const bool bf16_stream = precision == Precision::bf16;
  return {CpuEngine::packs_tiles(lanes, nnz, inputs),
          bf16_stream && CpuEngine::holds_bf16(lanes, nnz, inputs, tokens), bf16_stream};
}
Holding holding_for(std::int32_t lanes, const StreamHeader& header, std::int64_t tokens) {
  return holding_for(lanes, header.nnz, header.inputs, tokens, header.precision);
}

/// Sends each weight packet of a chunk to the lane that owns its input feature, with the
/// row's index in that lane's resident buffer as its tag, and records each lane's runs.
template <typename PacketT>
void route(const StreamChunk& chunk, std::vector<LaneShare>& shares, std::uint64_t weights,
           const Placement& placement, const LaneLayout& layout, bool keep_origin) {
  const auto lanes = static_cast<std::uint64_t>(shares.size());
  for (auto& s : shares) {
    routed<PacketT>(s).reserve(weights / lanes + weights / (4 * lanes) + 16);
    if (keep_origin) s.origin.reserve(weights / lanes + weights / (4 * lanes) + 16);
  }
  const auto& packets = packets_of<PacketT>(chunk);
  std::uint32_t r = 0;
  const std::int32_t* lane_of = placement.lane_of.data();
  if (chunk.outputs > 0) {
    for (auto& s : shares) s.begin[0] = 0;
  }
  for (std::size_t k = 0; k < packets.size(); ++k) {
    const PacketT packet = packets[k];
    if (!is_control(packet)) {
      const std::uint32_t tag = tag_of(packet);
      LaneShare& s = shares[lane_of[tag]];
      if constexpr (std::is_same_v<PacketT, Packet>) {
        s.packets.push_back({layout.local[tag], packet.value});
      } else {
        s.packets_bf16.push_back({static_cast<std::uint16_t>(layout.local[tag]), packet.value});
      }
      if (keep_origin) s.origin.push_back(static_cast<std::uint32_t>(k));
    } else if (tag_of(packet) == kCarriageReturn) {
      for (auto& s : shares) {
        const auto size = static_cast<std::uint32_t>(routed<PacketT>(s).size());
        s.end[r] = size;
        if (r + 1 < chunk.outputs) s.begin[r + 1] = size;
      }
      ++r;
    }
  }
}

/// A product's intake: pulls every chunk from the source, then checks each and routes it
/// to the lanes (with several lanes, routed packets carry the row's index in its lane's
/// resident buffer). Chunks may be taken in parallel, all at once before the product
/// (take_all) or each by the task about to compute it (a one-pass product, whose stream
/// is then read once while in cache); finish() checks the whole after the last.
class Intake {
 public:
  Intake(TakenChunks& into, StreamSource& source, const Placement& placement,
         const LaneLayout& layout, bool keep_origin)
      : taken_(into.chunks),
        spares_(into.spares()),
        header_(source.header()),
        placement_(placement),
        layout_(layout),
        keep_origin_(keep_origin) {
    detail::check_header(header_);
    while (ChunkPtr chunk = source.next()) {
      detail::check_sequence(header_, *chunk, taken_.size(), outputs_, false);
      outputs_ += chunk->outputs;
      bytes_ += chunk->byte_size();
      taken_.push_back({std::move(chunk), {}});
    }
    weights_.resize(taken_.size());
    ends_.resize(taken_.size());
  }

  std::size_t chunks() const { return taken_.size(); }
  std::uint64_t bytes() const { return bytes_; }

  void take(std::size_t c) {
    const StreamChunk& chunk = *taken_[c].chunk;
    auto& shares = taken_[c].lanes;
    const std::int32_t lanes = placement_.lanes;
    if (c < spares_.size()) shares = std::move(spares_[c]);
    shares.resize(lanes);
    for (auto& s : shares) {
      s.packets.clear();
      s.packets_bf16.clear();
      s.origin.clear();
      s.begin.resize(chunk.outputs);
      s.end.resize(chunk.outputs);
    }
    // One lane: the runs lie between the carriage returns the check finds anyway.
    const detail::ChunkFacts facts =
        detail::check_chunk(header_, chunk, c, lanes == 1 ? shares[0].end.data() : nullptr);
    weights_[c] = facts.weights;
    ends_[c] = facts.ends_layer ? 1 : 0;
    if (lanes == 1) {
      auto& s = shares[0];
      for (std::uint32_t r = 0; r < chunk.outputs; ++r) s.begin[r] = r == 0 ? 0 : s.end[r - 1] + 1;
    } else if (header_.precision == Precision::bf16) {
      route<Bf16Packet>(chunk, shares, facts.weights, placement_, layout_, keep_origin_);
    } else {
      route<Packet>(chunk, shares, facts.weights, placement_, layout_, keep_origin_);
    }
  }

  void finish() const {
    std::uint64_t total = 0;
    for (std::size_t c = 0; c < taken_.size(); ++c) {
      if (ends_[c] && c + 1 != taken_.size()) {
        throw FormatError(detail::describe_chunk(*taken_[c + 1].chunk, c + 1) +
                          ": data after end-of-layer");
      }
      total += weights_[c];
    }
    detail::check_finished(header_, outputs_, total, !taken_.empty() && ends_.back());
  }

  void take_all() {
    detail::parallel_for(std::size_t{0}, taken_.size(), [&](std::size_t c) { take(c); });
    finish();
  }

 private:
  std::vector<TakenChunk>& taken_;
  SpareShares& spares_;
  const StreamHeader header_;
  const Placement& placement_;
  const LaneLayout& layout_;
  const bool keep_origin_;
  std::uint64_t outputs_ = 0;
  std::uint64_t bytes_ = 0;
  std::vector<std::uint64_t> weights_;  // per chunk, as take() found them
  std::vector<char> ends_;
};

/// How a product's tasks divide the work: the token tiles of a layer, dealt to Q blocks
/// in contiguous runs, and the stream's chunks, dealt to S shares in contiguous runs.
/// Task (p, q, s) is lane p's work on block q's tiles and share s's chunks — where it
/// starts: one-lane passes hand the rest out as they go (StreamPiece, TaskChunks).
struct TokenTiling {
  std::int64_t tokens = 0, tile = 1, count = 0;
  std::int32_t blocks = 1, shares = 1;
  std::int64_t first_tile(std::int32_t q) const { return q * count / blocks; }
  std::int64_t begin(std::int64_t t) const { return t * tile; }
  std::int64_t width(std::int64_t t) const { return std::min(tile, tokens - t * tile); }
  std::size_t first_chunk(std::int32_t s, std::size_t chunks) const {
    return static_cast<std::size_t>(s) * chunks / static_cast<std::size_t>(shares);
  }
  std::int64_t tasks(std::int32_t lanes) const { return std::int64_t{lanes} * blocks * shares; }
  struct Task {
    std::int32_t lane, block, share;
  };
  Task task(std::int64_t i, std::int32_t lanes) const {
    return {static_cast<std::int32_t>(i % lanes), static_cast<std::int32_t>(i / lanes % blocks),
            static_cast<std::int32_t>(i / lanes / blocks)};
  }
};

TokenTiling make_tiling(std::int64_t tokens, const Geometry& g) {
  TokenTiling tiling;
  tiling.tokens = tokens;
  tiling.tile = std::max<std::int64_t>(1, g.tile_tokens);
  tiling.count = (tokens + tiling.tile - 1) / tiling.tile;
  tiling.blocks = static_cast<std::int32_t>(
      std::clamp<std::int64_t>(g.blocks, 1, std::max<std::int64_t>(1, tiling.count)));
  tiling.shares = std::max(1, g.shares);
  return tiling;
}

/// Whether a one-lane pass takes each chunk in on the task about to compute it, rather
/// than all before the pass. With one token tile the stream is read once; a stream larger
/// than the threads' caches would be read from memory twice, by the check and by the
/// kernel, which now finds the chunk in cache where the check left it (4096 x 4096, one
/// token at 50%: the forward 4.3 -> 3.9 ms, the backward by input 5.0 -> 4.4; at 75% 16
/// tokens' forward 2.96 -> 2.67; 8192 x 8192 at 90%, one token 3.04 -> 2.43). A stream
/// that stays in cache gains nothing (4096 x 4096 at 90%, 8 and 16 tokens: 3-5% slower).
/// With chunks enough for the tasks to share evenly.
bool takes_in_as_it_goes(const TokenTiling& tiling, const Intake& intake,
                         std::int64_t cache_bytes) {
  constexpr std::size_t kChunksPerTask = 4;
  return tiling.count == 1 && intake.bytes() > static_cast<std::uint64_t>(cache_bytes) &&
         intake.chunks() >= kChunksPerTask * static_cast<std::size_t>(tiling.tasks(1));
}

/// Runs [first, first + count) of chunk `chunk`: a one-lane forward's unit of work within
/// a token tile. Pieces are small so a thread done with its own token block can take
/// pieces of another's: this VM's two vCPUs ran the same block at 15 and 23 ms (one of
/// them shares its core with someone), and a hybrid CPU's cores differ by design.
struct StreamPiece {
  std::size_t chunk;
  std::uint32_t first, count;
};

std::vector<StreamPiece> stream_pieces(const std::vector<TakenChunk>& chunks) {
  // About 1,000 packets at 99.9%, a whole 32K-packet chunk at 90%.
  constexpr std::uint32_t kPieceOutputs = 256;
  std::vector<StreamPiece> pieces;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const auto outputs = static_cast<std::uint32_t>(chunks[c].chunk->outputs);
    for (std::uint32_t r = 0; r < outputs; r += kPieceOutputs) {
      pieces.push_back({c, r, std::min(kPieceOutputs, outputs - r)});
    }
  }
  return pieces;
}

/// The weight pass on one lane: its token blocks become stream shares (unless the geometry
/// is fixed) where the stream has chunks enough to share evenly. Each weight then has one
/// writer, which sends its total straight out as its gradient packet: no block sums to add
/// and lay out after the pass (4096 x 4096 x 256 at 90%: the pass 13.0 -> 10.7 ms). The
/// stream is read as often either way: each share reads its part once per tile instead of
/// each block the whole stream once per tile of its own.
void prefer_shares(TokenTiling& tiling, const Geometry& fixed, std::int32_t lanes,
                   std::size_t chunks) {
  constexpr std::size_t kChunksPerShare = 8;  // so shares differ by at most ~1/8
  const std::int32_t shares = tiling.blocks * tiling.shares;
  if (lanes != 1 || fixed.blocks > 0 || fixed.shares > 0 || tiling.blocks == 1 ||
      chunks < kChunksPerShare * static_cast<std::size_t>(shares)) {
    return;
  }
  tiling.blocks = 1;
  tiling.shares = shares;
}

/// The chunks one task of a pass takes, tile after tile: its share's, or (`claims` given:
/// one lane and one block, the stream in shares) those it claims while the first tile
/// goes, kept for the later tiles. A faster core then takes more of the stream (this VM's
/// two vCPUs differ by 1.5x), and each weight's sums still run tile after tile on one
/// thread.
class TaskChunks {
 public:
  /// Whether a pass on `lanes` lanes claims its chunks: one lane, one block, shares.
  static bool claimed(const TokenTiling& tiling, std::int32_t lanes) {
    return lanes == 1 && tiling.blocks == 1 && tiling.shares > 1;
  }
  TaskChunks(const TokenTiling& tiling, std::int32_t share, std::size_t chunks,
             std::atomic<std::size_t>* claims)
      : chunks_(chunks), claims_(claims) {
    if (claims != nullptr) return;
    for (std::size_t c = tiling.first_chunk(share, chunks);
         c < tiling.first_chunk(share + 1, chunks); ++c) {
      mine_.push_back(c);
    }
  }
  /// fn(c, first_visit) for each of the task's chunks on a tile.
  template <typename Fn>
  void on_tile(bool first_tile, Fn&& fn) {
    if (first_tile && claims_ != nullptr) {
      for (std::size_t c = claims_->fetch_add(1, std::memory_order_relaxed); c < chunks_;
           c = claims_->fetch_add(1, std::memory_order_relaxed)) {
        mine_.push_back(c);
        fn(c, true);
      }
      return;
    }
    for (const std::size_t c : mine_) fn(c, first_tile);
  }

 private:
  std::size_t chunks_;
  std::atomic<std::size_t>* claims_;
  std::vector<std::size_t> mine_;
};

/// Pins each thread that joins the engine's arena to a core of its own.
class PinningObserver final : public tbb::task_scheduler_observer {
 public:
  explicit PinningObserver(tbb::task_arena& arena) : tbb::task_scheduler_observer(arena) {
    observe(true);
  }
  ~PinningObserver() override { observe(false); }
  void on_scheduler_entry(bool) override {
    pin_current_thread_to_core(tbb::this_task_arena::current_thread_index());
  }
};

}  // namespace

// Below this many flops a layer's product runs as one task: waking a second thread
// costs more than it saves.
constexpr std::uint64_t kSerialFlops = std::uint64_t{1} << 21;

struct CpuEngine::Impl {
  EngineOptions options;
  Isa isa = Isa::scalar;
  std::int32_t threads = 1;
  std::int64_t tile_cache_bytes = 0;
  /// The cache all the engine's threads hold: a product's stream bigger than this is read
  /// from memory.
  std::int64_t caches() const { return tile_cache_bytes * threads; }
  const detail::LaneKernels* kernels = nullptr;
  const detail::Bf16LaneKernels* bf16_kernels = nullptr;
  tbb::task_arena arena;
  std::unique_ptr<PinningObserver> pinning;
  // The weight gradients' partial sums (per token block, and between tiles), kept between
  // calls: faulting in fresh pages for them every backward cost more than the sums.
  std::vector<float> gradient_scratch;
  std::shared_ptr<detail::ChunkPool> gradient_chunks = std::make_shared<detail::ChunkPool>();
  // Stream shares' parts of dX (every share but the first), and with several lanes each
  // lane's partial sums of Y, kept for the same reason (4096 x 65536 at 99%, two lanes:
  // 31-47 ms a forward, 56-65 with partial sums in fresh pages).
  std::vector<float> dx_share_scratch;
  std::vector<float> lane_partial_scratch;
  SpareShares spare_shares;

  // A lane keeps one activation tile resident per pass, as wide as its kernels go: 64
  // tokens in fp32, 128 in bf16 (256 bytes a row either way). Every pass over the stream
  // costs more than the tile rows that spill from L2 to L3 (each packet's work is fixed,
  // so wider tiles amortise it): 4096 x 8192 / x 16384 at 90%, one lane, tiles of 16, 32,
  // 64 tokens: 30.7, 21.6, 18.0 ms / 85.5, 65.0, 48.8 ms. How many rows a lane holds is
  // geometry_for's choice of lanes.
  Geometry resolve(std::int64_t tokens, std::int32_t lanes, Precision precision = Precision::fp32,
                   std::uint64_t nnz = std::numeric_limits<std::uint64_t>::max()) const {
    Geometry g = options.geometry;
    if (g.blocks <= 0 &&
        nnz < kSerialFlops / 2 / static_cast<std::uint64_t>(std::max<std::int64_t>(tokens, 1))) {
      // Too little work to wake another thread for: one block does it all.
      g.blocks = 1;
    } else if (g.blocks <= 0) {
      // Split tokens first: no partial sums to reduce. Keep blocks at least 16 tokens wide
      // (narrower ones each still read the whole stream, which bounds a small batch), and
      // give threads the blocks leave idle a share of the stream each.
      const std::int32_t columns = std::max(1, threads / std::max(1, lanes));
      g.blocks =
          static_cast<std::int32_t>(std::clamp<std::int64_t>((tokens + 15) / 16, 1, columns));
      if (g.shares <= 0) g.shares = std::max(1, columns / g.blocks);
    }
    if (g.shares <= 0) g.shares = 1;
    g.lanes = lanes;
    if (g.tile_tokens <= 0) {
      const std::int64_t widest = precision == Precision::bf16 ? 128 : 64;
      const std::int64_t per_block = (tokens + g.blocks - 1) / g.blocks;
      g.tile_tokens = static_cast<std::int32_t>(std::clamp<std::int64_t>(per_block, 1, widest));
    }
    return g;
  }
};

CpuEngine::CpuEngine(EngineOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = options;
  m.isa = options.isa.value_or(default_isa());
  if (!cpu_supports(m.isa)) {
    throw ShapeError(std::string("this CPU cannot run the ") + to_string(m.isa) + " kernels");
  }
  m.kernels = &detail::lane_kernels(m.isa);
  m.bf16_kernels = &detail::bf16_lane_kernels(m.isa);
  const std::int32_t available = tbb::this_task_arena::max_concurrency();
  if (options.threads < 0) throw ShapeError("engine threads must be >= 0");
  m.threads = options.threads > 0 ? options.threads : available;
  m.tile_cache_bytes =
      options.tile_cache_bytes > 0 ? options.tile_cache_bytes : topology().cache_share_bytes();
  const Geometry& g = options.geometry;
  if (g.lanes < 0 || g.blocks < 0 || g.tile_tokens < 0 || g.shares < 0) {
    throw ShapeError("engine geometry must not be negative: " + g.to_string());
  }
  m.arena.initialize(m.threads);
  if (options.pin_threads) m.pinning = std::make_unique<PinningObserver>(m.arena);
}

CpuEngine::~CpuEngine() = default;

bool CpuEngine::packs_tiles(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs) {
  // Packing pays when each row is read many times per pass; a very sparse layer reads
  // most rows a few times, and copying them would cost more than it saves. Several lanes
  // always pack: their packets carry indices into the packed rows.
  constexpr std::uint64_t kReadsPerRow = 16;
  return lanes > 1 ||
         nnz >= kReadsPerRow * static_cast<std::uint64_t>(std::max<std::int64_t>(inputs, 0));
}

bool CpuEngine::holds_bf16(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs,
                           std::int64_t tokens) {
  return tokens != 1 && packs_tiles(lanes, nnz, inputs);
}

Isa CpuEngine::isa() const {
  return impl_->isa;
}
std::int32_t CpuEngine::threads() const {
  return impl_->threads;
}

Geometry CpuEngine::geometry_for(std::int64_t outputs, std::int64_t inputs, std::int64_t tokens,
                                 Precision precision, std::uint64_t nnz) const {
  (void)outputs;
  const Impl& m = *impl_;
  // As the products decide: how the lanes hold X (its precision), and resolve's serial case.
  auto resolved = [&](std::int32_t lanes) {
    if (nnz == 0) return std::pair{m.resolve(tokens, lanes, precision), precision};
    const Precision held = holding_for(lanes, nnz, inputs, tokens, precision).precision();
    return std::pair{m.resolve(tokens, lanes, held, nnz), held};
  };
  if (m.options.geometry.lanes > 0) return resolved(m.options.geometry.lanes).first;
  // Input features are split over lanes only when a lane's tile of all of them would not
  // fit its core's share of the caches: routing each packet to its lane and adding up the
  // partial sums cost more than tile rows read from L3 (4096 x 32768 at 90%, one lane
  // 118-122 ms, two 132-134; 4096 x 65536 at 99%, one lane 46-66 ms, two 31-32), and a small
  // batch is bound by reading the stream, not by arithmetic (4096 x 4096 at 90%, 1-16
  // tokens: 2 lanes took 2-3x one lane's time).
  for (std::int32_t lanes = 1;; lanes *= 2) {
    const auto [g, held] = resolved(lanes);
    const std::int64_t features = (inputs + lanes - 1) / lanes;
    const std::int64_t row_bytes = held == Precision::bf16
                                       ? 2 * ((g.tile_tokens + detail::kBf16RowAlign - 1) /
                                              detail::kBf16RowAlign * detail::kBf16RowAlign)
                                       : 4 * std::int64_t{g.tile_tokens};
    if (lanes >= 256 || features * row_bytes <= m.tile_cache_bytes) return g;
  }
}

ProductPath CpuEngine::path_for(const StreamHeader& header, std::int64_t tokens) const {
  if (impl_->options.path != ProductPath::automatic) return impl_->options.path;
  return PathCosts::for_this_cpu().choose(header.layer_outputs(), header.layer_inputs(),
                                          static_cast<double>(header.nnz), tokens, header.precision,
                                          impl_->threads);
}

void CpuEngine::forward_impl(StreamSource& weights, const Placement& placement, ConstMatrixView x,
                             MutableMatrixView y, const Placement* next_placement) {
  Impl& m = *impl_;
  if (path_for(weights.header(), x.cols) == ProductPath::dense) {
    detail::DensePath(m.arena).forward(weights, x, y, counters_);
    return;
  }
  const std::int32_t P = placement.lanes;
  // (Plain bools, not a structured binding: lambdas below capture them, which Clang 14,
  // the sanitizer and fuzz builds' compiler, cannot do with bindings.)
  const Holding holding = holding_for(P, weights.header(), x.cols);
  const bool pack = holding.pack, bf16 = holding.bf16, bf16_stream = holding.bf16_stream;
  const Geometry g = m.resolve(x.cols, P, holding.precision(), weights.header().nnz);
  const TokenTiling tiling = make_tiling(x.cols, g);
  const auto t_intake = Clock::now();
  const LaneLayout layout(placement);
  TakenChunks taken(m.spare_shares);
  Intake intake(taken, weights, placement, layout, false);
  const std::vector<TakenChunk>& chunks = taken.chunks;
  const std::int64_t tokens = x.cols;
  const std::int64_t outputs = y.rows;
  const bool fused = P == 1 && outputs > 0 && takes_in_as_it_goes(tiling, intake, m.caches());
  if (!fused) m.arena.execute([&] { intake.take_all(); });
  counters_.intake_seconds += seconds_since(t_intake);
  if (tokens == 0 || outputs == 0) return;

  // With several lanes, each keeps its partial sums for every output and token until the
  // ring has taken them; tiles of all blocks share the buffer by column. Every run ends in
  // a carriage return, so a lane writes each output of its chunks: no zeroing needed.
  const std::int64_t partial_stride = (tokens + 15) / 16 * 16;
  const auto partial_size = static_cast<std::size_t>(outputs * partial_stride);
  std::vector<std::atomic<std::int32_t>> arrivals;
  if (P > 1) {
    if (m.lane_partial_scratch.size() < P * partial_size) {
      m.lane_partial_scratch.resize(P * partial_size);
    }
    arrivals = std::vector<std::atomic<std::int32_t>>(tiling.count * chunks.size());
  }
  auto partial_row = [&](std::int32_t lane, std::int64_t o) {
    return m.lane_partial_scratch.data() + lane * partial_size + o * partial_stride;
  };
  auto ring_reduce = [&](std::int64_t t, std::size_t c) {
    const StreamChunk& chunk = *chunks[c].chunk;
    const std::int64_t t0 = tiling.begin(t), width = tiling.width(t);
    for (std::int64_t o = chunk.first_output; o < chunk.first_output + chunk.outputs; ++o) {
      const std::int32_t home =
          next_placement != nullptr ? next_placement->lane_of[o] % P : default_output_lane(o, P);
      float* out = y.row(o) + t0;
      std::int32_t lane = (home + 1) % P;
      std::memcpy(out, partial_row(lane, o) + t0, sizeof(float) * width);
      for (std::int32_t s = 1; s < P; ++s) {
        lane = (lane + 1) % P;
        const float* in = partial_row(lane, o) + t0;
        for (std::int64_t i = 0; i < width; ++i) out[i] += in[i];
      }
    }
  };

  // Lane p's rows of X for tile t, as its kernels read them (packed, or in place).
  auto load_tile = [&](ResidentTile& resident, std::int32_t p, std::int64_t t) {
    const std::int64_t t0 = tiling.begin(t), width = tiling.width(t);
    if (bf16) {
      resident.load_bf16(layout.rows[p], x.data, x.stride, t0, width, *m.bf16_kernels);
    } else if (pack) {
      resident.load(layout.rows[p], x.data, x.stride, t0, width);
    }
  };
  // Lane p's product of tile t for runs [first, first + count) of chunk c into `out`,
  // whichever the stream's format.
  auto product = [&](const ResidentTile& resident, std::int32_t p, std::int64_t t, std::size_t c,
                     std::uint32_t first, std::uint32_t count, MutableTile out) {
    const std::int64_t width = tiling.width(t);
    auto part = [&](auto runs) {
      runs.begin += first;
      runs.end += first;
      runs.runs = count;
      return runs;
    };
    if (bf16) {
      m.bf16_kernels->forward(part(chunks[c].runs<Bf16Packet>(p)), resident.bf16_tile(), out,
                              width);
    } else {
      const Tile x_tile = pack ? resident.tile() : Tile{x.data + tiling.begin(t), x.stride};
      if (bf16_stream) {
        m.kernels->forward_bf16_packets(part(chunks[c].runs<Bf16Packet>(p)), x_tile, out, width);
      } else {
        m.kernels->forward(part(chunks[c].runs<Packet>(p)), x_tile, out, width);
      }
    }
  };

  std::vector<double> busy(static_cast<std::size_t>(tiling.tasks(P)), 0.0);
  // The one-lane tasks: work(task, resident) each, with a tile of its own.
  auto one_lane_tasks = [&](auto&& work) {
    m.arena.execute([&] {
      detail::parallel_for(
          std::int64_t{0}, tiling.tasks(1),
          [&](std::int64_t task) {
            const auto t_start = Clock::now();
            ResidentTile resident;
            if (pack) resident.resize(layout.rows[0].size(), tiling.tile, holding.precision());
            work(task, resident);
            busy[task] = seconds_since(t_start);
          },
          /*one_task_each=*/true);
    });
  };
  if (fused) {
    std::atomic<std::size_t> next_chunk{0};
    one_lane_tasks([&](std::int64_t /*task*/, ResidentTile& resident) {
      load_tile(resident, 0, 0);
      for (;;) {
        const std::size_t c = next_chunk.fetch_add(1, std::memory_order_relaxed);
        if (c >= chunks.size()) break;
        intake.take(c);
        const StreamChunk& chunk = *chunks[c].chunk;
        product(resident, 0, 0, c, 0, static_cast<std::uint32_t>(chunk.outputs),
                {y.row(chunk.first_output), y.stride});
      }
    });
    intake.finish();
  } else if (P == 1) {
    // Items are (tile, piece), numbered tile by tile; block q's are those of its tiles.
    // Each task works through its own block from the front, then takes what is left of
    // the others' from the back, so it packs tiles their owners will not reach; an item
    // is claimed once, and a side stops where it finds the other's claim. Every item
    // writes its own part of Y the same way whoever runs it: results stay bitwise
    // reproducible.
    const std::vector<StreamPiece> pieces = stream_pieces(chunks);
    const auto per_tile = static_cast<std::int64_t>(pieces.size());
    std::vector<std::atomic<std::uint8_t>> claimed(
        static_cast<std::size_t>(tiling.count * per_tile));
    std::vector<std::atomic<std::int64_t>> front(static_cast<std::size_t>(tiling.blocks));
    std::vector<std::atomic<std::int64_t>> back(static_cast<std::size_t>(tiling.blocks));
    auto claim = [&](std::int64_t item) {
      return claimed[static_cast<std::size_t>(item)].exchange(1, std::memory_order_relaxed) == 0;
    };
    one_lane_tasks([&](std::int64_t task, ResidentTile& resident) {
      std::int64_t held = -1;
      auto run = [&](std::int64_t item) {
        const std::int64_t t = item / per_tile;
        if (t != held) load_tile(resident, 0, t);
        held = t;
        const StreamPiece& piece = pieces[static_cast<std::size_t>(item % per_tile)];
        const std::int64_t row = chunks[piece.chunk].chunk->first_output + piece.first;
        product(resident, 0, t, piece.chunk, piece.first, piece.count,
                {y.row(row) + tiling.begin(t), y.stride});
      };
      const std::int32_t home = tiling.task(task, 1).block;
      for (std::int32_t k = 0; k < tiling.blocks; ++k) {
        const std::int32_t q = (home + k) % tiling.blocks;
        const std::int64_t lo = tiling.first_tile(q) * per_tile;
        const std::int64_t hi = tiling.first_tile(q + 1) * per_tile;
        auto& taken = (k == 0 ? front : back)[static_cast<std::size_t>(q)];
        for (;;) {
          const std::int64_t n = taken.fetch_add(1, std::memory_order_relaxed);
          const std::int64_t item = k == 0 ? lo + n : hi - 1 - n;
          if (item < lo || item >= hi || !claim(item)) break;
          run(item);
        }
      }
    });
  } else {
    m.arena.execute([&] {
      detail::parallel_for(
          std::int64_t{0}, tiling.tasks(P),
          [&](std::int64_t task) {
            const TokenTiling::Task here = tiling.task(task, P);
            const std::int32_t p = here.lane, q = here.block, share = here.share;
            const std::size_t c_end = tiling.first_chunk(share + 1, chunks.size());
            const auto t_start = Clock::now();
            ResidentTile resident;
            if (pack) resident.resize(layout.rows[p].size(), tiling.tile, holding.precision());
            for (std::int64_t t = tiling.first_tile(q); t < tiling.first_tile(q + 1); ++t) {
              load_tile(resident, p, t);
              for (std::size_t c = tiling.first_chunk(share, chunks.size()); c < c_end; ++c) {
                const StreamChunk& chunk = *chunks[c].chunk;
                product(resident, p, t, c, 0, static_cast<std::uint32_t>(chunk.outputs),
                        {partial_row(p, chunk.first_output) + tiling.begin(t), partial_stride});
                auto& arrived = arrivals[t * chunks.size() + c];
                if (arrived.fetch_add(1, std::memory_order_acq_rel) == P - 1) ring_reduce(t, c);
              }
            }
            busy[task] = seconds_since(t_start);
          },
          /*one_task_each=*/true);
    });
  }
  for (double b : busy) counters_.busy_seconds += b;
  for (const auto& c : chunks) {
    counters_.packets += c.chunk->size();
    counters_.bytes += c.chunk->byte_size();
  }
}

WeightStream CpuEngine::backward_impl(StreamSource& weights, const Placement& placement,
                                      const ConstMatrixView* x, ConstMatrixView dy,
                                      MutableMatrixView* dx) {
  Impl& m = *impl_;
  const StreamHeader header = weights.header();
  if (path_for(header, dy.cols) == ProductPath::dense) {
    return detail::DensePath(m.arena).backward(weights, x, dy, dx, counters_);
  }
  const bool want_grad = x != nullptr;
  // By output, the lanes hold rows of dX or X, the stream's tags; by input, one lane holds
  // all of dY, the stream's tags again, and walks the input features as the runs. A bf16
  // layer holds what it packs in bf16: X by output, dY by input (halving the bytes each
  // weight gathers; dX, X and every sum stay fp32).
  const bool by_input = header.by_input();
  const std::int64_t tags = header.inputs;
  const Placement one_lane = by_input ? Placement::single_lane(tags) : Placement{};
  const Placement& lanes_of = by_input ? one_lane : placement;
  const std::int32_t P = lanes_of.lanes;
  const bool packs_dy = by_input && packs_tiles(1, header.nnz, tags);
  const bool dy_in_bf16 =
      header.precision == Precision::bf16 && holds_bf16(1, header.nnz, tags, dy.cols);
  const Holding holding = by_input
                              ? Holding{packs_dy, dy_in_bf16, header.precision == Precision::bf16}
                              : holding_for(P, header, dy.cols);
  const bool pack = holding.pack, bf16 = holding.bf16, bf16_stream = holding.bf16_stream;
  // dX accumulates in an fp32 tile; X is held as holding_for says for dW.
  const TokenTiling data_tiling =
      make_tiling(dy.cols, m.resolve(dy.cols, P, Precision::fp32, header.nnz));
  TokenTiling weight_tiling =
      make_tiling(dy.cols, m.resolve(dy.cols, P, holding.precision(), header.nnz));
  const auto t_intake = Clock::now();
  const LaneLayout layout(lanes_of);
  TakenChunks taken(m.spare_shares);
  Intake intake(taken, weights, lanes_of, layout, P > 1);
  const std::vector<TakenChunk>& chunks = taken.chunks;
  // By input each run's dX row has one writer either way; shares give each weight one too.
  if (want_grad || by_input) prefer_shares(weight_tiling, m.options.geometry, P, chunks.size());
  const bool fused = by_input && takes_in_as_it_goes(weight_tiling, intake, m.caches());
  if (!fused) m.arena.execute([&] { intake.take_all(); });
  counters_.intake_seconds += seconds_since(t_intake);

  const std::int32_t S = data_tiling.shares;
  // Stream shares each add their chunks' part of dX: share 0 into dX, the others into
  // their own matrices, added to dX after the pass in share order (so the sums are the
  // same whatever the thread timing).
  std::vector<MutableMatrixView> dx_shares;
  if (!by_input && dx != nullptr && S > 1 && dy.cols > 0) {
    const auto size = static_cast<std::size_t>(dx->rows * dx->cols);
    if (m.dx_share_scratch.size() < (S - 1) * size) m.dx_share_scratch.resize((S - 1) * size);
    for (std::int32_t share = 1; share < S; ++share) {
      dx_shares.push_back(
          {m.dx_share_scratch.data() + (share - 1) * size, dx->rows, dx->cols, dx->cols});
    }
  }

  // The gradient stream leaves in the weight stream's order: same tags, same controls,
  // in fp32 whatever the weights' precision (the optimizer's sums want every bit). Its
  // chunks are written by the weight pass's tasks, each for the chunks it reads.
  std::vector<std::shared_ptr<StreamChunk>> gradient(want_grad ? chunks.size() : 0);
  for (std::size_t c = 0; c < gradient.size(); ++c) {
    gradient[c] = m.gradient_chunks->take(chunks.size());
    gradient[c]->first_output = chunks[c].chunk->first_output;
    gradient[c]->outputs = chunks[c].chunk->outputs;
    gradient[c]->packets.resize(chunks[c].chunk->size());
  }
  // The weight stream's tags with zero values (plain loops over plain pointers, so they
  // vectorise), for packets [k, end) of chunk c.
  auto copy_tags = [&](std::size_t c, Packet* to, std::uint32_t k, std::uint32_t end) {
    const StreamChunk& chunk = *chunks[c].chunk;
    if (header.precision == Precision::bf16) {
      const Bf16Packet* from = chunk.packets_bf16.data();
      for (; k < end; ++k) to[k] = {tag_of(from[k]), 0.0F};
    } else {
      const Packet* from = chunk.packets.data();
      for (; k < end; ++k) to[k] = {from[k].tag, 0.0F};
    }
  };
  // With one lane and one block, each weight has one writer, and the kernels send each
  // weight's total straight out as its gradient packet on the last tile; the control
  // packets, between the lane's runs, are written here. Otherwise every block (and lane,
  // whose packets are routed) keeps sums of its own, added up after the pass in a fixed
  // order, so sums are reproducible.
  const std::int32_t Q = weight_tiling.blocks;
  const bool direct = P == 1 && Q == 1;
  auto write_controls = [&](std::size_t c) {
    const LaneShare& runs = chunks[c].lanes[0];
    Packet* to = gradient[c]->packets.data();
    std::uint32_t k = 0;
    for (std::uint32_t r = 0; r < chunks[c].chunk->outputs; ++r) {
      copy_tags(c, to, k, runs.begin[r]);
      k = runs.end[r];
    }
    copy_tags(c, to, k, static_cast<std::uint32_t>(chunks[c].chunk->size()));
  };
  // partials[q][c]: block q's sums for the packets of chunk c (P == 1), or for the lane's
  // routed packets, lane after lane (P > 1). The first tile overwrites them: no zeroing.
  std::vector<std::vector<float*>> partials(want_grad ? Q : 0);
  // Offsets of each lane's routed packets inside a chunk's gradient buffer.
  auto lane_offset = [&](std::size_t c, std::int32_t p) {
    std::size_t off = 0;
    for (std::int32_t l = 0; l < p; ++l) off += chunks[c].lanes[l].routed_count();
    return off;
  };
  if (!partials.empty()) {
    std::size_t packets = 0;
    for (const auto& c : chunks) packets += c.chunk->size();
    if (m.gradient_scratch.size() < Q * packets) m.gradient_scratch.resize(Q * packets);
    float* next = m.gradient_scratch.data();
    for (auto& per_chunk : partials) {
      for (const auto& c : chunks) {
        per_chunk.push_back(next);
        next += c.chunk->size();
      }
    }
  }
  // Task (p, q)'s sums for chunk c on tile t of `tiling`: see GradientSums.
  auto sums_of = [&](const TokenTiling& tiling, std::int32_t p, std::int32_t q, std::size_t c,
                     std::int64_t t) {
    if (!want_grad) return detail::GradientSums{};
    const bool last = t + 1 == tiling.first_tile(q + 1);
    return detail::GradientSums{partials[q][c] + (P > 1 ? lane_offset(c, p) : 0),
                                direct && last ? gradient[c]->packets.data() : nullptr,
                                t == tiling.first_tile(q)};
  };
  // By output: two passes over the stream, dX then dW, each keeping one matrix resident:
  // a fused pass would have to keep X and dX in cache together, halving the tile and
  // doubling the passes over the stream, which costs more than the second pass.
  std::vector<double> busy(
      static_cast<std::size_t>(std::max(data_tiling.tasks(P), weight_tiling.tasks(P))), 0.0);
  auto lane_pass = [&](bool data_pass) {
    const TokenTiling& tiling = data_pass ? data_tiling : weight_tiling;
    const Precision tile_precision = !data_pass && bf16 ? Precision::bf16 : Precision::fp32;
    // The data pass keeps its shares' chunks: each share adds into a dX of its own, and
    // those are summed in share order, so which chunks a share has fixes the sums.
    std::atomic<std::size_t> claims{0};
    const bool claim = !data_pass && TaskChunks::claimed(tiling, P);
    detail::parallel_for(
        std::int64_t{0}, tiling.tasks(P),
        [&](std::int64_t task) {
          const TokenTiling::Task here = tiling.task(task, P);
          const std::int32_t p = here.lane, q = here.block, share = here.share;
          TaskChunks mine(tiling, share, chunks.size(), claim ? &claims : nullptr);
          const auto t_start = Clock::now();
          const auto& rows = layout.rows[p];
          const MutableMatrixView target = !data_pass ? MutableMatrixView{}
                                           : share == 0
                                               ? *dx
                                               : dx_shares[static_cast<std::size_t>(share) - 1];
          ResidentTile resident;
          if (pack) resident.resize(rows.size(), tiling.tile, tile_precision);
          for (std::int64_t t = tiling.first_tile(q); t < tiling.first_tile(q + 1); ++t) {
            const std::int64_t t0 = tiling.begin(t), width = tiling.width(t);
            if (data_pass && pack) {
              resident.zero(width);
            } else if (data_pass) {
              for (std::int64_t r = 0; r < target.rows; ++r) {
                std::fill_n(target.row(r) + t0, width, 0.0F);
              }
            } else if (bf16) {
              resident.load_bf16(rows, x->data, x->stride, t0, width, *m.bf16_kernels);
            } else if (pack) {
              resident.load(rows, x->data, x->stride, t0, width);
            }
            const MutableTile dx_tile =
                pack ? resident.mutable_tile()
                     : MutableTile{target.data != nullptr ? target.data + t0 : nullptr,
                                   target.stride};
            const Tile x_tile =
                pack ? resident.tile()
                     : Tile{x != nullptr ? x->data + t0 : nullptr, x != nullptr ? x->stride : 0};
            mine.on_tile(t == tiling.first_tile(q), [&](std::size_t c, bool first_visit) {
              if (first_visit && direct && !data_pass) write_controls(c);
              const StreamChunk& chunk = *chunks[c].chunk;
              const Tile dy_tile{dy.row(chunk.first_output) + t0, dy.stride};
              if (bf16_stream && data_pass) {
                m.bf16_kernels->backward_data(chunks[c].runs<Bf16Packet>(p), dy_tile, dx_tile,
                                              width);
              } else if (bf16) {
                m.bf16_kernels->backward_weight(chunks[c].runs<Bf16Packet>(p), dy_tile,
                                                resident.bf16_tile(), sums_of(tiling, p, q, c, t),
                                                width);
              } else if (bf16_stream) {
                m.kernels->backward_weight_bf16_packets(chunks[c].runs<Bf16Packet>(p), dy_tile,
                                                        x_tile, sums_of(tiling, p, q, c, t), width);
              } else if (data_pass) {
                m.kernels->backward_data(chunks[c].runs<Packet>(p), dy_tile, dx_tile, width);
              } else {
                m.kernels->backward_weight(chunks[c].runs<Packet>(p), dy_tile, x_tile,
                                           sums_of(tiling, p, q, c, t), width);
              }
            });
            if (data_pass && pack) resident.store(rows, target.data, target.stride, t0, width);
          }
          busy[task] += seconds_since(t_start);
        },
        /*one_task_each=*/true);
  };
  // By input: one pass, dY resident, both gradients per run (see ByInputKernel). Each run
  // writes its own dX row, so the stream's chunks can be claimed (TaskChunks).
  auto by_input_pass = [&] {
    const TokenTiling& tiling = weight_tiling;
    const bool claim_chunks = TaskChunks::claimed(tiling, 1);
    std::atomic<std::size_t> claims{0};
    detail::parallel_for(
        std::int64_t{0}, tiling.tasks(1),
        [&](std::int64_t task) {
          const TokenTiling::Task here = tiling.task(task, 1);
          const std::int32_t q = here.block, share = here.share;
          const auto t_start = Clock::now();
          TaskChunks mine(tiling, share, chunks.size(), claim_chunks ? &claims : nullptr);
          ResidentTile resident;
          if (pack) resident.resize(layout.rows[0].size(), tiling.tile, holding.precision());
          for (std::int64_t t = tiling.first_tile(q); t < tiling.first_tile(q + 1); ++t) {
            const std::int64_t t0 = tiling.begin(t), width = tiling.width(t);
            if (bf16) {
              resident.load_bf16(layout.rows[0], dy.data, dy.stride, t0, width, *m.bf16_kernels);
            } else if (pack) {
              resident.load(layout.rows[0], dy.data, dy.stride, t0, width);
            }
            const Tile dy_tile = pack ? resident.tile() : Tile{dy.data + t0, dy.stride};
            auto run = [&](std::size_t c) {
              const std::int64_t first = chunks[c].chunk->first_output;  // an input feature
              const Tile x_rows =
                  want_grad ? Tile{x->row(first) + t0, x->stride} : Tile{nullptr, 0};
              const MutableTile dx_rows =
                  dx != nullptr ? MutableTile{dx->row(first) + t0, dx->stride} : MutableTile{};
              const detail::GradientSums sums = sums_of(tiling, 0, q, c, t);
              if (bf16) {
                m.bf16_kernels->backward_by_input_held(chunks[c].runs<Bf16Packet>(0),
                                                       resident.bf16_tile(), x_rows, dx_rows, sums,
                                                       width);
              } else if (bf16_stream) {
                m.bf16_kernels->backward_by_input(chunks[c].runs<Bf16Packet>(0), dy_tile, x_rows,
                                                  dx_rows, sums, width);
              } else {
                m.kernels->backward_by_input(chunks[c].runs<Packet>(0), dy_tile, x_rows, dx_rows,
                                             sums, width);
              }
            };
            mine.on_tile(t == tiling.first_tile(q), [&](std::size_t c, bool first_visit) {
              if (first_visit && fused) intake.take(c);
              if (first_visit && direct && want_grad) write_controls(c);
              run(c);
            });
          }
          busy[task] += seconds_since(t_start);
        },
        /*one_task_each=*/true);
  };
  m.arena.execute([&] {
    if (dy.cols == 0) return;
    if (by_input) {
      by_input_pass();
      if (fused) intake.finish();
      return;
    }
    if (dx != nullptr) lane_pass(true);
    if (!dx_shares.empty()) {
      detail::parallel_for(std::int64_t{0}, dx->rows, [&](std::int64_t r) {
        float* out = dx->row(r);
        for (const MutableMatrixView& part : dx_shares) {
          const float* in = part.row(r);
          for (std::int64_t t = 0; t < dx->cols; ++t) out[t] += in[t];
        }
      });
    }
    if (want_grad) lane_pass(false);
  });
  for (double b : busy) counters_.busy_seconds += b;

  for (const auto& c : chunks) {
    counters_.packets += c.chunk->size();
    counters_.bytes += c.chunk->byte_size();
  }
  if (!want_grad) return {};

  // Gradients summed in per-block buffers, and any chunk no task wrote (no tokens: no lane
  // ran, and the gradient is zero), are laid out here.
  if (!direct || dy.cols == 0) {
    m.arena.execute([&] {
      detail::parallel_for(std::size_t{0}, chunks.size(), [&](std::size_t c) {
        Packet* to = gradient[c]->packets.data();
        const auto n = static_cast<std::uint32_t>(gradient[c]->packets.size());
        copy_tags(c, to, 0, n);
        const std::int32_t blocks = dy.cols > 0 ? Q : 0;  // (direct here: no tokens)
        for (std::int32_t q = 0; q < blocks; ++q) {
          const float* part = partials[q][c];
          if (P == 1) {  // in place: block q's k-th sum is packet k's (none for controls)
            for (std::uint32_t k = 0; k < n; ++k) to[k].value += is_control(to[k]) ? 0.0F : part[k];
            continue;
          }
          // routed: each lane's values go back to their packets' positions
          std::size_t off = 0;
          for (std::int32_t l = 0; l < P; ++l) {
            const auto& origin = chunks[c].lanes[l].origin;
            for (std::size_t k = 0; k < origin.size(); ++k) {
              to[origin[k]].value += part[off + k];
            }
            off += origin.size();
          }
        }
      });
    });
  }
  WeightStream out;
  out.header = header;
  out.header.kind = StreamKind::gradient;
  out.header.precision = Precision::fp32;
  out.chunks.assign(gradient.begin(), gradient.end());
  counters_.bytes += out.byte_size();  // the gradient stream going out
  return out;
}

}  // namespace sluice
