// Causal multi-head self-attention arithmetic: the part between the Q, K, V projections and
// the output projection. One task per (sequence, head), writing rows no other task writes.
// QK^T, P V and the four products of the backward are blocked matrix products
// (blocks/head_products.hpp) on the head's feature-major rows as they lie, with token-major
// copies of Q, dO, P and dS where a product needs them the other way round; causal column
// blocks stop at the diagonal.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "blocks/block_support.hpp"
#include "blocks/head_products.hpp"
#include "core/exp_bounded.hpp"
#include "sluice/blocks.hpp"

namespace sluice {
namespace {

struct HeadTask {
  std::int64_t context = 0, d_head = 0;
  std::int64_t first_row = 0, first_token = 0;
  std::size_t probabilities_offset = 0;
};

void check_attention(const char* block, ConstMatrixView q, AttentionShape shape,
                     std::size_t probabilities_size) {
  if (shape.context <= 0 || shape.heads <= 0) {
    throw ShapeError(std::string(block) + ": context and heads must be positive");
  }
  if (q.rows <= 0 || q.rows % shape.heads != 0) {
    throw ShapeError(std::string(block) + ": d_model " + std::to_string(q.rows) +
                     " is not a positive multiple of heads " + std::to_string(shape.heads));
  }
  if (q.cols % shape.context != 0) {
    throw ShapeError(std::string(block) + ": " + std::to_string(q.cols) +
                     " tokens are not whole sequences of context " + std::to_string(shape.context));
  }
  detail::require_shape(block, "q", q, q.rows, q.cols);
  detail::require_size(block, "probabilities", probabilities_size,
                       attention_probabilities_size(q.cols, shape));
}

/// The head's rows of m, token-major: buffer[i * d_head + f] = m(first_row + f, first_token + i).
void gather(ConstMatrixView m, const HeadTask& task, std::vector<float>& buffer) {
  buffer.resize(static_cast<std::size_t>(task.context * task.d_head));
  for (std::int64_t f = 0; f < task.d_head; ++f) {
    const float* row = m.row(task.first_row + f) + task.first_token;
    for (std::int64_t i = 0; i < task.context; ++i) buffer[i * task.d_head + f] = row[i];
  }
}

/// The head's d_head x context block of a feature-major matrix, as it lies.
detail::RowMajor head_rows(ConstMatrixView m, const HeadTask& task) {
  return {m.row(task.first_row) + task.first_token, m.stride};
}
detail::MutableRowMajor head_rows(MutableMatrixView m, const HeadTask& task) {
  return {m.row(task.first_row) + task.first_token, m.stride};
}

// The three causal products, column block by column block of kTileWidth so that the zero
// triangle of a context x context factor is skipped (to within a block).

/// C(i, j) = sum_f at(i, f) b(f, j) for j <= i (and the rest of the diagonal blocks):
/// scores Q^T K and dP = dO^T V. at is context x d_head, b d_head x context, C context^2.
void lower_product(const std::vector<float>& at, detail::RowMajor b, const HeadTask& task,
                   float* c) {
  const std::int64_t n = task.context, dh = task.d_head;
  for (std::int64_t j0 = 0; j0 < n; j0 += detail::kTileWidth) {
    detail::product_columns({at.data() + j0 * dh, dh}, {b.data + j0, b.stride},
                            {c + j0 * n + j0, n}, n - j0, std::min(detail::kTileWidth, n - j0), dh);
  }
}

/// out(f, i) = sum_{j <= i} x(f, j) t(j, i), t upper triangular context x context (a
/// transposed P or dS): O = V P^T and dQ = K dS^T.
void times_upper(detail::RowMajor x, const std::vector<float>& t, const HeadTask& task,
                 detail::MutableRowMajor out) {
  const std::int64_t n = task.context;
  for (std::int64_t i0 = 0; i0 < n; i0 += detail::kTileWidth) {
    const std::int64_t width = std::min(detail::kTileWidth, n - i0);
    detail::product_columns(x, {t.data() + i0, n}, {out.data + i0, out.stride}, task.d_head, width,
                            i0 + width);
  }
}

/// out(f, j) = sum_{i >= j} x(f, i) m(i, j), m lower triangular context x context (P or
/// dS): dV = dO P and dK = Q dS.
void times_lower(detail::RowMajor x, const float* m, const HeadTask& task,
                 detail::MutableRowMajor out) {
  const std::int64_t n = task.context;
  for (std::int64_t j0 = 0; j0 < n; j0 += detail::kTileWidth) {
    detail::product_columns({x.data + j0, x.stride}, {m + j0 * n + j0, n},
                            {out.data + j0, out.stride}, task.d_head,
                            std::min(detail::kTileWidth, n - j0), n - j0);
  }
}

/// fn(task) for every (sequence, head) of a batch, one task each in parallel.
template <typename Fn>
void for_each_head(std::int64_t d_model, std::int64_t tokens, AttentionShape shape, Fn&& fn) {
  const std::int64_t sequences = tokens / shape.context;
  const std::int64_t d_head = d_model / shape.heads;
  detail::for_each_block_row(
      sequences * shape.heads, d_head * shape.context * shape.context, [&](std::int64_t n) {
        const std::int64_t s = n / shape.heads, h = n % shape.heads;
        HeadTask task{shape.context, d_head, h * d_head, s * shape.context,
                      static_cast<std::size_t>(n * shape.context * shape.context)};
        fn(task);
      });
}

}  // namespace

std::int64_t attention_probabilities_size(std::int64_t tokens, AttentionShape shape) {
  if (shape.context <= 0) return 0;
  return tokens / shape.context * shape.heads * shape.context * shape.context;
}

void causal_attention_forward(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                              AttentionShape shape, MutableMatrixView out,
                              std::span<float> probabilities) {
  const char* block = "causal_attention_forward";
  check_attention(block, q, shape, probabilities.size());
  detail::require_shape(block, "k", k, q.rows, q.cols);
  detail::require_shape(block, "v", v, q.rows, q.cols);
  detail::require_shape(block, "out", out, q.rows, q.cols);
  for_each_head(q.rows, q.cols, shape, [&](const HeadTask& task) {
    const std::int64_t c = task.context;
    const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(task.d_head)));
    float* const probs = probabilities.data() + task.probabilities_offset;
    std::vector<float> qt, pt(static_cast<std::size_t>(c * c));
    gather(q, task, qt);
    lower_product(qt, head_rows(k, task), task, probs);
    for (std::int64_t i = 0; i < c; ++i) {
      float* p = probs + i * c;
      // Max-subtracted softmax over the tokens j <= i; the masked ones are exactly zero.
      float max_score = -INFINITY;
      for (std::int64_t j = 0; j <= i; ++j) {
        p[j] *= scale;
        max_score = std::max(max_score, p[j]);
      }
      for (std::int64_t j = 0; j <= i; ++j) p[j] = detail::exp_bounded(p[j] - max_score);
      double sum = 0;
      for (std::int64_t j = 0; j <= i; ++j) sum += p[j];
      const auto inv_sum = static_cast<float>(1.0 / sum);
      for (std::int64_t j = 0; j <= i; ++j) p[j] *= inv_sum;
      std::fill(p + i + 1, p + c, 0.0F);
    }
    detail::transpose_square({probs, c}, {pt.data(), c}, c);
    times_upper(head_rows(v, task), pt, task, head_rows(out, task));
  });
}

