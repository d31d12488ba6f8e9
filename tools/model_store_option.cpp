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

NewStoreCleanup::NewStoreCleanup(const ModelStoreOptions& o) {
  if (o.directory.empty() || TieredModelMemory::holds_store(o.directory)) return;
  directory_ = o.directory;
  std::error_code ec;
  for (std::filesystem::path p = std::filesystem::absolute(directory_, ec);
       !ec && !p.empty() && !std::filesystem::exists(p, ec) && !ec; p = p.parent_path()) {
    created_.push_back(p);
  }
  if (ec) return;  // where it cannot be told what is there, nothing is removed
  if (created_.empty()) {
    try {
      for (const auto& entry : std::filesystem::directory_iterator(directory_, ec)) {
        there_before_.insert(entry.path().filename());
      }
    } catch (const std::filesystem::filesystem_error&) {
      return;
    }
    if (ec) return;
  }
  active_ = true;
}

NewStoreCleanup::~NewStoreCleanup() {
  if (!active_) return;
  try {  // (a directory iterator's step throws: never out of a destructor)
    std::error_code ec;
    std::vector<std::filesystem::path> made;
    for (const auto& entry : std::filesystem::directory_iterator(directory_, ec)) {
      if (there_before_.count(entry.path().filename()) == 0) made.push_back(entry.path());
    }
    for (const std::filesystem::path& file : made) std::filesystem::remove(file, ec);
    // Not recursive: a directory the run made holds only what it made, or it stays.
    for (const std::filesystem::path& dir : created_) std::filesystem::remove(dir, ec);
  } catch (const std::exception&) {  // what is left is an empty store, as before
  }
}

std::int64_t drawn_nnz_bound(std::int64_t rows, std::int64_t cols, double sparsity) {
  const double cells = static_cast<double>(rows) * static_cast<double>(cols);
  const double density = 1.0 - sparsity;
  return std::min<std::int64_t>(
      rows * cols, std::llround(density * cells + 6.0 * std::sqrt(cells * density * sparsity)) + 1);
}

namespace {

std::string too_small(const ModelStoreOptions& o) {
  return "--model-memory-budget " + std::to_string(o.budget) + " is too small: ";
}

}  // namespace

std::int64_t check_layers_fit(const ModelStoreOptions& o, const std::vector<LayerShape>& shapes,
                              std::size_t* largest_layer) {
  std::int64_t largest = 0;
  for (std::size_t l = 0; l < shapes.size(); ++l) {
    const LayerShape& s = shapes[l];
    const std::int64_t need = TieredModelMemory::working_set_bytes(s);
    if (need > o.budget) {
      throw UsageError(too_small(o) + "layer " + std::to_string(l) + " (" + std::to_string(s.rows) +
                       "x" + std::to_string(s.cols) + ", up to " + std::to_string(s.nnz) +
                       " non-zeros) needs " + std::to_string(need) + " bytes of RAM at once");
    }
    if (need > largest) {
      largest = need;
      if (largest_layer != nullptr) *largest_layer = l;
    }
  }
  return largest;
}

void check_model_store_budget(const ModelStoreOptions& o, const std::vector<std::int64_t>& sizes,
                              double sparsity, const ExecutorOptions& executor,
                              std::int32_t engines) {
  if (o.directory.empty()) return;
  std::vector<LayerShape> shapes;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    const std::int64_t rows = sizes[l + 1], cols = sizes[l];
    shapes.push_back({rows, cols, drawn_nnz_bound(rows, cols, sparsity), rows});
  }
  std::size_t largest_layer = 0;
  const std::int64_t largest = check_layers_fit(o, shapes, &largest_layer);
  const std::int64_t beside = executor_ram_beside_memory(shapes, executor, engines, o.budget);
  if (largest + beside > o.budget) {
    throw UsageError(too_small(o) + "layer " + std::to_string(largest_layer) + "'s working set (" +
                     std::to_string(largest) +
                     " bytes) and what training holds beside the "
                     "store (the layer's stream and its gradients) need at least " +
                     std::to_string(executor_least_ram_budget(shapes, executor, engines, largest)));
  }
}

std::unique_ptr<LayerStreamingExecutor> make_executor(ModelMemory& memory, Fabric& fabric,
                                                      const ExecutorOptions& executor,
                                                      const ModelStoreOptions& o) {
  try {
    return std::make_unique<LayerStreamingExecutor>(memory, fabric, executor);
  } catch (const ResourceError& e) {
    if (o.directory.empty()) throw;
    throw UsageError("--model-memory-budget " + std::to_string(o.budget) +
                     " is too small: " + e.what());
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
