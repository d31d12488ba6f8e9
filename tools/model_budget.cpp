#include "model_budget.hpp"

#include <algorithm>

#include "commands.hpp"
#include "core/available_memory.hpp"
#include "sluice/dataset.hpp"
#include "sluice/error.hpp"
#include "sluice/gpt.hpp"
#include "train_options.hpp"

namespace sluice::cli {
namespace {

// The value, column, transposed index and position, gradient and two optimizer moments are
// 28 bytes; with the generated mask, the placements and the streams a 512 x 10^6 layer at
// 90% peaked near 80 (sluice train, Nov 2026). 64 stays below what it takes.
constexpr double kTrainingBytesPerWeight = 64.0;

}  // namespace

double mlp_activation_bytes(const std::vector<std::int64_t>& sizes, std::int64_t batch) {
  double bytes = 0;
  for (const std::int64_t size : sizes) {
    bytes += 12.0 * static_cast<double>(size) * static_cast<double>(batch);
  }
  return bytes;
}

double mlp_model_bytes(const std::vector<std::int64_t>& sizes, double sparsity) {
  double bytes = 0;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    const double cells = static_cast<double>(sizes[l]) * static_cast<double>(sizes[l + 1]);
    bytes += kTrainingBytesPerWeight * (1.0 - sparsity) * cells;
  }
  return bytes;
}

std::string largest_label_source(const std::filesystem::path& path, const Dataset& data) {
  if (data.labels.empty()) return path.string();
  if (!data.class_names.empty()) {
    return path.string() + ": " + std::to_string(data.class_names.size()) + " class names";
  }
  const auto largest = std::max_element(data.labels.begin(), data.labels.end());
  const auto sample = largest - data.labels.begin();
  const std::int64_t line_number = csv_line_of(path, sample);
  return path.string() + ":" + std::to_string(line_number) + ": label " + std::to_string(*largest);
}

void require_mlp_memory(const std::vector<std::int64_t>& sizes, double sparsity, std::int64_t batch,
                        std::optional<double> store_ram_bytes,
                        const std::function<std::string()>& label_source,
                        const std::string& layers_flag) {
  const std::string what = "a model of layers " + join_sizes(sizes);
  try {
    double model = mlp_model_bytes(sizes, sparsity);
    if (store_ram_bytes) model = std::min(model, *store_ram_bytes);  // a store holds no more
    detail::require_memory(model + mlp_activation_bytes(sizes, batch), what);
  } catch (const ResourceError& e) {
    if (label_source) {
      throw FormatError(label_source() + " implies " + std::to_string(sizes.back()) +
                        " classes: " + e.what());
    }
    throw UsageError(layers_flag + ": " + e.what());
  }
}

double gpt_model_bytes(const GptConfig& config) {
  double weights = 0;
  for (const GptLayerShape& g : gpt_layer_shapes(config)) {
    const double cells = static_cast<double>(g.rows) * static_cast<double>(g.cols);
    weights += g.sparse ? (1.0 - config.sparsity) * cells : cells;  // as mlp_model_bytes
  }
  return kTrainingBytesPerWeight * weights;
}

double gpt_activation_bytes(const GptConfig& config, std::int64_t sequences) {
  const auto d = static_cast<double>(config.d_model);
  const auto vocab = static_cast<double>(config.vocab);
  const double attention = static_cast<double>(config.heads) * static_cast<double>(config.context);
  const double per_block = 16 * d + 4 + attention;  // 8 of d, u and h of 4d, 4 norm statistics
  const double floats_per_token =
      static_cast<double>(config.blocks) * per_block + 2 * d + 2 + 2 * vocab + 16 * d;
  return 4.0 * floats_per_token * static_cast<double>(sequences) *
         static_cast<double>(config.context);
}

void require_gpt_memory(const GptConfig& config, std::int64_t batch, int engines, bool model_here,
                        bool engines_here) {
  const std::int64_t shard = (batch + engines - 1) / engines;
  const double activations = engines_here ? gpt_activation_bytes(config, batch) : 0;
  const double model = model_here ? gpt_model_bytes(config) : 0;
  const std::string what =
      "a GPT of " + config.describe() + " on batches of " + std::to_string(batch) + " sequences";
  try {
    detail::require_memory(model + activations, what);
    if (!engines_here) {
      detail::require_memory(gpt_activation_bytes(config, shard),
                             what + ", an engine rank's " + std::to_string(shard) + " of them");
    }
  } catch (const ResourceError& e) {
    throw UsageError(std::string(e.what()) +
                     " (--batch, --context, --d-model or --blocks sets it)");
  }
}

}  // namespace sluice::cli
