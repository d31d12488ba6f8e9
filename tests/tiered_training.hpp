#pragma once
// What the TieredModelMemory tests share (test_tiered_model_memory.cpp, which trains it
// against HostModelMemory, and test_model_store.cpp, which corrupts, locks and kills its
// store): a small MLP's sizes and data, the optimizers, a one-thread trainer, bitwise
// comparison of every layer's values, and the least budget that trains the layers.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sluice/dynamic_sparsity.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/stream_codec.hpp"
#include "sluice/tiered_model_memory.hpp"

namespace sluice::testing {

inline const std::vector<std::int64_t> kSizes{12, 40, 33, 10};
constexpr std::int64_t kBatch = 16;

struct Data {
  std::vector<DenseMatrix> x;
  std::vector<std::vector<int>> labels;
};

inline Data make_data(int steps, std::uint64_t seed) {
  Data d;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (int s = 0; s < steps; ++s) {
    DenseMatrix x(kSizes.front(), kBatch);
    std::vector<int> y;
    for (std::int64_t t = 0; t < kBatch; ++t) {
      for (std::int64_t i = 0; i < x.rows(); ++i) x(i, t) = normal(rng);
      y.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(kSizes.back())));
    }
    d.x.push_back(std::move(x));
    d.labels.push_back(std::move(y));
  }
  return d;
}

inline OptimizerConfig config_of(OptimizerKind kind, double clip = 0) {
  OptimizerConfig c;
  c.kind = kind;
  c.learning_rate = 0.01;
  if (kind == OptimizerKind::sgd) c.momentum = 0.9;
  if (kind != OptimizerKind::adam) c.weight_decay = 1e-3;
  c.clip_global_norm = clip;
  return c;
}

/// Every layer's values (decoded from its stream) and bias.
inline std::vector<std::vector<float>> snapshot(const ModelMemory& m) {
  std::vector<std::vector<float>> out;
  for (std::int32_t l = 0; l < m.layer_count(); ++l) {
    out.push_back(decode_stream(m.stream(l)).values());
    out.push_back(m.bias(l));
  }
  return out;
}

inline void expect_bitwise_equal(const std::vector<std::vector<float>>& a,
                                 const std::vector<std::vector<float>>& b,
                                 const std::string& where) {
  ASSERT_EQ(a.size(), b.size()) << where;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size()) << where << ", array " << i;
    for (std::size_t k = 0; k < a[i].size(); ++k) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(a[i][k]), std::bit_cast<std::uint32_t>(b[i][k]))
          << where << ", array " << i << ", element " << k;
    }
  }
}

/// The options of a Trainer (below).
inline ExecutorOptions trainer_options(Precision precision, DynamicSparsity dynamic,
                                       std::size_t layers,
                                       std::optional<StreamOrder> backward_order) {
  ExecutorOptions eo;
  eo.dynamic = dynamic;
  eo.backward_order = backward_order;
  eo.precisions.assign(layers, precision);
  eo.chunk_packets = 64;
  eo.prefetch_depth = 2;
  return eo;
}

/// The least budget that trains layers of `shapes` with `engines` engines: the largest
/// working set and what the Trainer holds beside the store. The store must evict between
/// layers.
inline std::int64_t tight_budget(const std::vector<LayerShape>& shapes, int engines) {
  std::int64_t most = 0;
  for (const LayerShape& s : shapes) most = std::max(most, TieredModelMemory::working_set_bytes(s));
  const ExecutorOptions eo = trainer_options(Precision::fp32, {}, shapes.size(), std::nullopt);
  return executor_least_ram_budget(shapes, eo, engines, most);
}

/// The same for kSizes' layers taken dense, the most they hold, and two engines at most.
inline std::int64_t tight_budget() {
  std::vector<LayerShape> shapes;
  for (std::size_t l = 0; l + 1 < kSizes.size(); ++l) {
    shapes.push_back({kSizes[l + 1], kSizes[l], kSizes[l + 1] * kSizes[l], kSizes[l + 1]});
  }
  return tight_budget(shapes, 2);
}

/// The shapes of the layers of `memory`.
inline std::vector<LayerShape> shapes_of(const ModelMemory& memory) {
  std::vector<LayerShape> shapes;
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) shapes.push_back(memory.layer_shape(l));
  return shapes;
}

struct Trainer {
  /// `backward_order` unset: the executor's own choice (ExecutorOptions::backward_order).
  Trainer(ModelMemory& m, int engines, Precision precision, DynamicSparsity dynamic = {},
          std::size_t layers = kSizes.size() - 1,
          std::optional<StreamOrder> backward_order = std::nullopt)
      : fabric(fabric_options(engines)) {
    exec = std::make_unique<LayerStreamingExecutor>(
        m, fabric, trainer_options(precision, dynamic, layers, backward_order));
  }
  static LocalFabricOptions fabric_options(int engines) {
    LocalFabricOptions fo;
    fo.engines = engines;
    fo.engine.threads = 1;
    return fo;
  }
  /// The order this trainer's backward takes: a trainer compared with it bit for bit
  /// takes it too (the orders sum dX in different orders).
  StreamOrder order() const { return exec->backward_order(exec->layer_count() - 1); }
  StepResult step(const Data& d, int s) {
    const auto i = static_cast<std::size_t>(s) % d.x.size();
    return exec->train_step({d.x[i].view(), d.labels[i], {}});
  }
  LocalFabric fabric;
  std::unique_ptr<LayerStreamingExecutor> exec;
};

}  // namespace sluice::testing
