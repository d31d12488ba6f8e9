// `sluice generate`: text sampled from a GPT checkpoint (`sluice train --model gpt
// --checkpoint FILE`) or model store (`--model-store DIR`), a byte at a time.
#include <unistd.h>

#include <iostream>
#include <string>

#include "commands.hpp"
#include "measure.hpp"
#include "model_kind.hpp"
#include "model_store_option.hpp"
#include "number_options.hpp"
#include "output_files.hpp"
#include "sluice/error.hpp"
#include "sluice/fabric.hpp"
#include "sluice/gpt.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/tiered_model_memory.hpp"
#include "terminal_text.hpp"

namespace sluice::cli {
namespace {

struct GenerateOptions {
  std::string checkpoint;
  ModelStoreOptions store;
  std::string prompt;
  std::int64_t bytes = 200;
  double temperature = 1.0;
  std::uint64_t seed = 1;
  int threads = 0;
  std::string controls = "auto";
};

}  // namespace

Command add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd =
      app.add_subcommand("generate", "Sample text from a GPT checkpoint or model store");
  CLI::Option* checkpoint =
      cmd->add_option("--checkpoint", o->checkpoint, "The checkpoint of sluice train --model gpt")
          ->check(path_argument());
  cmd->add_option("--model-store", o->store.directory,
                  "The model store of sluice train --model gpt --model-store (read, not created)")
      ->check(path_argument())
      ->excludes(checkpoint);
  o->store.budget_option = cmd->add_option("--model-memory-budget", o->store.budget,
                                           "Bytes of model the store keeps in RAM (default 2 GiB)")
                               ->check(positive_number())
                               ->check(within_available_memory());
  cmd->add_option("--prompt", o->prompt, "The text to continue (default: none)");
  cmd->add_option("--bytes", o->bytes, "Bytes to generate")
      ->check(number_range(std::int64_t{0}, std::int64_t{1} << 24));
  cmd->add_option("--temperature", o->temperature,
                  "Sampling temperature; 0 takes the most likely byte")
      ->check(number_range(0.0, 100.0));
  cmd->add_option("--seed", o->seed, "Seed of the sampling: the same seed, the same text")
      ->check(non_negative_number());
  cmd->add_option("--threads", o->threads, "Threads of the engine (default: every core)")
      ->check(number_range(1, 4096));
  cmd->add_option("--controls", o->controls,
                  "Control bytes and bytes that are not UTF-8: written as \\xHH on a terminal "
                  "(auto), always (escape), or as generated (raw)")
      ->check(CLI::IsMember({"auto", "escape", "raw"}));
  auto check = [o] {
    check_model_store_options(o->store, false, false);
    if (o->checkpoint.empty() == o->store.directory.empty()) {
      throw UsageError("generate needs --checkpoint FILE or --model-store DIR");
    }
  };
  auto run = [o] {
    if (!o->store.directory.empty() && !TieredModelMemory::holds_store(o->store.directory)) {
      throw IoError("no model store at " + o->store.directory + " (it has no MANIFEST)");
    }
    const std::unique_ptr<ModelMemory> owner = make_model_memory(o->store);
    ModelMemory& memory = *owner;
    if (!o->checkpoint.empty()) memory.load(o->checkpoint);
    const std::string source =
        o->checkpoint.empty() ? "model store " + o->store.directory : "checkpoint " + o->checkpoint;
    require_gpt(memory, source, "sluice generate samples text from a GPT alone");
    GptConfig config;
    try {
      config = gpt_config_of(memory);
    } catch (const FormatError& e) {
      throw FormatError(source + " holds no GPT: " + e.what());
    }
    LocalFabricOptions fo;
    fo.engine.threads = o->threads > 0 ? runnable_threads(o->threads, "generate") : 0;
    LocalFabric fabric(fo);
    GptModel model(memory, fabric, config);
    const std::string text =
        o->prompt + generate_text(model, o->prompt, o->bytes, o->temperature, o->seed);
    const bool escape =
        o->controls == "escape" || (o->controls == "auto" && isatty(STDOUT_FILENO) == 1);
    std::cout << (escape ? escape_for_terminal(text) : text) << "\n";
    return 0;
  };
  return {check, run};
}

}  // namespace sluice::cli
