#pragma once
// A block model's activation store: what one engine keeps of its shard of a GPT's batch
// (sluice/gpt.hpp) for a whole step, and the operations the engine runs on it. It is the
// GPT's counterpart of ActivationStore (which holds a chain of layers): per transformer
// block the residual stream, both LayerNorms' outputs and statistics, Q, K, V, the
// attention output and probabilities, the feed-forward's u and GELU(u); the final norm, the
// logits, the token ids and targets; the backward's deltas; and the dense parameters
// (token table, positions, LayerNorm gains and biases) as they were streamed in.
//
// A step is a sequence of BlockCalls, each run by every engine on its own store (see
// Engine::run_block and Fabric::run_block): weight streams come in, gradient streams, bias
// gradients and loss sums go out, the activations stay. Over MPI the calls are what
// crosses the wire, never the activations.
#include <cstdint>
#include <span>
#include <vector>

#include "sluice/activation_store.hpp"
#include "sluice/blocks.hpp"
#include "sluice/dense.hpp"
#include "sluice/stream.hpp"

namespace sluice {

/// The shape of a block model's shard: a GPT of `blocks` pre-LayerNorm blocks.
struct BlockShape {
  std::int64_t vocab = 0, context = 0, d_model = 0, heads = 0, blocks = 0;
  bool training = true;  ///< keep the backward's deltas too
};

/// One operation of a block model's step, run by every engine on its store. The comments
/// say which stream it takes (a layer of the model's ModelMemory) and what it returns.
enum class BlockOp : std::int32_t {
  // The dense parameters, from their layers' weight streams (by output) and biases.
  set_table = 1,   ///< the token table
  set_positions,   ///< the learned positions
  set_norm1,       ///< block b's first LayerNorm (gain stream, bias)
  set_norm2,       ///< block b's second LayerNorm
  set_final_norm,  ///< the final LayerNorm
  // Forward. A projection takes its layer's stream by output and its bias.
  embed,       ///< x(0) = table[inputs] + positions
  norm1,       ///< n1 = LayerNorm1(x)
  q,           ///< q = Wq n1 + b (projection)
  k,           ///< k = Wk n1 + b (projection)
  v,           ///< v = Wv n1 + b (projection)
  attention,   ///< att = causal attention of q, k, v
  o,           ///< mid = Wo att + b (projection)
  norm2,       ///< mid += x, n2 = LayerNorm2(mid)
  up,          ///< u = Wup n2 + b (projection)
  gelu,        ///< h = GELU(u)
  down,        ///< x(b + 1) = Wdown h + b + mid (projection)
  final_norm,  ///< nf = LayerNorm(x(blocks))
  head,        ///< logits = Whead nf + b (projection)
  loss,        ///< the cross-entropy's sums; with want_delta, d_logits of the mean
  // Backward, in reverse. A projection's takes its layer's stream by input and returns its
  // weight gradient and bias gradient; a LayerNorm's takes its gain stream again and
  // returns the gain's gradient (in that stream's order) and the bias's.
  head_back,        ///< dnf = Whead^T d_logits
  final_norm_back,  ///< dx = LayerNorm backward of dnf
  down_back,        ///< dh = Wdown^T dx
  gelu_back,        ///< du = dh GELU'(u)
  up_back,          ///< dn = Wup^T du
  norm2_back,       ///< dmid = LayerNorm2 backward of dn, + dx
  o_back,           ///< datt = Wo^T dmid
  attention_back,   ///< dq, dk, dv from datt
  q_back,           ///< dn = Wq^T dq
  k_back,           ///< dn += Wk^T dk
  v_back,           ///< dn += Wv^T dv
  norm1_back,       ///< dx = LayerNorm1 backward of dn, + dmid
  table_back,       ///< the token table's gradient (its stream again), from dx
  positions_back,   ///< the positions' gradient (its stream again), from dx
};
inline constexpr std::int32_t kFirstBlockOp = static_cast<std::int32_t>(BlockOp::set_table);
inline constexpr std::int32_t kLastBlockOp = static_cast<std::int32_t>(BlockOp::positions_back);
const char* to_string(BlockOp op);

/// Whether an operation takes a weight stream; whether it multiplies by it (then it needs
/// the engine's placement of the layer); whether it returns a gradient to be summed over
/// the engines (and with it a bias gradient, has_bias_gradient).
bool takes_stream(BlockOp op);
bool is_projection(BlockOp op);
bool returns_gradient(BlockOp op);
bool has_bias_gradient(BlockOp op);

struct BlockCall {
  BlockOp op = BlockOp::embed;
  std::int32_t block = 0;         ///< the transformer block, for per-block operations
  bool want_delta = false;        ///< loss: compute d_logits
  std::int64_t total_tokens = 0;  ///< loss: every engine's tokens (the mean's divisor)
};

/// What one engine returns of a call: a gradient stream (in the weight stream's order)
/// and a bias gradient, or loss sums.
struct BlockReply {
  WeightStream gradient;
  std::vector<float> bias_gradient;
  LossSums loss;
};

/// One engine's shard of a block model's batch. Public for the engine's operations and
/// their tests; the fields are what the names say (feature-major, tokens as columns).
class BlockStore {
 public:
  struct Block {
    DenseMatrix x;  ///< the block's input: the residual stream
    DenseMatrix n1, q, k, v, att, mid, n2, u, h;
    std::vector<float> mean1, inv1, mean2, inv2, probabilities;
  };
  struct Norm {
    std::vector<float> gain, bias;
  };

  /// Takes a shard's tokens (whole sequences of shape.context) and sizes every buffer;
  /// the previous batch's buffers are kept when they fit (a training batch's also through
  /// an evaluation's of as many tokens between two steps), and another shape is zeroed in
  /// the memory the buffers have where it holds it. ShapeError / ArgumentError for
  /// a shape that makes no model, a partial sequence, or a token outside the vocabulary.
  void load(const BlockShape& shape, std::span<const std::int32_t> inputs,
            std::span<const std::int32_t> targets);

  bool loaded() const { return tokens_ > 0; }
  const BlockShape& shape() const { return shape_; }
  std::int64_t tokens() const { return tokens_; }
  AttentionShape attention() const { return {shape_.context, shape_.heads}; }
  /// Block b's output: the next block's input, or after the last block `x_out`.
  DenseMatrix& block_output(std::size_t b) {
    return b + 1 < blocks.size() ? blocks[b + 1].x : x_out;
  }

  std::vector<std::int32_t> inputs, targets;
  std::vector<Block> blocks;
  DenseMatrix x_out, nf, logits, d_logits;
  std::vector<float> mean_f, inv_f;
  // The backward's deltas (training only), reused block after block.
  DenseMatrix dnf, dx, dh, du, dn, dmid, datt, dq, dk, dv;
  DenseMatrix d_table, d_positions;
  // The dense parameters as streamed in.
  DenseMatrix table, positions;
  std::vector<Norm> norm1, norm2;
  Norm final;

 private:
  BlockShape shape_;  ///< the batch's: training says whether its backward may run
  std::int64_t tokens_ = 0;
  bool training_buffers_ = false;  ///< whether the buffers include the backward's deltas
};

}  // namespace sluice
