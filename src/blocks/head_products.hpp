#pragma once
// The attention's matrix products on one (sequence, head): C = A B over row-major operands,
// blocked so that a tile of C stays in registers while the k loop streams a row of B per
// step. Every loop runs over contiguous floats without a reduction across lanes, so the
// compiler vectorises it at the ISA of the file that includes it (blocks/block_kernels_body.hpp;
// the tile's shape is that file's).
// Always inlined, so each ISA's file compiles its own copy. Internal.
#include <cstdint>
#include <cstring>

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

/// Width floats as one vector of GCC's extension (a typedef in a class template: on a
/// dependent alias GCC drops the attribute).
template <std::int64_t Width>
struct FloatVector {
  typedef float type __attribute__((vector_size(Width * sizeof(float))));
};

/// C(0..Rows, 0..Width) = A(0..Rows, 0..k) B(0..k, 0..Width): a whole tile, its sums held
/// as Rows vectors of Width floats (GCC's vector extension, one register or several at the
/// ISA the file is compiled for) and a row of B loaded once per k step for all Rows.
template <std::int64_t Width, std::int64_t Rows>
[[gnu::always_inline]] inline void product_tile(RowMajor a, RowMajor b, MutableRowMajor c,
                                                std::int64_t k) {
  using Vector = typename FloatVector<Width>::type;
  static_assert(sizeof(Vector) == Width * sizeof(float));
  Vector acc[Rows] = {};
  for (std::int64_t p = 0; p < k; ++p) {
    Vector bp;
    std::memcpy(&bp, b.data + p * b.stride, sizeof bp);
    for (std::int64_t r = 0; r < Rows; ++r) acc[r] += a.data[r * a.stride + p] * bp;
  }
  for (std::int64_t r = 0; r < Rows; ++r)
    std::memcpy(c.data + r * c.stride, &acc[r], sizeof(Vector));
}

/// The same for a tile narrower than Width (a product's last columns), element by element.
template <std::int64_t Width, std::int64_t Rows>
[[gnu::always_inline]] inline void product_edge(RowMajor a, RowMajor b, MutableRowMajor c,
                                                std::int64_t width, std::int64_t k) {
  float acc[Rows][Width] = {};
  for (std::int64_t p = 0; p < k; ++p) {
    const float* bp = b.data + p * b.stride;
    for (std::int64_t r = 0; r < Rows; ++r) {
      const float ar = a.data[r * a.stride + p];
      for (std::int64_t w = 0; w < width; ++w) acc[r][w] += ar * bp[w];
    }
  }
  for (std::int64_t r = 0; r < Rows; ++r) {
    for (std::int64_t w = 0; w < width; ++w) c.data[r * c.stride + w] = acc[r][w];
  }
}

/// C(0..m, 0..width) = A(0..m, 0..k) B(0..k, 0..width) for width <= Width: one column
/// block of a product, its rows in tiles of Rows (Width x Rows sums: as many registers as
/// the ISA's fused multiply-adds need in flight).
template <std::int64_t Width, std::int64_t Rows>
[[gnu::always_inline]] inline void product_columns(RowMajor a, RowMajor b, MutableRowMajor c,
                                                   std::int64_t m, std::int64_t width,
                                                   std::int64_t k) {
  std::int64_t r = 0;
  for (; r + Rows <= m; r += Rows) {
    const RowMajor a_r{a.data + r * a.stride, a.stride};
    const MutableRowMajor c_r{c.data + r * c.stride, c.stride};
    if (width == Width) {
      product_tile<Width, Rows>(a_r, b, c_r, k);
    } else {
      product_edge<Width, Rows>(a_r, b, c_r, width, k);
    }
  }
  for (; r < m; ++r) {
    const RowMajor a_r{a.data + r * a.stride, a.stride};
    const MutableRowMajor c_r{c.data + r * c.stride, c.stride};
    if (width == Width) {
      product_tile<Width, 1>(a_r, b, c_r, k);
    } else {
      product_edge<Width, 1>(a_r, b, c_r, width, k);
    }
  }
}

/// Tiles of a transpose, kTransposeTile squared: element by element, a whole column of a
/// 128-wide block is written 512 bytes apart, a stride that maps every store to the same
/// few L1 sets, so each missed; a tile's rows stay in L1 whatever the stride.
inline constexpr std::int64_t kTransposeTile = 16;

/// out(j, i) = in(i, j) for the lower triangle of an n x n block, tile by tile: the tiles
/// wholly above in's diagonal are neither read nor written (those of a diagonal tile are),
/// which is all that a product by the upper triangle of out (times_upper) reads.
[[gnu::always_inline]] inline void transpose_lower(RowMajor in, MutableRowMajor out,
                                                   std::int64_t n) {
  constexpr std::int64_t b = kTransposeTile;
  for (std::int64_t i0 = 0; i0 < n; i0 += b) {
    const std::int64_t i1 = i0 + b < n ? i0 + b : n;
    for (std::int64_t j0 = 0; j0 < i1; j0 += b) {
      const std::int64_t j1 = j0 + b < n ? j0 + b : n;
      for (std::int64_t i = i0; i < i1; ++i) {
        for (std::int64_t j = j0; j < j1; ++j) {
          out.data[j * out.stride + i] = in.data[i * in.stride + j];
        }
      }
    }
  }
}

}  // namespace sluice::detail
