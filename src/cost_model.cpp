#include "sluice/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/json.hpp"

namespace sluice {

namespace {

constexpr const char* kTermNames[kCostTerms] = {
    "axpy_fixed_seconds",        "axpy_per_token_seconds",
    "partial_sum_fixed_seconds", "partial_sum_per_token_seconds",
    "layer_fixed_seconds",       "stream_spill_seconds",
    "tile_copy_seconds"};

std::string to_text(double value) {
  std::ostringstream out;
  out.precision(4);
  out << value;
  return out.str();
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

void check_shape(std::int64_t outputs, std::int64_t inputs, std::int64_t tokens,
                 const char* where) {
  if (outputs < 1 || inputs < 1 || tokens < 1)
    throw ShapeError(std::string(where) + ": outputs, inputs and tokens must be >= 1 (got " +
                     std::to_string(outputs) + " x " + std::to_string(inputs) + ", " +
                     std::to_string(tokens) + " tokens)");
}

void check_geometry(const Geometry& g, const char* where) {
  if (g.lanes < 1 || g.blocks < 1 || g.tile_tokens < 0 || g.shares < 0)
    throw ShapeError(std::string(where) + ": geometry needs lanes >= 1, blocks >= 1, " +
                     "tile_tokens >= 0 and shares >= 0 (got " + g.to_string() + ")");
}

void check_sparsity(double sparsity, const char* where) {
  if (!(sparsity >= 0.0 && sparsity <= 1.0))
    throw ShapeError(std::string(where) + ": sparsity must be in [0, 1], got " + to_text(sparsity));
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
    throw ShapeError("cost_term_name: no term " + std::to_string(term));
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
      throw ShapeError(std::string("cost model: constant ") + kTermNames[t] +
                       " must be finite and >= 0, got " + to_text(terms[t]));
  }
  if (!(constants.dense_flops >= 0 && std::isfinite(constants.dense_flops)))
    throw ShapeError("cost model: dense_flops must be finite and >= 0, got " +
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
    throw ShapeError("cost model: dense_flops is not set, so there is no dense baseline");
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
    throw ShapeError("calibrate: fitting " + std::to_string(free_terms.size()) +
                     " constants needs at least as many measured runs; got " + std::to_string(n));

  std::vector<std::array<double, kCostTerms>> terms(n);
  std::vector<double> measured(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double seconds = runs[i].seconds;
    if (!(seconds > 0 && std::isfinite(seconds)))
      throw ShapeError("calibrate: run " + std::to_string(i) + " has measured time " +
                       to_text(seconds) + "; it must be positive");
    try {
      terms[i] = cost_terms(runs[i].work);
    } catch (const ShapeError& e) {
      throw ShapeError("calibrate: run " + std::to_string(i) + ": " + e.what());
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
        throw ShapeError(std::string("calibrate: no measured run exercises ") +
                         kTermNames[free_terms[j]] + "; hold it fixed (CalibrationOptions::fit)");
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
      throw ShapeError("calibrate: the measured runs cannot tell apart " + names +
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

void write_json(JsonWriter& writer, const CostConstants& constants) {
  writer.begin_object();
  const auto values = constants.terms();
  for (int t = 0; t < kCostTerms; ++t) writer.field(kTermNames[t], values[t]);
  writer.field("dense_flops", constants.dense_flops);
  writer.end_object();
}

std::string CalibrationResult::to_json(int indent) const {
  JsonWriter w(indent);
  w.begin_object();
  w.field("model",
          "t = max_lane_nnz * (a0 + a1*T_q) + n_out * (b0 + b1*T_q) + c_layer, "
          "summed over passes of tile_tokens");
  w.key("constants");
  write_json(w, constants);
  w.field("r_squared", r_squared);
  w.field("rms_relative_residual", rms_relative_residual);
  w.field("condition_number", condition_number);
  w.key("held_at_zero").begin_array();
  for (const auto& name : held_at_zero) w.value(name);
  w.end_array();
  w.key("points").begin_array();
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const LayerWork& work = runs[i].work;
    w.begin_object();
    w.field("outputs", work.outputs);
    w.field("inputs", work.inputs);
    w.field("tokens", work.tokens);
    w.field("lanes", work.geometry.lanes);
    w.field("blocks", work.geometry.blocks);
    w.field("tile_tokens", work.geometry.tile_tokens);
    w.field("shares", std::max(1, work.geometry.shares));
    w.field("max_lane_nnz", work.max_lane_nnz);
    w.field("measured_seconds", runs[i].seconds);
    w.field("predicted_seconds", i < predicted_seconds.size() ? predicted_seconds[i] : NAN);
    w.field("relative_residual", i < relative_residuals.size() ? relative_residuals[i] : NAN);
    w.end_object();
  }
  w.end_array();
  w.end_object();
  return w.str();
}

// ------------------------------------------------------------------------------------
// The wafer-scale system
// ------------------------------------------------------------------------------------

WaferSystem WaferSystem::wse2() {
  WaferSystem s;
  s.name = "wse2";
  s.cores = {850000, "cores", "seed 002: 850,000 independently programmable cores"};
  s.fp_units = {3.4e6, "FPUs", "seed 002: 3.4 million floating point units (4 per core)"};
  s.clock_hz = {1.1e9, "Hz",
                "assumption: ~1.1 GHz, the commonly quoted WSE clock (Cerebras publishes none); "
                "the seed's 5.8 PFLOP/s over 3.4M FPUs implies 0.85 GHz"};
  s.fp32_fmac_per_core_cycle = {
      1, "FMAC/core/cycle",
      "assumption: one fp32 AXPY lane-op per core per cycle; this gives only 1.87 PFLOP/s, so "
      "the model uses the token-lane rate derived from the published peak instead"};
  s.peak_flops = {5.8e15, "FLOP/s", "seed 002: raw throughput 5.8 PFLOP/s (dense baseline)"};
  s.partial_sum_cycles = {4, "cycles/output/core",
                          "seed 002: copy 1 + reset accumulator 1 + double-wide add on the "
                          "partial-sum chain 2"};
  s.engine_rows = {922, "rows", "assumption: square grid, round(sqrt(850,000)) = 922"};
  s.engine_columns = {922, "columns", "assumption: square grid, round(sqrt(850,000)) = 922"};
  s.memory_bytes = {40e9, "B", "seed 002: 40 GB on-chip memory"};
  s.memory_bandwidth = {20e15, "B/s", "seed 002: 20 PB/s memory bandwidth"};
  s.fabric_bandwidth = {28e15, "B/s", "seed 002: 28 PB/s on-wafer fabric (220 Pb/s)"};
  s.memoryx_bandwidth = {4e12, "B/s", "seed 002: MemoryX model memory bandwidth 4 TB/s"};
  s.engine_io_bandwidth = {150e9, "B/s",
                           "CS-2 system I/O 1.2 Tb/s (12 x 100 GbE), Cerebras product material; "
                           "not in the seed: the SwarmX link into each engine"};
  s.swarmx_hop_latency = {5e-6, "s",
                          "assumption: a few microseconds per SwarmX tree level (switch and "
                          "store-and-forward of a chunk)"};
  s.weight_packet_bytes = {4, "B/non-zero",
                           "seed 002: 38-bit fabric messages; taken as 16-bit value + 16-bit "
                           "index"};
  s.gradient_bytes = {2, "B/non-zero",
                      "assumption: 16-bit gradients, position implied by stream order"};
  s.optimizer_bytes_per_weight = {32, "B/non-zero/step",
                                  "seed 002: Adam keeps four fp32 values per parameter; MemoryX "
                                  "reads and writes them each step"};
  return s;
}

std::vector<std::pair<std::string, SourcedValue>> WaferSystem::parameters() const {
  return {{"cores", cores},
          {"fp_units", fp_units},
          {"clock_hz", clock_hz},
          {"fp32_fmac_per_core_cycle", fp32_fmac_per_core_cycle},
          {"peak_flops", peak_flops},
          {"partial_sum_cycles", partial_sum_cycles},
          {"engine_rows", engine_rows},
          {"engine_columns", engine_columns},
          {"memory_bytes", memory_bytes},
          {"memory_bandwidth", memory_bandwidth},
          {"fabric_bandwidth", fabric_bandwidth},
          {"memoryx_bandwidth", memoryx_bandwidth},
          {"engine_io_bandwidth", engine_io_bandwidth},
          {"swarmx_hop_latency", swarmx_hop_latency},
          {"weight_packet_bytes", weight_packet_bytes},
          {"gradient_bytes", gradient_bytes},
          {"optimizer_bytes_per_weight", optimizer_bytes_per_weight}};
}

double WaferSystem::token_lanes_per_core_cycle() const {
  return peak_flops.value / (2 * cores.value * clock_hz.value);
}
double WaferSystem::fp32_scalar_peak_flops() const {
  return 2 * cores.value * clock_hz.value * fp32_fmac_per_core_cycle.value;
}
double WaferSystem::fpu_peak_flops() const {
  return 2 * fp_units.value * clock_hz.value;
}
double WaferSystem::clock_for_peak_from_fpus() const {
  return peak_flops.value / (2 * fp_units.value);
}
double WaferSystem::memory_bytes_per_core() const {
  return memory_bytes.value / cores.value;
}

CostModel WaferSystem::cost_model() const {
  if (!(cores.value > 0 && clock_hz.value > 0 && peak_flops.value > 0 && engine_rows.value >= 1 &&
        engine_columns.value >= 1))
    throw ShapeError("wafer system " + name + ": cores, clock, peak and grid must be positive");
  CostConstants c;
  c.axpy_fixed = 0;
  c.axpy_per_token = 1.0 / (token_lanes_per_core_cycle() * clock_hz.value);
  c.partial_sum_fixed = partial_sum_cycles.value / clock_hz.value;
  c.partial_sum_per_token = 0;
  c.layer_fixed = (3 * engine_rows.value + engine_columns.value) / clock_hz.value;
  c.dense_flops = peak_flops.value;
  return CostModel(c);
}

Geometry WaferSystem::geometry_for(std::int64_t inputs, std::int64_t tokens) const {
  if (inputs < 1 || tokens < 1) throw ShapeError("wafer geometry: inputs and tokens must be >= 1");
  const auto rows = static_cast<std::int64_t>(engine_rows.value);
  // The busiest row cannot hold fewer than ceil(inputs / rows) features; use the fewest
  // rows that achieve that, and give the remaining cores to more token columns (a logical
  // P x Q grid over all cores, folded onto the physical one). This avoids rows holding 2
  // features next to rows holding 1 (e.g. 1024 features on 922 rows).
  const std::int64_t features_per_row = ceil_div(inputs, rows);
  const std::int64_t lanes = ceil_div(inputs, features_per_row);
  const auto columns =
      static_cast<std::int64_t>(std::floor(cores.value / static_cast<double>(lanes)));
  Geometry g;
  g.lanes = static_cast<std::int32_t>(lanes);
  g.blocks = static_cast<std::int32_t>(std::max<std::int64_t>(1, std::min(tokens, columns)));
  g.tile_tokens = 0;
  return g;
}

double WaferSystem::nnz_per_engine_row(std::int64_t outputs, std::int64_t inputs,
                                       double sparsity) const {
  check_shape(outputs, inputs, 1, "nnz per engine row");
  check_sparsity(sparsity, "nnz per engine row");
  const double rows = geometry_for(inputs, 1).lanes;
  return static_cast<double>(outputs) * static_cast<double>(inputs) * (1 - sparsity) / rows;
}

// ------------------------------------------------------------------------------------
// Scaling laws and predictions
// ------------------------------------------------------------------------------------

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
  if (!(parameters > 0)) throw ShapeError("Kaplan loss: parameters must be positive");
  return std::pow(n_c / parameters, alpha_n);
}

double KaplanScaling::critical_batch_tokens(double loss) const {
  if (!(loss > 0)) throw ShapeError("Kaplan critical batch: loss must be positive");
  return b_star / std::pow(loss, 1.0 / alpha_b);
}

std::vector<double> standard_sparsities() {
  return {0, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999};
}

namespace {
std::int64_t tokens_per_engine(const TransformerShape& shape, std::int32_t engines,
                               const KaplanScaling& scaling) {
  if (engines < 1) throw ShapeError("engine count must be >= 1, got " + std::to_string(engines));
  const double batch = scaling.critical_batch_tokens(shape);
  return std::max<std::int64_t>(1, std::llround(batch / engines));
}
}  // namespace

AccelerationCurve wafer_ffn_acceleration(const WaferSystem& system, const TransformerShape& shape,
                                         std::int32_t engines,
                                         const std::vector<double>& sparsities,
                                         const KaplanScaling& scaling) {
  if (shape.d_model < 1) throw ShapeError("wafer acceleration: d_model must be >= 1");
  AccelerationCurve curve;
  curve.d_model = shape.d_model;
  curve.engines = engines;
  curve.tokens_per_engine = tokens_per_engine(shape, engines, scaling);
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
};

StepParts cluster_step(const WaferSystem& system, const TransformerShape& shape, double sparsity,
                       std::int32_t engines, const KaplanScaling& scaling) {
  const std::int64_t tokens = tokens_per_engine(shape, engines, scaling);
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
  const double layers = shape.n_layers;
  parts.compute = layers * (forward + backward);
  parts.stream = layers * (stream_forward + stream_backward + 2 * fill);
  parts.step =
      layers * (std::max(forward, stream_forward) + std::max(backward, stream_backward) + 2 * fill);
  return parts;
}
}  // namespace

std::vector<ClusterStepPrediction> predict_cluster_scaling(
    const WaferSystem& system, const TransformerShape& shape, double sparsity,
    const std::vector<std::int32_t>& engine_counts, const KaplanScaling& scaling) {
  check_sparsity(sparsity, "cluster scaling");
  if (shape.d_model < 1 || shape.n_layers < 1)
    throw ShapeError("cluster scaling: d_model and n_layers must be >= 1");
  const double single = cluster_step(system, shape, sparsity, 1, scaling).step;
  std::vector<ClusterStepPrediction> points;
  for (const std::int32_t engines : engine_counts) {
    const StepParts parts = cluster_step(system, shape, sparsity, engines, scaling);
    ClusterStepPrediction p;
    p.engines = engines;
    p.step_seconds = parts.step;
    p.compute_seconds = parts.compute;
    p.stream_seconds = parts.stream;
    p.speedup = single / parts.step;
    points.push_back(p);
  }
  return points;
}

}  // namespace sluice
