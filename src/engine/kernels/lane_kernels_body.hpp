#pragma once
// What the AVX2 and AVX-512 lane kernels (lane_kernels_avx2.cpp, lane_kernels_avx512.cpp)
// do alike, written once over the vector width of the file that includes it: a tile's
// tokens walked in groups of whole vectors (the last one masked only where the group is
// not whole), the gathered rows' loads and stores, and the gradients by output (each
// file's own: how a width takes a dot product's partial sums; each width reduces eight
// weights' partials together, add_run_sums). Internal. As blocks/block_kernels_body.hpp, everything
// here is in an unnamed namespace, so each file keeps its own copy and no ISA's code can stand in
// for another's at link time (tests/isa_objects_share_nothing.sh).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "engine/kernels/bf16_block.hpp"
#include "engine/kernels/lane_kernels.hpp"
#if defined(__AVX512F__)
#include "engine/kernels/reduce8.hpp"
#else
#include "engine/kernels/gradient_batch.hpp"
#endif

namespace sluice::detail {
namespace {

#if defined(__AVX512F__)
/// 16 fp32 lanes a vector; a group's last vector masked by a 16-bit mask.
struct Lanes {
  using Vec = __m512;
  using Tail = __mmask16;
  static constexpr int kWidth = 16;
  /// The lanes in use of a group's last vector, `width` tokens in the group.
  static Tail tail_mask(std::int64_t width) {
    const std::int64_t rem = width - (width - 1) / 16 * 16;  // 1..16
    return static_cast<__mmask16>((1U << rem) - 1U);
  }
  /// A dX row's lines asked for ahead: one in four vectors (four lines of 64 tokens).
  static constexpr int kDxPrefetchEvery = 4;
  static Vec load(const float* p, Tail tail) { return _mm512_maskz_loadu_ps(tail, p); }
  static void store(float* p, Vec value, Tail tail) { _mm512_mask_storeu_ps(p, tail, value); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
};
#else
/// AVX2: 8 fp32 lanes; a group's last vector masked by a vector of all-ones lanes. A masked
/// store is microcoded on AMD cores, so only a group that is not whole masks its last one.
struct Lanes {
  using Vec = __m256;
  using Tail = __m256i;
  static constexpr int kWidth = 8;
  static Tail tail_mask(std::int64_t width) {
    const int rem = static_cast<int>(width - (width - 1) / 8 * 8);  // 1..8
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), lanes);
  }
  /// A dX row's first line only (a group is at most eight vectors).
  static constexpr int kDxPrefetchEvery = 8;
  static Vec load(const float* p, Tail tail) { return _mm256_maskload_ps(p, tail); }
  static void store(float* p, Vec value, Tail tail) { _mm256_maskstore_ps(p, tail, value); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

using Vec = Lanes::Vec;
using Tail = Lanes::Tail;
constexpr int kWidth = Lanes::kWidth;

/// A whole vector's unaligned load and store, written once for either width as GCC's
/// _mm*_loadu_ps and _mm*_storeu_ps are: through a type of alignment 1.
typedef Vec UnalignedVec __attribute__((aligned(1)));
inline Vec load_whole(const float* p) {
  return *reinterpret_cast<const UnalignedVec*>(p);
}
inline void store_whole(float* p, Vec value) {
  *reinterpret_cast<UnalignedVec*>(p) = value;
}
/// `w` in every lane, as GCC's _mm*_set1_ps builds it.
template <std::size_t... kLane>
inline Vec splat(float w, std::index_sequence<kLane...>) {
  return Vec{(static_cast<void>(kLane), w)...};
}
inline Vec broadcast(float w) {
  return splat(w, std::make_index_sequence<kWidth>{});
}
/// Packets ahead for tile rows; only a row's first line is asked for (more requests only
/// queue behind the misses that matter).
constexpr std::uint32_t kPrefetch = 16;
#if defined(__AVX512F__)
/// Packets ahead that the stream itself is asked for: it is read once per tile, and with a
/// non-temporal hint it passes without evicting tile rows.
constexpr std::uint32_t kStreamAhead = 256;
#else
constexpr std::uint32_t kStreamAhead = 0;  // not asked for

/// add_run_sums (reduce8.hpp) at this width: for every packet k of a run [begin, end), its
/// dot product's eight partial sums, partial(k), eight packets' reduced together (hsum8)
/// and left as `g` says.
template <typename PacketT, typename Partial>
void add_run_sums(const GradientSums& g, const PacketT* packets, std::uint32_t begin,
                  std::uint32_t end, Partial&& partial) {
  __m256 part[8];
  std::uint32_t k = begin;
  for (; k + 8 <= end; k += 8) {
    for (std::uint32_t j = 0; j < 8; ++j) part[j] = partial(k + j);
    leave_sums8(g, packets, k, hsum8(part));
  }
  if (k < end) {
    const auto n = static_cast<int>(end - k);
#pragma GCC unroll 8  // left rolled, GCC 12 spilled in the loop above too
    for (int j = 0; j < 8; ++j) part[j] = j < n ? partial(k + j) : _mm256_setzero_ps();
    alignas(32) float each[8];
    _mm256_store_ps(each, hsum8(part));
    for (int j = 0; j < n; ++j) leave_sum(g, packets, k + j, each[j]);
  }
}
#endif

// always_inline: GCC 12 was seen to drop the prefetch from a plain inline helper.
template <typename PacketT>
[[gnu::always_inline]] inline void prefetch_stream(const PacketT* packet) {
  _mm_prefetch(reinterpret_cast<const char*>(packet), _MM_HINT_NTA);
}
/// Tokens per group of the by-output gradients.
constexpr std::int64_t kByOutputGroup = 64;

template <int NV, bool kTail>
inline Vec load(const float* p, int v, Tail tail) {
  return kTail && v == NV - 1 ? Lanes::load(p + kWidth * v, tail) : load_whole(p + kWidth * v);
}
/// A gathered dY row's NV vectors, from fp32 rows.
template <int NV, bool kTail>
inline void load_row(const float* row, Vec dv[NV], Tail tail) {
  for (int v = 0; v < NV; ++v) dv[v] = load<NV, kTail>(row, v, tail);
}
/// ... from bf16 rows in the bf16 kernels' order (bf16_block.hpp), widened exactly.
/// Rows are padded with zeros to whole blocks, so no load is masked.
template <int NV, bool kTail>
inline void load_row(const std::uint16_t* row, Vec dv[NV], Tail /*tail*/) {
  for (int v = 0; v < NV; v += 2) {
    const Bf16Words block = load_block(row + kWidth * v);
    dv[v] = first_half(block);
    if (v + 1 < NV) dv[v + 1] = second_half(block);
  }
}

template <int NV, bool kTail>
inline void store(float* p, int v, Vec value, Tail tail) {
  if (kTail && v == NV - 1) {
    Lanes::store(p + kWidth * v, value, tail);
  } else {
    store_whole(p + kWidth * v, value);
  }
}

template <typename T>
inline const T* row_of(const T* base, std::uint32_t tag, std::int64_t stride) {
  return base + static_cast<std::int64_t>(tag) * stride;
}

/// Asks for a whole row one output ahead, a line at a time: each output's row is read once
/// per tile, and with short runs (high sparsity) its miss would otherwise stall the next.
template <int NV>
[[gnu::always_inline]] inline void prefetch_row(const float* row) {
  for (int v = 0; v < NV; v += 64 / static_cast<int>(sizeof(Vec))) {
    _mm_prefetch(reinterpret_cast<const char*>(row + kWidth * v), _MM_HINT_T0);
  }
}

/// Output r's dY row into dv, the next output's asked for.
template <int NV, bool kTail, typename PacketT>
[[gnu::always_inline]] inline void load_output_row(const Runs<PacketT>& L, const float* dy,
                                                   std::int64_t dys, std::int64_t r, Vec* dv,
                                                   Tail tail) {
  const float* d = dy + r * dys;
  if (r + 1 < L.runs) prefetch_row<NV>(d + dys);
  for (int v = 0; v < NV; ++v) dv[v] = load<NV, kTail>(d, v, tail);
}

/// Calls run.template operator()<nv>() for the nv in NV..kMaxNV that matches.
template <int NV, int kMaxNV, typename Run>
void with_vector_count(int nv, Run& run) {
  if constexpr (NV < kMaxNV) {
    if (nv != NV) return with_vector_count<NV + 1, kMaxNV>(nv, run);
  }
  run.template operator()<NV>();
}

/// Runs `kernel.template operator()<NV, kTail>(t0, tail)` over the tile in groups of at
/// most kWidth * kMaxNV tokens: NV vectors per group, the last one masked only when the
/// group is not a whole number of vectors (an unmasked load can fuse into its FMA).
template <int kMaxNV, typename Kernel>
void for_each_group(std::int64_t tokens, Kernel&& kernel) {
  constexpr std::int64_t kTokens = kWidth * kMaxNV;
  for (std::int64_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const std::int64_t width = std::min(kTokens, tokens - t0);
    const Tail tail = Lanes::tail_mask(width);
    auto run = [&]<int NV>() {
      if (width % kWidth != 0) {
        kernel.template operator()<NV, true>(t0, tail);
      } else {
        kernel.template operator()<NV, false>(t0, tail);
      }
    };
    with_vector_count<1, kMaxNV>(static_cast<int>((width + kWidth - 1) / kWidth), run);
  }
}

template <int NV, bool kTail>
void backward_data_group(const LaneRuns& L, const float* dy, std::int64_t dys, float* dx,
                         std::int64_t dxs, Tail tail) {
  const Packet* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    Vec dv[NV];
    load_output_row<NV, kTail>(L, dy, dys, r, dv, tail);
    std::uint32_t k = L.begin[r];
    const std::uint32_t e = L.end[r];
    // Indices are unique within an output, so the rows never alias. Four rows per step
    // (faster than two at both widths).
    for (; k + 4 <= e; k += 4) {
      if (k + kPrefetch + 4 <= e) {
        for (std::uint32_t j = 0; j < 4; ++j) {
          const float* next = dx + static_cast<std::int64_t>(p[k + kPrefetch + j].tag) * dxs;
          for (int v = 0; v < NV; v += Lanes::kDxPrefetchEvery) {
            __builtin_prefetch(next + kWidth * v, 1, 3);
          }
        }
      }
      // The four packets are read before any row is written: the compiler cannot tell
      // a store to dX from one to the stream, and would read each packet after the last
      // row's stores.
      float* out[4];
      Vec w[4];
      for (std::uint32_t j = 0; j < 4; ++j) {
        out[j] = dx + static_cast<std::int64_t>(p[k + j].tag) * dxs;
        w[j] = broadcast(p[k + j].value);
      }
      for (std::uint32_t j = 0; j < 4; ++j) {
        for (int v = 0; v < NV; ++v) {
          store<NV, kTail>(out[j], v, Lanes::fmadd(w[j], dv[v], load<NV, kTail>(out[j], v, tail)),
                           tail);
        }
      }
    }
    for (; k < e; ++k) {
      float* out = dx + static_cast<std::int64_t>(p[k].tag) * dxs;
      const Vec w = broadcast(p[k].value);
      for (int v = 0; v < NV; ++v) {
        store<NV, kTail>(out, v, Lanes::fmadd(w, dv[v], load<NV, kTail>(out, v, tail)), tail);
      }
    }
  }
}

// Each including file's own, for the kernels below: its group kernels of the forward and
// the backward by input.
template <int NV, bool kTail, typename PacketT>
void forward_group(const Runs<PacketT>& L, const float* x, std::int64_t xs, float* y,
                   std::int64_t ys, Tail tail);
template <bool kData, bool kWeight, int NV, bool kTail, typename PacketT, typename DyT>
void by_input_group(const Runs<PacketT>& L, const DyT* dy, std::int64_t dys, const float* x,
                    std::int64_t xs, float* dx, std::int64_t dxs, const GradientSums& sums,
                    Tail tail);

#if defined(__AVX512F__)
// One token: AVX-512 has kernels of its own (one_token_avx512.cpp) for the backward by
// input and a bf16 stream's forward; an fp32 packet's forward stays the scalar dot (two
// loads, an FMA), which beats taking 16 apart for a gather at every sparsity measured,
// where a bf16 packet is one load and its gathers stay (performance_notes.md, "One token:
// scalar dots or gathers").
constexpr bool kOwnOneTokenKernels = true;
// Vectors of a by-input group from a bf16 dY: bf16 rows are half the bytes, so groups
// twice as wide as from fp32, and each packet's fixed work (its weight, its dot's
// reduction) covers twice the tokens.
constexpr int kByInputBf16Vectors = 8;
#else
constexpr bool kOwnOneTokenKernels = false;
constexpr int kByInputBf16Vectors = 4;
#endif

template <typename PacketT>
void forward(const Runs<PacketT>& L, Tile x, MutableTile y, std::int64_t tokens) {
  if (tokens == 1) {
    if constexpr (kOwnOneTokenKernels && std::is_same_v<PacketT, Bf16Packet>) {
      return forward_one_token_avx512(L, x, y);
    } else {
      return forward_one_token(L, x, y);
    }
  }
  for_each_group<4>(tokens, [&]<int NV, bool kTail>(std::int64_t t0, Tail tail) {
    forward_group<NV, kTail>(L, x.data + t0, x.stride, y.data + t0, y.stride, tail);
  });
}

template <typename PacketT, typename DyTile>
void by_input(const Runs<PacketT>& L, DyTile dy, Tile x, MutableTile dx, const GradientSums& sums,
              std::int64_t tokens) {
  if constexpr (std::is_same_v<DyTile, Tile>) {
    if (tokens == 1) {
      if constexpr (kOwnOneTokenKernels) {
        return by_input_one_token_avx512(L, dy, x, dx, sums);
      } else {
        return by_input_one_token(L, dy, x, dx, sums);
      }
    }
  }
  constexpr int kMaxNV = std::is_same_v<DyTile, Bf16Tile> ? kByInputBf16Vectors : 4;
  with_by_input_products(x, dx, [&]<bool kData, bool kWeight>() {
    for_each_group<kMaxNV>(tokens, [&]<int NV, bool kTail>(std::int64_t t0, Tail tail) {
      by_input_group<kData, kWeight, NV, kTail>(
          L, dy.data + t0, dy.stride, kWeight ? x.data + t0 : nullptr, x.stride,
          kData ? dx.data + t0 : nullptr, dx.stride,
          for_group(sums, t0 == 0, t0 + kWidth * kMaxNV >= tokens), tail);
    });
  });
}

/// dot(dy, x) over a group, left as partial sums: each including file's own.
template <int NV, bool kTail>
Vec dot_partial(const Vec* dv, const float* x, Tail tail);

/// The weight gradient by output on one group of tokens: output r's dY row in registers,
/// each packet's dot product with its X row, the row kPrefetch packets ahead asked for
/// (its first line: a group is at most four vectors of AVX-512, eight of AVX2).
template <int NV, bool kTail, typename PacketT>
void backward_weight_group(const Runs<PacketT>& L, const float* dy, std::int64_t dys,
                           const float* x, std::int64_t xs, const GradientSums& sums, Tail tail) {
  const PacketT* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    Vec dv[NV];
    load_output_row<NV, kTail>(L, dy, dys, r, dv, tail);
    const std::uint32_t e = L.end[r];
    add_run_sums(sums, p, L.begin[r], e, [&](std::uint32_t k) {
      if constexpr (kStreamAhead > 0) {
        if ((k & 7) == 0) prefetch_stream(p + k + kStreamAhead);  // once per line
      }
      if (k + kPrefetch < e) {
        _mm_prefetch(reinterpret_cast<const char*>(row_of(x, weight_tag(p[k + kPrefetch]), xs)),
                     _MM_HINT_T0);
      }
      return dot_partial<NV, kTail>(dv, row_of(x, weight_tag(p[k]), xs), tail);
    });
  }
}

void backward_data(const LaneRuns& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  if (tokens == 1) return backward_data_one_token(L, dy, dx);
  for_each_group<kByOutputGroup / kWidth>(
      tokens, [&]<int NV, bool kTail>(std::int64_t t0, Tail tail) {
        backward_data_group<NV, kTail>(L, dy.data + t0, dy.stride, dx.data + t0, dx.stride, tail);
      });
}

template <typename PacketT>
void backward_weight(const Runs<PacketT>& L, Tile dy, Tile x, const GradientSums& sums,
                     std::int64_t tokens) {
  if (tokens == 1) return backward_weight_one_token(L, dy, x, sums);
  for_each_group<kByOutputGroup / kWidth>(tokens, [&]<int NV, bool kTail>(std::int64_t t0,
                                                                          Tail tail) {
    backward_weight_group<NV, kTail>(L, dy.data + t0, dy.stride, x.data + t0, x.stride,
                                     for_group(sums, t0 == 0, t0 + kByOutputGroup >= tokens), tail);
  });
}

/// This width's kernels, as lane_kernels.hpp's tables of them hold them.
constexpr ByInputKernels kByInputKernels{by_input<Packet, Tile>, by_input<Bf16Packet, Tile>,
                                         by_input<Bf16Packet, Bf16Tile>};
constexpr LaneKernels kLaneKernels{forward<Packet>, backward_data, backward_weight<Packet>,
                                   forward<Bf16Packet>, backward_weight<Bf16Packet>};

}  // namespace
}  // namespace sluice::detail
