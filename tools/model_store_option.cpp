#include "model_store_option.hpp"

#include "number_options.hpp"

#include <cmath>

#include "sluice/tiered_model_memory.hpp"

namespace sluice::cli {

void add_model_store_options(CLI::App& cmd, ModelStoreOptions& o) {
  cmd.add_option("--model-store", o.directory,
                 "Keep the model in files under this directory, with a bounded RAM cache; "
                 "creates the store, or resumes the model it holds (it is its own checkpoint)");
  o.budget_option = cmd.add_option("--model-memory-budget", o.budget,
                                   "Bytes of model the store keeps in RAM (default 2 GiB)")
                        ->check(positive_number())
                        ->check(within_available_memory());
}

void check_model_store_options(const ModelStoreOptions& o, bool resume, bool checkpoint) {
  if (o.directory.empty()) {
    if (o.budget_option != nullptr && o.budget_option->count() > 0) {
      throw UsageError("--model-memory-budget needs --model-store");
    }
    return;
  }
  if (resume || checkpoint) {
    throw UsageError(
        "--model-store cannot be given with --resume or --checkpoint: the store is its own "
        "checkpoint (every step commits to it; run again with the same --model-store to "
        "resume)");
  }
}

std::unique_ptr<ModelMemory> make_model_memory(const ModelStoreOptions& o) {
  if (o.directory.empty()) return std::make_unique<HostModelMemory>();
  try {
    return std::make_unique<TieredModelMemory>(o.directory, o.budget);
  } catch (const ResourceError& e) {
    throw UsageError("--model-memory-budget " + std::to_string(o.budget) +
                     " is too small: " + e.what());
  }
}

void check_model_store_budget(const ModelStoreOptions& o, const std::vector<std::int64_t>& sizes,
                              double sparsity) {
  if (o.directory.empty()) return;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    LayerShape s;
    s.rows = sizes[l + 1];
    s.cols = sizes[l];
    // CsrMatrix::random's expected count; the store refuses the exact one when it is added.
    s.nnz =
        std::llround((1.0 - sparsity) * static_cast<double>(s.rows) * static_cast<double>(s.cols));
    s.bias = s.rows;
    const std::int64_t need = TieredModelMemory::working_set_bytes(s);
    if (need > o.budget) {
      throw UsageError(
          "--model-memory-budget " + std::to_string(o.budget) + " is too small: layer " +
          std::to_string(l) + " (" + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
          ", about " + std::to_string(s.nnz) + " non-zeros) needs " + std::to_string(need) +
          " bytes of RAM at once; the store " + o.directory + " was left without a model");
    }
  }
}

void commit_store_counters(ModelMemory& memory) {
  if (auto* tiered = dynamic_cast<TieredModelMemory*>(&memory)) tiered->commit_counters();
}

void add_model_store_fields(JsonWriter& j, const ModelMemory& memory) {
  const auto* tiered = dynamic_cast<const TieredModelMemory*>(&memory);
  if (tiered == nullptr) return;
  const ModelStoreCounters c = tiered->counters();
  auto rate = [](std::uint64_t bytes, double seconds) {
    return seconds > 0 ? static_cast<double>(bytes) / seconds : 0.0;
  };
  j.field("model_store_bytes", static_cast<std::int64_t>(c.store_bytes));
  j.field("disk_read_bytes_per_s", rate(c.read_bytes, c.read_seconds));
  j.field("disk_write_bytes_per_s", rate(c.write_bytes, c.write_seconds));
  j.field("disk_wait_seconds", c.wait_seconds);
}

}  // namespace sluice::cli
