#pragma once
// The activation store: what one engine keeps of its shard of a batch for a whole step,
// in its own memory, addressed by layer: the inputs X, every layer's pre-activations Z
// and activations A, and the two deltas of the backward pass (dZ of the layer being
// worked on, dX into the layer below). Nothing of it crosses the fabric during a step:
// weights come in, gradients and a few scalars go out (see Engine's layer operations).
// The activation functions and losses the engines apply to it are defined here too.
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "sluice/dense.hpp"

namespace sluice {

enum class Activation {
  none,
  relu,
  /// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  gelu,
};
const char* to_string(Activation activation);

enum class Loss {
  /// Softmax cross-entropy against integer labels: mean over tokens of -log p[label].
  softmax_cross_entropy,
  /// Mean over tokens of 0.5 * sum over outputs of (y - target)^2.
  mse,
};

/// What a pass keeps per layer: the model's widths, each layer's activation function,
/// the loss, and whether it trains (then the two delta buffers are kept as well).
struct PassSpec {
  std::vector<std::int64_t> sizes;      ///< sizes[0] inputs, sizes[l + 1] outputs of layer l
  std::vector<Activation> activations;  ///< one per layer
  Loss loss = Loss::softmax_cross_entropy;
  bool training = true;
};

/// One engine's shard of a batch: features x tokens, and the tokens' integer labels
/// (cross-entropy) or targets (outputs x tokens, MSE; absent: the loss is not asked for).
struct ShardData {
  ConstMatrixView features;
  std::span<const int> labels;
  std::optional<ConstMatrixView> targets;
};

/// The loss of some tokens, summed (not averaged), with the counts to reduce it over
/// engines: the fabric adds engines' sums in engine order.
struct LossSums {
  double loss = 0;
  std::int64_t correct = 0;  ///< argmax == label (cross-entropy)
  std::int64_t tokens = 0;
  bool non_finite = false;  ///< some token's output or loss is not finite
  LossSums& operator+=(const LossSums& other);
};

class ActivationStore {
 public:
  /// Takes a copy of `shard` for a pass of `spec`. The buffers of earlier passes are kept
  /// while the layers are the same and no shard is wider than the one they were made for:
  /// a narrower shard uses their first columns (views of `tokens()` columns whose stride
  /// is the buffers'), so they hold what the widest shard since needed.
  void load(const PassSpec& spec, const ShardData& shard);
  /// Bytes the activations of a shard of `tokens` take in a store: Z and A of every layer,
  /// and for training the two delta buffers (rows padded as DenseMatrix pads them).
  static std::int64_t bytes_for(const PassSpec& spec, std::int64_t tokens);

  const PassSpec& spec() const { return spec_; }
  bool loaded() const { return !spec_.sizes.empty(); }
  std::int64_t tokens() const { return tokens_; }
  std::int32_t layers() const { return static_cast<std::int32_t>(z_.size()); }

  /// The input of layer l: X for layer 0, else the output of layer l - 1.
  ConstMatrixView in(std::int32_t layer) const;
  /// Layer l's output: A, or Z when the layer has no activation function.
  ConstMatrixView out(std::int32_t layer) const;
  MutableMatrixView z(std::int32_t layer);
  /// A of layer l; an empty view when the layer has no activation function.
  MutableMatrixView a(std::int32_t layer);
  /// dZ of the layer being worked on (its first `rows` rows).
  MutableMatrixView delta(std::int64_t rows);
  /// dX into the layer below (its first `rows` rows); swap_deltas() makes it the delta.
  MutableMatrixView delta_below(std::int64_t rows);
  void swap_deltas() { std::swap(delta_, delta_below_); }
  /// After swap_deltas(): the dZ the last layer's backward worked on (its first `rows`),
  /// until the next backward overwrites it.
  ConstMatrixView last_delta(std::int64_t rows) const;

  std::span<const int> labels() const { return labels_; }
  std::optional<ConstMatrixView> targets() const;

 private:
  std::size_t index(std::int32_t layer) const;
  PassSpec spec_;
  std::int64_t tokens_ = 0;
  std::int64_t capacity_ = 0;  ///< the columns z_, a_ and the deltas were made with
  DenseMatrix input_;
  std::vector<DenseMatrix> z_, a_;  // a_[l] empty when layer l has no activation (A = Z)
  DenseMatrix delta_, delta_below_;
  std::vector<int> labels_;
  DenseMatrix targets_;
  bool has_targets_ = false;
};

}  // namespace sluice
