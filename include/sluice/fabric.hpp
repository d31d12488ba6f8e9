#pragma once
// The Fabric (Cerebras: SwarmX) joins one ModelMemory to N engines, data parallel:
// each engine holds different tokens. Weight streams go out by broadcast (every engine
// sees the same chunks, shared, never copied); gradient streams come back by a
// sum-reduction over the engines, done as a pairwise tree in a fixed order so the
// result does not depend on which engine finished first.
//
// A training step runs as layer operations over the engines' activation stores (see
// activation_store.hpp): each engine loads its shard of the batch once, then per layer
// the weight stream and the layer's bias go out and, backward, the summed gradient and
// bias gradient come back; the loss comes back as a few scalars. Activations never cross
// the fabric. The product operations on caller-held views (forward, backward) remain for
// benchmarks and tests of the engines themselves.
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <vector>

#include "sluice/activation_store.hpp"
#include "sluice/block_store.hpp"
#include "sluice/dataset.hpp"
#include "sluice/dense.hpp"
#include "sluice/engine.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace sluice {
namespace detail {
class EngineWorker;
}  // namespace detail

/// One layer's gradient, summed over every engine: the weight-gradient stream (in the
/// weight stream's order) and the bias gradient (row sums of dY; empty if not asked for).
struct ReducedGradient {
  WeightStream weights;
  std::vector<float> bias;
};

/// Sums gradient streams and bias gradients as a tree: level by level, (0,1), (2,3), ...
/// so the order of additions is fixed. Every stream must have the same header and the
/// same tags in the same order (FormatError otherwise); bias vectors must agree in size.
ReducedGradient reduce_gradients(std::vector<WeightStream> streams,
                                 std::vector<std::vector<float>> biases);

/// A block operation's result over every engine (see Fabric::run_block).
struct BlockResult {
  ReducedGradient gradient;  ///< summed by the tree, when the operation returns one
  LossSums loss;             ///< summed in engine order (the loss operation)
};

/// One engine's bias gradient: the row sums of its dY, accumulated in double (in eight
/// partial sums, over every eighth column, added in a fixed order: the same on every CPU).
std::vector<float> bias_gradient(ConstMatrixView dy);

/// What the driver's side of a fabric (the caller of its operations; over MPI rank 0)
/// moved through it, in bytes.
struct FabricCounters {
  /// Weight streams (once per broadcast), biases, batch shards or their sample indices,
  /// and the protocol's own messages (commands, placements).
  std::uint64_t driver_bytes_sent = 0;
  /// Summed gradients and bias gradients, loss scalars, gathered outputs, replies.
  std::uint64_t driver_bytes_received = 0;
};

/// A non-blocking fabric operation. get() waits and returns (or rethrows); the destructor
/// waits too, so views handed to the operation stay in use until it has finished.
template <typename T>
class FabricRequest {
 public:
  FabricRequest() = default;
  explicit FabricRequest(std::future<T> future) : future_(std::move(future)) {}
  FabricRequest(FabricRequest&&) noexcept = default;
  FabricRequest& operator=(FabricRequest&& other) noexcept {
    if (this != &other) {
      wait();
      future_ = std::move(other.future_);
    }
    return *this;
  }
  ~FabricRequest() { wait(); }

  bool valid() const { return future_.valid(); }
  bool ready() const {
    return !future_.valid() ||
           future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  void wait() const {
    if (future_.valid()) future_.wait();
  }
  T get() { return future_.get(); }

 private:
  std::future<T> future_;
};

class Fabric {
 public:
  Fabric();
  virtual ~Fabric();

  std::int32_t engine_count() const { return engine_count_impl(); }
  Engine& engine(std::int32_t k);

