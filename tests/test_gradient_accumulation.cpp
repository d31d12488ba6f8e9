// Gradient accumulation (ModelMemory::accumulate_gradient): a layer's micro-batch
// gradients add up to one update, bit for bit the update of their sum handed in at once
// (without clipping) and against the float64 reference; a rejected stream leaves the sum,
// an overflowing sum skips the step; a model store adds as HostModelMemory does.
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "optimizer_reference.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/stream_codec.hpp"
#include "sluice/tiered_model_memory.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using namespace optimizer_reference;  // NOLINT(google-build-using-namespace)

// a + b elementwise, in float, as the ModelMemory adds.
Gradients sum(const Gradients& a, const Gradients& b) {
  Gradients s = a;
  for (std::size_t l = 0; l < s.weights.size(); ++l) {
    for (std::size_t i = 0; i < s.weights[l].size(); ++i) s.weights[l][i] += b.weights[l][i];
    for (std::size_t i = 0; i < s.bias[l].size(); ++i) s.bias[l][i] += b.bias[l][i];
  }
  return s;
}

// Every layer's gradient, by output or (odd calls) by input, on the masks of `masks` (a
// model store holds none in RAM to build the streams on).
void accumulate(ModelMemory& mm, const Gradients& g, int call, const ModelMemory* masks = nullptr) {
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    const CsrMatrix& mask = (masks != nullptr ? *masks : mm).weights(l);
    mm.accumulate_gradient(l,
                           (call + l) % 2 == 0 ? gradient_stream(mask, g.weights[l])
                                               : gradient_stream_by_input(mask, g.weights[l]),
                           g.bias[l]);
  }
}

OptimizerConfig config_of(OptimizerKind kind, double clip) {
  OptimizerConfig c;
  c.kind = kind;
  c.learning_rate = 0.02;
  c.momentum = kind == OptimizerKind::sgd ? 0.9 : 0.0;
  c.weight_decay = 0.01;
  c.clip_global_norm = clip;
  return c;
}

// Commits `micro`'s step and checks it bit for bit against the same model (built with
// `config`) handed `total` at once.
void expect_step_as_handed_in_at_once(Model& micro, const OptimizerConfig& config,
                                      const Gradients& total) {
  Model whole;
  build(whole, config);
  ASSERT_TRUE(micro.memory.commit_step().applied);
  ASSERT_TRUE(submit_and_commit(whole.memory, total).applied);
  EXPECT_TRUE(fingerprint(micro.memory) == fingerprint(whole.memory));
}

TEST(GradientAccumulation, MicroBatchesUpdateAsTheirSumHandedInAtOnce) {
  for (OptimizerKind kind : {OptimizerKind::sgd, OptimizerKind::adam, OptimizerKind::adamw}) {
    for (double clip : {0.0, 2.0}) {
      SCOPED_TRACE(std::string(to_string(kind)) + (clip > 0 ? ", clipped" : ""));
      Model micro, whole;
      build(micro, config_of(kind, clip), /*large=*/true);
      build(whole, config_of(kind, clip), /*large=*/true);
      for (std::uint32_t step = 0; step < 3; ++step) {
        // Three micro-batches, then one (a step after accumulating starts from nothing).
        const int parts = step == 1 ? 1 : 3;
        Gradients total;
        for (int k = 0; k < parts; ++k) {
          const Gradients g = random_gradients(micro.memory, 100 * step + k);
          accumulate(micro.memory, g, k);
          total = k == 0 ? g : sum(total, g);
        }
        const StepReport got = micro.memory.commit_step();
        const StepReport want = submit_and_commit(whole.memory, total);
        ASSERT_TRUE(got.applied);
        // The norm is summed in another order (a stream's chunks): equal to rounding, so
        // a clipped update is compared with the reference only.
        EXPECT_NEAR(got.gradient_norm, want.gradient_norm, 1e-12 * want.gradient_norm);
        if (clip == 0) {
          EXPECT_TRUE(fingerprint(micro.memory) == fingerprint(whole.memory))
              << "step " << step << ": weights or optimizer state differ";
        }
        micro.ref.apply(total);
        expect_matches_reference(micro, "step " + std::to_string(step));
      }
    }
  }
}

TEST(GradientAccumulation, ARejectedStreamLeavesTheSum) {
  Model micro;
  const OptimizerConfig config = config_of(OptimizerKind::adam, 0);
  build(micro, config);
  const Gradients a = random_gradients(micro.memory, 7), b = random_gradients(micro.memory, 8);
  accumulate(micro.memory, a, 0);
  WeightStream bad = gradient_stream(micro.memory.weights(0), b.weights[0]);
  editable_chunk(bad, 0).packets[0].tag = 52;  // row 0's first weight moved to column 52
  EXPECT_CONTAINS(testing::thrown_message<FormatError>(
                      [&] { micro.memory.accumulate_gradient(0, bad, b.bias[0]); }),
                  "gradient of layer 0, chunk 0");
  std::vector<float> short_bias(b.bias[0].begin(), b.bias[0].end() - 1);
  EXPECT_THROW(micro.memory.accumulate_gradient(
                   0, gradient_stream(micro.memory.weights(0), b.weights[0]), short_bias),
               ShapeError);
  accumulate(micro.memory, b, 1);
  expect_step_as_handed_in_at_once(micro, config, sum(a, b));
}

