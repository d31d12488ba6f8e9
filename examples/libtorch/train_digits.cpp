// A complete libtorch trainer whose hidden layers are sluice's sparse layers: a drop-in
// for torch::nn::Linear, trained by a torch optimizer, on the UCI digits.
//   train_digits [digits.csv.gz] [epochs]
#include <torch/torch.h>

#include <cstdio>
#include <exception>

#include "count_arg.hpp"
#include "sluice/dataset.hpp"
#include "sluice/torch/sparse_linear.hpp"

namespace st = sluice::torch;

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1",
                            st::SparseLinear(st::SparseLinearOptions(64, 256).sparsity(0.8)))),
        fc2(register_module(
            "fc2", st::SparseLinear(st::SparseLinearOptions(256, 256).sparsity(0.9).seed(2)))),
        out(register_module("out", torch::nn::Linear(256, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x));  // fc1's output is feature-major: fc2 reads it without a copy
    x = torch::relu(fc2(x));
    return out(x);
  }
  st::SparseLinear fc1, fc2;
  torch::nn::Linear out;
};
TORCH_MODULE(Mlp);

// Samples as a [samples, 64] tensor (a view of sluice's features x samples matrix).
torch::Tensor features_of(const sluice::Dataset& d) {
  return torch::from_blob(const_cast<float*>(d.features.data()), {64, d.samples()},
                          {d.features.stride(), 1})
      .t();
}

int main(int argc, char** argv) try {
  const auto path = sluice::find_digits_file(
      argc > 1 ? std::optional<std::filesystem::path>(argv[1]) : std::nullopt);
  const int epochs = count_arg(argc > 2 ? argv[2] : nullptr, 10);
  if (!path || epochs < 1) {
    std::fprintf(stderr, "usage: train_digits [digits.csv.gz] [epochs >= 1]%s\n",
                 path ? ""
                      : " (no digits file found: give build/data/digits.csv.gz, which "
                        "scripts/sluice-setup fetches, or set SLUICE_DIGITS)");
    return 2;
  }
  auto [train, test] = sluice::split_dataset(sluice::load_digits(*path), 0.2, /*seed=*/7);
  sluice::standardize(train, test);
  const torch::Tensor x_train = features_of(train), x_test = features_of(test);
  const torch::Tensor y_train = torch::tensor(train.labels, torch::kLong);
  const torch::Tensor y_test = torch::tensor(test.labels, torch::kLong);

  torch::manual_seed(1);
  Mlp model;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(2e-3));
  const std::int64_t n = x_train.size(0), batch = 64;
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    const torch::Tensor order = torch::randperm(n, torch::kLong);
    double loss_sum = 0;
    for (std::int64_t s = 0; s < n; s += batch) {
      const torch::Tensor idx = order.slice(0, s, std::min(n, s + batch));
      optimizer.zero_grad();
      torch::Tensor loss = torch::nn::functional::cross_entropy(model(x_train.index_select(0, idx)),
                                                                y_train.index_select(0, idx));
      loss.backward();
      optimizer.step();
      loss_sum += loss.item<double>() * static_cast<double>(idx.size(0));
    }
    torch::NoGradGuard no_grad;
    const double accuracy =
        model(x_test).argmax(1).eq(y_test).to(torch::kDouble).mean().item<double>();
    std::printf("epoch %d: loss %.4f, test accuracy %.4f\n", epoch, loss_sum / n, accuracy);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_digits: %s\n", e.what());
  return 1;
}
