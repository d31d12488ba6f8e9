// The reference lane kernels, fp32 and bf16: plain loops, no ISA assumptions, every bf16
// value widened exactly to fp32 and every sum in fp32. Every faster variant is tested
// against these.
#include "engine/kernels/lane_kernels.hpp"

namespace sluice::detail {
namespace {

// TileT: Tile (fp32 rows) or Bf16Tile (bf16 rows, here in token order).
template <typename PacketT, typename TileT>
void forward(const Runs<PacketT>& L, TileT x, MutableTile y, std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    float* out = y.data + r * y.stride;
    for (std::int64_t t = 0; t < tokens; ++t) out[t] = 0.0F;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const float w = value_of(L.packets[k]);
      const auto* in = x.data + static_cast<std::int64_t>(weight_tag(L.packets[k])) * x.stride;
      for (std::int64_t t = 0; t < tokens; ++t) out[t] += w * widen(in[t]);
    }
  }
}

template <typename PacketT>
void backward_data(const Runs<PacketT>& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy.data + r * dy.stride;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const float w = value_of(L.packets[k]);
      float* out = dx.data + static_cast<std::int64_t>(weight_tag(L.packets[k])) * dx.stride;
      for (std::int64_t t = 0; t < tokens; ++t) out[t] += w * d[t];
    }
  }
}

template <typename PacketT, typename TileT>
void backward_weight(const Runs<PacketT>& L, Tile dy, TileT x, const GradientSums& sums,
                     std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy.data + r * dy.stride;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const auto* in = x.data + static_cast<std::int64_t>(weight_tag(L.packets[k])) * x.stride;
      float sum = 0.0F;
      for (std::int64_t t = 0; t < tokens; ++t) sum += d[t] * widen(in[t]);
      leave_sum(sums, L.packets, k, sum);
    }
  }
}

void pack(const float* src, std::uint16_t* dst, std::int64_t n, std::int64_t padded) {
  for (std::int64_t t = 0; t < n; ++t) dst[t] = to_bf16(src[t]);
  for (std::int64_t t = n; t < padded; ++t) dst[t] = 0;
}

}  // namespace

const LaneKernels kScalarKernels{forward<Packet, Tile>, backward_data<Packet>,
                                 backward_weight<Packet, Tile>, forward<Bf16Packet, Tile>,
                                 backward_weight<Bf16Packet, Tile>};
const Bf16LaneKernels kScalarBf16Kernels{forward<Bf16Packet, Bf16Tile>, backward_data<Bf16Packet>,
                                         backward_weight<Bf16Packet, Bf16Tile>, pack};

}  // namespace sluice::detail
