#pragma once
// The checkpoint targets' common step: a model of one layer loads the fuzz file.
#include <cstdlib>
#include <filesystem>

#include "sluice/error.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::fuzz {

/// Loads `path` into `memory`, given one 3x4 layer first: true when it loaded. A refused
/// load (a sluice::Error; anything else escapes to libFuzzer) must change nothing.
inline bool load_checked(const std::filesystem::path& path, HostModelMemory& memory) {
  memory.add_layer(CsrMatrix::random(3, 4, 0.5, 7), {0.5F, -0.5F, 1.0F});
  try {
    memory.load(path);
    return true;
  } catch (const Error&) {
    if (memory.layer_count() != 1 || memory.weights(0).rows() != 3) std::abort();
    return false;
  }
}

}  // namespace sluice::fuzz
