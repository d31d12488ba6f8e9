// `sluice sweep`: measures the streamed layer over a list of sparsities against oneDNN's
// dense products on the same shape (f32 matmul, and the fastest of any precision),
// calibrates the cost model (Amdahl's law, docs/architecture.md) to the measured points by
// least squares, and shows measured and predicted acceleration side by side with the
// residual: a table, CSV/JSON files and a plot.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "dense_baseline.hpp"
#include "json_writer.hpp"
#include "measure.hpp"
#include "number_options.hpp"
#include "output_files.hpp"
#include "reference.hpp"
#include "sluice/cost_model.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/path_cost.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"
#include "sluice/topology.hpp"
#include "sweep_paths.hpp"

namespace sluice::cli {
namespace {

namespace fs = std::filesystem;

struct SweepOptions {
  std::string shape = "4096x4096";
  std::int64_t tokens = 256;
  int threads = 0;
  std::string sparsities = "0,0.5,0.75,0.9,0.95,0.98,0.99,0.995,0.999";
  std::uint64_t seed = 1;
  int repeat = 5;
  bool training = false;
  bool json = false;
  std::string out_dir = "sweep-out";
  std::string path = "sparse";  ///< the paths each point is timed on: sparse, dense or both
  std::string precision = "fp32";
  std::string save_path_costs;  ///< a path-cost file to write the fitted terms into
  bool times_sparse() const { return path != "dense"; }
  bool times_dense() const { return path != "sparse"; }
};

struct SweepPoint {
  double sparsity = 0;  ///< requested
  std::int64_t nnz = 0;
  double measured_seconds = 0;
  double predicted_seconds = 0;
  double dense_path_seconds = 0;  ///< the engine's dense path (--path dense or both)
};

struct Sweep {
  std::int64_t outputs = 0, inputs = 0, tokens = 0;
  int threads = 0;
  std::string isa;
  Geometry geometry;
  bool training = false;
  int repeat = 0;
  double dense_seconds = 0;       ///< oneDNN's f32 matmul, the sweep's precision
  double dense_best_seconds = 0;  ///< the fastest oneDNN product of any precision
  std::string dense_kind, dense_best_kind;
  std::vector<SweepPoint> points;
  CalibrationResult fit;
  std::vector<std::string> fitted_terms;
  std::vector<std::string> unidentifiable_terms;
  std::string path, precision;
  bool sparse_timed = true, dense_timed = false;
  PathCosts held_path_costs;  ///< what the path fit starts from
  PathFit path_fit;

  double measured_acceleration(const SweepPoint& p) const {
    return p.measured_seconds > 0 ? dense_seconds / p.measured_seconds : 0;
  }
  double predicted_acceleration(const SweepPoint& p) const {
    return p.predicted_seconds > 0 ? dense_seconds / p.predicted_seconds : 0;
  }
  double measured_acceleration_vs_best(const SweepPoint& p) const {
    return p.measured_seconds > 0 ? dense_best_seconds / p.measured_seconds : 0;
  }
  double dense_path_acceleration(const SweepPoint& p) const {
    return p.dense_path_seconds > 0 ? dense_seconds / p.dense_path_seconds : 0;
  }
  double dense_path_acceleration_vs_best(const SweepPoint& p) const {
    return p.dense_path_seconds > 0 ? dense_best_seconds / p.dense_path_seconds : 0;
  }
  static double residual(const SweepPoint& p) {
    if (p.measured_seconds <= 0) return 0;
    return (p.predicted_seconds - p.measured_seconds) / p.measured_seconds;
  }
};

// ---- progress ----------------------------------------------------------------------

/// A one-line bar on stderr, drawn only when stderr is a terminal (not in logs or pipes).
class ProgressBar {
 public:
  explicit ProgressBar(int total) : total_(total), enabled_(::isatty(STDERR_FILENO) != 0) {}
  ~ProgressBar() { finish(); }
  void set_label(std::string label) {
    label_ = std::move(label);
    draw();
  }
  void tick() {
    ++done_;
    draw();
  }
  void finish() {
    if (enabled_ && drawn_) std::fprintf(stderr, "\r%*s\r", 78, "");
    drawn_ = false;
  }

