// AVX-512 lane kernels for bf16 streams. A 64-byte load of a bf16 activation row holds 32
// tokens; shifting each 32-bit lane left by 16 gives the even tokens as fp32 and masking
// off its low half gives the odd ones, exactly, so the products and sums stay fp32 FMAs.
// (The AVX512-BF16 dot product would pair neighbouring tokens, letting a NaN in one token
// poison the next; and it needs a newer CPU than AVX-512F.) Accumulators keep even and
// odd tokens apart and are interleaved once per output, at the carriage return.
#include <immintrin.h>

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12, masked loads

#include <algorithm>
#include <bit>

#include "kernels/avx512_reduce.hpp"
#include "kernels/lane_kernels.hpp"

namespace sluice::detail {
namespace {

constexpr std::int64_t kGroup = 128;     // tokens per group: four 32-token vectors
constexpr std::uint32_t kPrefetch = 16;  // packets ahead

inline __m512 broadcast_weight(const Bf16Packet& p) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(std::uint32_t{p.value} << 16)));
}
inline const std::uint16_t* row_of(const std::uint16_t* x, const Bf16Packet& p, std::int64_t xs) {
  return x + static_cast<std::int64_t>(p.index) * xs;
}
inline __m512 even_tokens(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 odd_tokens(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000U))));
}
/// Mask of the fp32 lanes in [0, 16) that are < n.
inline __mmask16 first(std::int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1U << std::max<std::int64_t>(n, 0)) - 1U);
}

/// Writes 32 tokens kept as (even, odd) to out[0, 32), the first `width` of them.
inline void store_interleaved(float* out, __m512 even, __m512 odd, std::int64_t width) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512 a = _mm512_permutex2var_ps(even, lo, odd);
  const __m512 b = _mm512_permutex2var_ps(even, hi, odd);
  if (width >= 32) {
    _mm512_storeu_ps(out, a);
    _mm512_storeu_ps(out + 16, b);
  } else {
    _mm512_mask_storeu_ps(out, first(width), a);
    _mm512_mask_storeu_ps(out + 16, first(width - 16), b);
  }
}

/// Loads 32 fp32 tokens (the first `width`, zeros after) split into (even, odd).
inline void load_split(const float* in, std::int64_t width, __m512& even, __m512& odd) {
  const __m512 a = _mm512_maskz_loadu_ps(first(width), in);
  const __m512 b = _mm512_maskz_loadu_ps(first(width - 16), in + 16);
  const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i o = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  even = _mm512_permutex2var_ps(a, e, b);
  odd = _mm512_permutex2var_ps(a, o, b);
}

template <int NV>
void forward_group(const Bf16LaneRuns& L, const std::uint16_t* x, std::int64_t xs, float* y,
                   std::int64_t ys, std::int64_t width) {
  const Bf16Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    // Two packets in flight, each with even and odd accumulators.
    __m512 ae[NV], ao[NV], be[NV], bo[NV];
    for (int v = 0; v < NV; ++v) ae[v] = ao[v] = be[v] = bo[v] = _mm512_setzero_ps();
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 2 <= e; k += 2) {
      if (k + kPrefetch + 2 <= e) {
        const std::uint16_t* n0 = row_of(x, p[k + kPrefetch], xs);
        const std::uint16_t* n1 = row_of(x, p[k + kPrefetch + 1], xs);
        for (int v = 0; v < NV; ++v) {
          _mm_prefetch(reinterpret_cast<const char*>(n0 + 32 * v), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(n1 + 32 * v), _MM_HINT_T0);
        }
      }
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      const std::uint16_t* x1 = row_of(x, p[k + 1], xs);
      const __m512 w0 = broadcast_weight(p[k]);
      const __m512 w1 = broadcast_weight(p[k + 1]);
      for (int v = 0; v < NV; ++v) {
        const __m512i v0 = _mm512_loadu_si512(x0 + 32 * v);
        const __m512i v1 = _mm512_loadu_si512(x1 + 32 * v);
        ae[v] = _mm512_fmadd_ps(w0, even_tokens(v0), ae[v]);
        ao[v] = _mm512_fmadd_ps(w0, odd_tokens(v0), ao[v]);
        be[v] = _mm512_fmadd_ps(w1, even_tokens(v1), be[v]);
        bo[v] = _mm512_fmadd_ps(w1, odd_tokens(v1), bo[v]);
      }
    }
    if (k < e) {
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      const __m512 w0 = broadcast_weight(p[k]);
      for (int v = 0; v < NV; ++v) {
        const __m512i v0 = _mm512_loadu_si512(x0 + 32 * v);
        ae[v] = _mm512_fmadd_ps(w0, even_tokens(v0), ae[v]);
        ao[v] = _mm512_fmadd_ps(w0, odd_tokens(v0), ao[v]);
      }
    }
    float* out = y + r * ys;
    for (int v = 0; v < NV; ++v) {
      store_interleaved(out + 32 * v, _mm512_add_ps(ae[v], be[v]), _mm512_add_ps(ao[v], bo[v]),
                        width - 32 * v);
    }
  }
}