// submit_gradient takes one gradient a step, as before; accumulate_gradient adds to one.
TEST(GradientAccumulation, SubmitTakesOneAccumulateAddsToIt) {
  Model micro;
  const OptimizerConfig config = config_of(OptimizerKind::sgd, 0);
  build(micro, config);
  const Gradients a = random_gradients(micro.memory, 9), b = random_gradients(micro.memory, 10);
  for (std::int32_t l = 0; l < micro.memory.layer_count(); ++l) {
    const WeightStream first = gradient_stream(micro.memory.weights(l), a.weights[l]);
    micro.memory.submit_gradient(l, first, a.bias[l]);
    EXPECT_CONTAINS(testing::thrown_message<ShapeError>(
                        [&] { micro.memory.submit_gradient(l, first, a.bias[l]); }),
                    "already has a gradient for this step");
  }
  accumulate(micro.memory, b, 0);
  expect_step_as_handed_in_at_once(micro, config, sum(a, b));
}

TEST(GradientAccumulation, DiscardDropsTheSum) {
  Model micro;
  const OptimizerConfig config = config_of(OptimizerKind::adamw, 0);
  build(micro, config);
  accumulate(micro.memory, random_gradients(micro.memory, 11), 0);
  micro.memory.discard_step();
  const Gradients b = random_gradients(micro.memory, 12);
  accumulate(micro.memory, b, 1);
  expect_step_as_handed_in_at_once(micro, config, b);
}

// discard_gradient drops one layer's sum (a trainer's zero_grad); the others' stay.
TEST(GradientAccumulation, DiscardingOneLayersGradientLeavesTheOthers) {
  Model micro;
  const OptimizerConfig config = config_of(OptimizerKind::adam, 0);
  build(micro, config);
  Gradients g = random_gradients(micro.memory, 16);
  accumulate(micro.memory, g, 0);
  accumulate(micro.memory, g, 1);
  micro.memory.discard_gradient(1);
  micro.memory.discard_gradient(1);  // nothing left: nothing to do
  EXPECT_THROW(micro.memory.discard_gradient(3), ArgumentError);
  Gradients sum_but_1 = sum(g, g);
  sum_but_1.weights[1].clear();  // not submitted
  expect_step_as_handed_in_at_once(micro, config, sum_but_1);
}

// Two finite gradients whose sum is not: the step is skipped, as for a non-finite one.
TEST(GradientAccumulation, ASumThatOverflowsSkipsTheStep) {
  Model m;
  build(m, config_of(OptimizerKind::sgd, 0));
  const std::string before = fingerprint(m.memory);
  Gradients g = random_gradients(m.memory, 13);
  g.weights[2][0] = 0.75F * std::numeric_limits<float>::max();
  accumulate(m.memory, g, 0);
  accumulate(m.memory, g, 1);
  const StepReport r = m.memory.commit_step();
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(r.bad_layers, std::vector<std::int32_t>{2});
  EXPECT_TRUE(fingerprint(m.memory) == before) << "state changed";
}

class GradientAccumulationInAStore : public testing::TempDirTest {
 protected:
  // A store holding `plain`'s layers, with its optimizer.
  TieredModelMemory& store_of(const Model& plain, const OptimizerConfig& config) {
    store_ = std::make_unique<TieredModelMemory>(dir_ / "store", std::int64_t{256} << 20);
    store_->set_optimizer(config);
    for (std::int32_t l = 0; l < plain.memory.layer_count(); ++l) {
      store_->add_layer(plain.memory.weights(l), plain.memory.bias(l));
    }
    return *store_;
  }
  std::unique_ptr<TieredModelMemory> store_;
};

// Every layer's values (decoded from its stream) and bias, bit for bit.
void expect_same_model(const ModelMemory& a, const ModelMemory& b, const std::string& when) {
  for (std::int32_t l = 0; l < a.layer_count(); ++l) {
    EXPECT_EQ(decode_stream(a.stream(l)).values(), decode_stream(b.stream(l)).values())
        << when << ", layer " << l;
    EXPECT_EQ(a.bias(l), b.bias(l)) << when << ", layer " << l;
  }
}

