#include "sluice/calibration.hpp"
#include "sluice/layer_cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cost_model/cost_model_checks.hpp"
#include "sluice/error.hpp"

namespace sluice {

using detail::check_shape;
using detail::check_sparsity;
using detail::to_text;

namespace {

constexpr const char* kTermNames[kCostTerms] = {
    "axpy_fixed_seconds",        "axpy_per_token_seconds",
    "partial_sum_fixed_seconds", "partial_sum_per_token_seconds",
    "layer_fixed_seconds",       "stream_spill_seconds",
    "tile_copy_seconds"};

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

void check_geometry(const Geometry& g, const char* where) {
  if (g.lanes < 1 || g.blocks < 1 || g.tile_tokens < 0 || g.shares < 0)
    throw ArgumentError(std::string(where) + ": geometry needs lanes >= 1, blocks >= 1, " +
                        "tile_tokens >= 0 and shares >= 0 (got " + g.to_string() + ")");
}

// ---- small dense linear algebra for the calibration (k <= 5 columns) ----------------

using Matrix = std::vector<std::vector<double>>;  // column-major: a[column][row]

// Singular values and right singular vectors of an n x k matrix by one-sided Jacobi
// (Hestenes): accurate for the small, possibly ill-conditioned design matrices here.
void jacobi_svd(Matrix a, std::vector<double>& sigma, Matrix& v) {
  const std::size_t k = a.size();
  const std::size_t n = k ? a[0].size() : 0;
  v.assign(k, std::vector<double>(k, 0.0));
  for (std::size_t j = 0; j < k; ++j) v[j][j] = 1.0;
  for (int sweep = 0; sweep < 60; ++sweep) {
    bool rotated = false;
    for (std::size_t p = 0; p + 1 < k; ++p) {
      for (std::size_t q = p + 1; q < k; ++q) {
        double alpha = 0, beta = 0, gamma = 0;
        for (std::size_t i = 0; i < n; ++i) {
          alpha += a[p][i] * a[p][i];
          beta += a[q][i] * a[q][i];
          gamma += a[p][i] * a[q][i];
        }
        if (gamma == 0 || std::abs(gamma) <= 1e-15 * std::sqrt(alpha * beta)) continue;
        rotated = true;
        const double zeta = (beta - alpha) / (2 * gamma);
        const double t = (zeta >= 0 ? 1.0 : -1.0) / (std::abs(zeta) + std::sqrt(1 + zeta * zeta));
        const double c = 1 / std::sqrt(1 + t * t);
        const double s = c * t;
        for (std::size_t i = 0; i < n; ++i) {
          const double ap = a[p][i], aq = a[q][i];
          a[p][i] = c * ap - s * aq;
          a[q][i] = s * ap + c * aq;
        }
        for (std::size_t i = 0; i < k; ++i) {
          const double vp = v[p][i], vq = v[q][i];
          v[p][i] = c * vp - s * vq;
          v[q][i] = s * vp + c * vq;
        }
      }
    }
    if (!rotated) break;
  }
  sigma.assign(k, 0.0);
  for (std::size_t j = 0; j < k; ++j) {
    double sum = 0;
    for (std::size_t i = 0; i < n; ++i) sum += a[j][i] * a[j][i];
    sigma[j] = std::sqrt(sum);
  }
}

// Least squares min |A x - b| by Householder QR (A is n x k, n >= k, full rank).
std::vector<double> householder_solve(Matrix a, std::vector<double> b) {
  const std::size_t k = a.size();
  const std::size_t n = b.size();
  for (std::size_t j = 0; j < k; ++j) {
    double norm = 0;
    for (std::size_t i = j; i < n; ++i) norm += a[j][i] * a[j][i];
    norm = std::sqrt(norm);
    if (norm == 0) continue;
    const double alpha = a[j][j] > 0 ? -norm : norm;
    std::vector<double> u(n, 0.0);
    for (std::size_t i = j; i < n; ++i) u[i] = a[j][i];
    u[j] -= alpha;
    double unorm2 = 0;
    for (std::size_t i = j; i < n; ++i) unorm2 += u[i] * u[i];
    if (unorm2 == 0) continue;
    auto reflect = [&](std::vector<double>& x) {
      double dot = 0;
      for (std::size_t i = j; i < n; ++i) dot += u[i] * x[i];
      const double f = 2 * dot / unorm2;
      for (std::size_t i = j; i < n; ++i) x[i] -= f * u[i];
    };
    for (std::size_t c = j; c < k; ++c) reflect(a[c]);
    reflect(b);
  }
  std::vector<double> x(k, 0.0);
  for (std::size_t jj = k; jj-- > 0;) {
    double sum = b[jj];
    for (std::size_t c = jj + 1; c < k; ++c) sum -= a[c][jj] * x[c];
    x[jj] = sum / a[jj][jj];
  }
  return x;
}

}  // namespace

// ------------------------------------------------------------------------------------
// The cost model
// ------------------------------------------------------------------------------------

const char* cost_term_name(int term) {
  if (term < 0 || term >= kCostTerms)
    throw ArgumentError("cost_term_name: no term " + std::to_string(term));
  return kTermNames[term];
}

std::array<double, kCostTerms> cost_terms(const LayerWork& work) {
  check_shape(work.outputs, work.inputs, work.tokens, "cost model");
  check_geometry(work.geometry, "cost model");
  const double max_nnz = static_cast<double>(work.outputs) * static_cast<double>(work.inputs);
  if (!(work.max_lane_nnz >= 0 && work.max_lane_nnz <= max_nnz * (1 + 1e-12)))
    throw ShapeError("cost model: max_lane_nnz " + to_text(work.max_lane_nnz) +
                     " is not in [0, outputs * inputs = " + to_text(max_nnz) + "]");
  const std::int64_t tile =
      (work.geometry.tile_tokens == 0 || work.geometry.tile_tokens > work.tokens)
          ? work.tokens
          : work.geometry.tile_tokens;
  const std::int64_t blocks = work.geometry.blocks;
  const std::int64_t full_passes = work.tokens / tile;
  const std::int64_t remainder = work.tokens % tile;
  // Every pass waits for its fullest block: ceil(tokens of the pass / blocks) tokens.
  const double passes = static_cast<double>(full_passes + (remainder > 0 ? 1 : 0));
  const double block_tokens = static_cast<double>(
      full_passes * ceil_div(tile, blocks) + (remainder > 0 ? ceil_div(remainder, blocks) : 0));
  // Stream shares each take a part of the stream, so of the non-zeros and outputs.
  const double shares = static_cast<double>(std::max(1, work.geometry.shares));
  const double outputs = static_cast<double>(work.outputs) / shares;
  const double lane_nnz = work.max_lane_nnz / shares;
  // A block makes ceil(passes / blocks) passes over its lane's stream; what of it does not
  // stay in the cache between passes comes from memory each time.
  const double packet_bytes = 8.0;
  const double spilled =
      std::max(0.0, (lane_nnz + outputs) * packet_bytes - std::max(0.0, work.cache_bytes));
  const double block_passes =
      static_cast<double>(ceil_div(static_cast<std::int64_t>(passes), blocks));
  return {lane_nnz * passes, lane_nnz * block_tokens, outputs * passes, outputs * block_tokens, 1.0,
          work.cache_bytes > 0 ? spilled / packet_bytes * block_passes : 0.0,
          // The busiest lane copies its rows of X, one block's tokens, once per layer.
          work.packed_tiles
              ? static_cast<double>(ceil_div(work.inputs, work.geometry.lanes)) * block_tokens
              : 0.0};
}

LayerWork uniform_layer_work(const Geometry& geometry, std::int64_t outputs, std::int64_t inputs,
                             std::int64_t tokens, double sparsity) {
  check_shape(outputs, inputs, tokens, "uniform layer");
  check_geometry(geometry, "uniform layer");
  check_sparsity(sparsity, "uniform layer");
  LayerWork work;
  work.outputs = outputs;
  work.inputs = inputs;
  work.tokens = tokens;
  work.geometry = geometry;
  // Round-robin deals whole features: the first lanes get ceil(inputs / lanes) of them.
  const double features_on_busiest_lane = static_cast<double>(ceil_div(inputs, geometry.lanes));
  work.max_lane_nnz = features_on_busiest_lane * static_cast<double>(outputs) * (1.0 - sparsity);
  return work;
}

CostModel::CostModel(const CostConstants& constants) : constants_(constants) {
  const auto terms = constants.terms();
  for (int t = 0; t < kCostTerms; ++t) {
    if (!(terms[t] >= 0 && std::isfinite(terms[t])))
      throw ArgumentError(std::string("cost model: constant ") + kTermNames[t] +
                          " must be finite and >= 0, got " + to_text(terms[t]));
  }
  if (!(constants.dense_flops >= 0 && std::isfinite(constants.dense_flops)))
    throw ArgumentError("cost model: dense_flops must be finite and >= 0, got " +
                        to_text(constants.dense_flops));
}

double CostModel::axpy_seconds(double tokens_per_block) const {
  return constants_.axpy_fixed + constants_.axpy_per_token * tokens_per_block;
}

double CostModel::partial_sum_seconds(double tokens_per_block) const {
  return constants_.partial_sum_fixed + constants_.partial_sum_per_token * tokens_per_block;
}

double CostModel::layer_seconds(const LayerWork& work) const {
  const auto terms = cost_terms(work);
  const auto values = constants_.terms();
  double seconds = 0;
  for (int t = 0; t < kCostTerms; ++t) seconds += terms[t] * values[t];
  return seconds;
}

double CostModel::layer_seconds(const Geometry& geometry, std::int64_t outputs, std::int64_t inputs,
                                std::int64_t tokens, double sparsity) const {
  return layer_seconds(uniform_layer_work(geometry, outputs, inputs, tokens, sparsity));
}

double CostModel::dense_seconds(std::int64_t outputs, std::int64_t inputs,
                                std::int64_t tokens) const {
  check_shape(outputs, inputs, tokens, "dense baseline");
  if (!(constants_.dense_flops > 0))
    throw ArgumentError("cost model: dense_flops is not set, so there is no dense baseline");
  return 2.0 * static_cast<double>(outputs) * static_cast<double>(inputs) *
         static_cast<double>(tokens) / constants_.dense_flops;
}

double CostModel::acceleration(const Geometry& geometry, std::int64_t outputs, std::int64_t inputs,
                               std::int64_t tokens, double sparsity) const {
  const double dense = dense_seconds(outputs, inputs, tokens);
  const double sparse = layer_seconds(geometry, outputs, inputs, tokens, sparsity);
  return sparse > 0 ? dense / sparse : std::numeric_limits<double>::infinity();
}

std::vector<double> CostModel::acceleration_curve(const Geometry& geometry, std::int64_t outputs,
                                                  std::int64_t inputs, std::int64_t tokens,
                                                  const std::vector<double>& sparsities) const {
  std::vector<double> curve;
  curve.reserve(sparsities.size());
  for (const double s : sparsities)
    curve.push_back(acceleration(geometry, outputs, inputs, tokens, s));
  return curve;
}

double CostModel::saturation_acceleration(const Geometry& geometry, std::int64_t outputs,
                                          std::int64_t inputs, std::int64_t tokens) const {
  return acceleration(geometry, outputs, inputs, tokens, 1.0);
}

// ------------------------------------------------------------------------------------
// Calibration
// ------------------------------------------------------------------------------------

CalibrationResult calibrate(const std::vector<MeasuredRun>& runs,
                            const CalibrationOptions& options) {
  std::vector<int> free_terms;
  for (int t = 0; t < kCostTerms; ++t)
    if (options.fit[t]) free_terms.push_back(t);
  const std::size_t n = runs.size();
  if (n < free_terms.size())
    throw ArgumentError("calibrate: fitting " + std::to_string(free_terms.size()) +
                        " constants needs at least as many measured runs; got " +
                        std::to_string(n));

  std::vector<std::array<double, kCostTerms>> terms(n);
  std::vector<double> measured(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double seconds = runs[i].seconds;
    if (!(seconds > 0 && std::isfinite(seconds)))
      throw ArgumentError("calibrate: run " + std::to_string(i) + " has measured time " +
                          to_text(seconds) + "; it must be positive");
    try {
      terms[i] = cost_terms(runs[i].work);
    } catch (const ArgumentError& e) {
      throw ArgumentError("calibrate: run " + std::to_string(i) + ": " + e.what());
    }
    measured[i] = seconds;
  }

  CalibrationResult result;
  result.constants = options.held;
  auto values = options.held.terms();
  for (const int t : free_terms) values[t] = 0;
  {
    // The held constants must themselves be valid costs.
    CostConstants check = options.held;
    CostModel validate(check);
    (void)validate;
  }

  double condition = 1;
  while (!free_terms.empty()) {
    const std::size_t k = free_terms.size();
    // Rows weighted by 1 / measured: minimise the sum of squared relative errors.
    Matrix a(k, std::vector<double>(n));
    std::vector<double> b(n);
    for (std::size_t i = 0; i < n; ++i) {
      double held_part = 0;
      for (int t = 0; t < kCostTerms; ++t)
        if (std::find(free_terms.begin(), free_terms.end(), t) == free_terms.end())
          held_part += terms[i][t] * values[t];
      b[i] = (measured[i] - held_part) / measured[i];
      for (std::size_t j = 0; j < k; ++j) a[j][i] = terms[i][free_terms[j]] / measured[i];
    }
    // Scale columns to unit norm so the condition number does not depend on units.
    std::vector<double> scale(k);
    for (std::size_t j = 0; j < k; ++j) {
      double sum = 0;
      for (const double x : a[j]) sum += x * x;
      scale[j] = std::sqrt(sum);
      if (scale[j] == 0)
        throw ArgumentError(std::string("calibrate: no measured run exercises ") +
                            kTermNames[free_terms[j]] +
                            "; hold it fixed (CalibrationOptions::fit)");
      for (double& x : a[j]) x /= scale[j];
    }
    std::vector<double> sigma;
    Matrix v;
    jacobi_svd(a, sigma, v);
    const auto [min_it, max_it] = std::minmax_element(sigma.begin(), sigma.end());
    condition = *min_it > 0 ? *max_it / *min_it : std::numeric_limits<double>::infinity();
    if (!(condition <= options.max_condition)) {
      // The right singular vector of the smallest singular value says which constants
      // trade off against each other.
      const auto& direction = v[static_cast<std::size_t>(min_it - sigma.begin())];
      std::vector<std::pair<double, int>> weight;
      for (std::size_t j = 0; j < k; ++j)
        weight.emplace_back(std::abs(direction[j]), free_terms[j]);
      std::sort(weight.rbegin(), weight.rend());
      std::string names;
      for (const auto& [w, t] : weight) {
        if (w < 0.2 && !names.empty()) break;
        names += (names.empty() ? "" : ", ");
        names += kTermNames[t];
      }
      throw ArgumentError("calibrate: the measured runs cannot tell apart " + names +
                          " (condition number " + to_text(condition) + " > " +
                          to_text(options.max_condition) +
                          "); vary tokens per block, outputs and lane load across runs, or hold "
                          "some of them fixed");
    }
    std::vector<double> x = householder_solve(a, b);
    for (std::size_t j = 0; j < k; ++j) x[j] /= scale[j];

    // Simple active set: the most negative constant is fixed at zero and the rest refit.
    std::size_t most_negative = k;
    for (std::size_t j = 0; j < k; ++j)
      if (x[j] < 0 && (most_negative == k || x[j] < x[most_negative])) most_negative = j;
    if (most_negative == k) {
      for (std::size_t j = 0; j < k; ++j) values[free_terms[j]] = x[j];
      break;
    }
    const int dropped = free_terms[most_negative];
    values[dropped] = 0;
    result.held_at_zero.push_back(kTermNames[dropped]);
    free_terms.erase(free_terms.begin() + static_cast<std::ptrdiff_t>(most_negative));
  }

  result.constants.set_terms(values);
  result.condition_number = condition;
  result.runs = runs;
  const CostModel model(result.constants);
  double mean = std::accumulate(measured.begin(), measured.end(), 0.0) / static_cast<double>(n);
  double ss_res = 0, ss_tot = 0, sq_rel = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double predicted = 0;
    for (int t = 0; t < kCostTerms; ++t) predicted += terms[i][t] * values[t];
    const double relative = (predicted - measured[i]) / measured[i];
    result.predicted_seconds.push_back(predicted);
    result.relative_residuals.push_back(relative);
    ss_res += (predicted - measured[i]) * (predicted - measured[i]);
    ss_tot += (measured[i] - mean) * (measured[i] - mean);
    sq_rel += relative * relative;
  }
  result.r_squared = ss_tot > 0 ? 1 - ss_res / ss_tot : std::numeric_limits<double>::quiet_NaN();
  result.rms_relative_residual = n ? std::sqrt(sq_rel / static_cast<double>(n)) : 0;
  return result;
}

