// RigL's growth criterion without the dense gradient (gradient_top_k.hpp).
#include "gradient_top_k.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "parallel.hpp"
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
// Column tiles go to at most this many tasks, each with a top-k of its own: more would
// only cost memory (k entries each).
constexpr std::int64_t kMaxTasks = 8;

/// Scores the columns [c0, c1) of every row into `top`.
void score_columns(const CsrMatrix& mask, std::span<const ConstMatrixView> xs,
                   std::span<const ConstMatrixView> dys, std::int64_t c0, std::int64_t c1,
                   std::vector<float>& xt, std::vector<float>& row, StreamingTopK& top) {
  const std::int64_t width = c1 - c0;
  std::int64_t tokens = 0;
  for (const ConstMatrixView& x : xs) tokens += x.cols;
  // X^T for these columns, every engine's tokens in order: row t of xt is token t.
  xt.resize(static_cast<std::size_t>(tokens * width));
  std::int64_t t0 = 0;
  for (const ConstMatrixView& x : xs) {
    for (std::int64_t c = 0; c < width; ++c) {
      const float* src = x.row(c0 + c);
      for (std::int64_t t = 0; t < x.cols; ++t)
        xt[static_cast<std::size_t>((t0 + t) * width + c)] = src[t];
    }
    t0 += x.cols;
  }
  row.resize(static_cast<std::size_t>(width));
  const auto& offsets = mask.row_offsets();
  const auto& indices = mask.col_indices();
  const std::int64_t cols = mask.cols();
  for (std::int64_t r = 0; r < mask.rows(); ++r) {
    std::fill(row.begin(), row.end(), 0.0F);
    float* acc = row.data();
    std::int64_t t = 0;
    for (const ConstMatrixView& dy : dys) {
      const float* d = dy.row(r);
      for (std::int64_t j = 0; j < dy.cols; ++j, ++t) {
        const float a = d[j];
        if (a == 0.0F) continue;  // (ReLU zeroes many)
        const float* xr = xt.data() + t * width;
        for (std::int64_t c = 0; c < width; ++c) acc[c] += a * xr[c];
      }
    }
    // Offer the inactive columns: skip the row's active ones in [c0, c1).
    const auto* first = indices.data() + offsets[r];
    const auto* last = indices.data() + offsets[r + 1];
    const auto* active = std::lower_bound(first, last, static_cast<std::uint32_t>(c0));
    for (std::int64_t c = 0; c < width; ++c) {
      if (active != last && *active == static_cast<std::uint32_t>(c0 + c)) {
        ++active;
        continue;
      }
      top.offer(r * cols + c0 + c, std::fabs(acc[c]));
    }
  }
}

}  // namespace

StreamingTopK::StreamingTopK(std::int64_t k) : k_(k) {
  if (k < 0) throw ShapeError("StreamingTopK: negative k " + std::to_string(k));
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
                                               std::span<const ConstMatrixView> dys,
                                               std::int64_t k) {
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
    throw ShapeError("dense_gradient_top_k: k = " + std::to_string(k) + " but the layer has " +
                     std::to_string(inactive) + " inactive positions");
  }
  if (k == 0) return {};
  const std::int64_t tiles = (mask.cols() + kTileColumns - 1) / kTileColumns;
  const std::int64_t tasks = std::clamp<std::int64_t>(tiles, 1, kMaxTasks);
  std::vector<StreamingTopK> tops(static_cast<std::size_t>(tasks), StreamingTopK(k));
  parallel_for(
      std::int64_t{0}, tasks,
      [&](std::int64_t task) {
        std::vector<float> xt, row;
        for (std::int64_t tile = task * tiles / tasks; tile < (task + 1) * tiles / tasks; ++tile) {
          const std::int64_t c0 = tile * kTileColumns;
          const std::int64_t c1 = std::min(mask.cols(), c0 + kTileColumns);
          score_columns(mask, xs, dys, c0, c1, xt, row, tops[static_cast<std::size_t>(task)]);
        }
      },
      true);
  for (std::size_t i = 1; i < tops.size(); ++i) tops.front().merge(tops[i]);
  return tops.front().positions();
}

}  // namespace sluice::detail
