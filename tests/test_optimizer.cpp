// The optimizer that HostModelMemory runs: every update rule against a plain scalar
// double-precision reimplementation, atomic steps with non-finite gradients, and the
// checks on gradient streams.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "sluice/model_memory.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

// --- building gradient streams by hand (independent of encode_stream) ----------------

// Runs of weight packets, `runs_per_chunk` to a chunk, each closed by a carriage return.
WeightStream chunked(StreamHeader header, const std::vector<std::vector<Packet>>& runs,
                     std::int64_t runs_per_chunk) {
  WeightStream s;
  s.header = header;
  const auto count = static_cast<std::int64_t>(runs.size());
  std::int64_t r = 0;
  do {
    auto chunk = std::make_shared<StreamChunk>();
    const std::int64_t end = std::min(count, r + runs_per_chunk);
    chunk->first_output = static_cast<std::uint32_t>(r);
    chunk->outputs = static_cast<std::uint32_t>(end - r);
    for (std::int64_t o = r; o < end; ++o) {
      chunk->packets.insert(chunk->packets.end(), runs[o].begin(), runs[o].end());
      chunk->packets.push_back({kCarriageReturn, 0.0F});
    }
    if (end == count) chunk->packets.push_back({kEndOfLayer, 0.0F});
    s.chunks.push_back(std::move(chunk));
    r = end;
  } while (r < count);
  return s;
}

WeightStream gradient_stream(const CsrMatrix& mask, const std::vector<float>& gradient,
                             std::int64_t outputs_per_chunk = 5) {
  std::vector<std::vector<Packet>> runs(static_cast<std::size_t>(mask.rows()));
  const auto& off = mask.row_offsets();
  for (std::int64_t o = 0; o < mask.rows(); ++o) {
    for (std::int64_t k = off[o]; k < off[o + 1]; ++k) {
      runs[o].push_back({mask.col_indices()[k], gradient[k]});
    }
  }
  return chunked({StreamKind::gradient, static_cast<std::uint32_t>(mask.rows()),
                  static_cast<std::uint32_t>(mask.cols()), static_cast<std::uint64_t>(mask.nnz())},
                 runs, outputs_per_chunk);
}

// The same gradient by input: the mask's columns in order, each its rows' gradients in
// increasing row order (walking the rows in order, not through transposed_pattern).
WeightStream gradient_stream_by_input(const CsrMatrix& mask, const std::vector<float>& gradient,
                                      std::int64_t inputs_per_chunk = 4) {
  std::vector<std::vector<Packet>> runs(static_cast<std::size_t>(mask.cols()));
  const auto& off = mask.row_offsets();
  for (std::int64_t o = 0; o < mask.rows(); ++o) {
    for (std::int64_t k = off[o]; k < off[o + 1]; ++k) {
      runs[mask.col_indices()[k]].push_back({static_cast<std::uint32_t>(o), gradient[k]});
    }
  }
  return chunked({StreamKind::gradient, static_cast<std::uint32_t>(mask.cols()),
                  static_cast<std::uint32_t>(mask.rows()), static_cast<std::uint64_t>(mask.nnz()),
                  Precision::fp32, StreamOrder::by_input},
                 runs, inputs_per_chunk);
}

// A copy of one chunk that the caller may change.
StreamChunk& editable_chunk(WeightStream& s, std::size_t c) {
  auto copy = std::make_shared<StreamChunk>(*s.chunks[c]);
  StreamChunk& ref = *copy;
  s.chunks[c] = std::move(copy);
  return ref;
}

// --- the reference: scalar, double precision, stores float like the real one ----------

struct RefLayer {
  std::vector<float> w, bias;
  std::vector<float> s0, s1, bias_s0, bias_s1;
  std::int64_t t = 0;
};

