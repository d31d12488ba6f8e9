// AVX-512 lane kernels for bf16 streams. These kernels keep a resident bf16 row in their
// own order (bf16_block_avx512.hpp), which a load widens to fp32 exactly and in order, so
// products and sums are fp32 FMAs and results are stored without shuffles.
// (The AVX512-BF16 dot product would pair neighbouring tokens, letting a NaN in one poison
// the other, and needs a newer CPU than AVX-512F; it measured no faster here.)
#include <immintrin.h>

#if defined(__GNUC__) && !defined(__clang__)            // clang has no such warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12, masked loads
#endif

#include <algorithm>
#include <bit>
#include <cstring>

#include "engine/kernels/bf16_block_avx512.hpp"
#include "engine/kernels/gradient_batch.hpp"
#include "engine/kernels/lane_kernels.hpp"
#include "engine/kernels/reduce8.hpp"
#include "engine/kernels/token_groups.hpp"

namespace sluice::detail {
namespace {

constexpr std::int64_t kGroup = 128;         // tokens per group: four 32-token blocks
constexpr std::uint32_t kPrefetch = 16;      // packets ahead, for the rows they name
constexpr std::uint32_t kStreamAhead = 256;  // packets ahead, for the stream itself

// always_inline: GCC 12 was seen to drop the prefetch from a plain inline helper. The
// stream is read once per tile, so it should not displace the tile: non-temporal.
[[gnu::always_inline]] inline void prefetch_stream(const Bf16Packet* packet) {
  _mm_prefetch(reinterpret_cast<const char*>(packet), _MM_HINT_NTA);
}
/// Asks for `floats` of an fp32 row (dY of the next output: read once per tile, and with
/// short runs its miss would stall the next output).
[[gnu::always_inline]] inline void prefetch_lines(const float* row, std::int64_t floats) {
  for (std::int64_t f = 0; f < floats; f += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(row + f), _MM_HINT_T0);
  }
}

/// A packet's weight in every lane: its 32-bit word (value << 16 | index) without the index.
inline __m512 broadcast_weight(const Bf16Packet& p) {
  std::uint32_t word;
  std::memcpy(&word, &p, sizeof word);
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_set1_epi32(static_cast<int>(word)), high_halves()));
}
inline const std::uint16_t* row_of(const std::uint16_t* x, const Bf16Packet& p, std::int64_t xs) {
  return x + static_cast<std::int64_t>(p.index) * xs;
}
/// Mask of the fp32 lanes in [0, 16) that are < n.
inline __mmask16 first(std::int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1U << std::max<std::int64_t>(n, 0)) - 1U);
}

template <int NV>
void forward_group(const Bf16LaneRuns& L, const std::uint16_t* x, std::int64_t xs, float* y,
                   std::int64_t ys, std::int64_t width) {
  const Bf16Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    // Two packets in flight, each with accumulators for both halves of every block.
    __m512 ae[NV], ao[NV], be[NV], bo[NV];
    for (int v = 0; v < NV; ++v) ae[v] = ao[v] = be[v] = bo[v] = _mm512_setzero_ps();
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 2 <= e; k += 2) {
      if ((k & 14) == 0) prefetch_stream(p + k + kStreamAhead);  // once per line
      if (k + kPrefetch + 2 <= e) {  // each row's first line, as the fp32 kernels (~2% faster)
        const std::uint16_t* n0 = row_of(x, p[k + kPrefetch], xs);
        const std::uint16_t* n1 = row_of(x, p[k + kPrefetch + 1], xs);
        _mm_prefetch(reinterpret_cast<const char*>(n0), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(n1), _MM_HINT_T0);
      }
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      const std::uint16_t* x1 = row_of(x, p[k + 1], xs);
      const __m512 w0 = broadcast_weight(p[k]);
      const __m512 w1 = broadcast_weight(p[k + 1]);
      for (int v = 0; v < NV; ++v) {
        const __m512i v0 = _mm512_loadu_si512(x0 + 32 * v);
        const __m512i v1 = _mm512_loadu_si512(x1 + 32 * v);
        ae[v] = _mm512_fmadd_ps(w0, first_half(v0), ae[v]);
        ao[v] = _mm512_fmadd_ps(w0, second_half(v0), ao[v]);
        be[v] = _mm512_fmadd_ps(w1, first_half(v1), be[v]);
        bo[v] = _mm512_fmadd_ps(w1, second_half(v1), bo[v]);
      }
    }
    if (k < e) {
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      const __m512 w0 = broadcast_weight(p[k]);
      for (int v = 0; v < NV; ++v) {
        const __m512i v0 = _mm512_loadu_si512(x0 + 32 * v);
        ae[v] = _mm512_fmadd_ps(w0, first_half(v0), ae[v]);
        ao[v] = _mm512_fmadd_ps(w0, second_half(v0), ao[v]);
      }
    }
    float* out = y + r * ys;
    for (int v = 0; v < NV; ++v) {
      _mm512_mask_storeu_ps(out + 32 * v, first(width - 32 * v), _mm512_add_ps(ae[v], be[v]));
      _mm512_mask_storeu_ps(out + 32 * v + 16, first(width - 32 * v - 16),
                            _mm512_add_ps(ao[v], bo[v]));
    }
  }
}

