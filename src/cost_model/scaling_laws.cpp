#include "sluice/scaling_laws.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cost_model/cost_model_checks.hpp"
#include "sluice/error.hpp"

namespace sluice {

using detail::check_shape;
using detail::check_sparsity;

double TransformerShape::parameters() const {
  const double d = static_cast<double>(d_model);
  return 12.0 * n_layers * d * d;
}

std::vector<TransformerShape> gpt3_family() {
  return {{"GPT-3 Small 125M", 12, 768},  {"GPT-3 Medium 350M", 24, 1024},
          {"GPT-3 Large 760M", 24, 1536}, {"GPT-3 XL 1.3B", 24, 2048},
          {"GPT-3 2.7B", 32, 2560},       {"GPT-3 6.7B", 32, 4096},
          {"GPT-3 13B", 40, 5120},        {"GPT-3 175B", 96, 12288}};
}

TransformerShape gpt3_175b() {
  return {"GPT-3 175B", 96, 12288};
}

double KaplanScaling::loss(double parameters) const {
  if (!(parameters > 0)) throw ArgumentError("Kaplan loss: parameters must be positive");
  return std::pow(n_c / parameters, alpha_n);
}

double KaplanScaling::critical_batch_tokens(double loss) const {
  if (!(loss > 0)) throw ArgumentError("Kaplan critical batch: loss must be positive");
  return b_star / std::pow(loss, 1.0 / alpha_b);
}

double ActivationMemory::bytes_per_token_layer(const TransformerShape& shape) const {
  return bytes_per_token_layer_per_d_model * static_cast<double>(shape.d_model);
}

double ActivationMemory::bytes_per_token(const TransformerShape& shape) const {
  return bytes_per_token_layer(shape) * shape.n_layers;
}

std::int64_t ActivationMemory::token_capacity(const TransformerShape& shape,
                                              double memory_bytes) const {
  if (!(bytes_per_token_layer_per_d_model > 0) || shape.d_model < 1 || shape.n_layers < 1)
    throw ArgumentError("activation memory: bytes per token, d_model and layers must be positive");
  return std::max<std::int64_t>(1,
                                static_cast<std::int64_t>(memory_bytes / bytes_per_token(shape)));
}

std::vector<double> standard_sparsities() {
  return {0, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999};
}

namespace {
/// The tokens each engine takes at a time: its share of the critical batch, capped by
/// what its memory holds.
std::int64_t tokens_per_engine(const WaferSystem& system, const TransformerShape& shape,
                               std::int32_t engines, const KaplanScaling& scaling,
                               const ActivationMemory& activations) {
  if (engines < 1) throw ArgumentError("engine count must be >= 1, got " + std::to_string(engines));
  const double batch = scaling.critical_batch_tokens(shape);
  const std::int64_t share = std::max<std::int64_t>(1, std::llround(batch / engines));
  return std::min(share, activations.token_capacity(shape, system.memory_bytes.value));
}
}  // namespace

AccelerationCurve wafer_ffn_acceleration(const WaferSystem& system, const TransformerShape& shape,
                                         std::int32_t engines,
                                         const std::vector<double>& sparsities,
                                         const KaplanScaling& scaling,
                                         const ActivationMemory& activations) {
  if (shape.d_model < 1) throw ArgumentError("wafer acceleration: d_model must be >= 1");
  AccelerationCurve curve;
  curve.d_model = shape.d_model;
  curve.engines = engines;
  curve.tokens_per_engine = tokens_per_engine(system, shape, engines, scaling, activations);
  curve.token_capacity = activations.token_capacity(shape, system.memory_bytes.value);
  curve.batch_tokens = scaling.critical_batch_tokens(shape);
  curve.activation_bytes_per_token_layer = activations.bytes_per_token_layer(shape);
  curve.activation_bytes =
      static_cast<double>(curve.tokens_per_engine) * activations.bytes_per_token(shape);
  const std::int64_t outputs = 4 * shape.d_model;
  const std::int64_t inputs = shape.d_model;
  curve.geometry = system.geometry_for(inputs, curve.tokens_per_engine);
  const CostModel model = system.cost_model();
  curve.saturation =
      model.saturation_acceleration(curve.geometry, outputs, inputs, curve.tokens_per_engine);
  curve.sparsities = sparsities;
  curve.accelerations = model.acceleration_curve(curve.geometry, outputs, inputs,
                                                 curve.tokens_per_engine, sparsities);
  return curve;
}

namespace {
struct StepParts {
  double step = 0, compute = 0, stream = 0;
  std::int64_t tokens = 0, micro_batches = 1;
};

StepParts cluster_step(const WaferSystem& system, const TransformerShape& shape, double sparsity,
                       std::int32_t engines, const KaplanScaling& scaling,
                       const ActivationMemory& activations) {
  const std::int64_t tokens = tokens_per_engine(system, shape, engines, scaling, activations);
  // The batch the engines cannot hold at once comes as micro-batches, each streaming the
  // weights again (gradients accumulate in MemoryX).
  const double micro =
      std::max(1.0, std::ceil(scaling.critical_batch_tokens(shape) /
                                  (static_cast<double>(engines) * static_cast<double>(tokens)) -
                              1e-9));
  const CostModel model = system.cost_model();
  const std::int64_t d = shape.d_model;
  const std::pair<std::int64_t, std::int64_t> matrices[] = {
      {3 * d, d}, {d, d}, {4 * d, d}, {d, 4 * d}};  // (outputs, inputs)
  double forward = 0;
  double nnz = 0;
  for (const auto& [outputs, inputs] : matrices) {
    forward +=
        model.layer_seconds(system.geometry_for(inputs, tokens), outputs, inputs, tokens, sparsity);
    nnz += static_cast<double>(outputs) * static_cast<double>(inputs) * (1 - sparsity);
  }
  const double backward = 2 * forward;  // dX pass + weight-gradient pass
  const double link = system.engine_io_bandwidth.value;
  const double memx = system.memoryx_bandwidth.value;
  const double packet = system.weight_packet_bytes.value;
  const double grad = system.gradient_bytes.value;
  const double optimizer = system.optimizer_bytes_per_weight.value;
  // Forward: weights out. Backward: weights out and gradients back at the same time on
  // full-duplex links; MemoryX also serves the optimizer's reads and writes.
  const double stream_forward = std::max(nnz * packet / link, nnz * packet / memx);
  const double stream_backward =
      std::max(nnz * std::max(packet, grad) / link, nnz * (packet + grad + optimizer) / memx);
  const int depth = 1 + static_cast<int>(std::ceil(std::log2(static_cast<double>(engines))));
  const double fill = depth * system.swarmx_hop_latency.value;
  StepParts parts;
  parts.tokens = tokens;
  parts.micro_batches = static_cast<std::int64_t>(micro);
  const double layers = shape.n_layers * micro;
  parts.compute = layers * (forward + backward);
  parts.stream = layers * (stream_forward + stream_backward + 2 * fill);
  parts.step =
      layers * (std::max(forward, stream_forward) + std::max(backward, stream_backward) + 2 * fill);
  return parts;
}
}  // namespace

std::vector<ClusterStepPrediction> predict_cluster_scaling(
    const WaferSystem& system, const TransformerShape& shape, double sparsity,
    const std::vector<std::int32_t>& engine_counts, const KaplanScaling& scaling,
    const ActivationMemory& activations) {
  check_sparsity(sparsity, "cluster scaling");
  if (shape.d_model < 1 || shape.n_layers < 1)
    throw ArgumentError("cluster scaling: d_model and n_layers must be >= 1");
  const double single = cluster_step(system, shape, sparsity, 1, scaling, activations).step;
  std::vector<ClusterStepPrediction> points;
  for (const std::int32_t engines : engine_counts) {
    const StepParts parts = cluster_step(system, shape, sparsity, engines, scaling, activations);
    ClusterStepPrediction p;
    p.engines = engines;
    p.step_seconds = parts.step;
    p.compute_seconds = parts.compute;
    p.stream_seconds = parts.stream;
    p.speedup = single / parts.step;
    p.tokens_per_engine = parts.tokens;
    p.micro_batches = parts.micro_batches;
    points.push_back(p);
  }
  return points;
}

}  // namespace sluice
