#pragma once
// The attention's matrix products on one (sequence, head): C = A B over row-major operands,
// blocked so that a tile of C stays in registers while the k loop streams a row of B per
// step. Every loop runs over contiguous floats without a reduction across lanes, so the
// compiler vectorises it at the baseline ISA (a tile of 4 rows x 8 columns is 8 SSE
// registers of sums). Internal.
#include <cstdint>

namespace sluice::detail {

/// A row-major operand: element (r, c) at data[r * stride + c].
struct RowMajor {
  const float* data;
  std::int64_t stride;
};
struct MutableRowMajor {
  float* data;
  std::int64_t stride;
};

inline constexpr std::int64_t kTileWidth = 8;
inline constexpr std::int64_t kTileRows = 4;

/// C(0..Rows, 0..width) = A(0..Rows, 0..k) B(0..k, 0..width), width <= kTileWidth; the
/// full-width tile with constant bounds so its sums stay in registers.
template <std::int64_t Rows, bool Full>
void product_tile(RowMajor a, RowMajor b, MutableRowMajor c, std::int64_t width, std::int64_t k) {
  const std::int64_t w_end = Full ? kTileWidth : width;
  float acc[Rows][kTileWidth] = {};
  for (std::int64_t p = 0; p < k; ++p) {
    const float* bp = b.data + p * b.stride;
    for (std::int64_t r = 0; r < Rows; ++r) {
      const float ar = a.data[r * a.stride + p];
      for (std::int64_t w = 0; w < w_end; ++w) acc[r][w] += ar * bp[w];
    }
  }
  for (std::int64_t r = 0; r < Rows; ++r) {
    for (std::int64_t w = 0; w < w_end; ++w) c.data[r * c.stride + w] = acc[r][w];
  }
}

/// C(0..m, 0..width) = A(0..m, 0..k) B(0..k, 0..width) for width <= kTileWidth: one column
/// block of a product, its rows in tiles.
inline void product_columns(RowMajor a, RowMajor b, MutableRowMajor c, std::int64_t m,
                            std::int64_t width, std::int64_t k) {
  std::int64_t r = 0;
  for (; r + kTileRows <= m; r += kTileRows) {
    const RowMajor a_r{a.data + r * a.stride, a.stride};
    const MutableRowMajor c_r{c.data + r * c.stride, c.stride};
    if (width == kTileWidth) {
      product_tile<kTileRows, true>(a_r, b, c_r, width, k);
    } else {
      product_tile<kTileRows, false>(a_r, b, c_r, width, k);
    }
  }
  for (; r < m; ++r) {
    const RowMajor a_r{a.data + r * a.stride, a.stride};
    const MutableRowMajor c_r{c.data + r * c.stride, c.stride};
    if (width == kTileWidth) {
      product_tile<1, true>(a_r, b, c_r, width, k);
    } else {
      product_tile<1, false>(a_r, b, c_r, width, k);
    }
  }
}

/// out(j, i) = in(i, j) for an n x n block (row strides given).
inline void transpose_square(RowMajor in, MutableRowMajor out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < n; ++j) out.data[j * out.stride + i] = in.data[i * in.stride + j];
  }
}

}  // namespace sluice::detail
