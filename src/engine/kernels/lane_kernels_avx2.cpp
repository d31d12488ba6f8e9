// AVX2 + FMA lane kernels: the AVX-512 scheme with 8-wide registers. Forward works in
// groups of up to 32 tokens (four ymm, two accumulator sets); the gradients in groups of
// up to 64 (eight ymm of dY held in registers), so a 64-token tile is one pass over the
// stream and costs one horizontal sum per weight. Only a group that is not a whole
// number of vectors masks its last vector: a masked store is microcoded on AMD cores
// (the data gradient ran 2.4x slower with it on every group).
#include <immintrin.h>

#include <algorithm>

#include "engine/kernels/gradient_batch.hpp"
#include "engine/kernels/lane_kernels_body.hpp"

namespace sluice::detail {
namespace {

// PacketT: an fp32 stream's packets, or a bf16 one's read as they are (X in fp32).
template <int NV, bool kTail, typename PacketT>
void forward_group(const Runs<PacketT>& L, const float* x, std::int64_t xs, float* y,
                   std::int64_t ys, __m256i tail) {
  const PacketT* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m256 a[NV], b[NV];
    for (int v = 0; v < NV; ++v) a[v] = b[v] = _mm256_setzero_ps();
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 2 <= e; k += 2) {
      const float* x0 = row_of(x, weight_tag(p[k]), xs);
      const float* x1 = row_of(x, weight_tag(p[k + 1]), xs);
      const __m256 w0 = _mm256_set1_ps(value_of(p[k]));
      const __m256 w1 = _mm256_set1_ps(value_of(p[k + 1]));
      for (int v = 0; v < NV; ++v) {
        a[v] = _mm256_fmadd_ps(w0, load<NV, kTail>(x0, v, tail), a[v]);
        b[v] = _mm256_fmadd_ps(w1, load<NV, kTail>(x1, v, tail), b[v]);
      }
    }
    if (k < e) {
      const float* x0 = row_of(x, weight_tag(p[k]), xs);
      const __m256 w0 = _mm256_set1_ps(value_of(p[k]));
      for (int v = 0; v < NV; ++v) a[v] = _mm256_fmadd_ps(w0, load<NV, kTail>(x0, v, tail), a[v]);
    }
    float* out = y + r * ys;
    for (int v = 0; v < NV; ++v) store<NV, kTail>(out, v, _mm256_add_ps(a[v], b[v]), tail);
  }
}

/// dot(dy, x) over the group, left as eight partial sums.
template <int NV, bool kTail>
__m256 dot_partial(const __m256* dv, const float* x, __m256i tail) {
  // Two chains: half the FMA latency on the critical path.
  __m256 a = _mm256_mul_ps(dv[0], load<NV, kTail>(x, 0, tail));
  if constexpr (NV == 1) {
    return a;
  } else {
    __m256 b = _mm256_mul_ps(dv[1], load<NV, kTail>(x, 1, tail));
    for (int v = 2; v + 1 < NV; v += 2) {
      a = _mm256_fmadd_ps(dv[v], load<NV, kTail>(x, v, tail), a);
      b = _mm256_fmadd_ps(dv[v + 1], load<NV, kTail>(x, v + 1, tail), b);
    }
    if constexpr (NV % 2 == 1) a = _mm256_fmadd_ps(dv[NV - 1], load<NV, kTail>(x, NV - 1, tail), a);
    return _mm256_add_ps(a, b);
  }
}

/// The backward of a stream by input (see ByInputKernel) on one group of up to 32 tokens.
/// Per run, one accumulator set for dX stays in registers (each packet's eight FMAs on two
/// ports outlast the FMA latency of one set) and each dY row is gathered once for both
/// products. Eight packets go per step, their dot products' partials in registers and
/// reduced together; X's row is read from L1 beside them, since with the partials, the
/// accumulators and the gathered row there is no register left to hold it. DyT: float, or
/// bf16 bits where dY is held in bf16.
template <bool kData, bool kWeight, int NV, bool kTail, typename PacketT, typename DyT>
void by_input_group(const Runs<PacketT>& L, const DyT* dy, std::int64_t dys, const float* x,
                    std::int64_t xs, float* dx, std::int64_t dxs, const GradientSums& sums,
                    __m256i tail) {
  const PacketT* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* row = kWeight ? x + r * xs : nullptr;
    if constexpr (kWeight) {
      if (r + 1 < L.runs) prefetch_row<NV>(row + xs);
    }
    __m256 acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
    // One packet: dX accumulated, and its dot product's partials returned.
    auto step = [&](std::uint32_t k) {
      __m256 dv[NV];
      load_row<NV, kTail>(row_of(dy, weight_tag(p[k]), dys), dv, tail);
      if constexpr (kData) {
        const __m256 w = _mm256_set1_ps(value_of(p[k]));
        for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(w, dv[v], acc[v]);
      }
      __m256 dot = _mm256_setzero_ps();
      if constexpr (kWeight) {
        dot = _mm256_mul_ps(dv[0], load<NV, kTail>(row, 0, tail));
        for (int v = 1; v < NV; ++v) {
          dot = _mm256_fmadd_ps(dv[v], load<NV, kTail>(row, v, tail), dot);
        }
      }
      return dot;
    };
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 8 <= e; k += 8) {
      // The rows ahead asked for once per step, not checked per packet (near the run's
      // end its last row is asked for again), as in the AVX-512 kernel.
      for (std::uint32_t j = 0; j < 8; ++j) {
        const std::uint32_t ahead = std::min(k + j + kPrefetch, e - 1);
        _mm_prefetch(reinterpret_cast<const char*>(row_of(dy, weight_tag(p[ahead]), dys)),
                     _MM_HINT_T0);
      }
      __m256 part[8];
      for (std::uint32_t j = 0; j < 8; ++j) part[j] = step(k + j);
      if constexpr (kWeight) leave_sums8(sums, p, k, hsum8(part));
    }
    if (k < e) {
      __m256 part[8];
      const auto n = static_cast<int>(e - k);
      for (int j = 0; j < 8; ++j) part[j] = j < n ? step(k + j) : _mm256_setzero_ps();
      if constexpr (kWeight) {
        alignas(32) float each[8];
        _mm256_store_ps(each, hsum8(part));
        for (int j = 0; j < n; ++j) leave_sum(sums, p, k + j, each[j]);
      }
    }
    if constexpr (kData) {
      float* out = dx + r * dxs;
      for (int v = 0; v < NV; ++v) store<NV, kTail>(out, v, acc[v], tail);
    }
  }
}

}  // namespace

const ByInputKernels kAvx2ByInput = kByInputKernels;
const LaneKernels kAvx2Kernels = kLaneKernels;

}  // namespace sluice::detail