void causal_attention_backward(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                               std::span<const float> probabilities, AttentionShape shape,
                               ConstMatrixView d_out, MutableMatrixView dq, MutableMatrixView dk,
                               MutableMatrixView dv) {
  const char* block = "causal_attention_backward";
  check_attention(block, q, shape, probabilities.size());
  detail::require_shape(block, "k", k, q.rows, q.cols);
  detail::require_shape(block, "v", v, q.rows, q.cols);
  detail::require_shape(block, "d_out", d_out, q.rows, q.cols);
  detail::require_shape(block, "dq", dq, q.rows, q.cols);
  detail::require_shape(block, "dk", dk, q.rows, q.cols);
  detail::require_shape(block, "dv", dv, q.rows, q.cols);
  for_each_head(q.rows, q.cols, shape, [&](const HeadTask& task) {
    const std::int64_t c = task.context;
    const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(task.d_head)));
    const float* const probs = probabilities.data() + task.probabilities_offset;
    const auto square = static_cast<std::size_t>(c * c);
    std::vector<float> d_out_t, ds(square), ds_t(square);
    gather(d_out, task, d_out_t);
    lower_product(d_out_t, head_rows(v, task), task, ds.data());  // dP, then dS in place
    for (std::int64_t i = 0; i < c; ++i) {
      const float* p = probs + i * c;
      float* dsi = &ds[static_cast<std::size_t>(i * c)];
      double row_dot = 0;  // sum_j P(i, j) dP(i, j): the softmax's Jacobian term
      for (std::int64_t j = 0; j <= i; ++j) row_dot += static_cast<double>(p[j]) * dsi[j];
      const auto dot = static_cast<float>(row_dot);
      for (std::int64_t j = 0; j <= i; ++j) dsi[j] = p[j] * (dsi[j] - dot) * scale;
      std::fill(dsi + i + 1, dsi + c, 0.0F);
    }
    times_lower(head_rows(d_out, task), probs, task, head_rows(dv, task));
    times_lower(head_rows(q, task), ds.data(), task, head_rows(dk, task));
    detail::transpose_square({ds.data(), c}, {ds_t.data(), c}, c);
    times_upper(head_rows(k, task), ds_t, task, head_rows(dq, task));
  });
}

}  // namespace sluice
