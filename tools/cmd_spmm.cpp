// `sluice spmm`: the streamed sparse forward (and backward) against oneDNN's dense product
// on the same operands, in the same precision and the fastest of any, over one sparsity
// or a sweep.
#include <cstdio>
#include <iostream>
#include <optional>

#include "dense_baseline.hpp"
#include "json_writer.hpp"
#include "measure.hpp"
#include "number_options.hpp"
#include "reference.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/path_cost.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"
#include "sluice/topology.hpp"

namespace sluice::cli {
namespace {

struct SpmmOptions {
  std::string matrix;
  std::string shape = "4096x4096";
  std::string sparsity;
  std::string distribution = "uniform";
  std::int64_t tokens = 256;
  int threads = 0;
  int repeat = 5;
  std::uint64_t seed = 1;
  bool check = false;
  bool json = false;
  bool backward = false;
  std::string backward_order = "auto";
  std::string precision = "fp32";
  std::string path = "auto";
  Geometry geometry;
};

struct SpmmResult {
  std::string matrix;  ///< the --matrix file; empty for a random W
  std::int64_t out = 0, in = 0, tokens = 0, nnz = 0;
  double sparsity = 0;
  int threads = 0;
  std::string isa, geometry, precision;
  std::string path, backward_path;  ///< the path the engine took: sparse or dense
  std::string backward_order;       ///< by_input or by_output (what --backward-order took)
  double sparse_ms = 0, dense_ms = 0, prepare_ms = 0, balance = 1;
  // dense_ms is oneDNN's matmul in the same precision; the best is the fastest of any.
  std::string dense_kind, dense_best_kind, backward_dense_best_kind;
  double dense_best_ms = 0, backward_dense_best_ms = 0;
  std::optional<double> max_rel_error;
  // --backward
  double backward_ms = 0, bwd_data_ms = 0, bwd_weight_ms = 0, dense_backward_ms = 0;
  std::optional<double> max_rel_error_bwd;

