#pragma once
// Calibrating the layer cost model (sluice/layer_cost_model.hpp) to measured runs: linear
// least squares on the relative error, with the terms the runs cannot separate held.
#include <array>
#include <string>
#include <vector>

#include "sluice/layer_cost_model.hpp"

namespace sluice {

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
/// ArgumentError when there are fewer runs than constants to fit, a run is invalid, a term is
/// never exercised, or the runs cannot separate the constants (condition number).
CalibrationResult calibrate(const std::vector<MeasuredRun>& runs,
                            const CalibrationOptions& options = {});

}  // namespace sluice
