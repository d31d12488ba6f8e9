#pragma once
// Eight horizontal sums of AVX-512 vectors at once. Internal; shared by the AVX-512
// weight-gradient kernel and bench_roofline's probe of the same step (so the probe's
// bound is the kernel's own arithmetic). Marked for AVX-512 itself, so a file compiled
// for the baseline ISA may call it from an AVX-512 function.
#include <immintrin.h>

namespace sluice::detail {

/// [sum(v[0]), ..., sum(v[7])]. Each step folds pairs of vectors into one, so eight
/// dot products cost 16 shuffles and 8 adds together: about a third of reducing each
/// alone, and the weight gradient needs one reduction per non-zero per token group.
[[gnu::target("avx512f")]] inline __m256 reduce8(const __m512* v) {
  __m512 h[4];
  for (int j = 0; j < 4; ++j) {
    const __m512 a = v[2 * j], b = v[2 * j + 1];
    // [a.lo + a.hi, b.lo + b.hi] (256-bit halves): 8 partials of a, then 8 of b.
    h[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  __m512 q[2];
  for (int j = 0; j < 2; ++j) {
    const __m512 a = h[2 * j], b = h[2 * j + 1];
    // 128-bit block i now holds 4 partials of v[4j + i].
    q[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // Block i: [2 partials of v[i], 2 partials of v[4 + i]].
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Block i: [sum v[i], sum v[i], sum v[4 + i], sum v[4 + i]].
  const __m512 s = _mm512_add_ps(r, _mm512_permute_ps(r, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s));
}

}  // namespace sluice::detail
