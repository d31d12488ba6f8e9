#pragma once
// The block kernels' bodies (blocks/block_kernels.hpp), included by one file per ISA:
// block_kernels.cpp (the baseline), block_kernels_avx2.cpp and block_kernels_avx512.cpp,
// each compiled for its ISA. Every function here is in an unnamed namespace (internal
// linkage) and every helper it calls is always inlined, so each file keeps its own copy and
// no ISA's code can stand in for another's at link time (tests/isa_objects_share_nothing.sh);
// for the same reason they use no std:: container, whose instantiations the linker would
// share between the files. Those files are compiled with -fno-trapping-math
// (core/exp_bounded.hpp says why). Internal.
#include <cmath>

#include "blocks/block_kernels.hpp"
#include "blocks/head_products.hpp"
#include "core/exp_bounded.hpp"
#include "executor/gelu.hpp"

namespace sluice::detail {
namespace {

// The products' register tile, columns x rows: 32 sums in 8 SSE registers at the baseline,
// 64 in 8 AVX or 128 in 8 AVX-512 registers, enough independent sums to keep the fused
// multiply-adds busy.
#if defined(__AVX512F__)
constexpr std::int64_t kTileWidth = 16, kTileRows = 8;
#elif defined(__AVX2__)
constexpr std::int64_t kTileWidth = 16, kTileRows = 4;
#else
constexpr std::int64_t kTileWidth = 8, kTileRows = 4;
#endif

void head_product(RowMajor a, RowMajor b, MutableRowMajor c, std::int64_t m, std::int64_t width,
                  std::int64_t k) {
  detail::product_columns<kTileWidth, kTileRows>(a, b, c, m, width, k);
}

/// The head's rows of m, token-major: buffer[i * d_head + f] = m(first_row + f, first_token + i),
/// in tiles as transpose_lower (the buffer's rows are d_head floats apart).
void gather_head(ConstMatrixView m, const HeadTask& task, float* buffer) {
  constexpr std::int64_t b = kTransposeTile;
  const std::int64_t dh = task.d_head, n = task.context;
  for (std::int64_t i0 = 0; i0 < n; i0 += b) {
    const std::int64_t i1 = i0 + b < n ? i0 + b : n;
    for (std::int64_t f = 0; f < dh; ++f) {
      const float* row = m.row(task.first_row + f) + task.first_token;
      for (std::int64_t i = i0; i < i1; ++i) buffer[i * dh + f] = row[i];
    }
  }
}

/// The head's d_head x context block of a feature-major matrix, copied to `buffer` with
/// rows of context floats. In place its rows lie a whole batch of tokens apart, a stride
/// that maps every row of a product's k loop to the same cache sets.
RowMajor compact_head(ConstMatrixView m, const HeadTask& task, float* buffer) {
  for (std::int64_t f = 0; f < task.d_head; ++f) {
    const float* row = m.row(task.first_row + f) + task.first_token;
    float* to = buffer + f * task.context;
    for (std::int64_t i = 0; i < task.context; ++i) to[i] = row[i];
  }
  return {buffer, task.context};
}

/// The head's block of a feature-major output, where the products write it.
MutableRowMajor head_rows(MutableMatrixView m, const HeadTask& task) {
  return {m.row(task.first_row) + task.first_token, m.stride};
}

// The three causal products, column block by column block of kTileWidth so that the zero
// triangle of a context x context factor is skipped (to within a block).

/// C(i, j) = sum_f at(i, f) b(f, j) for j <= i (and the rest of the diagonal blocks):
/// scores Q^T K and dP = dO^T V. at is context x d_head, b d_head x context, C context^2.
void lower_product(const float* at, RowMajor b, const HeadTask& task, float* c) {
  const std::int64_t n = task.context, dh = task.d_head;
  for (std::int64_t j0 = 0; j0 < n; j0 += kTileWidth) {
    head_product({at + j0 * dh, dh}, {b.data + j0, b.stride}, {c + j0 * n + j0, n}, n - j0,
                 n - j0 < kTileWidth ? n - j0 : kTileWidth, dh);
  }
}

/// out(f, i) = sum_{j <= i} x(f, j) t(j, i), t upper triangular context x context (a
/// transposed P or dS): O = V P^T and dQ = K dS^T.
void times_upper(RowMajor x, const float* t, const HeadTask& task, MutableRowMajor out) {
  const std::int64_t n = task.context;
  for (std::int64_t i0 = 0; i0 < n; i0 += kTileWidth) {
    const std::int64_t width = n - i0 < kTileWidth ? n - i0 : kTileWidth;
    head_product(x, {t + i0, n}, {out.data + i0, out.stride}, task.d_head, width, i0 + width);
  }
}

/// out(f, j) = sum_{i >= j} x(f, i) m(i, j), m lower triangular context x context (P or
/// dS): dV = dO P and dK = Q dS.
void times_lower(RowMajor x, const float* m, const HeadTask& task, MutableRowMajor out) {
  const std::int64_t n = task.context;
  for (std::int64_t j0 = 0; j0 < n; j0 += kTileWidth) {
    head_product({x.data + j0, x.stride}, {m + j0 * n + j0, n}, {out.data + j0, out.stride},
                 task.d_head, n - j0 < kTileWidth ? n - j0 : kTileWidth, n - j0);
  }
}

/// ln 2^-64: a probability below 2^-64 of its row's largest is taken as zero. Its share of
/// any sum is far below a float's resolution, but left in, a sharp softmax fills P (and dS)
/// with such factors, their products in the attention's matrix products come out
/// subnormal, and vector units take subnormal results in microcode: a model whose
/// attention sharpens would slow down as it trains.
constexpr float kNegligibleScore = -44.3614195558365F;

/// p[0..n) = softmax(scale * p[0..n)), max-subtracted; shares below 2^-64 of the largest are
/// exactly zero.
void softmax_row(float* p, std::int64_t n, float scale) {
  float max_score = -INFINITY;
  for (std::int64_t j = 0; j < n; ++j) {
    p[j] *= scale;
    max_score = p[j] > max_score ? p[j] : max_score;
  }
  for (std::int64_t j = 0; j < n; ++j) {
    const float y = p[j] - max_score;
    p[j] = y < kNegligibleScore ? 0.0F : exp_bounded(y);
  }
  double sum = 0;
  for (std::int64_t j = 0; j < n; ++j) sum += p[j];
  const auto inv_sum = static_cast<float>(1.0 / sum);
  for (std::int64_t j = 0; j < n; ++j) p[j] *= inv_sum;
}

/// p[0..n) = 0.
void zero(float* p, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) p[j] = 0.0F;
}

void attention_forward(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                       const HeadTask& task, MutableMatrixView out, float* probs, float* scratch) {
  const std::int64_t c = task.context;
  const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(task.d_head)));
  const std::int64_t block = c * task.d_head;
  float* const qt = scratch;
  float* const pt = scratch + block;
  gather_head(q, task, qt);
  lower_product(qt, compact_head(k, task, pt + c * c), task, probs);
  for (std::int64_t i = 0; i < c; ++i) {
    // Over the tokens j <= i; the masked ones are exactly zero.
    softmax_row(probs + i * c, i + 1, scale);
    zero(probs + i * c + i + 1, c - i - 1);
  }
  transpose_lower({probs, c}, {pt, c}, c);
  times_upper(compact_head(v, task, pt + c * c), pt, task, head_rows(out, task));
}

