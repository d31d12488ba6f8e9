// Uses an installed sluice::torch: a SparseLinear forward and backward inside libtorch, the
// output's shape and a finite input gradient checked. Exits non-zero on any failure.
#include <torch/torch.h>

#include <cstdio>
#include <exception>

#include "sluice/torch/sparse_linear.hpp"

int main() {
  try {
    torch::manual_seed(1);
    sluice::torch::SparseLinear layer(sluice::torch::SparseLinearOptions(48, 32).sparsity(0.9));
    const torch::Tensor x = torch::randn({20, 48}).requires_grad_(true);
    const torch::Tensor y = layer->forward(x);
    if (y.sizes() != torch::IntArrayRef({20, 32})) {
      std::fprintf(stderr, "consumer_torch: output shape is wrong\n");
      return 1;
    }
    y.sum().backward();
    if (!x.grad().defined() || x.grad().sizes() != x.sizes() ||
        !torch::isfinite(x.grad()).all().item<bool>()) {
      std::fprintf(stderr, "consumer_torch: no finite input gradient\n");
      return 1;
    }
    std::puts("consumer_torch: ok");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer_torch: %s\n", e.what());
    return 1;
  }
}
