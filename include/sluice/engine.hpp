#pragma once
// The Engine (Cerebras: the Wafer-Scale Engine) owns activations; weights stream
// through it and are never stored there.
//
// Geometry: P lanes ("engine rows") x Q token blocks ("engine columns"). Lane p owns
// the input features its layer's Placement gives it; block q owns a slice of the tokens.
// A batch too small to slice by tokens for every thread is cut the other way: S stream
// shares, each taking a contiguous part of the stream's chunks (so of the outputs). The
// weight-gradient pass of one lane takes shares instead of token blocks whenever the
// stream has chunks enough (each weight then has one writer: no partial sums to add).
// Forward: every weight packet goes to the lane that owns its input index and becomes
// one AXPY (acc += w * X[i, tokens]); a carriage return hands the lane's accumulator to
// a ring reduction over the lanes that runs concurrently with the AXPYs and ends each
// output at the lane the next layer's placement wants.
// Backward takes the stream either way. By output, the wafer's dual of the forward: each
// lane adds w * dY[o, :] into the dX rows it owns, and a second pass takes the weight
// gradients. By input (the layer's transpose), one lane holds a token tile of dY and for
// each input feature i gathers the dY rows its weights name, once for both products:
// dX[i, :] = sum w * dY[o, :] as a sum kept in registers, and dot(X[i, :], dY[o, :]) for
// each weight. On a CPU that is one pass of reads instead of a read-modify-write of a dX
// row per weight plus a second pass.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "sluice/activation_store.hpp"
#include "sluice/block_store.hpp"
#include "sluice/dataset.hpp"
#include "sluice/dense.hpp"
#include "sluice/geometry.hpp"
#include "sluice/isa.hpp"
#include "sluice/planner.hpp"
#include "sluice/product_path.hpp"
#include "sluice/stream.hpp"

namespace sluice {

struct EngineOptions {
  Geometry geometry;         ///< fixed geometry, or zeros to choose per layer
  std::int32_t threads = 0;  ///< worker threads; 0 = every core of this process
  std::optional<Isa> isa;    ///< kernel ISA; default: default_isa()
  bool pin_threads = false;  ///< pin workers to cores with hwloc
  /// The cache a lane's activation tile may fill, per core: beyond it, input features are
  /// split over more lanes. 0 = the core's share of the caches (Topology::cache_share_bytes:
  /// the L3 over the cores sharing it, at most 12 MiB, at least the core's L2). A one-pass
  /// product's stream larger than all threads' shares of it is checked chunk by chunk by
  /// the task about to compute each (read once from memory, not twice).
  std::int64_t tile_cache_bytes = 0;
  ProductPath path = ProductPath::automatic;  ///< see ProductPath
};

/// Time spent by the engine's lanes, for metrics (seconds, summed over lanes).
struct EngineCounters {
  double busy_seconds = 0;    ///< lanes inside AXPY / reduction kernels
  double intake_seconds = 0;  ///< validating and routing packets
  std::uint64_t packets = 0;
  std::uint64_t bytes = 0;
  /// Wall time from a layer's first chunk asked for to its last one taken in, summed
  /// over layers, and the part of it during which some lane of the engine was computing.
  double stream_arrival_seconds = 0;
  double overlapped_seconds = 0;
  void reset() { *this = {}; }
};

/// Which of an engine's activations RigL's growth scores read (Engine::growth_activations,
/// Fabric::growth_top_k): an MLP layer's input X and the dZ of its last backward_layer (in
/// the ActivationStore), or with `block` a block model's projection backward (q_back, ...,
/// head_back) as it just ran (in the BlockStore: its X and dY, until the next call reuses
/// the deltas).
struct GrowthSource {
  std::int32_t layer = 0;
  std::optional<BlockCall> block;
};

class Engine {
 public:
  virtual ~Engine() = default;

  /// Y = W X. `x` is inputs x tokens, `y` outputs x tokens (overwritten). The stream is
  /// validated as it is taken in (FormatError on corruption; `y` then holds no result:
  /// rows of chunks before the bad one may have been written).
  void forward(StreamSource& weights, const Placement& placement, ConstMatrixView x,
               MutableMatrixView y, const Placement* next_placement = nullptr);
  void forward(const WeightStream& weights, const Placement& placement, ConstMatrixView x,
               MutableMatrixView y, const Placement* next_placement = nullptr) {
    MemoryStreamSource source(weights);
    forward(source, placement, x, y, next_placement);
  }

