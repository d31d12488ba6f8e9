// RigL's dense-gradient rows with AVX-512: the row's accumulators stay in registers (up to
// eight vectors, a 128-column tile) while the tokens pass; columns beyond go in further
// passes, a partial last vector under a mask.
#include <immintrin.h>

#include <algorithm>

#include "engine/kernels/gradient_rows.hpp"

namespace sluice::detail {
namespace {

template <int Vectors>
void block(const float* const* dy, const std::int64_t* tokens, int parts, const float* xt,
           std::int64_t width, std::int64_t c0, __mmask16 tail, bool accumulate, float* acc) {
  __m512 sum[Vectors];
  for (int v = 0; v < Vectors; ++v) sum[v] = _mm512_setzero_ps();
  if (accumulate) {
    for (int v = 0; v + 1 < Vectors; ++v) sum[v] = _mm512_loadu_ps(acc + c0 + 16 * v);
    sum[Vectors - 1] = _mm512_maskz_loadu_ps(tail, acc + c0 + 16 * (Vectors - 1));
  }
  const float* x = xt + c0;
  for (int e = 0; e < parts; ++e) {
    for (std::int64_t t = 0; t < tokens[e]; ++t, x += width) {
      const float a = dy[e][t];
      if (a == 0.0F) continue;
      const __m512 av = _mm512_set1_ps(a);
      for (int v = 0; v + 1 < Vectors; ++v) {
        sum[v] = _mm512_fmadd_ps(av, _mm512_loadu_ps(x + 16 * v), sum[v]);
      }
      const __m512 last = _mm512_maskz_loadu_ps(tail, x + 16 * (Vectors - 1));
      sum[Vectors - 1] = _mm512_fmadd_ps(av, last, sum[Vectors - 1]);
    }
  }
  for (int v = 0; v + 1 < Vectors; ++v) _mm512_storeu_ps(acc + c0 + 16 * v, sum[v]);
  _mm512_mask_storeu_ps(acc + c0 + 16 * (Vectors - 1), tail, sum[Vectors - 1]);
}

using Block = void (*)(const float* const*, const std::int64_t*, int, const float*, std::int64_t,
                       std::int64_t, __mmask16, bool, float*);
constexpr Block kBlocks[8] = {block<1>, block<2>, block<3>, block<4>,
                              block<5>, block<6>, block<7>, block<8>};

}  // namespace

void gradient_row_avx512(const float* const* dy, const std::int64_t* tokens, int parts,
                         const float* xt, std::int64_t width, bool accumulate, float* acc) {
  for (std::int64_t c0 = 0; c0 < width; c0 += 128) {
    const std::int64_t n = std::min<std::int64_t>(128, width - c0);
    const auto vectors = static_cast<int>((n + 15) / 16);
    const std::int64_t rest = n - 16 * (vectors - 1);
    const auto tail = static_cast<__mmask16>(rest == 16 ? 0xFFFF : (1U << rest) - 1);
    kBlocks[vectors - 1](dy, tokens, parts, xt, width, c0, tail, accumulate, acc);
  }
}

}  // namespace sluice::detail
