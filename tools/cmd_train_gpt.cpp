// `sluice train --model gpt`: a byte-level GPT (sluice/gpt.hpp) trained on a text, its
// held-out part (the last 5% of the bytes) evaluated at the end.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <iostream>
#include <memory>
#include <numeric>

#include "commands.hpp"
#include "interrupt.hpp"
#include "json_writer.hpp"
#include "measure.hpp"
#include "model_budget.hpp"
#include "model_kind.hpp"
#include "sluice/bf16.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/error.hpp"
#include "sluice/fabric.hpp"
#include "sluice/gpt.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/text_corpus.hpp"
#include "train_gpt.hpp"
#include "training_data.hpp"

namespace sluice::cli {
namespace {

/// Where a resumed model comes from, for messages: "checkpoint PATH" or "model store DIR".
std::string source_of(const GptTrainOptions& o) {
  return o.resume.empty() ? "model store " + o.store.directory : "checkpoint " + o.resume;
}

/// --text, else what a resumed model was trained on, else $SLUICE_TEXT, else the fortunes
/// scripts/sluice-setup puts beside the program.
std::filesystem::path text_path(const GptTrainOptions& o, const ModelMemory& memory, bool resuming,
                                std::ostream& progress) {
  if (!o.text.empty()) return o.text;
  if (resuming) {  // not told: what the model was trained on
    const std::string data = resumed_training_data(
        memory, source_of(o), "--text", [](const std::string&) { return false; }, progress);
    if (!data.empty()) return data;
  }
  if (const char* env = std::getenv("SLUICE_TEXT"); env != nullptr && *env != '\0') return env;
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::filesystem::path beside = ec ? "data/fortunes" : exe.parent_path() / "data/fortunes";
  if (!std::filesystem::exists(beside, ec)) {
    throw IoError(
        "no text to train on: pass --text FILE (or a directory of text files), set "
        "SLUICE_TEXT, or run scripts/sluice-setup, which puts Debian's fortunes in " +
        beside.string());
  }
  return beside;
}

/// The resumed model's source as a possessive, for the schedules' messages.
std::string whose(const GptTrainOptions& o) {
  return o.resume.empty() ? "the store's" : "the checkpoint's";
}

/// UsageError, before a new store is built, if a layer of the GPT would need more RAM at
/// once than the store's budget.
void check_gpt_store_budget(const ModelStoreOptions& store, const GptConfig& c) {
  if (store.directory.empty()) return;
  std::vector<LayerShape> shapes;
  for (const GptLayerShape& g : gpt_layer_shapes(c)) {
    const std::int64_t nnz =
        g.sparse ? drawn_nnz_bound(g.rows, g.cols, c.sparsity) : g.rows * g.cols;
    shapes.push_back({g.rows, g.cols, nnz, g.bias ? g.rows : 0});
  }
  check_layers_fit(store, shapes);
}

/// The shape of a new model, from the options.
GptConfig new_config(const GptTrainOptions& o) {
  GptConfig c;
  c.context = o.context;
  c.d_model = o.d_model;
  c.heads = o.heads;
  c.blocks = o.blocks;
  c.sparsity = o.sparsity;
  try {
    c.validate();
  } catch (const ArgumentError& e) {
    throw UsageError(e.what());
  }
  return c;
}

/// A new model of `c` in `memory` (in the store, if one was given), and its optimizer.
void build_model(ModelMemory& memory, const GptTrainOptions& o, const GptConfig& c) {
  memory.seed = o.seed;
  build_gpt(memory, c, o.seed);
  OptimizerConfig opt;
  opt.kind = parse_optimizer(o.optimizer);
  opt.learning_rate = o.lr;
  if (opt.kind == OptimizerKind::adamw) opt.weight_decay = 0.01;
  // A transformer's first steps can take gradients far larger than the rest.
  opt.clip_global_norm = 1.0;
  memory.set_optimizer(opt);
  commit_store_counters(memory);  // the store holds a GPT from here, not after a step
}

/// The model to resume: the checkpoint's, or the one the store holds.
GptConfig resumed_model(ModelMemory& memory, GptTrainOptions& o) {
  if (!o.resume.empty()) memory.load(o.resume);
  require_gpt(memory, source_of(o), "train it without --model gpt");
  GptConfig c;
  try {
    c = gpt_config_of(memory);
  } catch (const FormatError& e) {
    throw FormatError(source_of(o) + " holds no GPT: " + e.what());
  }
  if (o.shape_given) {
    throw UsageError(
        "--context, --d-model, --heads, --blocks and --sparsity cannot be given " +
        std::string(o.resume.empty() ? "when --model-store holds a model" : "with --resume") +
        ": the " + source_of(o) + " (" + c.describe() + ") fixes them");
  }
  if (o.seed_given && o.seed != memory.seed) {
    throw UsageError("--seed differs from " + whose(o) + " " + std::to_string(memory.seed) +
                     ", which fixes the data order (leave --seed out to resume)");
  }
  o.seed = memory.seed;
  OptimizerConfig opt = memory.optimizer();
  if (o.optimizer_given) opt.kind = parse_optimizer(o.optimizer);
  if (o.lr_given) opt.learning_rate = o.lr;
  if (o.optimizer_given || o.lr_given) memory.set_optimizer(opt);
  return c;
}

/// The learning-rate decay of the run (lr_decay_option.hpp), set in the memory's optimizer:
/// it ends where training is planned to, --horizon-steps (as the mask-update schedule's
/// horizon) or else where this run's --steps end.
void set_decay(ModelMemory& memory, const GptTrainOptions& o, bool resuming,
               std::ostream& progress) {
  const bool horizon_given =
      o.schedule.horizon_steps_option != nullptr && o.schedule.horizon_steps_option->count() > 0;
  const std::int64_t first = memory.step();
  const std::int64_t planned_end =
      horizon_given ? o.schedule.horizon_steps : (o.steps > 0 ? first + o.steps : 0);
  OptimizerConfig optimizer = memory.optimizer();
  optimizer.decay = resolve_decay(optimizer.decay, o.decay, resuming, whose(o), first, planned_end,
                                  "--steps, --horizon-steps", progress);
  memory.set_optimizer(optimizer);
}

/// The held-out part's mean loss in nats per byte, in batches of whole windows per engine.
double held_out_loss(GptModel& model, const TextCorpus& corpus, std::int64_t batch, int engines,
                     std::int64_t& tokens) {
  const std::int64_t windows = corpus.held_out_windows() / engines * engines;
  if (windows < 1) {
    throw FormatError("the held-out part has " + std::to_string(corpus.held_out_windows()) +
                      " windows of --context bytes, fewer than the " + std::to_string(engines) +
                      " engines");
  }
  const std::int64_t step = std::max<std::int64_t>(engines, batch / engines * engines);
  double sum = 0;
  for (std::int64_t first = 0; first < windows; first += step) {
    const std::int64_t count = std::min(step, windows - first);
    const TextBatch b = corpus.held_out_batch(first, count);
    sum += model.loss(b) * static_cast<double>(count * corpus.context());
  }
  tokens = windows * corpus.context();
  return sum / static_cast<double>(tokens);
}

struct RunTotals {
  std::int64_t steps = 0, skipped = 0;
  std::deque<double> recent;  // the last steps' losses, for train_loss
  double train_loss() const {
    return recent.empty() ? NAN
                          : std::accumulate(recent.begin(), recent.end(), 0.0) /
                                static_cast<double>(recent.size());
  }
};

RunTotals train_steps(GptModel& model, ModelMemory& memory, const TextCorpus& corpus,
                      const GptTrainOptions& o, std::ostream& progress) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  RunTotals t;
  const std::int64_t first_step = memory.step();
  constexpr std::size_t kRecent = 20;
  const std::int64_t report_every = 25;
  while (interrupting_signal() == 0 && (o.steps == 0 || t.steps < o.steps) &&
         (o.max_seconds == 0 ||
          std::chrono::duration<double>(Clock::now() - t0).count() < o.max_seconds)) {
    // Batches follow the step count, so a resumed run goes on with the data order.
    const auto global = static_cast<std::uint64_t>(first_step + t.steps);
    const GptStep s = model.train_step(corpus.sample(o.batch, o.seed, global));
    ++t.steps;
    if (!s.report.applied) ++t.skipped;
    t.recent.push_back(s.loss);
    if (t.recent.size() > kRecent) t.recent.pop_front();
    if (t.steps % report_every == 0) {
      char line[160];
      std::snprintf(line, sizeof line, "step %6lld  loss %.4f  (%.3f bits/byte)  %.0f tokens/s\n",
                    static_cast<long long>(memory.step()), t.train_loss(),
                    t.train_loss() / std::log(2.0), model.totals().tokens_per_second());
      progress << line << std::flush;
    }
  }
  const std::string unwritten =
      o.checkpoint.empty() ? "" : "; " + o.checkpoint + " was not written";
  if (t.steps == 0 && interrupting_signal() != 0)
    throw Interrupted("interrupted before the first step: nothing was trained" + unwritten);
  if (t.steps == 0) throw UsageError("no step was trained: --max-seconds is too small");
  if (!std::isfinite(t.train_loss()) || t.skipped == t.steps) {
    throw NumericError(
        "training diverged: " + std::to_string(t.skipped) + " of " + std::to_string(t.steps) +
        " steps were skipped for non-finite gradients (try a smaller --lr)" + unwritten);
  }
  return t;
}

/// The mask-update schedule of the run (dynamic_schedule.hpp), stored in the memory: a GPT
/// run counts steps, so its horizon is --horizon-steps, else where this run's --steps end.
DynamicSparsity gpt_schedule(ModelMemory& memory, GptTrainOptions& o, bool resuming,
                             std::ostream& progress) {
  const bool keeps = resuming && memory.dynamic.rule != MaskUpdateRule::none;
  const bool asks = o.schedule.rule_option != nullptr && o.schedule.rule_option->count() > 0 &&
                    parse_mask_update_rule(o.schedule.dynamic) != MaskUpdateRule::none;
  const bool horizon_given =
      o.schedule.horizon_steps_option != nullptr && o.schedule.horizon_steps_option->count() > 0;
  if (asks && !keeps && o.steps == 0 && !horizon_given) {
    throw UsageError(
        "--dynamic with --model gpt and --max-seconds needs --steps or --horizon-steps: the "
        "schedule's horizon");
  }
  const DynamicSparsity d =
      resolve_schedule(memory, o.schedule, resuming, 1, o.steps, whose(o), progress);
  o.schedule.dynamic = to_string(d.rule);  // what the report says
  return d;
}

}  // namespace

