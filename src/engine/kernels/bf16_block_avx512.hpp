#pragma once
// The AVX-512 kernels' bf16 row layout, for the kernel files that read it (the bf16
// kernels, and the fp32 kernels' backward from a dY held in bf16). Internal; include only
// from files compiled for AVX-512.
//
// Each 32-token block of a bf16 row is sixteen 32-bit words, word j holding token j in its
// high half and token 16 + j in its low half. A 64-byte load then gives tokens 0-15 as
// fp32 by masking off the low halves and tokens 16-31 by shifting them up, exactly and in
// order.
#include <immintrin.h>

namespace sluice::detail {
namespace {

inline __m512i high_halves() {
  return _mm512_set1_epi32(static_cast<int>(0xFFFF0000U));
}
/// Tokens 0-15 and 16-31 of a 32-token block, as fp32.
inline __m512 first_half(__m512i block) {
  return _mm512_castsi512_ps(_mm512_and_si512(block, high_halves()));
}
inline __m512 second_half(__m512i block) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(block, 16));
}

}  // namespace
}  // namespace sluice::detail
