#pragma once
// One sparse linear layer, Y = W X + b, for trainers that bring their own loop (libtorch,
// PyTorch, a hand-written one). W's mask and values, the bias and the optimizer state live
// in a ModelMemory; the products run on an Engine the caller picks. The executor is not
// needed (it may be built from the same pieces).
//
// Activations come feature-major (features x tokens, the engine's own layout) or
// token-major (tokens x features, as PyTorch holds them). The engine's kernels read and
// write feature rows of contiguous tokens only, so a token-major X or dY is transposed
// into a scratch copy and a token-major Y or dX is written through one; feature-major
// activations are passed to the engine as they are. A trainer whose activations can be
// viewed feature-major (a torch tensor whose transpose is contiguous) pays no copy.
//
// Thread-safety: forward() and backward() only read the layer and may run concurrently,
// each on its own Engine (an Engine runs one product at a time). submit_backward() and
// accumulate_backward() hand the gradient to ModelMemory, which takes different layers'
// gradients concurrently and one layer's in turn. step() and anything that changes the
// ModelMemory (another layer's step included: step() commits the whole ModelMemory) must
// not overlap a product.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "sluice/bf16.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/dense.hpp"
#include "sluice/engine.hpp"
#include "sluice/model_memory.hpp"

namespace sluice {

/// How a dense activation matrix holds a layer's features and tokens.
enum class Layout {
  feature_major,  ///< features x tokens (row f holds feature f of every token)
  token_major,    ///< tokens x features (row t holds every feature of token t)
};

/// How one product runs.
struct ProductOptions {
  Layout layout = Layout::feature_major;  ///< of X, Y, dY and dX alike
  Precision precision = Precision::fp32;  ///< of the weight stream (activations stay fp32)
  /// Weights held outside the ModelMemory (e.g. by a torch optimizer): when non-empty,
  /// these values, in the order of weights().values(), replace the ModelMemory's, and
  /// `bias` (empty: none) replaces its bias. The mask is still the ModelMemory's.
  std::span<const float> values;
  std::span<const float> bias;
};

/// A layer's gradient, returned instead of submitted.
struct SparseLinearGradient {
  std::vector<float> weights;  ///< dW at the mask's positions, in the order of weights().values()
  std::vector<float> bias;     ///< db, one per output; empty when the layer has no bias
};

class SparseLinear {
 public:
  /// Adds `weights` (outputs x inputs) and `bias` (empty, or one per output) to `memory`
  /// as a new layer.
  SparseLinear(std::shared_ptr<ModelMemory> memory, CsrMatrix weights,
               std::vector<float> bias = {});
  /// The layer `layer` already in `memory`.
  SparseLinear(std::shared_ptr<ModelMemory> memory, std::int32_t layer);
  ~SparseLinear();
  SparseLinear(SparseLinear&& other) noexcept;
  SparseLinear& operator=(SparseLinear&& other) noexcept;

  /// W = dense where `mask` is non-zero (zeros of `dense` under the mask are kept); a NaN
  /// in the mask, or a kept weight that is not finite, is a FormatError naming it.
  static SparseLinear from_dense(std::shared_ptr<ModelMemory> memory, ConstMatrixView dense,
                                 ConstMatrixView mask, std::vector<float> bias = {});
  /// The mask (and values) of a `.smtx` or `.mtx` file; see read_matrix for the values.
  static SparseLinear from_file(std::shared_ptr<ModelMemory> memory,
                                const std::filesystem::path& path, std::uint64_t seed = 1,
                                std::vector<float> bias = {});
  /// Magnitude pruning: keeps the round((1 - sparsity) * rows * cols) entries of `dense`
  /// largest in magnitude (ties: the first in row-major order), at least one per layer
  /// unless the layer is empty. A weight that is not finite is a FormatError naming it.
  static SparseLinear pruned(std::shared_ptr<ModelMemory> memory, ConstMatrixView dense,
                             double sparsity, std::vector<float> bias = {});

  std::int32_t layer() const { return layer_; }
  ModelMemory& memory() const { return *memory_; }
  std::int64_t in_features() const;
  std::int64_t out_features() const;
  std::int64_t nnz() const;
  /// The ModelMemory's copy of the layer.
  const CsrMatrix& weights() const;
  const std::vector<float>& bias() const;

  /// Y = W X + b. X: inputs x tokens and Y: outputs x tokens (feature-major), or their
  /// transposes (token-major). Y is overwritten.
  void forward(Engine& engine, ConstMatrixView x, MutableMatrixView y,
               const ProductOptions& options = {}) const;
  /// The backward of forward(): dX = W^T dY (when `dx` is given; overwritten) and the
  /// gradients of the weights at the mask's positions and of the bias, returned.
  SparseLinearGradient backward(Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                                MutableMatrixView* dx, const ProductOptions& options = {}) const;
  /// The same with the gradient submitted to the ModelMemory for the next step() (the
  /// values must be the ModelMemory's: `options.values` empty). Returns nothing but dX.
  void submit_backward(Engine& engine, ConstMatrixView x, ConstMatrixView dy, MutableMatrixView* dx,
                       const ProductOptions& options = {}) const;
  /// The same for micro-batches: the gradient is added to what this layer handed in since
  /// the last step() (ModelMemory::accumulate_gradient), so step() applies their sum.
  void accumulate_backward(Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                           MutableMatrixView* dx, const ProductOptions& options = {}) const;
  /// dX = W^T dY alone, for a layer whose weights want no gradient (frozen, or a gradient
  /// taken with respect to the input only). dX is overwritten.
  void backward_data(Engine& engine, ConstMatrixView dy, MutableMatrixView dx,
                     const ProductOptions& options = {}) const;
  /// Commits the ModelMemory's step: this layer's update and that of every other layer
  /// that submitted a gradient since the last step (ModelMemory::commit_step).
  StepReport step();
  /// Drops what this layer handed in since the last step (ModelMemory::discard_gradient).
  void discard_gradient();

 private:
  struct Cache;
  const Placement& placement_for(const Engine& engine, std::int64_t tokens,
                                 Precision precision) const;
  WeightStream stream(StreamKind kind, StreamOrder order, const ProductOptions& options) const;
  StreamOrder data_order(Precision precision) const;
  WeightStream run_backward(Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                            MutableMatrixView* dx, const ProductOptions& options,
                            std::vector<float>& bias_gradient) const;
  void hand_in_backward(bool add, Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                        MutableMatrixView* dx, const ProductOptions& options) const;

  std::shared_ptr<ModelMemory> memory_;
  std::int32_t layer_ = 0;
  // Placements and the by-output walk of values held outside the ModelMemory, made on
  // first use under a lock of their own (concurrent products may ask at once).
  std::unique_ptr<Cache> cache_;
};

}  // namespace sluice
