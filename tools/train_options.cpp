#include "train_options.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/excerpt.hpp"
#include "measure.hpp"
#include "number_options.hpp"
#include "output_files.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::cli {
namespace {

/// `--model gpt`: the options it would ignore refused.
void check_gpt_options(const TrainOptions& o, const CLI::App& cmd) {
  for (const char* name : {"--dataset", "--data", "--layers", "--epochs", "--memory-budget",
                           "--prefetch", "--prefetch-bytes", "--backward-order"}) {
    if (cmd.count(name) > 0) throw UsageError(std::string(name) + " is not for --model gpt");
  }
  if (o.precision != "fp32" && o.precision != "bf16") {
    throw UsageError("--precision " + detail::excerpt(o.precision) +
                     ": the GPT's projections stream in one precision, fp32 or bf16");
  }
  if (cmd.count("--horizon-epochs") > 0) {
    throw UsageError(
        "--horizon-epochs is not for --model gpt, which trains by steps: give "
        "--horizon-steps");
  }
  check_schedule_options(o.schedule, !o.resume.empty() || !o.store.directory.empty());
  check_model_store_options(o.store, !o.resume.empty(), !o.checkpoint.empty());
}

}  // namespace

std::vector<std::int64_t> parse_layers(const std::string& text) {
  std::vector<std::int64_t> sizes;
  for (const std::string& item : split_list(text)) {
    try {
      std::size_t used = 0;
      const long long v = std::stoll(item, &used);
      if (used != item.size() || v < 1) throw std::invalid_argument(item);
      sizes.push_back(v);
    } catch (const std::exception&) {
      throw UsageError("--layers: " + detail::excerpt(item) + " is not a positive integer");
    }
  }
  if (sizes.size() < 2) throw UsageError("--layers needs at least two sizes, e.g. 64,512,10");
  return sizes;
}

std::vector<Precision> parse_precisions(const std::string& text, std::int32_t layers) {
  std::vector<Precision> out;
  for (const std::string& item : split_list(text)) {
    if (item != "fp32" && item != "bf16") {
      throw UsageError("--precision: " + detail::excerpt(item) + " is neither fp32 nor bf16");
    }
    out.push_back(parse_precision(item));
  }
  if (out.size() == 1) out.assign(static_cast<std::size_t>(layers), out.front());
  if (static_cast<std::int32_t>(out.size()) != layers) {
    throw UsageError("--precision: " + std::to_string(out.size()) + " values for " +
                     std::to_string(layers) + " layers (give one, or one per layer)");
  }
  return out;
}

std::string join_sizes(const std::vector<std::int64_t>& sizes) {
  std::string out;
  for (const std::int64_t s : sizes) out += (out.empty() ? "" : ",") + std::to_string(s);
  return out;
}

void check_checkpoint_path(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    throw UsageError("--checkpoint " + path.string() + " is a directory; name a file");
  }
  // Saving renames a new file over the path: whatever was there is gone.
  if (!replaceable(path)) {
    throw UsageError("--checkpoint " + path.string() +
                     " is not a file (a device or pipe), which saving would replace");
  }
  if (fs::is_regular_file(path, ec) && fs::file_size(path, ec) != 0 &&
      !ModelMemory::is_checkpoint(path)) {
    throw UsageError("--checkpoint " + path.string() +
                     " is a file but not a sluice checkpoint, which saving would replace (remove "
                     "it, or name another file)");
  }
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) {
    throw UsageError("--checkpoint " + path.string() + ": the directory " + dir.string() +
                     " does not exist");
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    throw UsageError("--checkpoint " + path.string() + ": cannot write in " + dir.string() + ": " +
                     std::strerror(errno));
  }
}