namespace {

nlohmann::ordered_json constants_json(const CostConstants& constants) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  const auto values = constants.terms();
  for (int t = 0; t < kCostTerms; ++t) j[kTermNames[t]] = values[t];
  j["dense_flops"] = constants.dense_flops;
  return j;
}

/// NaN (a residual that was not computed) as JSON's null.
nlohmann::ordered_json number(double value) {
  return std::isfinite(value) ? nlohmann::ordered_json(value) : nlohmann::ordered_json(nullptr);
}

}  // namespace

std::string CalibrationResult::to_json(int indent) const {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  j["model"] =
      "t = max_lane_nnz * (a0 + a1*T_q) + n_out * (b0 + b1*T_q) + c_layer, "
      "summed over passes of tile_tokens";
  j["constants"] = constants_json(constants);
  j["r_squared"] = number(r_squared);
  j["rms_relative_residual"] = number(rms_relative_residual);
  j["condition_number"] = number(condition_number);
  j["held_at_zero"] = held_at_zero;
  j["points"] = nlohmann::ordered_json::array();
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const LayerWork& work = runs[i].work;
    nlohmann::ordered_json p = nlohmann::ordered_json::object();
    p["outputs"] = work.outputs;
    p["inputs"] = work.inputs;
    p["tokens"] = work.tokens;
    p["lanes"] = work.geometry.lanes;
    p["blocks"] = work.geometry.blocks;
    p["tile_tokens"] = work.geometry.tile_tokens;
    p["shares"] = std::max(1, work.geometry.shares);
    p["max_lane_nnz"] = work.max_lane_nnz;
    p["measured_seconds"] = number(runs[i].seconds);
    p["predicted_seconds"] = number(i < predicted_seconds.size() ? predicted_seconds[i] : NAN);
    p["relative_residual"] = number(i < relative_residuals.size() ? relative_residuals[i] : NAN);
    j["points"].push_back(std::move(p));
  }
  return j.dump(indent > 0 ? indent : -1, ' ', false,
                nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace sluice
