#include "engine/kernels/gradient_layout.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstdint>

namespace sluice::detail {
namespace {

// Two packets a step where neither is a control packet (nearly all of them).
void lay_out_fp32(const Packet* in, std::size_t n, const float* v, Packet* out, bool streaming) {
  std::size_t i = 0;
#if defined(__SSE2__)
  if (reinterpret_cast<std::uintptr_t>(out) % 16 == 0) {
    for (; i + 2 <= n; i += 2) {
      const __m128i two = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
      if ((_mm_movemask_ps(_mm_castsi128_ps(two)) & 0b0101) != 0) {  // a control packet
        v = lay_out_packets(in, i, i + 2, v, out);
        continue;
      }
      const __m128i tags = _mm_shuffle_epi32(two, _MM_SHUFFLE(2, 0, 2, 0));
      const __m128i values = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v));
      const __m128i packets = _mm_unpacklo_epi32(tags, values);
      auto* to = reinterpret_cast<__m128i*>(out + i);
      if (streaming) {
        _mm_stream_si128(to, packets);
      } else {
        _mm_store_si128(to, packets);
      }
      v += 2;
    }
    if (streaming) _mm_sfence();
  }
#else
  (void)streaming;
#endif
  lay_out_packets(in, i, n, v, out);
}

void lay_out_bf16(const Bf16Packet* in, std::size_t n, const float* v, Packet* out,
                  bool /*streaming*/) {
  lay_out_packets(in, 0, n, v, out);
}

}  // namespace

const GradientLayout kScalarGradientLayout{lay_out_fp32, lay_out_bf16};

const GradientLayout& gradient_layout(Isa isa) {
  return isa == Isa::avx512 ? kAvx512GradientLayout : kScalarGradientLayout;
}

}  // namespace sluice::detail
