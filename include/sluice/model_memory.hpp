#pragma once
// ModelMemory (Cerebras: MemoryX) owns every layer's sparse weights, bias, mask,
// placement and optimizer state. It streams weights out, takes gradient streams in,
// and runs the optimizer itself, elementwise and sharded over threads.
//
// A training step is atomic: submit_gradient() may compute each layer's update as soon
// as its gradient arrives (so the optimizer works on layer l while the engines work on
// layer l-1), but nothing becomes visible until commit_step(), which applies every
// layer's update or, if any gradient was not finite, none.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sluice/csr_matrix.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/error.hpp"
#include "sluice/optimizer.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace sluice {

/// A non-finite gradient under NonFinitePolicy::error.
class NumericError : public Error {
 public:
  using Error::Error;
};

/// A layer's shape: `rows` outputs x `cols` inputs, `nnz` non-zeros, `bias` elements (0
/// or rows). What a caller needs to plan a layer without holding its weights.
struct LayerShape {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t nnz = 0;
  std::int64_t bias = 0;
};

struct StepReport {
  bool applied = false;
  std::int64_t step = 0;                 ///< optimizer steps applied so far
  std::vector<std::int32_t> bad_layers;  ///< layers whose gradient had a NaN or Inf
  double gradient_norm = 0;              ///< global L2 norm before clipping
  double seconds = 0;                    ///< optimizer time spent in this step
};

class ModelMemory {
 public:
  virtual ~ModelMemory() = default;

  /// Adds a layer (weights validated; bias empty or of size rows); returns its index.
  std::int32_t add_layer(CsrMatrix weights, std::vector<float> bias = {});
  std::int32_t layer_count() const { return layer_count_impl(); }
  LayerShape layer_shape(std::int32_t layer) const;
  /// The layer as an in-RAM matrix: only from an implementation that keeps it so
  /// (HostModelMemory); the others throw ShapeError (stream the layer instead).
  const CsrMatrix& weights(std::int32_t layer) const;
  const std::vector<float>& bias(std::int32_t layer) const;

  /// The layer's placement on `lanes` lanes (planned once, then kept with the layer).
  const Placement& placement(std::int32_t layer, std::int32_t lanes);

  /// The layer's stream: weights, or the mask alone (`StreamKind::mask`), by output (W,
  /// for the forward pass) or by input (W^T, for the backward pass; see StreamOrder). The
  /// master values stay fp32; in bf16 they are rounded as they are streamed (half the
  /// bytes). By input they are read through the layer's transposed pattern (built on
  /// first use and kept, like its placements): no second copy of the weights is kept.
  WeightStream stream(std::int32_t layer, StreamKind kind = StreamKind::weights,
                      Precision precision = Precision::fp32,
                      StreamOrder order = StreamOrder::by_output) const;
  /// The same, chunk by chunk into a bounded channel (closes it at the end, or fails it).
  /// Chunks are encoded one at a time as the channel takes them. Never throws: every
  /// error, a bad argument included, reaches the consumer through `channel.fail()`.
  void stream_to(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                 std::size_t chunk_packets = kDefaultChunkPackets,
                 Precision precision = Precision::fp32,
                 StreamOrder order = StreamOrder::by_output) const;
  /// The header of the layer's stream of `kind` (for a ChannelStreamSource). Gradient
  /// streams are always fp32.
  StreamHeader stream_header(std::int32_t layer, StreamKind kind = StreamKind::weights,
                             Precision precision = Precision::fp32,
                             StreamOrder order = StreamOrder::by_output) const;
  /// The layer's transposed pattern: what it is streamed by input with. Like weights(),
  /// only from an implementation that keeps it in RAM.
  const TransposedPattern& transposed(std::int32_t layer) const;

