// Gradient accumulation (ModelMemory::accumulate_gradient): a layer's micro-batch
// gradients add up to one update, bit for bit the update of their sum handed in at once,
// (without clipping) and against the float64 reference; a rejected stream leaves the sum, an
// overflowing sum skips the step, a model store takes one gradient a layer.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "optimizer_reference.hpp"
#include "sluice/model_memory.hpp"
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

// Every layer's gradient, by output or (odd calls) by input.
void accumulate(ModelMemory& mm, const Gradients& g, int call) {
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    const CsrMatrix& mask = mm.weights(l);
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
  Model micro, whole;
  build(micro, config_of(OptimizerKind::adam, 0));
  build(whole, config_of(OptimizerKind::adam, 0));
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
  ASSERT_TRUE(micro.memory.commit_step().applied);
  ASSERT_TRUE(submit_and_commit(whole.memory, sum(a, b)).applied);
  EXPECT_TRUE(fingerprint(micro.memory) == fingerprint(whole.memory));
}

// submit_gradient takes one gradient a step, as before; accumulate_gradient adds to one.
TEST(GradientAccumulation, SubmitTakesOneAccumulateAddsToIt) {
  Model micro, whole;
  build(micro, config_of(OptimizerKind::sgd, 0));
  build(whole, config_of(OptimizerKind::sgd, 0));
  const Gradients a = random_gradients(micro.memory, 9), b = random_gradients(micro.memory, 10);
  for (std::int32_t l = 0; l < micro.memory.layer_count(); ++l) {
    const WeightStream first = gradient_stream(micro.memory.weights(l), a.weights[l]);
    micro.memory.submit_gradient(l, first, a.bias[l]);
    EXPECT_CONTAINS(testing::thrown_message<ShapeError>(
                        [&] { micro.memory.submit_gradient(l, first, a.bias[l]); }),
                    "already has a gradient for this step");
  }
  accumulate(micro.memory, b, 0);
  ASSERT_TRUE(micro.memory.commit_step().applied);
  ASSERT_TRUE(submit_and_commit(whole.memory, sum(a, b)).applied);
  EXPECT_TRUE(fingerprint(micro.memory) == fingerprint(whole.memory));
}

TEST(GradientAccumulation, DiscardDropsTheSum) {
  Model micro, whole;
  build(micro, config_of(OptimizerKind::adamw, 0));
  build(whole, config_of(OptimizerKind::adamw, 0));
  accumulate(micro.memory, random_gradients(micro.memory, 11), 0);
  micro.memory.discard_step();
  const Gradients b = random_gradients(micro.memory, 12);
  accumulate(micro.memory, b, 1);
  ASSERT_TRUE(micro.memory.commit_step().applied);
  ASSERT_TRUE(submit_and_commit(whole.memory, b).applied);
  EXPECT_TRUE(fingerprint(micro.memory) == fingerprint(whole.memory));
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

class GradientAccumulationInAStore : public testing::TempDirTest {};

// A model store holds one gradient a layer: the first accumulate_gradient is taken, a
// second refused with a message that says so, and the step commits the first.
TEST_F(GradientAccumulationInAStore, TakesTheFirstAndRefusesASecond) {
  Model plain;
  build(plain, config_of(OptimizerKind::adam, 0));
  TieredModelMemory store(dir_ / "store", std::int64_t{64} << 20);
  store.set_optimizer(config_of(OptimizerKind::adam, 0));
  for (std::int32_t l = 0; l < plain.memory.layer_count(); ++l) {
    store.add_layer(plain.memory.weights(l), plain.memory.bias(l));
  }
  const Gradients g = random_gradients(plain.memory, 14);
  for (std::int32_t l = 0; l < store.layer_count(); ++l) {
    const WeightStream s = gradient_stream(plain.memory.weights(l), g.weights[l]);
    store.accumulate_gradient(l, s, g.bias[l]);
    EXPECT_CONTAINS(
        testing::thrown_message<ShapeError>([&] { store.accumulate_gradient(l, s, g.bias[l]); }),
        "does not add gradients");
  }
  ASSERT_TRUE(store.commit_step().applied);
  ASSERT_TRUE(submit_and_commit(plain.memory, g).applied);
  for (std::int32_t l = 0; l < store.layer_count(); ++l) {
    EXPECT_EQ(store.bias(l), plain.memory.bias(l)) << "layer " << l;
  }
}

}  // namespace
}  // namespace sluice
