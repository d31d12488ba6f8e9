// sluice predict: the cost model with the wafer-scale system's published parameters.
// Acceleration vs sparsity for the GPT-3 family on one and sixteen engines, each engine
// holding the tokens its memory can (the activation bytes assumed are printed), the
// saturation that Amdahl's law puts on every configuration, and (--scaling) time per
// training step vs cluster size.
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "core/excerpt.hpp"
#include "json_writer.hpp"
#include "number_options.hpp"
#include "output_files.hpp"
#include "sluice/cost_model.hpp"
#include "sluice/error.hpp"

namespace sluice::cli {
namespace {

namespace fs = std::filesystem;

struct PredictOptions {
  std::string system = "wse2";
  bool scaling = false;
  bool json = false;
  std::string out_dir;
  double scaling_sparsity = 0.9;
  ActivationMemory activations;
};

struct ScalingSeries {
  TransformerShape shape;
  std::vector<ClusterStepPrediction> points;
};

struct Prediction {
  WaferSystem system;
  std::vector<AccelerationCurve> curves;
  ActivationMemory activations;
  AccelerationCurve gpt3_single;   // GPT-3 175B, one engine: the headline saturation
  AccelerationCurve gpt3_cluster;  // GPT-3 175B, sixteen engines
  double nnz_per_row = 0;
  std::vector<ScalingSeries> scaling;
};

constexpr std::int32_t kCurveEngines[] = {1, kSeedClusterEngines};

/// Model sizes of the scaling figure: GPT-3 XL, 13B, 175B, and a 1T-parameter model with
/// GPT-3's aspect ratio family (d_model 25600, 128 layers: 12 * 128 * 25600^2 = 1.0e12).
std::vector<TransformerShape> scaling_shapes() {
  return {{"GPT-3 XL 1.3B", 24, 2048},
          {"GPT-3 13B", 40, 5120},
          gpt3_175b(),
          {"1T (hypothetical)", 128, 25600}};
}

std::vector<std::int32_t> engine_counts() {
  std::vector<std::int32_t> counts;
  for (std::int32_t n = 1; n <= 1024; n *= 2) counts.push_back(n);
  return counts;
}

Prediction predict(const PredictOptions& options) {
  Prediction p;
  p.system = WaferSystem::wse2();
  p.activations = options.activations;
  const auto sparsities = standard_sparsities();
  const KaplanScaling kaplan;
  for (const auto& shape : gpt3_family())
    for (const std::int32_t engines : kCurveEngines)
      p.curves.push_back(
          wafer_ffn_acceleration(p.system, shape, engines, sparsities, kaplan, p.activations));
  p.gpt3_single =
      wafer_ffn_acceleration(p.system, gpt3_175b(), 1, sparsities, kaplan, p.activations);
  p.gpt3_cluster = wafer_ffn_acceleration(p.system, gpt3_175b(), kSeedClusterEngines, sparsities,
                                          kaplan, p.activations);
  p.nnz_per_row = p.system.nnz_per_engine_row(4 * 12288, 12288, 0.9);
  if (options.scaling) {
    for (const auto& shape : scaling_shapes())
      p.scaling.push_back({shape, predict_cluster_scaling(p.system, shape, options.scaling_sparsity,
                                                          engine_counts(), kaplan, p.activations)});
  }
  return p;
}

// ---- text --------------------------------------------------------------------------

std::string fixed(double value, int width, int precision) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%*.*f", width, precision, value);
  return buffer;
}

std::string general(double value, int width) {
  char buffer[64];
  if (std::abs(value) >= 100 && std::abs(value) < 1e7)
    std::snprintf(buffer, sizeof buffer, "%*.0f", width, value);
  else
    std::snprintf(buffer, sizeof buffer, "%*.3g", width, value);
  return buffer;
}

void print_text(const Prediction& p, const PredictOptions& options) {
  const WaferSystem& s = p.system;
  std::ostream& out = std::cout;
  out << "System " << s.name << " — parameters and sources\n";
  for (const auto& [name, v] : s.parameters())
    out << "  " << name << std::string(name.size() < 27 ? 27 - name.size() : 1, ' ')
        << general(v.value, 10) << " " << v.unit << "  [" << v.source << "]\n";
  out << "Consistency of the peak: one fp32 FMAC per core per cycle gives "
      << general(s.fp32_scalar_peak_flops() / 1e15, 0) << " PFLOP/s; 3.4M FPUs at "
      << general(s.clock_hz.value / 1e9, 0) << " GHz give " << general(s.fpu_peak_flops() / 1e15, 0)
      << "; the published " << general(s.peak_flops.value / 1e15, 0) << " needs "
      << fixed(s.token_lanes_per_core_cycle(), 0, 2)
      << " token-lane FMACs per core per cycle at this clock (or every FPU at "
      << fixed(s.clock_for_peak_from_fpus() / 1e9, 0, 3) << " GHz). The model uses the derived "
      << "rate, so dense on the engine equals the dense baseline.\n\n";

  out << "Acceleration over dense (" << general(s.peak_flops.value / 1e15, 0)
      << " PFLOP/s) of the FFN up-projection (4 d_model x d_model); each engine holds\n"
      << "Kaplan's critical batch / engines tokens, at most what its "
      << general(s.memory_bytes.value / 1e9, 0) << " GB hold: activations of "
      << general(p.activations.bytes_per_token_layer_per_d_model, 0)
      << " bytes per token, layer and d_model\n(--activation-bytes; 2: each layer's 16-bit input "
         "kept, the rest recomputed; 34: Korthikanti et al. 2022, only attention scores "
         "recomputed). Columns: sparsity.\n";
  out << "d_model engines  tokens/eng  act_GB  geometry  ";
  for (const double sp : standard_sparsities()) {
    char header[32];
    std::snprintf(header, sizeof header, "%7g", sp);
    out << header;
  }
  out << "  saturation\n";
  for (const auto& c : p.curves) {
    out << general(static_cast<double>(c.d_model), 7) << general(c.engines, 8)
        << fixed(static_cast<double>(c.tokens_per_engine), 12, 0)
        << fixed(c.activation_bytes / 1e9, 8, 1) << "  "
        << (std::to_string(c.geometry.lanes) + "x" + std::to_string(c.geometry.blocks));
    const auto geometry_width =
        std::to_string(c.geometry.lanes).size() + std::to_string(c.geometry.blocks).size() + 1;
    out << std::string(geometry_width < 9 ? 9 - geometry_width : 1, ' ');
    for (const double a : c.accelerations) out << general(a, 7);
    out << general(c.saturation, 12) << "\n";
  }
  out << "\nNon-zeros per engine row, GPT-3 FFN 12288 x 49152 (604M values) at 90% sparsity: "
      << fixed(p.nnz_per_row, 0, 0) << " (" << p.system.geometry_for(12288, 1).lanes << " rows)\n";
  out << "Saturation (sparsity -> 1), GPT-3 175B FFN: " << general(p.gpt3_single.saturation, 0)
      << "x on one engine (" << p.gpt3_single.tokens_per_engine << " tokens of a "
      << general(p.gpt3_single.batch_tokens, 0) << "-token batch at once, "
      << general(p.gpt3_single.activation_bytes_per_token_layer / 1e3, 0)
      << " kB per token and layer), " << general(p.gpt3_cluster.saturation, 0)
      << "x per engine of a " << kSeedClusterEngines << "-engine cluster\n";
  out << "  ~ d_model * tokens per engine / (cores * " << general(s.partial_sum_cycles.value, 0)
      << " partial-sum cycles * " << fixed(s.token_lanes_per_core_cycle(), 0, 2)
      << " token lanes): Amdahl's serial fraction is the per-output partial sum.\n";

  if (!p.scaling.empty()) {
    out << "\nTraining step time vs engines at sparsity " << options.scaling_sparsity
        << " (critical batch shared out; SwarmX tree, MemoryX streaming included)\n";
    for (const auto& series : p.scaling) {
      out << series.shape.name << " (d_model " << series.shape.d_model << ", "
          << series.shape.n_layers << " layers, batch "
          << fixed(KaplanScaling{}.critical_batch_tokens(series.shape), 0, 0) << " tokens)\n";
      out << "  engines   step_s    speedup  compute_s  stream_s  tokens/eng  micro_batches\n";
      for (const auto& pt : series.points)
        out << general(pt.engines, 9) << general(pt.step_seconds, 9) << general(pt.speedup, 11)
            << general(pt.compute_seconds, 11) << general(pt.stream_seconds, 10)
            << general(static_cast<double>(pt.tokens_per_engine), 12)
            << general(static_cast<double>(pt.micro_batches), 15) << "\n";
    }
  }
}

// ---- JSON --------------------------------------------------------------------------

/// `key`: an array of one object per item, its fields written by fields(item).
template <typename Items, typename Fields>
void write_objects(JsonWriter& w, const char* key, const Items& items, Fields&& fields) {
  w.key(key).begin_array();
  for (const auto& item : items) {
    w.begin_object();
    fields(item);
    w.end_object();
  }
  w.end_array();
}

std::string to_json(const Prediction& p) {
  JsonWriter w(2);
  w.begin_object();
  write_objects(w, "curves", p.curves, [&](const auto& c) {
    w.field("d_model", c.d_model);
    w.field("engines", c.engines);
    w.field("tokens_per_engine", c.tokens_per_engine);
    w.field("token_capacity", c.token_capacity);
    w.field("batch_tokens", c.batch_tokens);
    w.field("activation_bytes", c.activation_bytes);
    w.field("activation_bytes_per_token_layer", c.activation_bytes_per_token_layer);
    w.field("saturation", c.saturation);
    // By index: the two arrays side by side (no std::views::iota, which clang cannot
    // compile against GCC 12's <ranges>, as the fuzz build does).
    w.key("points").begin_array();
    for (std::size_t i = 0; i < c.sparsities.size(); ++i) {
      w.begin_object();
      w.field("sparsity", c.sparsities[i]);
      w.field("acceleration", c.accelerations[i]);
      w.end_object();
    }
    w.end_array();
  });
  // The headline: the largest model on one engine.
  w.field("saturation_acceleration", p.gpt3_single.saturation);
  w.field("saturation_acceleration_cluster", p.gpt3_cluster.saturation);
  w.field("activation_bytes_per_token_layer_per_d_model",
          p.activations.bytes_per_token_layer_per_d_model);
  w.field("nnz_per_engine_row_gpt3_ffn_90", p.nnz_per_row);
  if (!p.scaling.empty()) {
    write_objects(w, "scaling", p.scaling, [&](const auto& series) {
      w.field("d_model", series.shape.d_model);
      write_objects(w, "points", series.points, [&](const auto& pt) {
        w.field("engines", pt.engines);
        w.field("step_seconds", pt.step_seconds);
        w.field("speedup", pt.speedup);
        w.field("tokens_per_engine", pt.tokens_per_engine);
        w.field("micro_batches", pt.micro_batches);
      });
    });
  }
  w.end_object();
  return w.str();
}

// ---- files and plots ---------------------------------------------------------------

std::string curve_column(const AccelerationCurve& c) {
  return "d" + std::to_string(c.d_model) + "_" + std::to_string(c.engines) + "engine";
}

/// Wide CSV: one row per sparsity, one column per (d_model, engines) curve; ordered as
/// p.curves with the one-engine curves first so the plot can split them.
std::string acceleration_csv(const Prediction& p, std::vector<std::size_t>& order) {
  order.clear();
  for (const std::int32_t engines : kCurveEngines)
    for (std::size_t i = 0; i < p.curves.size(); ++i)
      if (p.curves[i].engines == engines) order.push_back(i);
  std::ostringstream csv;
  csv << "sparsity,density_reduction";
  for (const std::size_t i : order) csv << "," << curve_column(p.curves[i]);
  csv << "\n";
  const auto sparsities = standard_sparsities();
  for (std::size_t k = 0; k < sparsities.size(); ++k) {
    csv << json_number(sparsities[k]) << "," << json_number(1.0 / (1.0 - sparsities[k]));
    for (const std::size_t i : order) csv << "," << json_number(p.curves[i].accelerations[k]);
    csv << "\n";
  }
  return csv.str();
}

std::string saturation_csv(const Prediction& p) {
  std::ostringstream csv;
  csv << "d_model,engines,tokens_per_engine,lanes,blocks,saturation_acceleration\n";
  for (const auto& c : p.curves)
    csv << c.d_model << "," << c.engines << "," << c.tokens_per_engine << "," << c.geometry.lanes
        << "," << c.geometry.blocks << "," << json_number(c.saturation) << "\n";
  return csv.str();
}

/// Wide CSV: engines, then the speedup of each model, then its step time.
std::string scaling_csv(const Prediction& p) {
  std::ostringstream csv;
  csv << "engines";
  for (const auto& s : p.scaling) csv << ",speedup_d" << s.shape.d_model;
  for (const auto& s : p.scaling) csv << ",step_seconds_d" << s.shape.d_model;
  csv << "\n";
  const std::size_t rows = p.scaling.empty() ? 0 : p.scaling.front().points.size();
  for (std::size_t r = 0; r < rows; ++r) {
    csv << p.scaling.front().points[r].engines;
    for (const auto& s : p.scaling) csv << "," << json_number(s.points[r].speedup);
    for (const auto& s : p.scaling) csv << "," << json_number(s.points[r].step_seconds);
    csv << "\n";
  }
  return csv.str();
}

/// Runs gnuplot on the CSVs; PNGs appear only when gnuplot succeeded (tmp + rename).
void plot(const Prediction& p, const fs::path& dir, std::size_t curves_per_panel) {
  std::vector<PlotFile> outputs;
  std::ostringstream gp;
  gp << "set datafile separator ','\n"
     << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo size 1400,560 } "
        "else { set terminal png size 1400,560 }\n"
     << "set termoption noenhanced\nset logscale xy\nset grid\nset key top left\n";
  {
    const PlotFile o = plot_file(dir, "acceleration.png");
    outputs.push_back(o);
    const std::string csv = gnuplot_quote((dir / "acceleration.csv").string());
    const std::size_t first = 3, split = first + curves_per_panel;
    gp << "set output " << gnuplot_quote(o.tmp_path.string()) << "\n"
       << "set multiplot layout 1,2 title 'Predicted acceleration over dense, " << p.system.name
       << " (Amdahl: per-output partial sums)'\n"
       << "set xlabel '1 / (1 - sparsity)'\nset ylabel 'acceleration'\n"
       << "set xrange [1:20000]\nset yrange [0.5:*]\n"
       << "set title '1 engine'\n"
       << "plot for [i=" << first << ":" << split - 1 << "] " << csv
       << " using 2:i with linespoints title columnheader(i)\n"
       << "set title '" << kSeedClusterEngines << " engines (batch / " << kSeedClusterEngines
       << " per engine)'\n"
       << "plot for [i=" << split << ":" << split + curves_per_panel - 1 << "] " << csv
       << " using 2:i with linespoints title columnheader(i)\n"
       << "unset multiplot\nset output\n";
  }
  if (!p.scaling.empty()) {
    const PlotFile o = plot_file(dir, "scaling.png");
    outputs.push_back(o);
    const std::string csv = gnuplot_quote((dir / "scaling.csv").string());
    gp << "set output " << gnuplot_quote(o.tmp_path.string()) << "\n"
       << "set title 'Predicted cluster scaling (time per step), " << p.system.name << "'\n"
       << "set xlabel 'engines'\nset ylabel 'speedup over one engine'\nset logscale x 2\n"
       << "set autoscale\nset xrange [1:1024]\n"
       << "plot x title 'linear' with lines dashtype 2 lc rgb 'gray', for [i=2:"
       << 1 + p.scaling.size() << "] " << csv
       << " using 1:i with linespoints title columnheader(i)\nset output\n";
  }
  run_gnuplot(gp.str(), dir, outputs, "sluice predict");
}