// A model store keeps the sum in its spill files and updates from it at the commit: bit
// for bit what HostModelMemory does, clipped too (both sum the norm of a sum alike).
TEST_F(GradientAccumulationInAStore, AddsAsHostModelMemoryDoes) {
  for (OptimizerKind kind : {OptimizerKind::sgd, OptimizerKind::adam}) {
    for (double clip : {0.0, 2.0}) {
      SCOPED_TRACE(std::string(to_string(kind)) + (clip > 0 ? ", clipped" : ""));
      Model host;
      build(host, config_of(kind, clip), /*large=*/true);
      TieredModelMemory& store = store_of(host, config_of(kind, clip));
      for (std::uint32_t step = 0; step < 3; ++step) {
        const int parts = step == 1 ? 1 : 3;
        for (int k = 0; k < parts; ++k) {
          const Gradients g = random_gradients(host.memory, 200 * step + k);
          accumulate(host.memory, g, k);
          accumulate(store, g, k, &host.memory);
        }
        const StepReport want = host.memory.commit_step();
        const StepReport got = store.commit_step();
        ASSERT_TRUE(got.applied);
        EXPECT_EQ(got.gradient_norm, want.gradient_norm);
        expect_same_model(store, host.memory, "step " + std::to_string(step));
      }
      store_.reset();
      std::filesystem::remove_all(dir_ / "store");
    }
  }
}

// The sum read back from a spill file of several update chunks.
TEST_F(GradientAccumulationInAStore, ALayerOfSeveralUpdateChunksAddsAsHostModelMemoryDoes) {
  Model host;
  host.memory.set_optimizer(config_of(OptimizerKind::adam, 0));
  host.memory.add_layer(CsrMatrix::random(2100, 2050, 0.5, 21), std::vector<float>(2100, 0.5F));
  ASSERT_GT(host.memory.layer_shape(0).nnz, std::int64_t{1} << 21);
  TieredModelMemory& store = store_of(host, config_of(OptimizerKind::adam, 0));
  for (int k = 0; k < 2; ++k) {
    const Gradients g = random_gradients(host.memory, 300 + k);
    accumulate(host.memory, g, k);
    accumulate(store, g, k, &host.memory);
  }
  ASSERT_TRUE(host.memory.commit_step().applied);
  ASSERT_TRUE(store.commit_step().applied);
  expect_same_model(store, host.memory, "the step");
}

// discard_gradient drops a layer's spilled sum or its computed update; the others' stay.
TEST_F(GradientAccumulationInAStore, DiscardingOneLayersGradientLeavesTheOthers) {
  for (double clip : {0.0, 2.0}) {
    SCOPED_TRACE(clip > 0 ? "clipped" : "not clipped");
    Model host;
    build(host, config_of(OptimizerKind::sgd, clip));
    TieredModelMemory& store = store_of(host, config_of(OptimizerKind::sgd, clip));
    const Gradients g = random_gradients(host.memory, 17);
    for (std::int32_t l = 0; l < store.layer_count(); ++l) {
      const WeightStream s = gradient_stream(host.memory.weights(l), g.weights[l]);
      store.submit_gradient(l, s, g.bias[l]);  // updated from at once without clipping
      host.memory.submit_gradient(l, s, g.bias[l]);
    }
    if (clip > 0) {  // the gradients wait in the spill files, and are added to
      accumulate(store, g, 0, &host.memory);
      accumulate(host.memory, g, 0);
    }
    store.discard_gradient(0);
    host.memory.discard_gradient(0);
    ASSERT_TRUE(store.commit_step().applied);
    ASSERT_TRUE(host.memory.commit_step().applied);
    expect_same_model(store, host.memory, "the step");
    store_.reset();
    std::filesystem::remove_all(dir_ / "store");
  }
}

// Without clipping a submitted gradient's update is computed at once: a store cannot add
// to it and says so; the step then applies the submitted one. With clipping it waits, and
// a micro-batch is added to it.
TEST_F(GradientAccumulationInAStore, AddsToASubmittedGradientOnlyWhileItWaits) {
  for (double clip : {0.0, 2.0}) {
    SCOPED_TRACE(clip > 0 ? "clipped" : "not clipped");
    Model host;
    build(host, config_of(OptimizerKind::adam, clip));
    TieredModelMemory& store = store_of(host, config_of(OptimizerKind::adam, clip));
    const Gradients a = random_gradients(host.memory, 14), b = random_gradients(host.memory, 15);
    for (std::int32_t l = 0; l < store.layer_count(); ++l) {
      const WeightStream s = gradient_stream(host.memory.weights(l), a.weights[l]);
      store.submit_gradient(l, s, a.bias[l]);
      host.memory.submit_gradient(l, s, a.bias[l]);
    }
    if (clip == 0) {
      EXPECT_CONTAINS(
          testing::thrown_message<ShapeError>([&] { accumulate(store, b, 0, &host.memory); }),
          "cannot add to it");
    } else {
      accumulate(store, b, 0, &host.memory);
      accumulate(host.memory, b, 0);
    }
    ASSERT_TRUE(store.commit_step().applied);
    ASSERT_TRUE(host.memory.commit_step().applied);
    expect_same_model(store, host.memory, "the step");
    store_.reset();
    std::filesystem::remove_all(dir_ / "store");
  }
}

}  // namespace
}  // namespace sluice
