#pragma once
// Internal: a GPT's dynamic sparsity (sluice/dynamic_sparsity.hpp). The sparse layers
// (GptLayers::sparse) drop and grow on the schedule as the MLP's layers do; the dense
// parameters (embeddings, LayerNorms) keep their full masks. RigL scores a projection
// right after its backward, on the engines, from the X and dY they just used
// (Fabric::growth_top_k), so 1 and N engines grow the same positions.
#include <cstdint>
#include <span>
#include <vector>

#include "sluice/dense.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/gpt.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::detail {

class GptMaskUpdates {
 public:
  /// ArgumentError if `dynamic` is invalid.
  GptMaskUpdates(ModelMemory& memory, Fabric& fabric, const GptLayers& layers,
                 DynamicSparsity dynamic);

  /// Before step `step` (ModelMemory::step() + 1) runs: whether it is an update step.
  void begin_step(std::int64_t step);
  /// Whether `layer`'s backward must be scored (RigL, an update step, a sparse layer).
  bool scores(std::int32_t layer) const;
  /// RigL's growth of `layer`, whose backward `call` the engines just ran.
  void score(std::int32_t layer, const BlockCall& call, StepMetrics& metrics);
  /// After the step's commit: the sparse layers' masks change if it was an update step
  /// and the commit applied it. Also after a step that failed (a report not applied):
  /// nothing is scored until the next begin_step.
  void end_step(const StepReport& report, StepMetrics& metrics);

 private:
  ModelMemory& memory_;
  Fabric& fabric_;
  DynamicSparsity dynamic_;
  std::vector<std::int32_t> sparse_;
  std::vector<bool> is_sparse_;  // by layer
  std::int64_t step_ = 0;
  bool update_ = false;
  std::vector<std::vector<std::int64_t>> growth_;  // RigL's, by layer
};

}  // namespace sluice::detail
