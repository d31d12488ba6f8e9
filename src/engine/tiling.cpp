#include "engine/tiling.hpp"

#include "engine/holding.hpp"

namespace sluice::detail {
namespace {

// Below this many flops a layer's product runs as one task: waking a second thread
// costs more than it saves.
constexpr std::uint64_t kSerialFlops = std::uint64_t{1} << 21;

}  // namespace

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

// A lane keeps one activation tile resident per pass, as wide as its kernels go: 64
// tokens in fp32, 128 in bf16 (256 bytes a row either way). Each packet's work is fixed,
// so wider tiles amortise it over more tokens, and every pass over the stream costs more
// than the tile rows that spill from L2 to L3. How many rows a lane holds is the choice
// of lanes (geometry_for).
Geometry TilingPolicy::resolve(std::int64_t tokens, std::int32_t lanes, Precision precision,
                               std::uint64_t nnz) const {
  Geometry g = fixed_;
  if (g.blocks <= 0 &&
      nnz < kSerialFlops / 2 / static_cast<std::uint64_t>(std::max<std::int64_t>(tokens, 1))) {
    // Too little work to wake another thread for: one block does it all.
    g.blocks = 1;
  } else if (g.blocks <= 0) {
    // Split tokens first: no partial sums to reduce. Keep blocks at least 16 tokens wide
    // (narrower ones each still read the whole stream, which bounds a small batch), and
    // give threads the blocks leave idle a share of the stream each.
    const std::int32_t columns = std::max(1, threads_ / std::max(1, lanes));
    g.blocks = static_cast<std::int32_t>(std::clamp<std::int64_t>((tokens + 15) / 16, 1, columns));
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

Geometry TilingPolicy::geometry_for(std::int64_t inputs, std::int64_t tokens, Precision precision,
                                    std::uint64_t nnz) const {
  // As the products decide: how the lanes hold X (its precision), and resolve's serial case.
  auto resolved = [&](std::int32_t lanes) {
    if (nnz == 0) return std::pair{resolve(tokens, lanes, precision), precision};
    const Precision held = holding_for(lanes, nnz, inputs, tokens, precision).precision();
    return std::pair{resolve(tokens, lanes, held, nnz), held};
  };
  if (fixed_.lanes > 0) return resolved(fixed_.lanes).first;
  // Input features are split over lanes only when a lane's tile of all of them would not
  // fit its core's share of the caches: routing each packet to its lane and adding up the
  // partial sums cost more than tile rows read from L3, and a small batch is bound by
  // reading the stream, not by arithmetic.
  for (std::int32_t lanes = 1;; lanes *= 2) {
    const auto [g, held] = resolved(lanes);
    const std::int64_t features = (inputs + lanes - 1) / lanes;
    const std::int64_t row_bytes =
        held == Precision::bf16
            ? 2 * ((g.tile_tokens + kBf16RowAlign - 1) / kBf16RowAlign * kBf16RowAlign)
            : 4 * std::int64_t{g.tile_tokens};
    if (lanes >= 256 || features * row_bytes <= tile_cache_bytes_) return g;
  }
}

// Each weight then has one writer, which sends its total straight out as its gradient
// packet: no block sums to add and lay out after the pass. The stream is read as often
// either way: each share reads its part once per tile instead of each block the whole
// stream once per tile of its own.
// (The chunks are counted as they arrive: the decision waits for that many, not for the
// whole stream.)
void TilingPolicy::prefer_shares(TokenTiling& tiling, std::int32_t lanes, Intake& intake) const {
  constexpr std::size_t kChunksPerShare = 8;  // so shares differ by at most ~1/8
  const std::int32_t shares = tiling.blocks * tiling.shares;
  if (lanes != 1 || fixed_.blocks > 0 || fixed_.shares > 0 || tiling.blocks == 1 ||
      !intake.has_at_least(kChunksPerShare * static_cast<std::size_t>(shares))) {
    return;
  }
  tiling.blocks = 1;
  tiling.shares = shares;
}

// With one token tile the stream is read once; a stream larger than the threads' caches
// would be read from memory twice, by the check and by the kernel, which now finds the
// chunk in cache where the check left it. A stream that stays in cache gains nothing
// (and loses the parallel check before the pass). With chunks enough for the tasks to
// share evenly (counted as they arrive: the decision waits for that many at most).
bool TilingPolicy::takes_in_as_it_goes(const TokenTiling& tiling, Intake& intake) const {
  constexpr std::size_t kChunksPerTask = 4;
  return tiling.count == 1 && intake.expected_bytes() > static_cast<std::uint64_t>(caches()) &&
         intake.has_at_least(kChunksPerTask * static_cast<std::size_t>(tiling.tasks(1)));
}

std::vector<StreamPiece> stream_pieces(const std::vector<TakenChunk>& chunks) {
  std::vector<StreamPiece> pieces;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const auto outputs = static_cast<std::uint32_t>(chunks[c].chunk->outputs);
    for (std::uint32_t r = 0; r < outputs; r += kPieceOutputs) {
      pieces.push_back({c, r, std::min(kPieceOutputs, outputs - r)});
    }
  }
  return pieces;
}

}  // namespace sluice::detail
