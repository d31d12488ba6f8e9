#pragma once
// `sluice train --model-store DIR [--model-memory-budget BYTES]`: the model in a
// TieredModelMemory store instead of RAM, and what the run reports about its disk.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "commands.hpp"
#include "json_writer.hpp"
#include "sluice/executor.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::cli {

struct ModelStoreOptions {
  std::string directory;
  std::int64_t budget = std::int64_t{2} << 30;
  CLI::Option* budget_option = nullptr;
};

void add_model_store_options(CLI::App& cmd, ModelStoreOptions& o);
/// UsageError for an option the store makes meaningless (`--resume`, `--checkpoint`:
/// the store is the checkpoint) or a budget without a store.
void check_model_store_options(const ModelStoreOptions& o, bool resume, bool checkpoint);
/// A HostModelMemory, or the store opened (created if new; resumed if it holds a model).
/// A budget too small for one of the store's layers is a UsageError naming it.
std::unique_ptr<ModelMemory> make_model_memory(const ModelStoreOptions& o);
/// The store a training run creates, removed again if the run ends before its model is
/// built (data that does not fit, a budget too small, a text that cannot be read): a
/// refused first run leaves no empty or half-built store that the next run would take for
/// a model to resume, and no directory the user did not have. Only what the run made goes:
/// the files that were not in the directory before, the directories it created. Made
/// before make_model_memory and declared before its ModelMemory, so that the store is
/// closed when this looks at it.
class NewStoreCleanup {
 public:
  explicit NewStoreCleanup(const ModelStoreOptions& o);
  ~NewStoreCleanup();
  NewStoreCleanup(const NewStoreCleanup&) = delete;
  NewStoreCleanup& operator=(const NewStoreCleanup&) = delete;
  /// The model is in the store: it stays, whatever happens to the run.
  void keep() { active_ = false; }

 private:
  bool active_ = false;  ///< a store is being created and the model is not built yet
  std::filesystem::path directory_;
  std::set<std::filesystem::path> there_before_;
  std::vector<std::filesystem::path> created_;  ///< directories, the innermost first
};

/// The most non-zeros a rows x cols mask drawn at `sparsity` (CsrMatrix::random) is taken
/// to have: its count varies around the mean, and six standard deviations are spared, so
/// that a budget this passes is not refused once the model is built.
std::int64_t drawn_nnz_bound(std::int64_t rows, std::int64_t cols, double sparsity);
/// UsageError, before a new store is built, if one of `shapes` would need more RAM at once
/// than the budget; the largest working set, and its layer in `largest_layer`.
std::int64_t check_layers_fit(const ModelStoreOptions& o, const std::vector<LayerShape>& shapes,
                              std::size_t* largest_layer = nullptr);
/// UsageError, before a new store is built, if a layer of the MLP `sizes` at `sparsity`
/// would need more RAM at once than the budget, or the largest layer's working set and
/// what an executor with `executor` over `engines` engines holds beside the store would
/// (nothing for a ModelMemory in RAM).
void check_model_store_budget(const ModelStoreOptions& o, const std::vector<std::int64_t>& sizes,
                              double sparsity, const ExecutorOptions& executor,
                              std::int32_t engines);
/// The executor over `memory`, a ResourceError of a store whose budget cannot hold what
/// the executor holds beside it made a UsageError naming the budget.
std::unique_ptr<LayerStreamingExecutor> make_executor(ModelMemory& memory, Fabric& fabric,
                                                      const ExecutorOptions& executor,
                                                      const ModelStoreOptions& o);
/// Commits ModelMemory::seed and epochs to a model store (nothing for one in RAM).
void commit_store_counters(ModelMemory& memory);
/// model_store_bytes, disk_read_bytes_per_s, disk_write_bytes_per_s, disk_wait_seconds
/// (nothing for a ModelMemory in RAM).
void add_model_store_fields(JsonWriter& j, const ModelMemory& memory);

}  // namespace sluice::cli
