// The reference by-input backward kernel (see ByInputKernel): plain loops, every sum in
// fp32 in token order, dY widened exactly where it is held in bf16 (in token order in
// this table's tiles). The AVX2 and AVX-512 variants are tested against it.
#include "engine/kernels/lane_kernels.hpp"

namespace sluice::detail {
namespace {

template <typename PacketT, typename DyTile>
void by_input(const Runs<PacketT>& L, DyTile dy, Tile x, MutableTile dx, const GradientSums& sums,
              std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    float* out = dx.data != nullptr ? dx.data + r * dx.stride : nullptr;
    const float* in = x.data != nullptr ? x.data + r * x.stride : nullptr;
    if (out != nullptr) {
      for (std::int64_t t = 0; t < tokens; ++t) out[t] = 0.0F;
    }
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const auto* d = dy.data + static_cast<std::int64_t>(tag_of(L.packets[k])) * dy.stride;
      if (out != nullptr) {
        const float w = value_of(L.packets[k]);
        for (std::int64_t t = 0; t < tokens; ++t) out[t] += w * widen(d[t]);
      }
      if (in != nullptr) {
        float sum = 0.0F;
        for (std::int64_t t = 0; t < tokens; ++t) sum += in[t] * widen(d[t]);
        leave_sum(sums, L.packets, k, sum);
      }
    }
  }
}

}  // namespace

const ByInputKernels kScalarByInput{by_input<Packet, Tile>, by_input<Bf16Packet, Tile>,
                                    by_input<Bf16Packet, Bf16Tile>};

}  // namespace sluice::detail
