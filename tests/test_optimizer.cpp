// The optimizer that HostModelMemory runs: every update rule against a plain scalar
// double-precision reimplementation, and atomic steps with non-finite gradients. The
// checks on gradient streams are in test_gradient_checks.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "optimizer_reference.hpp"
#include "sluice/model_memory.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using namespace optimizer_reference;  // NOLINT(google-build-using-namespace)

// --- tests ------------------------------------------------------------------------------

TEST(Optimizer, NamesRoundTrip) {
  for (OptimizerKind k : {OptimizerKind::sgd, OptimizerKind::adam, OptimizerKind::adamw}) {
    EXPECT_EQ(parse_optimizer(to_string(k)), k);
  }
  EXPECT_STREQ(to_string(OptimizerKind::adamw), "adamw");
  EXPECT_THROW(parse_optimizer("Adam"), ArgumentError);
  EXPECT_THROW(parse_optimizer(""), ArgumentError);
}

TEST(Optimizer, SgdWithMomentumAndWeightDecayMatchesReference) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::sgd;
  c.learning_rate = 0.05;
  c.momentum = 0.9;
  c.weight_decay = 0.01;
  build(m, c);
  run_steps(m, 6, 100);
}

TEST(Optimizer, PlainSgdMatchesReference) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::sgd;
  c.learning_rate = 0.1;
  build(m, c);
  run_steps(m, 3, 150);
}

TEST(Optimizer, AdamWithL2WeightDecayMatchesReference) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::adam;
  c.learning_rate = 0.01;
  c.weight_decay = 0.05;
  build(m, c, /*large=*/true);
  run_steps(m, 6, 200);
}

TEST(Optimizer, AdamWDecoupledMatchesReference) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::adamw;
  c.learning_rate = 0.02;
  c.beta1 = 0.8;
  c.beta2 = 0.99;
  c.epsilon = 1e-6;
  c.weight_decay = 0.1;
  build(m, c);
  run_steps(m, 6, 300);
}

TEST(Optimizer, ScheduleIsEvaluatedAtOneBasedSteps) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::sgd;
  c.learning_rate = 0.1;
  c.momentum = 0.5;
  // Step 1 has learning rate 0: the weights must not move at all, though the velocity does.
  c.schedule = [](std::int64_t step) { return step == 1 ? 0.0 : 1.0 / static_cast<double>(step); };
  build(m, c);
  const std::vector<float> before = m.memory.weights(0).values();
  run_steps(m, 1, 400);
  EXPECT_EQ(m.memory.weights(0).values(), before);
  run_steps(m, 4, 401);
}

TEST(Optimizer, AdamWithScheduleMatchesReference) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::adam;
  c.learning_rate = 0.05;
  c.schedule = [](std::int64_t step) { return std::min(1.0, static_cast<double>(step) / 3.0); };
  build(m, c);
  run_steps(m, 5, 450);
}

TEST(Optimizer, DecayWarmsUpThenFollowsHalfACosine) {
  LearningRateDecay d;
  EXPECT_FALSE(d.active());
  EXPECT_EQ(d.factor(1), 1.0);
  EXPECT_EQ(d.factor(1000), 1.0);
  d.warmup_steps = 4;
  d.decay_steps = 12;
  d.final_fraction = 0.2;
  EXPECT_TRUE(d.active());
  EXPECT_DOUBLE_EQ(d.factor(1), 0.25);
  EXPECT_DOUBLE_EQ(d.factor(4), 1.0);
  EXPECT_DOUBLE_EQ(d.factor(8), 0.6);  // half way: the cosine's middle
  EXPECT_DOUBLE_EQ(d.factor(12), 0.2);
  EXPECT_DOUBLE_EQ(d.factor(13), 0.2);
  for (std::int64_t step = 5; step < 12; ++step) EXPECT_LT(d.factor(step + 1), d.factor(step));
  d.decay_steps = 0;  // warmup alone
  EXPECT_DOUBLE_EQ(d.factor(2), 0.5);
  EXPECT_EQ(d.factor(5), 1.0);
}

TEST(Optimizer, AdamWithDecayAndScheduleMatchesReference) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::adam;
  c.learning_rate = 0.05;
  c.decay.warmup_steps = 2;
  c.decay.decay_steps = 6;
  c.decay.final_fraction = 0.3;
  c.schedule = [](std::int64_t step) { return step % 2 == 0 ? 0.5 : 1.0; };  // on top of it
  build(m, c);
  run_steps(m, 8, 460);
}