  /// Broadcast forward: every engine k computes ys[k] = W xs[k] from the same stream,
  /// concurrently. `placements[k]` is engine k's placement of the layer's inputs.
  void forward(StreamSource& weights, std::span<const Placement* const> placements,
               std::span<const ConstMatrixView> xs, std::span<const MutableMatrixView> ys);
  /// The same, returning at once. Async operations run one after another, in the order
  /// issued, on a thread the fabric keeps. The engines take one operation at a time: issue
  /// them from one thread, get() a request before a blocking operation, and let every
  /// request finish before the fabric is destroyed.
  FabricRequest<void> forward_async(StreamSource& weights, std::vector<const Placement*> placements,
                                    std::vector<ConstMatrixView> xs,
                                    std::vector<MutableMatrixView> ys);

  /// Broadcast backward, then reduction: every engine k computes its weight gradient
  /// from xs[k] and dys[k] (and dX into *dxs[k] when dxs is not empty and dxs[k] is not
  /// null; a `mask` stream suffices when no dX is wanted); the fabric sums the gradient
  /// streams, and the row sums of dY when `with_bias`, into one.
  ReducedGradient backward(StreamSource& weights, std::span<const Placement* const> placements,
                           std::span<const ConstMatrixView> xs,
                           std::span<const ConstMatrixView> dys,
                           std::span<MutableMatrixView* const> dxs, bool with_bias);
  FabricRequest<ReducedGradient> backward_async(StreamSource& weights,
                                                std::vector<const Placement*> placements,
                                                std::vector<ConstMatrixView> xs,
                                                std::vector<ConstMatrixView> dys,
                                                std::vector<MutableMatrixView*> dxs,
                                                bool with_bias);

  // --- Layer operations over the engines' activation stores ------------------------------

  /// Engine k's tokens of a batch of `tokens` split over `engines`: contiguous ranges in
  /// engine order, [first, first + count).
  struct TokenRange {
    std::int64_t first = 0, count = 0;
  };
  static TokenRange shard_of(std::int32_t k, std::int32_t engines, std::int64_t tokens);

  /// Every engine takes its shard (shard_of) of `batch` into its store, for `spec`.
  /// `batch.labels` (cross-entropy) or `batch.targets` (MSE) may be absent for inference.
  void load_batch(const PassSpec& spec, const ShardData& batch);
  /// The data set the engines take batches from by sample index (load_samples): on a
  /// local fabric shared, over MPI every rank's own copy, built the same way (engine
  /// ranks attach theirs before serve()). Null detaches. The caller keeps it alive.
  void attach_dataset(const Dataset* data) { dataset_ = data; }
  const Dataset* dataset() const { return dataset_; }
  /// Every engine takes its shard (shard_of) of the samples `indices` of the attached data
  /// set into its store, features and labels: only the indices cross the fabric.
  void load_samples(const PassSpec& spec, std::span<const std::int64_t> indices);
  /// Layer `layer` forward on every engine, from one broadcast of `weights` (by output),
  /// with the layer's bias (empty: none).
  void forward_layer(StreamSource& weights, std::span<const Placement* const> placements,
                     std::int32_t layer, std::span<const float> bias);
  /// The loss over every engine's tokens, summed in engine order (see Engine::loss).
  LossSums loss(bool want_delta, std::int64_t total_tokens);
  /// Layer `layer` backward on every engine (see Engine::backward_layer); the gradient
  /// streams, and with `with_bias` the bias gradients, summed by the tree.
  ReducedGradient backward_layer(StreamSource& weights,
                                 std::span<const Placement* const> placements, std::int32_t layer,
                                 bool want_dx, bool with_bias);
  /// The last layer's output of every engine, side by side (outputs x all tokens).
  DenseMatrix gather_output();
  /// Each engine's input X of layer `layer` and the dZ its last backward_layer (of that
  /// layer) worked on, lent to `fn` for the call: for what needs the activations
  /// themselves (RigL's growth scores). A local fabric lends the engines' stores; over MPI
  /// they are gathered to the driver, the one operation that moves activations.
  using ActivationsFn = std::function<void(std::span<const ConstMatrixView> xs,
                                           std::span<const ConstMatrixView> dzs)>;
  void with_layer_activations(std::int32_t layer, const ActivationsFn& fn);
  /// RigL's growth: the `k` positions inactive in `mask` with the largest |dY X^T| summed
  /// over every engine's tokens (the X and dY `source` names, Engine::growth_activations),
  /// in increasing order, computed where the activations are and never as a whole dense
  /// gradient. A local fabric scores its engines' stores; over MPI the engines chain each
  /// tile of the gradient (engine e adds its tokens to engine e-1's sums) and the last one
  /// keeps the top-k, so only tiles between engines and k candidates to the driver move.
  /// Either way every sum runs over the tokens in engine order: the same positions, bit
  /// for bit, on a LocalFabric and over MPI with as many engines, and on 1 or N engines.
  std::vector<std::int64_t> growth_top_k(const GrowthSource& source, const CsrMatrix& mask,
                                         std::int64_t k);