  double useful_gflops() const { return 2.0 * nnz * tokens / (sparse_ms * 1e6); }
  double acceleration() const { return dense_ms / sparse_ms; }
  double acceleration_vs_best() const { return dense_best_ms / sparse_ms; }
};

// --check fails above this relative error (per output, relative to sum |w x|, as the test
// suite checks): rounding gives ~1e-7 here, one lost or wrong term about 1/K of the sum.
constexpr double kCheckTolerance = 1e-5;

/// Whether the engine measure() makes for `o` multiplies the layer on its dense path.
bool takes_dense_path(const SpmmOptions& o, std::int64_t outputs, std::int64_t inputs, double nnz) {
  return cli::takes_dense_path(parse_product_path(o.path), outputs, inputs, nnz, o.tokens,
                               parse_precision(o.precision), o.threads);
}

SpmmResult measure(const CsrMatrix& w, const SpmmOptions& o) {
  EngineOptions eo;
  eo.threads = o.threads;
  eo.geometry = o.geometry;
  eo.path = parse_product_path(o.path);
  CpuEngine engine(eo);
  baseline::set_dense_threads(engine.threads());
  const DenseMatrix x = testing::random_dense(w.cols(), o.tokens, o.seed + 101);
  DenseMatrix y(w.rows(), o.tokens);

  SpmmResult r;
  r.matrix = o.matrix;
  r.out = w.rows();
  r.in = w.cols();
  r.tokens = o.tokens;
  r.nnz = w.nnz();
  r.sparsity = w.sparsity();
  r.threads = engine.threads();
  r.isa = to_string(engine.isa());
  const Precision precision = parse_precision(o.precision);
  r.precision = o.precision;
  // The geometry the products below run with (the non-zeros decide some of it).
  const Geometry g = engine.geometry_for(w.rows(), w.cols(), o.tokens, precision, w.nnz());
  r.geometry = g.to_string();
  // A bf16 product is checked against float64 on the operands rounded as the engine holds
  // them (W streamed in bf16; X resident in bf16 where lanes pack their rows for more
  // than one token, else fp32; dY likewise in the backward by input), so the check still
  // catches kernel
  // bugs at fp32 tolerances.
  const bool bf16 = precision == Precision::bf16;
  // The dense path holds every activation in bf16.
  const bool dense_forward = engine.path_for(stream_header_for(w, StreamKind::weights, precision),
                                             o.tokens) == ProductPath::dense;
  const bool x_in_bf16 =
      bf16 && (dense_forward || CpuEngine::holds_bf16(g.lanes, w.nnz(), w.cols(), o.tokens));
  // The operands rounded as the engine holds them are for --check alone (each as large as
  // W or X).
  const bool rounded = bf16 && o.check;
  const CsrMatrix w_held = rounded ? testing::rounded_to_bf16(w) : CsrMatrix();
  const CsrMatrix& w_ref = rounded ? w_held : w;
  const DenseMatrix x_held =
      rounded && x_in_bf16 ? testing::rounded_to_bf16(x.view()) : DenseMatrix();
  const ConstMatrixView x_ref = rounded && x_in_bf16 ? x_held.view() : x.view();
  // By input the lane holds dY (in bf16 where it packs the rows) and reads X in place, in
  // fp32.
  // auto: by input where the layer can be streamed so, as training decides.
  const bool by_input =
      o.backward_order == "by_input" ||
      (o.backward_order == "auto" && streams_by_input(w.rows(), w.nnz(), precision));
  const bool dense_backward =
      engine.path_for(stream_header_for(w, StreamKind::weights, precision,
                                        by_input ? StreamOrder::by_input : StreamOrder::by_output),
                      o.tokens) == ProductPath::dense;
  const bool x_rounded_bwd = rounded && dense_backward;
  const DenseMatrix x_held_bwd = x_rounded_bwd ? testing::rounded_to_bf16(x.view()) : DenseMatrix();
  const ConstMatrixView x_ref_bwd = x_rounded_bwd ? x_held_bwd.view() : by_input ? x.view() : x_ref;
  const bool dy_in_bf16 =
      bf16 &&
      (dense_backward || (by_input && CpuEngine::holds_bf16(1, w.nnz(), w.rows(), o.tokens)));

  // Preparing the layer (planning + encoding the streams) happens in ModelMemory, so it is
  // reported apart from the products. The backward reads the layer by input, as training
  // does (`--backward-order by_output`: the wafer's own order, dX scattered).
  const StreamOrder backward_order = by_input ? StreamOrder::by_input : StreamOrder::by_output;
  WeightStream stream, backward_stream;
  Placement placement;
  r.prepare_ms =
      1e3 * median_seconds(
                [&] {
                  placement = round_robin_placement(w, g.lanes);
                  stream = encode_stream(w, StreamKind::weights, kDefaultChunkPackets, precision);
                  if (o.backward) {
                    backward_stream = encode_stream(w, StreamKind::weights, kDefaultChunkPackets,
                                                    precision, backward_order);
                  }
                },
                1);
  r.balance = placement.balance();
  r.path = to_string(engine.path_for(stream.header, o.tokens));
  if (o.backward) {
    r.backward_path = to_string(engine.path_for(backward_stream.header, o.tokens));
    r.backward_order = to_string(backward_order);
  }
  // The engine's products are timed in turn, round by round (see
  // median_seconds_interleaved), so backward/forward holds even while the machine's
  // speed drifts. oneDNN's are timed apart: its OpenMP threads spin after each call and
  // would slow the engine's next one on a small machine.
  const DenseMatrix dy =
      o.backward ? testing::random_dense(w.rows(), o.tokens, o.seed + 202) : DenseMatrix();
  DenseMatrix dx(o.backward ? w.cols() : 0, o.tokens);
  MutableMatrixView dx_view = dx.view();
  const WeightStream mask =
      o.backward ? encode_stream(w, StreamKind::mask, kDefaultChunkPackets, precision)
                 : WeightStream();
  WeightStream grad;
  std::vector<std::function<void()>> products{
      [&] { engine.forward(stream, placement, x.view(), y.view()); }};
  if (o.backward) {
    // Both gradients, as a training step takes them; dX alone; dW alone from the mask, as
    // the first layer takes it.
    products.emplace_back(
        [&] { grad = engine.backward(backward_stream, placement, x.view(), dy.view(), &dx_view); });
    products.emplace_back(
        [&] { engine.backward_data(backward_stream, placement, dy.view(), dx_view); });
    products.emplace_back([&] { engine.backward(mask, placement, x.view(), dy.view(), nullptr); });
  }
  const std::vector<double> ms = median_seconds_interleaved(products, o.repeat);
  r.sparse_ms = 1e3 * ms[0];
  const DenseMatrix w_dense = w.to_dense();
  DenseMatrix y_dense(w.rows(), o.tokens);
  const baseline::DenseTiming dense = baseline::time_dense(
      {{w_dense.view(), false, x.view(), false, y_dense.view()}}, precision, o.repeat);
  r.dense_ms = dense.same_ms;
  r.dense_kind = baseline::to_string(dense.same_kind);
  r.dense_best_ms = dense.best_ms;
  r.dense_best_kind = baseline::to_string(dense.best_kind);
  if (o.check) r.max_rel_error = testing::forward_error(w_ref, x_ref, y.view());

  if (o.backward) {
    r.backward_ms = 1e3 * ms[1];
    r.bwd_data_ms = 1e3 * ms[2];
    r.bwd_weight_ms = 1e3 * ms[3];
    DenseMatrix dx_dense(w.cols(), o.tokens), dw_dense(w.rows(), w.cols());
    const baseline::DenseTiming dense_bwd =
        baseline::time_dense({{w_dense.view(), true, dy.view(), false, dx_dense.view()},
                              {dy.view(), false, x.view(), true, dw_dense.view()}},
                             precision, o.repeat);
    r.dense_backward_ms = dense_bwd.same_ms;
    r.backward_dense_best_ms = dense_bwd.best_ms;
    r.backward_dense_best_kind = baseline::to_string(dense_bwd.best_kind);
    if (o.check) {
      const DenseMatrix dy_held = dy_in_bf16 ? testing::rounded_to_bf16(dy.view()) : DenseMatrix();
      const ConstMatrixView dy_ref = dy_in_bf16 ? dy_held.view() : dy.view();
      r.max_rel_error_bwd = std::max(
          testing::backward_data_error(w_ref, dy_ref, dx.view()),
          testing::backward_weight_error(w, dy_ref, x_ref_bwd, testing::csr_gradient(grad)));
    }
  }
  return r;
}

void write_json(JsonWriter& j, const SpmmResult& r, bool backward) {
  j.begin_object();
  j.key("matrix");  // which file a script's many runs measured (null: a random W)
  r.matrix.empty() ? j.null() : j.value(r.matrix);
  j.field("out", r.out).field("in", r.in).field("tokens", r.tokens).field("nnz", r.nnz);
  j.field("sparsity", r.sparsity).field("threads", r.threads).field("isa", r.isa);
  j.field("precision", r.precision).field("path", r.path);
  j.field("path_costs", PathCosts::this_cpus_origin());
  j.field("geometry", r.geometry).field("sparse_ms", r.sparse_ms).field("dense_ms", r.dense_ms);
  j.field("prepare_ms", r.prepare_ms).field("useful_gflops", r.useful_gflops());
  j.field("acceleration", r.acceleration()).field("balance", r.balance);
  j.field("dense_kind", r.dense_kind).field("dense_best_ms", r.dense_best_ms);
  j.field("dense_best_kind", r.dense_best_kind);
  j.field("acceleration_vs_best", r.acceleration_vs_best());
  j.key("max_rel_error");
  r.max_rel_error ? j.value(*r.max_rel_error) : j.null();
  if (backward) {
    j.field("backward_ms", r.backward_ms).field("bwd_data_ms", r.bwd_data_ms);
    j.field("bwd_weight_ms", r.bwd_weight_ms).field("dense_backward_ms", r.dense_backward_ms);
    j.field("backward_acceleration", r.dense_backward_ms / r.backward_ms);
    j.field("backward_dense_ms", r.dense_backward_ms).field("backward_path", r.backward_path);
    j.field("backward_order", r.backward_order);
    j.field("backward_dense_best_ms", r.backward_dense_best_ms);
    j.field("backward_dense_best_kind", r.backward_dense_best_kind);
    j.field("backward_acceleration_vs_best", r.backward_dense_best_ms / r.backward_ms);
    j.key("max_rel_error_bwd");
    r.max_rel_error_bwd ? j.value(*r.max_rel_error_bwd) : j.null();
  }
  // An affinity mask (taskset, mpirun's binding) that leaves fewer CPUs than the machine
  // lets this process have limits the threads: said, so a slow run is not a mystery.
  j.field("cpus_allowed", process_cpus())
      .field("affinity_limited", process_cpus() < allowed_cpus());
  j.field("peak_rss_bytes", peak_resident_bytes());
  j.end_object();
}

void print_table(const std::vector<SpmmResult>& results, bool backward, bool check) {
  const SpmmResult& first = results.front();
  std::printf(
      "sluice spmm: %s%s%lld x %lld weights, %lld tokens, %d threads, ISA %s, %s, geometry %s\n",
      first.matrix.c_str(), first.matrix.empty() ? "" : ": ", static_cast<long long>(first.out),
      static_cast<long long>(first.in), static_cast<long long>(first.tokens), first.threads,
      first.isa.c_str(), first.precision.c_str(), first.geometry.c_str());
  if (process_cpus() < allowed_cpus()) {
    std::printf("affinity mask: this process may run on %d of the %d CPUs it is allowed\n",
                process_cpus(), allowed_cpus());
  }
  std::printf("path (sparse: streamed; dense: densified tiles, oneDNN matmul; costs %s):",
              PathCosts::this_cpus_origin().c_str());
  for (const SpmmResult& r : results) {
    std::printf(" %s", r.path.c_str());
    if (backward) std::printf("/%s", r.backward_path.c_str());
  }
  std::printf("\n");
  std::printf("dense: %s in the same precision; best: the fastest oneDNN product of any\n",
              first.dense_kind.c_str());
  std::printf("%9s %10s %10s %10s %9s %8s %10s %8s %8s", "sparsity", "nnz", "sparse_ms", "dense_ms",
              "GFLOP/s", "accel", "best_ms", "vs_best", "balance");
  if (check) std::printf(" %9s", "rel_err");
  if (backward)
    std::printf(" %10s %9s %9s %10s %7s %10s %8s", "bwd_ms", "bwd_dX", "bwd_dW", "dense_bwd",
                "accel", "best_bwd", "vs_best");
  if (backward && check) std::printf(" %9s", "err_bwd");
  std::printf("\n");
  for (const SpmmResult& r : results) {
    std::printf("%9.4f %10lld %10.3f %10.3f %9.1f %7.2fx %10.3f %7.2fx %8.3f", r.sparsity,
                static_cast<long long>(r.nnz), r.sparse_ms, r.dense_ms, r.useful_gflops(),
                r.acceleration(), r.dense_best_ms, r.acceleration_vs_best(), r.balance);
    if (check) std::printf(" %9.2e", *r.max_rel_error);
    if (backward) {
      std::printf(" %10.3f %9.3f %9.3f %10.3f %6.2fx %10.3f %7.2fx", r.backward_ms, r.bwd_data_ms,
                  r.bwd_weight_ms, r.dense_backward_ms, r.dense_backward_ms / r.backward_ms,
                  r.backward_dense_best_ms, r.backward_dense_best_ms / r.backward_ms);
    }
    if (backward && check) std::printf(" %9.2e", *r.max_rel_error_bwd);
    std::printf("\n");
  }
}

}  // namespace

Command add_spmm_command(CLI::App& app) {
  auto o = std::make_shared<SpmmOptions>();
  CLI::App* cmd = app.add_subcommand(
      "spmm",
      "Time the streamed sparse product against oneDNN's dense product on the same W and X");
  auto* matrix = cmd->add_option("--matrix", o->matrix,
                                 "Weight mask/matrix file (.smtx or .mtx, gzip'd or not)");
  auto* shape = cmd->add_option("--shape", o->shape, "OUTxIN of a random W (default 4096x4096)");
  auto* sparsity = cmd->add_option(
      "--sparsity", o->sparsity,
      "Sparsity of a random W, or a comma-separated list (default: a sweep 0 ... 0.999)");
  auto* distribution = cmd->add_option("--distribution", o->distribution,
                                       "Row counts of a random W: uniform or powerlaw")
                           ->check(CLI::IsMember({"uniform", "powerlaw"}));
  matrix->excludes(shape)->excludes(sparsity)->excludes(distribution);
  cmd->add_option("--tokens", o->tokens, "Tokens (columns of X)")->check(number_range(1, 1 << 24));
  cmd->add_option("--threads", o->threads, "Threads (default: all cores)")
      ->check(number_range(1, 4096));
  cmd->add_option("--repeat", o->repeat, "Timed repetitions (median)")
      ->check(number_range(1, 100000));
  cmd->add_option("--seed", o->seed, "Seed for W, X and values");
  cmd->add_option("--lanes", o->geometry.lanes, "Engine lanes P (default: chosen)")
      ->check(number_range(1, 4096));
  cmd->add_option("--blocks", o->geometry.blocks, "Token blocks Q (default: chosen)")
      ->check(number_range(1, 4096));
  cmd->add_option("--tile", o->geometry.tile_tokens, "Tokens per tile (default: chosen)")
      ->check(number_range(1, 1 << 20));
  cmd->add_option("--shares", o->geometry.shares,
                  "Stream shares S: the chunks split among S groups of threads (default: "
                  "chosen, > 1 only for a batch too small to split by tokens)")
      ->check(number_range(1, 4096));
  cmd->add_option("--precision", o->precision,
                  "fp32, or bf16: weights streamed and activations held in bf16, fp32 sums")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--path", o->path,
                  "auto (the cost model's choice per layer), sparse (streamed) or dense "
                  "(packets densified into tiles, oneDNN's matmul)")
      ->check(CLI::IsMember({"auto", "sparse", "dense"}));
  cmd->add_flag("--check", o->check,
                "Check against a float64 reference (of the bf16-rounded operands in bf16); exit "
                "code 1 if a relative error exceeds 1e-5");
  cmd->add_flag("--backward", o->backward, "Also time (and check) backward-data and -weight");
  cmd->add_option("--backward-order", o->backward_order,
                  "How the backward reads the layer: by_input (its transpose: dY gathered once "
                  "for both gradients, as training does with the model in RAM), by_output "
                  "(dX scattered, then a pass for dW), or auto (by_input where the layer can be "
                  "streamed so: a bf16 stream by input addresses 65535 outputs)")
      ->check(CLI::IsMember({"auto", "by_input", "by_output"}));
  cmd->add_flag("--json", o->json, "Print JSON on stdout instead of a table");

