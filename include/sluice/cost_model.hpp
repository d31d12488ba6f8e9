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
// The second half of this header carries the wafer-scale system's published parameters
// (WaferSystem::wse2) and the scaling laws used to reproduce the seed's predictions.
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sluice/engine.hpp"  // Geometry

namespace sluice {

class JsonWriter;

// ------------------------------------------------------------------------------------
// The cost model
// ------------------------------------------------------------------------------------

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

// ------------------------------------------------------------------------------------
// Calibration from measured runs
// ------------------------------------------------------------------------------------

struct MeasuredRun {
  LayerWork work;
  double seconds = 0;  ///< measured wall time of the layer; must be positive
};

struct CalibrationOptions {
  /// Which terms to fit; the others are held at their value in `held`.
  /// The spill and copy terms are off by default: they need runs that set cache_bytes
  /// and packed_tiles.
  std::array<bool, kCostTerms> fit{true, true, true, true, true, false, false};
  /// Values of the terms not fitted; its dense_flops is copied into the result.
  CostConstants held;
  /// Refuse fits whose (column-scaled) design matrix is worse conditioned than this:
  /// the runs then do not tell the constants apart.
  double max_condition = 1e8;
};

struct CalibrationResult {
  CostConstants constants;
  std::vector<MeasuredRun> runs;           ///< the inputs, for the record
  std::vector<double> predicted_seconds;   ///< per run
  std::vector<double> relative_residuals;  ///< per run: (predicted - measured) / measured
  double r_squared = 0;                    ///< of predicted vs measured seconds; NaN if all equal
  double rms_relative_residual = 0;
  double condition_number = 0;            ///< of the final fit's scaled design matrix
  std::vector<std::string> held_at_zero;  ///< terms a negative fit forced to zero

  /// {"constants": {...}, "r_squared", "rms_relative_residual", "condition_number",
  ///  "held_at_zero": [...], "points": [{outputs, inputs, tokens, lanes, blocks,
  ///  tile_tokens, shares, max_lane_nnz, measured_seconds, predicted_seconds,
  ///  relative_residual}]}
  std::string to_json(int indent = 2) const;
};

/// Fits the constants to the runs by linear least squares on the *relative* error
/// (each run weighted by 1 / measured time, since timings span decades), solved by
/// Householder QR. Negative costs are meaningless: while the fit has a negative constant,
/// the most negative one is fixed at zero and the rest refitted (a simple active set).
/// ShapeError when there are fewer runs than constants to fit, a run is invalid, a term is
/// never exercised, or the runs cannot separate the constants (condition number).
CalibrationResult calibrate(const std::vector<MeasuredRun>& runs,
                            const CalibrationOptions& options = {});

/// Writes the constants as a JSON object (term names as keys, plus "dense_flops").
void write_json(JsonWriter& writer, const CostConstants& constants);

// ------------------------------------------------------------------------------------
// The wafer-scale system
// ------------------------------------------------------------------------------------

/// A parameter with its unit and where the number comes from.
struct SourcedValue {
  double value = 0;
  std::string unit;
  std::string source;
};

/// The published parameters of a wafer-scale engine and its cluster (wse2()). The
/// acceleration model on it:
///   * geometry: input features over engine rows, tokens over engine columns, one pass.
///     P is the fewest rows (<= engine_rows) that keep the busiest row at its minimum of
///     ceil(inputs / engine_rows) features, Q = cores / P (the logical grid is folded onto
///     the physical one when P < engine_rows), so the whole wafer is busy;
///   * a1 = 1 / (token_lanes_per_core_cycle * clock): the token-lane FMAC rate per core is
///     derived from the published 5.8 PFLOP/s, so the engine running every weight (dense)
///     is exactly the dense baseline;
///   * b0 = partial_sum_cycles / clock (four cycles per output per core, seed 002);
///   * a0 = b1 = 0 (packet handling and the hand-off are pipelined in hardware);
///   * c_layer = (3 * rows + columns) / clock: the stream crosses the wafer once and the
///     last output's partial sum drains round a ring of rows at two cycles per hop.
/// Saturation is then dense / (4 n_out cycles) = inputs * T_q / (4 * rows * lane-ops),
/// i.e. inputs * tokens / (4 * cores * token_lanes_per_core_cycle): independent of the
/// P x Q split, proportional to the tokens each engine holds.
struct WaferSystem {
  std::string name;
  SourcedValue cores;
  SourcedValue fp_units;
  SourcedValue clock_hz;
  SourcedValue fp32_fmac_per_core_cycle;
  SourcedValue peak_flops;
  SourcedValue partial_sum_cycles;
  SourcedValue engine_rows;
  SourcedValue engine_columns;
  SourcedValue memory_bytes;
  SourcedValue memory_bandwidth;
  SourcedValue fabric_bandwidth;
  SourcedValue memoryx_bandwidth;
  SourcedValue engine_io_bandwidth;
  SourcedValue swarmx_hop_latency;
  SourcedValue weight_packet_bytes;
  SourcedValue gradient_bytes;
  SourcedValue optimizer_bytes_per_weight;

