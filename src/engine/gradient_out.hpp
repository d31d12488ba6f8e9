#pragma once
// The weight-gradient stream a backward sends out. Internal.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/engine_state.hpp"
#include "engine/plan.hpp"

namespace sluice::detail {

/// The gradient stream leaves in the weight stream's order: same tags, same controls, in
/// fp32 whatever the weights' precision (the optimizer's sums want every bit). Its chunks
/// are written by the weight pass's tasks, each for the chunks it reads.
///
/// With one lane and one block (the plan's `direct`), each weight has one writer, and the
/// kernels send each weight's total straight out as its gradient packet on the last tile;
/// the control packets, between the lane's runs, are written by write_controls. Otherwise
/// every block (and lane, whose packets are routed) keeps sums of its own, added up after
/// the pass in a fixed order (lay_out), so sums are reproducible.
class GradientOut {
 public:
  /// For a stream of `header`, whose chunks arrive into `chunks`: add() each as it does.
  GradientOut(EngineState& engine, const BackwardPlan& plan, std::int32_t lanes,
              const std::vector<TakenChunk>& chunks, const StreamHeader& header);

  /// Chunk c has arrived (in order, before any task reads it): its gradient chunk and sums.
  void add(std::size_t c);

  /// Task (p, q)'s sums for chunk c on tile t of `tiling`: see GradientSums.
  GradientSums sums(const TokenTiling& tiling, std::int32_t p, std::int32_t q, std::size_t c,
                    std::int64_t t) const {
    const bool last = t + 1 == tiling.first_tile(q + 1);
    return {partials_[q][c] + (lanes_ > 1 ? lane_offset(c, p) : 0),
            plan_.direct && last ? gradient_[c]->packets.data() : nullptr,
            t == tiling.first_tile(q)};
  }
  /// On a direct pass's first visit to chunk c: its control packets.
  void write_controls(std::size_t c) const;
  /// After the pass: the sums not sent straight out, and chunks no task wrote (no tokens).
  void lay_out(std::int64_t tokens);
  WeightStream stream(const StreamHeader& weights) const;

 private:
  std::size_t lane_offset(std::size_t c, std::int32_t p) const {
    std::size_t off = 0;
    for (std::int32_t l = 0; l < p; ++l) off += chunks_[c].lanes[l].routed_count();
    return off;
  }

  EngineState& engine_;
  const BackwardPlan& plan_;
  std::int32_t lanes_;
  std::int32_t blocks_;
  const std::vector<TakenChunk>& chunks_;
  std::size_t most_chunks_;
  std::size_t block_packets_;  // a valid stream's packets: each block's sums
  std::size_t added_packets_ = 0;
  std::vector<std::shared_ptr<StreamChunk>> gradient_;
  // partials_[q][c]: block q's sums for the packets of chunk c (one lane), or for the
  // lanes' routed packets, lane after lane. The first tile overwrites them: no zeroing.
  std::vector<std::vector<float*>> partials_;
};

}  // namespace sluice::detail