  /// Hands in one layer's gradient for the current step: the gradient stream (same mask
  /// and order as the weight stream it answers, by output or by input) and the bias
  /// gradient (empty if the layer has none). Checks shape and pattern (FormatError),
  /// records whether all values are finite, and may compute the update right away.
  /// Thread-safe for different layers.
  void submit_gradient(std::int32_t layer, const WeightStream& gradient,
                       std::span<const float> bias_gradient);
  /// The same for micro-batches: adds the gradient to what this layer was handed in this
  /// step, as torch sums `.grad` over backward passes; the update is that of the sum
  /// (float adds, in the order the calls came), computed once, by commit_step. A rejected
  /// stream leaves what was handed in before. An implementation that cannot add takes the
  /// first and refuses a second as submit_gradient does.
  void accumulate_gradient(std::int32_t layer, const WeightStream& gradient,
                           std::span<const float> bias_gradient);
  /// Applies every submitted layer's update, or none if a gradient was not finite
  /// (see NonFinitePolicy). Layers with no submitted gradient are left as they are.
  StepReport commit_step();
  /// Drops every gradient submitted since the last commit_step(): for a step that failed
  /// half-way (an engine or a submit threw), so the next step starts clean. Weights,
  /// optimizer state and the step count are unchanged.
  void discard_step();
  /// Drops what was handed in for `layer` since the last commit_step (a micro-batches'
  /// sum included), nothing if none; the other layers' stay (a trainer's zero_grad).
  void discard_gradient(std::int32_t layer);

  /// Prune and regrow, between steps (dynamic sparsity, see sluice/dynamic_sparsity.hpp):
  /// drops the grow.size() active weights of the layer with the smallest |w| (ties: the
  /// earlier in CSR order, i.e. row-major) and makes the positions `grow` (row * cols +
  /// col, increasing, inactive now) active at 0 with zeroed optimizer state; the dropped
  /// weights' state is discarded and the number of non-zeros stays. The layer's transposed
  /// pattern and placements follow the new mask (the objects stay where they are); every
  /// stream of the layer must have finished. ShapeError if a gradient is waiting for
  /// commit_step, a position is out of range or order, or already active.
  void regrow(std::int32_t layer, std::span<const std::int64_t> grow);
  /// Counts the changes of any mask (regrow, load): a caller keeping copies of
  /// placements or patterns compares it to know they are stale.
  std::uint64_t mask_generation() const { return mask_generation_; }

  void set_optimizer(const OptimizerConfig& config);
  const OptimizerConfig& optimizer() const;
  void set_non_finite_policy(NonFinitePolicy policy);
  std::int64_t step() const;
  /// The bytes of RAM the model is kept in when they are bounded (TieredModelMemory's
  /// budget), else 0 (HostModelMemory holds every layer). A trainer over a bounded
  /// ModelMemory bounds what it holds beside it too — the gradients waiting for
  /// submit_gradient, the streams' prefetch (see LayerStreamingExecutor) — so the
  /// process, not only the model, stays near the budget.
  std::int64_t ram_budget_bytes() const { return ram_budget_bytes_impl(); }
  /// Bytes a trainer holds beside a bounded ModelMemory at most (the streams in flight,
  /// the engines' gradients): the ModelMemory keeps that much of its budget free, so that
  /// the process, not only the model, stays within the budget; ResourceError if the
  /// budget cannot, beside each layer's working set (nothing changes then). The last call
  /// counts; ignored by an unbounded one.
  void reserve_ram_bytes(std::int64_t bytes) { reserve_ram_bytes_impl(bytes); }
  /// The most reserve_ram_bytes accepts: a bounded ModelMemory's budget less what its
  /// largest layer needs at once (TieredModelMemory), by default the whole budget; 0 for
  /// an unbounded one.
  std::int64_t reservable_ram_bytes() const { return reservable_ram_bytes_impl(); }
  /// Whether every layer's by-input stream is encoded from RAM, as its by-output stream
  /// is: true for a HostModelMemory. False where a bounded ModelMemory cannot keep the
  /// model's transposed patterns (8 bytes per non-zero, as much as the weights) beside it,
  /// so that each by-input stream would read one from storage again; a trainer then
  /// streams its backward by output (LayerStreamingExecutor).
  bool by_input_from_ram() const { return by_input_from_ram_impl(); }

