#pragma once
// Transformer scaling laws (Kaplan et al. 2020) for the tokens each engine holds, and the
// predictions built on them: acceleration vs sparsity of a transformer's FFN on the wafer
// and a cluster's time per training step.
#include <cstdint>
#include <string>
#include <vector>

#include "sluice/wafer_system.hpp"

namespace sluice {

struct TransformerShape {
  std::string name;
  std::int32_t n_layers = 0;
  std::int64_t d_model = 0;
  /// Non-embedding parameters, Kaplan et al. 2020: N = 12 * n_layers * d_model^2.
  double parameters() const;
};

/// GPT-3 family (Brown et al. 2020, Table 2.1), 125M .. 175B; 13B's d_model 5140 is
/// taken as 5120 (the table's 5140 is a typo: 40 heads x 128).
std::vector<TransformerShape> gpt3_family();
/// The GPT-3 175B shape (96 layers, d_model 12288).
TransformerShape gpt3_175b();

/// Kaplan et al. 2020, "Scaling Laws for Neural Language Models":
///   L(N) = (N_c / N)^alpha_N,  N_c = 8.8e13, alpha_N = 0.076   (loss in nats/token)
///   B_crit(L) = B* / L^(1 / alpha_B),  B* = 2e8 tokens, alpha_B = 0.21
/// The loss a model is trained to is taken as L(N), its converged loss.
struct KaplanScaling {
  double n_c = 8.8e13;
  double alpha_n = 0.076;
  double b_star = 2e8;
  double alpha_b = 0.21;
  double loss(double parameters) const;
  double critical_batch_tokens(double loss) const;
  double critical_batch_tokens(const TransformerShape& shape) const {
    return critical_batch_tokens(loss(shape.parameters()));
  }
};

/// What an engine's memory holds per token of a training step: the activations every
/// layer keeps for its backward. The default, 2 bytes per token, layer and d_model, is
/// full activation checkpointing: each layer's 16-bit input is kept and the rest of the
/// layer recomputed in the backward pass (one more forward of each product, on the
/// sparse engine and on the dense baseline alike, so accelerations keep their ratio).
/// It is what a model of this family needs on one engine: keeping more, Korthikanti et
/// al. 2022's 34 bytes ("Reducing Activation Recomputation in Large Transformer Models",
/// 16-bit, only the attention scores recomputed), GPT-3 175B needs ~82 GB for one
/// 2048-token sequence and cannot train on a 40 GB engine at all. It also matches the
/// seed's own measure, an engine holding "up to 20 billion activations" (40 GB of
/// 16-bit values). The weights are not held: they stream.
struct ActivationMemory {
  double bytes_per_token_layer_per_d_model = 2;
  double bytes_per_token_layer(const TransformerShape& shape) const;
  double bytes_per_token(const TransformerShape& shape) const;  ///< all layers
  /// The tokens an engine with `memory_bytes` can hold (at least 1).
  std::int64_t token_capacity(const TransformerShape& shape, double memory_bytes) const;
};

/// The sparsities of the acceleration table: 0, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995,
/// 0.999, 0.9999.
std::vector<double> standard_sparsities();

/// Acceleration of a transformer's FFN up-projection (outputs 4 d_model, inputs d_model)
/// on one engine of a cluster of `engines`: the critical batch is shared out, each engine
/// taking B_crit / engines tokens at a time, but never more than its memory holds
/// (ActivationMemory; the rest of the batch then comes as further micro-batches).
struct AccelerationCurve {
  std::int64_t d_model = 0;
  std::int32_t engines = 1;
  std::int64_t tokens_per_engine = 0;  ///< min(batch / engines, token_capacity)
  std::int64_t token_capacity = 0;     ///< what the engine's memory holds
  double batch_tokens = 0;             ///< Kaplan's critical batch
  double activation_bytes_per_token_layer = 0;
  double activation_bytes = 0;  ///< held on the engine: tokens_per_engine * bytes per token
  Geometry geometry;
  double saturation = 0;
  std::vector<double> sparsities;
  std::vector<double> accelerations;
};
AccelerationCurve wafer_ffn_acceleration(const WaferSystem& system, const TransformerShape& shape,
                                         std::int32_t engines,
                                         const std::vector<double>& sparsities,
                                         const KaplanScaling& scaling = {},
                                         const ActivationMemory& activations = {});

/// The engine count of the seed's cluster figures (Figure 5: one engine and sixteen).
inline constexpr std::int32_t kSeedClusterEngines = 16;

/// One training step of a whole transformer on a cluster: time per step and the speedup
/// over one engine. Per layer the weight matrices QKV (3d x d), projection (d x d), FFN up
/// (4d x d) and down (d x 4d) are streamed; backward costs two forward passes (dX and
/// the weight gradient). Weights stream while the engines compute, so each phase takes
/// max(compute, SwarmX link time, MemoryX time) plus the tree's fill: 1 + ceil(log2 N)
/// hops. Attention scores and other token-token work are not counted. An engine takes as
/// many tokens at a time as its memory holds (ActivationMemory): a batch larger than the
/// engines hold runs as micro-batches, each streaming the weights again.
struct ClusterStepPrediction {
  std::int32_t engines = 1;
  double step_seconds = 0;
  double compute_seconds = 0;          ///< engines' time alone
  double stream_seconds = 0;           ///< SwarmX/MemoryX time alone (incl. tree fill)
  double speedup = 1;                  ///< step_seconds(1 engine) / step_seconds
  std::int64_t tokens_per_engine = 0;  ///< per micro-batch
  std::int64_t micro_batches = 1;
};
std::vector<ClusterStepPrediction> predict_cluster_scaling(
    const WaferSystem& system, const TransformerShape& shape, double sparsity,
    const std::vector<std::int32_t>& engine_counts, const KaplanScaling& scaling = {},
    const ActivationMemory& activations = {});

}  // namespace sluice
