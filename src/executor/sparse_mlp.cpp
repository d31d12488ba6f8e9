// The sparse MLP as a model in ModelMemory: building one, and reading one's layer sizes
// back (what the executor and the command line check a checkpoint against).
#include <algorithm>
#include <cmath>
#include <string>

#include "sluice/error.hpp"
#include "sluice/executor.hpp"

namespace sluice {

std::vector<std::int64_t> mlp_sizes(const ModelMemory& memory) {
  const std::int32_t layers = memory.layer_count();
  if (layers < 1) throw ArgumentError("the ModelMemory holds no layers");
  std::vector<std::int64_t> sizes{memory.layer_shape(0).cols};
  for (std::int32_t l = 0; l < layers; ++l) {
    const LayerShape w = memory.layer_shape(l);
    if (w.cols != sizes.back()) {
      throw ShapeError("layer " + std::to_string(l) + " takes " + std::to_string(w.cols) +
                       " inputs but the layer below gives " + std::to_string(sizes.back()));
    }
    sizes.push_back(w.rows);
  }
  return sizes;
}

void build_sparse_mlp(ModelMemory& memory, const std::vector<std::int64_t>& sizes, double sparsity,
                      std::uint64_t seed) {
  if (sizes.size() < 2) throw ShapeError("build_sparse_mlp: needs at least two sizes");
  for (std::size_t l = 0; l < sizes.size(); ++l) {
    // A layer of width 0 would pass nothing on: the net's output would not depend on X.
    if (sizes[l] < 1) {
      throw ShapeError("build_sparse_mlp: size " + std::to_string(l) + " is " +
                       std::to_string(sizes[l]) + "; every layer needs at least one feature");
    }
  }
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    CsrMatrix w = CsrMatrix::random(sizes[l + 1], sizes[l], sparsity, seed + 7919 * (l + 1));
    const double fan_in = std::max(1.0, (1.0 - sparsity) * static_cast<double>(sizes[l]));
    w.fill_values(seed + 104729 * (l + 1), static_cast<float>(std::sqrt(6.0 / fan_in)));
    memory.add_layer(std::move(w),
                     std::vector<float>(static_cast<std::size_t>(sizes[l + 1]), 0.0F));
  }
}

}  // namespace sluice
