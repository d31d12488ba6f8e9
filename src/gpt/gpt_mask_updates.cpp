// A GPT's mask updates (gpt_mask_updates.hpp).
#include "gpt/gpt_mask_updates.hpp"

#include <chrono>

#include "model_memory/mask_update.hpp"

namespace sluice::detail {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

GptMaskUpdates::GptMaskUpdates(ModelMemory& memory, Fabric& fabric, const GptLayers& layers,
                               DynamicSparsity dynamic)
    : memory_(memory), fabric_(fabric), dynamic_(dynamic), sparse_(layers.sparse()) {
  dynamic_.validate();
  is_sparse_.assign(static_cast<std::size_t>(layers.count), false);
  for (const std::int32_t l : sparse_) is_sparse_[static_cast<std::size_t>(l)] = true;
  growth_.resize(static_cast<std::size_t>(layers.count));
}

void GptMaskUpdates::begin_step(std::int64_t step) {
  step_ = step;
  update_ = dynamic_.is_update_step(step);
  for (auto& g : growth_) g.clear();
}

bool GptMaskUpdates::scores(std::int32_t layer) const {
  return update_ && dynamic_.rule == MaskUpdateRule::rigl &&
         is_sparse_[static_cast<std::size_t>(layer)];
}

void GptMaskUpdates::score(std::int32_t layer, const BlockCall& call, StepMetrics& metrics) {
  const auto t0 = std::chrono::steady_clock::now();
  CsrMatrix copy;
  const CsrMatrix& w = layer_mask(memory_, layer, copy);
  const std::int64_t k = dynamic_.swap_count(step_, w.nnz(), w.rows() * w.cols());
  GrowthSource source;
  source.block = call;
  growth_[static_cast<std::size_t>(layer)] = fabric_.growth_top_k(source, w, k);
  const double seconds = seconds_since(t0);
  metrics.mask_update_seconds += seconds;
  metrics.mask_score_seconds += seconds;
}

void GptMaskUpdates::end_step(const StepReport& report, StepMetrics& metrics) {
  const bool update = update_;
  update_ = false;  // gradients() and loss() between steps score nothing
  // A skipped step (non-finite gradient) changes no mask.
  if (!update || !report.applied || report.step != step_) return;
  const auto t0 = std::chrono::steady_clock::now();
  for (const std::int32_t l : sparse_) {
    update_layer_mask(memory_, dynamic_, step_, l, growth_[static_cast<std::size_t>(l)]);
  }
  metrics.mask_updates += 1;
  metrics.mask_update_seconds += seconds_since(t0);
}

}  // namespace sluice::detail
