// RigL's dense-gradient rows: the portable kernel and the choice by ISA.
#include "engine/kernels/gradient_rows.hpp"

namespace sluice::detail {

void gradient_row_scalar(const float* const* dy, const std::int64_t* tokens, int parts,
                         const float* xt, std::int64_t width, float* acc) {
  gradient_row_loop(dy, tokens, parts, xt, width, acc);
}

GradientRowKernel gradient_row_kernel(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return gradient_row_avx512;
    case Isa::avx2:
      return gradient_row_avx2;
    case Isa::scalar:
      break;
  }
  return gradient_row_scalar;
}

}  // namespace sluice::detail
