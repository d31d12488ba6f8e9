// AVX-512 lane kernels. A token tile is handled in groups of up to 64 tokens (four
// zmm registers; 128 in the by-input backward from a bf16 dY); the accumulators stay in
// registers for a whole output, and two independent sets of them hide the FMA latency.
// The last vector of a group is masked, so any token count works and nothing past a
// row's end is touched.
//
// Prefetching, as measured on Zen 5 with a 64-token tile filling the 1 MiB L2: each
// packet's row is asked for kPrefetch packets ahead, its first line only (asking for
// every line, or further ahead, was 10-20% slower: the extra requests queue behind the
// misses that matter). The stream itself, read once per tile, is asked for well ahead
// with a non-temporal hint so it passes without evicting tile rows (forward ~10%
// faster, the weight gradient a few percent; the data gradient, bound by writing its
// rows back, unchanged).
#include <immintrin.h>

// GCC 12 warns falsely inside _mm512_maskz_loadu_ps (its pass-through operand is unused).
#if defined(__GNUC__) && !defined(__clang__)  // clang has no such warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <algorithm>
#include <type_traits>

#include "engine/kernels/lane_kernels_body.hpp"
#include "engine/kernels/reduce8.hpp"

namespace sluice::detail {
namespace {

// PacketT: an fp32 stream's packets, or a bf16 one's read as they are (X in fp32).
// kSets packets are in flight, each adding into its own accumulators, so enough FMA
// chains hide the FMA latency: two sets of four vectors, but four sets of a group of one
// or two whole vectors (16 or 32 tokens), where two chains left the FMA units waiting.
// Not with a masked last vector, where four sets measured slower (performance_notes.md,
// "FMA chains per token group").
template <int NV, bool kTail, typename PacketT>
void forward_group(const Runs<PacketT>& L, const float* x, std::int64_t xs, float* y,
                   std::int64_t ys, __mmask16 tail) {
  constexpr int kSets = NV <= 2 && !kTail ? 4 : 2;
  const PacketT* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m512 acc[kSets][NV];
    for (auto& set : acc) {
      for (int v = 0; v < NV; ++v) set[v] = _mm512_setzero_ps();
    }
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + kSets <= e; k += kSets) {
      if ((k & (8 - kSets)) == 0) prefetch_stream(p + k + kStreamAhead);  // ~once per line
      if (k + kPrefetch + kSets <= e) {
        // The stream says which rows come next: ask for them before they are needed.
        for (int j = 0; j < kSets; ++j) {
          const float* next = row_of(x, weight_tag(p[k + kPrefetch + j]), xs);
          for (int v = 0; v < NV; v += 4) {
            _mm_prefetch(reinterpret_cast<const char*>(next + 16 * v), _MM_HINT_T0);
          }
        }
      }
      const float* rows[kSets];
      __m512 w[kSets];
      for (int j = 0; j < kSets; ++j) {
        rows[j] = row_of(x, weight_tag(p[k + j]), xs);
        w[j] = _mm512_set1_ps(value_of(p[k + j]));
      }
      for (int v = 0; v < NV; ++v) {
        for (int j = 0; j < kSets; ++j) {
          acc[j][v] = _mm512_fmadd_ps(w[j], load<NV, kTail>(rows[j], v, tail), acc[j][v]);
        }
      }
    }
    for (int j = 0; j + 1 < kSets; ++j) {  // fewer than kSets left (a fixed j each)
      if (k + j >= e) break;
      const float* row = row_of(x, weight_tag(p[k + j]), xs);
      const __m512 w = _mm512_set1_ps(value_of(p[k + j]));
      for (int v = 0; v < NV; ++v) {
        acc[j][v] = _mm512_fmadd_ps(w, load<NV, kTail>(row, v, tail), acc[j][v]);
      }
    }
    float* out = y + r * ys;
    for (int v = 0; v < NV; ++v) {
      __m512 sum = acc[0][v];
      for (int j = 1; j < kSets; ++j) sum = _mm512_add_ps(sum, acc[j][v]);
      store<NV, kTail>(out, v, sum, tail);
    }
  }
}

/// dot(a, b) over the group's NV vectors, left as 16 partial sums (two chains at the full
/// width).
template <int NV>
inline __m512 dot_registers(const __m512* a, const __m512* b) {
  if constexpr (NV == 4) {
    return _mm512_add_ps(_mm512_fmadd_ps(a[1], b[1], _mm512_mul_ps(a[0], b[0])),
                         _mm512_fmadd_ps(a[3], b[3], _mm512_mul_ps(a[2], b[2])));
  } else {
    __m512 sum = _mm512_mul_ps(a[0], b[0]);
    for (int v = 1; v < NV; ++v) sum = _mm512_fmadd_ps(a[v], b[v], sum);
    return sum;
  }
}

/// dot(dy, x) over the group with x's row loaded here (the loads fuse into the FMAs).
template <int NV, bool kTail>
__m512 dot_partial(const __m512* dv, const float* x, __mmask16 tail) {
  __m512 xv[NV];
  for (int v = 0; v < NV; ++v) xv[v] = load<NV, kTail>(x, v, tail);
  return dot_registers<NV>(dv, xv);
}

