// RigL's dense-gradient rows with AVX2: the portable loop, vectorised by the compiler.
#include "engine/kernels/gradient_rows.hpp"

namespace sluice::detail {

void gradient_row_avx2(const float* const* dy, const std::int64_t* tokens, int parts,
                       const float* xt, std::int64_t width, bool accumulate, float* acc) {
  gradient_row_loop(dy, tokens, parts, xt, width, accumulate, acc);
}

}  // namespace sluice::detail