  /// Cerebras WSE-2 / CS-2 with MemoryX and SwarmX, from seed 002 plus stated assumptions.
  static WaferSystem wse2();

  /// Every parameter as (name, value) in declaration order: the documented table.
  std::vector<std::pair<std::string, SourcedValue>> parameters() const;

  // -- derived quantities ---------------------------------------------------------------
  /// peak / (2 * cores * clock): FMACs on token lanes per core per cycle needed for the
  /// published peak (3.10 for WSE-2 at 1.1 GHz).
  double token_lanes_per_core_cycle() const;
  /// 2 * cores * clock * fp32 FMACs per core per cycle (1.87 PFLOP/s for WSE-2).
  double fp32_scalar_peak_flops() const;
  /// 2 * floating point units * clock (7.48 PFLOP/s for WSE-2 at 1.1 GHz).
  double fpu_peak_flops() const;
  /// The clock at which every floating point unit doing one FMAC per cycle gives the
  /// published peak (853 MHz for WSE-2).
  double clock_for_peak_from_fpus() const;
  double memory_bytes_per_core() const;

  /// The engine's cost constants (see the struct comment).
  CostModel cost_model() const;
  /// Features over rows, tokens over columns, one pass (see the struct comment).
  Geometry geometry_for(std::int64_t inputs, std::int64_t tokens) const;
  /// Mean non-zeros sent to each engine row (of geometry_for's P) for a layer of
  /// uniform sparsity.
  double nnz_per_engine_row(std::int64_t outputs, std::int64_t inputs, double sparsity) const;
};

// ------------------------------------------------------------------------------------
// Transformer scaling laws (for the tokens each engine holds)
// ------------------------------------------------------------------------------------

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

/// The sparsities of the acceleration table: 0, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995,
/// 0.999, 0.9999.
std::vector<double> standard_sparsities();

/// Acceleration of a transformer's FFN up-projection (outputs 4 d_model, inputs d_model)
/// on one engine of a cluster of `engines`: the critical batch is shared out, so each
/// engine holds B_crit / engines tokens.
struct AccelerationCurve {
  std::int64_t d_model = 0;
  std::int32_t engines = 1;
  std::int64_t tokens_per_engine = 0;
  Geometry geometry;
  double saturation = 0;
  std::vector<double> sparsities;
  std::vector<double> accelerations;
};
AccelerationCurve wafer_ffn_acceleration(const WaferSystem& system, const TransformerShape& shape,
                                         std::int32_t engines,
                                         const std::vector<double>& sparsities,
                                         const KaplanScaling& scaling = {});

/// The engine count of the seed's cluster figures (Figure 5: one engine and sixteen).
inline constexpr std::int32_t kSeedClusterEngines = 16;

/// One training step of a whole transformer on a cluster: time per step and the speedup
/// over one engine. Per layer the weight matrices QKV (3d x d), projection (d x d), FFN up
/// (4d x d) and down (d x 4d) are streamed; backward costs two forward passes (dX and
/// the weight gradient). Weights stream while the engines compute, so each phase takes
/// max(compute, SwarmX link time, MemoryX time) plus the tree's fill: 1 + ceil(log2 N)
/// hops. Attention scores and other token-token work are not counted.
struct ClusterStepPrediction {
  std::int32_t engines = 1;
  double step_seconds = 0;
  double compute_seconds = 0;  ///< engines' time alone
  double stream_seconds = 0;   ///< SwarmX/MemoryX time alone (incl. tree fill)
  double speedup = 1;          ///< step_seconds(1 engine) / step_seconds
};
std::vector<ClusterStepPrediction> predict_cluster_scaling(
    const WaferSystem& system, const TransformerShape& shape, double sparsity,
    const std::vector<std::int32_t>& engine_counts, const KaplanScaling& scaling = {});

}  // namespace sluice