TrainFlags add_train_options(CLI::App& app, TrainOptions& options) {
  TrainOptions* o = &options;  // as the options are registered elsewhere: o->name
  CLI::App* cmd =
      app.add_subcommand("train", "Train a sparse MLP or a byte-level GPT by weight streaming");
  cmd->add_option("--model", o->model, "mlp (on --dataset) or gpt (on --text)")
      ->check(CLI::IsMember({"mlp", "gpt"}));
  cmd->add_option(
         "--text", o->gpt.text,
         "GPT: a text file or a directory of them, gzip'd or not (default: what a resumed model "
         "was trained on, else $SLUICE_TEXT, else the fortunes scripts/sluice-setup fetches); the "
         "last 5% is held out")
      ->check(path_argument());
  cmd->add_option("--context", o->gpt.context, "GPT: bytes per sequence")
      ->check(number_range(1, 4096));
  cmd->add_option("--d-model", o->gpt.d_model, "GPT: width of the residual stream")
      ->check(number_range(1, 16384));
  cmd->add_option("--heads", o->gpt.heads, "GPT: attention heads (divide --d-model)")
      ->check(number_range(1, 1024));
  cmd->add_option("--blocks", o->gpt.blocks, "GPT: transformer blocks")
      ->check(number_range(1, 256));
  cmd->add_option("--steps", o->steps, "Stop after this many steps")
      ->check(number_range(std::int64_t{1}, std::int64_t{1} << 40));
  cmd->add_option("--max-seconds", o->max_seconds, "Stop after this much training time")
      ->check(positive_number());
  cmd->add_option("--dataset", o->dataset,
                  "digits, synthetic or a CSV file (last column the label: a class number, or a "
                  "class name, numbered in sorted order or as a resumed model learnt them; a "
                  "first line of names is a header); default: what a resumed model was trained "
                  "on, else digits if its file is found, else synthetic");
  cmd->add_option("--data", o->data, "The digits file (else $SLUICE_DIGITS or standard places)");
  cmd->add_option("--layers", o->layers,
                  "Layer sizes, e.g. 64,512,512,10 (default: features,512,512,classes)");
  auto* sparsity = cmd->add_option("--sparsity", o->sparsity, "Weight sparsity")
                       ->check(number_range(0.0, 0.999));
  auto* engines =
      cmd->add_option("--engines", o->engines, "Engines in the fabric (--fabric local only)")
          ->check(number_range(1, 256));
  cmd->add_option("--epochs", o->epochs, "Epochs")->check(number_range(1, 100000));
  cmd->add_option("--batch", o->batch, "Per step: tokens (MLP) or sequences (GPT; default 32)")
      ->check(number_range(1, 1 << 24));
  auto* optimizer = cmd->add_option("--optimizer", o->optimizer, "sgd, adam or adamw")
                        ->check(CLI::IsMember({"sgd", "adam", "adamw"}));
  auto* lr = cmd->add_option("--lr", o->lr, "Learning rate (default 2e-3; the GPT's 6e-3)")
                 ->check(positive_number());
  auto* seed = cmd->add_option("--seed", o->seed,
                               "Seed for weights, data split and shuffles (a resumed run "
                               "keeps its checkpoint's)")
                   ->check(non_negative_number());
  cmd->add_option("--checkpoint", o->checkpoint, "Save the model here at the end")
      ->check(path_argument());
  cmd->add_option("--resume", o->resume,
                  "Continue from this checkpoint: its optimizer (unless --optimizer or --lr "
                  "change it), seed and data order")
      ->check(path_argument());
  cmd->add_option("--threads", o->threads, "Threads per engine (default: cores / engines)")
      ->check(number_range(1, 4096));
  cmd->add_option("--path", o->path,
                  "How the engines multiply each layer: auto (the cost model's choice), sparse "
                  "(streamed) or dense (packets densified into tiles, oneDNN's matmul)")
      ->check(CLI::IsMember({"auto", "sparse", "dense"}));
  cmd->add_option("--memory-budget", o->memory_budget,
                  "Bytes the activations may take (0: no limit)")
      ->check(non_negative_number())
      ->check(within_available_memory());
  cmd->add_option("--prefetch", o->prefetch,
                  "Stream chunks prefetched ahead of the engines (overrides --prefetch-bytes)")
      ->check(number_range(1, 1024));
  cmd->add_option("--prefetch-bytes", o->prefetch_bytes,
                  "Stream bytes prefetched ahead of the engines (0: the whole next layer)")
      ->check(non_negative_number());
  cmd->add_option("--backward-order", o->backward_order,
                  "How a layer's weights stream in the backward pass: by_input (the transpose: "
                  "dY gathered once for both gradients), by_output (as in the forward pass), "
                  "or auto: by_input, unless a --model-store whose budget cannot keep the "
                  "model's transposed patterns would read them from disk every step")
      ->check(CLI::IsMember({"auto", "by_input", "by_output"}));
  cmd->add_option("--precision", o->precision,
                  "fp32 or bf16 (weights streamed and activations held in bf16, fp32 sums "
                  "and master weights), or one per layer: bf16,bf16,fp32; the GPT's "
                  "projections stream in one (its activations stay fp32)");
  cmd->add_option("--fabric", o->fabric,
                  "local: --engines engines in this process; mpi: run under mpirun, rank 0 "
                  "drives and every other rank is one engine")
      ->check(CLI::IsMember({"local", "mpi"}));
  auto* peer_timeout =
      cmd->add_option("--peer-timeout", o->peer_timeout,
                      "--fabric mpi: seconds a rank waits on a silent peer before every rank "
                      "exits (exit code 1) naming it (0: wait forever)")
          ->check(number_range(0.0, 1e6));
  add_schedule_options(*cmd, o->schedule);
  add_decay_options(*cmd, o->gpt.decay);
  cmd->add_flag("--json", o->json, "Print one JSON object on stdout (progress goes to stderr)");
  add_model_store_options(*cmd, o->store);

  TrainFlags flags;
  flags.cmd = cmd;
  flags.optimizer = optimizer;
  flags.lr = lr;
  flags.sparsity = sparsity;
  flags.engines = engines;
  flags.seed = seed;
  flags.peer_timeout = peer_timeout;
  return flags;
}

