// AVX-512 lane kernels for bf16 streams: lane_kernels_bf16_body.hpp at 16 fp32 lanes (32
// tokens a block, groups of up to 128), every vector masked, the stream and the next dY
// row asked for ahead; and two kernels of their own for a tile of at most 16 tokens.
// (The AVX512-BF16 dot product would pair neighbouring tokens, letting a NaN in one poison
// the other, and needs a newer CPU than AVX-512F; it measured no faster here.)
#include <immintrin.h>

#if defined(__GNUC__) && !defined(__clang__)            // clang has no such warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12, masked loads
#endif

#include <algorithm>

#include "engine/kernels/lane_kernels_bf16_body.hpp"
#include "engine/kernels/reduce8.hpp"

namespace sluice::detail {
namespace {

struct Bf16Lanes {
  using Tail = __mmask16;
  static constexpr std::uint32_t kStreamAhead = 256;  // packets ahead, for the stream itself
  static constexpr bool kPrefetchDy = true;
  static constexpr bool kMaskEveryVector = true;
  /// Two packets in flight, each with its own accumulators.
  static constexpr int forward_sets(int /*nv*/) { return 2; }
  /// A forward row's first line only, as the fp32 kernels (~2% faster).
  static constexpr std::int64_t forward_row_bytes(int /*nv*/) { return 64; }

  /// Mask of the fp32 lanes in [0, 16) that are < n.
  static Tail first(std::int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                   : static_cast<__mmask16>((1U << std::max<std::int64_t>(n, 0)) - 1U);
  }
  static __m512 load(const float* in) { return _mm512_loadu_ps(in); }
  static __m512 load(const float* in, Tail tail) { return _mm512_maskz_loadu_ps(tail, in); }
  static __m512 load_first(const float* in, std::int64_t n) { return load(in, first(n)); }
  static void store(float* out, __m512 value) { _mm512_storeu_ps(out, value); }
  static void store(float* out, __m512 value, Tail tail) {
    _mm512_mask_storeu_ps(out, tail, value);
  }
  static void store_first(float* out, __m512 value, std::int64_t n) { store(out, value, first(n)); }
  static __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold8(__m512 sum) {
    return _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1));
  }
};

/// The stream, once per line of a walk that starts at packet `b`, kWays packets a step.
template <int kWays>
[[gnu::always_inline]] inline void prefetch_stream_from(const Bf16Packet* p, std::uint32_t b,
                                                        std::uint32_t k) {
  if (((k - b) & 15) < kWays) {
    _mm_prefetch(reinterpret_cast<const char*>(p + k + Bf16Lanes::kStreamAhead), _MM_HINT_NTA);
  }
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
      prefetch_stream_from<kWays>(p, b, k);
      if (k + kPrefetch + kWays <= e) {
        for (int j = 0; j < kWays; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(row_of(x, p[k + kPrefetch + j], xs)),
                       _MM_HINT_T0);
        }
      }
      for (int j = 0; j < kWays; ++j) {
        const Bf16Words block = load_block(row_of(x, p[k + j], xs));
        acc[j] = _mm512_fmadd_ps(broadcast_weight(p[k + j]), first_half(block), acc[j]);
      }
    }
    for (; k < e; ++k) {
      const Bf16Words block = load_block(row_of(x, p[k], xs));
      acc[0] = _mm512_fmadd_ps(broadcast_weight(p[k]), first_half(block), acc[0]);
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_mask_storeu_ps(y + r * ys, Bf16Lanes::first(width), sum);
  }
}

void forward(const Bf16LaneRuns& L, Bf16Tile x, MutableTile y, std::int64_t tokens) {
  if (tokens <= 16) {
    forward_narrow(L, x.data, x.stride, y.data, y.stride, tokens);
    return;
  }
  forward_groups<Bf16Lanes>(L, x, y, tokens);
}

/// The weight gradient of a tile of at most 16 tokens: one multiply per packet (the low
/// halves are padding), eight packets' products reduced together and added to their
/// gradients at once, as the fp32 kernel does.
void backward_weight_narrow(const Bf16LaneRuns& L, const float* dy, std::int64_t dys,
                            const std::uint16_t* x, std::int64_t xs, const GradientSums& sums,
                            std::int64_t width) {
  const Bf16Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    if (r + 1 < L.runs) prefetch_lines(dy + (r + 1) * dys, sizeof(float) * width);
    const __m512 d = Bf16Lanes::load_first(dy + r * dys, width);
    const std::uint32_t e = L.end[r];
    add_run_sums(sums, p, L.begin[r], e, [&](std::uint32_t k) {
      prefetch_stream<Bf16Lanes, 1>(p, k);
      if (k + kPrefetch < e) {
        _mm_prefetch(reinterpret_cast<const char*>(row_of(x, p[k + kPrefetch], xs)), _MM_HINT_T0);
      }
      return _mm512_mul_ps(d, first_half(load_block(row_of(x, p[k], xs))));
    });
  }
}

void backward_weight(const Bf16LaneRuns& L, Tile dy, Bf16Tile x, const GradientSums& sums,
                     std::int64_t tokens) {
  if (tokens <= 16) {
    backward_weight_narrow(L, dy.data, dy.stride, x.data, x.stride, sums, tokens);
    return;
  }
  backward_weight_groups<Bf16Lanes>(L, dy, x, sums, tokens);
}

}  // namespace

const Bf16LaneKernels kAvx512Bf16Kernels{forward, backward_data<Bf16Lanes>, backward_weight,
                                         pack<Bf16Lanes>};

}  // namespace sluice::detail