void ref_update(const OptimizerConfig& c, double lr, std::int64_t t, double scale,
                std::vector<float>& w, std::vector<float>& s0, std::vector<float>& s1,
                const std::vector<float>& g) {
  for (std::size_t i = 0; i < w.size(); ++i) {
    double wi = w[i];
    double gi = scale * static_cast<double>(g[i]);
    if (c.kind == OptimizerKind::sgd) {
      gi += c.weight_decay * wi;
      const double v = c.momentum * s0[i] + gi;
      s0[i] = static_cast<float>(v);
      w[i] = static_cast<float>(wi - lr * v);
      continue;
    }
    if (c.kind == OptimizerKind::adam) gi += c.weight_decay * wi;
    if (c.kind == OptimizerKind::adamw) wi = wi - lr * c.weight_decay * wi;
    const double m = c.beta1 * s0[i] + (1 - c.beta1) * gi;
    const double v = c.beta2 * s1[i] + (1 - c.beta2) * gi * gi;
    const double m_hat = m / (1 - std::pow(c.beta1, static_cast<double>(t)));
    const double v_hat = v / (1 - std::pow(c.beta2, static_cast<double>(t)));
    s0[i] = static_cast<float>(m);
    s1[i] = static_cast<float>(v);
    w[i] = static_cast<float>(wi - lr * m_hat / (std::sqrt(v_hat) + c.epsilon));
  }
}

struct Gradients {
  std::vector<std::vector<float>> weights, bias;  // per layer; empty weights = not submitted
};

// LearningRateDecay's multiplier, written from its documentation.
double reference_decay(const LearningRateDecay& d, std::int64_t step) {
  const auto s = static_cast<double>(step);
  if (step <= d.warmup_steps) return s / static_cast<double>(d.warmup_steps);
  if (d.decay_steps == 0) return 1.0;
  if (step >= d.decay_steps) return d.final_fraction;
  const double angle = std::numbers::pi * (s - static_cast<double>(d.warmup_steps)) /
                       static_cast<double>(d.decay_steps - d.warmup_steps);
  return d.final_fraction + (1 - d.final_fraction) * (1 + std::cos(angle)) / 2;
}

struct Reference {
  OptimizerConfig config;
  std::vector<RefLayer> layers;
  std::int64_t step = 0;

  /// Returns the global gradient norm.
  double apply(const Gradients& g) {
    double sum = 0;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      if (!submitted(g, l)) continue;
      for (float x : g.weights[l]) sum += static_cast<double>(x) * x;
      for (float x : g.bias[l]) sum += static_cast<double>(x) * x;
    }
    const double norm = std::sqrt(sum);
    const double scale =
        config.clip_global_norm > 0 ? std::min(1.0, config.clip_global_norm / (norm + 1e-6)) : 1.0;
    ++step;
    const double lr = config.learning_rate * reference_decay(config.decay, step) *
                      (config.schedule ? config.schedule(step) : 1.0);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      if (!submitted(g, l)) continue;
      RefLayer& r = layers[l];
      ++r.t;
      ref_update(config, lr, r.t, scale, r.w, r.s0, r.s1, g.weights[l]);
      ref_update(config, lr, r.t, scale, r.bias, r.bias_s0, r.bias_s1, g.bias[l]);
    }
    return norm;
  }
  static bool submitted(const Gradients& g, std::size_t l) {
    return l < g.weights.size() && !g.weights[l].empty();
  }
};

// --- fixtures --------------------------------------------------------------------------

struct Model {
  HostModelMemory memory;
  Reference ref;
};

