#pragma once
// Eight horizontal sums of AVX-512 vectors at once, and leaving them as a weight-gradient
// kernel's GradientSums say: in the partial sums, or as the gradient stream's packets.
// Internal; shared by the AVX-512 weight-gradient kernels (fp32, and bf16 tiles of <= 16
// tokens) and bench_roofline's probe of the same step (so the probe's bound is the
// kernels' own arithmetic). Marked for AVX-512 themselves, so a file compiled for the
// baseline ISA may call them from an AVX-512 function.
#include <immintrin.h>

#include <cstdint>

#include "engine/kernels/lane_kernels.hpp"

namespace sluice::detail {

// GCC 12 warns that the intrinsics' own undefined pass-through operand is used
// uninitialized where fold8 is emitted out of line; it is not read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
/// The first step of fold8 on one pair of vectors: [a.lo + a.hi, b.lo + b.hi] (256-bit
/// halves), 8 partials of a, then 8 of b. A kernel may take it as each pair is done, so
/// four vectors wait for the rest of the reduction instead of eight.
[[gnu::target("avx512f")]] inline __m512 fold_pair(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

/// The rest of fold8, from the four fold_pair results of v[0, 1], ..., v[6, 7].
[[gnu::target("avx512f")]] inline __m512 fold_pairs(const __m512* h) {
  __m512 q[2];
  for (int j = 0; j < 2; ++j) {
    const __m512 a = h[2 * j], b = h[2 * j + 1];
    // 128-bit block i now holds 4 partials of v[4j + i].
    q[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // Block i: [2 partials of v[i], 2 partials of v[4 + i]].
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(r, _mm512_permute_ps(r, _MM_SHUFFLE(2, 3, 0, 1)));
}

/// Eight dot products' partial sums folded to their totals: 128-bit block i of the result
/// is [sum v[i], sum v[i], sum v[4 + i], sum v[4 + i]]. Each step folds pairs of vectors
/// into one, so eight reductions cost 16 shuffles and 8 adds together: about a third of
/// reducing each alone, and the weight gradient needs one per non-zero per token group.
[[gnu::target("avx512f")]] inline __m512 fold8(const __m512* v) {
  const __m512 h[4] = {fold_pair(v[0], v[1]), fold_pair(v[2], v[3]), fold_pair(v[4], v[5]),
                       fold_pair(v[6], v[7])};
  return fold_pairs(h);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// The tags of packets[0, n) (n <= 8) in the even floats of a zmm (the odd ones are to be
/// replaced): an fp32 stream's packets as they are, a bf16 stream's indices widened.
[[gnu::target("avx512f,avx512vl")]] inline __m512 tags_of8(const Packet* packets, unsigned n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1U << (2 * n)) - 1U), packets);
}
[[gnu::target("avx512f,avx512vl")]] inline __m512 tags_of8(const Bf16Packet* packets, unsigned n) {
  const __m256i words = _mm256_maskz_loadu_epi32(static_cast<__mmask8>((1U << n) - 1U), packets);
  const __m256i index = _mm256_and_si256(words, _mm256_set1_epi32(0xFFFF));
  return _mm512_castsi512_ps(_mm512_cvtepu32_epi64(index));
}

/// Leaves the totals `folded` (as fold8 leaves them) of packets k, ..., k + n - 1 (n <= 8)
/// as `g` says, as leave_sum does for one.
template <typename PacketT>
[[gnu::target("avx512f,avx512vl")]] inline void add_folded_sums(const GradientSums& g,
                                                                const PacketT* packets,
                                                                std::uint32_t k, __m512 folded,
                                                                unsigned n) {
  const auto m8 = static_cast<__mmask8>((1U << n) - 1U);
  if (g.out == nullptr) {
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256 sums = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, folded));
    if (!g.first) sums = _mm256_add_ps(_mm256_maskz_loadu_ps(m8, g.partial + k), sums);
    _mm256_mask_storeu_ps(g.partial + k, m8, sums);
    return;
  }
  // Eight packets are one zmm: each total goes beside its packet's tag (the odd floats).
  const __m512i beside = _mm512_setr_epi32(0, 0, 0, 4, 0, 8, 0, 12, 0, 2, 0, 6, 0, 10, 0, 14);
  __m512 sums = _mm512_permutexvar_ps(beside, folded);
  if (!g.first) {
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m256 earlier = _mm256_maskz_loadu_ps(m8, g.partial + k);
    sums = _mm512_add_ps(_mm512_permutexvar_ps(twice, _mm512_castps256_ps512(earlier)), sums);
  }
  const auto m16 = static_cast<__mmask16>((1U << (2 * n)) - 1U);
  const __m512 tags = tags_of8(packets + k, n);
  _mm512_mask_storeu_ps(g.out + k, m16, _mm512_mask_blend_ps(0xAAAA, tags, sums));
}

/// Leaves the sums of part[0, n) (n <= 8; the rest are read, their sums dropped) for
/// packets k, ..., k + n - 1 as `g` says, as leave_sum does for one.
template <typename PacketT>
[[gnu::target("avx512f,avx512vl")]] inline void add_sums(const GradientSums& g,
                                                         const PacketT* packets, std::uint32_t k,
                                                         const __m512* part, unsigned n) {
  add_folded_sums(g, packets, k, fold8(part), n);
}

/// For every packet k of a run [begin, end): its dot product's 16 partial sums,
/// partial(k), reduced and left as `g` says. A run's packets are contiguous, so eight in a
/// row have their sums in a row: their partials stay in registers and go out together.
template <typename PacketT, typename Partial>
[[gnu::target("avx512f,avx512vl")]] inline void add_run_sums(const GradientSums& g,
                                                             const PacketT* packets,
                                                             std::uint32_t begin, std::uint32_t end,
                                                             Partial&& partial) {
  __m512 part[8];
  std::uint32_t k = begin;
  for (; k + 8 <= end; k += 8) {
    for (std::uint32_t j = 0; j < 8; ++j) part[j] = partial(k + j);
    add_sums(g, packets, k, part, 8);
  }
  if (k < end) {
    const unsigned n = end - k;
    for (unsigned j = 0; j < 8; ++j) part[j] = j < n ? partial(k + j) : _mm512_setzero_ps();
    add_sums(g, packets, k, part, n);
  }
}

}  // namespace sluice::detail
