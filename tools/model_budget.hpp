#pragma once
// What a model takes to train, checked before it is built: a data file's one stray label of
// 10^6 implies a million-class output layer, and a GPT's --context 4096 with the default
// batch tens of gigabytes of activations; each is refused naming where it came from rather
// than built for minutes (or until the process is killed).
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace sluice {
struct Dataset;
struct GptConfig;
}  // namespace sluice

namespace sluice::cli {

/// The least a sparse MLP of `sizes` at `sparsity` holds while it trains on batches of
/// `batch`: its model, per non-zero its value, column, transposed pattern, gradient,
/// optimizer moments, placements and stream; its activations, per neuron and token the
/// pre-activation, activation and delta.
double mlp_model_bytes(const std::vector<std::int64_t>& sizes, double sparsity);
double mlp_activation_bytes(const std::vector<std::int64_t>& sizes, std::int64_t batch);

/// "file:line: label N" for the first sample of `data` (loaded from the CSV `path`) with
/// its largest label: where its class count comes from.
std::string largest_label_source(const std::filesystem::path& path, const Dataset& data);

/// Throws unless the two fit in the memory this process can have, the model
/// counted as at most `store_ram_bytes` where a model store holds it (its RAM budget): a
/// FormatError naming what `label_source` says (the sizes came from the data's classes;
/// asked only then, as it may read the file again) when it is given, else a UsageError
/// naming `layers_flag`.
void require_mlp_memory(const std::vector<std::int64_t>& sizes, double sparsity, std::int64_t batch,
                        std::optional<double> store_ram_bytes,
                        const std::function<std::string()>& label_source,
                        const std::string& layers_flag);

/// The least a GPT of `config` holds while it trains: `gpt_model_bytes` for its ModelMemory
/// (each stored weight as an MLP's non-zero above), `gpt_activation_bytes` for a shard of
/// `sequences` on an engine (per token what its BlockStore keeps: per block the residual
/// stream, both norms, Q, K, V, the attention's output and probabilities, the feed-forward's
/// u and GELU(u); the final norm, the logits and their delta; the backward's deltas).
double gpt_model_bytes(const GptConfig& config);
double gpt_activation_bytes(const GptConfig& config, std::int64_t sequences);

/// Throws UsageError unless a GPT training on batches of `batch` sequences fits in the memory
/// this process can have. `model_here`: its ModelMemory is in RAM (not a store, whose budget
/// is checked on its own); `engines_here`: the engines sharing the batch are in this process
/// (else each engine rank must hold one engine's shard).
void require_gpt_memory(const GptConfig& config, std::int64_t batch, int engines, bool model_here,
                        bool engines_here);

}  // namespace sluice::cli