  return [o] {
    o->threads = runnable_threads(o->threads, "spmm");
    std::vector<SpmmResult> results;
    if (!o->matrix.empty()) {
      const CsrMatrix w = read_matrix(o->matrix, o->seed);
      // .smtx can hold an empty matrix; a product of it has nothing to time.
      if (w.rows() == 0 || w.cols() == 0) {
        throw FormatError(o->matrix + " holds a " + std::to_string(w.rows()) + "x" +
                          std::to_string(w.cols()) + " matrix: nothing to time");
      }
      check_geometry_bounds(o->geometry, w.cols(), o->tokens, o->threads);
      const auto nnz = static_cast<double>(w.nnz());
      require_dense_baseline_memory(w.rows(), w.cols(), o->backward, o->tokens, nnz,
                                    takes_dense_path(*o, w.rows(), w.cols(), nnz));
      results.push_back(measure(w, *o));
    } else {
      const auto [out, in] = parse_shape(o->shape);
      const auto distribution =
          o->distribution == "powerlaw" ? RowDistribution::powerlaw : RowDistribution::uniform;
      const std::vector<double> sparsities = parse_sparsities(
          o->sparsity.empty() ? "0,0.5,0.75,0.9,0.95,0.98,0.99,0.999" : o->sparsity);
      check_geometry_bounds(o->geometry, in, o->tokens, o->threads);
      // Every point is checked before the first W is generated, and each W is made, timed
      // and freed in turn: memory does not grow with the list.
      for (double s : sparsities) {
        const double nnz = (1.0 - s) * static_cast<double>(out) * static_cast<double>(in);
        require_dense_baseline_memory(out, in, o->backward, o->tokens, nnz,
                                      takes_dense_path(*o, out, in, nnz));
      }
      for (double s : sparsities) {
        results.push_back(measure(CsrMatrix::random(out, in, s, o->seed, distribution), *o));
      }
    }
    if (o->json) {
      JsonWriter j(2);
      if (results.size() == 1) {
        write_json(j, results[0], o->backward);
      } else {
        j.begin_object().key("runs").begin_array();
        for (const auto& r : results) write_json(j, r, o->backward);
        j.end_array().end_object();
      }
      std::cout << j.str() << "\n";
    } else {
      print_table(results, o->backward, o->check);
    }
    int failed = 0;
    for (const SpmmResult& r : results) {
      for (const auto& [error, product] :
           {std::pair{r.max_rel_error, "forward"}, std::pair{r.max_rel_error_bwd, "backward"}}) {
        if (error && !(*error <= kCheckTolerance)) {
          std::fprintf(stderr,
                       "sluice spmm: check failed at sparsity %.4f: %s relative error %.2e, "
                       "above %.0e\n",
                       r.sparsity, product, *error, kCheckTolerance);
          ++failed;
        }
      }
    }
    return failed > 0 ? 1 : 0;
  };
}

}  // namespace sluice::cli