  /// Backward of Y = W X, from a stream by output or by input. With `dx` given:
  /// dX = W^T dY (the stream must carry weights). Always: the weight gradient
  /// dot(dY[o,:], X[i,:]) at every mask position, returned as a gradient stream in the
  /// weight stream's order and orientation (a `mask` stream suffices). A stream by input
  /// runs on one lane (its tile holds dY, not X): the placement is checked, not used.
  /// A corrupt stream is a FormatError, as for forward (`dx` then holds no result).
  WeightStream backward(StreamSource& weights, const Placement& placement, ConstMatrixView x,
                        ConstMatrixView dy, MutableMatrixView* dx);
  WeightStream backward(const WeightStream& weights, const Placement& placement, ConstMatrixView x,
                        ConstMatrixView dy, MutableMatrixView* dx) {
    MemoryStreamSource source(weights);
    return backward(source, placement, x, dy, dx);
  }

  /// dX = W^T dY alone (no weight gradient), e.g. for a frozen layer.
  void backward_data(StreamSource& weights, const Placement& placement, ConstMatrixView dy,
                     MutableMatrixView dx);
  void backward_data(const WeightStream& weights, const Placement& placement, ConstMatrixView dy,
                     MutableMatrixView dx) {
    MemoryStreamSource source(weights);
    backward_data(source, placement, dy, dx);
  }

  /// The geometry this engine uses for a layer of this shape (a bf16 layer's tiles are
  /// wider: its activations take half the bytes). With the layer's non-zeros (`nnz` > 0)
  /// it is exactly the geometry a product runs with: a bf16 layer that holds X in fp32
  /// (see CpuEngine::holds_bf16) runs with the fp32 geometry, and a layer with too
  /// little work to share runs as one token block. The lanes do not depend on `nnz`.
  virtual Geometry geometry_for(std::int64_t outputs, std::int64_t inputs, std::int64_t tokens,
                                Precision precision = Precision::fp32,
                                std::uint64_t nnz = 0) const = 0;
  virtual Isa isa() const = 0;
  virtual std::int32_t threads() const = 0;
  EngineCounters& counters() { return counters_; }

  // --- Layer operations on the engine's own activation store ---------------------------
  // A step loads the engine's shard of the batch once, then runs layer by layer on what
  // the engine holds: weights stream in, gradients and scalars come out, activations stay.
  // The base class implements them on the product calls above, in this process's memory;
  // an engine with memory of its own (another process, an accelerator) overrides them.

  const ActivationStore& store() const { return store_; }
  /// Takes this engine's shard of a batch into its store for a pass of `spec`.
  virtual void load_shard(const PassSpec& spec, const ShardData& shard);
  /// The same from samples of a data set (the engine's copy): features and labels of
  /// `indices`, in that order (ArgumentError for an index out of the set).
  void load_samples(const PassSpec& spec, const Dataset& data,
                    std::span<const std::int64_t> indices);
  /// Layer `layer` forward: Z = W in(layer) + bias (empty: none), A = act(Z).
  virtual void forward_layer(StreamSource& weights, const Placement& placement, std::int32_t layer,
                             std::span<const float> bias);
  /// The loss of the store's tokens against their labels or targets. With `want_delta`,
  /// dA of the last layer, for the mean loss over `total_tokens` (every engine's), goes
  /// into the store's delta.
  virtual LossSums loss(bool want_delta, std::int64_t total_tokens);
  /// Layer `layer` backward: dZ = dA * act'(Z) in the delta; returns the weight gradient
  /// (see backward()); with `want_dx` dX goes into the layer below's delta, which becomes
  /// the delta; with `bias_gradient` the row sums of dZ go there.
  virtual WeightStream backward_layer(StreamSource& weights, const Placement& placement,
                                      std::int32_t layer, bool want_dx,
                                      std::vector<float>* bias_gradient);