// Odd shapes: a layer with bias, one without, one small and very sparse (empty rows),
// one large enough for the threaded path (> 16K non-zeros, several chunks).
void build(Model& m, const OptimizerConfig& config, bool large = false) {
  struct Shape {
    std::int64_t rows, cols;
    double sparsity;
    bool bias;
  };
  std::vector<Shape> shapes = {{37, 53, 0.7, true}, {19, 37, 0.5, false}, {11, 7, 0.8, true}};
  if (large) shapes.push_back({200, 300, 0.6, true});
  m.memory.set_optimizer(config);
  m.ref.config = config;
  std::uint64_t seed = 11;
  for (const Shape& s : shapes) {
    CsrMatrix w = CsrMatrix::random(s.rows, s.cols, s.sparsity, seed++);
    std::vector<float> bias;
    if (s.bias) {
      std::mt19937 rng(static_cast<std::uint32_t>(seed++));
      std::uniform_real_distribution<float> u(-0.5F, 0.5F);
      for (std::int64_t i = 0; i < s.rows; ++i) bias.push_back(u(rng));
    }
    RefLayer r;
    r.w = w.values();
    r.bias = bias;
    r.s0.assign(r.w.size(), 0);
    r.s1.assign(r.w.size(), 0);
    r.bias_s0.assign(bias.size(), 0);
    r.bias_s1.assign(bias.size(), 0);
    m.ref.layers.push_back(r);
    m.memory.add_layer(std::move(w), std::move(bias));
  }
}

Gradients random_gradients(const ModelMemory& mm, std::uint32_t seed, float scale = 1.0F) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0F, scale);
  Gradients g;
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    std::vector<float> w(static_cast<std::size_t>(mm.weights(l).nnz()));
    for (float& x : w) x = n(rng);
    std::vector<float> b(mm.bias(l).size());
    for (float& x : b) x = n(rng);
    g.weights.push_back(std::move(w));
    g.bias.push_back(std::move(b));
  }
  return g;
}

StepReport submit_and_commit(ModelMemory& mm, const Gradients& g) {
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    if (!Reference::submitted(g, static_cast<std::size_t>(l))) continue;
    mm.submit_gradient(l, gradient_stream(mm.weights(l), g.weights[l]), g.bias[l]);
  }
  return mm.commit_step();
}

void expect_close(const std::vector<float>& actual, const std::vector<float>& expected,
                  const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double tol = 1e-6 * std::abs(static_cast<double>(expected[i])) + 1e-9;
    if (!(std::abs(static_cast<double>(actual[i]) - expected[i]) <= tol) && bad++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << actual[i] << " vs reference " << expected[i];
    }
  }
  EXPECT_EQ(bad, 0U) << what;
}

void expect_matches_reference(const Model& m, const std::string& when) {
  EXPECT_EQ(m.memory.step(), m.ref.step) << when;
  for (std::int32_t l = 0; l < m.memory.layer_count(); ++l) {
    expect_close(m.memory.weights(l).values(), m.ref.layers[l].w,
                 when + ", layer " + std::to_string(l) + " weights");
    expect_close(m.memory.bias(l), m.ref.layers[l].bias,
                 when + ", layer " + std::to_string(l) + " bias");
  }
}

void run_steps(Model& m, int steps, std::uint32_t seed) {
  for (int s = 0; s < steps; ++s) {
    const Gradients g = random_gradients(m.memory, seed + static_cast<std::uint32_t>(s));
    const auto before = std::chrono::steady_clock::now();
    const StepReport report = submit_and_commit(m.memory, g);
    const std::chrono::duration<double> wall = std::chrono::steady_clock::now() - before;
    const double norm = m.ref.apply(g);
    ASSERT_TRUE(report.applied);
    EXPECT_TRUE(report.bad_layers.empty());
    EXPECT_EQ(report.step, m.ref.step);
    EXPECT_NEAR(report.gradient_norm, norm, 1e-9 * norm);
    // The optimizer's time is spent inside this step, on this thread (the layers are
    // submitted one after another): more than nothing, and no more than the step took.
    EXPECT_GT(report.seconds, 0.0);
    EXPECT_LE(report.seconds, wall.count());
    expect_matches_reference(m, "step " + std::to_string(m.ref.step));
  }
}

// Everything a ModelMemory holds, including optimizer state (through a checkpoint's bytes).
std::string fingerprint(const ModelMemory& mm) {
  // The process id keeps test processes that ctest runs in parallel (each test is one,
  // with the same seed and, under a sanitizer, often the same addresses) apart.
  const auto path = std::filesystem::temp_directory_path() /
                    ("sluice_test_optimizer_" + std::to_string(::getpid()) + "_" +
                     std::to_string(reinterpret_cast<std::uintptr_t>(&mm)) + ".ck");
  mm.save(path);
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(path);
  return bytes;
}

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

