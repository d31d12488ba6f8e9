#include "sweep_paths.hpp"

#include <algorithm>
#include <cmath>
#include <optional>

namespace sluice::cli {
namespace {

std::size_t index_of(Precision precision) {
  return precision == Precision::bf16 ? 1 : 0;
}

/// a + b n ~ t over the points, least squares on the relative error; a, b >= 0.
void fit_line(const std::vector<double>& n, const std::vector<double>& t, double& a, double& b) {
  double s00 = 0, s01 = 0, s11 = 0, y0 = 0, y1 = 0;
  for (std::size_t i = 0; i < n.size(); ++i) {
    const double w = 1 / (t[i] * t[i]);
    s00 += w;
    s01 += w * n[i];
    s11 += w * n[i] * n[i];
    y0 += w * t[i];
    y1 += w * n[i] * t[i];
  }
  const double det = s00 * s11 - s01 * s01;
  const bool solvable = n.size() >= 2 && det > 1e-12 * s00 * s11;
  if (!solvable) {  // b held as given
    a = s00 > 0 ? std::max(0.0, (y0 - b * s01) / s00) : 0;
    return;
  }
  a = (y0 * s11 - y1 * s01) / det;
  b = (y1 * s00 - y0 * s01) / det;
  if (a < 0) {  // a negative term: the other alone
    a = 0;
    b = std::max(0.0, y1 / s11);
  } else if (b < 0) {
    b = 0;
    a = std::max(0.0, y0 / s00);
  }
}

}  // namespace

PathFit fit_path_costs(const PathCosts& held, std::int64_t outputs, std::int64_t inputs,
                       std::int64_t tokens, int threads, Precision precision,
                       double dense_matmul_seconds, const std::vector<PathPoint>& points) {
  PathFit f;
  f.costs = held;
  f.builtin_crossover = f.costs.crossover_sparsity(tokens, precision);
  const std::size_t p = index_of(precision);
  const double th = std::max(1, threads), t = static_cast<double>(tokens);
  const double slots = static_cast<double>(outputs) * static_cast<double>(inputs);

  // Sparse: t = nnz * (a + tokens * c) / threads. One batch size cannot tell a from c, so
  // a is held; where the points take less than it alone, it is dropped.
  const auto fit_per_token = [&](double a) -> std::optional<double> {
    double num = 0, den = 0;
    for (const PathPoint& q : points) {
      if (q.sparse_seconds <= 0 || q.nnz <= 0) continue;
      const double x = q.nnz * t / th, y = q.sparse_seconds - q.nnz * a / th;
      num += x * y / (q.sparse_seconds * q.sparse_seconds);
      den += x * x / (q.sparse_seconds * q.sparse_seconds);
    }
    if (den <= 0) return std::nullopt;  // no streamed points
    return num / den;
  };
  std::optional<double> c = fit_per_token(f.costs.sparse_per_nnz[p]);
  if (c && *c <= 0) {
    f.costs.sparse_per_nnz[p] = 0;
    c = fit_per_token(0);
  }
  if (c && *c > 0) {
    f.costs.sparse_per_nnz_token[p] = *c;
    f.sparse_fitted = true;
  }

  // Dense: a line in the non-zeros, its intercept the multiply-adds at oneDNN's rate and
  // the rest per slot. Where the dense path's tiles beat oneDNN's whole matmul timed in
  // the same run, the intercept is all multiply-adds at the tiles' rate.
  std::vector<double> n, seconds;
  const double macs = slots * t / th;
  if (dense_matmul_seconds > 0 && slots > 0) {
    f.costs.dense_per_mac[p] = dense_matmul_seconds / macs;
  }
  for (const PathPoint& q : points) {
    if (q.dense_seconds <= 0) continue;
    n.push_back(q.nnz / th);
    seconds.push_back(q.dense_seconds);
  }
  if (!n.empty() && slots > 0) {
    double intercept = 0, b = f.costs.densify_per_packet[p];
    fit_line(n, seconds, intercept, b);
    const double at_onednns_rate = macs * f.costs.dense_per_mac[p];
    const double multiply_adds =
        intercept > 0 ? std::min(intercept, at_onednns_rate) : at_onednns_rate;
    f.costs.dense_per_mac[p] = multiply_adds / macs;
    f.costs.densify_per_slot[p] = std::max(0.0, intercept - multiply_adds) * th / slots;
    f.costs.densify_per_packet[p] = b;
    f.dense_fitted = true;
    double sum = 0;
    for (std::size_t i = 0; i < n.size(); ++i) {
      const double predicted = f.costs.dense_seconds(outputs, inputs, n[i] * th, tokens, precision,
                                                     static_cast<std::int32_t>(th));
      sum += std::pow((predicted - seconds[i]) / seconds[i], 2);
    }
    f.rms_dense_residual = std::sqrt(sum / static_cast<double>(n.size()));
  }
  f.crossover = f.costs.crossover_sparsity(tokens, precision);
  return f;
}

PathCosts with_fitted_terms(PathCosts base, const PathFit& fit, Precision precision) {
  const std::size_t p = index_of(precision);
  if (fit.sparse_fitted) {
    base.sparse_per_nnz_token[p] = fit.costs.sparse_per_nnz_token[p];
    base.sparse_per_nnz[p] = fit.costs.sparse_per_nnz[p];
  }
  if (fit.dense_fitted) {
    base.dense_per_mac[p] = fit.costs.dense_per_mac[p];
    base.densify_per_slot[p] = fit.costs.densify_per_slot[p];
    base.densify_per_packet[p] = fit.costs.densify_per_packet[p];
  }
  return base;
}

}  // namespace sluice::cli