template <int NV>
void backward_weight_group(const Bf16LaneRuns& L, const float* dy, std::int64_t dys,
                           const std::uint16_t* x, std::int64_t xs, float* grad,
                           std::int64_t width) {
  const Bf16Packet* p = L.packets;
  GradientBatch batch(grad);
  for (std::int64_t r = 0; r < L.runs; ++r) {
    // dY's row in the same even/odd order as the widened activations; zeros past the
    // tile's width meet the zero padding of the resident rows.
    __m512 de[NV], dodd[NV];
    for (int v = 0; v < NV; ++v) load_split(dy + r * dys + 32 * v, width - 32 * v, de[v], dodd[v]);
    const std::uint32_t e = L.end[r];
    for (std::uint32_t k = L.begin[r]; k < e; ++k) {
      if (k + kPrefetch < e) {
        const std::uint16_t* n0 = row_of(x, p[k + kPrefetch], xs);
        for (int v = 0; v < NV; ++v) {
          _mm_prefetch(reinterpret_cast<const char*>(n0 + 32 * v), _MM_HINT_T0);
        }
      }
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
      for (int v = 0; v < NV; ++v) {
        const __m512i xv = _mm512_loadu_si512(x0 + 32 * v);
        a = _mm512_fmadd_ps(de[v], even_tokens(xv), a);
        b = _mm512_fmadd_ps(dodd[v], odd_tokens(xv), b);
      }
      batch.add(k, _mm512_add_ps(a, b));
    }
  }
  batch.flush();
}

template <typename Kernel>
void for_each_group(std::int64_t tokens, Kernel&& kernel) {
  for (std::int64_t t0 = 0; t0 < tokens; t0 += kGroup) {
    const std::int64_t width = std::min(kGroup, tokens - t0);
    switch ((width + 31) / 32) {
      case 1:
        kernel.template operator()<1>(t0, width);
        break;
      case 2:
        kernel.template operator()<2>(t0, width);
        break;
      case 3:
        kernel.template operator()<3>(t0, width);
        break;
      default:
        kernel.template operator()<4>(t0, width);
        break;
    }
  }
}

void forward(const Bf16LaneRuns& L, Bf16Tile x, MutableTile y, std::int64_t tokens) {
  for_each_group(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    forward_group<NV>(L, x.data + t0, x.stride, y.data + t0, y.stride, width);
  });
}

void backward_weight(const Bf16LaneRuns& L, Tile dy, Bf16Tile x, float* grad, std::int64_t tokens) {
  for_each_group(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    backward_weight_group<NV>(L, dy.data + t0, dy.stride, x.data + t0, x.stride, grad, width);
  });
}

/// dX rows accumulate in fp32 from fp32 dY: only the weights are bf16. Groups of up to 64
/// tokens (four fp32 vectors), dY's row held in registers for a whole output.
template <int NV>
void backward_data_group(const Bf16LaneRuns& L, const float* dy, std::int64_t dys, float* dx,
                         std::int64_t dxs, std::int64_t width) {
  const Bf16Packet* p = L.packets;
  __mmask16 m[NV];
  for (int v = 0; v < NV; ++v) m[v] = first(width - 16 * v);
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m512 d[NV];
    for (int v = 0; v < NV; ++v) d[v] = _mm512_maskz_loadu_ps(m[v], dy + r * dys + 16 * v);
    const std::uint32_t e = L.end[r];
    for (std::uint32_t k = L.begin[r]; k < e; ++k) {
      if (k + kPrefetch < e) {
        const float* next = dx + static_cast<std::int64_t>(p[k + kPrefetch].index) * dxs;
        for (int v = 0; v < NV; ++v) __builtin_prefetch(next + 16 * v, 1, 3);
      }
      float* o = dx + static_cast<std::int64_t>(p[k].index) * dxs;
      const __m512 w = broadcast_weight(p[k]);
      for (int v = 0; v < NV; ++v) {
        _mm512_mask_storeu_ps(o + 16 * v, m[v],
                              _mm512_fmadd_ps(w, d[v], _mm512_maskz_loadu_ps(m[v], o + 16 * v)));
      }
    }
  }
}

void backward_data(const Bf16LaneRuns& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  for (std::int64_t t0 = 0; t0 < tokens; t0 += 64) {
    const std::int64_t width = std::min<std::int64_t>(64, tokens - t0);
    const float* d = dy.data + t0;
    float* o = dx.data + t0;
    switch ((width + 15) / 16) {
      case 1:
        backward_data_group<1>(L, d, dy.stride, o, dx.stride, width);
        break;
      case 2:
        backward_data_group<2>(L, d, dy.stride, o, dx.stride, width);
        break;
      case 3:
        backward_data_group<3>(L, d, dy.stride, o, dx.stride, width);
        break;
      default:
        backward_data_group<4>(L, d, dy.stride, o, dx.stride, width);
        break;
    }
  }
}

/// fp32 -> bf16 rounding to nearest even, NaN kept a NaN: the same bits as to_bf16().
void pack(const float* src, std::uint16_t* dst, std::int64_t n, std::int64_t padded) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFF'FFFF), inf = _mm512_set1_epi32(0x7F80'0000);
  const __m512i quiet = _mm512_set1_epi32(0x0040);
  for (std::int64_t t = 0; t < padded; t += 16) {
    const __mmask16 m = first(n - t);
    const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + t));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(bias, lsb)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, abs_mask), inf);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), quiet);
    const __mmask16 keep = first(padded - t);
    _mm256_mask_storeu_epi16(dst + t, keep, _mm512_cvtepi32_epi16(rounded));
  }
}

}  // namespace

const Bf16LaneKernels kAvx512Bf16Kernels{forward, backward_data, backward_weight, pack};

}  // namespace sluice::detail
