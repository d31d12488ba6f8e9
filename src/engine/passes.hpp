#pragma once
// The passes of a product over a layer's stream, each in a file of its own; each only
// executes its plan. Internal.
#include <vector>

#include "engine/clock.hpp"
#include "engine/engine_state.hpp"
#include "engine/gradient_out.hpp"
#include "engine/intake.hpp"
#include "engine/plan.hpp"
#include "engine/resident_tile.hpp"
#include "sluice/dense.hpp"
#include "sluice/planner.hpp"

namespace sluice::detail {

/// What a product works on, besides its plan.
struct ProductInputs {
  const LaneLayout& layout;
  Intake& intake;
  /// The stream's chunks: while it arrives, only those intake.arrive() has given.
  const std::vector<TakenChunk>& chunks;
  /// busy[task]: seconds the task spent computing, spans[task] when (for EngineCounters;
  /// a TaskClock keeps both).
  std::vector<double>& busy;
  std::vector<std::vector<Span>>& spans;
  /// Whether the stream is still arriving when the pass starts (the plan's choice).
  bool live = false;
};

/// Y = W X (forward_pass.cpp). Y's rows end where `next_placement` wants them (several
/// lanes).
void forward_pass(EngineState& engine, const ForwardPlan& plan, const ProductInputs& in,
                  ConstMatrixView x, MutableMatrixView y, const Placement* next_placement);

/// Backward from a stream by output (backward_by_output_pass.cpp): dX (if `dx`) in one
/// pass, then the weight gradients (if `gradient`) in a second, each keeping one matrix
/// resident.
void backward_by_output_pass(EngineState& engine, const BackwardPlan& plan, const ProductInputs& in,
                             const ConstMatrixView* x, ConstMatrixView dy, MutableMatrixView* dx,
                             GradientOut* gradient);

/// Backward from a stream by input (backward_by_input_pass.cpp): one pass, dY resident,
/// both gradients per run.
void backward_by_input_pass(EngineState& engine, const BackwardPlan& plan, const ProductInputs& in,
                            const ConstMatrixView* x, ConstMatrixView dy, MutableMatrixView* dx,
                            GradientOut* gradient);

}  // namespace sluice::detail
