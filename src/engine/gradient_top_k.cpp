// RigL's growth criterion without the dense gradient (gradient_top_k.hpp).
#include "engine/gradient_top_k.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>

#include <oneapi/tbb/task_arena.h>

#include "core/parallel.hpp"
#include "engine/kernels/gradient_rows.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

/// a is the better position: larger score, then smaller position.
bool better(const ScoredPosition& a, const ScoredPosition& b) {
  return a.score > b.score || (a.score == b.score && a.position < b.position);
}

// Columns per tile: the tile's slice of X^T (tokens x columns) stays in L1 while every
// row of dY passes over it.
constexpr std::int64_t kTileColumns = 128;
// Column tiles go to one task per thread, at most this many: each task keeps a top-k of
// its own (up to 2k entries), and every extra one takes in more candidates that the merge
// throws away.
constexpr std::int64_t kMaxTasks = 8;

/// Scores the columns [c0, c1) of every row into `top`.
void score_columns(const CsrMatrix& mask, std::span<const ConstMatrixView> xs,
                   std::span<const ConstMatrixView> dys, std::int64_t c0, std::int64_t c1,
                   GradientRowKernel kernel, std::vector<float>& xt, std::vector<float>& row,
                   StreamingTopK& top, std::atomic<float>& shared_bar) {
  const std::int64_t width = c1 - c0;
  std::int64_t tokens = 0;
  std::vector<std::int64_t> counts;
  for (const ConstMatrixView& x : xs) {
    tokens += x.cols;
    counts.push_back(x.cols);
  }
  // X^T for these columns, every engine's tokens in order: row t of xt is token t.
  xt.resize(static_cast<std::size_t>(tokens * width));
  std::int64_t t0 = 0;
  for (const ConstMatrixView& x : xs) {
    for (std::int64_t c = 0; c < width; ++c) {
      const float* src = x.row(c0 + c);
      float* dst = xt.data() + t0 * width + c;
      for (std::int64_t t = 0; t < x.cols; ++t) dst[t * width] = src[t];
    }
    t0 += x.cols;
  }
  row.resize(static_cast<std::size_t>(width));
  std::vector<const float*> dy(dys.size());
  const auto& offsets = mask.row_offsets();
  const auto& indices = mask.col_indices();
  const std::int64_t cols = mask.cols();
  // Rows in an interleaved order (every 8th, then the ones after them, ...): a row's
  // scores scale with its |dY|, so the first rows seen set a bar that is representative
  // of the layer, and fewer candidates from later rows reach it.
  constexpr std::int64_t kInterleave = 8;
  std::array<std::int32_t, kTileColumns> reaching;
  for (std::int64_t phase = 0; phase < kInterleave; ++phase) {
    for (std::int64_t r = phase; r < mask.rows(); r += kInterleave) {
      for (std::size_t e = 0; e < dys.size(); ++e) dy[e] = dys[e].row(r);
      kernel(dy.data(), counts.data(), static_cast<int>(dy.size()), xt.data(), width, false,
             row.data());
      // Most scores fall short of the bar; only those that reach it are looked up in the
      // row's mask (active positions are not candidates), walking it once per row.
      const auto* active =
          std::lower_bound(indices.data() + offsets[r], indices.data() + offsets[r + 1],
                           static_cast<std::uint32_t>(c0));
      const auto* last = indices.data() + offsets[r + 1];
      // Every task's k-th best bounds the layer's from below: a score under the best of
      // the tasks' bars cannot be in the top-k (ties still go through, to the exact check).
      float bar = std::max(top.bar(), shared_bar.load(std::memory_order_relaxed));
      // First the columns that reach the bar, without branches; then only those.
      const float* scores = row.data();
      std::int64_t candidates = 0;
      for (std::int64_t c = 0; c < width; ++c) {
        reaching[static_cast<std::size_t>(candidates)] = static_cast<std::int32_t>(c);
        candidates += std::fabs(scores[c]) >= bar ? 1 : 0;
      }
      for (std::int64_t i = 0; i < candidates; ++i) {
        const std::int32_t c = reaching[static_cast<std::size_t>(i)];
        const float score = std::fabs(scores[c]);
        if (!(score >= bar)) continue;  // the bar rose since
        const auto col = static_cast<std::uint32_t>(c0 + c);
        while (active != last && *active < col) ++active;
        if (active != last && *active == col) continue;
        const float before = top.bar();
        top.offer(r * cols + col, score);
        if (top.bar() != before) {  // a cut raised it: share it
          float seen = shared_bar.load(std::memory_order_relaxed);
          while (top.bar() > seen &&
                 !shared_bar.compare_exchange_weak(seen, top.bar(), std::memory_order_relaxed)) {
          }
          bar = std::max(top.bar(), seen);
        }
      }
    }
  }
}

}  // namespace

StreamingTopK::StreamingTopK(std::int64_t k) : k_(k) {
  if (k < 0) throw ArgumentError("StreamingTopK: negative k " + std::to_string(k));
  if (k == 0) bar_ = std::numeric_limits<float>::infinity();  // nothing is kept
  kept_.reserve(static_cast<std::size_t>(2 * k));
}

void StreamingTopK::cut() {
  if (static_cast<std::int64_t>(kept_.size()) < k_ || k_ == 0) return;
  std::nth_element(kept_.begin(), kept_.begin() + (k_ - 1), kept_.end(), better);
  kept_.resize(static_cast<std::size_t>(k_));
  bar_ = kept_.back().score;
  bar_position_ = kept_.back().position;
}

void StreamingTopK::merge(const StreamingTopK& other) {
  for (const ScoredPosition& p : other.kept_) offer(p.position, p.score);
}