TEST(Optimizer, BadDecaysAreRefused) {
  HostModelMemory mm;
  mm.add_layer(CsrMatrix::random(4, 4, 0.5, 1));
  for (const LearningRateDecay& bad :
       {LearningRateDecay{-1, 0, 0.1}, LearningRateDecay{5, 5, 0.1}, LearningRateDecay{0, -3, 0.1},
        LearningRateDecay{0, 10, 1.5}, LearningRateDecay{0, 10, -0.5},
        LearningRateDecay{0, 10, std::nan("")}}) {
    OptimizerConfig c;
    c.decay = bad;
    EXPECT_THROW(mm.set_optimizer(c), ArgumentError);
  }
}

TEST(Optimizer, GlobalNormClippingScalesAllLayersIncludingBias) {
  for (OptimizerKind kind : {OptimizerKind::sgd, OptimizerKind::adam, OptimizerKind::adamw}) {
    SCOPED_TRACE(to_string(kind));
    Model m;
    OptimizerConfig c;
    c.kind = kind;
    c.learning_rate = 0.03;
    c.momentum = kind == OptimizerKind::sgd ? 0.9 : 0.0;
    c.weight_decay = 0.02;
    c.clip_global_norm = 2.0;  // the random gradients' norm is about 30: always clipped
    build(m, c, /*large=*/kind == OptimizerKind::adam);
    run_steps(m, 4, 500);
  }
}

TEST(Optimizer, ClippingBelowThresholdChangesNothing) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::sgd;
  c.learning_rate = 0.1;
  c.clip_global_norm = 1e6;
  build(m, c);
  Model plain;
  c.clip_global_norm = 0;
  build(plain, c);
  const Gradients g = random_gradients(m.memory, 600);
  submit_and_commit(m.memory, g);
  submit_and_commit(plain.memory, g);
  for (std::int32_t l = 0; l < m.memory.layer_count(); ++l) {
    // scale = min(1, 1e6 / (norm + 1e-6)) = 1 exactly: bit-identical to no clipping.
    EXPECT_EQ(m.memory.weights(l).values(), plain.memory.weights(l).values());
  }
}

TEST(Optimizer, UnsubmittedLayerIsUnchangedAndKeepsItsOwnAdamCount) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::adam;
  c.learning_rate = 0.01;
  build(m, c);
  Gradients g = random_gradients(m.memory, 700);
  const std::vector<float> layer1 = m.memory.weights(1).values();
  g.weights[1].clear();  // layer 1 sits out step 1
  ASSERT_TRUE(submit_and_commit(m.memory, g).applied);
  m.ref.apply(g);
  EXPECT_EQ(m.memory.weights(1).values(), layer1);
  expect_matches_reference(m, "step 1");
  // Step 2: layer 1's first update uses bias correction t = 1, the others t = 2.
  run_steps(m, 2, 701);
}

TEST(Optimizer, EmptyCommitAppliesNothing) {
  Model m;
  build(m, OptimizerConfig{});
  const StepReport r = m.memory.commit_step();
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(r.step, 0);
  EXPECT_EQ(m.memory.step(), 0);
}

// Layers submitted concurrently, some by output and some by input (the backward pass's
// order), land on the right weights: step for step the reference.
TEST(Optimizer, ConcurrentSubmitsOfDifferentLayersInEitherOrderMatchReference) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::adamw;
  c.learning_rate = 0.01;
  c.weight_decay = 0.01;
  build(m, c, /*large=*/true);
  for (int s = 0; s < 3; ++s) {
    const Gradients g = random_gradients(m.memory, 800 + static_cast<std::uint32_t>(s));
    std::vector<WeightStream> streams;
    for (std::int32_t l = 0; l < m.memory.layer_count(); ++l) {
      const CsrMatrix& mask = m.memory.weights(l);
      streams.push_back((l + s) % 2 == 0 ? gradient_stream_by_input(mask, g.weights[l], 3)
                                         : gradient_stream(mask, g.weights[l], 7));
    }
    std::vector<std::thread> threads;
    for (std::int32_t l = 0; l < m.memory.layer_count(); ++l) {
      threads.emplace_back([&, l] { m.memory.submit_gradient(l, streams[l], g.bias[l]); });
    }
    for (auto& t : threads) t.join();
    ASSERT_TRUE(m.memory.commit_step().applied);
    m.ref.apply(g);
    expect_matches_reference(m, "step " + std::to_string(s + 1));
  }
}

