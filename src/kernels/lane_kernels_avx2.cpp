// AVX2 + FMA lane kernels: the AVX-512 scheme with 8-wide registers, groups of up to 32
// tokens (four ymm), the last vector masked.
#include <immintrin.h>

#include <algorithm>

#include "kernels/lane_kernels.hpp"

namespace sluice::detail {
namespace {

constexpr std::int64_t kGroup = 32;

inline __m256i tail_mask(std::int64_t width) {
  const int rem = static_cast<int>(width - (width - 1) / 8 * 8);  // 1..8
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), lanes);
}

template <int NV>
inline __m256 load(const float* p, int v, __m256i tail) {
  return v == NV - 1 ? _mm256_maskload_ps(p + 8 * v, tail) : _mm256_loadu_ps(p + 8 * v);
}

template <int NV>
inline void store(float* p, int v, __m256 value, __m256i tail) {
  if (v == NV - 1) {
    _mm256_maskstore_ps(p + 8 * v, tail, value);
  } else {
    _mm256_storeu_ps(p + 8 * v, value);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline const float* row_of(const float* base, std::uint32_t tag, std::int64_t stride) {
  return base + static_cast<std::int64_t>(tag) * stride;
}

template <int NV>
void forward_group(const LaneRuns& L, const float* x, std::int64_t xs, float* y, std::int64_t ys,
                   __m256i tail) {
  const Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m256 a[NV], b[NV];
    for (int v = 0; v < NV; ++v) a[v] = b[v] = _mm256_setzero_ps();
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 2 <= e; k += 2) {
      const float* x0 = row_of(x, p[k].tag, xs);
      const float* x1 = row_of(x, p[k + 1].tag, xs);
      const __m256 w0 = _mm256_set1_ps(p[k].value);
      const __m256 w1 = _mm256_set1_ps(p[k + 1].value);
      for (int v = 0; v < NV; ++v) {
        a[v] = _mm256_fmadd_ps(w0, load<NV>(x0, v, tail), a[v]);
        b[v] = _mm256_fmadd_ps(w1, load<NV>(x1, v, tail), b[v]);
      }
    }
    if (k < e) {
      const float* x0 = row_of(x, p[k].tag, xs);
      const __m256 w0 = _mm256_set1_ps(p[k].value);
      for (int v = 0; v < NV; ++v) a[v] = _mm256_fmadd_ps(w0, load<NV>(x0, v, tail), a[v]);
    }
    float* out = y + r * ys;
    for (int v = 0; v < NV; ++v) store<NV>(out, v, _mm256_add_ps(a[v], b[v]), tail);
  }
}

template <int NV>
void backward_data_group(const LaneRuns& L, const float* dy, std::int64_t dys, float* dx,
                         std::int64_t dxs, __m256i tail) {
  const Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy + r * dys;
    __m256 dv[NV];
    for (int v = 0; v < NV; ++v) dv[v] = load<NV>(d, v, tail);
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      float* o = dx + static_cast<std::int64_t>(p[k].tag) * dxs;
      const __m256 w = _mm256_set1_ps(p[k].value);
      for (int v = 0; v < NV; ++v) {
        store<NV>(o, v, _mm256_fmadd_ps(w, dv[v], load<NV>(o, v, tail)), tail);
      }
    }
  }
}

template <int NV>
void backward_weight_group(const LaneRuns& L, const float* dy, std::int64_t dys, const float* x,
                           std::int64_t xs, float* grad, __m256i tail) {
  const Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy + r * dys;
    __m256 dv[NV];
    for (int v = 0; v < NV; ++v) dv[v] = load<NV>(d, v, tail);
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const float* x0 = row_of(x, p[k].tag, xs);
      __m256 a = _mm256_mul_ps(dv[0], load<NV>(x0, 0, tail));
      for (int v = 1; v < NV; ++v) a = _mm256_fmadd_ps(dv[v], load<NV>(x0, v, tail), a);
      grad[k] += hsum(a);
    }
  }
}

// Runs `kernel.template operator()<NV>(t0, tail)` over the tile in groups of at most 32
// tokens: NV vectors per group, the last one masked.
template <typename Kernel>
void for_each_group(std::int64_t tokens, Kernel&& kernel) {
  for (std::int64_t t0 = 0; t0 < tokens; t0 += kGroup) {
    const std::int64_t width = std::min(kGroup, tokens - t0);
    const __m256i tail = tail_mask(width);
    switch ((width + 7) / 8) {
      case 1:
        kernel.template operator()<1>(t0, tail);
        break;
      case 2:
        kernel.template operator()<2>(t0, tail);
        break;
      case 3:
        kernel.template operator()<3>(t0, tail);
        break;
      default:
        kernel.template operator()<4>(t0, tail);
        break;
    }
  }
}

void forward(const LaneRuns& L, Tile x, MutableTile y, std::int64_t tokens) {
  for_each_group(tokens, [&]<int NV>(std::int64_t t0, __m256i tail) {
    forward_group<NV>(L, x.data + t0, x.stride, y.data + t0, y.stride, tail);
  });
}

void backward_data(const LaneRuns& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  for_each_group(tokens, [&]<int NV>(std::int64_t t0, __m256i tail) {
    backward_data_group<NV>(L, dy.data + t0, dy.stride, dx.data + t0, dx.stride, tail);
  });
}

void backward_weight(const LaneRuns& L, Tile dy, Tile x, float* grad, std::int64_t tokens) {
  for_each_group(tokens, [&]<int NV>(std::int64_t t0, __m256i tail) {
    backward_weight_group<NV>(L, dy.data + t0, dy.stride, x.data + t0, x.stride, grad, tail);
  });
}
}  // namespace

const LaneKernels kAvx2Kernels{forward, backward_data, backward_weight};

}  // namespace sluice::detail