void write_outputs(const Prediction& p, const fs::path& dir) {
  create_output_directory(dir);
  std::vector<std::size_t> order;
  std::vector<std::pair<fs::path, std::string>> files{
      {dir / "acceleration.csv", acceleration_csv(p, order)},
      {dir / "saturation.csv", saturation_csv(p)}};
  if (!p.scaling.empty()) files.emplace_back(dir / "scaling.csv", scaling_csv(p));
  write_all_atomically(files);
  plot(p, dir, order.size() / std::size(kCurveEngines));
}

int run_predict(const PredictOptions& options) {
  if (options.system != "wse2")
    throw UsageError("predict: unknown --system " + detail::excerpt(options.system) +
                     " (known: wse2)");
  if (!(options.scaling_sparsity >= 0 && options.scaling_sparsity < 1))
    throw UsageError("predict: --scaling-sparsity must be in [0, 1)");
  const Prediction p = predict(options);
  if (!options.out_dir.empty()) write_outputs(p, options.out_dir);
  if (options.json) {
    std::cout << to_json(p) << "\n";
  } else {
    print_text(p, options);
    if (!options.out_dir.empty()) std::cout << "\nWrote CSV files to " << options.out_dir << "\n";
  }
  return 0;
}

}  // namespace

Command add_predict_command(CLI::App& app) {
  auto options = std::make_shared<PredictOptions>();
  CLI::App* sub = app.add_subcommand(
      "predict", "Predict wafer-scale acceleration vs sparsity and cluster scaling (cost model)");
  sub->add_option("--system", options->system, "System parameters to use (wse2)")
      ->capture_default_str();
  CLI::Option* scaling =
      sub->add_flag("--scaling", options->scaling,
                    "Also predict time per training step vs number of engines (1..1024)");
  sub->add_option("--scaling-sparsity", options->scaling_sparsity,
                  "Weight sparsity of the scaling prediction")
      ->needs(scaling)  // alone it would change nothing
      ->capture_default_str();
  sub->add_option("--activation-bytes", options->activations.bytes_per_token_layer_per_d_model,
                  "Activation bytes an engine holds per token, layer and d_model (2: each "
                  "layer's 16-bit input kept, the rest recomputed in backward, which GPT-3 needs "
                  "to hold one sequence in 40 GB; 34: Korthikanti et al. 2022, only the "
                  "attention scores recomputed)")
      ->check(number_range(0.001, 1e6))
      ->capture_default_str();
  sub->add_flag("--json", options->json, "Print JSON instead of tables");
  sub->add_option("--out", options->out_dir,
                  "Directory for CSV files (and PNG plots when gnuplot is on PATH)")
      ->check(path_argument());
  return [options] { return run_predict(*options); };
}

}  // namespace sluice::cli