void attention_backward(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v, const float* probs,
                        const HeadTask& task, ConstMatrixView d_out, MutableMatrixView dq,
                        MutableMatrixView dk, MutableMatrixView dv, float* scratch) {
  const std::int64_t c = task.context;
  const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(task.d_head)));
  const std::int64_t block = c * task.d_head;
  float* const d_out_t = scratch;
  float* const ds = scratch + block;
  float* const ds_t = ds + c * c;
  float* const rows = ds_t + c * c;  // one head block, compacted, at a time
  gather_head(d_out, task, d_out_t);
  lower_product(d_out_t, compact_head(v, task, rows), task, ds);  // dP, then dS in place
  for (std::int64_t i = 0; i < c; ++i) {
    const float* p = probs + i * c;
    float* dsi = ds + i * c;
    double row_dot = 0;  // sum_j P(i, j) dP(i, j): the softmax's Jacobian term
    for (std::int64_t j = 0; j <= i; ++j) row_dot += static_cast<double>(p[j]) * dsi[j];
    const auto dot = static_cast<float>(row_dot);
    for (std::int64_t j = 0; j <= i; ++j) dsi[j] = p[j] * (dsi[j] - dot) * scale;
    zero(dsi + i + 1, c - i - 1);
  }
  times_lower(compact_head(d_out, task, rows), probs, task, head_rows(dv, task));
  times_lower(compact_head(q, task, rows), ds, task, head_rows(dk, task));
  transpose_lower({ds, c}, {ds_t, c}, c);
  times_upper(compact_head(k, task, rows), ds_t, task, head_rows(dq, task));
}

void gelu_forward_row(const float* z, float* y, std::int64_t n) {
  for (std::int64_t t = 0; t < n; ++t) y[t] = gelu(z[t]);
}

void gelu_backward_row(const float* z, const float* dy, float* dz, std::int64_t n) {
  for (std::int64_t t = 0; t < n; ++t) dz[t] = dy[t] * gelu_slope(z[t]);
}

constexpr BlockKernels kThisIsaBlockKernels{attention_forward, attention_backward, gelu_forward_row,
                                            gelu_backward_row};

}  // namespace
}  // namespace sluice::detail