 private:
  void draw() {
    if (!enabled_) return;
    constexpr int kWidth = 30;
    const int filled = total_ > 0 ? kWidth * done_ / total_ : kWidth;
    std::fprintf(stderr, "\r[%s%s] %3d%% %-30.30s", std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, ' ').c_str(), total_ > 0 ? 100 * done_ / total_ : 100,
                 label_.c_str());
    std::fflush(stderr);
    drawn_ = true;
  }
  int total_ = 0, done_ = 0;
  bool enabled_ = false, drawn_ = false;
  std::string label_;
};

// ---- measuring ---------------------------------------------------------------------

double seconds_of(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

Sweep measure(const SweepOptions& o, const std::vector<double>& sparsities,
              std::vector<MeasuredRun>& runs) {
  const auto [outputs, inputs] = parse_shape(o.shape);
  const double densest = 1.0 - *std::min_element(sparsities.begin(), sparsities.end());
  require_dense_baseline_memory(
      outputs, inputs, o.training, o.tokens,
      densest * static_cast<double>(outputs) * static_cast<double>(inputs), o.times_dense());
  EngineOptions eo;
  eo.threads = runnable_threads(o.threads, "sweep");
  // The points calibrate the streamed product's model: every one runs sparse, also where
  // the engine would take the dense path; with --path dense or both each point is also
  // (or only) timed on the dense path, which calibrates PathCosts' dense terms.
  eo.path = ProductPath::sparse;
  CpuEngine engine(eo);
  eo.path = ProductPath::dense;
  CpuEngine dense_engine(eo);
  const Precision precision = parse_precision(o.precision);
  baseline::set_dense_threads(engine.threads());

  Sweep s;
  s.outputs = outputs;
  s.inputs = inputs;
  s.tokens = o.tokens;
  s.threads = engine.threads();
  s.isa = to_string(engine.isa());
  s.geometry = engine.geometry_for(outputs, inputs, o.tokens);
  s.training = o.training;
  s.repeat = o.repeat;
  s.path = o.path;
  s.precision = o.precision;
  s.sparse_timed = o.times_sparse();
  s.dense_timed = o.times_dense();

  const DenseMatrix x = testing::random_dense(inputs, o.tokens, o.seed + 101);
  const DenseMatrix dy = testing::random_dense(outputs, o.tokens, o.seed + 202);
  DenseMatrix y(outputs, o.tokens), dx(inputs, o.tokens);
  MutableMatrixView dx_view = dx.view();

  // Every layer is prepared first (planning and encoding happen once per layer in
  // ModelMemory, so they are not timed) ...
  struct Layer {
    Placement placement;
    WeightStream stream;
    WeightStream backward;  ///< as a training step streams it (with --training)
  };
  std::vector<Layer> layers;
  for (const double sparsity : sparsities) {
    const CsrMatrix w = CsrMatrix::random(outputs, inputs, sparsity, o.seed);
    const StreamOrder backward_order = streams_by_input(outputs, w.nnz(), precision)
                                           ? StreamOrder::by_input
                                           : StreamOrder::by_output;
    Layer layer{round_robin_placement(w, s.geometry.lanes),
                encode_stream(w, StreamKind::weights, kDefaultChunkPackets, precision),
                o.training ? encode_stream(w, StreamKind::weights, kDefaultChunkPackets, precision,
                                           backward_order)
                           : WeightStream{}};
    SweepPoint p;
    p.sparsity = sparsity;
    p.nnz = w.nnz();
    s.points.push_back(p);
    MeasuredRun run;
    run.work.outputs = outputs;
    run.work.inputs = inputs;
    run.work.tokens = o.tokens;
    // As the product will run (a very sparse point may be too little work to share).
    run.work.geometry = engine.geometry_for(outputs, inputs, o.tokens, precision, w.nnz());
    run.work.max_lane_nnz = static_cast<double>(layer.placement.max_lane_nnz());
    run.work.cache_bytes = static_cast<double>(topology().cache_share_bytes() * engine.threads());
    run.work.packed_tiles = CpuEngine::packs_tiles(s.geometry.lanes, w.nnz(), inputs);
    runs.push_back(run);
    layers.push_back(std::move(layer));
  }
  // The dense baselines do the same work whatever the sparsity (zeros included), so they
  // are timed once, on the same shape and threads, before the sweep.
  {
    const DenseMatrix w_dense = testing::random_dense(outputs, inputs, o.seed);
    DenseMatrix dw(o.training ? outputs : 1, o.training ? inputs : 1);
    std::vector<baseline::DenseOperands> products{
        {w_dense.view(), false, x.view(), false, y.view()}};
    if (o.training) {
      products.push_back({w_dense.view(), true, dy.view(), false, dx.view()});
      products.push_back({dy.view(), false, x.view(), true, dw.view()});
    }
    const baseline::DenseTiming dense = baseline::time_dense(products, precision, o.repeat);
    s.dense_seconds = 1e-3 * dense.same_ms;
    s.dense_kind = baseline::to_string(dense.same_kind);
    s.dense_best_seconds = 1e-3 * dense.best_ms;
    s.dense_best_kind = baseline::to_string(dense.best_kind);
  }
  // Item 2i times point i streamed, 2i + 1 on the dense path (each where asked for).
  std::vector<std::function<void()>> items;
  std::vector<std::size_t> item_point;
  std::vector<bool> item_dense;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    for (CpuEngine* e : {&engine, &dense_engine}) {
      const bool dense = e == &dense_engine;
      if (dense ? !o.times_dense() : !o.times_sparse()) continue;
      const Layer& layer = layers[i];
      items.push_back([&layer, e, &o, &x, &y, &dy, &dx_view] {
        e->forward(layer.stream, layer.placement, x.view(), y.view());
        if (o.training)
          (void)e->backward(layer.backward, layer.placement, x.view(), dy.view(), &dx_view);
      });
      item_point.push_back(i);
      item_dense.push_back(dense);
    }
  }

  // ... then each timed back to back: one warm-up call (it also absorbs the wake-up of
  // threads that slept or the spinning of another runtime's threads after the previous
  // item), then `repeat` timed calls; the median drops bursts of load from elsewhere.
  ProgressBar progress(static_cast<int>(items.size()) * (o.repeat + 1));
  std::vector<std::vector<double>> times(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    progress.set_label("sparsity " + json_number(s.points[item_point[i]].sparsity) +
                       (item_dense[i] ? " dense" : ""));
    for (int call = 0; call <= o.repeat; ++call) {
      const double t = seconds_of(items[i]);
      if (call > 0) times[i].push_back(t);
      progress.tick();
    }
  }
  progress.finish();
  for (std::size_t i = 0; i < items.size(); ++i) {
    SweepPoint& p = s.points[item_point[i]];
    (item_dense[i] ? p.dense_path_seconds : p.measured_seconds) = median(times[i]);
    if (!item_dense[i]) runs[item_point[i]].seconds = p.measured_seconds;
  }
  return s;
}

// ---- calibration -------------------------------------------------------------------

/// The terms the runs can tell apart. A sweep over sparsity at one shape, token count and
/// geometry varies only the busiest lane's non-zeros: the per-packet and per-token AXPY terms are
/// then proportional to each other, and so are the per-output terms and the per-layer constant.
/// Terms are taken in order of preference (the per-token costs, which carry over to other token
/// counts best, first) and kept when their column, weighted as calibrate weights it, is not
/// (numerically) in the span of those already kept; the rest are held at zero.
std::array<bool, kCostTerms> identifiable_terms(const std::vector<MeasuredRun>& runs) {
  static_assert(kCostTerms == 7, "list every term in kPreference");
  // a1, b1, s, k, a0, b0, c
  constexpr std::array<int, kCostTerms> kPreference = {1, 3, 5, 6, 0, 2, 4};
  std::vector<std::vector<double>> basis;  // orthonormal
  std::array<bool, kCostTerms> keep{};
  for (const int t : kPreference) {
    std::vector<double> column(runs.size());
    for (std::size_t i = 0; i < runs.size(); ++i)
      column[i] = cost_terms(runs[i].work)[t] / runs[i].seconds;
    double norm = 0;
    for (const double v : column) norm += v * v;
    norm = std::sqrt(norm);
    if (norm == 0) continue;
    for (double& v : column) v /= norm;
    for (int pass = 0; pass < 2; ++pass) {  // twice: Gram-Schmidt loses orthogonality once
      for (const auto& b : basis) {
        double dot = 0;
        for (std::size_t i = 0; i < column.size(); ++i) dot += b[i] * column[i];
        for (std::size_t i = 0; i < column.size(); ++i) column[i] -= dot * b[i];
      }
    }
    double rest = 0;
    for (const double v : column) rest += v * v;
    rest = std::sqrt(rest);
    if (rest < 1e-4) continue;
    for (double& v : column) v /= rest;
    basis.push_back(std::move(column));
    keep[t] = true;
  }
  return keep;
}

/// PathCosts fitted to the points (sweep_paths.hpp), for the sweep's precision. A
/// training step is three products: the dense rate and the times are per product.
void fit_paths(Sweep& s) {
  std::vector<PathPoint> points;
  const double products = s.training ? 3 : 1;
  for (const SweepPoint& p : s.points) {
    points.push_back({static_cast<double>(p.nnz), p.measured_seconds / products,
                      p.dense_path_seconds / products});
  }
  s.path_fit = fit_path_costs(s.held_path_costs, s.outputs, s.inputs, s.tokens, s.threads,
                              parse_precision(s.precision), s.dense_seconds / products, points);
}

void calibrate_sweep(Sweep& s, const std::vector<MeasuredRun>& runs) {
  fit_paths(s);
  if (!s.sparse_timed) return;  // the streamed model has nothing to fit
  CalibrationOptions options;
  options.fit = identifiable_terms(runs);
  // The dense rate as measured, so CostModel::dense_seconds reproduces the baseline.
  const double flops_per_product = 2.0 * static_cast<double>(s.outputs) *
                                   static_cast<double>(s.inputs) * static_cast<double>(s.tokens);
  options.held.dense_flops = (s.training ? 3 : 1) * flops_per_product / s.dense_seconds;
  s.fit = calibrate(runs, options);
  for (int t = 0; t < kCostTerms; ++t)
    (options.fit[t] ? s.fitted_terms : s.unidentifiable_terms).push_back(cost_term_name(t));
  for (std::size_t i = 0; i < s.points.size(); ++i)
    s.points[i].predicted_seconds = s.fit.predicted_seconds.at(i);
}

// ---- output ------------------------------------------------------------------------

void write_fit_json(JsonWriter& w, const Sweep& s) {
  const CalibrationResult& f = s.fit;
  w.begin_object();
  w.field("model",
          "t = max_lane_nnz * (a0 + a1*T_q) + n_out * (b0 + b1*T_q) + c_layer, "
          "summed over passes of tile_tokens");
  w.key("constants").begin_object();
  const auto terms = f.constants.terms();
  for (int t = 0; t < kCostTerms; ++t) w.field(cost_term_name(t), terms[t]);
  w.field("dense_flops", f.constants.dense_flops);
  w.end_object();
  w.field("r_squared", f.r_squared);
  w.field("rms_relative_residual", f.rms_relative_residual);
  w.field("condition_number", f.condition_number);
  w.key("fitted_terms").begin_array();
  for (const auto& name : s.fitted_terms) w.value(name);
  w.end_array();
  w.key("held_at_zero").begin_array();
  for (const auto& name : f.held_at_zero) w.value(name);
  w.end_array();
  w.key("not_identifiable").begin_array();
  for (const auto& name : s.unidentifiable_terms) w.value(name);
  w.end_array();
  w.end_object();
}

/// PathCosts as fitted for the sweep's precision, and the crossover they imply.
void write_path_fit_json(JsonWriter& w, const Sweep& s) {
  const PathFit& f = s.path_fit;
  const std::size_t p = s.precision == "bf16" ? 1 : 0;
  w.begin_object();
  w.field("precision", s.precision);
  w.field("sparse_fitted", f.sparse_fitted).field("dense_fitted", f.dense_fitted);
  w.field("sparse_per_nnz_token", f.costs.sparse_per_nnz_token[p]);
  w.field("sparse_per_nnz", f.costs.sparse_per_nnz[p]);
  w.field("dense_per_mac", f.costs.dense_per_mac[p]);
  w.field("densify_per_slot", f.costs.densify_per_slot[p]);
  w.field("densify_per_packet", f.costs.densify_per_packet[p]);
  w.field("rms_dense_residual", f.rms_dense_residual);
  w.field("crossover_sparsity", f.crossover);
  w.field("builtin_crossover_sparsity", f.builtin_crossover);
  w.end_object();
}

std::string to_json(const Sweep& s) {
  JsonWriter w(2);
  w.begin_object();
  w.field("mode", s.training ? "training_step" : "forward");
  w.field("outputs", s.outputs).field("inputs", s.inputs).field("tokens", s.tokens);
  w.field("threads", s.threads).field("isa", s.isa).field("geometry", s.geometry.to_string());
  w.field("repeat", s.repeat).field("dense_ms", 1e3 * s.dense_seconds);
  w.field("dense_kind", s.dense_kind).field("dense_best_ms", 1e3 * s.dense_best_seconds);
  w.field("dense_best_kind", s.dense_best_kind);
  // The engine's path model: above these sparsities the streamed product is faster than
  // the dense path of the same precision.
  const PathCosts paths = PathCosts::for_this_cpu();
  w.field("path_costs", PathCosts::this_cpus_origin());
  w.field("crossover_sparsity_fp32", paths.crossover_sparsity(s.tokens, Precision::fp32));
  w.field("crossover_sparsity_bf16", paths.crossover_sparsity(s.tokens, Precision::bf16));
  w.field("path", s.path).field("precision", s.precision);
  w.key("path_fit");
  write_path_fit_json(w, s);
  w.key("points").begin_array();
  for (const auto& p : s.points) {
    w.begin_object();
    w.field("sparsity", p.sparsity).field("nnz", p.nnz);
    w.field("measured_ms", 1e3 * p.measured_seconds);
    w.field("predicted_ms", 1e3 * p.predicted_seconds);
    w.field("measured_acceleration", s.measured_acceleration(p));
    w.field("predicted_acceleration", s.predicted_acceleration(p));
    w.field("residual", Sweep::residual(p));
    w.field("acceleration_vs_best", s.measured_acceleration_vs_best(p));
    if (s.dense_timed) {
      w.field("dense_path_ms", 1e3 * p.dense_path_seconds);
      w.field("dense_path_acceleration", s.dense_path_acceleration(p));
      w.field("dense_path_acceleration_vs_best", s.dense_path_acceleration_vs_best(p));
    }
    w.end_object();
  }
  w.end_array();
  w.key("fit");
  write_fit_json(w, s);
  w.end_object();
  return w.str();
}

std::string to_csv(const Sweep& s) {
  std::ostringstream csv;
  csv << "sparsity,inverse_density,nnz,measured_ms,predicted_ms,dense_ms,measured_acceleration,"
         "predicted_acceleration,residual,dense_best_ms,acceleration_vs_best,dense_path_ms,"
         "dense_path_acceleration\n";
  for (const auto& p : s.points) {
    csv << json_number(p.sparsity) << "," << json_number(1.0 / (1.0 - p.sparsity)) << "," << p.nnz
        << "," << json_number(1e3 * p.measured_seconds) << ","
        << json_number(1e3 * p.predicted_seconds) << "," << json_number(1e3 * s.dense_seconds)
        << "," << json_number(s.measured_acceleration(p)) << ","
        << json_number(s.predicted_acceleration(p)) << "," << json_number(Sweep::residual(p)) << ","
        << json_number(1e3 * s.dense_best_seconds) << ","
        << json_number(s.measured_acceleration_vs_best(p)) << ","
        << json_number(1e3 * p.dense_path_seconds) << ","
        << json_number(s.dense_path_acceleration(p)) << "\n";
  }
  return csv.str();
}

std::string title(const Sweep& s) {
  char text[200];
  std::snprintf(text, sizeof text, "%s %lld x %lld, %lld tokens, %d threads, geometry %s",
                s.training ? "training step" : "forward", static_cast<long long>(s.outputs),
                static_cast<long long>(s.inputs), static_cast<long long>(s.tokens), s.threads,
                s.geometry.to_string().c_str());
  return text;
}

void print_crossovers(const Sweep& s) {
  const PathCosts paths = PathCosts::for_this_cpu();
  std::printf(
      "path model (PathCosts, %s): the streamed product beats the dense path above sparsity "
      "%.3f in fp32, %.3f in bf16 (%lld tokens); below, --path auto multiplies dense\n",
      PathCosts::this_cpus_origin().c_str(), paths.crossover_sparsity(s.tokens, Precision::fp32),
      paths.crossover_sparsity(s.tokens, Precision::bf16), static_cast<long long>(s.tokens));
  const PathFit& f = s.path_fit;
  const std::size_t p = s.precision == "bf16" ? 1 : 0;
  std::printf(
      "path model fitted to this sweep (%s; %s%s): sparse %.3g s per nnz and token and %.3g s "
      "per nnz (held), dense %.3g s per multiply-add (oneDNN's, or the tiles' where faster), "
      "densifying %.3g s per slot and %.3g s per packet (per thread); rms dense residual "
      "%.1f%%; crossover %.3f (before: %.3f)\n",
      s.precision.c_str(), f.sparse_fitted ? "streamed measured" : "streamed built in",
      f.dense_fitted ? ", dense path measured" : ", dense path built in",
      f.costs.sparse_per_nnz_token[p], f.costs.sparse_per_nnz[p], f.costs.dense_per_mac[p],
      f.costs.densify_per_slot[p], f.costs.densify_per_packet[p], 100 * f.rms_dense_residual,
      f.crossover, f.builtin_crossover);
}

void print_dense_path(const Sweep& s) {
  std::printf("dense path (--path %s):\n%9s %10s %14s %12s %9s\n", s.path.c_str(), "sparsity",
              "nnz", "dense_path_ms", "accel", "vs_best");
  for (const auto& p : s.points) {
    std::printf("%9.4g %10lld %14.4f %11.2fx %8.2fx\n", p.sparsity, static_cast<long long>(p.nnz),
                1e3 * p.dense_path_seconds, s.dense_path_acceleration(p),
                s.dense_path_acceleration_vs_best(p));
  }
}

void print_table(const Sweep& s) {
  std::printf("sluice sweep: %s, ISA %s; dense %s %.3f ms, best dense %s %.3f ms\n",
              title(s).c_str(), s.isa.c_str(), s.dense_kind.c_str(), 1e3 * s.dense_seconds,
              s.dense_best_kind.c_str(), 1e3 * s.dense_best_seconds);
  std::printf("%9s %10s %12s %12s %10s %10s %9s %9s\n", "sparsity", "nnz", "measured_ms",
              "predicted_ms", "meas_accel", "pred_accel", "residual", "vs_best");
  for (const auto& p : s.points) {
    std::printf("%9.4g %10lld %12.4f %12.4f %9.2fx %9.2fx %8.1f%% %8.2fx\n", p.sparsity,
                static_cast<long long>(p.nnz), 1e3 * p.measured_seconds, 1e3 * p.predicted_seconds,
                s.measured_acceleration(p), s.predicted_acceleration(p), 100 * Sweep::residual(p),
                s.measured_acceleration_vs_best(p));
  }
  const auto values = s.fit.constants.terms();
  std::printf("fit (least squares on relative error):");
  for (const auto& name : s.fitted_terms) {
    for (int t = 0; t < kCostTerms; ++t)
      if (name == cost_term_name(t)) std::printf(" %s = %.4g s", name.c_str(), values[t]);
  }
  if (std::isfinite(s.fit.r_squared)) {
    std::printf("\n  R^2 = %.5f, ", s.fit.r_squared);
  } else {
    std::printf("\n  R^2 undefined (the times do not vary), ");
  }
  std::printf("rms residual %.1f%%, condition %.3g", 100 * s.fit.rms_relative_residual,
              s.fit.condition_number);
  if (!s.fit.held_at_zero.empty()) {
    std::printf("; forced to zero:");
    for (const auto& name : s.fit.held_at_zero) std::printf(" %s", name.c_str());
  }
  std::printf("\n  not separable by this sweep (held at 0):");
  for (const auto& name : s.unidentifiable_terms) std::printf(" %s", name.c_str());
  std::printf("\n");
}

bool plot(const Sweep& s, const fs::path& dir) {
  const PlotFile png = plot_file(dir, "sweep.png");
  const std::string csv = gnuplot_quote((dir / "sweep.csv").string());
  std::ostringstream gp;
  gp << "set datafile separator ','\n"
     << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo size 900,600 } "
        "else { set terminal png size 900,600 }\n"
     << "set termoption noenhanced\nset output " << gnuplot_quote(png.tmp_path.string()) << "\n"
     << "set title " << gnuplot_quote("Acceleration over oneDNN dense: " + title(s)) << "\n"
     << "set logscale xy\nset grid\nset key top left\n"
     // From just left of dense, so a sweep of one sparsity still has an x range.
     << "set xrange [0.8:*]\n"
     << "set xlabel '1 / (1 - sparsity)  (1 = dense, 10 = 90% sparse, 1000 = 99.9%)'\n"
     << "set ylabel 'acceleration (dense time / sparse time)'\n"
     << "plot " << csv << " using 2:7 with points pt 7 ps 1.5 title 'measured', " << csv
     << " using 2:8 with linespoints lw 2 title 'predicted (calibrated cost model)', "
     << (s.dense_timed ? csv + " using 2:13 with linespoints lw 2 title 'dense path (measured)', "
                       : std::string())
     << "1 with lines dashtype 2 lc rgb 'gray' title 'break-even'\n"
     << "set output\n";
  return run_gnuplot(gp.str(), dir, {png}, "sluice sweep");
}

