// The elementwise blocks: residual add and GELU, row by row so every row's loop vectorises.
#include "blocks/block_support.hpp"
#include "executor/gelu.hpp"
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
  detail::for_each_block_row(z.rows, z.cols, [&](std::int64_t r) {
    const float* in = z.row(r);
    float* out = y.row(r);
    for (std::int64_t t = 0; t < z.cols; ++t) out[t] = detail::gelu(in[t]);
  });
}

void gelu_backward(ConstMatrixView z, ConstMatrixView dy, MutableMatrixView dz) {
  detail::require_shape("gelu_backward", "z", z, z.rows, z.cols);
  detail::require_shape("gelu_backward", "dy", dy, z.rows, z.cols);
  detail::require_shape("gelu_backward", "dz", dz, z.rows, z.cols);
  detail::for_each_block_row(z.rows, z.cols, [&](std::int64_t r) {
    const float* in = z.row(r);
    const float* d_in = dy.row(r);
    float* out = dz.row(r);
    for (std::int64_t t = 0; t < z.cols; ++t) out[t] = d_in[t] * detail::gelu_slope(in[t]);
  });
}

}  // namespace sluice
