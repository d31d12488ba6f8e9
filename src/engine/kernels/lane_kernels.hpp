#pragma once
// The lane kernels: what one engine lane does with its share of a stream chunk on one
// token tile. Internal; one implementation per ISA, chosen once at run time.
#include <cstdint>

#include "sluice/bf16.hpp"
#include "sluice/isa.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

/// An element of a tile row as fp32: as it is, or widened exactly from bf16 (the scalar
/// kernels, whose bf16 rows are in token order).
inline float widen(float v) {
  return v;
}
inline float widen(std::uint16_t v) {
  return from_bf16(v);
}

/// One lane's packets for a run of outputs: output r's weights are
/// packets[begin[r]], ..., packets[end[r] - 1] (tags = input feature indices).
template <typename PacketT>
struct Runs {
  const PacketT* packets = nullptr;
  const std::uint32_t* begin = nullptr;
  const std::uint32_t* end = nullptr;
  std::int64_t runs = 0;
};
using LaneRuns = Runs<Packet>;
using Bf16LaneRuns = Runs<Bf16Packet>;

/// A token tile of a row-major matrix: row i starts at data + i * stride, `tokens` wide.
struct Tile {
  const float* data;
  std::int64_t stride;
};
struct MutableTile {
  float* data;
  std::int64_t stride;
};
/// A resident tile held in bf16: rows padded with zeros to a multiple of 32 tokens, so
/// kernels may read whole 32-token vectors past `tokens`. The order of the tokens within a
/// row is each kernel table's own: its `pack` writes the rows its kernels read.
struct Bf16Tile {
  const std::uint16_t* data;
  std::int64_t stride;
};
inline constexpr std::int64_t kBf16RowAlign = 32;

/// Where a weight-gradient kernel leaves s_k, packet k's dot product over one token tile
/// (k indexes the run's packets). A weight's sums over the tiles are added in `partial`:
///   partial[k] = s_k on the first tile (`first`: partial is not read), else partial[k] + s_k;
/// and where `out` is given (the last tile), that total goes out as the gradient stream's
/// packet instead: out[k] = {tag_k, total}. So a pass never zeroes a buffer, and with one
/// writer per weight no partial sums are left to add after it.
struct GradientSums {
  float* partial = nullptr;
  Packet* out = nullptr;
  bool first = true;
};

/// What `g` asks of one group of a tile's tokens, where a kernel walks the tile in groups:
/// the tile's first group starts the sums if the tile does, its last one sends them out.
inline GradientSums for_group(const GradientSums& g, bool first_group, bool last_group) {
  return {g.partial, last_group ? g.out : nullptr, g.first && first_group};
}

/// A weight packet's tag: runs hold weights only, so no control tag to map (tag_of).
inline std::uint32_t weight_tag(const Packet& p) {
  return p.tag;
}
inline std::uint32_t weight_tag(const Bf16Packet& p) {
  return p.index;
}

/// Leaves one weight's sum s as `g` says: the plain form every vector path must equal.
template <typename PacketT>
inline void leave_sum(const GradientSums& g, const PacketT* packets, std::uint32_t k, float s) {
  const float total = g.first ? s : g.partial[k] + s;
  if (g.out != nullptr) {
    g.out[k] = {weight_tag(packets[k]), total};
  } else {
    g.partial[k] = total;
  }
}

/// The backward pass of a by-input stream (StreamOrder::by_input), whose runs are the
/// layer's input features and whose tags are its output features. For run r and each of
/// its weights k (w_k, tag_k), with dY's rows gathered by tag from the resident tile:
///   dx[r, :] = sum_k w_k * dy[tag_k, :]     (overwrites dx's rows; skipped if dx.data is null)
///   s_k = dot(x[r, :], dy[tag_k, :])        (left as `sums` says; skipped if x.data is null)
/// One gather of each dY row serves both products: the data gradient becomes a sum kept
/// in registers, not a read-modify-write of a dX row per weight.
/// DyTile: Tile, or Bf16Tile where dY is held in bf16 (half the bytes gathered per weight).
template <typename PacketT, typename DyTile = Tile>
using ByInputKernel = void (*)(const Runs<PacketT>& runs, DyTile dy, Tile x, MutableTile dx,
                               const GradientSums& sums, std::int64_t tokens);

/// Calls run.template operator()<kData, kWeight>() for the products a by-input call asks
/// for (dX where dx.data is set, dW where x.data is), so kernels test that once per call.
template <typename Run>
void with_by_input_products(Tile x, MutableTile dx, Run&& run) {
  if (dx.data != nullptr && x.data != nullptr) {
    run.template operator()<true, true>();
  } else if (dx.data != nullptr) {
    run.template operator()<true, false>();
  } else if (x.data != nullptr) {
    run.template operator()<false, true>();
  }
}