// --- gradient streams that do not fit the layer -----------------------------------------

class BadGradient : public ::testing::Test {
 protected:
  void SetUp() override {
    OptimizerConfig c;
    c.kind = OptimizerKind::sgd;
    c.learning_rate = 0.1;
    build(m, c);
    g = random_gradients(m.memory, 1500);
    before = fingerprint(m.memory);
  }
  WeightStream good(std::int32_t layer) {
    return gradient_stream(m.memory.weights(layer), g.weights[layer]);
  }
  // Submitting `s` for layer 0 throws E whose message contains every one of `words`;
  // afterwards a good gradient is still accepted and the step matches the reference.
  template <typename E>
  void expect_refused(const WeightStream& s, std::vector<std::string> words,
                      std::span<const float> bias) {
    try {
      m.memory.submit_gradient(0, s, bias);
      ADD_FAILURE() << "accepted";
    } catch (const E& e) {
      for (const auto& w : words) {
        EXPECT_NE(std::string(e.what()).find(w), std::string::npos)
            << "'" << w << "' not in: " << e.what();
      }
    }
    EXPECT_TRUE(fingerprint(m.memory) == before) << "state changed";
    ASSERT_TRUE(submit_and_commit(m.memory, g).applied);
    m.ref.apply(g);
    expect_matches_reference(m, "after a refused gradient");
    before = fingerprint(m.memory);
  }
  template <typename E>
  void expect_refused(const WeightStream& s, std::vector<std::string> words) {
    expect_refused<E>(s, std::move(words), g.bias[0]);
  }
  Model m;
  Gradients g;
  std::string before;
};

TEST_F(BadGradient, WrongKind) {
  WeightStream s = good(0);
  s.header.kind = StreamKind::weights;
  expect_refused<FormatError>(s, {"layer 0", "not a gradient"});
}

// Gradients are fp32 whatever the weights' precision: a bf16 header over fp32 packets, or
// bf16 packets, are named as such (not as a pattern mismatch deep in the stream).
TEST_F(BadGradient, NotFp32) {
  WeightStream s = good(0);
  s.header.precision = Precision::bf16;
  expect_refused<FormatError>(s, {"layer 0", "must be fp32"});
  s = good(0);
  auto chunk = std::make_shared<StreamChunk>(*s.chunks[0]);
  chunk->packets_bf16.push_back(bf16_control(kEndOfLayer));
  s.chunks[0] = chunk;
  expect_refused<FormatError>(s, {"layer 0", "chunks hold bf16"});
}

TEST_F(BadGradient, WrongHeaderShape) {
  WeightStream s = good(0);
  s.header.outputs += 1;
  expect_refused<FormatError>(s, {"layer 0"});
  s = good(0);
  s.header.inputs -= 1;
  expect_refused<FormatError>(s, {"layer 0"});
  s = good(0);
  s.header.nnz += 1;
  expect_refused<FormatError>(s, {"layer 0"});
}

TEST_F(BadGradient, StreamOfAnotherLayer) {
  expect_refused<FormatError>(good(1), {"layer 0"});
}

TEST_F(BadGradient, WrongTagNamesLayerOutputAndPosition) {
  WeightStream s = good(0);
  // Output 6's second non-zero (chunk 1 holds outputs 5..9).
  const auto& off = m.memory.weights(0).row_offsets();
  ASSERT_GE(off[7] - off[6], 2);
  StreamChunk& chunk = editable_chunk(s, 1);
  const std::size_t pos = static_cast<std::size_t>(off[6] - off[5]) + 1 + 1;
  chunk.packets[pos].tag += 1;
  expect_refused<FormatError>(s, {"layer 0", "output 6", "position 1"});
}

