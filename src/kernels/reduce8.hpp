#pragma once
// Eight horizontal sums of AVX-512 vectors at once, and adding them to eight gradients.
// Internal; shared by the AVX-512 weight-gradient kernels (fp32, and bf16 tiles of <= 16
// tokens) and bench_roofline's probe of the same step (so the probe's bound is the
// kernels' own arithmetic). Marked for AVX-512 themselves, so a file compiled for the
// baseline ISA may call them from an AVX-512 function.
#include <immintrin.h>

#include <cstdint>

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

/// grad[0, n) += [sum(part[0]), ..., sum(part[n - 1])], n <= 8 (part[n, 8) are read but
/// their sums are not stored).
[[gnu::target("avx512f,avx512vl")]] inline void add_sums(float* grad, const __m512* part,
                                                         unsigned n) {
  if (n == 8) {
    _mm256_storeu_ps(grad, _mm256_add_ps(_mm256_loadu_ps(grad), reduce8(part)));
  } else {
    const auto m = static_cast<__mmask8>((1U << n) - 1U);
    _mm256_mask_storeu_ps(grad, m, _mm256_add_ps(_mm256_maskz_loadu_ps(m, grad), reduce8(part)));
  }
}

/// For every packet k of a run [begin, end): grad[k] += sum(partial(k)), partial(k) being
/// its dot product's 16 partial sums. A run's packets are contiguous, so eight in a row
/// have their gradients in a row: their partials stay in registers and go out together.
template <typename Partial>
[[gnu::target("avx512f,avx512vl")]] inline void add_run_sums(std::uint32_t begin, std::uint32_t end,
                                                             float* grad, Partial&& partial) {
  __m512 part[8];
  std::uint32_t k = begin;
  for (; k + 8 <= end; k += 8) {
    for (std::uint32_t j = 0; j < 8; ++j) part[j] = partial(k + j);
    add_sums(grad + k, part, 8);
  }
  if (k < end) {
    const unsigned n = end - k;
    for (unsigned j = 0; j < 8; ++j) part[j] = j < n ? partial(k + j) : _mm512_setzero_ps();
    add_sums(grad + k, part, n);
  }
}

}  // namespace sluice::detail
