// AVX-512 lane kernels. A token tile is handled in groups of up to 64 tokens (four
// zmm registers); the accumulators stay in registers for a whole output, and two
// independent sets of them hide the FMA latency. The last vector of a group is masked,
// so any token count works and nothing past a row's end is touched.
#include <immintrin.h>

// GCC 12 warns falsely inside _mm512_maskz_loadu_ps (its pass-through operand is unused).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>

#include "kernels/lane_kernels.hpp"

namespace sluice::detail {
namespace {

constexpr std::int64_t kGroup = 64;
constexpr std::uint32_t kPrefetch = 16;  // packets ahead

inline __mmask16 tail_mask(std::int64_t width) {
  const std::int64_t rem = width - (width - 1) / 16 * 16;  // 1..16
  return static_cast<__mmask16>((1U << rem) - 1U);
}

inline const float* row_of(const float* base, std::uint32_t tag, std::int64_t stride) {
  return base + static_cast<std::int64_t>(tag) * stride;
}

template <int NV, bool kTail>
inline __m512 load(const float* p, int v, __mmask16 tail) {
  return kTail && v == NV - 1 ? _mm512_maskz_loadu_ps(tail, p + 16 * v)
                              : _mm512_loadu_ps(p + 16 * v);
}

template <int NV, bool kTail>
inline void store(float* p, int v, __m512 value, __mmask16 tail) {
  if (kTail && v == NV - 1) {
    _mm512_mask_storeu_ps(p + 16 * v, tail, value);
  } else {
    _mm512_storeu_ps(p + 16 * v, value);
  }
}

template <int NV, bool kTail>
void forward_group(const LaneRuns& L, const float* x, std::int64_t xs, float* y, std::int64_t ys,
                   __mmask16 tail) {
  const Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m512 a[NV], b[NV];
    for (int v = 0; v < NV; ++v) a[v] = b[v] = _mm512_setzero_ps();
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 2 <= e; k += 2) {
      const float* x0 = row_of(x, p[k].tag, xs);
      const float* x1 = row_of(x, p[k + 1].tag, xs);
      const __m512 w0 = _mm512_set1_ps(p[k].value);
      const __m512 w1 = _mm512_set1_ps(p[k + 1].value);
      if (k + kPrefetch + 2 <= e) {
        // The stream says which rows come next: ask for them before they are needed.
        const float* n0 = row_of(x, p[k + kPrefetch].tag, xs);
        const float* n1 = row_of(x, p[k + kPrefetch + 1].tag, xs);
        for (int v = 0; v < NV; v += 4) {
          _mm_prefetch(reinterpret_cast<const char*>(n0 + 16 * v), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(n1 + 16 * v), _MM_HINT_T0);
        }
      }
      for (int v = 0; v < NV; ++v) {
        a[v] = _mm512_fmadd_ps(w0, load<NV, kTail>(x0, v, tail), a[v]);
        b[v] = _mm512_fmadd_ps(w1, load<NV, kTail>(x1, v, tail), b[v]);
      }
    }
    if (k < e) {
      const float* x0 = row_of(x, p[k].tag, xs);
      const __m512 w0 = _mm512_set1_ps(p[k].value);
      for (int v = 0; v < NV; ++v) a[v] = _mm512_fmadd_ps(w0, load<NV, kTail>(x0, v, tail), a[v]);
    }
    float* out = y + r * ys;
    for (int v = 0; v < NV; ++v) store<NV, kTail>(out, v, _mm512_add_ps(a[v], b[v]), tail);
  }
}

template <int NV, bool kTail>
void backward_data_group(const LaneRuns& L, const float* dy, std::int64_t dys, float* dx,
                         std::int64_t dxs, __mmask16 tail) {
  const Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy + r * dys;
    __m512 dv[NV];
    for (int v = 0; v < NV; ++v) dv[v] = load<NV, kTail>(d, v, tail);
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    // Indices are unique within an output, so the two rows never alias.
    for (; k + 2 <= e; k += 2) {
      if (k + kPrefetch + 2 <= e) {
        for (std::uint32_t j = 0; j < 2; ++j) {
          const float* next = dx + static_cast<std::int64_t>(p[k + kPrefetch + j].tag) * dxs;
          for (int v = 0; v < NV; v += 4) __builtin_prefetch(next + 16 * v, 1, 3);
        }
      }
      float* o0 = dx + static_cast<std::int64_t>(p[k].tag) * dxs;
      float* o1 = dx + static_cast<std::int64_t>(p[k + 1].tag) * dxs;
      const __m512 w0 = _mm512_set1_ps(p[k].value);
      const __m512 w1 = _mm512_set1_ps(p[k + 1].value);
      for (int v = 0; v < NV; ++v) {
        store<NV, kTail>(o0, v, _mm512_fmadd_ps(w0, dv[v], load<NV, kTail>(o0, v, tail)), tail);
        store<NV, kTail>(o1, v, _mm512_fmadd_ps(w1, dv[v], load<NV, kTail>(o1, v, tail)), tail);
      }
    }
    if (k < e) {
      float* o0 = dx + static_cast<std::int64_t>(p[k].tag) * dxs;
      const __m512 w0 = _mm512_set1_ps(p[k].value);
      for (int v = 0; v < NV; ++v) {
        store<NV, kTail>(o0, v, _mm512_fmadd_ps(w0, dv[v], load<NV, kTail>(o0, v, tail)), tail);
      }
    }
  }
}

