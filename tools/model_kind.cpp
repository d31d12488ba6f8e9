#include "model_kind.hpp"

#include "commands.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"
#include "train_options.hpp"

namespace sluice::cli {

void require_gpt(const ModelMemory& memory, const std::string& source, const std::string& hint) {
  if (!memory.model.empty() || memory.layer_count() == 0) return;  // gpt_config_of checks it
  std::string what = std::to_string(memory.layer_count()) + " layers";
  try {
    what = "layers " + join_sizes(mlp_sizes(memory));
  } catch (const ArgumentError&) {  // not even a stack of layers: counted
  }
  throw UsageError(source + " holds an MLP (" + what + "), not a GPT: " + hint);
}

void require_mlp(const ModelMemory& memory, const std::string& source) {
  if (memory.model.empty()) return;
  throw UsageError(source + " holds a " + memory.model + ", not an MLP: train it with --model gpt");
}

}  // namespace sluice::cli