/// Packets [k, e)'s sparse dot product with X's one column: sum of w * x[tag, 0]. A
/// vector kernel would use one lane of each step and chain every packet's FMA on the one
/// before; here four sums run at once and each packet costs two loads.
/// (always_inline: at 99.9% a run holds ~4 packets, and a call per run was seen to cost
/// a fifth of the product.)
template <typename PacketT>
[[gnu::always_inline]] inline float dot_one_token(const PacketT* p, std::uint32_t k,
                                                  std::uint32_t e, Tile x) {
  auto term = [&](std::uint32_t j) {
    return value_of(p[j]) * x.data[static_cast<std::int64_t>(weight_tag(p[j])) * x.stride];
  };
  float s0 = 0.0F, s1 = 0.0F, s2 = 0.0F, s3 = 0.0F;
  for (; k + 4 <= e; k += 4) {
    s0 += term(k);
    s1 += term(k + 1);
    s2 += term(k + 2);
    s3 += term(k + 3);
  }
  for (; k < e; ++k) s0 += term(k);
  return (s0 + s1) + (s2 + s3);
}

// The one-token templates below are always inlined: the files of different ISAs include
// them, and an out-of-line copy is one symbol the linker keeps from any of them, so an
// AVX-512 file's copy could serve the AVX2 path on a CPU without AVX-512.

/// The forward of a single token: y[r, 0] = run r's dot product with X's column. The
/// vector tables' forwards take this path for one token (AVX-512's with gathers), and the
/// engine takes it for a bf16 stream's one token, its packets read as they are (X held in
/// fp32): one token is bound by reading the stream, which bf16 halves.
template <typename PacketT>
[[gnu::always_inline]] inline void forward_one_token(const Runs<PacketT>& L, Tile x,
                                                     MutableTile y) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    y.data[r * y.stride] = dot_one_token(L.packets, L.begin[r], L.end[r], x);
  }
}

/// The by-output gradients of a single token, for the vector tables and a bf16 stream's
/// one token, as the forward's: dX scattered one product per weight, and each weight's one
/// product left as `sums` says.
template <typename PacketT>
[[gnu::always_inline]] inline void backward_data_one_token(const Runs<PacketT>& L, Tile dy,
                                                           MutableTile dx) {
  const PacketT* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float d = dy.data[r * dy.stride];
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      dx.data[static_cast<std::int64_t>(weight_tag(p[k])) * dx.stride] += value_of(p[k]) * d;
    }
  }
}
template <typename PacketT>
[[gnu::always_inline]] inline void backward_weight_one_token(const Runs<PacketT>& L, Tile dy,
                                                             Tile x, const GradientSums& sums) {
  const PacketT* p = L.packets;
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float d = dy.data[r * dy.stride];
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      leave_sum(sums, p, k, d * x.data[static_cast<std::int64_t>(weight_tag(p[k])) * x.stride]);
    }
  }
}