int run_gpt_training(GptTrainOptions o, Fabric* given) {
  if (o.steps == 0 && o.max_seconds == 0) o.steps = 200;
  if (o.batch < o.engines) throw UsageError("--batch (sequences) must be at least --engines");
  std::ostream& progress = o.json ? std::cerr : std::cout;
  NewStoreCleanup new_store(o.store);
  const std::unique_ptr<ModelMemory> memory_owner = make_model_memory(o.store);
  ModelMemory& memory = *memory_owner;
  const bool resuming = !o.resume.empty() || memory.layer_count() > 0;
  const GptConfig config = resuming ? resumed_model(memory, o) : new_config(o);
  // A step that cannot fit is refused before the text is read or a model built (a resumed
  // model is in memory already; a store's budget was checked on its own).
  require_gpt_memory(config, o.batch, o.engines, !resuming && o.store.directory.empty(),
                     given == nullptr);
  // The budget and the text before a new model: no store is built for a run that cannot
  // start.
  if (!resuming) check_gpt_store_budget(o.store, config);
  const std::filesystem::path path = text_path(o, memory, resuming, progress);
  const TextCorpus corpus = TextCorpus::load(path, config.context);
  if (!resuming) build_model(memory, o, config);
  // Kept with the model: a run resumed without --text trains on this text again.
  const std::string text_name = training_data_name(path.string(), false);
  if (resuming) note_other_training_data(memory, text_name, progress);
  memory.training_data = text_name;
  new_store.keep();
  set_decay(memory, o, resuming, progress);
  std::unique_ptr<LocalFabric> local;
  if (given == nullptr) {
    o.threads = o.threads > 0 ? runnable_threads(o.threads, "train") : 0;
    LocalFabricOptions fo;
    fo.engines = o.engines;
    fo.engine.threads = o.threads;
    fo.engine.path = parse_product_path(o.path);
    local = std::make_unique<LocalFabric>(fo);
  }
  Fabric& fabric = given != nullptr ? *given : *local;
  const DynamicSparsity dynamic = gpt_schedule(memory, o, resuming, progress);
  GptModel model(memory, fabric, config, dynamic, parse_precision(o.precision));
  progress << "gpt: " << config.describe() << ", sparsity " << json_number(model.config().sparsity)
           << (o.precision == "bf16" ? ", projections streamed in bf16" : "") << ", "
           << gpt_parameters(config) << " parameters (" << stored_parameters(memory) << " stored); "
           << path.string() << ": " << corpus.train().size() << " bytes to train, "
           << corpus.held_out().size() << " held out\n";

  const RunTotals t = train_steps(model, memory, corpus, o, progress);
  if (!o.checkpoint.empty()) memory.save(o.checkpoint);
  if (interrupting_signal() != 0)
    progress << interruption_note(t.steps, o.checkpoint, o.store.directory) << "\n";
  std::int64_t held_out_tokens = 0;
  const double val_loss = held_out_loss(model, corpus, o.batch, o.engines, held_out_tokens);
  const StepMetrics& total = model.totals();
  const double bits = val_loss / std::log(2.0);
  if (o.json) {
    JsonWriter j(2);
    j.begin_object();
    j.field("model", "gpt").field("text", path.string());
    j.field("val_loss", val_loss).field("val_bits_per_byte", bits);
    j.field("train_loss", t.train_loss());
    j.field("tokens_per_s", total.tokens_per_second()).field("engine_busy", total.engine_busy());
    j.field("steps", t.steps).field("skipped_steps", t.skipped);
    j.field("interrupted", interrupting_signal() != 0);
    j.field("steps_total", memory.step());
    j.field("parameters", gpt_parameters(config)).field("nonzeros", stored_parameters(memory));
    j.field("train_seconds", total.wall_seconds);
    j.field("optimizer_seconds", total.optimizer_seconds);
    j.field("dynamic", o.schedule.dynamic).field("mask_updates", total.mask_updates);
    j.field("mask_update_seconds", total.mask_update_seconds);
    j.field("mask_score_seconds", total.mask_score_seconds);
    j.field("stream_bytes_per_s", total.bytes_per_second());
    j.field("context", config.context).field("d_model", config.d_model);
    j.field("heads", config.heads).field("blocks", config.blocks);
    j.field("sparsity", model.config().sparsity).field("batch", o.batch);
    j.field("engines", o.engines).field("fabric", o.fabric).field("path", o.path);
    j.field("precision", o.precision);
    j.field("optimizer", to_string(memory.optimizer().kind));
    j.field("learning_rate", memory.optimizer().learning_rate).field("seed", memory.seed);
    const LearningRateDecay& decay = memory.optimizer().decay;
    j.field("lr_schedule", decay_name(decay)).field("warmup_steps", decay.warmup_steps);
    j.field("decay_steps", decay.decay_steps);
    j.field("held_out_tokens", held_out_tokens);
    add_model_store_fields(j, memory);
    j.field("peak_rss_bytes", peak_resident_bytes());
    j.end_object();
    std::cout << j.str() << "\n";
  } else {
    std::printf(
        "held-out loss %.4f nats/byte (%.3f bits/byte) on %lld bytes; %lld steps in "
        "%.1f s, %.0f tokens/s, engine busy %.1f%%\n",
        val_loss, bits, static_cast<long long>(held_out_tokens), static_cast<long long>(t.steps),
        total.wall_seconds, total.tokens_per_second(), 100 * total.engine_busy());
  }
  return 0;
}

}  // namespace sluice::cli
