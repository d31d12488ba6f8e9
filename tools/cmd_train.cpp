// `sluice train`: trains a sparse MLP with the layer-streaming executor on the digits
// set, the built-in synthetic task or a CSV file, and reports accuracy and throughput.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <tuple>
#include <utility>

#include "core/excerpt.hpp"
#include "interrupt.hpp"
#include "json_writer.hpp"
#include "lr_decay_option.hpp"
#include "measure.hpp"
#include "model_budget.hpp"
#include "model_kind.hpp"
#include "model_store_option.hpp"
#include "number_options.hpp"
#include "output_files.hpp"
#include "sluice/dataset.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"
#include "train_gpt.hpp"
#include "train_options.hpp"
#include "training_data.hpp"
#ifdef SLUICE_HAVE_MPI
#include "sluice/mpi_fabric.hpp"
#endif

namespace sluice::cli {
namespace {

#ifdef SLUICE_HAVE_MPI
/// MPI for `--fabric mpi`: initialised for the command's lifetime.
struct MpiSession {
  MpiSession() {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  ~MpiSession() { MPI_Finalize(); }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank = 0, size = 1;
};
#endif

/// The sparsity of the model trained: as asked for a new one; a resumed one's masks fix
/// it, so it is read off them.
double model_sparsity(const ModelMemory& memory, const TrainOptions& o, bool resumed) {
  if (!resumed) return o.sparsity;
  double weights = 0, cells = 0;
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
    const LayerShape w = memory.layer_shape(l);
    weights += static_cast<double>(w.nnz);
    cells += static_cast<double>(w.rows) * static_cast<double>(w.cols);
  }
  return cells > 0 ? 1.0 - weights / cells : o.sparsity;
}

/// Whether --dataset `name` is one of sluice's own data sets, not a file.
bool built_in_dataset(const std::string& name) {
  return name == "digits" || name == "synthetic";
}

Dataset load_data(const TrainOptions& o, std::string& name) {
  const std::optional<std::filesystem::path> given =
      o.data.empty() ? std::nullopt : std::optional<std::filesystem::path>(o.data);
  if (o.dataset == "digits" || o.dataset == "auto") {
    const auto path = find_digits_file(given);
    if (path) {
      name = "digits";
      return load_digits(*path);
    }
    if (o.dataset == "digits") {
      throw IoError(
          "the digits file was not found: pass --data FILE or set SLUICE_DIGITS (looked in "
          "~/.local/share/sluice, /usr/local/share/sluice, /usr/share/sluice and python3-sklearn's "
          "sklearn/datasets/data/digits.csv.gz)");
    }
  }
  if (o.dataset == "synthetic" || o.dataset == "auto") {
    name = "synthetic";
    return make_synthetic_dataset(4000, 64, 10, o.seed);
  }
  name = o.dataset;
  std::error_code ec;
  if (!std::filesystem::exists(o.dataset, ec) && !ec) {  // a misspelt name, most likely
    throw IoError("cannot open " + o.dataset +
                  ": no such file (--dataset takes digits, synthetic or a CSV file)");
  }
  return load_csv(o.dataset);
}

/// Where a resumed model comes from, for messages: "checkpoint PATH" or "model store DIR".
std::string model_source(const TrainOptions& o) {
  return o.resume.empty() ? "model store " + o.store.directory : "checkpoint " + o.resume;
}

/// "classes of DATA (by name, ORDER): 'a'=0, 'b'=1, ...", the first few of a long list.
std::string class_list(const std::string& dataset_name, const std::vector<std::string>& names,
                       const std::string& order) {
  constexpr std::size_t kShown = 12;
  std::string text = "classes of " + dataset_name + " (by name, " + order + "): ";
  for (std::size_t c = 0; c < std::min(names.size(), kShown); ++c) {
    text += (c > 0 ? ", " : "") + detail::excerpt(names[c]) + "=" + std::to_string(c);
  }
  if (names.size() > kShown) text += ", ... (" + std::to_string(names.size()) + " classes)";
  return text;
}

/// The data's labels numbered by a resumed model's class names, as it learnt them: the
/// data's own sorted names would number a subset of the classes, or a superset, otherwise.
void number_as_model(Dataset& all, const std::vector<std::string>& classes, const TrainOptions& o,
                     const std::string& dataset_name) {
  try {
    renumber_classes(all, classes, [&](std::int64_t sample) {
      return dataset_name + ":" + std::to_string(csv_line_of(o.dataset, sample));
    });
  } catch (const FormatError& e) {
    const std::string what = e.what();
    throw FormatError((what.rfind(dataset_name, 0) == 0 ? what : dataset_name + ": " + what) +
                      "; " + class_list(model_source(o), classes, "as the model learnt them"));
  }
}

/// Standardises the inputs as the model learnt them: by a resumed model's kept scaling,
/// else by the training set's (a new model's, or one kept without it), which the model then
/// keeps, so that a run resumed on other data scales it alike.
void scale_inputs(ModelMemory& memory, Dataset& train, Dataset& test, const TrainOptions& o) {
  FeatureScaling s{memory.input_mean, memory.input_scale};
  if (s.mean.empty()) s = feature_scaling(train);
  if (std::cmp_not_equal(s.mean.size(), train.features.rows())) {  // its layers have as many
    throw FormatError(model_source(o) + " keeps the scaling of " + std::to_string(s.mean.size()) +
                      " inputs for a model of " + std::to_string(train.features.rows()));
  }
  scale_features(train, s);
  scale_features(test, s);
  memory.input_mean = std::move(s.mean);
  memory.input_scale = std::move(s.scale);
}

/// The data set split for training and testing, as every rank builds it
/// (the split and the order come from the seed); its named classes numbered as
/// `model_classes` number them, if a resumed model has any.
struct PreparedData {
  Dataset all, train, test;
};
PreparedData prepare_data(const TrainOptions& o, std::string& name,
                          const std::vector<std::string>& model_classes = {}) {
  PreparedData d;
  d.all = load_data(o, name);
  if (!model_classes.empty()) number_as_model(d.all, model_classes, o, name);
  std::tie(d.train, d.test) = split_dataset(d.all, 0.2, o.seed);
  return d;
}

/// A new optimizer of `kind` as `sluice train` sets it up: SGD with momentum, AdamW with
/// a little weight decay.
OptimizerConfig new_optimizer(OptimizerKind kind, double learning_rate) {
  OptimizerConfig config;
  config.kind = kind;
  config.learning_rate = learning_rate;
  if (kind == OptimizerKind::sgd) config.momentum = 0.9;
  if (kind == OptimizerKind::adamw) config.weight_decay = 1e-4;
  return config;
}

/// The fraction of the stored layers' positions that are zero.
double stored_sparsity(const ModelMemory& memory) {
  double kept = 0, cells = 0;
  for (std::int32_t layer = 0; layer < memory.layer_count(); ++layer) {
    const LayerShape s = memory.layer_shape(layer);
    kept += static_cast<double>(s.nnz);
    cells += static_cast<double>(s.rows) * static_cast<double>(s.cols);
  }
  return cells > 0 ? 1.0 - kept / cells : 0.0;
}

/// Loads --resume into `memory` and returns the sizes of its layers; the checkpoint's
/// seed becomes the run's, as it fixes the data, the split and the shuffles. A checkpoint
/// whose layers do not make a network is bad data (exit 1), named.
std::vector<std::int64_t> resume_model(ModelMemory& memory, TrainOptions& o, bool seed_given) {
  if (!o.resume.empty()) memory.load(o.resume);  // else a --model-store holds the model
  require_mlp(memory, model_source(o));
  std::vector<std::int64_t> sizes;
  try {
    sizes = mlp_sizes(memory);
  } catch (const ArgumentError& e) {
    throw FormatError(model_source(o) + " holds no network that can be trained: " + e.what());
  }
  if (seed_given && o.seed != memory.seed) {
    throw UsageError("--seed " + std::to_string(o.seed) + " differs from the seed " +
                     std::to_string(memory.seed) + " of " + model_source(o) +
                     ", which fixes the data, its split and its order (leave --seed out to "
                     "resume)");
  }
  o.seed = memory.seed;
  return sizes;
}

/// The optimizer of a resumed run: the checkpoint's, state and all, unless --optimizer or
/// --lr say otherwise; what was chosen is said on `progress`.
void resume_optimizer(ModelMemory& memory, const TrainOptions& o, bool kind_given, bool lr_given,
                      std::ostream& progress) {
  const OptimizerConfig saved = memory.optimizer();
  OptimizerConfig config = saved;
  config.schedule = nullptr;
  const OptimizerKind kind = parse_optimizer(o.optimizer);
  const std::string whose = o.resume.empty() ? "the store's" : "the checkpoint's";
  std::string note = whose;
  if (kind_given && kind != saved.kind) {
    config = new_optimizer(kind, lr_given ? o.lr : saved.learning_rate);
    note = "--optimizer replaces " + whose + " " + to_string(saved.kind);
  }
  if (lr_given && o.lr != saved.learning_rate) {
    config.learning_rate = o.lr;
    note += ", --lr replaces its learning rate " + json_number(saved.learning_rate);
  }
  memory.set_optimizer(config);
  progress << "resuming " << model_source(o) << " after " << memory.epochs << " epochs, "
           << memory.step() << " steps: optimizer " << to_string(config.kind) << ", learning rate "
           << json_number(config.learning_rate) << " (" << note << ")\n";
}

/// The learning-rate decay (lr_decay_option.hpp) where a flag asks for one; without, an
/// MLP trains at a constant rate (or under its checkpoint's decay). By default the cosine
/// ends where this run's steps end (`run_steps`; 0: unknown, a run bounded by time alone).
void set_mlp_decay(ModelMemory& memory, const TrainOptions& o, bool resuming,
                   std::int64_t run_steps, std::ostream& progress) {
  if (!decay_flags_given(o.gpt.decay) && !resuming) return;
  const std::int64_t first = memory.step();
  const std::int64_t planned_end = run_steps > 0 ? first + run_steps : 0;
  OptimizerConfig config = memory.optimizer();
  const std::string whose = o.resume.empty() ? "the store's" : "the checkpoint's";
  config.decay = resolve_decay(config.decay, o.gpt.decay, resuming, whose, first, planned_end,
                               "--epochs, --steps", progress);
  memory.set_optimizer(config);
}

struct TrainTotals {
  std::int64_t steps = 0, skipped = 0;
  std::int32_t last_bad_layer = -1;
  double final_loss = 0;
  std::int64_t epochs = 0;  ///< passes over the data completed (--steps may cut the last)
};

/// The samples of `data` as a batch whose features are in `x` (resized as needed).
Batch batch_of(const Dataset& data, std::span<const std::int64_t> samples, DenseMatrix& x) {
  const auto size = static_cast<std::int64_t>(samples.size());
  if (x.cols() != size) x = DenseMatrix(data.features.rows(), size);
  Batch b;
  for (std::int64_t k = 0; k < size; ++k) {
    const std::int64_t s = samples[static_cast<std::size_t>(k)];
    for (std::int64_t f = 0; f < x.rows(); ++f) x(f, k) = data.features(f, s);
    b.labels.push_back(data.labels[static_cast<std::size_t>(s)]);
  }
  b.features = x.view();
  return b;
}

/// Trains `o.epochs` epochs after the `memory.epochs` the model has had, each over the
/// training set in an order shuffled from the seed: epoch k's order is the same whether or
/// not the run was resumed in between. Counts the epochs in `memory` as they end (a model
/// store commits the count, so a run killed later resumes from the right order).
TrainTotals train_epochs(LayerStreamingExecutor& executor, ModelMemory& memory,
                         const Dataset& train, const TrainOptions& o, std::ostream& progress,
                         bool by_index) {
  const std::int64_t done = memory.epochs;
  const std::int64_t n = train.samples();
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(o.seed + 17);
  for (std::int64_t e = 0; e < done; ++e) std::shuffle(order.begin(), order.end(), rng);
  DenseMatrix batch_x(train.features.rows(), std::min(o.batch, n));
  TrainTotals t;
  const auto t0 = std::chrono::steady_clock::now();
  auto stop = [&] {  // --steps, --max-seconds and Ctrl-C end the run between steps
    return interrupting_signal() != 0 || (o.steps > 0 && t.steps >= o.steps) ||
           (o.max_seconds > 0 &&
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >=
                o.max_seconds);
  };
  for (int epoch = 1; epoch <= o.epochs && !stop(); ++epoch) {
    std::shuffle(order.begin(), order.end(), rng);
    const StepMetrics before = executor.totals();
    double loss_sum = 0, correct = 0;
    std::int64_t seen = 0, epoch_skipped = 0;
    bool cut = false;
    for (std::int64_t begin = 0; begin + o.engines <= n; begin += o.batch) {
      if (stop()) {
        cut = true;
        break;
      }
      const std::int64_t size = std::min(o.batch, n - begin);
      const std::span<const std::int64_t> samples = std::span<const std::int64_t>(order).subspan(
          static_cast<std::size_t>(begin), static_cast<std::size_t>(size));
      const StepResult r = by_index ? executor.train_step_samples(samples)
                                    : executor.train_step(batch_of(train, samples, batch_x));
      loss_sum += r.loss * static_cast<double>(size);
      correct += r.accuracy * static_cast<double>(size);
      seen += size;
      ++t.steps;
      // A non-finite gradient skips the step (NonFinitePolicy::skip_step): say so.
      if (!r.report.applied) {
        ++epoch_skipped;
        if (!r.report.bad_layers.empty()) t.last_bad_layer = r.report.bad_layers.back();
      }
    }
    StepMetrics epoch_metrics = executor.totals();
    epoch_metrics.wall_seconds -= before.wall_seconds;
    epoch_metrics.engine_busy_seconds -= before.engine_busy_seconds;
    epoch_metrics.engine_thread_seconds -= before.engine_thread_seconds;
    epoch_metrics.tokens -= before.tokens;
    if (!cut) ++t.epochs;
    if (seen == 0) break;
    t.final_loss = loss_sum / static_cast<double>(seen);
    t.skipped += epoch_skipped;
    char line[256];
    std::snprintf(line, sizeof line,
                  "epoch %3lld  loss %.4f  train accuracy %.4f  %.0f tokens/s  engine busy %.1f%%",
                  static_cast<long long>(done + epoch), t.final_loss,
                  correct / static_cast<double>(seen), epoch_metrics.tokens_per_second(),
                  100 * epoch_metrics.engine_busy());
    progress << line;
    if (epoch_skipped > 0) progress << "  " << epoch_skipped << " steps skipped";
    progress << "\n" << std::flush;
    memory.epochs = done + t.epochs;
    commit_store_counters(memory);
  }
  return t;
}

/// A diverged model, or one no step of this run changed, is worth nothing: the run fails
/// and an older checkpoint at the path is kept.
void refuse_failed_training(const TrainTotals& t, const TrainOptions& o) {
  const std::string unwritten =
      o.checkpoint.empty() ? "" : "; " + o.checkpoint + " was not written";
  if (t.steps == 0 && interrupting_signal() != 0)
    throw Interrupted("interrupted before the first step: nothing was trained" + unwritten);
  if (t.steps == 0) throw UsageError("no step was trained: --max-seconds is too small");
  const bool diverged = !std::isfinite(t.final_loss);
  if (!diverged && t.skipped < t.steps) return;
  std::string why = diverged ? "training diverged: the last epoch's loss is not finite; "
                             : "training made no progress: ";
  why += std::to_string(t.skipped) + " of " + std::to_string(t.steps) +
         " steps were skipped for non-finite gradients";
  if (t.last_bad_layer >= 0)
    why += " (the last in layer " + std::to_string(t.last_bad_layer) + ", from 0)";
  throw NumericError(why + unwritten + " (try a smaller --lr)");
}

/// `--model gpt`: the options it takes over (check_train_options refused the others).
int run_gpt(const TrainOptions& o, const CLI::App& cmd) {
  GptTrainOptions g = o.gpt;
  g.sparsity = o.sparsity;
  if (cmd.count("--batch") > 0) g.batch = o.batch;
  g.steps = o.steps;
  g.max_seconds = o.max_seconds;
  g.engines = o.engines;
  g.threads = o.threads;
  g.path = o.path;
  g.precision = o.precision;
  g.optimizer = o.optimizer;
  g.optimizer_given = cmd.count("--optimizer") > 0;
  if (cmd.count("--lr") > 0) g.lr = o.lr;
  g.lr_given = cmd.count("--lr") > 0;
  g.seed = o.seed;
  g.seed_given = cmd.count("--seed") > 0;
  g.shape_given = false;
  for (const char* name : {"--context", "--d-model", "--heads", "--blocks", "--sparsity"}) {
    g.shape_given = g.shape_given || cmd.count(name) > 0;
  }
  g.checkpoint = o.checkpoint;
  g.resume = o.resume;
  g.store = o.store;
  g.json = o.json;
  g.schedule = o.schedule;
  g.fabric = o.fabric;
#ifdef SLUICE_HAVE_MPI
  if (o.fabric == "mpi") {
    // The engine ranks serve until rank 0 is done; they need nothing of the text or the
    // model: rank 0 sends token ids and streams. Rank 0's fabric stops them even when
    // rank 0 fails (its destructor says stop), before MPI_Finalize.
    const MpiSession mpi;
    if (mpi.size < 2) {
      throw UsageError(
          "--fabric mpi needs at least 2 ranks (rank 0 drives, the others are "
          "engines): run it as mpirun -np N sluice train --model gpt --fabric mpi ...");
    }
    MpiFabricOptions mo;
    mo.engine.threads = o.threads;
    mo.peer_timeout_seconds = o.peer_timeout;
    mo.engine.path = parse_product_path(o.path);
    MpiFabric fabric(mo);
    if (!fabric.is_driver()) {
      fabric.serve();
      return 0;
    }
    g.engines = fabric.engine_count();
    if (!g.checkpoint.empty()) check_checkpoint_path(g.checkpoint);
    return run_gpt_training(g, &fabric);
  }
#else
  if (o.fabric == "mpi") {
    throw UsageError(
        "--fabric mpi: sluice was built without MPI (configure with "
        "-DSLUICE_WITH_MPI=ON and an MPI such as Open MPI installed)");
  }
#endif
  if (!g.checkpoint.empty()) check_checkpoint_path(g.checkpoint);
  return run_gpt_training(g);
}

/// What a run reports: one JSON object, or lines of text.
/// "by_input" or "by_output" as every layer past the first streams its backward (see
/// ExecutorOptions::backward_order), "mixed" if they differ.
std::string backward_orders(const LayerStreamingExecutor& executor) {
  std::string orders = to_string(executor.backward_order(executor.layer_count() - 1));
  for (std::int32_t l = 1; l < executor.layer_count() - 1; ++l) {
    if (orders != to_string(executor.backward_order(l))) orders = "mixed";
  }
  return orders;
}

void report(const TrainOptions* o, const Dataset& all, const std::string& dataset_name,
            const Evaluation& e, const TrainTotals& t, const LayerStreamingExecutor& executor,
            const ModelMemory& memory, bool resuming) {
  const StepMetrics& total = executor.totals();
  if (o->json) {
    JsonWriter j(2);
    j.begin_object();
    j.field("dataset", dataset_name);
    if (!all.class_names.empty()) {  // class i the i-th
      j.key("class_names").begin_array();
      for (const std::string& name : all.class_names) j.value(name);
      j.end_array();
    }
    j.field("test_accuracy", e.accuracy).field("test_loss", e.loss);
    j.field("final_loss", t.final_loss).field("steps", t.steps).field("epochs", t.epochs);
    j.field("skipped_steps", t.skipped).field("interrupted", interrupting_signal() != 0);
    j.field("engines", o->engines).field("sparsity", model_sparsity(memory, *o, resuming));
    j.field("precision", o->precision);
    j.field("optimizer", to_string(memory.optimizer().kind));
    j.field("learning_rate", memory.optimizer().learning_rate);
    const LearningRateDecay& decay = memory.optimizer().decay;
    j.field("lr_schedule", decay_name(decay)).field("warmup_steps", decay.warmup_steps);
    j.field("decay_steps", decay.decay_steps);
    j.field("seed", memory.seed).field("epochs_total", memory.epochs);
    j.field("engine_busy", total.engine_busy()).field("tokens_per_s", total.tokens_per_second());
    j.field("train_seconds", total.wall_seconds);
    j.field("stream_packets_per_s", total.packets_per_second());
    j.field("stream_bytes_per_s", total.bytes_per_second());
    j.field("stream_wait_seconds", total.stream_wait_seconds);
    j.field("optimizer_seconds", total.optimizer_seconds);
    j.field("dynamic", o->schedule.dynamic).field("mask_updates", total.mask_updates);
    j.field("mask_update_seconds", total.mask_update_seconds);
    j.field("mask_score_seconds", total.mask_score_seconds);
    j.field("driver_bytes_sent_per_step", total.driver_bytes_sent_per_step());
    j.field("driver_bytes_received_per_step", total.driver_bytes_received_per_step());
    j.field("overlap", total.overlap());
    j.field("step_over_passes", total.step_over_passes());
    j.field("backward_order", backward_orders(executor));
    j.field("peak_rss_bytes", peak_resident_bytes());
    add_model_store_fields(j, memory);
    j.end_object();
    std::cout << j.str() << "\n";
  } else {
    std::printf(
        "test accuracy %.4f (loss %.4f) on %lld samples; %lld steps in %.2f s, "
        "%.0f tokens/s, engine busy %.1f%%, optimizer %.2f s, stream wait %.2f s\n",
        e.accuracy, e.loss, static_cast<long long>(e.tokens), static_cast<long long>(t.steps),
        total.wall_seconds, total.tokens_per_second(), 100 * total.engine_busy(),
        total.optimizer_seconds, total.stream_wait_seconds);
    if (total.mask_updates > 0) {
      std::printf("masks updated %lld times (%s) in %.3f s\n",
                  static_cast<long long>(total.mask_updates), o->schedule.dynamic.c_str(),
                  total.mask_update_seconds);
    }
    if (t.skipped > 0) {
      std::printf("%lld of %lld steps skipped for non-finite gradients\n",
                  static_cast<long long>(t.skipped), static_cast<long long>(t.steps));
    }
  }
}

/// Every engine takes a share of each batch's tokens: a split with fewer samples than
/// engines gives no training step or no evaluation.
void check_split(const TrainOptions& options, const PreparedData& data,
                 const std::string& dataset_name) {
  const TrainOptions* o = &options;
  const Dataset& all = data.all;
  const Dataset& train = data.train;
  const Dataset& test = data.test;
  const std::int64_t fewest = std::min(train.samples(), test.samples());
  if (fewest < o->engines) {
    const std::string what = dataset_name + ": " + std::to_string(all.samples()) +
                             " samples, split into " + std::to_string(train.samples()) +
                             " to train and " + std::to_string(test.samples()) + " to test";
    if (fewest < 1) throw FormatError(what + "; too few to train and test on");
    throw UsageError(what + "; " + std::to_string(o->engines) +
                     " engines need at least as many samples in each");
  }
}

/// The layer sizes of the run: --layers, the resumed model's, or the data's default; each
/// checked against the data and the resumed model.
std::vector<std::int64_t> model_sizes(const TrainOptions& options, const Dataset& all,
                                      bool resuming, const std::vector<std::int64_t>& saved) {
  const TrainOptions* o = &options;
  const std::vector<std::int64_t> sizes =
      !o->layers.empty() ? parse_layers(o->layers)
      : resuming         ? saved
                         : std::vector<std::int64_t>{all.features.rows(), 512, 512, all.classes};
  if (resuming && sizes != saved) {
    throw UsageError("--layers " + join_sizes(sizes) + " differs from the layers " +
                     join_sizes(saved) + " of " + model_source(*o) +
                     " (leave --layers out to resume)");
  }
  if (sizes.front() != all.features.rows() || sizes.back() < all.classes) {
    const std::string what = "that does not fit the data: " + std::to_string(all.features.rows()) +
                             " features, " + std::to_string(all.classes) + " classes";
    if (resuming) {
      throw FormatError(model_source(*o) + " holds a model with layers " + join_sizes(saved) + " " +
                        what);
    }
    throw UsageError("--layers " + o->layers + " " + what);
  }
  return sizes;
}

/// What the flags say of the executor over `layers` layers (its mask-update schedule
/// comes from the model and the run, see resolve_schedule).
ExecutorOptions executor_options(const TrainOptions& o, std::int32_t layers) {
  ExecutorOptions eo;
  eo.prefetch_depth = o.prefetch;
  eo.prefetch_bytes = o.prefetch_bytes;
  eo.memory_budget_bytes = o.memory_budget;
  eo.precisions = parse_precisions(o.precision, layers);
  if (o.backward_order != "auto") {
    eo.backward_order =
        o.backward_order == "by_input" ? StreamOrder::by_input : StreamOrder::by_output;
  }
  return eo;
}

/// `--model mlp`: the fabric, the data, the model (new or resumed), the epochs, the report.
int run_mlp(TrainOptions* o, const TrainFlags& flags) {
  CLI::Option *sparsity = flags.sparsity, *seed = flags.seed, *optimizer = flags.optimizer,
              *lr = flags.lr;
#ifdef SLUICE_HAVE_MPI
  // The fabric comes first: with MPI, the engine ranks serve it until rank 0 is done,
  // and rank 0's fabric stops them even when rank 0 fails (its destructor says stop).
  std::unique_ptr<MpiSession> mpi;  // declared first: MPI_Finalize comes last
  std::unique_ptr<Fabric> fabric_owner;
  if (o->fabric == "mpi") {
    mpi = std::make_unique<MpiSession>();
    if (mpi->size < 2) {
      throw UsageError(
          "--fabric mpi needs at least 2 ranks (rank 0 drives, the others are "
          "engines): run it as mpirun -np N sluice train --fabric mpi ...");
    }
    MpiFabricOptions mo;
    mo.engine.threads = o->threads;
    mo.peer_timeout_seconds = o->peer_timeout;
    mo.engine.path = parse_product_path(o->path);
    auto mpi_fabric = std::make_unique<MpiFabric>(mo);
    if (!mpi_fabric->is_driver()) {
      // Engine ranks build the training set as rank 0 does and take each batch's samples
      // from it: rank 0 sends their indices, never features. A resumed run's seed (which
      // fixes the split) is in its checkpoint, which engine ranks do not read: rank 0
      // then sends each batch's features once a step.
      std::optional<PreparedData> own;
      if (o->resume.empty()) {
        try {
          std::string name;
          own = prepare_data(*o, name);
          standardize(own->train, own->test);
        } catch (const std::exception&) {  // rank 0 fails alike and says why
          own.reset();
        }
      }
      if (own) mpi_fabric->attach_dataset(&own->train);
      mpi_fabric->serve();
      return 0;
    }
    o->engines = mpi_fabric->engine_count();
    fabric_owner = std::move(mpi_fabric);
  }
#else
  std::unique_ptr<Fabric> fabric_owner;
  if (o->fabric == "mpi") {
    throw UsageError(
        "--fabric mpi: sluice was built without MPI (configure with "
        "-DSLUICE_WITH_MPI=ON and an MPI such as Open MPI installed)");
  }
#endif
  // Fail before minutes of training when the model could not be saved at the end.
  if (!o->checkpoint.empty()) check_checkpoint_path(o->checkpoint);
  std::ostream& progress = o->json ? std::cerr : std::cout;
  NewStoreCleanup new_store(o->store);
  // A resumed model comes first: its seed fixes the data, the split and the order.
  const std::unique_ptr<ModelMemory> memory_owner = make_model_memory(o->store);
  ModelMemory& memory = *memory_owner;
  const bool resuming = !o->resume.empty() || memory.layer_count() > 0;
  if (resuming && o->resume.empty() && sparsity->count() > 0) {
    throw UsageError("--sparsity cannot be given when --model-store " + o->store.directory +
                     " holds a model: its masks fix it");
  }
  const std::vector<std::int64_t> saved =
      resuming ? resume_model(memory, *o, seed->count() > 0) : std::vector<std::int64_t>{};
  if (resuming && o->dataset == "auto") {  // not told: what the model was trained on
    const std::string data =
        resumed_training_data(memory, model_source(*o), "--dataset", built_in_dataset, progress);
    if (!data.empty()) o->dataset = data;
  }
  std::string dataset_name;
  const bool numbered_by_model = !memory.class_names.empty();
  PreparedData data = prepare_data(*o, dataset_name, memory.class_names);
  const Dataset& all = data.all;
  Dataset& train = data.train;
  Dataset& test = data.test;
  check_split(*o, data, dataset_name);
  if (!all.class_names.empty()) {
    progress << class_list(dataset_name, all.class_names,
                           numbered_by_model ? "as the model learnt them" : "sorted")
             << "\n";
  }
  // Kept with the model: a run resumed on other data numbers the classes as this one, and
  // one not told what data trains on this.
  memory.class_names = all.class_names;
  const std::string data_name = training_data_name(dataset_name, built_in_dataset(dataset_name));
  if (resuming) note_other_training_data(memory, data_name, progress);
  memory.training_data = data_name;
  const std::vector<std::int64_t> sizes = model_sizes(*o, all, resuming, saved);
  scale_inputs(memory, train, test, *o);
  if (o->batch < o->engines) throw UsageError("--batch must be at least --engines");
  // What a step holds: no more tokens than the training set has, and the model in RAM
  // unless a store holds it (then its RAM budget).
  const std::int64_t step_tokens = std::min(o->batch, train.samples());
  std::optional<double> store_ram;
  if (!o->store.directory.empty()) store_ram = static_cast<double>(o->store.budget);

  if (resuming) {
    resume_optimizer(memory, *o, optimizer->count() > 0, lr->count() > 0, progress);
    require_mlp_memory(sizes, stored_sparsity(memory), step_tokens, store_ram, {},
                       "--batch " + std::to_string(o->batch));
  } else {
    memory.seed = o->seed;
    const bool classes_from_file = o->layers.empty() && dataset_name == o->dataset;
    std::function<std::string()> label_source;
    if (classes_from_file) label_source = [&] { return largest_label_source(o->dataset, all); };
    require_mlp_memory(sizes, o->sparsity, step_tokens, store_ram, label_source,
                       o->layers.empty() ? "the default layers" : "--layers " + o->layers);
    check_model_store_budget(o->store, sizes, o->sparsity,
                             executor_options(*o, static_cast<std::int32_t>(sizes.size()) - 1),
                             o->engines);
    build_sparse_mlp(memory, sizes, o->sparsity, o->seed);
    memory.set_optimizer(new_optimizer(parse_optimizer(o->optimizer), o->lr));
  }
  new_store.keep();

  if (!fabric_owner) {
    o->threads = o->threads > 0 ? runnable_threads(o->threads, "train") : 0;
    LocalFabricOptions fo;
    fo.engines = o->engines;
    fo.engine.threads = o->threads;
    fo.engine.path = parse_product_path(o->path);
    fabric_owner = std::make_unique<LocalFabric>(fo);
  }
  Fabric& fabric = *fabric_owner;
  ExecutorOptions eo = executor_options(*o, memory.layer_count());
  const std::int64_t n = train.samples();
  const std::int64_t steps_per_epoch = n >= o->engines ? (n - o->engines) / o->batch + 1 : 0;
  const std::int64_t run_steps =
      o->steps > 0 ? std::min(o->steps, steps_per_epoch * o->epochs) : steps_per_epoch * o->epochs;
  eo.dynamic = resolve_schedule(memory, o->schedule, resuming, steps_per_epoch, run_steps,
                                o->resume.empty() ? "the store's" : "the checkpoint's", progress);
  o->schedule.dynamic = to_string(eo.dynamic.rule);  // what the report says
  const bool bounded_by_time_alone =
      o->max_seconds > 0 && o->steps == 0 && flags.cmd->count("--epochs") == 0;
  set_mlp_decay(memory, *o, resuming, bounded_by_time_alone ? 0 : run_steps, progress);
  const std::unique_ptr<LayerStreamingExecutor> executor_owner =
      make_executor(memory, fabric, eo, o->store);
  LayerStreamingExecutor& executor = *executor_owner;

  // The engines take batches by sample index from the training set (over MPI each engine
  // rank from its own copy, which it has unless the run resumed).
  const bool by_index = o->fabric == "local" || !resuming;
  if (by_index) fabric.attach_dataset(&train);
  const TrainTotals t = train_epochs(executor, memory, train, *o, progress, by_index);
  refuse_failed_training(t, *o);
  // Saved before evaluating, so a failing evaluation does not cost the trained model.
  if (!o->checkpoint.empty()) memory.save(o->checkpoint);
  if (interrupting_signal() != 0)
    progress << interruption_note(t.steps, o->checkpoint, o->store.directory) << "\n";
  // In batches of --batch tokens, so --memory-budget holds here too.
  const Evaluation e = executor.evaluate({test.features.view(), test.labels, {}}, o->batch);
  report(o, all, dataset_name, e, t, executor, memory, resuming);

  return 0;
}

}  // namespace

Command add_train_command(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  const TrainFlags flags = add_train_options(app, *o);
  return Command([o, flags] { check_train_options(*o, flags); },
                 [o, flags] {
                   const StopOnInterrupt stop_on_interrupt;
                   const int code =
                       o->model == "gpt" ? run_gpt(*o, *flags.cmd) : run_mlp(o.get(), flags);
                   return code != 0 ? code : interrupted_exit_code();
                 });
}
}  // namespace sluice::cli