template <int NV>
void backward_weight_group(const Bf16LaneRuns& L, const float* dy, std::int64_t dys,
                           const std::uint16_t* x, std::int64_t xs, const GradientSums& sums,
                           std::int64_t width) {
  const Bf16Packet* p = L.packets;
  GradientBatch batch(sums, p);
  for (std::int64_t r = 0; r < L.runs; ++r) {
    if (r + 1 < L.runs) prefetch_lines(dy + (r + 1) * dys, 32 * NV);
    // dY's row split as the blocks are; zeros past the
    // tile's width meet the zero padding of the resident rows.
    __m512 de[NV], dodd[NV];
    for (int v = 0; v < NV; ++v) {
      de[v] = _mm512_maskz_loadu_ps(first(width - 32 * v), dy + r * dys + 32 * v);
      dodd[v] = _mm512_maskz_loadu_ps(first(width - 32 * v - 16), dy + r * dys + 32 * v + 16);
    }
    const std::uint32_t e = L.end[r];
    for (std::uint32_t k = L.begin[r]; k < e; ++k) {
      if ((k & 15) == 0) prefetch_stream(p + k + kStreamAhead);  // once per line
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
        a = _mm512_fmadd_ps(de[v], first_half(xv), a);
        b = _mm512_fmadd_ps(dodd[v], second_half(xv), b);
      }
      const __m512 sum = _mm512_add_ps(a, b);
      batch.add(k, _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1)));
    }
  }
  batch.flush();
}

/// A tile of at most 16 tokens (a small batch): only the high halves of a row's words hold
/// tokens, the low halves are padding, so one FMA per packet; and four packets in flight,
/// so the FMA latency does not bound what is then little work per packet.
void forward_narrow(const Bf16LaneRuns& L, const std::uint16_t* x, std::int64_t xs, float* y,
                    std::int64_t ys, std::int64_t width) {
  constexpr int kWays = 4;
  const Bf16Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m512 acc[kWays];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const std::uint32_t b = L.begin[r], e = L.end[r];
    std::uint32_t k = b;
    for (; k + kWays <= e; k += kWays) {
      if (((k - b) & 15) < kWays) prefetch_stream(p + k + kStreamAhead);  // once per line
      if (k + kPrefetch + kWays <= e) {
        for (int j = 0; j < kWays; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(row_of(x, p[k + kPrefetch + j], xs)),
                       _MM_HINT_T0);
        }
      }
      for (int j = 0; j < kWays; ++j) {
        const __m512i block = _mm512_loadu_si512(row_of(x, p[k + j], xs));
        acc[j] = _mm512_fmadd_ps(broadcast_weight(p[k + j]), first_half(block), acc[j]);
      }
    }
    for (; k < e; ++k) {
      const __m512i block = _mm512_loadu_si512(row_of(x, p[k], xs));
      acc[0] = _mm512_fmadd_ps(broadcast_weight(p[k]), first_half(block), acc[0]);
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_mask_storeu_ps(y + r * ys, first(width), sum);
  }
}

void forward(const Bf16LaneRuns& L, Bf16Tile x, MutableTile y, std::int64_t tokens) {
  if (tokens <= 16) {
    forward_narrow(L, x.data, x.stride, y.data, y.stride, tokens);
    return;
  }
  for_each_group<kGroup, 32>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    forward_group<NV>(L, x.data + t0, x.stride, y.data + t0, y.stride, width);
  });
}

