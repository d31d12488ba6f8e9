#pragma once
// The weightless blocks of a transformer, as an engine runs them on its resident activations:
// token embedding with learned positions, LayerNorm, causal multi-head self-attention
// arithmetic, GELU, residual adds and the byte-level softmax cross-entropy. The projections
// around them are sparse layers streamed from ModelMemory; these functions only do what lies
// between.
//
// Activations are feature-major like everywhere in sluice: rows = features, columns = tokens.
// A batch of `sequences` sequences of `context` tokens each is laid out contiguously: the
// tokens of sequence s are the columns [s * context, (s + 1) * context).
//
// Every function checks its shapes and throws ShapeError (naming the block and the
// mismatch) before touching an output. Outputs are overwritten; parameter gradients (gains,
// biases, embedding tables) are added to, so a caller can accumulate them over micro-batches.
#include <cstdint>
#include <span>

#include "sluice/dense.hpp"

namespace sluice {

// --- token embedding + learned positions -------------------------------------------------

/// x(f, t) = tokens_table(tokens[t], f) + positions(t % context, f).
/// tokens_table is vocab x d_model (one row per symbol, as a tied LM head's weight rows),
/// positions is context x d_model, x is d_model x tokens.size(); every token < vocab.
void embedding_forward(std::span<const std::int32_t> tokens, ConstMatrixView tokens_table,
                       ConstMatrixView positions, MutableMatrixView x);

/// The scatter-add backward: d_tokens_table(tokens[t], f) += dx(f, t) and
/// d_positions(t % context, f) += dx(f, t).
void embedding_backward(std::span<const std::int32_t> tokens, ConstMatrixView dx,
                        MutableMatrixView d_tokens_table, MutableMatrixView d_positions);

// --- LayerNorm ------------------------------------------------------------------------------

/// What the LayerNorm backward needs from its forward: per token, the mean and 1/sqrt(var+eps)
/// of the features.
struct LayerNormStatistics {
  std::span<float> mean;     ///< one per token
  std::span<float> inv_std;  ///< one per token
};

inline constexpr float kLayerNormEpsilon = 1e-5F;

/// Per token (column): y(f, t) = gain[f] * (x(f, t) - mean_t) * inv_std_t + bias[f], with the
/// biased variance over the d_model features. Fills `stats` (each span one per token).
void layer_norm_forward(ConstMatrixView x, std::span<const float> gain, std::span<const float> bias,
                        MutableMatrixView y, LayerNormStatistics stats,
                        float epsilon = kLayerNormEpsilon);

/// dx from dy (overwritten); d_gain[f] += sum_t dy(f, t) * x_hat(f, t), d_bias[f] += sum_t
/// dy(f, t).
void layer_norm_backward(ConstMatrixView x, std::span<const float> gain,
                         std::span<const float> mean, std::span<const float> inv_std,
                         ConstMatrixView dy, MutableMatrixView dx, std::span<float> d_gain,
                         std::span<float> d_bias);

// --- causal multi-head self-attention -------------------------------------------------------

/// The shape of one attention call. Head h owns the feature rows [h * d_head, (h + 1) * d_head)
/// of Q, K, V and of the output, d_head = d_model / heads.
struct AttentionShape {
  std::int64_t context = 0;  ///< tokens per sequence
  std::int64_t heads = 0;
};

/// Floats the attention forward saves for its backward: sequences * heads * context^2 (the
/// probabilities, the upper triangle zero).
std::int64_t attention_probabilities_size(std::int64_t tokens, AttentionShape shape);

/// out = softmax(mask(Q_h^T K_h / sqrt(d_head))) applied to V_h for every sequence and head:
/// out(h*d_head + f, i) = sum_{j <= i} P(i, j) V(h*d_head + f, j), P row-wise softmax over the
/// tokens j <= i of the same sequence. Q, K, V, out are d_model x tokens, tokens a multiple
/// of context. `probabilities` (attention_probabilities_size floats) receives P.
void causal_attention_forward(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                              AttentionShape shape, MutableMatrixView out,
                              std::span<float> probabilities);

/// dQ, dK, dV (overwritten) from d_out and the forward's inputs and probabilities.
void causal_attention_backward(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                               std::span<const float> probabilities, AttentionShape shape,
                               ConstMatrixView d_out, MutableMatrixView dq, MutableMatrixView dk,
                               MutableMatrixView dv);

// --- elementwise ----------------------------------------------------------------------------

/// y += x (a residual add; its backward passes the gradient to both branches unchanged).
void residual_add(MutableMatrixView y, ConstMatrixView x);

/// y = GELU(z), the tanh approximation 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), the
/// same formula as the MLP's Activation::gelu.
void gelu_forward(ConstMatrixView z, MutableMatrixView y);

/// dz = dy * GELU'(z).
void gelu_backward(ConstMatrixView z, ConstMatrixView dy, MutableMatrixView dz);

// --- loss -----------------------------------------------------------------------------------

/// Softmax cross-entropy of every token's logits column (vocab x tokens, e.g. 256 bytes)
/// against targets[t] < vocab, in nats. Returns the sum over the tokens; when `dlogits` has
/// data it receives the gradient of (scale * that sum): scale * (softmax - one_hot).
double softmax_cross_entropy(ConstMatrixView logits, std::span<const std::int32_t> targets,
                             MutableMatrixView dlogits, float scale = 1.0F);

}  // namespace sluice