  /// Crash-safe checkpoint of everything: layers, masks, values, biases, optimizer
  /// config and state, step, seed. Written to a temporary file, flushed, then renamed
  /// over `path`: an interrupted save leaves the previous checkpoint intact. ArgumentError,
  /// before writing, where `path` is something other than a file (a device, a pipe),
  /// which the rename would replace.
  void save(const std::filesystem::path& path) const;
  /// Replaces this ModelMemory's contents with the checkpoint's. A truncated, corrupt or
  /// wrong-version file throws FormatError and changes nothing.
  void load(const std::filesystem::path& path);
  /// True where `path` begins as a checkpoint does (its magic): a program about to save
  /// over a file it was given asks first, not to replace the user's other files.
  static bool is_checkpoint(const std::filesystem::path& path);

  /// A seed the model was built from, kept in checkpoints.
  std::uint64_t seed = 0;
  /// Passes over the training data completed, kept in checkpoints: a resumed run
  /// continues the data order from here. The trainer counts them; ModelMemory only keeps
  /// them.
  std::int64_t epochs = 0;
  /// What the layers make, kept in checkpoints: empty for a stack of layers (an MLP), else
  /// a description its builder wrote and can read back (e.g. GptConfig::describe()).
  /// Printable ASCII, at most kMaxModelDescription characters, for a checkpoint to hold it.
  std::string model;
  static constexpr std::size_t kMaxModelDescription = 4096;
  /// The names of the model's output classes, class i the i-th (a data set's labels given
  /// as names), kept in checkpoints and model stores, so that a run resumed on other data
  /// numbers the classes as the model learnt them; empty where the classes are numbers.
  /// Distinct, non-empty, without NUL bytes, at most kMostClassNames, for a checkpoint to
  /// hold them.
  std::vector<std::string> class_names;
  static constexpr std::size_t kMostClassNames = 1'000'000;
  /// Per input feature, the standardisation the model learnt on, x' = (x - input_mean) *
  /// input_scale (a trainer's, as sluice train's of its training set), kept in checkpoints
  /// and model stores so that a run resumed on other data scales its inputs as the first
  /// did; empty where none is kept. As many of each, finite, the scales positive.
  std::vector<double> input_mean, input_scale;
  /// What the model was trained on, as its trainer names it (sluice train: digits,
  /// synthetic, or a CSV file's or a text's absolute path), kept in checkpoints and model
  /// stores so that a resumed run goes on with the same data unless told other; empty where
  /// it is not said. Without NUL bytes, at most kMaxTrainingData bytes, for a checkpoint to
  /// hold it.
  std::string training_data;
  static constexpr std::size_t kMaxTrainingData = 4096;
  /// The mask-update schedule the model trains under (rule none: masks fixed), kept in
  /// checkpoints and model stores so that a resumed run goes on with the same schedule,
  /// its horizon (total_steps, counted from the model's first step) included. The trainer
  /// sets it; ModelMemory only keeps it.
  DynamicSparsity dynamic;

