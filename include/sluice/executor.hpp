#pragma once
// The LayerStreamingExecutor drives a stack of sparse linear layers (weights in
// ModelMemory) through forward and backward passes on a Fabric's engines.
//
// A step first loads each engine's shard of the batch into the engine's activation store
// (see activation_store.hpp); from then on the executor holds no activations: it runs
// layer operations over the fabric, which carry weights out and gradients and scalars
// back. Forward: layer by layer, ModelMemory streams the weights into a bounded channel
// from a producer task (capacity: the prefetch budget) while the engines take them in;
// the producers of the streams after it start while the engines still work on this one
// (streams are opened a largest layer ahead, so a small last layer's successor, its
// backward stream, is produced during the forward pass). Every engine
// keeps its pre-activations Z and activations A of every layer for the backward pass.
// Backward: the weights stream again (the first layer: the mask alone, no dX); the fabric
// sums the engines' gradient streams; the executor hands each layer's gradient to
// ModelMemory::submit_gradient on a task of its own, so the optimizer works on layer l
// while the engines work on layer l-1; commit_step() ends the step.
//
// A batch is split over the engines by tokens, in contiguous ranges. The loss is the mean
// over all tokens of the batch, so the gradients the fabric sums are those of that mean
// and N engines compute the same math as one.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "sluice/activation_store.hpp"
#include "sluice/dense.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"

namespace sluice {

/// A batch: features x tokens, with integer labels (cross-entropy) or dense targets
/// (outputs x tokens, MSE).
struct Batch {
  ConstMatrixView features;
  std::vector<int> labels;
  std::optional<ConstMatrixView> targets;
};

/// The most a layer's channel prefetches by default (prefetch_bytes 0).
inline constexpr std::int64_t kMaxPrefetchBytes = std::int64_t{256} << 20;
/// Over a ModelMemory in bounded RAM (ModelMemory::ram_budget_bytes), by default a
/// layer's channel prefetches at most this fraction of that budget (two channels are open
/// at a time: the layer the engines take and the next).
inline constexpr std::int64_t kBoundedPrefetchShare = 32;

struct ExecutorOptions {
  /// One per layer; empty = ReLU on every hidden layer, none on the last.
  std::vector<Activation> activations;
  Loss loss = Loss::softmax_cross_entropy;
  /// One per layer; empty = fp32 everywhere. A bf16 layer streams its weights in bf16
  /// (half the bytes) and the engines hold its input activations in bf16; sums, outputs,
  /// gradients and ModelMemory's master weights stay fp32.
  std::vector<Precision> precisions;
  /// Bytes of a layer's weight stream that may wait ahead of the engines (each layer's
  /// channel holds that much: the next layer's stream is produced while the engines work
  /// on this one). 0 = the whole layer, up to kMaxPrefetchBytes (and, over a ModelMemory
  /// in bounded RAM, 1/kBoundedPrefetchShare of its budget).
  std::int64_t prefetch_bytes = 0;
  /// The budget in chunks instead (as before bytes): nonzero overrides prefetch_bytes.
  std::size_t prefetch_depth = 0;
  std::size_t chunk_packets = kDefaultChunkPackets;
  /// Bytes the resident activations may take over all engines; 0 = no limit.
  std::int64_t memory_budget_bytes = 0;
  /// Masks that change during training (train_step only): after each update step's
  /// commit, every layer is pruned and regrown (ModelMemory::regrow). RigL's scores are
  /// taken from that step's activations during its backward pass.
  DynamicSparsity dynamic;
  /// The order of the backward streams of the layers past the first. By input, the
  /// engines gather dY once for both gradients (the faster product); by output, the
  /// layer streams as in the forward pass, from the mask and values alone. Unset: by input
  /// where ModelMemory::by_input_from_ram(), else by output, which spares a bounded
  /// ModelMemory reading each layer's transposed pattern from storage every step. A
  /// layer that cannot stream by input (see backward_order()) streams by output.
  std::optional<StreamOrder> backward_order;
};

/// Counters of one step, or summed over all steps (see LayerStreamingExecutor::totals).
struct StepMetrics {
  double wall_seconds = 0;
  double engine_busy_seconds = 0;    ///< EngineCounters::busy_seconds over all engines
  double engine_thread_seconds = 0;  ///< wall_seconds x engine threads (the busy fraction's base)
  double stream_wait_seconds = 0;    ///< time the engines' intake waited for the next chunk
  double optimizer_seconds = 0;      ///< StepReport::seconds
  std::uint64_t stream_packets = 0;  ///< packets streamed out of ModelMemory
  std::uint64_t stream_bytes = 0;
  std::int64_t tokens = 0;
  std::int64_t mask_updates = 0;   ///< steps after which the masks changed
  double mask_update_seconds = 0;  ///< RigL's scores and the regrowth (in wall_seconds)
  double mask_score_seconds = 0;   ///< of which RigL's scores (the streaming top-k)
  std::int64_t steps = 0;          ///< train steps counted (1 for one step's metrics)
  /// What the driver moved through the fabric (FabricCounters), summed.
  std::uint64_t driver_bytes_sent = 0;
  std::uint64_t driver_bytes_received = 0;
  /// EngineCounters::stream_arrival_seconds and overlapped_seconds over all engines.
  double stream_arrival_seconds = 0;
  double overlapped_seconds = 0;
  /// Wall time of the fabric's layer operations (each layer's forward and backward, all
  /// engines together): the engines' passes. The rest of wall_seconds is the step's own
  /// work between them (loading the batch, the loss, opening streams, the commit).
  double pass_seconds = 0;

