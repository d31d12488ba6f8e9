// The reference bf16 lane kernels: plain loops, every bf16 value widened exactly to fp32
// and every sum in fp32. The AVX-512 variant is tested against these.
#include "kernels/lane_kernels.hpp"

namespace sluice::detail {
namespace {

const std::uint16_t* row_of(Bf16Tile x, const Bf16Packet& p) {
  return x.data + static_cast<std::int64_t>(p.index) * x.stride;
}

void forward(const Bf16LaneRuns& L, Bf16Tile x, MutableTile y, std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    float* out = y.data + r * y.stride;
    for (std::int64_t t = 0; t < tokens; ++t) out[t] = 0.0F;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const float w = value_of(L.packets[k]);
      const std::uint16_t* in = row_of(x, L.packets[k]);
      for (std::int64_t t = 0; t < tokens; ++t) out[t] += w * from_bf16(in[t]);
    }
  }
}

void backward_data(const Bf16LaneRuns& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy.data + r * dy.stride;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const float w = value_of(L.packets[k]);
      float* out = dx.data + static_cast<std::int64_t>(L.packets[k].index) * dx.stride;
      for (std::int64_t t = 0; t < tokens; ++t) out[t] += w * d[t];
    }
  }
}

void backward_weight(const Bf16LaneRuns& L, Tile dy, Bf16Tile x, float* grad, std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy.data + r * dy.stride;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const std::uint16_t* in = row_of(x, L.packets[k]);
      float sum = 0.0F;
      for (std::int64_t t = 0; t < tokens; ++t) sum += d[t] * from_bf16(in[t]);
      grad[k] += sum;
    }
  }
}

void pack(const float* src, std::uint16_t* dst, std::int64_t n, std::int64_t padded) {
  for (std::int64_t t = 0; t < n; ++t) dst[t] = to_bf16(src[t]);
  for (std::int64_t t = n; t < padded; ++t) dst[t] = 0;
}

}  // namespace

const Bf16LaneKernels kScalarBf16Kernels{forward, backward_data, backward_weight, pack};

}  // namespace sluice::detail
