#pragma once
// Internal: the elementwise optimizer math that ModelMemory runs on its own arrays.
// Each element is computed in double and stored as float, so a run does not depend on
// how the elements are split over threads.
#include <array>
#include <cstddef>
#include <cstdint>

#include "sluice/optimizer.hpp"

namespace sluice::detail {

inline constexpr int kMaxOptimizerSlots = 2;

/// Optimizer state floats kept per parameter: SGD its velocity; Adam and AdamW the first
/// and second moments (m, v), in that order.
int optimizer_slot_count(OptimizerKind kind);

/// Checks that the numbers make sense (ArgumentError naming the field).
void validate_optimizer_config(const OptimizerConfig& config);

/// learning_rate * schedule(step), step 1-based (empty schedule = 1). ArgumentError if the
/// schedule gives a negative or non-finite multiplier.
double scheduled_learning_rate(const OptimizerConfig& config, std::int64_t step);

/// Everything one update needs besides the arrays.
struct UpdateScalars {
  OptimizerKind kind = OptimizerKind::adam;
  double learning_rate = 0;  ///< already scheduled
  double momentum = 0;       ///< SGD
  double beta1 = 0, beta2 = 0, epsilon = 0;
  double weight_decay = 0;      ///< L2 (SGD, Adam) or decoupled (AdamW)
  double gradient_scale = 1;    ///< global-norm clipping factor, applied to the raw gradient
  double bias_correction1 = 1;  ///< 1 - beta1^t
  double bias_correction2 = 1;  ///< 1 - beta2^t
};

/// `t` is the 1-based count of updates this parameter has received, this one included.
UpdateScalars make_update_scalars(const OptimizerConfig& config, double learning_rate,
                                  std::int64_t t, double gradient_scale);

/// The arrays of one parameter set; `new_*` may not alias the inputs.
struct UpdateArrays {
  const float* weights = nullptr;
  const float* gradient = nullptr;
  std::array<const float*, kMaxOptimizerSlots> state{};
  float* new_weights = nullptr;
  std::array<float*, kMaxOptimizerSlots> new_state{};
};

/// Computes elements [begin, end) of the update:
///   SGD:   g' = s*g + wd*w;  v = momentum*v + g';  w -= lr*v
///   Adam:  g' = s*g + wd*w;  m = b1*m + (1-b1)*g';  v = b2*v + (1-b2)*g'^2;
///          w -= lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)
///   AdamW: g' = s*g;  w -= lr*wd*w;  then the Adam update of w with g'
/// Returns false if any new weight or state value is not finite as a float.
bool optimizer_update(const UpdateScalars& scalars, const UpdateArrays& arrays, std::size_t begin,
                      std::size_t end);

}  // namespace sluice::detail