  // --- Block operations on the engine's own block store (a GPT's step) --------------------
  // The same idea for a model of transformer blocks (sluice/block_store.hpp): the engine
  // loads its whole sequences once, then runs the step's BlockCalls on what it holds. The
  // base class implements them on the product calls and the blocks of sluice/blocks.hpp.

  const BlockStore& block_store() const { return blocks_; }
  /// Takes this engine's shard of a GPT batch (whole sequences; targets may be empty for
  /// generation) into its block store.
  virtual void load_tokens(const BlockShape& shape, std::span<const std::int32_t> inputs,
                           std::span<const std::int32_t> targets);
  /// Runs one operation on the block store. `weights` is the operation's stream (null for
  /// one that takes none, see takes_stream), `placement` the engine's placement of a
  /// projection's inputs, `bias` a projection's or a LayerNorm's bias. ArgumentError for a
  /// call out of order (no shard, a parameter not set) or with the wrong arguments.
  virtual BlockReply run_block(const BlockCall& call, StreamSource* weights,
                               const Placement* placement, std::span<const float> bias);

  /// The X (inputs x tokens) and dY (outputs x tokens) `source` names in this engine's
  /// stores; ArgumentError if they do not hold it.
  std::pair<ConstMatrixView, ConstMatrixView> growth_activations(const GrowthSource& source) const;

 protected:
  /// Runs `fn` on the engine's own threads, so the parallel loops in it (the layer
  /// operations' per-element passes: bias, activation, its slope) use as many threads as
  /// the engine has, not every core of the process. The base class runs it on the caller's.
  virtual void on_engine_threads(const std::function<void()>& fn) { fn(); }
  virtual void forward_impl(StreamSource& weights, const Placement& placement, ConstMatrixView x,
                            MutableMatrixView y, const Placement* next_placement) = 0;
  /// `x` null: no weight gradient wanted (returns an empty stream); `dx` null: no dX.
  virtual WeightStream backward_impl(StreamSource& weights, const Placement& placement,
                                     const ConstMatrixView* x, ConstMatrixView dy,
                                     MutableMatrixView* dx) = 0;
  EngineCounters counters_;
  ActivationStore store_;
  BlockStore blocks_;

 private:
  // run_block's three kinds of operation that are not projections.
  void set_parameter(const BlockCall& call, const WeightStream& stream,
                     std::span<const float> bias);
  BlockReply parameter_backward(const BlockCall& call, const WeightStream& parameter);
  BlockReply weightless_block(const BlockCall& call);
};

/// The engine on this machine's cores: lanes are oneTBB tasks in the engine's own arena,
/// kernels chosen by ISA at run time.
class CpuEngine final : public Engine {
 public:
  explicit CpuEngine(EngineOptions options = {});
  ~CpuEngine() override;

  Geometry geometry_for(std::int64_t outputs, std::int64_t inputs, std::int64_t tokens,
                        Precision precision = Precision::fp32,
                        std::uint64_t nnz = 0) const override;
  Isa isa() const override;
  std::int32_t threads() const override;

  /// Whether lanes copy their activation rows into a packed resident tile for a layer
  /// (else they read X where it is): a cost the cost model accounts for.
  static bool packs_tiles(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs);
  /// Whether a bf16 layer's lanes hold its activations (X forward and by output, dY by
  /// input) in bf16 for a batch of `tokens`: where they pack them, for more than one token.
  /// Else they hold them in fp32 as given, and only the weights are bf16.
  static bool holds_bf16(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs,
                         std::int64_t tokens);
  /// The path a product of this stream over `tokens` tokens takes (sparse or dense): the
  /// one the options force, else the faster by the cost model.
  ProductPath path_for(const StreamHeader& header, std::int64_t tokens) const;

 protected:
  void on_engine_threads(const std::function<void()>& fn) override;
  void forward_impl(StreamSource& weights, const Placement& placement, ConstMatrixView x,
                    MutableMatrixView y, const Placement* next_placement) override;
  WeightStream backward_impl(StreamSource& weights, const Placement& placement,
                             const ConstMatrixView* x, ConstMatrixView dy,
                             MutableMatrixView* dx) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sluice
