// The stream check's fast path with AVX2, as the AVX-512 one (stream_scan_avx512.cpp):
// eight packets per step, the rules kept as VectorRules says, carriage returns found with a
// compare and written from its bits. The packets
// left after the last whole step go through the scalar rules.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>

#include "engine/kernels/stream_scan.hpp"

namespace sluice::detail {
namespace {

/// Lanes 7, 0, 1, ..., 6 of v: each packet's predecessor in the step, lane 0 to be
/// filled from the step before.
inline __m256i rotate(__m256i v) {
  return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(7, 0, 1, 2, 3, 4, 5, 6));
}

/// v's eight lanes as T (unsigned for the maxima, signed for the smallest step).
template <typename T>
std::array<T, 8> lanes_of(__m256i v) {
  alignas(32) std::array<T, 8> lanes;
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes.data()), v);
  return lanes;
}
std::uint32_t largest(__m256i v) {
  return std::ranges::max(lanes_of<std::uint32_t>(v));
}
std::int32_t smallest_signed(__m256i v) {
  return std::ranges::min(lanes_of<std::int32_t>(v));
}

/// The rules on eight packets, kept as VectorRules says.
class Scanner {
 public:
  Scanner(std::uint32_t inputs, std::uint32_t outputs, bool check_values,
          std::uint32_t* carriage_returns)
      : carriage_returns_(carriage_returns),
        inputs_(inputs),
        outputs_(outputs),
        check_values_(check_values) {}

  void step(std::size_t k, __m256i tags, __m256i exponents) {
    const __m256i control = _mm256_srai_epi32(tags, 31);  // all ones for a control
    const __m256i weight_tags = _mm256_andnot_si256(control, tags);
    largest_tag_ = _mm256_max_epu32(largest_tag_, weight_tags);
    largest_control_ = _mm256_max_epu32(largest_control_, _mm256_andnot_si256(tags, control));
    const __m256i as_before = rotate(_mm256_or_si256(tags, control));
    const __m256i before = _mm256_blend_epi32(as_before, last_, 1);
    const __m256i as_after = _mm256_or_si256(
        weight_tags, _mm256_and_si256(control, _mm256_set1_epi32(VectorRules::kFarAhead)));
    smallest_step_ = _mm256_min_epi32(smallest_step_, _mm256_sub_epi32(as_after, before));
    largest_exponent_ =
        _mm256_max_epu32(largest_exponent_, _mm256_andnot_si256(control, exponents));
    last_ = as_before;  // (its lane 0 is this step's last packet)
    const __m256i cr = _mm256_set1_epi32(static_cast<int>(kCarriageReturn));
    const __m256i eol = _mm256_set1_epi32(static_cast<int>(kEndOfLayer));
    auto bits = [](__m256i mask) {
      return static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(mask)));
    };
    for (unsigned found = bits(_mm256_cmpeq_epi32(tags, cr)); found != 0; found &= found - 1) {
      if (carriage_returns_ != nullptr && returns_ < outputs_) {
        carriage_returns_[returns_] = static_cast<std::uint32_t>(k) + std::countr_zero(found);
      }
      ++returns_;
    }
    ends_ += static_cast<std::uint32_t>(std::popcount(bits(_mm256_cmpeq_epi32(tags, eol))));
  }

  template <typename PacketT>
  bool finish(const PacketT* p, std::size_t from, std::size_t n) {
    const VectorRules rules{largest(largest_tag_), largest(largest_control_),
                            smallest_signed(smallest_step_), largest(largest_exponent_)};
    const auto prev = static_cast<std::uint32_t>(_mm256_cvtsi256_si32(last_));  // lane 0: last
    return rules.finish(p, from, n, prev, inputs_, outputs_, check_values_, carriage_returns_,
                        returns_, ends_);
  }

 private:
  __m256i last_ = _mm256_set1_epi32(static_cast<int>(kCarriageReturn));
  __m256i largest_tag_ = _mm256_setzero_si256();
  __m256i largest_control_ = _mm256_setzero_si256();
  __m256i smallest_step_ = _mm256_set1_epi32(1);
  __m256i largest_exponent_ = _mm256_setzero_si256();
  std::uint32_t* carriage_returns_;
  std::uint32_t inputs_;
  std::uint32_t outputs_;
  std::uint32_t returns_ = 0, ends_ = 0;
  bool check_values_;
};

bool scan_fp32(const Packet* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
               bool check_values, std::uint32_t* carriage_returns) {
  if (!VectorRules::apply(inputs)) {
    return kScalarStreamScan.fp32(p, n, inputs, outputs, check_values, carriage_returns);
  }
  Scanner scanner(inputs, outputs, check_values, carriage_returns);
  // Each half's four tags to its low 128 bits and values to its high ones, then joined.
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i exponent = _mm256_set1_epi32(VectorRules::kExponent);
  std::size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i a = _mm256_permutevar8x32_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k)), split);
    const __m256i b = _mm256_permutevar8x32_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k + 4)), split);
    const __m256i tags = _mm256_permute2x128_si256(a, b, 0x20);
    const __m256i values = _mm256_permute2x128_si256(a, b, 0x31);
    scanner.step(k, tags, _mm256_and_si256(values, exponent));
  }
  return scanner.finish(p, k, n);
}

bool scan_bf16(const Bf16Packet* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
               bool check_values, std::uint32_t* carriage_returns) {
  if (!VectorRules::apply(inputs)) {
    return kScalarStreamScan.bf16(p, n, inputs, outputs, check_values, carriage_returns);
  }
  Scanner scanner(inputs, outputs, check_values, carriage_returns);
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF'0000U));
  const __m256i exponent = _mm256_set1_epi32(VectorRules::kExponent);
  std::size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    // Eight words value << 16 | index; a control's tag is 0xFFFF << 16 | value.
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k));
    const __m256i index = _mm256_and_si256(words, low);
    const __m256i control = _mm256_cmpeq_epi32(index, low);
    const __m256i tags =
        _mm256_blendv_epi8(index, _mm256_or_si256(_mm256_srli_epi32(words, 16), high), control);
    scanner.step(k, tags, _mm256_and_si256(words, exponent));
  }
  return scanner.finish(p, k, n);
}

}  // namespace

const StreamScan kAvx2StreamScan{scan_fp32, scan_bf16};

}  // namespace sluice::detail
