// The AVX-512 products of a single token: the forward of a bf16 stream, per output a sparse
// dot product of its run with X's one column (an fp32 stream's forward is faster scalar,
// see lane_kernels_avx512.cpp), and the backward by input, the same over dY's column. A
// step takes 16 packets apart into tags and weights with two permutes (fp32) or two masks
// (bf16), gathers their 16 activations and adds with one FMA; the sum is reduced once per
// run. The scalar form (dot_one_token) costs two loads, a multiply and an add a packet,
// and stays for short runs, where the gathers and the reduction do not pay.
#include "engine/kernels/avx512_intrinsics.hpp"

#include <algorithm>

#include "engine/kernels/lane_kernels.hpp"

namespace sluice::detail {
namespace {

constexpr std::uint32_t kShortRun = 128;  // runs shorter than this stay scalar (see below)

/// Mask of the first n of 16 lanes (n <= 16).
inline __mmask16 first(std::uint32_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xFFFFU : (1U << n) - 1U);
}

/// Packets [k, k + n) of an fp32 stream (n <= 16) as their tags and weights; lanes past n
/// are zero (tag 0, weight 0: a gather there is masked off anyway).
inline void take(const Packet* p, std::uint32_t n, __m512i& tags, __m512& weights) {
  // Packet j is the 32-bit words 2j (tag) and 2j + 1 (weight) of the two vectors.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const auto* words = reinterpret_cast<const float*>(p);
  const __mmask16 lo = first(2 * std::min<std::uint32_t>(n, 8));
  const __mmask16 hi = first(n > 8 ? 2 * (n - 8) : 0);
  const __m512i a = _mm512_castps_si512(_mm512_maskz_loadu_ps(lo, words));
  const __m512i b = _mm512_castps_si512(_mm512_maskz_loadu_ps(hi, words + 16));
  tags = _mm512_permutex2var_epi32(a, even, b);
  weights = _mm512_castsi512_ps(_mm512_permutex2var_epi32(a, odd, b));
}
/// ... of a bf16 stream: each packet one 32-bit word, value << 16 | index.
inline void take(const Bf16Packet* p, std::uint32_t n, __m512i& tags, __m512& weights) {
  const __m512i words = _mm512_maskz_loadu_epi32(first(n), p);
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  tags = _mm512_and_si512(words, low);
  weights = _mm512_castsi512_ps(_mm512_andnot_si512(low, words));
}

/// Where x's elements for `tags` lie, as the gathers' 32-bit offsets: tag * stride. False
/// if some offset would not fit (a layer of over 2^31 / stride inputs), which the caller
/// then takes packet by packet.
inline bool offsets(__m512i tags, std::int64_t stride, __m512i& out) {
  if (stride == 1) {  // a packed one-token tile (tags < 2^31 by the stream format)
    out = tags;
    return true;
  }
  const auto limit = static_cast<int>(0x7FFF'FFFF / stride);
  if (_mm512_cmpgt_epu32_mask(tags, _mm512_set1_epi32(limit)) != 0) return false;
  out = _mm512_mullo_epi32(tags, _mm512_set1_epi32(static_cast<int>(stride)));
  return true;
}

template <typename PacketT>
void forward_one_token_gather(const Runs<PacketT>& L, Tile x, MutableTile y) {
  static_assert(sizeof(Packet) == 8 && sizeof(Bf16Packet) == 4);
  if (x.stride < 1 || x.stride > 0x7FFF'FFFF) return forward_one_token(L, x, y);
  const PacketT* p = L.packets;
  // Packets [k, k + n) (n <= 16) of the run, their products added to `sum`.
  auto step = [&](std::uint32_t k, std::uint32_t n, __m512& sum) {
    __m512i tags, at;
    __m512 w;
    take(p + k, n, tags, w);
    if (offsets(tags, x.stride, at)) {
      sum = _mm512_fmadd_ps(
          w, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), first(n), at, x.data, 4), sum);
      return;
    }
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(1, _mm512_set1_ps(dot_one_token(p, k, k + n, x))));
  };
  for (std::int64_t r = 0; r < L.runs; ++r) {
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    // A short run pays a reduction, and masked steps, for few packets: below about a
    // hundred packets the scalar dot measured faster (performance_notes.md, "One token:
    // scalar dots or gathers").
    if (e - k < kShortRun) {
      y.data[r * y.stride] = dot_one_token(p, k, e, x);
      continue;
    }
    // Two sums: a gather's latency is long, and each step's FMA waits on its own only.
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (; k + 32 <= e; k += 32) {
      step(k, 16, a);
      step(k + 16, 16, b);
    }
    for (; k < e; k += 16) step(k, std::min<std::uint32_t>(16, e - k), a);
    y.data[r * y.stride] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

/// Leaves the products s of packets [k, k + n) (n <= 16) as `sums` says (leave_sum, 16 at
/// once): gradient packets {tag, total} interleaved by two permutes, or partial sums.
inline void leave_sums(const GradientSums& sums, std::uint32_t k, std::uint32_t n, __m512i tags,
                       __m512 s) {
  const __m512 total =
      sums.first ? s : _mm512_add_ps(_mm512_maskz_loadu_ps(first(n), sums.partial + k), s);
  if (sums.out == nullptr) {
    _mm512_mask_storeu_ps(sums.partial + k, first(n), total);
    return;
  }
  // Packet j is words 2j (tag) and 2j + 1 (total): lanes j of `tags` and 16 + j of `total`.
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
  const __m512i values = _mm512_castps_si512(total);
  auto* words = reinterpret_cast<float*>(sums.out + k);
  _mm512_mask_storeu_ps(words, first(2 * std::min<std::uint32_t>(n, 8)),
                        _mm512_castsi512_ps(_mm512_permutex2var_epi32(tags, low, values)));
  _mm512_mask_storeu_ps(words + 16, first(n > 8 ? 2 * (n - 8) : 0),
                        _mm512_castsi512_ps(_mm512_permutex2var_epi32(tags, high, values)));
}

/// Packets [k, e) of a long by-input run for one token (by_input_run_one_token) with
/// gathers: one gather of dY a step serves both the run's dX (a dot product, as the
/// forward's) and its weights' products with the run's activation `xr`. Not inlined, so
/// the loop over short runs stays as tight as the scalar form's (inlined, it made 99%,
/// where every run is short, ~12% slower).
template <bool kData, bool kWeight, typename PacketT>
[[gnu::noinline]] float by_input_long_run(const PacketT* p, std::uint32_t k, std::uint32_t e,
                                          Tile dy, float xr, const GradientSums& sums) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  auto step = [&](std::uint32_t j, std::uint32_t n, __m512& sum) {
    __m512i tags, at;
    __m512 w;
    take(p + j, n, tags, w);
    if (!offsets(tags, dy.stride, at)) {
      const float d = by_input_run_one_token<kData, kWeight>(p, j, j + n, dy, xr, sums);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(1, _mm512_set1_ps(d)));
      return;
    }
    const __m512 d = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), first(n), at, dy.data, 4);
    if constexpr (kData) sum = _mm512_fmadd_ps(w, d, sum);
    if constexpr (kWeight) leave_sums(sums, j, n, tags, _mm512_mul_ps(_mm512_set1_ps(xr), d));
  };
  for (; k + 32 <= e; k += 32) {
    step(k, 16, a);
    step(k + 16, 16, b);
  }
  for (; k < e; k += 16) step(k, std::min<std::uint32_t>(16, e - k), a);
  return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}

