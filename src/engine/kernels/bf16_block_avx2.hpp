#pragma once
// The AVX2 kernels' bf16 row layout, for the kernel files that read it (the bf16 kernels,
// and the fp32 kernels' backward from a dY held in bf16). Internal; include only from
// files compiled for AVX2.
//
// Each 16-token block of a bf16 row is eight 32-bit words, word j holding token j in its
// high half and token 8 + j in its low half. A 32-byte load then gives tokens 0-7 as fp32
// by masking off the low halves and tokens 8-15 by shifting them up, exactly and in order.
#include <immintrin.h>

namespace sluice::detail {
namespace {

inline __m256i high_halves() {
  return _mm256_set1_epi32(static_cast<int>(0xFFFF0000U));
}
/// Tokens 0-7 and 8-15 of a 16-token block, as fp32.
inline __m256 first_half(__m256i block) {
  return _mm256_castsi256_ps(_mm256_and_si256(block, high_halves()));
}
inline __m256 second_half(__m256i block) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(block, 16));
}

}  // namespace
}  // namespace sluice::detail