 protected:
  virtual std::int32_t add_layer_impl(CsrMatrix weights, std::vector<float> bias) = 0;
  virtual std::int32_t layer_count_impl() const = 0;
  virtual LayerShape layer_shape_impl(std::int32_t layer) const = 0;
  /// Default: ShapeError (the layer is not held in RAM).
  virtual const CsrMatrix& weights_impl(std::int32_t layer) const;
  /// Kept in RAM by every implementation (a layer's bias is one float per output), so
  /// the reference stays valid until the next commit_step or load.
  virtual const std::vector<float>& bias_impl(std::int32_t layer) const = 0;
  virtual const Placement& placement_impl(std::int32_t layer, std::int32_t lanes) = 0;
  /// Built once per layer and kept; thread-safe. Default: ShapeError, as weights_impl.
  virtual const TransposedPattern& transposed_impl(std::int32_t layer) const;
  /// Encodes the layer's stream into `channel` from wherever the layer is kept; the
  /// arguments are checked. Throws on failure (stream_to fails the channel with it).
  virtual void stream_to_impl(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                              std::size_t chunk_packets, Precision precision,
                              StreamOrder order) const = 0;
  /// Called with the gradient stream's header and the bias gradient's size checked
  /// against the layer; the chunks are the implementation's to check (detail::
  /// scan_gradient does it for a layer in RAM).
  virtual void submit_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                    std::span<const float> bias_gradient) = 0;
  /// Checked as for submit_gradient_impl. Default: submit_gradient_impl.
  virtual void accumulate_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                        std::span<const float> bias_gradient) {
    submit_gradient_impl(layer, gradient, bias_gradient);
  }
  virtual StepReport commit_step_impl() = 0;
  virtual void discard_step_impl() = 0;
  virtual void discard_gradient_impl(std::int32_t layer) = 0;
  /// An implementation that cannot change masks keeps this one, which refuses (Error).
  virtual void regrow_impl(std::int32_t layer, std::span<const std::int64_t> grow);
  virtual void set_optimizer_impl(const OptimizerConfig& config) = 0;
  virtual const OptimizerConfig& optimizer_impl() const = 0;
  virtual void set_non_finite_policy_impl(NonFinitePolicy policy) = 0;
  virtual std::int64_t step_impl() const = 0;
  virtual void save_impl(const std::filesystem::path& path) const = 0;
  virtual void load_impl(const std::filesystem::path& path) = 0;
  /// Default: 0, not bounded.
  virtual std::int64_t ram_budget_bytes_impl() const { return 0; }
  virtual void reserve_ram_bytes_impl(std::int64_t /*bytes*/) {}
  virtual std::int64_t reservable_ram_bytes_impl() const { return ram_budget_bytes_impl(); }
  virtual bool by_input_from_ram_impl() const { return true; }

  void check_layer(std::int32_t layer) const;

 private:
  /// submit_gradient's checks of the header and the bias gradient; `who` names the call.
  void check_gradient(const char* who, std::int32_t layer, const WeightStream& gradient,
                      std::span<const float> bias_gradient) const;

  std::uint64_t mask_generation_ = 0;
};

/// ModelMemory in this process's memory; the optimizer runs on oneTBB.
class HostModelMemory final : public ModelMemory {
 public:
  HostModelMemory();
  ~HostModelMemory() override;

 protected:
  std::int32_t add_layer_impl(CsrMatrix weights, std::vector<float> bias) override;
  std::int32_t layer_count_impl() const override;
  LayerShape layer_shape_impl(std::int32_t layer) const override;
  const CsrMatrix& weights_impl(std::int32_t layer) const override;
  const std::vector<float>& bias_impl(std::int32_t layer) const override;
  const Placement& placement_impl(std::int32_t layer, std::int32_t lanes) override;
  const TransposedPattern& transposed_impl(std::int32_t layer) const override;
  void stream_to_impl(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                      std::size_t chunk_packets, Precision precision,
                      StreamOrder order) const override;
  void submit_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                            std::span<const float> bias_gradient) override;
  void accumulate_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                std::span<const float> bias_gradient) override;
  StepReport commit_step_impl() override;
  void discard_step_impl() override;
  void discard_gradient_impl(std::int32_t layer) override;
  void regrow_impl(std::int32_t layer, std::span<const std::int64_t> grow) override;
  void set_optimizer_impl(const OptimizerConfig& config) override;
  const OptimizerConfig& optimizer_impl() const override;
  void set_non_finite_policy_impl(NonFinitePolicy policy) override;
  std::int64_t step_impl() const override;
  void save_impl(const std::filesystem::path& path) const override;
  void load_impl(const std::filesystem::path& path) override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace sluice
