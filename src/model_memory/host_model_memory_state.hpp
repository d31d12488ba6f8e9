#pragma once
// Internal: what HostModelMemory keeps, shared by model_memory.cpp (training) and
// checkpoint.cpp (save/load).
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "model_memory/optimizer_kernels.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::detail {

/// One layer's update for the current step, prepared by submit_gradient and made visible
/// (or dropped) by commit_step. The buffers are kept between steps: after a commit they
/// hold the previous values and are overwritten next time, so a step allocates nothing.
struct PendingUpdate {
  bool submitted = false;
  bool finite = true;         ///< gradient (and the update computed from it) all finite
  bool computed = false;      ///< new_* hold the update (without clipping: at submit time)
  double sum_of_squares = 0;  ///< of the gradient incl. bias, for the global norm
  double seconds = 0;
  std::vector<float> gradient;  ///< in CSR order
  std::vector<float> bias_gradient;
  std::vector<float> new_values;
  std::vector<float> new_bias;
  std::array<std::vector<float>, kMaxOptimizerSlots> new_state;
  std::array<std::vector<float>, kMaxOptimizerSlots> new_bias_state;
};

struct HostLayer {
  CsrMatrix weights;
  std::vector<float> bias;
  /// Optimizer state per non-zero and per bias element (optimizer_slot_count slots used).
  std::array<std::vector<float>, kMaxOptimizerSlots> state;
  std::array<std::vector<float>, kMaxOptimizerSlots> bias_state;
  /// Updates applied to this layer: Adam's t for bias correction (a layer that sat out a
  /// step has had fewer updates than the global step count).
  std::int64_t updates = 0;

  std::mutex placement_mutex;
  std::map<std::int32_t, Placement> placements;  ///< by lane count; map nodes never move
  /// The pattern's transpose, for streams by input: built on first use (under
  /// placement_mutex); rebuilt in place when the mask changes (regrow, between steps).
  std::unique_ptr<TransposedPattern> transposed;

  std::mutex pending_mutex;
  PendingUpdate pending;
};

/// Allocates zeroed optimizer state for `slots` slots (and frees the others).
void reset_optimizer_state(HostLayer& layer, int slots);

struct HostState {
  std::vector<std::unique_ptr<HostLayer>> layers;  // pointers: layers hold mutexes
  OptimizerConfig config;
  NonFinitePolicy policy = NonFinitePolicy::skip_step;
  std::int64_t step = 0;  ///< optimizer steps applied
};

}  // namespace sluice::detail

namespace sluice {

// The private name of the same thing (free functions use detail::HostState).
struct HostModelMemory::State : detail::HostState {};

}  // namespace sluice
