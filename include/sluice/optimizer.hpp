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

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::adam;
  double learning_rate = 1e-3;
  double momentum = 0.0;          ///< SGD only (heavy ball: v = momentum*v + g; w -= lr*v)
  double beta1 = 0.9;             ///< Adam/AdamW
  double beta2 = 0.999;           ///< Adam/AdamW
  double epsilon = 1e-8;          ///< Adam/AdamW
  double weight_decay = 0.0;      ///< SGD and Adam: L2 added to the gradient; AdamW: decoupled
  double clip_global_norm = 0.0;  ///< > 0: scale all gradients so their global L2 norm <= this
  /// Learning-rate schedule: multiplier of learning_rate at a step (1-based). Empty = 1.
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