// A NaN in a gradient by input is caught as one by output is: the step is skipped.
TEST(Optimizer, NonFiniteGradientByInputSkipsTheStep) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::adam;
  build(m, c);
  Gradients bad = random_gradients(m.memory, 950);
  bad.weights[1].back() = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> before = m.memory.weights(1).values();
  for (std::int32_t l = 0; l < m.memory.layer_count(); ++l) {
    m.memory.submit_gradient(l, gradient_stream_by_input(m.memory.weights(l), bad.weights[l]),
                             bad.bias[l]);
  }
  const StepReport r = m.memory.commit_step();
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(r.bad_layers, std::vector<std::int32_t>{1});
  EXPECT_EQ(m.memory.weights(1).values(), before);
}

TEST(Optimizer, NonFiniteGradientSkipsTheWholeStep) {
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  for (bool clip : {false, true}) {
    for (float bad : bad_values) {
      SCOPED_TRACE(std::string(clip ? "clipping, " : "") + std::to_string(bad));
      Model m;
      OptimizerConfig c;
      c.kind = OptimizerKind::adam;
      c.learning_rate = 0.01;
      c.clip_global_norm = clip ? 1.0 : 0.0;
      build(m, c);
      run_steps(m, 2, 900);  // non-zero optimizer state
      const std::string before = fingerprint(m.memory);
      std::vector<std::vector<float>> values;
      for (std::int32_t l = 0; l < m.memory.layer_count(); ++l) {
        values.push_back(m.memory.weights(l).values());
      }

      Gradients g = random_gradients(m.memory, 950);
      g.weights[1][3] = bad;
      const StepReport r = submit_and_commit(m.memory, g);
      EXPECT_FALSE(r.applied);
      EXPECT_EQ(r.bad_layers, std::vector<std::int32_t>{1});
      EXPECT_EQ(r.step, 2);
      EXPECT_EQ(m.memory.step(), 2);
      EXPECT_FALSE(std::isfinite(r.gradient_norm));
      // Bit-exact: weights, biases and optimizer state of every layer, and the step.
      for (std::int32_t l = 0; l < m.memory.layer_count(); ++l) {
        EXPECT_EQ(std::memcmp(m.memory.weights(l).values().data(), values[l].data(),
                              values[l].size() * sizeof(float)),
                  0);
      }
      EXPECT_TRUE(fingerprint(m.memory) == before) << "state changed";
      // And training goes on as if the bad step never happened.
      run_steps(m, 1, 902);
    }
  }
}

TEST(Optimizer, NonFiniteBiasGradientIsCaught) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::sgd;
  build(m, c);
  const std::string before = fingerprint(m.memory);
  Gradients g = random_gradients(m.memory, 1000);
  g.bias[2][0] = std::numeric_limits<float>::infinity();
  g.weights[0][0] = std::numeric_limits<float>::quiet_NaN();
  const StepReport r = submit_and_commit(m.memory, g);
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(r.bad_layers, (std::vector<std::int32_t>{0, 2}));
  EXPECT_TRUE(fingerprint(m.memory) == before) << "state changed";
}

TEST(Optimizer, UpdateThatOverflowsIsRejectedLikeANonFiniteGradient) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::sgd;
  c.learning_rate = 1e38;  // finite gradients, but w - lr*g overflows float
  build(m, c);
  const std::string before = fingerprint(m.memory);
  const StepReport r = submit_and_commit(m.memory, random_gradients(m.memory, 1100, 10.0F));
  EXPECT_FALSE(r.applied);
  EXPECT_FALSE(r.bad_layers.empty());
  EXPECT_TRUE(std::isfinite(r.gradient_norm));
  EXPECT_TRUE(fingerprint(m.memory) == before) << "state changed";
}

