#pragma once
// What a sparse MLP takes to train, checked before it is built: a data file's one stray
// label of 10^6 implies a million-class output layer, which is refused naming the file and
// line rather than built for minutes (or until the process is killed).
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace sluice {
struct Dataset;
}

namespace sluice::cli {

/// The least a sparse MLP of `sizes` at `sparsity` holds while it trains on batches of
/// `batch`: per non-zero its value, column, transposed pattern, gradient, optimizer
/// moments, placements and stream; per neuron and token the pre-activation, activation
/// and delta.
double mlp_training_bytes(const std::vector<std::int64_t>& sizes, double sparsity,
                          std::int64_t batch);

/// "file:line: label N" for the first sample of `data` (loaded from the CSV `path`) with
/// its largest label: where its class count comes from.
std::string largest_label_source(const std::filesystem::path& path, const Dataset& data);

/// Throws unless mlp_training_bytes fits in the memory this process can have: a
/// FormatError naming `label_source` (the sizes came from the data's classes) when it is
/// not empty, else a UsageError naming `layers_flag`.
void require_mlp_memory(const std::vector<std::int64_t>& sizes, double sparsity, std::int64_t batch,
                        const std::string& label_source, const std::string& layers_flag);

}  // namespace sluice::cli