/// The fabric's options, for either model: those the run would silently ignore refused.
void check_fabric_options(const TrainOptions& o, const TrainFlags& flags) {
  if (o.fabric == "mpi" && flags.engines->count() > 0) {
    throw UsageError(
        "--engines cannot be given with --fabric mpi: every rank but rank 0 is one engine "
        "(choose their number with mpirun -np)");
  }
  if (!(o.peer_timeout >= 0)) throw UsageError("--peer-timeout must be a number of seconds >= 0");
  if (o.fabric != "mpi" && flags.peer_timeout->count() > 0) {
    throw UsageError("--peer-timeout needs --fabric mpi: a local fabric has no peers");
  }
}

void check_train_options(TrainOptions& options, const TrainFlags& flags) {
  TrainOptions* o = &options;
  const CLI::App* cmd = flags.cmd;
  check_fabric_options(*o, flags);
  if (o->model == "gpt") {
    check_gpt_options(*o, *cmd);
    return;
  }
  const CLI::Option* sparsity = flags.sparsity;
  for (const char* name : {"--text", "--context", "--d-model", "--heads", "--blocks"}) {
    if (cmd->count(name) > 0) throw UsageError(std::string(name) + " needs --model gpt");
  }
  // A run limited by steps or time goes on over as many epochs as that takes.
  if ((o->steps > 0 || o->max_seconds > 0) && cmd->count("--epochs") == 0) o->epochs = 100000;
  check_schedule_options(o->schedule, !o->resume.empty() || !o->store.directory.empty());
  if (!o->resume.empty() && sparsity->count() > 0) {
    throw UsageError("--sparsity cannot be given with --resume: the checkpoint's masks fix it");
  }
  check_model_store_options(o->store, !o->resume.empty(), !o->checkpoint.empty());
  if (!o->data.empty() && o->dataset != "auto" && o->dataset != "digits") {
    throw UsageError("--data names the digits file; with --dataset " + o->dataset +
                     " it would be ignored");
  }
}

}  // namespace sluice::cli
