#pragma once
// Internal: RigL's growth criterion, the k inactive positions with the largest |dense
// gradient| |dY X^T|, found without ever holding the dense gradient: it is computed a tile
// at a time and each tile passes through a streaming top-k.
//
// The dense gradient of the batch is a sum over the engines' token shards, so a top-k of
// each engine's partial gradient would not be the top-k of the sum (a position can be
// large in the sum and in no engine's list). Tiles are therefore summed over the engines
// first, for the same positions, and only the sum goes through the top-k: exact, and
// with the engines' shards taken in order (engine 0's tokens, then engine 1's, ...) each
// score is added up in the same order whatever the number of engines, so 1 and N engines
// choose the same positions.
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "sluice/csr_matrix.hpp"
#include "sluice/dense.hpp"
#include "sluice/isa.hpp"

namespace sluice::detail {

struct ScoredPosition {
  std::int64_t position = 0;  ///< row * cols + col
  float score = 0;
};

/// Keeps the k best positions offered: larger score first, the smaller position on a tie.
/// The order is total, so the set kept does not depend on the order of the offers, and
/// two top-k's over disjoint positions merge into the top-k of the union. Offers at or
/// above the k-th best score so far are buffered; a full buffer (2k) is cut back to its
/// best k, whose worst becomes the bar: amortised O(1) per offer, no heap.
class StreamingTopK {
 public:
  explicit StreamingTopK(std::int64_t k);

  std::int64_t capacity() const { return k_; }
  /// The score to reach (or beat on position): the k-th best so far, -inf before k.
  float bar() const { return bar_; }
  /// NaN scores are ignored.
  void offer(std::int64_t position, float score) {
    // Not better than the k-th best so far (NaN never is).
    if (!(score > bar_ || (score == bar_ && position < bar_position_))) return;
    kept_.push_back({position, score});
    if (static_cast<std::int64_t>(kept_.size()) >= 2 * k_) cut();
  }
  void merge(const StreamingTopK& other);
  /// The positions kept, in increasing order.
  std::vector<std::int64_t> positions();
  /// The positions kept with their scores, best first.
  std::vector<ScoredPosition> ranked();

 private:
  void cut();  ///< keeps the best k, sets the bar to the k-th score
  std::int64_t k_;
  /// The k-th best so far (after a cut): an offer must beat it to be kept.
  float bar_ = -std::numeric_limits<float>::infinity();
  std::int64_t bar_position_ = std::numeric_limits<std::int64_t>::max();
  std::vector<ScoredPosition> kept_;
};

/// The `k` positions inactive in `mask` with the largest |sum_e dys[e] xs[e]^T| (ties to
/// the smaller position), in increasing order; fewer if fewer scores are finite. xs[e] is
/// engine e's layer input (mask.cols() x its tokens), dys[e] its output gradient
/// (mask.rows() x the same tokens). Tiles of columns run in parallel, their products with
/// `isa`'s kernel. ShapeError on shapes that do not fit, ArgumentError for a k over the inactive
/// positions.
std::vector<std::int64_t> dense_gradient_top_k(const CsrMatrix& mask,
                                               std::span<const ConstMatrixView> xs,
                                               std::span<const ConstMatrixView> dys, std::int64_t k,
                                               Isa isa = default_isa());

// --- The same scores with every engine's tokens on its own rank (MpiFabric) ---------------
// Engine 0 computes a tile of the dense gradient over its tokens, engine 1 continues those
// sums with its tokens, and so on; the last engine offers the finished tile to the top-k.
// Each sum then runs over the tokens in dense_gradient_top_k's order, so the positions are
// the same bit for bit, and only the tiles' sums and the top-k's candidates move.

/// Columns per tile of gradient_tile.
std::int64_t gradient_tile_columns();

/// tile (dy.rows x (c1 - c0), row-major) = dy x[c0, c1)^T over this engine's tokens, or with
/// `accumulate` added to the tile's sums (the engines before it). `xt` is scratch. Rows in
/// parallel; ShapeError if x and dy do not fit.
void gradient_tile(ConstMatrixView x, ConstMatrixView dy, std::int64_t c0, std::int64_t c1,
                   bool accumulate, std::vector<float>& xt, float* tile, Isa isa = default_isa());

/// Offers the finished tile's positions inactive in `mask` (|score|) to `top`.
void offer_gradient_tile(const CsrMatrix& mask, std::int64_t c0, std::int64_t c1, const float* tile,
                         StreamingTopK& top);

}  // namespace sluice::detail
