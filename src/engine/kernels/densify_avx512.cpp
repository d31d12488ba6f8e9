// The dense path's packet kernels with AVX-512. A run that fills its row (its indices are
// then 0 .. width-1: the run is checked, strictly increasing) is written 16 fp32 or 32
// bf16 values a store; any other run as zeros (plain stores), then its packets one by
// one. A window-at-a-time kernel (expanding each window's packets into place) was one
// chain of dependent steps per window and lost to the stores at every density measured
// (docs/performance_notes.md). Nothing past the row's width is written, so tiles can be
// as wide as the layer (oneDNN's brgemm matmul takes only a dense A).
#include "engine/kernels/avx512_intrinsics.hpp"

#include <algorithm>

#include "engine/kernels/densify.hpp"

namespace sluice::detail {
namespace {

__mmask16 first(std::uint32_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1U << n) - 1U);
}

void densify_fp32(const Packet* run, std::uint32_t n, float* row, std::uint32_t width) {
  if (n < width) {
    std::fill_n(row, width, 0.0F);
    for (std::uint32_t k = 0; k < n; ++k) row[run[k].tag] = run[k].value;
    return;
  }
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  std::uint32_t k = 0;
  for (; k + 16 <= width; k += 16) {
    _mm512_storeu_si512(row + k, _mm512_permutex2var_epi32(_mm512_loadu_si512(run + k), odd,
                                                           _mm512_loadu_si512(run + k + 8)));
  }
  for (; k < width; ++k) row[k] = run[k].value;
}

void densify_bf16(const Bf16Packet* run, std::uint32_t n, std::uint16_t* row, std::uint32_t width) {
  if (n < width) {
    std::fill_n(row, width, std::uint16_t{0});
    for (std::uint32_t k = 0; k < n; ++k) row[run[k].index] = run[k].value;
    return;
  }
  std::uint32_t k = 0;
  for (; k + 32 <= width; k += 32) {
    // Each packet a word value << 16 | index: the values are the high halves.
    const __m512i w0 = _mm512_loadu_si512(run + k), w1 = _mm512_loadu_si512(run + k + 16);
    _mm512_storeu_si512(
        row + k,
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w0, 16))),
                           _mm512_cvtepi32_epi16(_mm512_srli_epi32(w1, 16)), 1));
  }
  for (; k < width; ++k) row[k] = run[k].value;
}

/// Sixteen output packets {tag, row[tag]}, `valid` of them, from their tags.
void gradient_step(__m512i tags, __mmask16 valid, const float* row, Packet* out) {
  const __m512i values =
      _mm512_castps_si512(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, tags, row, 4));
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  const auto low_half = static_cast<__mmask8>(valid & 0xFF);
  const auto high_half = static_cast<__mmask8>(valid >> 8);
  _mm512_mask_storeu_epi64(out, low_half, _mm512_permutex2var_epi32(tags, lo, values));
  _mm512_mask_storeu_epi64(out + 8, high_half, _mm512_permutex2var_epi32(tags, hi, values));
}

void gradient_fp32(const Packet* run, std::uint32_t n, const float* row, Packet* out) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  for (std::uint32_t k = 0; k < n; k += 16) {
    const std::uint32_t avail = std::min(16U, n - k);
    const __m512i a = _mm512_maskz_loadu_epi64(static_cast<__mmask8>(first(avail)), run + k);
    const __m512i b = _mm512_maskz_loadu_epi64(
        static_cast<__mmask8>(first(avail > 8 ? avail - 8 : 0)), run + k + 8);
    gradient_step(_mm512_permutex2var_epi32(a, even, b), first(avail), row, out + k);
  }
}

void gradient_bf16(const Bf16Packet* run, std::uint32_t n, const float* row, Packet* out) {
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  for (std::uint32_t k = 0; k < n; k += 16) {
    const __mmask16 valid = first(n - k);
    const __m512i words = _mm512_maskz_loadu_epi32(valid, run + k);
    gradient_step(_mm512_and_si512(words, low), valid, row, out + k);
  }
}

}  // namespace

DensifyKernels avx512_densify() {
  return {densify_fp32, densify_bf16, gradient_fp32, gradient_bf16};
}

}  // namespace sluice::detail
