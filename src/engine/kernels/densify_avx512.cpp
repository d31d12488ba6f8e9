// The dense path's packet kernels with AVX-512: a run is written into its row a window of
// slots at a time (16 fp32, 32 bf16): the window's packets found by comparing their
// indices with its bounds, their slots as a bit mask, their values expanded into those
// slots (zeros elsewhere) and stored as one vector. A full window holds consecutive
// indices (the run is checked: strictly increasing), so its values are stored as they are.
// A sparse run is written as zeros, then its packets one by one.
// The row's last window is stored masked at `width`: nothing past the row is written, so
// tiles can be as wide as the layer (oneDNN's brgemm matmul takes only a dense A).
#include <immintrin.h>

#if defined(__GNUC__) && !defined(__clang__)            // clang has no such warnings
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12, inside its own intrinsics
#pragma GCC diagnostic ignored "-Wuninitialized"        // ... and its reductions
#endif

#include <algorithm>
#include <bit>

#include "core/isa_choice.hpp"
#include "engine/kernels/densify.hpp"

namespace sluice::detail {
namespace {

// A run with fewer than one packet in this many slots is written as zeros, then its
// packets one by one: a window costs a chain of dependent steps (load, compare, count),
// more than the few stores of its packets once windows hold fewer than a handful.
constexpr std::uint64_t kScatterBelow = 4;

__mmask16 first(std::uint32_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1U << n) - 1U);
}

/// The slots of a window at `base` that lie in a row of `width` (the last may be short).
__mmask16 inside16(std::uint32_t base, std::uint32_t width) {
  return first(width - base);
}
__mmask32 inside32(std::uint32_t base, std::uint32_t width) {
  const std::uint32_t n = width - base;
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1U << n) - 1U);
}

/// The 32 values of two vectors of bf16 packets (value << 16 | index), in order.
__m512i values_of(__m512i w0, __m512i w1) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w0, 16))),
      _mm512_cvtepi32_epi16(_mm512_srli_epi32(w1, 16)), 1);
}

/// row[0, width) = 0, nothing past it written.
template <typename T>
void zero_row(T* row, std::uint32_t width) {
  constexpr std::uint32_t per = 64 / sizeof(T);
  std::uint32_t base = 0;
  for (; base + per <= width; base += per) _mm512_storeu_si512(row + base, _mm512_setzero_si512());
  if (base < width) std::fill(row + base, row + width, T{});
}

/// The slots of a window's packets: 1 << (index - base) over the lanes in `in`.
std::uint32_t slots_of(__mmask16 in, __m512i relative) {
  return static_cast<std::uint32_t>(
      _mm512_reduce_or_epi32(_mm512_maskz_sllv_epi32(in, _mm512_set1_epi32(1), relative)));
}

void densify_fp32(const Packet* run, std::uint32_t n, float* row, std::uint32_t width) {
  if (std::uint64_t{n} * kScatterBelow < width) {
    zero_row(row, width);
    for (std::uint32_t k = 0; k < n; ++k) row[run[k].tag] = run[k].value;
    return;
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i span = _mm512_set1_epi32(16);
  std::uint32_t k = 0, base = 0;
  for (; base < width && k < n; base += 16) {
    const __mmask16 inside = inside16(base, width);
    if (run[k].tag >= base + 16) {  // no weight in this window
      _mm512_mask_storeu_ps(row + base, inside, _mm512_setzero_ps());
      continue;
    }
    if (k + 16 <= n && run[k + 15].tag == base + 15 && run[k].tag == base) {
      // Full, as densify_bf16 says.
      _mm512_storeu_si512(row + base, _mm512_permutex2var_epi32(_mm512_loadu_si512(run + k), odd,
                                                                _mm512_loadu_si512(run + k + 8)));
      k += 16;
      continue;
    }
    const std::uint32_t avail = std::min(16U, n - k);
    const __m512i a = _mm512_maskz_loadu_epi64(static_cast<__mmask8>(first(avail)), run + k);
    const __m512i b = _mm512_maskz_loadu_epi64(
        static_cast<__mmask8>(first(avail > 8 ? avail - 8 : 0)), run + k + 8);
    const __m512i values = _mm512_permutex2var_epi32(a, odd, b);
    const __m512i relative =
        _mm512_sub_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_set1_epi32(base));
    const __mmask16 in = _mm512_mask_cmplt_epu32_mask(first(avail), relative, span);
    const auto count = static_cast<std::uint32_t>(std::popcount(static_cast<unsigned>(in)));
    _mm512_mask_storeu_epi32(
        row + base, inside,
        _mm512_maskz_expand_epi32(static_cast<__mmask16>(slots_of(in, relative)), values));
    k += count;
  }
  if (base < width) std::fill(row + base, row + width, 0.0F);
}

__attribute__((target("avx512vbmi2"))) void densify_bf16(const Bf16Packet* run, std::uint32_t n,
                                                         std::uint16_t* row, std::uint32_t width) {
  if (std::uint64_t{n} * kScatterBelow < width) {
    zero_row(row, width);
    for (std::uint32_t k = 0; k < n; ++k) row[run[k].index] = run[k].value;
    return;
  }
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  const __m512i span = _mm512_set1_epi32(32);
  std::uint32_t k = 0, base = 0;
  for (; base < width && k < n; base += 32) {
    const __mmask32 inside = inside32(base, width);
    if (run[k].index >= base + 32) {  // no weight in this window
      _mm512_mask_storeu_epi16(row + base, inside, _mm512_setzero_si512());
      continue;
    }
    if (k + 32 <= n && run[k + 31].index == base + 31 && run[k].index == base) {
      // Full (indices increase, so the 32 between are base..base+31): no counting, and
      // the next window's loads do not wait for this one's.
      _mm512_storeu_si512(row + base,
                          values_of(_mm512_loadu_si512(run + k), _mm512_loadu_si512(run + k + 16)));
      k += 32;
      continue;
    }
    const std::uint32_t avail = std::min(32U, n - k);
    const __mmask16 m0 = first(avail), m1 = first(avail > 16 ? avail - 16 : 0);
    const __m512i w0 = _mm512_maskz_loadu_epi32(m0, run + k);
    const __m512i w1 = _mm512_maskz_loadu_epi32(m1, run + k + 16);
    const __m512i b = _mm512_set1_epi32(static_cast<int>(base));
    const __m512i r0 = _mm512_sub_epi32(_mm512_and_si512(w0, low), b);
    const __m512i r1 = _mm512_sub_epi32(_mm512_and_si512(w1, low), b);
    const __mmask16 in0 = _mm512_mask_cmplt_epu32_mask(m0, r0, span);
    const __mmask16 in1 = _mm512_mask_cmplt_epu32_mask(m1, r1, span);
    const auto count = static_cast<std::uint32_t>(std::popcount(static_cast<unsigned>(in0)) +
                                                  std::popcount(static_cast<unsigned>(in1)));
    const std::uint32_t slots = slots_of(in0, r0) | (in1 != 0 ? slots_of(in1, r1) : 0U);
    _mm512_mask_storeu_epi16(row + base, inside,
                             _mm512_maskz_expand_epi16(slots, values_of(w0, w1)));
    k += count;
  }
  if (base < width) std::fill(row + base, row + width, std::uint16_t{0});
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
  DensifyKernels k{densify_fp32, nullptr, gradient_fp32, gradient_bf16};
  if (cpu_supports_avx512_vbmi2()) k.bf16 = densify_bf16;
  return k;
}

}  // namespace sluice::detail
