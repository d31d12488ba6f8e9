#pragma once
// The tiling and geometry policy: how a product's work is cut into lane tasks (lanes,
// token blocks and tiles, stream shares), and how each task walks the stream. Internal.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "engine/intake.hpp"
#include "sluice/engine.hpp"

namespace sluice::detail {

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

TokenTiling make_tiling(std::int64_t tokens, const Geometry& g);

/// The geometry an engine gives a layer: fixed parts from its options, the rest chosen
/// from the layer's shape, the threads and the cache a lane's tile may fill.
class TilingPolicy {
 public:
  TilingPolicy(const Geometry& fixed, std::int32_t threads, std::int64_t tile_cache_bytes)
      : fixed_(fixed), threads_(threads), tile_cache_bytes_(tile_cache_bytes) {}

  const Geometry& fixed() const { return fixed_; }
  /// The cache all the engine's threads hold: a product's stream bigger than this is read
  /// from memory.
  std::int64_t caches() const { return tile_cache_bytes_ * threads_; }

  /// Blocks, shares and tile for `lanes` lanes holding activations in `precision`.
  Geometry resolve(std::int64_t tokens, std::int32_t lanes, Precision precision = Precision::fp32,
                   std::uint64_t nnz = std::numeric_limits<std::uint64_t>::max()) const;
  /// The whole geometry, lanes included (see Engine::geometry_for).
  Geometry geometry_for(std::int64_t inputs, std::int64_t tokens, Precision precision,
                        std::uint64_t nnz) const;

  /// The weight pass on one lane: its token blocks become stream shares (unless the
  /// geometry is fixed) where the stream has chunks enough to share evenly.
  void prefer_shares(TokenTiling& tiling, std::int32_t lanes, Intake& intake) const;
  /// Whether a one-lane pass takes each chunk in on the task about to compute it, rather
  /// than all before the pass.
  bool takes_in_as_it_goes(const TokenTiling& tiling, Intake& intake) const;

 private:
  Geometry fixed_;
  std::int32_t threads_;
  std::int64_t tile_cache_bytes_;
};

/// Runs [first, first + count) of chunk `chunk`: a one-lane forward's unit of work within
/// a token tile. Pieces are small so a thread done with its own token block can take
/// pieces of another's: cores run at different speeds (shared vCPUs, hybrid CPUs).
struct StreamPiece {
  std::size_t chunk;
  std::uint32_t first, count;
};
/// A piece's outputs (the last of a chunk's may have fewer): about 1,000 packets at
/// 99.9%, a whole 32K-packet chunk at 90%.
inline constexpr std::uint32_t kPieceOutputs = 256;
std::vector<StreamPiece> stream_pieces(const std::vector<TakenChunk>& chunks);

/// The chunks one task of a pass takes, tile after tile: its share's, or (`claims` given:
/// one lane and one block, the stream in shares) those it claims while the first tile
/// goes, kept for the later tiles. A faster core then takes more of the stream, and each
/// weight's sums still run tile after tile on one thread. On the first tile a task may
/// walk the stream as it arrives (live): claimed chunks, or every chunk with one share.
class TaskChunks {
 public:
  /// Whether a pass on `lanes` lanes claims its chunks: one lane, one block, shares.
  static bool claimed(const TokenTiling& tiling, std::int32_t lanes) {
    return lanes == 1 && tiling.blocks == 1 && tiling.shares > 1;
  }
  /// Whether its tasks can start before the stream's chunks are counted.
  static bool live(const TokenTiling& tiling, std::int32_t lanes) {
    return claimed(tiling, lanes) || tiling.shares == 1;
  }
  /// `chunks`: the stream's, or, live, none (the first tile asks `arrive` for each).
  TaskChunks(const TokenTiling& tiling, std::int32_t share, std::optional<std::size_t> chunks,
             std::atomic<std::size_t>* claims)
      : claims_(claims), live_(!chunks.has_value()) {
    if (claims != nullptr || live_) return;
    for (std::size_t c = tiling.first_chunk(share, *chunks);
         c < tiling.first_chunk(share + 1, *chunks); ++c) {
      mine_.push_back(c);
    }
  }
  /// fn(c, first_visit) for each of the task's chunks on a tile; arrive(c) says whether
  /// the stream has a chunk c (waiting for it if it may).
  template <typename Fn, typename Arrive>
  void on_tile(bool first_tile, Fn&& fn, Arrive&& arrive) {
    if (first_tile && (claims_ != nullptr || live_)) {
      auto next = [&](std::size_t c) {
        return claims_ != nullptr ? claims_->fetch_add(1, std::memory_order_relaxed) : c + 1;
      };
      for (std::size_t c = next(static_cast<std::size_t>(-1)); arrive(c); c = next(c)) {
        mine_.push_back(c);
        fn(c, true);
      }
      return;
    }
    for (const std::size_t c : mine_) fn(c, first_tile);
  }

 private:
  std::atomic<std::size_t>* claims_;
  bool live_;
  std::vector<std::size_t> mine_;
};

}  // namespace sluice::detail
