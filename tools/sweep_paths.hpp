#pragma once
// `sluice sweep --path`: the engine's path model (PathCosts, sluice/path_cost.hpp) fitted
// to the sweep's own points, so the crossover it prints is this machine's, measured:
// the streamed product's rate from the points timed sparse, the dense path's densifying
// costs from the points timed dense, its multiply-adds at the rate of oneDNN's whole
// matmul of the same precision timed in the same run.
#include <cstdint>
#include <string>
#include <vector>

#include "sluice/path_cost.hpp"

namespace sluice::cli {

/// One sweep point: its non-zeros and its time on each path (0 where it was not timed).
struct PathPoint {
  double nnz = 0;
  double sparse_seconds = 0;
  double dense_seconds = 0;
};

struct PathFit {
  PathCosts costs;  ///< the held costs with the measured terms replaced
  bool sparse_fitted = false, dense_fitted = false;
  double crossover = 0;           ///< crossover_sparsity under `costs`
  double builtin_crossover = 0;   ///< under the held costs
  double rms_dense_residual = 0;  ///< of the dense points under `costs`, relative
};

/// Fits a layer of outputs x inputs with `tokens` on `threads`; `dense_matmul_seconds`
/// is oneDNN's whole product in `precision`, timed with the points. Terms the points do
/// not measure (and the streamed product's fixed term) stay as `held` has them.
PathFit fit_path_costs(const PathCosts& held, std::int64_t outputs, std::int64_t inputs,
                       std::int64_t tokens, int threads, Precision precision,
                       double dense_matmul_seconds, const std::vector<PathPoint>& points);

/// `base` with the terms `fit` measured for `precision` (what --save-path-costs keeps).
PathCosts with_fitted_terms(PathCosts base, const PathFit& fit, Precision precision);

}  // namespace sluice::cli
