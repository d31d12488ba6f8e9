// The reference lane kernels: plain loops, no ISA assumptions. Every faster variant is
// tested against these.
#include "kernels/lane_kernels.hpp"

namespace sluice::detail {
namespace {

void forward(const LaneRuns& L, Tile x, MutableTile y, std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    float* out = y.data + r * y.stride;
    for (std::int64_t t = 0; t < tokens; ++t) out[t] = 0.0F;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const float w = L.packets[k].value;
      const float* in = x.data + static_cast<std::int64_t>(L.packets[k].tag) * x.stride;
      for (std::int64_t t = 0; t < tokens; ++t) out[t] += w * in[t];
    }
  }
}

void backward_data(const LaneRuns& L, Tile dy, MutableTile dx, std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy.data + r * dy.stride;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const float w = L.packets[k].value;
      float* out = dx.data + static_cast<std::int64_t>(L.packets[k].tag) * dx.stride;
      for (std::int64_t t = 0; t < tokens; ++t) out[t] += w * d[t];
    }
  }
}

void backward_weight(const LaneRuns& L, Tile dy, Tile x, float* grad, std::int64_t tokens) {
  for (std::int64_t r = 0; r < L.runs; ++r) {
    const float* d = dy.data + r * dy.stride;
    for (std::uint32_t k = L.begin[r]; k < L.end[r]; ++k) {
      const float* in = x.data + static_cast<std::int64_t>(L.packets[k].tag) * x.stride;
      float sum = 0.0F;
      for (std::int64_t t = 0; t < tokens; ++t) sum += d[t] * in[t];
      grad[k] += sum;
    }
  }
}

}  // namespace

const LaneKernels kScalarKernels{forward, backward_data, backward_weight};

}  // namespace sluice::detail
