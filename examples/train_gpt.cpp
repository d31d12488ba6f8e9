// A complete byte-level GPT trainer: every parameter lives in ModelMemory, the projections
// are sparse layers streamed to the fabric's engines, and the held-out bytes are scored at
// the end. Then a sample of text from the trained model.
//   train_gpt TEXT [steps] [engines]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>

#include "count_arg.hpp"
#include "sluice/fabric.hpp"
#include "sluice/gpt.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/text_corpus.hpp"

int main(int argc, char** argv) try {
  using namespace sluice;
  const int steps = count_arg(argc > 2 ? argv[2] : nullptr, 300);
  const int engines = count_arg(argc > 3 ? argv[3] : nullptr, 1);
  if (argc < 2 || steps < 1 || engines < 1) {
    std::fprintf(stderr, "usage: train_gpt TEXT [steps >= 1] [engines >= 1]\n");
    return 2;
  }

  GptConfig config;  // 256 bytes in, 256 out
  config.context = 64;
  config.d_model = 128;
  config.heads = 4;
  config.blocks = 2;
  config.sparsity = 0.9;
  const std::int64_t sequences = 16;
  const TextCorpus corpus = TextCorpus::load(argv[1], config.context);

  HostModelMemory memory;
  build_gpt(memory, config, /*seed=*/1);
  OptimizerConfig adam;
  adam.kind = OptimizerKind::adam;
  adam.learning_rate = 6e-3;
  adam.clip_global_norm = 1.0;
  adam.decay.warmup_steps = std::min(50, steps / 10);  // then half a cosine down to 0.1x
  adam.decay.decay_steps = steps;
  memory.set_optimizer(adam);

  LocalFabricOptions fabric_options;
  fabric_options.engines = engines;
  LocalFabric fabric(fabric_options);
  GptModel model(memory, fabric, config);
  std::printf("%lld parameters, %lld stored at sparsity %.2f\n",
              static_cast<long long>(gpt_parameters(config)),
              static_cast<long long>(stored_parameters(memory)), config.sparsity);

  for (int step = 0; step < steps; ++step) {
    const GptStep s = model.train_step(corpus.sample(sequences, /*seed=*/1, step));
    if ((step + 1) % 50 == 0 || step + 1 == steps) {
      std::printf("step %4d  loss %.3f bits/byte  %.0f tokens/s\n", step + 1,
                  s.loss / std::log(2.0), model.totals().tokens_per_second());
    }
  }

  // The held-out part in batches of whole windows, each engine taking whole sequences.
  const std::int64_t windows = corpus.held_out_windows() / engines * engines;
  double nats = 0;
  for (std::int64_t first = 0; first < windows; first += sequences / engines * engines) {
    const std::int64_t count = std::min(sequences / engines * engines, windows - first);
    nats += model.loss(corpus.held_out_batch(first, count)) * static_cast<double>(count);
  }
  std::printf("held out: %.3f bits/byte over %lld windows\n",
              nats / static_cast<double>(windows) / std::log(2.0), static_cast<long long>(windows));
  std::printf("sample: %s\n", generate_text(model, "The ", 120, 0.8, /*seed=*/3).c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_gpt: %s\n", e.what());
  return 1;
}