std::vector<std::int64_t> StreamingTopK::positions() {
  cut();
  std::vector<std::int64_t> out;
  out.reserve(kept_.size());
  for (const ScoredPosition& p : kept_) out.push_back(p.position);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<ScoredPosition> StreamingTopK::ranked() {
  cut();
  std::vector<ScoredPosition> out = kept_;
  std::sort(out.begin(), out.end(), better);
  return out;
}

std::vector<std::int64_t> dense_gradient_top_k(const CsrMatrix& mask,
                                               std::span<const ConstMatrixView> xs,
                                               std::span<const ConstMatrixView> dys, std::int64_t k,
                                               Isa isa) {
  if (xs.empty() || xs.size() != dys.size()) {
    throw ShapeError("dense_gradient_top_k: " + std::to_string(xs.size()) + " inputs and " +
                     std::to_string(dys.size()) + " output gradients (one each per engine)");
  }
  for (std::size_t e = 0; e < xs.size(); ++e) {
    if (xs[e].rows != mask.cols() || dys[e].rows != mask.rows() || xs[e].cols != dys[e].cols) {
      throw ShapeError("dense_gradient_top_k: engine " + std::to_string(e) + ": X is " +
                       std::to_string(xs[e].rows) + "x" + std::to_string(xs[e].cols) + " and dY " +
                       std::to_string(dys[e].rows) + "x" + std::to_string(dys[e].cols) + " for a " +
                       std::to_string(mask.rows()) + "x" + std::to_string(mask.cols()) + " layer");
    }
  }
  const std::int64_t inactive = mask.rows() * mask.cols() - mask.nnz();
  if (k < 0 || k > inactive) {
    throw ArgumentError("dense_gradient_top_k: k = " + std::to_string(k) + " but the layer has " +
                        std::to_string(inactive) + " inactive positions");
  }
  if (k == 0) return {};
  const std::int64_t tiles = (mask.cols() + kTileColumns - 1) / kTileColumns;
  const std::int64_t threads = tbb::this_task_arena::max_concurrency();
  const std::int64_t tasks = std::clamp<std::int64_t>(std::min(tiles, threads), 1, kMaxTasks);
  std::vector<StreamingTopK> tops(static_cast<std::size_t>(tasks), StreamingTopK(k));
  const GradientRowKernel kernel = gradient_row_kernel(isa);
  std::atomic<float> shared_bar{-std::numeric_limits<float>::infinity()};
  parallel_for(
      std::int64_t{0}, tasks,
      [&](std::int64_t task) {
        std::vector<float> xt, row;
        for (std::int64_t tile = task * tiles / tasks; tile < (task + 1) * tiles / tasks; ++tile) {
          const std::int64_t c0 = tile * kTileColumns;
          const std::int64_t c1 = std::min(mask.cols(), c0 + kTileColumns);
          score_columns(mask, xs, dys, c0, c1, kernel, xt, row,
                        tops[static_cast<std::size_t>(task)], shared_bar);
        }
      },
      true);
  for (std::size_t i = 1; i < tops.size(); ++i) tops.front().merge(tops[i]);
  return tops.front().positions();
}

std::int64_t gradient_tile_columns() {
  return kTileColumns;
}

void gradient_tile(ConstMatrixView x, ConstMatrixView dy, std::int64_t c0, std::int64_t c1,
                   bool accumulate, std::vector<float>& xt, float* tile, Isa isa) {
  if (x.cols != dy.cols || c0 < 0 || c1 > x.rows || c0 >= c1 || c1 - c0 > kTileColumns) {
    throw ShapeError("gradient_tile: columns [" + std::to_string(c0) + ", " + std::to_string(c1) +
                     ") of X " + std::to_string(x.rows) + "x" + std::to_string(x.cols) +
                     " with dY of " + std::to_string(dy.cols) + " tokens");
  }
  const std::int64_t width = c1 - c0;
  // X^T of these columns: row t is token t, as score_columns lays it out.
  xt.resize(static_cast<std::size_t>(x.cols * width));
  for (std::int64_t c = 0; c < width; ++c) {
    const float* src = x.row(c0 + c);
    for (std::int64_t t = 0; t < x.cols; ++t) xt[static_cast<std::size_t>(t * width + c)] = src[t];
  }
  const GradientRowKernel kernel = gradient_row_kernel(isa);
  const std::int64_t tokens = x.cols;
  parallel_for(std::int64_t{0}, dy.rows, [&](std::int64_t r) {
    const float* row = dy.row(r);
    kernel(&row, &tokens, 1, xt.data(), width, accumulate, tile + r * width);
  });
}

void offer_gradient_tile(const CsrMatrix& mask, std::int64_t c0, std::int64_t c1, const float* tile,
                         StreamingTopK& top) {
  const std::int64_t width = c1 - c0;
  const auto& offsets = mask.row_offsets();
  const auto& indices = mask.col_indices();
  for (std::int64_t r = 0; r < mask.rows(); ++r) {
    const auto* active =
        std::lower_bound(indices.data() + offsets[r], indices.data() + offsets[r + 1],
                         static_cast<std::uint32_t>(c0));
    const auto* last = indices.data() + offsets[r + 1];
    for (std::int64_t c = 0; c < width; ++c) {
      const float score = std::fabs(tile[r * width + c]);
      if (!(score >= top.bar())) continue;
      const auto col = static_cast<std::uint32_t>(c0 + c);
      while (active != last && *active < col) ++active;
      if (active != last && *active == col) continue;
      top.offer(r * mask.cols() + col, score);
    }
  }
}

}  // namespace sluice::detail
