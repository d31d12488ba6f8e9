// A complete sparse-MLP trainer on the built-in synthetic task: weights live in
// ModelMemory, activations on the engines, and the executor streams between them.
//   train_mlp [engines] [epochs]
#include <cstdio>
#include <exception>

#include "count_arg.hpp"
#include "sluice/dataset.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"

int main(int argc, char** argv) try {
  using namespace sluice;
  const int engines = count_arg(argc > 1 ? argv[1] : nullptr, 1);
  const int epochs = count_arg(argc > 2 ? argv[2] : nullptr, 5);
  const std::int64_t batch = 64;
  if (engines < 1 || epochs < 1) {
    std::fprintf(stderr, "usage: train_mlp [engines >= 1] [epochs >= 1]\n");
    return 2;
  }

  // A seeded teacher network labels random inputs: 32 features, 4 classes.
  Dataset data = make_synthetic_dataset(4000, 32, 4, /*seed=*/7);
  auto [train, test] = split_dataset(data, 0.2, /*seed=*/7);
  standardize(train, test);

  HostModelMemory memory;
  build_sparse_mlp(memory, {32, 128, 128, 4}, /*sparsity=*/0.8, /*seed=*/1);
  OptimizerConfig adam;
  adam.kind = OptimizerKind::adam;
  adam.learning_rate = 2e-3;
  memory.set_optimizer(adam);

  LocalFabricOptions fabric_options;
  fabric_options.engines = engines;
  LocalFabric fabric(fabric_options);
  LayerStreamingExecutor executor(memory, fabric);

  const std::int64_t samples = train.features.cols();
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    double loss = 0;
    int steps = 0;
    for (std::int64_t begin = 0; begin + batch <= samples; begin += batch) {
      Batch b;
      b.features = {train.features.data() + begin, train.features.rows(), batch,
                    train.features.stride()};
      b.labels.assign(train.labels.begin() + begin, train.labels.begin() + begin + batch);
      loss += executor.train_step(b).loss;
      ++steps;
    }
    const Evaluation e = executor.evaluate({test.features.view(), test.labels, {}});
    std::printf("epoch %d: loss %.4f, test accuracy %.3f, engine busy %.0f%%\n", epoch,
                loss / steps, e.accuracy, 100 * executor.totals().engine_busy());
  }
  return 0;
} catch (const std::exception& e) {
  // sluice's errors say what is wrong and where (sluice/error.hpp).
  std::fprintf(stderr, "train_mlp: %s\n", e.what());
  return 1;
}
