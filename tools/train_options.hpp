#pragma once
// `sluice train`'s command line: its options, their registration and the checks that need
// no data (every flag it would ignore refused before anything starts), apart from the run
// (cmd_train.cpp) so the fuzz target can parse and check without training.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "commands.hpp"
#include "dynamic_schedule.hpp"
#include "model_store_option.hpp"
#include "sluice/engine.hpp"
#include "train_gpt.hpp"

namespace sluice::cli {

struct TrainOptions {
  std::string dataset = "auto";
  std::string data;
  std::string layers;
  double sparsity = 0.9;
  int engines = 1;
  int epochs = 30;
  std::int64_t batch = 32;
  std::string optimizer = "adam";
  double lr = 2e-3;
  std::uint64_t seed = 1;
  std::string checkpoint, resume;
  bool json = false;
  int threads = 0;
  std::string path = "auto";
  std::int64_t memory_budget = 0;
  std::size_t prefetch = 0;
  std::int64_t prefetch_bytes = 0;
  std::string backward_order = "auto";
  std::string fabric = "local";
  double peer_timeout = 60;
  std::string precision = "fp32";
  ScheduleOptions schedule;  ///< --dynamic and its options
  ModelStoreOptions store;
  std::string model = "mlp";
  std::int64_t steps = 0;  ///< 0: the epochs decide
  double max_seconds = 0;  ///< 0: no time limit
  GptTrainOptions gpt;     ///< --model gpt's own options
};

/// The options whose presence (not only their value) the checks and the run ask about.
struct TrainFlags {
  CLI::App* cmd = nullptr;
  CLI::Option *optimizer = nullptr, *lr = nullptr, *sparsity = nullptr, *engines = nullptr,
              *seed = nullptr, *peer_timeout = nullptr;
};

/// Adds `train` and its options (into `options`) to `app`.
TrainFlags add_train_options(CLI::App& app, TrainOptions& options);

/// UsageError for options that do not go together or that the run would ignore; sets
/// what the options imply (a run limited by steps or time goes on over the epochs).
void check_train_options(TrainOptions& options, const TrainFlags& flags);

/// "64,512,10" -> {64, 512, 10}; UsageError unless at least two positive sizes.
std::vector<std::int64_t> parse_layers(const std::string& text);
/// "fp32", "bf16", or one of them per layer, comma-separated.
std::vector<Precision> parse_precisions(const std::string& text, std::int32_t layers);
/// {64, 512, 10} -> "64,512,10".
std::string join_sizes(const std::vector<std::int64_t>& sizes);
/// Refuses a --checkpoint the end of the run could not write, before any training: the
/// save writes a temporary file beside it and renames it over the path.
void check_checkpoint_path(const std::filesystem::path& path);

}  // namespace sluice::cli
