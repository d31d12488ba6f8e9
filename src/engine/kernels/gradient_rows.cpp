// RigL's dense-gradient rows: the portable kernel and the choice by ISA.
#include "engine/kernels/gradient_rows.hpp"

#include "core/isa_choice.hpp"

namespace sluice::detail {

void gradient_row_scalar(const float* const* dy, const std::int64_t* tokens, int parts,
                         const float* xt, std::int64_t width, bool accumulate, float* acc) {
  gradient_row_loop(dy, tokens, parts, xt, width, accumulate, acc);
}

GradientRowKernel gradient_row_kernel(Isa isa) {
  return for_isa<GradientRowKernel>(isa, gradient_row_scalar, gradient_row_avx2,
                                    gradient_row_avx512);
}

}  // namespace sluice::detail
