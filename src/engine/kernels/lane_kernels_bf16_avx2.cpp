// AVX2 + FMA lane kernels for bf16 streams: the AVX-512 scheme with 8-wide registers.
// These kernels keep a resident bf16 row in their own order (bf16_block_avx2.hpp), which
// a load widens to fp32 exactly and in order, so products and sums are fp32 FMAs and
// results are stored without shuffles. Groups of up to 64 tokens (four blocks); only the
// last vector of a group is masked, and masked stores are avoided where a vector is whole
// (they are slow on AMD cores).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "engine/kernels/bf16_block_avx2.hpp"
#include "engine/kernels/gradient_batch.hpp"
#include "engine/kernels/lane_kernels.hpp"
#include "engine/kernels/token_groups.hpp"

namespace sluice::detail {
namespace {

constexpr std::int64_t kGroup = 64;      // tokens per group: four 16-token vectors
constexpr std::uint32_t kPrefetch = 16;  // packets ahead

/// A packet's weight in every lane: its 32-bit word (value << 16 | index) without the index.
inline __m256 broadcast_weight(const Bf16Packet& p) {
  std::uint32_t word;
  std::memcpy(&word, &p, sizeof word);
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(word)), high_halves()));
}
inline const std::uint16_t* row_of(const std::uint16_t* x, const Bf16Packet& p, std::int64_t xs) {
  return x + static_cast<std::int64_t>(p.index) * xs;
}
inline __m256i load_bf16x16(const std::uint16_t* in) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
}
inline void prefetch_lines(const void* row, std::int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (std::int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/// Mask of the fp32 lanes in [0, 8) that are < n, for maskload/maskstore.
inline __m256i first(std::int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<std::int64_t>(n, 0, 8))),
                            lanes);
}
/// The first `n` of in[0, 8), zeros after; reads nothing past them.
inline __m256 load_first(const float* in, std::int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(in);
  if (n <= 0) return _mm256_setzero_ps();
  return _mm256_maskload_ps(in, first(n));
}
/// Writes the first `n` lanes of `value` to out[0, 8); touches nothing past them.
inline void store_first(float* out, __m256 value, std::int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(out, value);
  } else if (n > 0) {
    _mm256_maskstore_ps(out, first(n), value);
  }
}

template <int NV>
void forward_group(const Bf16LaneRuns& L, const std::uint16_t* x, std::int64_t xs, float* y,
                   std::int64_t ys, std::int64_t width) {
  // Two packets in flight, with accumulators for both halves of every block. With one or
  // two blocks each packet gets its own, so enough FMA chains run at once; with three or
  // four there are enough chains already and two sets would not fit sixteen registers.
  constexpr int kSets = NV <= 2 ? 2 : 1;
  const Bf16Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m256 a_first[kSets][NV], a_second[kSets][NV];
    for (int s = 0; s < kSets; ++s) {
      for (int v = 0; v < NV; ++v) a_first[s][v] = a_second[s][v] = _mm256_setzero_ps();
    }
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 2 <= e; k += 2) {
      if (k + kPrefetch + 2 <= e) {
        prefetch_lines(row_of(x, p[k + kPrefetch], xs), 32 * NV);
        prefetch_lines(row_of(x, p[k + kPrefetch + 1], xs), 32 * NV);
      }
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      const std::uint16_t* x1 = row_of(x, p[k + 1], xs);
      const __m256 w0 = broadcast_weight(p[k]);
      const __m256 w1 = broadcast_weight(p[k + 1]);
      for (int v = 0; v < NV; ++v) {
        const __m256i v0 = load_bf16x16(x0 + 16 * v);
        const __m256i v1 = load_bf16x16(x1 + 16 * v);
        a_first[0][v] = _mm256_fmadd_ps(w0, first_half(v0), a_first[0][v]);
        a_second[0][v] = _mm256_fmadd_ps(w0, second_half(v0), a_second[0][v]);
        a_first[kSets - 1][v] = _mm256_fmadd_ps(w1, first_half(v1), a_first[kSets - 1][v]);
        a_second[kSets - 1][v] = _mm256_fmadd_ps(w1, second_half(v1), a_second[kSets - 1][v]);
      }
    }
    if (k < e) {
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      const __m256 w0 = broadcast_weight(p[k]);
      for (int v = 0; v < NV; ++v) {
        const __m256i v0 = load_bf16x16(x0 + 16 * v);
        a_first[0][v] = _mm256_fmadd_ps(w0, first_half(v0), a_first[0][v]);
        a_second[0][v] = _mm256_fmadd_ps(w0, second_half(v0), a_second[0][v]);
      }
    }
    float* out = y + r * ys;
    for (int v = 0; v < NV; ++v) {
      __m256 lo = a_first[0][v], hi = a_second[0][v];
      if constexpr (kSets == 2) {
        lo = _mm256_add_ps(lo, a_first[1][v]);
        hi = _mm256_add_ps(hi, a_second[1][v]);
      }
      store_first(out + 16 * v, lo, width - 16 * v);
      store_first(out + 16 * v + 8, hi, width - 16 * v - 8);
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
    // dY's row split as the blocks are; zeros past the group's width meet the zero
    // padding of the resident rows.
    __m256 d_first[NV], d_second[NV];
    for (int v = 0; v < NV; ++v) {
      d_first[v] = load_first(dy + r * dys + 16 * v, width - 16 * v);
      d_second[v] = load_first(dy + r * dys + 16 * v + 8, width - 16 * v - 8);
    }
    const std::uint32_t e = L.end[r];
    for (std::uint32_t k = L.begin[r]; k < e; ++k) {
      if (k + kPrefetch < e) prefetch_lines(row_of(x, p[k + kPrefetch], xs), 32 * NV);
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
      for (int v = 0; v < NV; ++v) {
        const __m256i xv = load_bf16x16(x0 + 16 * v);
        a = _mm256_fmadd_ps(d_first[v], first_half(xv), a);
        b = _mm256_fmadd_ps(d_second[v], second_half(xv), b);
      }
      batch.add(k, _mm256_add_ps(a, b));
    }
  }
  batch.flush();
}