/// The backward of a stream by input (see ByInputKernel) on one group of tokens. Per run,
/// X's row (for the weight gradient) and two accumulator sets (for dX, hiding the FMA
/// latency) stay in registers while the run's dY rows (DyT: float, or bf16 bits) are
/// gathered from the resident tile, each once for both products; the weights' dot
/// products are reduced eight at a time.
template <bool kData, bool kWeight, int NV, bool kTail, typename PacketT, typename DyT>
void by_input_group(const Runs<PacketT>& L, const DyT* dy, std::int64_t dys, const float* x,
                    std::int64_t xs, float* dx, std::int64_t dxs, const GradientSums& sums,
                    __mmask16 tail) {
  const PacketT* p = L.packets;
  auto prefetch_rows = [&](std::uint32_t k) __attribute__((always_inline)) {
    // The row's first line only (see the top of the file).
    _mm_prefetch(reinterpret_cast<const char*>(row_of(dy, weight_tag(p[k]), dys)), _MM_HINT_T0);
  };
  for (std::int64_t r = 0; r < L.runs; ++r) {
    __m512 xv[NV];
    if constexpr (kWeight) {
      const float* row = x + r * xs;
      for (int v = 0; v < NV; ++v) xv[v] = load<NV, kTail>(row, v, tail);
      if (r + 1 < L.runs) prefetch_row<NV>(row + xs);  // read once per tile, in order
    }
    // Two accumulator sets hide the FMA latency for up to four vectors; more vectors are
    // enough chains in one set, and two would not fit the registers.
    constexpr bool kTwoSets = NV <= 4;
    __m512 a[NV], b_set[kTwoSets ? NV : 1];
    __m512* b = kTwoSets ? b_set : a;
    for (int v = 0; v < NV; ++v) a[v] = _mm512_setzero_ps();
    if constexpr (kTwoSets) {
      for (int v = 0; v < NV; ++v) b[v] = _mm512_setzero_ps();
    }
    const std::uint32_t e = L.end[r];
    // One packet: its dY row gathered once, for dX (into set a or b) and for its dot.
    // The caller asks for the rows and the stream ahead.
    auto packet = [&](std::uint32_t k, __m512 acc[NV]) __attribute__((always_inline)) {
      __m512 dv[NV];
      load_row<NV, kTail>(row_of(dy, weight_tag(p[k]), dys), dv, tail);
      if constexpr (kData) {
        const __m512 w = _mm512_set1_ps(value_of(p[k]));
        for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(w, dv[v], acc[v]);
      }
      if constexpr (kWeight) {
        return dot_registers<NV>(dv, xv);
      } else {
        return _mm512_setzero_ps();
      }
    };
    // Packets go to a and b in turn, each named at compile time: an accumulator picked at
    // run time would live in memory (the dX pass then ran 1.5x the forward's time).
    // Each pair's dots are folded as soon as both are done (fold_pair), so four vectors
    // wait for the reduction, not eight: with X's row, both sets and the gathered row,
    // eight would not fit the 32 zmm and went to the stack every step.
    std::uint32_t k = L.begin[r];
    for (; k + 8 <= e; k += 8) {
      // Once per step, not per packet: the checks cost more issue slots than the
      // prefetches they save. Near the run's end its last row is asked for again.
      prefetch_stream(p + k + kStreamAhead);
      for (std::uint32_t j = 0; j < 8; ++j) prefetch_rows(std::min(k + j + kPrefetch, e - 1));
      const __m512 pairs[4] = {fold_pair(packet(k, a), packet(k + 1, b)),
                               fold_pair(packet(k + 2, a), packet(k + 3, b)),
                               fold_pair(packet(k + 4, a), packet(k + 5, b)),
                               fold_pair(packet(k + 6, a), packet(k + 7, b))};
      if constexpr (kWeight) add_folded_sums(sums, p, k, fold_pairs(pairs), 8);
    }
    if (k < e) {
      prefetch_stream(p + k + kStreamAhead);
      const unsigned n = e - k;  // 1..7: the missing packets' dots are zeros
      const __m512 zero = _mm512_setzero_ps();
      __m512 pairs[4];
      for (unsigned j = 0; j < 8; j += 2) {
        pairs[j / 2] =
            fold_pair(j < n ? packet(k + j, a) : zero, j + 1 < n ? packet(k + j + 1, b) : zero);
      }
      if constexpr (kWeight) add_folded_sums(sums, p, k, fold_pairs(pairs), n);
    }
    if constexpr (kData) {
      float* out = dx + r * dxs;
      for (int v = 0; v < NV; ++v) {
        store<NV, kTail>(out, v, kTwoSets ? _mm512_add_ps(a[v], b[v]) : a[v], tail);
      }
    }
  }
}

}  // namespace

const ByInputKernels kAvx512ByInput = kByInputKernels;
const LaneKernels kAvx512Kernels = kLaneKernels;

}  // namespace sluice::detail
