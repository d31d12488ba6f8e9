#pragma once
// What the optimizer's tests share: gradient streams built by hand (independent of
// encode_stream), the plain scalar double-precision reference of every update rule, and a
// small model of odd shapes kept beside its reference.
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
#include <vector>

#include "sluice/model_memory.hpp"

namespace sluice::optimizer_reference {

// --- building gradient streams by hand (independent of encode_stream) ----------------

// Runs of weight packets, `runs_per_chunk` to a chunk, each closed by a carriage return.
inline WeightStream chunked(StreamHeader header, const std::vector<std::vector<Packet>>& runs,
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

inline WeightStream gradient_stream(const CsrMatrix& mask, const std::vector<float>& gradient,
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
inline WeightStream gradient_stream_by_input(const CsrMatrix& mask,
                                             const std::vector<float>& gradient,
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
inline StreamChunk& editable_chunk(WeightStream& s, std::size_t c) {
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

inline void ref_update(const OptimizerConfig& c, double lr, std::int64_t t, double scale,
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
inline double reference_decay(const LearningRateDecay& d, std::int64_t step) {
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
inline void build(Model& m, const OptimizerConfig& config, bool large = false) {
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

inline Gradients random_gradients(const ModelMemory& mm, std::uint32_t seed, float scale = 1.0F) {
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

inline StepReport submit_and_commit(ModelMemory& mm, const Gradients& g) {
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    if (!Reference::submitted(g, static_cast<std::size_t>(l))) continue;
    mm.submit_gradient(l, gradient_stream(mm.weights(l), g.weights[l]), g.bias[l]);
  }
  return mm.commit_step();
}

inline void expect_close(const std::vector<float>& actual, const std::vector<float>& expected,
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

inline void expect_matches_reference(const Model& m, const std::string& when) {
  EXPECT_EQ(m.memory.step(), m.ref.step) << when;
  for (std::int32_t l = 0; l < m.memory.layer_count(); ++l) {
    expect_close(m.memory.weights(l).values(), m.ref.layers[l].w,
                 when + ", layer " + std::to_string(l) + " weights");
    expect_close(m.memory.bias(l), m.ref.layers[l].bias,
                 when + ", layer " + std::to_string(l) + " bias");
  }
}

inline void run_steps(Model& m, int steps, std::uint32_t seed) {
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
inline std::string fingerprint(const ModelMemory& mm) {
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

}  // namespace sluice::optimizer_reference
