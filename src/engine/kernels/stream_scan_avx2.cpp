// The stream check's fast path with AVX2 (stream_scan_body.hpp over eight packets a step):
// carriage returns found with a compare and written from its bits.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "engine/kernels/stream_scan_body.hpp"

namespace sluice::detail {
namespace {

using Lanes8 = std::int32_t __attribute__((vector_size(32)));

/// v's eight lanes as T (unsigned for the maxima, signed for the smallest step).
template <typename T>
std::array<T, 8> lanes_of(Lanes8 v) {
  std::array<T, 8> lanes;
  std::memcpy(lanes.data(), &v, sizeof v);
  return lanes;
}
/// One bit per lane of a compare's result (all ones where true).
std::uint32_t bits(Lanes8 mask) {
  return static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(__m256i(mask))));
}

/// Eight 32-bit lanes.
struct ScanLanes {
  using Vec = Lanes8;
  static constexpr std::size_t kWidth = 8;

  static Vec max_unsigned(Vec a, Vec b) { return Vec(_mm256_max_epu32(__m256i(a), __m256i(b))); }
  static Vec min_signed(Vec a, Vec b) { return Vec(_mm256_min_epi32(__m256i(a), __m256i(b))); }
  static std::uint32_t largest(Vec a) { return std::ranges::max(lanes_of<std::uint32_t>(a)); }
  static std::int32_t smallest(Vec a) { return std::ranges::min(lanes_of<std::int32_t>(a)); }

  /// Each lane's predecessor (lane 0's from the step before), and what the next step takes
  /// as `carry`: `now` as lanes 7, 0, 1, ..., 6, so its lane 0 is this step's last packet.
  static VectorPair<Vec> predecessors(Vec now, Vec carry) {
    const __m256i rotated =
        _mm256_permutevar8x32_epi32(__m256i(now), _mm256_setr_epi32(7, 0, 1, 2, 3, 4, 5, 6));
    return {Vec(_mm256_blend_epi32(rotated, __m256i(carry), 1)), Vec(rotated)};
  }
  static std::uint32_t last_tag(Vec carry) { return static_cast<std::uint32_t>(carry[0]); }
  static std::uint32_t count(Vec tags, std::uint32_t tag) {
    return static_cast<std::uint32_t>(std::popcount(bits(tags == static_cast<std::int32_t>(tag))));
  }
  /// Writes the positions of this step's carriage returns from positions[written] while
  /// they stay below `outputs`; returns how many there are.
  static std::uint32_t write_returns(Vec tags, std::size_t k, std::uint32_t* positions,
                                     std::uint32_t written, std::uint32_t outputs) {
    std::uint32_t found = bits(tags == static_cast<std::int32_t>(kCarriageReturn));
    const auto count = static_cast<std::uint32_t>(std::popcount(found));
    if (positions != nullptr) {
      for (std::uint32_t at = written; found != 0; found &= found - 1, ++at) {
        if (at < outputs) positions[at] = static_cast<std::uint32_t>(k) + std::countr_zero(found);
      }
    }
    return count;
  }

  /// Packets [k, k + 8) as their tags and their values' exponent bits.
  static VectorPair<Vec> load(const Packet* p, std::size_t k) {
    // Each half's four tags to its low 128 bits and values to its high ones, then joined.
    const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i a = _mm256_permutevar8x32_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k)), split);
    const __m256i b = _mm256_permutevar8x32_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k + 4)), split);
    const Vec values = Vec(_mm256_permute2x128_si256(a, b, 0x31));
    return {Vec(_mm256_permute2x128_si256(a, b, 0x20)), values & VectorRules::kExponent};
  }
  static VectorPair<Vec> load(const Bf16Packet* p, std::size_t k) {
    // Eight words value << 16 | index; a control's tag is 0xFFFF << 16 | value.
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k));
    const __m256i index = _mm256_and_si256(words, low);
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF'0000U));
    const __m256i tags = _mm256_blendv_epi8(
        index, _mm256_or_si256(_mm256_srli_epi32(words, 16), high), _mm256_cmpeq_epi32(index, low));
    return {Vec(tags), Vec(words) & VectorRules::kExponent};
  }
};

}  // namespace

const StreamScan kAvx2StreamScan{scan<ScanLanes, Packet>, scan<ScanLanes, Bf16Packet>};

}  // namespace sluice::detail
