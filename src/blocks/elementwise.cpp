// The elementwise blocks: residual add and GELU, row by row so every row's loop vectorises
// (GELU's at the width of the ISA the library runs: blocks/block_kernels.hpp).
#include "blocks/block_kernels.hpp"
#include "blocks/block_support.hpp"
#include "sluice/blocks.hpp"

namespace sluice {

void residual_add(MutableMatrixView y, ConstMatrixView x) {
  detail::require_shape("residual_add", "x", x, y.rows, y.cols);
  detail::require_shape("residual_add", "y", y, x.rows, x.cols);
  detail::for_each_block_row(y.rows, y.cols, [&](std::int64_t r) {
    float* out = y.row(r);
    const float* in = x.row(r);
    for (std::int64_t t = 0; t < y.cols; ++t) out[t] += in[t];
  });
}

void gelu_forward(ConstMatrixView z, MutableMatrixView y) {
  detail::require_shape("gelu_forward", "z", z, z.rows, z.cols);
  detail::require_shape("gelu_forward", "y", y, z.rows, z.cols);
  const detail::BlockKernels& kernels = detail::block_kernels();
  detail::for_each_block_row(
      z.rows, z.cols, [&](std::int64_t r) { kernels.gelu_forward(z.row(r), y.row(r), z.cols); });
}

void gelu_backward(ConstMatrixView z, ConstMatrixView dy, MutableMatrixView dz) {
  detail::require_shape("gelu_backward", "z", z, z.rows, z.cols);
  detail::require_shape("gelu_backward", "dy", dy, z.rows, z.cols);
  detail::require_shape("gelu_backward", "dz", dz, z.rows, z.cols);
  const detail::BlockKernels& kernels = detail::block_kernels();
  detail::for_each_block_row(z.rows, z.cols, [&](std::int64_t r) {
    kernels.gelu_backward(z.row(r), dy.row(r), dz.row(r), z.cols);
  });
}

}  // namespace sluice