void forward(const Bf16LaneRuns& L, Bf16Tile x, MutableTile y, std::int64_t tokens) {
  for_each_group<kGroup, 16>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    forward_group<NV>(L, x.data + t0, x.stride, y.data + t0, y.stride, width);
  });
}

void backward_weight(const Bf16LaneRuns& L, Tile dy, Bf16Tile x, const GradientSums& sums,
                     std::int64_t tokens) {
  for_each_group<kGroup, 16>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    backward_weight_group<NV>(L, dy.data + t0, dy.stride, x.data + t0, x.stride,
                              for_group(sums, t0 == 0, t0 + kGroup >= tokens), width);
  });
}

/// dX rows accumulate in fp32 from fp32 dY: only the weights are bf16. Groups of up to 64
/// tokens (eight fp32 vectors), dY's row held in registers for a whole output. `Ragged`:
/// the last vector is partial and masked (known per group, so the whole ones never are).
template <int NV, bool Ragged>
void backward_data_group(const Bf16LaneRuns& L, const float* dy, std::int64_t dys, float* dx,
                         std::int64_t dxs, std::int64_t width) {
  const Bf16Packet* p = L.packets;
  const __m256i tail = first(width - 8 * (NV - 1));
  auto load = [&](const float* in, int v) {
    return Ragged && v == NV - 1 ? _mm256_maskload_ps(in + 8 * v, tail)
                                 : _mm256_loadu_ps(in + 8 * v);
  };
  auto add_row = [&](float* out, __m256 w, const __m256* d) {
    for (int v = 0; v < NV; ++v) {
      const __m256 sum = _mm256_fmadd_ps(w, d[v], load(out, v));
      if (Ragged && v == NV - 1) {
        _mm256_maskstore_ps(out + 8 * v, tail, sum);
      } else {
        _mm256_storeu_ps(out + 8 * v, sum);
      }
    }
  };
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m256 d[NV];
    for (int v = 0; v < NV; ++v) d[v] = load(dy + r * dys, v);
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    // As the fp32 kernels: four rows per step, their packets read before any row is
    // written, and only each row's first line asked for ahead (-25% against one row per
    // step with every line asked for).
    for (; k + 4 <= e; k += 4) {
      if (k + kPrefetch + 4 <= e) {
        for (std::uint32_t j = 0; j < 4; ++j) {
          __builtin_prefetch(dx + static_cast<std::int64_t>(p[k + kPrefetch + j].index) * dxs, 1,
                             3);
        }
      }
      float* out[4];
      __m256 w[4];
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
  for_each_group<kGroup, 8>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    const float* d = dy.data + t0;
    float* o = dx.data + t0;
    if (width % 8 == 0) {
      backward_data_group<NV, false>(L, d, dy.stride, o, dx.stride, width);
    } else {
      backward_data_group<NV, true>(L, d, dy.stride, o, dx.stride, width);
    }
  });
}

/// fp32 -> bf16 rounding to nearest even, NaN kept a (quiet) NaN: the same bits as
/// to_bf16(), in the high half of each lane.
inline __m256i rounded_high_halves(__m256 values) {
  const __m256i bits = _mm256_castps_si256(values);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  // |bits| > infinity's bits: both sides are non-negative, so the signed compare is right.
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFF'FFFF)),
                                         _mm256_set1_epi32(0x7F80'0000));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040'0000));
  return _mm256_and_si256(_mm256_blendv_epi8(rounded, quiet, nan), high_halves());
}

/// One resident row in this file's block order; zeros from n up to `padded`.
void pack(const float* src, std::uint16_t* dst, std::int64_t n, std::int64_t padded) {
  for (std::int64_t t = 0; t < padded; t += 16) {
    const __m256i first8 = rounded_high_halves(load_first(src + t, n - t));
    const __m256i second8 = rounded_high_halves(load_first(src + t + 8, n - t - 8));
    const __m256i block = _mm256_or_si256(first8, _mm256_srli_epi32(second8, 16));
    if (padded - t >= 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t), block);
    } else {  // `padded` is a multiple of 32 in the engine; stay inside it regardless
      alignas(32) std::uint16_t last[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(last), block);
      std::memcpy(dst + t, last, sizeof(std::uint16_t) * static_cast<std::size_t>(padded - t));
    }
  }
}

}  // namespace

const Bf16LaneKernels kAvx2Bf16Kernels{forward, backward_data, backward_weight, pack};

}  // namespace sluice::detail
