#include "model_budget.hpp"

#include <algorithm>
#include <fstream>

#include "commands.hpp"
#include "core/available_memory.hpp"
#include "sluice/dataset.hpp"
#include "sluice/error.hpp"

namespace sluice::cli {

double mlp_training_bytes(const std::vector<std::int64_t>& sizes, double sparsity,
                          std::int64_t batch) {
  double bytes = 0;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    const double cells = static_cast<double>(sizes[l]) * static_cast<double>(sizes[l + 1]);
    // The value, column, transposed index and position, gradient and two optimizer moments
    // are 28 bytes; with the generated mask, the placements and the streams a 512 x 10^6
    // layer at 90% peaked near 80 (sluice train, Nov 2026). 64 stays below what it takes.
    bytes += 64.0 * (1.0 - sparsity) * cells;
  }
  for (const std::int64_t size : sizes) {
    bytes += 12.0 * static_cast<double>(size) * static_cast<double>(batch);
  }
  return bytes;
}

std::string largest_label_source(const std::filesystem::path& path, const Dataset& data) {
  if (data.labels.empty()) return path.string();
  const auto largest = std::max_element(data.labels.begin(), data.labels.end());
  const auto sample = largest - data.labels.begin();
  if (path.extension() == ".gz") {
    return path.string() + ": sample " + std::to_string(sample + 1) + ", label " +
           std::to_string(*largest);
  }
  // load_csv keeps every line that is not blank as a sample, in order.
  std::ifstream in(path);
  std::int64_t line_number = 0, samples = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (samples++ == sample) break;
  }
  return path.string() + ":" + std::to_string(line_number) + ": label " + std::to_string(*largest);
}

void require_mlp_memory(const std::vector<std::int64_t>& sizes, double sparsity, std::int64_t batch,
                        const std::string& label_source, const std::string& layers_flag) {
  std::string layers;
  for (const std::int64_t s : sizes) layers += (layers.empty() ? "" : ",") + std::to_string(s);
  const std::string what = "a model of layers " + layers;
  try {
    detail::require_memory(mlp_training_bytes(sizes, sparsity, batch), what);
  } catch (const ResourceError& e) {
    if (!label_source.empty()) {
      throw FormatError(label_source + " implies " + std::to_string(sizes.back()) +
                        " classes: " + e.what());
    }
    throw UsageError(layers_flag + ": " + e.what());
  }
}

}  // namespace sluice::cli
