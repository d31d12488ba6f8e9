// The gradient layout with AVX-512: eight fp32 (or sixteen bf16) sent packets a step,
// with no branch on control packets: the values are expanded into the weights' lanes
// (a control's lane gets 0), the tags kept or, for bf16, rebuilt in place.
#include <immintrin.h>

#include <cstdint>

#include "engine/kernels/gradient_layout.hpp"

namespace sluice::detail {
namespace {

// Packets one at a time until `out + i` is 64-byte aligned (for non-temporal stores).
template <typename PacketT>
std::size_t align_start(const PacketT* in, std::size_t n, const float*& v, Packet* out) {
  std::size_t i = 0;
  while (i < n && reinterpret_cast<std::uintptr_t>(out + i) % 64 != 0) ++i;
  v = lay_out_packets(in, 0, i, v, out);
  return i;
}

inline void store(Packet* to, __m512i packets, bool streaming) {
  if (streaming) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to), packets);
  } else {
    _mm512_store_si512(to, packets);
  }
}

void lay_out_fp32(const Packet* in, std::size_t n, const float* v, Packet* out, bool streaming) {
  std::size_t i = align_start(in, n, v, out);
  constexpr __mmask16 kValueLanes = 0xAAAA;  // packet k: tag in dword 2k, value in 2k + 1
  for (; i + 8 <= n; i += 8) {
    const __m512i sent = _mm512_loadu_si512(in + i);
    const auto controls = static_cast<__mmask16>(_mm512_movepi32_mask(sent) & 0x5555U);
    const auto weights = static_cast<__mmask16>(~(controls << 1) & kValueLanes);
    const __m512i values = _mm512_maskz_expandloadu_epi32(weights, v);
    store(out + i, _mm512_mask_blend_epi32(kValueLanes, sent, values), streaming);
    v += __builtin_popcount(weights);
  }
  if (streaming) _mm_sfence();
  lay_out_packets(in, i, n, v, out);
}

void lay_out_bf16(const Bf16Packet* in, std::size_t n, const float* v, Packet* out,
                  bool streaming) {
  std::size_t i = align_start(in, n, v, out);
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  const __m512i control_high = _mm512_set1_epi32(static_cast<int>(0xFFFF'0000U));
  // Tag k and value k into dwords 2k and 2k + 1 of two registers of eight packets.
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (; i + 16 <= n; i += 16) {
    const __m512i sent = _mm512_loadu_si512(in + i);
    const __m512i index = _mm512_and_si512(sent, low);
    const __mmask16 controls = _mm512_cmpeq_epi32_mask(index, low);
    // A control's tag is 0xFFFF0000 | its value half; a weight's is its index.
    const __m512i tags = _mm512_mask_or_epi32(index, controls, control_high,
                                              _mm512_maskz_srli_epi32(controls, sent, 16));
    const __m512i values = _mm512_maskz_expandloadu_epi32(static_cast<__mmask16>(~controls), v);
    store(out + i, _mm512_permutex2var_epi32(tags, first, values), streaming);
    store(out + i + 8, _mm512_permutex2var_epi32(tags, second, values), streaming);
    v += __builtin_popcount(static_cast<__mmask16>(~controls));
  }
  if (streaming) _mm_sfence();
  lay_out_packets(in, i, n, v, out);
}

}  // namespace

const GradientLayout kAvx512GradientLayout{lay_out_fp32, lay_out_bf16};

}  // namespace sluice::detail