/// What --save-path-costs starts from: the file's terms where it exists (checked before
/// the sweep measures), else the constants built in for this CPU.
PathCosts path_costs_to_update(const fs::path& file) {
  const fs::path parent = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  if (!fs::is_directory(parent)) {
    throw UsageError("sweep: --save-path-costs " + file.string() + ": no directory " +
                     parent.string());
  }
  if (!replaceable(file)) {  // read first (a pipe: until a writer comes), then renamed over
    throw UsageError("sweep: --save-path-costs " + file.string() +
                     " is not a file (a device or pipe)");
  }
  const PathCosts built_in = PathCosts::measured_with(PathCosts::this_cpus_bf16_unit());
  return fs::exists(file) ? PathCosts::read(file, built_in) : built_in;
}

int run_sweep(const SweepOptions& o) {
  const std::vector<double> sparsities = parse_sparsities(o.sparsities);
  parse_shape(o.shape);  // refuse a bad shape before anything else
  if (o.out_dir.empty()) throw UsageError("sweep: --out must name a directory");
  // Fail before minutes of measuring when the results could not be written. The path fit
  // starts from the file it will update, else from the costs --path auto uses.
  const PathCosts held = o.save_path_costs.empty() ? PathCosts::for_this_cpu()
                                                   : path_costs_to_update(o.save_path_costs);
  create_output_directory(o.out_dir);

  std::vector<MeasuredRun> runs;
  Sweep s = measure(o, sparsities, runs);
  s.held_path_costs = held;
  calibrate_sweep(s, runs);

  const fs::path dir = o.out_dir;
  const std::string json = to_json(s);
  write_all_atomically({{dir / "sweep.csv", to_csv(s)}, {dir / "sweep.json", json + "\n"}});
  const bool plotted = plot(s, dir);
  if (!o.save_path_costs.empty()) {
    write_atomically(o.save_path_costs,
                     with_fitted_terms(held, s.path_fit, parse_precision(s.precision)).to_json());
  }

  if (o.json) {
    std::cout << json << "\n";
  } else {
    if (s.sparse_timed) print_table(s);
    if (s.dense_timed) print_dense_path(s);
    print_crossovers(s);
    std::cout << "Wrote " << (dir / "sweep.csv").string() << ", sweep.json"
              << (plotted ? ", sweep.png" : "") << "\n";
    if (!o.save_path_costs.empty()) {
      std::cout << "Wrote the fitted " << s.precision << " path costs into " << o.save_path_costs
                << " (SLUICE_PATH_COSTS=" << o.save_path_costs << " makes --path auto use them)\n";
    }
  }
  return 0;
}

}  // namespace

