#pragma once
// A product's plan, chosen once per call from the stream's header, the placement and the
// batch (oneDNN's "primitive descriptor"): how the lanes hold the activations, which
// kernel each step of a pass calls, how the work is cut into tasks and which schedule
// runs them. The passes (forward_pass.cpp, backward_*_pass.cpp) only execute a plan:
// they never look at a format. Internal.
#include <cstdint>

#include "engine/engine_state.hpp"
#include "engine/holding.hpp"
#include "engine/intake.hpp"
#include "engine/tiling.hpp"

namespace sluice::detail {

/// Lane `lane`'s forward of runs [first, first + count) of a chunk on one token tile:
/// y[r, :] = sum of the run's w * x[tag, :].
using ForwardStep = void (*)(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane,
                             std::uint32_t first, std::uint32_t count, const HeldTile& x,
                             MutableTile y, std::int64_t width);
/// By output, lane `lane`'s dX: dx[tag, :] += w * dy[r, :] over a chunk's runs.
using DataStep = void (*)(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane,
                          Tile dy, MutableTile dx, std::int64_t width);
/// By output, lane `lane`'s weight gradients over a chunk's runs, left as `sums` says.
using WeightStep = void (*)(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane,
                            Tile dy, const HeldTile& x, const GradientSums& sums,
                            std::int64_t width);
/// By input, both gradients of a chunk's runs (see ByInputKernel), dY held.
using ByInputStep = void (*)(const KernelTables& k, const TakenChunk& chunk, const HeldTile& dy,
                             Tile x, MutableTile dx, const GradientSums& sums, std::int64_t width);
/// Packets [k, end) of a chunk's tags with zero values, as gradient packets.
using CopyTags = void (*)(const StreamChunk& chunk, Packet* to, std::uint32_t k, std::uint32_t end);

/// How a forward's tasks walk the stream.
enum class ForwardSchedule {
  /// One lane, one tile: tasks claim chunks and take each in as they compute it.
  taken_as_computed,
  /// One lane: (tile, piece) items, each task its own block's from the front, then the
  /// others' from the back.
  one_lane_pieces,
  /// Several lanes: task (p, q, s) computes its share's chunks into partial rows, summed
  /// by LastLaneRingSum.
  lanes_in_ring,
};

struct ForwardPlan {
  Holding holding;
  TokenTiling tiling;
  ForwardSchedule schedule;
  ForwardStep step;
};

/// Before the stream has arrived: its size picks the schedule (waiting, where the rule
/// counts chunks, for that many at most).
ForwardPlan plan_forward(const TilingPolicy& policy, const StreamHeader& header, std::int32_t lanes,
                         std::int64_t tokens, std::int64_t outputs, Intake& intake);

struct BackwardPlan {
  Holding holding;  ///< X by output (for dW), dY by input
  bool by_input;
  /// By input: chunks taken in by the task that computes them (one pass, one tile).
  bool taken_as_computed;
  /// One lane, one block: each weight has one writer, whose sums go straight out.
  bool direct;
  TokenTiling data_tiling;    ///< by output, the dX pass (dX held in fp32)
  TokenTiling weight_tiling;  ///< the dW pass by output; the one pass by input
  DataStep data_step;
  WeightStep weight_step;
  ByInputStep by_input_step;
  CopyTags copy_tags;
};

/// Before the intake pulls the stream: its lanes and layout follow from the plan's order.
/// `lanes`: the placement's lanes (by output) or 1 (by input).
BackwardPlan plan_backward(const TilingPolicy& policy, const StreamHeader& header,
                           std::int32_t lanes, std::int64_t tokens);
/// The weight tiling may take shares, the schedule may take chunks in (counting the
/// chunks as they arrive, up to the rule's count).
void complete_backward_plan(BackwardPlan& plan, const TilingPolicy& policy, std::int32_t lanes,
                            bool want_grad, Intake& intake);

}  // namespace sluice::detail