TEST(Optimizer, ErrorPolicyThrowsNumericErrorNamingTheLayer) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::adamw;
  c.learning_rate = 0.01;
  build(m, c);
  m.memory.set_non_finite_policy(NonFinitePolicy::error);
  run_steps(m, 1, 1200);
  const std::string before = fingerprint(m.memory);
  Gradients g = random_gradients(m.memory, 1201);
  g.weights[2][1] = std::numeric_limits<float>::quiet_NaN();
  try {
    submit_and_commit(m.memory, g);
    FAIL() << "no NumericError";
  } catch (const NumericError& e) {
    EXPECT_NE(std::string(e.what()).find("layer(s) 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(m.memory.step(), 1);
  EXPECT_TRUE(fingerprint(m.memory) == before) << "state changed";
  // The failed step left nothing pending.
  run_steps(m, 1, 1202);
}

TEST(Optimizer, BadConfigurationsAreRefused) {
  HostModelMemory mm;
  auto refuse = [&](auto change) {
    OptimizerConfig c;
    change(c);
    EXPECT_THROW(mm.set_optimizer(c), ArgumentError);
  };
  refuse([](OptimizerConfig& c) { c.learning_rate = -1; });
  refuse([](OptimizerConfig& c) { c.learning_rate = std::nan(""); });
  refuse([](OptimizerConfig& c) { c.momentum = 1.0; });
  refuse([](OptimizerConfig& c) { c.beta1 = -0.1; });
  refuse([](OptimizerConfig& c) { c.beta2 = 1.0; });
  refuse([](OptimizerConfig& c) { c.epsilon = 0; });
  refuse([](OptimizerConfig& c) { c.weight_decay = -0.1; });
  refuse([](OptimizerConfig& c) { c.clip_global_norm = -1; });
  // AdamW's decoupled decay multiplies each weight by 1 - lr * weight_decay.
  refuse([](OptimizerConfig& c) {
    c.kind = OptimizerKind::adamw;
    c.learning_rate = 0.5;
    c.weight_decay = 2;
  });
  OptimizerConfig adam_l2;  // Adam's decay is an L2 term in the gradient: no such bound
  adam_l2.kind = OptimizerKind::adam;
  adam_l2.learning_rate = 0.5;
  adam_l2.weight_decay = 2;
  EXPECT_NO_THROW(mm.set_optimizer(adam_l2));
  EXPECT_THROW(mm.set_non_finite_policy(static_cast<NonFinitePolicy>(7)), ArgumentError);
}

TEST(Optimizer, ScheduleReturningNonsenseIsRefused) {
  Model m;
  OptimizerConfig c;
  c.kind = OptimizerKind::sgd;
  c.schedule = [](std::int64_t) { return -1.0; };
  build(m, c);
  const std::string before = fingerprint(m.memory);
  EXPECT_THROW(submit_and_commit(m.memory, random_gradients(m.memory, 1300)), ArgumentError);
  EXPECT_TRUE(fingerprint(m.memory) == before) << "state changed";
  // A schedule that takes AdamW's decay factor 1 - lr * weight_decay to 0 or below.
  m.memory.discard_step();
  c.kind = OptimizerKind::adamw;
  c.learning_rate = 0.01;
  c.weight_decay = 10;
  c.schedule = [](std::int64_t step) { return step < 2 ? 1.0 : 20.0; };
  m.memory.set_optimizer(c);
  ASSERT_TRUE(submit_and_commit(m.memory, random_gradients(m.memory, 1301)).applied);
  const std::string after_one = fingerprint(m.memory);
  EXPECT_CONTAINS(testing::thrown_message<ArgumentError>(
                      [&] { submit_and_commit(m.memory, random_gradients(m.memory, 1302)); }),
                  "scheduled at step 2");
  m.memory.discard_step();
  EXPECT_TRUE(fingerprint(m.memory) == after_one) << "state changed";
}

TEST(Optimizer, SetOptimizerWhileAStepIsPendingIsRefused) {
  Model m;
  build(m, OptimizerConfig{});
  const Gradients g = random_gradients(m.memory, 1400);
  m.memory.submit_gradient(0, gradient_stream(m.memory.weights(0), g.weights[0]), g.bias[0]);
  EXPECT_THROW(m.memory.set_optimizer(OptimizerConfig{}), ShapeError);
  EXPECT_TRUE(m.memory.commit_step().applied);
  EXPECT_NO_THROW(m.memory.set_optimizer(OptimizerConfig{}));
}

}  // namespace
}  // namespace sluice