  double engine_busy() const {
    return engine_thread_seconds > 0 ? engine_busy_seconds / engine_thread_seconds : 0;
  }
  double packets_per_second() const { return wall_seconds > 0 ? stream_packets / wall_seconds : 0; }
  double bytes_per_second() const { return wall_seconds > 0 ? stream_bytes / wall_seconds : 0; }
  double tokens_per_second() const { return wall_seconds > 0 ? tokens / wall_seconds : 0; }
  double driver_bytes_sent_per_step() const {
    return steps > 0 ? static_cast<double>(driver_bytes_sent) / static_cast<double>(steps) : 0;
  }
  double driver_bytes_received_per_step() const {
    return steps > 0 ? static_cast<double>(driver_bytes_received) / static_cast<double>(steps) : 0;
  }
  /// The fraction of the layers' stream arrival time during which the engine computed.
  double overlap() const {
    return stream_arrival_seconds > 0 ? overlapped_seconds / stream_arrival_seconds : 0;
  }
  /// wall_seconds over pass_seconds: how much longer a step takes than its passes.
  double step_over_passes() const { return pass_seconds > 0 ? wall_seconds / pass_seconds : 0; }
  StepMetrics& operator+=(const StepMetrics& other);
};

struct StepResult {
  double loss = 0;
  double accuracy = 0;  ///< fraction of argmax == label (cross-entropy only)
  StepReport report;
  StepMetrics metrics;
};

struct Evaluation {
  double loss = 0;
  double accuracy = 0;
  std::int64_t tokens = 0;
};

/// One layer's gradient summed over the batch (as ModelMemory receives it).
struct LayerGradient {
  CsrMatrix weights;
  std::vector<float> bias;
};

class LayerStreamingExecutor {
 public:
  /// The model is every layer in `memory`, in order; shapes must chain
  /// (layer l's rows = layer l+1's columns), else ShapeError.
  LayerStreamingExecutor(ModelMemory& memory, Fabric& fabric, ExecutorOptions options = {});
  ~LayerStreamingExecutor();

  /// Forward, backward, gradients to ModelMemory, commit_step.
  StepResult train_step(const Batch& batch);
  /// The same for samples of the data set attached to the fabric (Fabric::attach_dataset):
  /// the engines take the samples' features and labels from their own copy of the set,
  /// so only the indices cross the fabric (cross-entropy only).
  StepResult train_step_samples(std::span<const std::int64_t> samples);
  /// Forward and backward only: the gradients of the batch's mean loss, per layer.
  std::vector<LayerGradient> gradients(const Batch& batch, double* loss = nullptr);
  /// The last layer's output (outputs x tokens) after its activation.
  DenseMatrix infer(ConstMatrixView features);
  /// Mean loss and accuracy over a data set, in batches of `batch_tokens`.
  Evaluation evaluate(const Batch& data, std::int64_t batch_tokens = 1024);

  /// Bytes of resident activations (Z and A of every layer, two backward buffers) that a
  /// batch of `tokens` needs over all engines' stores.
  std::int64_t activation_bytes(std::int64_t tokens, bool training = true) const;

  /// The order layer `layer`'s backward stream takes (the first layer's: by output, its
  /// mask alone). By input needs at most 65535 outputs in bf16 (the tags' range) and at
  /// most 2^32 non-zeros (transposed positions are 32-bit).
  StreamOrder backward_order(std::int32_t layer) const;

  const StepMetrics& totals() const { return totals_; }
  std::int32_t layer_count() const;
  std::int64_t input_features() const;
  std::int64_t output_features() const;

 private:
  struct Impl;
  using StepRunner =
      std::function<LossSums(const std::function<void(std::int32_t, ReducedGradient&&)>& submit)>;
  /// A train step: `run` loads the batch, runs it and submits each layer's gradient.
  StepResult train(std::int64_t tokens, const StepRunner& run);
  std::unique_ptr<Impl> impl_;
  StepMetrics totals_;
};

/// The most RAM a LayerStreamingExecutor with `options` over `engines` engines holds beside
/// a ModelMemory in bounded RAM (ModelMemory::ram_budget_bytes, here `ram_budget_bytes`)
/// whose layers have `shapes`: the largest layer's stream, kept whole for its pass, the
/// engines' gradients of it and the reduced one, two channels' prefetch, and the freed
/// stream buffers kept for reuse (kChunkMemoryKeptBytes at most). The executor
/// asks the ModelMemory to keep that much of its budget free (reserve_ram_bytes); a budget
/// that cannot, beside its largest layer's working set, is refused there.
std::int64_t executor_ram_beside_memory(std::span<const LayerShape> shapes,
                                        const ExecutorOptions& options, std::int32_t engines,
                                        std::int64_t ram_budget_bytes);
/// The least budget B that holds `working_set_bytes` (a ModelMemory's largest layer's,
/// e.g. TieredModelMemory::working_set_bytes) and executor_ram_beside_memory(..., B)
/// beside it; the prefetch grows with the budget, so this is a little more than the sum at
/// the working set alone.
std::int64_t executor_least_ram_budget(std::span<const LayerShape> shapes,
                                       const ExecutorOptions& options, std::int32_t engines,
                                       std::int64_t working_set_bytes);

/// The sizes of the network `memory`'s layers make: its inputs, then each layer's
/// outputs. ShapeError, naming the layer, unless there is at least one layer and each
/// takes the outputs of the one below (what a LayerStreamingExecutor needs).
std::vector<std::int64_t> mlp_sizes(const ModelMemory& memory);

/// Adds a sparse MLP to `memory`: layer l is sizes[l+1] x sizes[l] at `sparsity`, random
/// pattern, He-scaled uniform values (variance 2 / expected fan-in), zero biases. Seeded.
void build_sparse_mlp(ModelMemory& memory, const std::vector<std::int64_t>& sizes, double sparsity,
                      std::uint64_t seed);

}  // namespace sluice
