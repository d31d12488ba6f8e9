// The stream check's fast path with AVX-512 (stream_scan_body.hpp over sixteen packets a
// step): carriage-return positions written by compression, and the packets asked for
// ahead of the scan.
#include "engine/kernels/avx512_intrinsics.hpp"

#include <bit>

#include "engine/kernels/stream_scan_body.hpp"

namespace sluice::detail {
namespace {

// Bytes ahead of the scan that are asked for: a chunk usually comes cold from memory, and
// the hardware's prefetchers stop at every 4 KiB page, so the scan, with a dozen vector
// steps between loads, waited on them most of the time (perf: the load took most samples).
constexpr std::size_t kPrefetchAhead = 2048;

void prefetch(const void* p, std::size_t k_bytes) {
  _mm_prefetch(static_cast<const char*>(p) + k_bytes + kPrefetchAhead, _MM_HINT_T0);
}

/// Sixteen 32-bit lanes; only carriage returns (their positions) and ends-of-layer (their
/// count) take a mask a step (VectorRules says why).
struct ScanLanes {
  using Vec = std::int32_t __attribute__((vector_size(64)));
  static constexpr std::size_t kWidth = 16;

  static Vec max_unsigned(Vec a, Vec b) { return Vec(_mm512_max_epu32(__m512i(a), __m512i(b))); }
  static Vec min_signed(Vec a, Vec b) { return Vec(_mm512_min_epi32(__m512i(a), __m512i(b))); }
  static std::uint32_t largest(Vec a) { return _mm512_reduce_max_epu32(__m512i(a)); }
  static std::int32_t smallest(Vec a) { return _mm512_reduce_min_epi32(__m512i(a)); }

  /// Each lane's predecessor (lane 0's: the last lane of `carry`, the step before), and
  /// what the next step takes as `carry`.
  static VectorPair<Vec> predecessors(Vec now, Vec carry) {
    return {Vec(_mm512_alignr_epi32(__m512i(now), __m512i(carry), 15)), now};
  }
  static std::uint32_t last_tag(Vec carry) { return static_cast<std::uint32_t>(carry[15]); }
  static std::uint32_t count(Vec tags, std::uint32_t tag) {
    const __mmask16 is =
        _mm512_cmpeq_epi32_mask(__m512i(tags), _mm512_set1_epi32(static_cast<int>(tag)));
    return static_cast<std::uint32_t>(std::popcount(static_cast<unsigned>(is)));
  }
  /// Writes the positions of this step's carriage returns from positions[written] when all
  /// of them fit below `outputs`; returns how many there are.
  static std::uint32_t write_returns(Vec tags, std::size_t k, std::uint32_t* positions,
                                     std::uint32_t written, std::uint32_t outputs) {
    const __mmask16 is_cr = _mm512_cmpeq_epi32_mask(
        __m512i(tags), _mm512_set1_epi32(static_cast<int>(kCarriageReturn)));
    const auto found = static_cast<std::uint32_t>(std::popcount(static_cast<unsigned>(is_cr)));
    if (positions != nullptr && found > 0 && written + found <= outputs) {
      // Compress in a register, then store: a compressing store is slow on AMD cores.
      const __m512i at =
          _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k)),
                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      _mm512_mask_storeu_epi32(positions + written, static_cast<__mmask16>((1U << found) - 1U),
                               _mm512_maskz_compress_epi32(is_cr, at));
    }
    return found;
  }

  /// Packets [k, k + 16) as their tags and their values' exponent bits.
  static VectorPair<Vec> load(const Packet* p, std::size_t k) {
    prefetch(p, k * sizeof(Packet));
    prefetch(p, k * sizeof(Packet) + 64);
    // Sixteen 8-byte packets: tags at even 32-bit positions, values at odd ones.
    const __m512i even =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i a = _mm512_loadu_si512(p + k);
    const __m512i b = _mm512_loadu_si512(p + k + 8);
    const __m512i tags = _mm512_permutex2var_epi32(a, even, b);
    const __m512i values =
        _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
    return {Vec(tags), Vec(values) & VectorRules::kExponent};
  }
  static VectorPair<Vec> load(const Bf16Packet* p, std::size_t k) {
    prefetch(p, k * sizeof(Bf16Packet));
    // Sixteen words value << 16 | index; a control's tag is 0xFFFF << 16 | value.
    const __m512i low = _mm512_set1_epi32(0xFFFF);
    const __m512i words = _mm512_loadu_si512(p + k);
    const __m512i index = _mm512_and_si512(words, low);
    const __mmask16 control = _mm512_cmpeq_epi32_mask(index, low);
    const __m512i tags = _mm512_mask_or_epi32(index, control, _mm512_srli_epi32(words, 16),
                                              _mm512_set1_epi32(static_cast<int>(0xFFFF'0000U)));
    return {Vec(tags), Vec(words) & VectorRules::kExponent};
  }
};

}  // namespace

const StreamScan kAvx512StreamScan{scan<ScanLanes, Packet>, scan<ScanLanes, Bf16Packet>};

}  // namespace sluice::detail
