#include "dense_baseline.hpp"

#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "core/enum_names.hpp"
#include "engine/dense_matmul.hpp"
#include "sluice/error.hpp"

namespace sluice::baseline {

void dense_sgemm(ConstMatrixView a, bool transpose_a, ConstMatrixView b, bool transpose_b,
                 MutableMatrixView c) {
  const std::int64_t m = transpose_a ? a.cols : a.rows;
  const std::int64_t k = transpose_a ? a.rows : a.cols;
  const std::int64_t kb = transpose_b ? b.cols : b.rows;
  const std::int64_t n = transpose_b ? b.rows : b.cols;
  if (k != kb || c.rows != m || c.cols != n) {
    throw ShapeError("dense_sgemm: shapes do not fit (" + std::to_string(m) + "x" +
                     std::to_string(k) + " times " + std::to_string(kb) + "x" + std::to_string(n) +
                     " into " + std::to_string(c.rows) + "x" + std::to_string(c.cols) + ")");
  }
  if (m == 0 || n == 0) return;
  const dnnl_status_t status =
      dnnl_sgemm(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', m, n, k, 1.0F, a.data, a.stride,
                 b.data, b.stride, 0.0F, c.data, c.stride);
  if (status != dnnl_success) {
    throw Error("oneDNN sgemm failed with status " + std::to_string(static_cast<int>(status)));
  }
}

void set_dense_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

constexpr detail::EnumName<DenseKind> kDenseKindNames[] = {
    {DenseKind::sgemm_f32, "onednn_sgemm_f32"},
    {DenseKind::matmul_f32, "onednn_matmul_f32"},
    {DenseKind::matmul_bf16, "onednn_matmul_bf16"}};

const char* to_string(DenseKind kind) {
  return detail::name_of(kDenseKindNames, kind);
}

std::vector<DenseKind> dense_kinds() {
  std::vector<DenseKind> kinds{DenseKind::sgemm_f32, DenseKind::matmul_f32};
  if (detail::DenseMatmul::bf16_native()) kinds.push_back(DenseKind::matmul_bf16);
  return kinds;
}

DenseKind same_precision_kind(Precision precision) {
  return precision == Precision::bf16 && detail::DenseMatmul::bf16_native() ? DenseKind::matmul_bf16
                                                                            : DenseKind::matmul_f32;
}

struct DenseProduct::Impl {
  DenseKind kind;
  ConstMatrixView a, b;  // as given (sgemm, f32 matmul)
  bool transpose_a, transpose_b;
  std::vector<std::uint16_t> a16, b16;  // bf16 copies, same layout (bf16 matmul)
  std::int64_t rows = 0, inner = 0, cols = 0;
  // Set up for C's row stride on first use (and again should another stride come).
  mutable std::unique_ptr<detail::DenseMatmul> matmul;
  mutable std::int64_t ldc = 0;

  const detail::DenseMatmul& for_stride(std::int64_t stride) const {
    if (!matmul || ldc != stride) {
      const bool bf16 = kind == DenseKind::matmul_bf16;
      matmul = std::make_unique<detail::DenseMatmul>(
          bf16 ? detail::DenseType::bf16 : detail::DenseType::f32, rows, cols, inner, transpose_a,
          bf16 ? a.cols : a.stride, transpose_b, bf16 ? b.cols : b.stride, stride);
      ldc = stride;
    }
    return *matmul;
  }
};

namespace {
std::vector<std::uint16_t> to_bf16_copy(ConstMatrixView m) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(m.rows * m.cols));
  for (std::int64_t r = 0; r < m.rows; ++r) {
    for (std::int64_t c = 0; c < m.cols; ++c) out[r * m.cols + c] = to_bf16(m.row(r)[c]);
  }
  return out;
}
}  // namespace

DenseProduct::DenseProduct(DenseKind kind, ConstMatrixView a, bool transpose_a, ConstMatrixView b,
                           bool transpose_b)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.kind = kind;
  m.a = a;
  m.b = b;
  m.transpose_a = transpose_a;
  m.transpose_b = transpose_b;
  m.rows = transpose_a ? a.cols : a.rows;
  m.inner = transpose_a ? a.rows : a.cols;
  m.cols = transpose_b ? b.rows : b.cols;
  if (kind == DenseKind::matmul_bf16) {
    m.a16 = to_bf16_copy(a);
    m.b16 = to_bf16_copy(b);
  }
}

DenseProduct::~DenseProduct() = default;
DenseProduct::DenseProduct(DenseProduct&&) noexcept = default;

void DenseProduct::run(MutableMatrixView c) const {
  const Impl& m = *impl_;
  if (m.kind == DenseKind::sgemm_f32) {
    dense_sgemm(m.a, m.transpose_a, m.b, m.transpose_b, c);
    return;
  }
  if (c.rows != m.rows || c.cols != m.cols) throw ShapeError("DenseProduct: C has the wrong shape");
  if (m.rows == 0 || m.cols == 0) return;
  if (m.inner == 0) {
    for (std::int64_t r = 0; r < c.rows; ++r) std::fill(c.row(r), c.row(r) + c.cols, 0.0F);
    return;
  }
  const detail::DenseMatmul& matmul = m.for_stride(c.stride);
  if (m.kind == DenseKind::matmul_bf16) {
    matmul.run(m.a16.data(), m.b16.data(), c.data);
  } else {
    matmul.run(m.a.data, m.b.data, c.data);
  }
}

std::string DenseProduct::implementation() const {
  const Impl& m = *impl_;
  if (m.kind == DenseKind::sgemm_f32 || m.rows == 0 || m.cols == 0 || m.inner == 0) return "gemm";
  return m.for_stride(m.cols).implementation();
}

DenseTiming time_dense(const std::vector<DenseOperands>& products, Precision precision,
                       int repeat) {
  DenseTiming timing;
  timing.same_kind = same_precision_kind(precision);
  timing.best_ms = -1;
  for (const DenseKind kind : dense_kinds()) {
    std::vector<DenseProduct> set_up;
    for (const DenseOperands& p : products) {
      set_up.emplace_back(kind, p.a, p.transpose_a, p.b, p.transpose_b);
    }
    auto call = [&] {
      for (std::size_t i = 0; i < products.size(); ++i) set_up[i].run(products[i].c);
    };
    call();  // warm-up: first touch, oneDNN's kernel generation
    std::vector<double> t;
    for (int r = 0; r < std::max(repeat, 1); ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      call();
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    const double ms = 1e3 * t[t.size() / 2];
    if (kind == timing.same_kind) timing.same_ms = ms;
    if (timing.best_ms < 0 || ms < timing.best_ms) {
      timing.best_ms = ms;
      timing.best_kind = kind;
    }
  }
  return timing;
}

}  // namespace sluice::baseline