TEST_F(BadGradient, MissingCarriageReturn) {
  WeightStream s = good(0);
  StreamChunk& chunk = editable_chunk(s, 0);
  const auto& off = m.memory.weights(0).row_offsets();
  chunk.packets.erase(chunk.packets.begin() + (off[1] - off[0]));  // output 0's return
  expect_refused<FormatError>(s, {"layer 0", "output"});
}

TEST_F(BadGradient, MissingEndOfLayer) {
  WeightStream s = good(0);
  editable_chunk(s, s.chunks.size() - 1).packets.pop_back();
  expect_refused<FormatError>(s, {"layer 0", "end-of-layer"});
}

TEST_F(BadGradient, PacketAfterEndOfLayer) {
  WeightStream s = good(0);
  editable_chunk(s, s.chunks.size() - 1).packets.push_back({0, 1.0F});
  expect_refused<FormatError>(s, {"layer 0"});
}

TEST_F(BadGradient, ExtraWeightInAnOutput) {
  WeightStream s = good(0);
  StreamChunk& chunk = editable_chunk(s, 0);
  // A duplicate of output 0's first non-zero.
  chunk.packets.insert(chunk.packets.begin() + 1, chunk.packets[0]);
  expect_refused<FormatError>(s, {"layer 0", "output 0", "position 1"});
}

TEST_F(BadGradient, ChunksOutOfOrderOrMissing) {
  WeightStream s = good(0);
  std::swap(s.chunks[0], s.chunks[1]);
  expect_refused<FormatError>(s, {"layer 0", "chunk 0"});
  s = good(0);
  s.chunks.erase(s.chunks.begin() + 1);
  expect_refused<FormatError>(s, {"layer 0"});
  s = good(0);
  s.chunks.clear();
  expect_refused<FormatError>(s, {"layer 0"});
}

// By input the runs are input features: a wrong tag is named by input and position, and
// a stream by output under a by-input header is refused, not read crosswise.
TEST_F(BadGradient, ByInputWrongTagNamesTheInput) {
  WeightStream s = gradient_stream_by_input(m.memory.weights(0), g.weights[0]);
  ASSERT_GE(s.chunks.size(), 2U);
  StreamChunk& chunk = editable_chunk(s, 1);  // inputs 4..7
  std::size_t pos = 0;
  while (is_control(chunk.packets[pos])) ++pos;  // the first weight of the chunk
  std::size_t run = 4;
  for (std::size_t k = 0; k < pos; ++k) run += chunk.packets[k].tag == kCarriageReturn ? 1 : 0;
  chunk.packets[pos].tag += 1;
  expect_refused<FormatError>(s, {"layer 0", "input " + std::to_string(run), "position 0"});
  WeightStream crosswise = good(0);
  crosswise.header.order = StreamOrder::by_input;
  std::swap(crosswise.header.outputs, crosswise.header.inputs);
  expect_refused<FormatError>(crosswise, {"layer 0", "inputs"});
  WeightStream unknown = good(0);
  unknown.header.order = StreamOrder{3};
  expect_refused<FormatError>(unknown, {"layer 0", "unknown stream order"});
}

TEST_F(BadGradient, WrongBiasGradientSize) {
  const std::vector<float> short_bias(g.bias[0].size() - 1, 0.0F);
  expect_refused<ShapeError>(good(0), {"layer 0", "bias"}, short_bias);
}

TEST_F(BadGradient, LayerOutOfRange) {
  EXPECT_THROW(m.memory.submit_gradient(-1, good(0), g.bias[0]), ArgumentError);
  EXPECT_THROW(m.memory.submit_gradient(3, good(0), g.bias[0]), ArgumentError);
}

TEST_F(BadGradient, SecondGradientForTheSameLayerInOneStep) {
  m.memory.submit_gradient(0, good(0), g.bias[0]);
  EXPECT_THROW(m.memory.submit_gradient(0, good(0), g.bias[0]), ShapeError);
}

}  // namespace
}  // namespace sluice
