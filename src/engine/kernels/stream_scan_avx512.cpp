// The stream check's fast path with AVX-512: sixteen packets per step, the rules kept as
// VectorRules says (vector maxima and minima, judged once per chunk), carriage-return
// positions written by compression. The packets left after the last whole step go
// through the scalar rules.
#include "engine/kernels/avx512_intrinsics.hpp"

#include <bit>

#include "engine/kernels/stream_scan.hpp"

namespace sluice::detail {
namespace {

// Bytes ahead of the scan that are asked for: a chunk usually comes cold from memory, and
// the hardware's prefetchers stop at every 4 KiB page, so the scan, with a dozen vector
// steps between loads, waited on them most of the time (perf: the load took most samples).
constexpr std::size_t kPrefetchAhead = 2048;

void prefetch(const void* p, std::size_t k_bytes) {
  _mm_prefetch(static_cast<const char*>(p) + k_bytes + kPrefetchAhead, _MM_HINT_T0);
}

/// The rules on sixteen packets, given their tags and their values' exponent bits, kept as
/// VectorRules says; only carriage returns (their positions) and ends-of-layer (their
/// count) take a mask a step.
class Scanner {
 public:
  Scanner(std::uint32_t inputs, std::uint32_t outputs, bool check_values,
          std::uint32_t* carriage_returns)
      : carriage_returns_(carriage_returns),
        inputs_(inputs),
        outputs_(outputs),
        check_values_(check_values) {}

  void step(std::size_t k, __m512i tags, __m512i exponents) {
    const __m512i cr = _mm512_set1_epi32(static_cast<int>(kCarriageReturn));
    const __m512i eol = _mm512_set1_epi32(static_cast<int>(kEndOfLayer));
    const __m512i control = _mm512_srai_epi32(tags, 31);             // all ones for a control
    const __m512i weight_tags = _mm512_andnot_si512(control, tags);  // controls as 0
    largest_tag_ = _mm512_max_epu32(largest_tag_, weight_tags);
    largest_control_ = _mm512_max_epu32(largest_control_, _mm512_andnot_si512(tags, control));
    // Each packet's step from the one before: a weight after a weight must increase, and
    // a control as a predecessor is -1 and as a successor 2^30, so any step involving one
    // is positive.
    const __m512i as_before = _mm512_or_si512(tags, control);
    const __m512i before = _mm512_alignr_epi32(as_before, last_, 15);
    const __m512i as_after = _mm512_or_si512(
        weight_tags, _mm512_and_si512(control, _mm512_set1_epi32(VectorRules::kFarAhead)));
    smallest_step_ = _mm512_min_epi32(smallest_step_, _mm512_sub_epi32(as_after, before));
    largest_exponent_ =
        _mm512_max_epu32(largest_exponent_, _mm512_andnot_si512(control, exponents));
    last_ = as_before;
    const __mmask16 is_cr = _mm512_cmpeq_epi32_mask(tags, cr);
    const auto found = static_cast<std::uint32_t>(std::popcount(static_cast<unsigned>(is_cr)));
    if (carriage_returns_ != nullptr && found > 0 && returns_ + found <= outputs_) {
      // Compress in a register, then store: a compressing store is slow on AMD cores.
      const __m512i positions =
          _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k)),
                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      _mm512_mask_storeu_epi32(carriage_returns_ + returns_,
                               static_cast<__mmask16>((1U << found) - 1U),
                               _mm512_maskz_compress_epi32(is_cr, positions));
    }
    returns_ += found;
    ends_ += static_cast<std::uint32_t>(
        std::popcount(static_cast<unsigned>(_mm512_cmpeq_epi32_mask(tags, eol))));
  }

  /// Finishes packets [from, n) with the scalar rules and gives the verdict.
  template <typename PacketT>
  bool finish(const PacketT* p, std::size_t from, std::size_t n) {
    const VectorRules rules{
        _mm512_reduce_max_epu32(largest_tag_), _mm512_reduce_max_epu32(largest_control_),
        _mm512_reduce_min_epi32(smallest_step_), _mm512_reduce_max_epu32(largest_exponent_)};
    alignas(64) std::uint32_t last[16];
    _mm512_store_si512(last, last_);
    return rules.finish(p, from, n, last[15], inputs_, outputs_, check_values_, carriage_returns_,
                        returns_, ends_);
  }

 private:
  __m512i last_ = _mm512_set1_epi32(static_cast<int>(kCarriageReturn));
  __m512i largest_tag_ = _mm512_setzero_si512();
  __m512i largest_control_ = _mm512_setzero_si512();
  __m512i smallest_step_ = _mm512_set1_epi32(1);
  __m512i largest_exponent_ = _mm512_setzero_si512();
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
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i exponent = _mm512_set1_epi32(VectorRules::kExponent);
  std::size_t k = 0;
  for (; k + 16 <= n; k += 16) {
    prefetch(p, k * sizeof(Packet));
    prefetch(p, k * sizeof(Packet) + 64);
    // Sixteen 8-byte packets: tags at even 32-bit positions, values at odd ones.
    const __m512i a = _mm512_loadu_si512(p + k);
    const __m512i b = _mm512_loadu_si512(p + k + 8);
    const __m512i tags = _mm512_permutex2var_epi32(a, even, b);
    const __m512i values =
        _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
    scanner.step(k, tags, _mm512_and_si512(values, exponent));
  }
  return scanner.finish(p, k, n);
}

bool scan_bf16(const Bf16Packet* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
               bool check_values, std::uint32_t* carriage_returns) {
  if (!VectorRules::apply(inputs)) {
    return kScalarStreamScan.bf16(p, n, inputs, outputs, check_values, carriage_returns);
  }
  Scanner scanner(inputs, outputs, check_values, carriage_returns);
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF'0000U));
  const __m512i exponent = _mm512_set1_epi32(VectorRules::kExponent);
  std::size_t k = 0;
  for (; k + 16 <= n; k += 16) {
    prefetch(p, k * sizeof(Bf16Packet));
    // Sixteen words value << 16 | index; a control's tag is 0xFFFF << 16 | value.
    const __m512i words = _mm512_loadu_si512(p + k);
    const __m512i index = _mm512_and_si512(words, low);
    const __mmask16 control = _mm512_cmpeq_epi32_mask(index, low);
    const __m512i tags = _mm512_mask_or_epi32(index, control, _mm512_srli_epi32(words, 16), high);
    scanner.step(k, tags, _mm512_and_si512(words, exponent));
  }
  return scanner.finish(p, k, n);
}

}  // namespace

const StreamScan kAvx512StreamScan{scan_fp32, scan_bf16};

}  // namespace sluice::detail