/// The weight gradient of a tile of at most 16 tokens: one multiply per packet (the low
/// halves are padding), eight packets' products reduced together and added to their
/// gradients at once, as the fp32 kernel does.
void backward_weight_narrow(const Bf16LaneRuns& L, const float* dy, std::int64_t dys,
                            const std::uint16_t* x, std::int64_t xs, const GradientSums& sums,
                            std::int64_t width) {
  const Bf16Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    if (r + 1 < L.runs) prefetch_lines(dy + (r + 1) * dys, width);
    const __m512 d = _mm512_maskz_loadu_ps(first(width), dy + r * dys);
    const std::uint32_t e = L.end[r];
    add_run_sums(sums, p, L.begin[r], e, [&](std::uint32_t k) {
      if ((k & 15) == 0) prefetch_stream(p + k + kStreamAhead);  // once per line
      if (k + kPrefetch < e) {
        _mm_prefetch(reinterpret_cast<const char*>(row_of(x, p[k + kPrefetch], xs)), _MM_HINT_T0);
      }
      return _mm512_mul_ps(d, first_half(_mm512_loadu_si512(row_of(x, p[k], xs))));
    });
  }
}

void backward_weight(const Bf16LaneRuns& L, Tile dy, Bf16Tile x, const GradientSums& sums,
                     std::int64_t tokens) {
  if (tokens <= 16) {
    backward_weight_narrow(L, dy.data, dy.stride, x.data, x.stride, sums, tokens);
    return;
  }
  for_each_group<kGroup, 32>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    backward_weight_group<NV>(L, dy.data + t0, dy.stride, x.data + t0, x.stride,
                              for_group(sums, t0 == 0, t0 + kGroup >= tokens), width);
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
  auto add_row = [&](float* out, __m512 w, const __m512* d) {
    for (int v = 0; v < NV; ++v) {
      _mm512_mask_storeu_ps(out + 16 * v, m[v],
                            _mm512_fmadd_ps(w, d[v], _mm512_maskz_loadu_ps(m[v], out + 16 * v)));
    }
  };
  for (std::int64_t r = 0; r < L.runs; ++r) {
    if (r + 1 < L.runs) prefetch_lines(dy + (r + 1) * dys, 16 * NV);
    __m512 d[NV];
    for (int v = 0; v < NV; ++v) d[v] = _mm512_maskz_loadu_ps(m[v], dy + r * dys + 16 * v);
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    // As the fp32 kernel: four rows per step, their packets read before any row is
    // written, and only each row's first line asked for ahead (all of them: ~15% slower).
    for (; k + 4 <= e; k += 4) {
      if ((k & 12) == 0) prefetch_stream(p + k + kStreamAhead);  // once per line
      if (k + kPrefetch + 4 <= e) {
        for (std::uint32_t j = 0; j < 4; ++j) {
          __builtin_prefetch(dx + static_cast<std::int64_t>(p[k + kPrefetch + j].index) * dxs, 1,
                             3);
        }
      }
      float* out[4];
      __m512 w[4];
      for (std::uint32_t j = 0; j < 4; ++j) {
        out[j] = dx + static_cast<std::int64_t>(p[k + j].index) * dxs;
        w[j] = broadcast_weight(p[k + j]);
      }
      for (std::uint32_t j = 0; j < 4; ++j) add_row(out[j], w[j], d);
    }
    for (; k < e; ++k)
      add_row(dx + static_cast<std::int64_t>(p[k].index) * dxs, broadcast_weight(p[k]), d);
  }
}

void backward_data(const Bf16LaneRuns& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  if (tokens == 1) return backward_data_one_token(L, dy, dx);
  for_each_group<64, 16>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    backward_data_group<NV>(L, dy.data + t0, dy.stride, dx.data + t0, dx.stride, width);
  });
}

/// fp32 -> bf16 rounding to nearest even, NaN kept a NaN (the same bits as to_bf16()),
/// written in this file's block order; zeros from n up to `padded` (a multiple of 32).
__m512i rounded_high_halves(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFF'FFFF)), _mm512_set1_epi32(0x7F80'0000));
  const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040'0000));
  return _mm512_and_si512(_mm512_mask_mov_epi32(rounded, nan, quiet), high_halves());
}

void pack(const float* src, std::uint16_t* dst, std::int64_t n, std::int64_t padded) {
  for (std::int64_t t = 0; t < padded; t += 32) {
    const __m512i first16 = rounded_high_halves(_mm512_maskz_loadu_ps(first(n - t), src + t));
    const __m512i second16 =
        rounded_high_halves(_mm512_maskz_loadu_ps(first(n - t - 16), src + t + 16));
    _mm512_storeu_si512(dst + t, _mm512_or_si512(first16, _mm512_srli_epi32(second16, 16)));
  }
}

}  // namespace

const Bf16LaneKernels kAvx512Bf16Kernels{forward, backward_data, backward_weight, pack};

}  // namespace sluice::detail
