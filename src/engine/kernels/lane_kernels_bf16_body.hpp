#pragma once
// What the AVX2 and AVX-512 lane kernels for bf16 streams (lane_kernels_bf16_avx2.cpp,
// lane_kernels_bf16_avx512.cpp) do alike, written once over the including file's
// Bf16Lanes traits: its masked loads and stores of fp32 lanes, how it folds a weight's
// products to eight floats, and what it asks for ahead (measured per width). A resident
// bf16 row is kept in the blocks of bf16_block.hpp, which a load widens to fp32 exactly
// and in order, so products and sums are fp32 FMAs and results are stored without
// shuffles. Internal; as lane_kernels_body.hpp, everything here is in an unnamed
// namespace, so each file keeps its own copy.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "engine/kernels/bf16_block.hpp"
#include "engine/kernels/gradient_batch.hpp"
#include "engine/kernels/lane_kernels.hpp"
#include "engine/kernels/token_groups.hpp"

namespace sluice::detail {
namespace {

/// fp32 lanes a vector: half a block's tokens.
constexpr int kFloats = kBlockTokens / 2;
constexpr std::uint32_t kPrefetch = 16;  // packets ahead, for the rows they name

/// Asks for `bytes` of a row from `row` on, a line at a time.
[[gnu::always_inline]] inline void prefetch_lines(const void* row, std::int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (std::int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/// Asks for the stream kStreamAhead packets ahead, about once per 64-byte line (16
/// packets) of a walk kStep packets a step, where Bf16Lanes asks for it at all. The stream
/// is read once per tile, so it should not displace the tile: non-temporal. always_inline:
/// GCC 12 was seen to drop the prefetch from a plain inline helper.
template <typename Bf16Lanes, std::uint32_t kStep>
[[gnu::always_inline]] inline void prefetch_stream(const Bf16Packet* p, std::uint32_t k) {
  if constexpr (Bf16Lanes::kStreamAhead > 0) {
    if ((k & (16 - kStep)) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(p + k + Bf16Lanes::kStreamAhead), _MM_HINT_NTA);
    }
  }
}

/// Two packets a step, with accumulators for both halves of every block, in
/// Bf16Lanes::forward_sets(NV) sets (the second packet adds into the last set).
template <typename Bf16Lanes, int NV>
void forward_group(const Bf16LaneRuns& L, const std::uint16_t* x, std::int64_t xs, float* y,
                   std::int64_t ys, std::int64_t width) {
  constexpr int kSets = Bf16Lanes::forward_sets(NV);
  constexpr std::int64_t kRowBytes = Bf16Lanes::forward_row_bytes(NV);
  const Bf16Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    Bf16Floats a_first[kSets][NV], a_second[kSets][NV];
    for (int s = 0; s < kSets; ++s) {
      for (int v = 0; v < NV; ++v) a_first[s][v] = a_second[s][v] = Bf16Floats{};
    }
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 2 <= e; k += 2) {
      prefetch_stream<Bf16Lanes, 2>(p, k);
      if (k + kPrefetch + 2 <= e) {
        prefetch_lines(row_of(x, p[k + kPrefetch], xs), kRowBytes);
        prefetch_lines(row_of(x, p[k + kPrefetch + 1], xs), kRowBytes);
      }
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      const std::uint16_t* x1 = row_of(x, p[k + 1], xs);
      const Bf16Floats w0 = broadcast_weight(p[k]);
      const Bf16Floats w1 = broadcast_weight(p[k + 1]);
      for (int v = 0; v < NV; ++v) {
        const Bf16Words v0 = load_block(x0 + kBlockTokens * v);
        const Bf16Words v1 = load_block(x1 + kBlockTokens * v);
        a_first[0][v] = Bf16Lanes::fmadd(w0, first_half(v0), a_first[0][v]);
        a_second[0][v] = Bf16Lanes::fmadd(w0, second_half(v0), a_second[0][v]);
        a_first[kSets - 1][v] = Bf16Lanes::fmadd(w1, first_half(v1), a_first[kSets - 1][v]);
        a_second[kSets - 1][v] = Bf16Lanes::fmadd(w1, second_half(v1), a_second[kSets - 1][v]);
      }
    }
    if (k < e) {
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      const Bf16Floats w0 = broadcast_weight(p[k]);
      for (int v = 0; v < NV; ++v) {
        const Bf16Words v0 = load_block(x0 + kBlockTokens * v);
        a_first[0][v] = Bf16Lanes::fmadd(w0, first_half(v0), a_first[0][v]);
        a_second[0][v] = Bf16Lanes::fmadd(w0, second_half(v0), a_second[0][v]);
      }
    }
    float* out = y + r * ys;
    for (int v = 0; v < NV; ++v) {
      Bf16Floats lo = a_first[0][v], hi = a_second[0][v];
      if constexpr (kSets == 2) {
        lo = lo + a_first[1][v];
        hi = hi + a_second[1][v];
      }
      const std::int64_t t = kBlockTokens * v;
      Bf16Lanes::store_first(out + t, lo, width - t);
      Bf16Lanes::store_first(out + t + kFloats, hi, width - t - kFloats);
    }
  }
}

/// One weight at a time: its products with dY's row, split as the blocks are, folded to
/// eight floats and reduced with seven others' (GradientBatch).
template <typename Bf16Lanes, int NV>
void backward_weight_group(const Bf16LaneRuns& L, const float* dy, std::int64_t dys,
                           const std::uint16_t* x, std::int64_t xs, const GradientSums& sums,
                           std::int64_t width) {
  const Bf16Packet* p = L.packets;
  GradientBatch batch(sums, p);
  for (std::int64_t r = 0; r < L.runs; ++r) {
    if constexpr (Bf16Lanes::kPrefetchDy) {
      // The next output's dY row: read once per tile, and with short runs its miss would
      // stall the next output.
      if (r + 1 < L.runs) prefetch_lines(dy + (r + 1) * dys, sizeof(float) * kBlockTokens * NV);
    }
    // dY's row split as the blocks are; zeros past the group's width meet the zero
    // padding of the resident rows.
    Bf16Floats d_first[NV], d_second[NV];
    for (int v = 0; v < NV; ++v) {
      const std::int64_t t = kBlockTokens * v;
      d_first[v] = Bf16Lanes::load_first(dy + r * dys + t, width - t);
      d_second[v] = Bf16Lanes::load_first(dy + r * dys + t + kFloats, width - t - kFloats);
    }
    const std::uint32_t e = L.end[r];
    for (std::uint32_t k = L.begin[r]; k < e; ++k) {
      prefetch_stream<Bf16Lanes, 1>(p, k);
      if (k + kPrefetch < e)
        prefetch_lines(row_of(x, p[k + kPrefetch], xs), sizeof(Bf16Words) * NV);
      const std::uint16_t* x0 = row_of(x, p[k], xs);
      Bf16Floats a{}, b{};
      for (int v = 0; v < NV; ++v) {
        const Bf16Words xv = load_block(x0 + kBlockTokens * v);
        a = Bf16Lanes::fmadd(d_first[v], first_half(xv), a);
        b = Bf16Lanes::fmadd(d_second[v], second_half(xv), b);
      }
      batch.add(k, Bf16Lanes::fold8(a + b));
    }
  }
  batch.flush();
}

/// dX rows accumulate in fp32 from fp32 dY: only the weights are bf16. dY's row is held in
/// registers for a whole output; four rows a step, their packets read before any row is
/// written, and only each row's first line asked for ahead (asking for all of them
/// measured slower at both widths). `kRagged`: the group's last vector is partial, known
/// per group, so where Bf16Lanes masks only what it must the whole ones never are.
template <typename Bf16Lanes, int NV, bool kRagged>
void backward_data_group(const Bf16LaneRuns& L, const float* dy, std::int64_t dys, float* dx,
                         std::int64_t dxs, std::int64_t width) {
  const Bf16Packet* p = L.packets;
  typename Bf16Lanes::Tail tail[NV];
  for (int v = 0; v < NV; ++v) tail[v] = Bf16Lanes::first(width - kFloats * v);
  auto load = [&](const float* in, int v) {
    if (Bf16Lanes::kMaskEveryVector || (kRagged && v == NV - 1)) {
      return Bf16Lanes::load(in + kFloats * v, tail[v]);
    }
    return Bf16Lanes::load(in + kFloats * v);
  };
  auto add_row = [&](float* out, Bf16Floats w, const Bf16Floats* d) {
    for (int v = 0; v < NV; ++v) {
      const Bf16Floats sum = Bf16Lanes::fmadd(w, d[v], load(out, v));
      if (Bf16Lanes::kMaskEveryVector || (kRagged && v == NV - 1)) {
        Bf16Lanes::store(out + kFloats * v, sum, tail[v]);
      } else {
        Bf16Lanes::store(out + kFloats * v, sum);
      }
    }
  };
  for (std::int64_t r = 0; r < L.runs; ++r) {
    if constexpr (Bf16Lanes::kPrefetchDy) {
      if (r + 1 < L.runs) prefetch_lines(dy + (r + 1) * dys, sizeof(float) * kFloats * NV);
    }
    Bf16Floats d[NV];
    for (int v = 0; v < NV; ++v) d[v] = load(dy + r * dys, v);
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    for (; k + 4 <= e; k += 4) {
      prefetch_stream<Bf16Lanes, 4>(p, k);
      if (k + kPrefetch + 4 <= e) {
        for (std::uint32_t j = 0; j < 4; ++j) {
          __builtin_prefetch(dx + static_cast<std::int64_t>(p[k + kPrefetch + j].index) * dxs, 1,
                             3);
        }
      }
      float* out[4];
      Bf16Floats w[4];
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

/// Tokens per group of the kernels below: four blocks; the data gradient's (fp32 dY) four
/// vectors of AVX-512 or eight of AVX2.
constexpr std::int64_t kGroup = 4 * kBlockTokens;
constexpr std::int64_t kDataGroup = 64;

template <typename Bf16Lanes>
void forward_groups(const Bf16LaneRuns& L, Bf16Tile x, MutableTile y, std::int64_t tokens) {
  for_each_group<kGroup, kBlockTokens>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    forward_group<Bf16Lanes, NV>(L, x.data + t0, x.stride, y.data + t0, y.stride, width);
  });
}

template <typename Bf16Lanes>
void backward_weight_groups(const Bf16LaneRuns& L, Tile dy, Bf16Tile x, const GradientSums& sums,
                            std::int64_t tokens) {
  for_each_group<kGroup, kBlockTokens>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    backward_weight_group<Bf16Lanes, NV>(L, dy.data + t0, dy.stride, x.data + t0, x.stride,
                                         for_group(sums, t0 == 0, t0 + kGroup >= tokens), width);
  });
}

