#pragma once
// Amdahl's law for a streamed sparse layer (docs/architecture.md, "The cost model").
//
// On a P x Q geometry every non-zero becomes one AXPY over a block's token vector in the
// lane that owns its input feature, and every output costs each lane a partial-sum
// hand-off whatever the sparsity. With T_q tokens per block and one pass over the stream:
//
//     t(layer) = max_p nnz_p * c_axpy(T_q) + n_out * c_ps(T_q) + c_layer
//     c_axpy(T) = a0 + a1 * T      a0: per packet (intake, routing, loop set-up)
//                                  a1: per token of the AXPY (memory/FMA bound)
//     c_ps(T)   = b0 + b1 * T      b0: per output hand-off (seed: four cycles on the wafer)
//                                  b1: copying/adding the accumulator, per token
//     + s * packets beyond the last-level cache, per pass    (the stream re-read from DRAM)
//     + k * activation values copied into packed lane tiles (when the engine packs)
//
// The last term matters on a CPU only: a lane reads the layer's stream once per token
// tile, and when the stream is larger than the shared cache every pass reads it from
// memory, so dense-ish layers pay more per non-zero than sparse ones. With S stream
// shares each task reads 1/S of the stream: nnz_p and n_out are divided by S.
//
// When the tokens do not fit one pass (Geometry::tile_tokens < tokens) every pass pays its
// own AXPYs and partial sums, so the terms are summed over the passes. The model is linear
// in (a0, a1, b0, b1, c_layer, s, k), which is what lets `calibrate` fit them to measured runs by
// least squares. The dense baseline is 2 * outputs * inputs * tokens / dense_flops.
//
// Acceleration = dense time / sparse time. As sparsity -> 1 the AXPY term vanishes and the
// acceleration saturates at dense time / (n_out * c_ps + c_layer): the partial sums are
// the serial fraction of Amdahl's law.
//
#include <array>
#include <cstdint>
#include <vector>

#include "sluice/geometry.hpp"

namespace sluice {

/// The work of one streamed layer: shape, tokens, geometry and the busiest lane's load.
struct LayerWork {
  std::int64_t outputs = 0;
  std::int64_t inputs = 0;
  std::int64_t tokens = 0;
  /// lanes (P) and blocks (Q) must be >= 1; tile_tokens 0 means all tokens in one pass.
  Geometry geometry;
  /// Non-zeros received by the busiest lane (Placement::max_lane_nnz()). A double so the
  /// uniform model can pass an expected value.
  double max_lane_nnz = 0;
  /// Bytes of the cache the stream is re-read from between passes (the last-level cache);
  /// 0 leaves the spill term out.
  double cache_bytes = 0;
  /// Whether the lanes copy their rows of X into packed tiles (CpuEngine::packs_tiles).
  bool packed_tiles = false;
};

/// The model's fitted constants, all in seconds (see the header comment for the form).
inline constexpr int kCostTerms = 7;
struct CostConstants {
  double axpy_fixed = 0;             ///< a0: per non-zero per pass
  double axpy_per_token = 0;         ///< a1: per non-zero per token of a block
  double partial_sum_fixed = 0;      ///< b0: per output per pass
  double partial_sum_per_token = 0;  ///< b1: per output per token of a block
  double layer_fixed = 0;            ///< c_layer: per layer (fill/drain, dispatch)
  double stream_spill = 0;           ///< s: per packet per pass beyond the cache
  double tile_copy = 0;              ///< k: per activation value packed into a lane tile
  /// Dense baseline throughput in FLOP/s (not fitted: measure it, e.g. with oneDNN).
  double dense_flops = 0;

  std::array<double, kCostTerms> terms() const {
    return {axpy_fixed,  axpy_per_token, partial_sum_fixed, partial_sum_per_token,
            layer_fixed, stream_spill,   tile_copy};
  }
  void set_terms(const std::array<double, kCostTerms>& t) {
    axpy_fixed = t[0];
    axpy_per_token = t[1];
    partial_sum_fixed = t[2];
    partial_sum_per_token = t[3];
    layer_fixed = t[4];
    stream_spill = t[5];
    tile_copy = t[6];
  }
};

/// JSON/CSV names of the seven fitted terms, in CostConstants::terms() order.
const char* cost_term_name(int term);

/// The multipliers of (a0, a1, b0, b1, c_layer, s, k) for this work: the predicted time is
/// their dot product with CostConstants::terms(). ShapeError for inconsistent work.
std::array<double, kCostTerms> cost_terms(const LayerWork& work);

/// LayerWork for a layer of uniform density (1 - sparsity) placed round-robin: the
/// busiest lane holds ceil(inputs / lanes) features of outputs * (1 - sparsity) non-zeros
/// each. Sparsity must be in [0, 1].
LayerWork uniform_layer_work(const Geometry& geometry, std::int64_t outputs, std::int64_t inputs,
                             std::int64_t tokens, double sparsity);

class CostModel {
 public:
  CostModel() = default;
  explicit CostModel(const CostConstants& constants);

  const CostConstants& constants() const { return constants_; }

  /// c_axpy(T) and c_ps(T) for T tokens per block.
  double axpy_seconds(double tokens_per_block) const;
  double partial_sum_seconds(double tokens_per_block) const;

  /// Predicted time of a layer from its measured (or planned) lane load.
  double layer_seconds(const LayerWork& work) const;
  /// The same for a uniform layer of the given sparsity (see uniform_layer_work).
  double layer_seconds(const Geometry& geometry, std::int64_t outputs, std::int64_t inputs,
                       std::int64_t tokens, double sparsity) const;
  /// The dense baseline: 2 * outputs * inputs * tokens / dense_flops.
  double dense_seconds(std::int64_t outputs, std::int64_t inputs, std::int64_t tokens) const;

  /// dense_seconds / layer_seconds for a uniform layer of this sparsity.
  double acceleration(const Geometry& geometry, std::int64_t outputs, std::int64_t inputs,
                      std::int64_t tokens, double sparsity) const;
  /// acceleration(...) at each sparsity.
  std::vector<double> acceleration_curve(const Geometry& geometry, std::int64_t outputs,
                                         std::int64_t inputs, std::int64_t tokens,
                                         const std::vector<double>& sparsities) const;
  /// The limit sparsity -> 1: dense_seconds / (partial sums + fixed cost). Infinite when
  /// those costs are zero.
  double saturation_acceleration(const Geometry& geometry, std::int64_t outputs,
                                 std::int64_t inputs, std::int64_t tokens) const;

 private:
  CostConstants constants_;
};

}  // namespace sluice
