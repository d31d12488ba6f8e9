// The activation store keeps its buffers for a narrower shard (an epoch's short last
// batch) and hands out their first columns: the buffers are reused, the views say the
// shard's width, and nothing the wider shards left in the other columns reaches a result.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "sluice/activation_store.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"

namespace sluice {
namespace {

const std::vector<std::int64_t> kSizes = {13, 17, 11, 5};

PassSpec training_spec() {
  return {kSizes, {Activation::gelu, Activation::relu, Activation::none}, Loss::mse, true};
}

DenseMatrix normal_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  DenseMatrix m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) m(r, c) = normal(rng);
  }
  return m;
}

void load(ActivationStore& store, const DenseMatrix& x, const DenseMatrix& targets) {
  store.load(training_spec(), {x.view(), {}, targets.view()});
}

TEST(ActivationStore, ANarrowerShardTakesTheFirstColumnsOfTheBuffersItFinds) {
  ActivationStore store;
  const DenseMatrix wide = normal_matrix(13, 40, 1), wide_targets = normal_matrix(5, 40, 2);
  load(store, wide, wide_targets);
  const float* z0 = store.z(0).data;
  const std::int64_t stride = store.z(0).stride;
  const float* delta = store.delta(17).data;

  const DenseMatrix narrow = normal_matrix(13, 9, 3), narrow_targets = normal_matrix(5, 9, 4);
  load(store, narrow, narrow_targets);
  EXPECT_EQ(store.tokens(), 9);
  for (std::int32_t l = 0; l < store.layers(); ++l) {
    EXPECT_EQ(store.z(l).cols, 9) << "layer " << l;
    EXPECT_EQ(store.out(l).cols, 9) << "layer " << l;
  }
  EXPECT_EQ(store.z(0).data, z0);
  EXPECT_EQ(store.z(0).stride, stride);
  EXPECT_EQ(store.delta(17).data, delta);
  EXPECT_EQ(store.delta(17).cols, 9);
  EXPECT_EQ(store.a(2).cols, 0);  // no activation function: no A
  const ConstMatrixView in = store.in(0), t = *store.targets();
  ASSERT_EQ(in.cols, 9);
  ASSERT_EQ(t.cols, 9);
  for (std::int64_t r = 0; r < 13; ++r) {
    EXPECT_EQ(0, std::memcmp(in.row(r), narrow.row(r), 9 * sizeof(float))) << "row " << r;
  }
  EXPECT_EQ(0, std::memcmp(t.row(4), narrow_targets.row(4), 9 * sizeof(float)));

  // Wider than the buffers: new ones of its width.
  const DenseMatrix wider = normal_matrix(13, 70, 5), wider_targets = normal_matrix(5, 70, 6);
  load(store, wider, wider_targets);
  EXPECT_EQ(store.z(0).cols, 70);
  EXPECT_GE(store.z(0).stride, 70);
  EXPECT_EQ(store.delta(17).cols, 70);
}

// Steps of changing widths, with inferences between them, on engines that keep their
// buffers, against the same steps each on engines made for it: bit for bit the same.
TEST(ActivationStore, NarrowerBatchesOnKeptBuffersChangeNoResult) {
  constexpr std::int64_t kWidest = 24;
  const std::int64_t widths[] = {kWidest, 7, kWidest, 3, 17, 5};
  std::vector<DenseMatrix> xs;
  std::vector<std::vector<int>> labels;
  std::mt19937_64 rng(8);
  for (std::size_t s = 0; s < std::size(widths); ++s) {
    xs.push_back(normal_matrix(kSizes.front(), widths[s], 10 + s));
    labels.emplace_back();
    for (std::int64_t t = 0; t < widths[s]; ++t) {
      labels.back().push_back(static_cast<int>(rng() % kSizes.back()));
    }
  }
  OptimizerConfig adam;
  adam.kind = OptimizerKind::adam;
  adam.learning_rate = 1e-2;
  for (const auto [engines, precision] :
       {std::pair{1, Precision::fp32}, std::pair{3, Precision::fp32},
        std::pair{2, Precision::bf16}}) {
    SCOPED_TRACE("engines " + std::to_string(engines) + ", " + to_string(precision));
    ExecutorOptions eo;
    eo.activations = {Activation::gelu, Activation::relu, Activation::none};
    eo.precisions.assign(eo.activations.size(), precision);
    LocalFabricOptions fo;
    fo.engines = engines;
    fo.engine.threads = 2;
    HostModelMemory kept, fresh;
    for (HostModelMemory* m : {&kept, &fresh}) {
      build_sparse_mlp(*m, kSizes, 0.5, 42);
      m->set_optimizer(adam);
    }
    LocalFabric kept_fabric(fo);
    LayerStreamingExecutor kept_exec(kept, kept_fabric, eo);
    for (std::size_t s = 0; s < std::size(widths); ++s) {
      SCOPED_TRACE("step " + std::to_string(s));
      const Batch batch{xs[s].view(), labels[s], {}};
      const StepResult a = kept_exec.train_step(batch);
      LocalFabric fresh_fabric(fo);
      LayerStreamingExecutor fresh_exec(fresh, fresh_fabric, eo);
      const StepResult b = fresh_exec.train_step(batch);
      ASSERT_EQ(a.loss, b.loss);
      ASSERT_EQ(a.accuracy, b.accuracy);
      const DenseMatrix y = kept_exec.infer(xs[s == 1 ? 0 : 1].view());  // wider, narrower
      EXPECT_EQ(y.cols(), s == 1 ? kWidest : 7);
    }
    for (std::int32_t l = 0; l < kept.layer_count(); ++l) {
      const std::vector<float>& a = kept.weights(l).values();
      const std::vector<float>& b = fresh.weights(l).values();
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "layer " << l;
      EXPECT_EQ(kept.bias(l), fresh.bias(l)) << "layer " << l;
    }
    const DenseMatrix narrow = kept_exec.infer(xs[3].view());
    LocalFabric fresh_fabric(fo);
    const DenseMatrix want = LayerStreamingExecutor(fresh, fresh_fabric, eo).infer(xs[3].view());
    ASSERT_EQ(narrow.cols(), want.cols());
    for (std::int64_t r = 0; r < want.rows(); ++r) {
      EXPECT_EQ(0, std::memcmp(narrow.row(r), want.row(r), want.cols() * sizeof(float)));
    }
  }
}

}  // namespace
}  // namespace sluice