  // --- Block operations over the engines' block stores (a GPT's step) --------------------

  /// Every engine takes its whole sequences (shard_of over the batch's sequences) of
  /// `inputs` and `targets`, shape.context tokens a sequence, sequence after sequence
  /// (targets may be empty: no loss). Only the token ids cross the fabric.
  void load_tokens(const BlockShape& shape, std::span<const std::int32_t> inputs,
                   std::span<const std::int32_t> targets);
  /// One operation on every engine's block store (Engine::run_block): `weights` broadcast
  /// to them all (null for an operation that takes no stream), `placements` each engine's
  /// placement of a projection's inputs (empty otherwise), `bias` a projection's or a
  /// LayerNorm's bias. The engines' gradient streams and bias gradients come back summed
  /// by the tree, their loss sums in engine order.
  BlockResult run_block(const BlockCall& call, StreamSource* weights,
                        std::span<const Placement* const> placements, std::span<const float> bias);
  /// Engine 0's logits of its token `token` (vocab of them): the one column generation
  /// needs.
  std::vector<float> block_logits(std::int64_t token);

  const FabricCounters& counters() const { return counters_; }

 protected:
  virtual std::int32_t engine_count_impl() const = 0;
  virtual Engine& engine_impl(std::int32_t k) = 0;
  virtual void forward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                            std::span<const ConstMatrixView> xs,
                            std::span<const MutableMatrixView> ys) = 0;
  virtual ReducedGradient backward_impl(StreamSource& weights,
                                        std::span<const Placement* const> placements,
                                        std::span<const ConstMatrixView> xs,
                                        std::span<const ConstMatrixView> dys,
                                        std::span<MutableMatrixView* const> dxs,
                                        bool with_bias) = 0;
  virtual void load_batch_impl(const PassSpec& spec, const ShardData& batch) = 0;
  virtual void load_samples_impl(const PassSpec& spec, std::span<const std::int64_t> indices) = 0;
  virtual void forward_layer_impl(StreamSource& weights,
                                  std::span<const Placement* const> placements, std::int32_t layer,
                                  std::span<const float> bias) = 0;
  /// One LossSums per engine, in engine order.
  virtual std::vector<LossSums> loss_impl(bool want_delta, std::int64_t total_tokens) = 0;
  virtual ReducedGradient backward_layer_impl(StreamSource& weights,
                                              std::span<const Placement* const> placements,
                                              std::int32_t layer, bool want_dx, bool with_bias) = 0;
  virtual DenseMatrix gather_output_impl() = 0;
  /// The views of with_layer_activations, valid until the next operation.
  virtual void layer_activations_impl(std::int32_t layer, std::vector<ConstMatrixView>& xs,
                                      std::vector<ConstMatrixView>& dzs) = 0;
  /// By default: dense_gradient_top_k on every engine's growth_activations.
  virtual std::vector<std::int64_t> growth_top_k_impl(const GrowthSource& source,
                                                      const CsrMatrix& mask, std::int64_t k);
  virtual void load_tokens_impl(const BlockShape& shape, std::span<const std::int32_t> inputs,
                                std::span<const std::int32_t> targets) = 0;
  /// The engines' replies summed: gradients by the tree, loss sums in engine order.
  virtual BlockResult run_block_impl(const BlockCall& call, StreamSource* weights,
                                     std::span<const Placement* const> placements,
                                     std::span<const float> bias) = 0;
  virtual std::vector<float> block_logits_impl(std::int64_t token) = 0;

