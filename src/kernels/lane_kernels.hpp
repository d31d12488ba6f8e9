#pragma once
// The lane kernels: what one engine lane does with its share of a stream chunk on one
// token tile. Internal; one implementation per ISA, chosen once at run time.
#include <cstdint>

#include "sluice/isa.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

/// One lane's packets for a run of outputs: output r's weights are
/// packets[begin[r]], ..., packets[end[r] - 1] (tags = input feature indices).
struct LaneRuns {
  const Packet* packets = nullptr;
  const std::uint32_t* begin = nullptr;
  const std::uint32_t* end = nullptr;
  std::int64_t runs = 0;
};

/// A token tile of a row-major matrix: row i starts at data + i * stride, `tokens` wide.
struct Tile {
  const float* data;
  std::int64_t stride;
};
struct MutableTile {
  float* data;
  std::int64_t stride;
};

struct LaneKernels {
  /// y[r, :] = sum over run r of w * x[tag, :]  (overwrites y's rows 0..runs-1).
  void (*forward)(const LaneRuns& runs, Tile x, MutableTile y, std::int64_t tokens);
  /// dx[tag, :] += w * dy[r, :] for every weight of run r.
  void (*backward_data)(const LaneRuns& runs, Tile dy, MutableTile dx, std::int64_t tokens);
  /// grad[k] += dot(dy[r, :], x[tag_k, :]) for every weight k of run r (k indexes packets).
  void (*backward_weight)(const LaneRuns& runs, Tile dy, Tile x, float* grad, std::int64_t tokens);
};

const LaneKernels& lane_kernels(Isa isa);

extern const LaneKernels kScalarKernels;
extern const LaneKernels kAvx2Kernels;
extern const LaneKernels kAvx512Kernels;

}  // namespace sluice::detail
