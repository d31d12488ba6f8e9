#pragma once
// Which kind of model a resumed checkpoint or store holds, checked before a command
// treats it as the other: an MLP given to --model gpt or generate, a GPT given to an
// MLP's training. Wrong flags for good data: a UsageError that says what it holds.
#include <string>

#include "sluice/model_memory.hpp"

namespace sluice::cli {

/// UsageError unless `memory`, loaded from `source` ("checkpoint PATH" or "model store
/// DIR"), holds a GPT (or nothing yet); `hint` says what to do with an MLP instead.
void require_gpt(const ModelMemory& memory, const std::string& source, const std::string& hint);
/// UsageError unless `memory` holds a stack of layers (an MLP): a GPT is named, and how to
/// train it.
void require_mlp(const ModelMemory& memory, const std::string& source);

}  // namespace sluice::cli
