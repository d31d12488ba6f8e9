#pragma once
// TieredModelMemory (Cerebras: MemoryX's DRAM + flash): a ModelMemory whose layers live
// in files under a directory — each layer's mask and transposed pattern, master weights,
// bias and optimizer state — with a RAM cache bounded by a byte budget. A model larger
// than RAM trains as long as one layer's working set fits the budget.
//
// The store is its own checkpoint. A step writes each updated layer's values and state to
// new files and commits by renaming a manifest over the old one (docs/model_store.md):
// a process killed at any moment leaves the store at its last committed step. Opening a
// store checks every section's CRC and refuses a corrupt or missing file with a message
// that names the file and the byte, changing nothing.
//
// Reads go in the order the executor streams: its prefetch opens layer l+1's stream
// while the engines take layer l's, and the cache keeps what was used last, so the
// forward's last layers are still there when the backward starts from the top.
#include <cstdint>
#include <filesystem>
#include <memory>

#include "sluice/model_memory.hpp"

namespace sluice {

/// The store's file I/O so far, summed over every thread.
struct ModelStoreCounters {
  std::uint64_t read_bytes = 0;
  std::uint64_t write_bytes = 0;
  double read_seconds = 0;   ///< spent in reads (their calls, not the waits for them)
  double write_seconds = 0;  ///< spent in writes and fsyncs
  double wait_seconds = 0;   ///< streams and optimizer waited for a layer to be read or for room
  std::uint64_t store_bytes = 0;  ///< the committed files' size
};

class TieredModelMemory final : public ModelMemory {
 public:
  /// Opens the store in `directory` (created if missing; a directory without a MANIFEST
  /// starts an empty model), with at most `budget_bytes` of layers in RAM. An existing
  /// store is checked in full first (FormatError/IoError naming the file; nothing is
  /// changed), then what a killed step left behind is removed. ResourceError if a layer
  /// needs more than the budget.
  TieredModelMemory(std::filesystem::path directory, std::int64_t budget_bytes);
  ~TieredModelMemory() override;

  /// True where `directory` holds a store (its MANIFEST): a reader that must not create
  /// one asks first.
  static bool holds_store(const std::filesystem::path& directory);

  const std::filesystem::path& directory() const;
  std::int64_t budget_bytes() const;
  /// RAM a layer needs at once (its cached patterns and values, its gradient and the
  /// optimizer's buffers): the least budget that trains it.
  static std::int64_t working_set_bytes(const LayerShape& shape);
  ModelStoreCounters counters() const;
  /// Commits `seed` and `epochs` to the store now (every step's commit and add_layer
  /// also does): what a trainer resuming from the store needs besides the model.
  void commit_counters();

 protected:
  std::int32_t add_layer_impl(CsrMatrix weights, std::vector<float> bias) override;
  std::int32_t layer_count_impl() const override;
  LayerShape layer_shape_impl(std::int32_t layer) const override;
  const std::vector<float>& bias_impl(std::int32_t layer) const override;
  const Placement& placement_impl(std::int32_t layer, std::int32_t lanes) override;
  void stream_to_impl(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                      std::size_t chunk_packets, Precision precision,
                      StreamOrder order) const override;
  void submit_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                            std::span<const float> bias_gradient) override;
  /// The micro-batches' sum waits in the layer's spill file (as a gradient does for the
  /// clipping norm) and is updated from at commit_step; a gradient whose update
  /// submit_gradient already computed is not added to (ShapeError).
  void accumulate_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                std::span<const float> bias_gradient) override;
  StepReport commit_step_impl() override;
  void discard_step_impl() override;
  void discard_gradient_impl(std::int32_t layer) override;
  /// The mask change commits to the store at once, as a step does.
  void regrow_impl(std::int32_t layer, std::span<const std::int64_t> grow) override;
  void set_optimizer_impl(const OptimizerConfig& config) override;
  const OptimizerConfig& optimizer_impl() const override;
  void set_non_finite_policy_impl(NonFinitePolicy policy) override;
  std::int64_t step_impl() const override;
  /// The store is the checkpoint: save and load refuse (UnsupportedError) and say so.
  void save_impl(const std::filesystem::path& path) const override;
  void load_impl(const std::filesystem::path& path) override;
  /// The budget: the executor bounds its gradients and prefetch beside it.
  std::int64_t ram_budget_bytes_impl() const override;
  /// The cache then holds at most the budget less the reserve. ResourceError, naming both
  /// and their sum, if the reserve does not leave the largest layer's working set room.
  void reserve_ram_bytes_impl(std::int64_t bytes) override;
  /// The budget less the largest layer's working set.
  std::int64_t reservable_ram_bytes_impl() const override;
  /// Whether the cache holds every layer's pieces beside the largest update.
  bool by_input_from_ram_impl() const override;

 private:
  void take_gradient(std::int32_t layer, const WeightStream& gradient,
                     std::span<const float> bias_gradient, bool add);

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace sluice