/// Packets [k, e) of a by-input run for a single token, its input's activation `xr`: the
/// run's part of dX (four sums at once, as dot_one_token), and (kWeight) each weight's one
/// product xr * dy[tag] left as `sums` says.
template <bool kData, bool kWeight, typename PacketT>
[[gnu::always_inline]] inline float by_input_run_one_token(const PacketT* p, std::uint32_t k,
                                                           std::uint32_t e, Tile dy, float xr,
                                                           const GradientSums& sums) {
  float s[4] = {0.0F, 0.0F, 0.0F, 0.0F};
  auto packet = [&](std::uint32_t j, float& sum) {
    const float d = dy.data[static_cast<std::int64_t>(weight_tag(p[j])) * dy.stride];
    if constexpr (kData) sum += value_of(p[j]) * d;
    if constexpr (kWeight) leave_sum(sums, p, j, xr * d);
  };
  for (; k + 4 <= e; k += 4) {
    for (std::uint32_t j = 0; j < 4; ++j) packet(k + j, s[j]);
  }
  for (; k < e; ++k) packet(k, s[0]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

/// The backward by input of a single token (see ByInputKernel), for the vector tables: as
/// forward_one_token, four sums of dX at once, and each weight's one product left as
/// `sums` says.
template <typename PacketT>
[[gnu::always_inline]] inline void by_input_one_token(const Runs<PacketT>& L, Tile dy, Tile x,
                                                      MutableTile dx, const GradientSums& sums) {
  with_by_input_products(x, dx, [&]<bool kData, bool kWeight>() {
    for (std::int64_t r = 0; r < L.runs; ++r) {
      const float xr = kWeight ? x.data[r * x.stride] : 0.0F;
      const float d =
          by_input_run_one_token<kData, kWeight>(L.packets, L.begin[r], L.end[r], dy, xr, sums);
      if constexpr (kData) dx.data[r * dx.stride] = d;
    }
  });
}

struct LaneKernels {
  /// y[r, :] = sum over run r of w * x[tag, :]  (overwrites y's rows 0..runs-1).
  void (*forward)(const LaneRuns& runs, Tile x, MutableTile y, std::int64_t tokens);
  /// dx[tag, :] += w * dy[r, :] for every weight of run r.
  void (*backward_data)(const LaneRuns& runs, Tile dy, MutableTile dx, std::int64_t tokens);
  /// s_k = dot(dy[r, :], x[tag_k, :]) for every weight k of run r, left as `sums` says.
  void (*backward_weight)(const LaneRuns& runs, Tile dy, Tile x, const GradientSums& sums,
                          std::int64_t tokens);
  /// The forward and the weight gradient on a bf16 stream's packets, read as they are,
  /// with X in fp32 (packed or in place): for a bf16 layer too sparse to pack its rows
  /// (converting X would cost more than the product) and for a single token.
  void (*forward_bf16_packets)(const Bf16LaneRuns& runs, Tile x, MutableTile y,
                               std::int64_t tokens);
  void (*backward_weight_bf16_packets)(const Bf16LaneRuns& runs, Tile dy, Tile x,
                                       const GradientSums& sums, std::int64_t tokens);
};

/// The same products for a bf16 stream: weights widened from bf16, activations held as
/// bf16 in the resident tile, every sum in fp32. dX stays fp32 (it accumulates); dY is
/// fp32 by output and, by input, held in bf16 where the lane packs it.
struct Bf16LaneKernels {
  void (*forward)(const Bf16LaneRuns& runs, Bf16Tile x, MutableTile y, std::int64_t tokens);
  void (*backward_data)(const Bf16LaneRuns& runs, Tile dy, MutableTile dx, std::int64_t tokens);
  void (*backward_weight)(const Bf16LaneRuns& runs, Tile dy, Bf16Tile x, const GradientSums& sums,
                          std::int64_t tokens);
  /// One resident row: src[0, n) rounded to bf16 (nearest even), then zeros up to
  /// `padded` (a multiple of 32), in this table's token order.
  void (*pack)(const float* src, std::uint16_t* dst, std::int64_t n, std::int64_t padded);
};

/// The backward by input (see ByInputKernel) of each stream precision, in one table: its
/// kernels serve fp32 and bf16 streams alike (src/engine/kernels/by_input_*.cpp and the
/// vector lane kernel files).
struct ByInputKernels {
  ByInputKernel<Packet> fp32;
  /// The weights widened from bf16 (dY, X, dX in fp32).
  ByInputKernel<Bf16Packet> bf16;
  /// The same with dY held in bf16 in the resident tile (the ISA's Bf16LaneKernels token
  /// order, as its `pack` writes it), widened exactly; X and dX in fp32.
  ByInputKernel<Bf16Packet, Bf16Tile> bf16_held;
};

const LaneKernels& lane_kernels(Isa isa);
const Bf16LaneKernels& bf16_lane_kernels(Isa isa);
const ByInputKernels& by_input_kernels(Isa isa);

/// The one-token forward of bf16 packets and backwards by input with AVX-512 gathers
/// (src/engine/kernels/one_token_avx512.cpp).
void forward_one_token_avx512(const Bf16LaneRuns& runs, Tile x, MutableTile y);
void by_input_one_token_avx512(const LaneRuns& runs, Tile dy, Tile x, MutableTile dx,
                               const GradientSums& sums);
void by_input_one_token_avx512(const Bf16LaneRuns& runs, Tile dy, Tile x, MutableTile dx,
                               const GradientSums& sums);

extern const LaneKernels kScalarKernels;
extern const LaneKernels kAvx2Kernels;
extern const LaneKernels kAvx512Kernels;
extern const Bf16LaneKernels kScalarBf16Kernels;
extern const Bf16LaneKernels kAvx2Bf16Kernels;
extern const Bf16LaneKernels kAvx512Bf16Kernels;
extern const ByInputKernels kScalarByInput;
extern const ByInputKernels kAvx2ByInput;
extern const ByInputKernels kAvx512ByInput;

}  // namespace sluice::detail
