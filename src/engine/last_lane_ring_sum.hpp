#pragma once
// The partial-sum reduction of a forward over several lanes. Internal.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/kernels/lane_kernels.hpp"
#include "sluice/dense.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

/// The last lane to finish a chunk adds all lanes' partial rows in ring order.
///
/// Each lane writes its sums for a chunk's outputs (on one token tile) into partial rows
/// of its own; every run ends in a carriage return, so a lane writes every output of its
/// chunks and nothing needs zeroing. The lane that finishes a chunk last then adds the
/// lanes' rows for each of the chunk's outputs in ring order: starting one past the lane
/// the next layer wants the output on (its `home`) and ending at it, into Y. It is not a
/// ring of messages between lanes: no lane ever waits for another, and because the order
/// of the additions is fixed, Y is bitwise reproducible whatever the thread timing.
class LastLaneRingSum {
 public:
  /// Partial rows in `scratch` (grown as needed, kept by the caller between products).
  LastLaneRingSum(std::vector<float>& scratch, std::int32_t lanes, std::int64_t tiles,
                  std::size_t chunks, MutableMatrixView y, const Placement* next_placement)
      : lanes_(lanes),
        stride_((y.cols + 15) / 16 * 16),
        lane_size_(static_cast<std::size_t>(y.rows * stride_)),
        arrivals_(static_cast<std::size_t>(tiles) * chunks),
        chunks_(chunks),
        y_(y),
        next_placement_(next_placement) {
    if (scratch.size() < lanes * lane_size_) scratch.resize(lanes * lane_size_);
    partials_ = scratch.data();
  }

  /// Where lane `lane` writes its sums for output `o` onwards, from token t0.
  MutableTile lane_rows(std::int32_t lane, std::int64_t o, std::int64_t t0) const {
    return {partial_row(lane, o) + t0, stride_};
  }

  /// Lane done with `chunk` (the c-th) on tile t, tokens [t0, t0 + width): the last of
  /// the lanes to get here sums the chunk's outputs into Y.
  void lane_done(std::int64_t t, std::size_t c, const StreamChunk& chunk, std::int64_t t0,
                 std::int64_t width) {
    auto& arrived = arrivals_[static_cast<std::size_t>(t) * chunks_ + c];
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == lanes_ - 1) sum(chunk, t0, width);
  }

 private:
  float* partial_row(std::int32_t lane, std::int64_t o) const {
    return partials_ + lane * lane_size_ + o * stride_;
  }
  void sum(const StreamChunk& chunk, std::int64_t t0, std::int64_t width) const {
    const std::int32_t P = lanes_;
    for (std::int64_t o = chunk.first_output; o < chunk.first_output + chunk.outputs; ++o) {
      const std::int32_t home =
          next_placement_ != nullptr ? next_placement_->lane_of[o] % P : default_output_lane(o, P);
      float* out = y_.row(o) + t0;
      std::int32_t lane = (home + 1) % P;
      std::memcpy(out, partial_row(lane, o) + t0, sizeof(float) * width);
      for (std::int32_t s = 1; s < P; ++s) {
        lane = (lane + 1) % P;
        const float* in = partial_row(lane, o) + t0;
        for (std::int64_t i = 0; i < width; ++i) out[i] += in[i];
      }
    }
  }

  std::int32_t lanes_;
  std::int64_t stride_;
  std::size_t lane_size_;
  std::vector<std::atomic<std::int32_t>> arrivals_;
  std::size_t chunks_;
  MutableMatrixView y_;
  const Placement* next_placement_;
  float* partials_ = nullptr;
};

}  // namespace sluice::detail
