#include "sluice/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "core/enum_names.hpp"
#include "model_memory/optimizer_kernels.hpp"
#include "sluice/error.hpp"

namespace sluice {

constexpr detail::EnumName<OptimizerKind> kOptimizerNames[] = {
    {OptimizerKind::sgd, "sgd"}, {OptimizerKind::adam, "adam"}, {OptimizerKind::adamw, "adamw"}};

SLUICE_ENUM_NAMES(OptimizerKind, kOptimizerNames, parse_optimizer, "optimizer")

double LearningRateDecay::factor(std::int64_t step) const {
  const auto warmup = static_cast<double>(warmup_steps);
  if (warmup_steps > 0 && step <= warmup_steps) return static_cast<double>(step) / warmup;
  if (decay_steps == 0) return 1.0;
  const double done = std::min(
      1.0, (static_cast<double>(step) - warmup) / (static_cast<double>(decay_steps) - warmup));
  return final_fraction + (1 - final_fraction) * 0.5 * (1 + std::cos(std::numbers::pi * done));
}

void LearningRateDecay::validate() const {
  constexpr std::int64_t kMaxSteps = std::int64_t{1} << 53;  // steps count exactly as doubles
  if (warmup_steps < 0 || warmup_steps > kMaxSteps) {
    throw ArgumentError("learning-rate decay: warmup_steps " + std::to_string(warmup_steps) +
                        " out of range [0, 2^53]");
  }
  if (decay_steps != 0 && (decay_steps <= warmup_steps || decay_steps > kMaxSteps)) {
    throw ArgumentError("learning-rate decay: decay_steps " + std::to_string(decay_steps) +
                        " must be 0 (no decay) or in (warmup_steps " +
                        std::to_string(warmup_steps) + ", 2^53]");
  }
  if (!(final_fraction >= 0 && final_fraction <= 1)) {
    throw ArgumentError("learning-rate decay: final_fraction " + std::to_string(final_fraction) +
                        " out of range [0, 1]");
  }
}

namespace detail {
namespace {

void require(bool ok, const char* field, double value, const char* expected) {
  if (!ok) {
    throw ArgumentError(std::string("optimizer config: ") + field + " = " + std::to_string(value) +
                        ", expected " + expected);
  }
}

// 1 if x is NaN or infinite (x - x is 0 for every finite x). Written as an int
// accumulated with |= because GCC vectorises that, not std::isfinite or a bool &=.
inline int not_finite(float x) {
  return static_cast<int>(x - x != 0.0F);
}

bool sgd_update(const UpdateScalars& s, const UpdateArrays& a, std::size_t begin, std::size_t end) {
  const float* __restrict w = a.weights;
  const float* __restrict g = a.gradient;
  const float* __restrict v_in = a.state[0];
  float* __restrict w_out = a.new_weights;
  float* __restrict v_out = a.new_state[0];
  const double lr = s.learning_rate, mu = s.momentum, wd = s.weight_decay, scale = s.gradient_scale;
  int bad = 0;
  for (std::size_t i = begin; i < end; ++i) {
    const double wi = w[i];
    const double gi = scale * g[i] + wd * wi;
    const double vi = mu * v_in[i] + gi;
    const auto nv = static_cast<float>(vi);
    const auto nw = static_cast<float>(wi - lr * vi);
    v_out[i] = nv;
    w_out[i] = nw;
    bad |= not_finite(nv) | not_finite(nw);
  }
  return bad == 0;
}

// Adam and AdamW differ only in where the weight decay goes: `l2` adds it to the
// gradient, `decay` shrinks the weight directly. Plain pointer arguments (not struct
// members) and -fno-math-errno on this file (see CMakeLists.txt) let GCC vectorise it.
int adam_kernel(const float* __restrict w, const float* __restrict g, const float* __restrict m_in,
                const float* __restrict v_in, float* __restrict w_out, float* __restrict m_out,
                float* __restrict v_out, std::size_t begin, std::size_t end, double lr, double b1,
                double b2, double eps, double scale, double l2, double decay, double inv_bc1,
                double inv_bc2) {
  int bad = 0;
  for (std::size_t i = begin; i < end; ++i) {
    const double wi = w[i];
    const double gi = scale * g[i] + l2 * wi;
    const double mi = b1 * m_in[i] + (1.0 - b1) * gi;
    const double vi = b2 * v_in[i] + (1.0 - b2) * gi * gi;
    const double m_hat = mi * inv_bc1;
    const double v_hat = vi * inv_bc2;
    const double decayed = wi - decay * wi;
    const auto nw = static_cast<float>(decayed - lr * m_hat / (std::sqrt(v_hat) + eps));
    const auto nm = static_cast<float>(mi);
    const auto nv = static_cast<float>(vi);
    w_out[i] = nw;
    m_out[i] = nm;
    v_out[i] = nv;
    bad |= not_finite(nw) | not_finite(nm) | not_finite(nv);
  }
  return bad;
}

bool adam_update(const UpdateScalars& s, const UpdateArrays& a, std::size_t begin, std::size_t end,
                 bool decoupled) {
  const double l2 = decoupled ? 0.0 : s.weight_decay;
  const double decay = decoupled ? s.learning_rate * s.weight_decay : 0.0;
  return adam_kernel(a.weights, a.gradient, a.state[0], a.state[1], a.new_weights, a.new_state[0],
                     a.new_state[1], begin, end, s.learning_rate, s.beta1, s.beta2, s.epsilon,
                     s.gradient_scale, l2, decay, 1.0 / s.bias_correction1,
                     1.0 / s.bias_correction2) == 0;
}

/// AdamW decays by w *= 1 - lr * weight_decay: at lr * weight_decay >= 1 the weights would
/// be zeroed or flip sign every step, which no schedule means.
void require_decay_below_one(const OptimizerConfig& c, double learning_rate, const char* when) {
  if (c.kind == OptimizerKind::adamw && learning_rate * c.weight_decay >= 1) {
    throw ArgumentError(std::string("optimizer config: adamw with learning rate ") +
                        std::to_string(learning_rate) + when + " and weight_decay " +
                        std::to_string(c.weight_decay) +
                        " decays each weight by a factor 1 - lr * weight_decay <= 0 (needs lr * "
                        "weight_decay < 1)");
  }
}

}  // namespace

int optimizer_slot_count(OptimizerKind kind) {
  return kind == OptimizerKind::sgd ? 1 : 2;
}

void validate_optimizer_config(const OptimizerConfig& c) {
  if (c.kind != OptimizerKind::sgd && c.kind != OptimizerKind::adam &&
      c.kind != OptimizerKind::adamw) {
    throw ArgumentError("optimizer config: unknown optimizer kind " +
                        std::to_string(static_cast<int>(c.kind)));
  }
  require(std::isfinite(c.learning_rate) && c.learning_rate >= 0, "learning_rate", c.learning_rate,
          "finite and >= 0");
  require(std::isfinite(c.momentum) && c.momentum >= 0 && c.momentum < 1, "momentum", c.momentum,
          "in [0, 1)");
  require(std::isfinite(c.beta1) && c.beta1 >= 0 && c.beta1 < 1, "beta1", c.beta1, "in [0, 1)");
  require(std::isfinite(c.beta2) && c.beta2 >= 0 && c.beta2 < 1, "beta2", c.beta2, "in [0, 1)");
  require(std::isfinite(c.epsilon) && c.epsilon > 0, "epsilon", c.epsilon, "finite and > 0");
  require(std::isfinite(c.weight_decay) && c.weight_decay >= 0, "weight_decay", c.weight_decay,
          "finite and >= 0");
  require(std::isfinite(c.clip_global_norm) && c.clip_global_norm >= 0, "clip_global_norm",
          c.clip_global_norm, "finite and >= 0 (0 = no clipping)");
  c.decay.validate();
  require_decay_below_one(c, c.learning_rate, "");
}

double scheduled_learning_rate(const OptimizerConfig& config, std::int64_t step) {
  if (!config.schedule && !config.decay.active()) return config.learning_rate;
  const double factor = config.decay.factor(step) * (config.schedule ? config.schedule(step) : 1.0);
  if (!std::isfinite(factor) || factor < 0) {
    throw ArgumentError("learning-rate schedule returned " + std::to_string(factor) + " at step " +
                        std::to_string(step) + " (expected a finite multiplier >= 0)");
  }
  const double learning_rate = config.learning_rate * factor;
  require_decay_below_one(config, learning_rate,
                          (" (scheduled at step " + std::to_string(step) + ")").c_str());
  return learning_rate;
}

UpdateScalars make_update_scalars(const OptimizerConfig& config, double learning_rate,
                                  std::int64_t t, double gradient_scale) {
  UpdateScalars s;
  s.kind = config.kind;
  s.learning_rate = learning_rate;
  s.momentum = config.momentum;
  s.beta1 = config.beta1;
  s.beta2 = config.beta2;
  s.epsilon = config.epsilon;
  s.weight_decay = config.weight_decay;
  s.gradient_scale = gradient_scale;
  s.bias_correction1 = 1.0 - std::pow(config.beta1, static_cast<double>(t));
  s.bias_correction2 = 1.0 - std::pow(config.beta2, static_cast<double>(t));
  return s;
}

bool optimizer_update(const UpdateScalars& scalars, const UpdateArrays& arrays, std::size_t begin,
                      std::size_t end) {
  if (begin >= end) return true;
  switch (scalars.kind) {
    case OptimizerKind::sgd:
      return sgd_update(scalars, arrays, begin, end);
    case OptimizerKind::adam:
      return adam_update(scalars, arrays, begin, end, false);
    case OptimizerKind::adamw:
      return adam_update(scalars, arrays, begin, end, true);
  }
  return false;
}

}  // namespace detail
}  // namespace sluice