/// The backward by input of one token (by_input_one_token), long runs with gathers.
template <typename PacketT>
void by_input_one_token_gather(const Runs<PacketT>& L, Tile dy, Tile x, MutableTile dx,
                               const GradientSums& sums) {
  static_assert(sizeof(Packet) == 2 * sizeof(float));  // leave_sums writes its words
  if (dy.stride < 1 || dy.stride > 0x7FFF'FFFF) return by_input_one_token(L, dy, x, dx, sums);
  const PacketT* p = L.packets;
  with_by_input_products(x, dx, [&]<bool kData, bool kWeight>() {
    for (std::int64_t r = 0; r < L.runs; ++r) {
      const std::uint32_t k = L.begin[r], e = L.end[r];
      const float xr = kWeight ? x.data[r * x.stride] : 0.0F;
      const float d = e - k < kShortRun  // (as the forward's)
                          ? by_input_run_one_token<kData, kWeight>(p, k, e, dy, xr, sums)
                          : by_input_long_run<kData, kWeight>(p, k, e, dy, xr, sums);
      if constexpr (kData) dx.data[r * dx.stride] = d;
    }
  });
}

}  // namespace

void forward_one_token_avx512(const Bf16LaneRuns& runs, Tile x, MutableTile y) {
  forward_one_token_gather(runs, x, y);
}
void by_input_one_token_avx512(const LaneRuns& runs, Tile dy, Tile x, MutableTile dx,
                               const GradientSums& sums) {
  by_input_one_token_gather(runs, dy, x, dx, sums);
}
void by_input_one_token_avx512(const Bf16LaneRuns& runs, Tile dy, Tile x, MutableTile dx,
                               const GradientSums& sums) {
  by_input_one_token_gather(runs, dy, x, dx, sums);
}

}  // namespace sluice::detail