template <typename Bf16Lanes>
void backward_data(const Bf16LaneRuns& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  if (tokens == 1) return backward_data_one_token(L, dy, dx);
  for_each_group<kDataGroup, kFloats>(tokens, [&]<int NV>(std::int64_t t0, std::int64_t width) {
    const float* d = dy.data + t0;
    float* o = dx.data + t0;
    if (!Bf16Lanes::kMaskEveryVector && width % kFloats != 0) {
      backward_data_group<Bf16Lanes, NV, !Bf16Lanes::kMaskEveryVector>(L, d, dy.stride, o,
                                                                       dx.stride, width);
    } else {
      backward_data_group<Bf16Lanes, NV, false>(L, d, dy.stride, o, dx.stride, width);
    }
  });
}

/// One resident row in the block order; zeros from n up to `padded` (a multiple of 32 in
/// the engine; a last partial block is written only up to it regardless).
template <typename Bf16Lanes>
void pack(const float* src, std::uint16_t* dst, std::int64_t n, std::int64_t padded) {
  for (std::int64_t t = 0; t < padded; t += kBlockTokens) {
    const Bf16Words first = rounded_high_halves(Bf16Lanes::load_first(src + t, n - t));
    const Bf16Words second =
        rounded_high_halves(Bf16Lanes::load_first(src + t + kFloats, n - t - kFloats));
    const Bf16Words block = first | (second >> 16);
    if (padded - t >= kBlockTokens) {
      std::memcpy(dst + t, &block, sizeof block);
    } else {
      std::memcpy(dst + t, &block, sizeof(std::uint16_t) * static_cast<std::size_t>(padded - t));
    }
  }
}

}  // namespace
}  // namespace sluice::detail
