#pragma once
// A byte-level GPT trained by weight streaming: token embedding with learned positions, a
// sequence of pre-LayerNorm transformer blocks (causal multi-head self-attention, then a
// GELU feed-forward of 4 * d_model, each around a residual add), a final LayerNorm and an LM
// head over the 256 byte values.
//
// Every parameter lives in one ModelMemory as a layer, so the chosen optimizer updates all
// of them there and a checkpoint holds the whole model:
//   * the projections (Q, K, V, the attention output, both feed-forward layers and the LM
//     head) are sparse layers with their biases, streamed to the fabric's engines;
//   * the dense parameters are layers whose mask is full, streamed the same way: the token
//     table (vocab x d_model), the positions (context x d_model), and each LayerNorm as a
//     d_model x 1 layer whose weights are its gains and whose bias is its bias.
// The weightless blocks between the projections are those of sluice/blocks.hpp.
//
// Data parallel over the fabric's engines by whole sequences (attention mixes the tokens of
// a sequence): engine k takes the sequences [k S / E, (k + 1) S / E) of a batch of S. The
// loss is the mean over every token of the batch, so E engines compute the gradient of one.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sluice/dynamic_sparsity.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/text_corpus.hpp"

namespace sluice {

struct GptConfig {
  std::int64_t vocab = TextCorpus::kSymbols;
  std::int64_t context = 128;  ///< tokens per sequence (and learned positions)
  std::int64_t d_model = 256;
  std::int64_t heads = 4;  ///< d_model must be a multiple of it
  std::int64_t blocks = 4;
  /// Of every projection and of the LM head; the dense parameters are dense.
  double sparsity = 0.9;

  /// ArgumentError naming the field unless these make a model.
  void validate() const;
  /// "gpt vocab=256 context=128 d_model=256 heads=4 blocks=4": the shape as a checkpoint
  /// keeps it (ModelMemory::model). The sparsity is in the masks.
  std::string describe() const;
  /// The inverse of describe() (sparsity 0); FormatError for any other text.
  static GptConfig parse(const std::string& text);
};

/// Where a GPT's parameters are in its ModelMemory: layer indices, in this order.
struct GptLayers {
  struct Block {
    std::int32_t norm1, q, k, v, o, norm2, up, down;
  };
  std::int32_t table = 0, positions = 1;
  std::vector<Block> blocks;
  std::int32_t final_norm = 0, head = 0;
  std::int32_t count = 0;  ///< layers in all

  explicit GptLayers(const GptConfig& config);
  /// The sparse layers (every block's Q, K, V, O, up, down, then the LM head), increasing:
  /// the ones whose masks dynamic sparsity changes.
  std::vector<std::int32_t> sparse() const;
};

/// A layer of a GPT as build_gpt adds it: its shape, whether it has a bias, and whether its
/// mask is drawn at the config's sparsity (a projection) or full (an embedding table, a
/// LayerNorm's gain).
struct GptLayerShape {
  std::int64_t rows = 0, cols = 0;
  bool bias = false, sparse = false;
};
/// The layers of a GPT of `config`, in the order build_gpt adds them (GptLayers' indices):
/// what a store's budget must hold before the model is built.
std::vector<GptLayerShape> gpt_layer_shapes(const GptConfig& config);

/// Adds a fresh GPT of `config` to `memory`, which must hold no layers (ArgumentError), and
/// sets memory.model to config.describe(). Projections: seeded random masks at the
/// sparsity, uniform values of variance 1 / expected fan-in (the residual branches' last
/// projections scaled down by sqrt(2 * blocks)), zero biases. LayerNorm gains 1, biases 0.
void build_gpt(ModelMemory& memory, const GptConfig& config, std::uint64_t seed);

/// The GPT `memory` holds: its config parsed from memory.model and checked against the
/// layers' shapes (FormatError naming the first mismatch). The sparsity is the projections'
/// measured one.
GptConfig gpt_config_of(const ModelMemory& memory);

/// Weights and biases a GPT of `config` has when dense, and what `memory` stores of them.
std::int64_t gpt_parameters(const GptConfig& config);
std::int64_t stored_parameters(const ModelMemory& memory);

struct GptStep {
  double loss = 0;  ///< mean nats per token, before the update
  StepReport report;
  StepMetrics metrics;
};

class GptModel {
 public:
  /// The model in `memory` (built by build_gpt or loaded from its checkpoint), its
  /// products run by `fabric`'s engines. The config must be the memory's (ShapeError).
  /// With a `dynamic` rule other than none, train_step changes the sparse layers' masks
  /// on its schedule (GptLayers::sparse; the dense parameters' masks never change), as
  /// the MLP's executor does (sluice/dynamic_sparsity.hpp); ArgumentError if it is invalid.
  /// `projections`: the precision the projections and the LM head stream in (bf16: half the
  /// bytes, fp32 sums and master weights; a projection of more than 65535 inputs or
  /// outputs, which a bf16 stream's tags cannot address, streams in fp32). The dense
  /// parameters stream in fp32.
  GptModel(ModelMemory& memory, Fabric& fabric, GptConfig config, DynamicSparsity dynamic = {},
           Precision projections = Precision::fp32);
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  const GptConfig& config() const;

  /// Forward, backward, every layer's gradient to ModelMemory, commit_step, then on an
  /// update step of the schedule the sparse layers' mask updates. The batch's
  /// context must be the model's and its sequences at least the engines (ShapeError).
  GptStep train_step(const TextBatch& batch);
  /// Forward and backward only: the gradient of the batch's mean loss for every layer
  /// (index = layer), the weights' in the layer's CSR order.
  std::vector<LayerGradient> gradients(const TextBatch& batch, double* loss = nullptr);
  /// The batch's mean loss in nats per token (forward only).
  double loss(const TextBatch& batch);
  /// The logits of the byte that follows `tokens` (the last `context` of them count; at
  /// least one), vocab of them.
  std::vector<float> next_logits(std::span<const std::int32_t> tokens);

  /// Counters summed over every train_step.
  const StepMetrics& totals() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// `bytes` bytes sampled after `prompt` (which may be empty) from softmax(logits /
/// temperature); temperature 0 takes the most likely byte. The same seed gives the same
/// text. ArgumentError for a negative temperature or byte count.
std::string generate_text(GptModel& model, std::string_view prompt, std::int64_t bytes,
                          double temperature, std::uint64_t seed);

}  // namespace sluice
