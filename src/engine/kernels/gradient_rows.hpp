#pragma once
// RigL's dense-gradient rows (gradient_top_k.cpp): one row of a tile of dY X^T, summed over
// every engine's tokens in order. Internal; one implementation per ISA, the same sums in
// the same order within each (so 1 and N engines agree bit for bit).
#include <cstdint>

#include "sluice/isa.hpp"

namespace sluice::detail {

/// acc[c] = sum over parts e, tokens t < tokens[e] of dy[e][t] * xt[(first[e] + t) * width + c]
/// for c < width: dy[e] is engine e's row of dY, xt the tile's X^T (every engine's tokens
/// in order, `width` columns each). With `accumulate` the sums start from acc's values
/// instead of 0: an engine that continues another's sums (over MPI) adds the same terms in
/// the same order as one call over both engines' tokens, so the bits are the same.
using GradientRowKernel = void (*)(const float* const* dy, const std::int64_t* tokens, int parts,
                                   const float* xt, std::int64_t width, bool accumulate,
                                   float* acc);

GradientRowKernel gradient_row_kernel(Isa isa);

void gradient_row_scalar(const float* const* dy, const std::int64_t* tokens, int parts,
                         const float* xt, std::int64_t width, bool accumulate, float* acc);
void gradient_row_avx2(const float* const* dy, const std::int64_t* tokens, int parts,
                       const float* xt, std::int64_t width, bool accumulate, float* acc);
void gradient_row_avx512(const float* const* dy, const std::int64_t* tokens, int parts,
                         const float* xt, std::int64_t width, bool accumulate, float* acc);

namespace {  // one copy per ISA's file: each is compiled with its own flags

/// The loop the scalar and AVX2 kernels share (the compiler vectorises it).
inline void gradient_row_loop(const float* const* dy, const std::int64_t* tokens, int parts,
                              const float* xt, std::int64_t width, bool accumulate, float* acc) {
  if (!accumulate) {
    for (std::int64_t c = 0; c < width; ++c) acc[c] = 0.0F;
  }
  for (int e = 0; e < parts; ++e) {
    for (std::int64_t t = 0; t < tokens[e]; ++t, xt += width) {
      const float a = dy[e][t];
      if (a == 0.0F) continue;  // (ReLU zeroes many)
      for (std::int64_t c = 0; c < width; ++c) acc[c] += a * xt[c];
    }
  }
}

}  // namespace
}  // namespace sluice::detail
