#pragma once
// Optimizers that ModelMemory runs on its own weights, elementwise.
#include <cstdint>
#include <functional>
#include <string>

namespace sluice {

enum class OptimizerKind { sgd, adam, adamw };
const char* to_string(OptimizerKind kind);
/// "sgd", "adam" or "adamw"; throws ArgumentError otherwise.
OptimizerKind parse_optimizer(const std::string& name);

/// A linear warmup and a cosine decay of the learning rate, kept with the model: checkpoints
/// and model stores save it (unlike `OptimizerConfig::schedule`, which is code), so a
/// resumed run goes on along the same curve. The multiplier at step s (1-based):
/// s / warmup_steps up to warmup_steps, then 1 falling along half a cosine to
/// final_fraction at decay_steps, final_fraction after. decay_steps 0: no decay.
struct LearningRateDecay {
  std::int64_t warmup_steps = 0;
  std::int64_t decay_steps = 0;
  double final_fraction = 0.1;

  bool active() const { return warmup_steps > 0 || decay_steps > 0; }
  /// The multiplier at `step` (1-based); 1 when not active.
  double factor(std::int64_t step) const;
  /// ArgumentError unless 0 <= warmup_steps <= 2^53, decay_steps 0 or in
  /// (warmup_steps, 2^53], final_fraction in [0, 1].
  void validate() const;
  bool operator==(const LearningRateDecay&) const = default;
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::adam;
  double learning_rate = 1e-3;
  double momentum = 0.0;          ///< SGD only (heavy ball: v = momentum*v + g; w -= lr*v)
  double beta1 = 0.9;             ///< Adam/AdamW
  double beta2 = 0.999;           ///< Adam/AdamW
  double epsilon = 1e-8;          ///< Adam/AdamW
  double weight_decay = 0.0;      ///< SGD and Adam: L2 added to the gradient; AdamW: decoupled
  double clip_global_norm = 0.0;  ///< > 0: scale all gradients so their global L2 norm <= this
  LearningRateDecay decay;        ///< warmup and decay, saved with the model (default: none)
  /// Learning-rate schedule: multiplier of learning_rate at a step (1-based), applied on
  /// top of `decay`. Empty = 1. Not saved: a loaded model keeps the schedule it had.
  /// Called for every layer of every step, from several threads at once (each layer's
  /// update is computed as its gradient arrives), so it must be a function of the step
  /// alone and safe to call concurrently: count steps with the argument, not the calls.
  std::function<double(std::int64_t step)> schedule;
};

/// What ModelMemory does with a non-finite gradient.
enum class NonFinitePolicy {
  skip_step,  ///< leave weights and optimizer state unchanged, report the layer, go on
  error,      ///< the same, then throw NumericError
};

}  // namespace sluice