/// Horizontal sums of eight vectors at once: [sum(v0), ..., sum(v7)]. Reducing eight
/// together costs about a third of reducing each alone, and the weight gradient needs
/// one reduction per non-zero per tile.
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/// Collects per-weight partial dot products and adds their sums to the gradient eight
/// at a time.
class GradientBatch {
 public:
  explicit GradientBatch(float* grad) : grad_(grad) {}
  void add(std::uint32_t k, __m512 partial) {
    pending_[n_] =
        _mm256_add_ps(_mm512_castps512_ps256(partial), _mm512_extractf32x8_ps(partial, 1));
    target_[n_++] = k;
    if (n_ == 8) flush();
  }
  void flush() {
    if (n_ == 0) return;
    for (int j = n_; j < 8; ++j) pending_[j] = _mm256_setzero_ps();
    const __m256 sums = hsum8(pending_);
    if (n_ == 8 && target_[7] == target_[0] + 7) {  // the usual case: eight in a row
      float* g = grad_ + target_[0];
      _mm256_storeu_ps(g, _mm256_add_ps(_mm256_loadu_ps(g), sums));
    } else {
      alignas(32) float each[8];
      _mm256_store_ps(each, sums);
      for (int j = 0; j < n_; ++j) grad_[target_[j]] += each[j];
    }
    n_ = 0;
  }

 private:
  float* grad_;
  __m256 pending_[8];
  std::uint32_t target_[8];
  int n_ = 0;
};

template <int NV, bool kTail>
void backward_weight_group(const LaneRuns& L, const float* dy, std::int64_t dys, const float* x,
                           std::int64_t xs, float* grad, __mmask16 tail) {
  const Packet* p = L.packets;
  GradientBatch batch(grad);
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy + r * dys;
    __m512 dv[NV];
    for (int v = 0; v < NV; ++v) dv[v] = load<NV, kTail>(d, v, tail);
    const std::uint32_t e = L.end[r];
    for (std::uint32_t k = L.begin[r]; k < e; ++k) {
      if (k + kPrefetch < e) {
        const float* n0 = row_of(x, p[k + kPrefetch].tag, xs);
        for (int v = 0; v < NV; v += 4) {
          _mm_prefetch(reinterpret_cast<const char*>(n0 + 16 * v), _MM_HINT_T0);
        }
      }
      const float* x0 = row_of(x, p[k].tag, xs);
      __m512 a = _mm512_mul_ps(dv[0], load<NV, kTail>(x0, 0, tail));
      for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(dv[v], load<NV, kTail>(x0, v, tail), a);
      batch.add(k, a);
    }
  }
  batch.flush();
}

// Runs `kernel.template operator()<NV, kTail>(t0, tail)` over the tile in groups of at
// most 64 tokens: NV vectors per group, the last one masked only when the group is not a
// whole number of vectors (an unmasked load can fuse into its FMA).
template <typename Kernel>
void for_each_group(std::int64_t tokens, Kernel&& kernel) {
  for (std::int64_t t0 = 0; t0 < tokens; t0 += kGroup) {
    const std::int64_t width = std::min(kGroup, tokens - t0);
    const __mmask16 tail = tail_mask(width);
    auto run = [&]<int NV>() {
      if (width % 16 != 0) {
        kernel.template operator()<NV, true>(t0, tail);
      } else {
        kernel.template operator()<NV, false>(t0, tail);
      }
    };
    switch ((width + 15) / 16) {
      case 1:
        run.template operator()<1>();
        break;
      case 2:
        run.template operator()<2>();
        break;
      case 3:
        run.template operator()<3>();
        break;
      default:
        run.template operator()<4>();
        break;
    }
  }
}

void forward(const LaneRuns& L, Tile x, MutableTile y, std::int64_t tokens) {
  for_each_group(tokens, [&]<int NV, bool kTail>(std::int64_t t0, __mmask16 tail) {
    forward_group<NV, kTail>(L, x.data + t0, x.stride, y.data + t0, y.stride, tail);
  });
}

void backward_data(const LaneRuns& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  for_each_group(tokens, [&]<int NV, bool kTail>(std::int64_t t0, __mmask16 tail) {
    backward_data_group<NV, kTail>(L, dy.data + t0, dy.stride, dx.data + t0, dx.stride, tail);
  });
}

void backward_weight(const LaneRuns& L, Tile dy, Tile x, float* grad, std::int64_t tokens) {
  for_each_group(tokens, [&]<int NV, bool kTail>(std::int64_t t0, __mmask16 tail) {
    backward_weight_group<NV, kTail>(L, dy.data + t0, dy.stride, x.data + t0, x.stride, grad, tail);
  });
}

}  // namespace

const LaneKernels kAvx512Kernels{forward, backward_data, backward_weight};

}  // namespace sluice::detail