Command add_sweep_command(CLI::App& app) {
  auto o = std::make_shared<SweepOptions>();
  CLI::App* cmd = app.add_subcommand(
      "sweep",
      "Measure the streamed layer over sparsities vs oneDNN dense, calibrate the cost model, "
      "and compare measured with predicted acceleration");
  cmd->add_option("--shape", o->shape, "OUTxIN of the random weights")->capture_default_str();
  cmd->add_option("--tokens", o->tokens, "Tokens (columns of X)")
      ->check(number_range(1, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Threads (default: all cores)")
      ->check(number_range(1, 4096));
  cmd->add_option("--sparsities", o->sparsities, "Comma-separated sparsities in [0, 1)")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed for W, X and values")->capture_default_str();
  cmd->add_option("--repeat", o->repeat, "Timed repetitions per point (median, after a warm-up)")
      ->check(number_range(1, 100000))
      ->capture_default_str();
  cmd->add_flag("--training", o->training,
                "Time a training step (forward + backward dX + weight gradient) against dense "
                "forward + two backward products");
  cmd->add_option(
         "--out", o->out_dir,
         "Directory for sweep.csv, sweep.json and sweep.png (plot when gnuplot is on PATH)")
      ->capture_default_str()
      ->check(path_argument());
  cmd->add_option("--path", o->path,
                  "Which path each point is timed on: sparse (the streamed product, which "
                  "calibrates its cost model), dense (the engine's dense path) or both; the "
                  "dense points fit PathCosts' densifying terms and the crossover")
      ->check(CLI::IsMember({"sparse", "dense", "both"}))
      ->capture_default_str();
  cmd->add_option("--precision", o->precision,
                  "fp32, or bf16 (weights streamed and the dense baselines in bf16)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--save-path-costs", o->save_path_costs,
                  "Write the path costs fitted for --precision into this file (its other terms "
                  "kept, or this CPU's built-in ones for a new file); SLUICE_PATH_COSTS=FILE "
                  "then makes --path auto choose by them")
      ->check(path_argument());
  cmd->add_flag("--json", o->json, "Print JSON on stdout instead of a table");
  return [o] { return run_sweep(*o); };
}

}  // namespace sluice::cli