  /// Implementations add what their own protocol moves (the base counts weight streams,
  /// biases, batch shards, gradients, scalars and outputs).
  FabricCounters counters_;
  const Dataset* dataset_ = nullptr;

 private:
  /// Runs the async operations (made by the first; one thread for all of them, since
  /// starting a thread per operation costs more than a small layer's product).
  detail::EngineWorker& async_worker();
  std::unique_ptr<detail::EngineWorker> async_worker_;
};

struct LocalFabricOptions {
  std::int32_t engines = 1;
  /// Options of every engine; threads 0 = max(1, cores / engines), so N engines share the
  /// machine's cores instead of oversubscribing them.
  EngineOptions engine;
  /// Chunks each engine's broadcast channel may hold ahead of it.
  std::size_t channel_capacity = 4;
};

/// N CpuEngines in this process. The broadcast hands each engine the same chunk pointers
/// through its own bounded channel; engines run on their own threads.
class LocalFabric final : public Fabric {
 public:
  explicit LocalFabric(LocalFabricOptions options = {});
  ~LocalFabric() override;

 protected:
  std::int32_t engine_count_impl() const override;
  Engine& engine_impl(std::int32_t k) override;
  void forward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                    std::span<const ConstMatrixView> xs,
                    std::span<const MutableMatrixView> ys) override;
  ReducedGradient backward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                                std::span<const ConstMatrixView> xs,
                                std::span<const ConstMatrixView> dys,
                                std::span<MutableMatrixView* const> dxs, bool with_bias) override;
  void load_batch_impl(const PassSpec& spec, const ShardData& batch) override;
  void load_samples_impl(const PassSpec& spec, std::span<const std::int64_t> indices) override;
  void forward_layer_impl(StreamSource& weights, std::span<const Placement* const> placements,
                          std::int32_t layer, std::span<const float> bias) override;
  std::vector<LossSums> loss_impl(bool want_delta, std::int64_t total_tokens) override;
  ReducedGradient backward_layer_impl(StreamSource& weights,
                                      std::span<const Placement* const> placements,
                                      std::int32_t layer, bool want_dx, bool with_bias) override;
  DenseMatrix gather_output_impl() override;
  void layer_activations_impl(std::int32_t layer, std::vector<ConstMatrixView>& xs,
                              std::vector<ConstMatrixView>& dzs) override;
  void load_tokens_impl(const BlockShape& shape, std::span<const std::int32_t> inputs,
                        std::span<const std::int32_t> targets) override;
  BlockResult run_block_impl(const BlockCall& call, StreamSource* weights,
                             std::span<const Placement* const> placements,
                             std::span<const float> bias) override;
  std::vector<float> block_logits_impl(std::int64_t token) override;

 private:
  /// One engine's backward from its copy of the stream; its bias gradient into the third
  /// argument when that is not null.
  using EngineBackward =
      std::function<WeightStream(std::size_t, StreamSource&, std::vector<float>*)>;
  /// Broadcasts `weights` to every engine's `backward` and sums the results by the tree.
  ReducedGradient broadcast_and_reduce(StreamSource& weights, bool with_bias,
                                       const EngineBackward& backward);
  /// fn(k) for every engine, on the engines' threads (with one engine on this one).
  void for_each_engine(const std::function<void(std::int32_t)>& fn);
  LocalFabricOptions options_;
  std::vector<std::unique_ptr<CpuEngine>> engines_;
  // Persistent threads that drive the engines (declared last: they stop first).
  std::vector<std::unique_ptr<detail::EngineWorker>> workers_;
};

}  // namespace sluice
