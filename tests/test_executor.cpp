// The executor against a float64 dense-masked reference trainer, over 1-3 engines and
// several lane geometries; determinism; a finite-difference gradient check; the fabric's
// reduction; the memory budget.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "reference.hpp"
#include "sluice/bf16.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"

namespace sluice {
namespace {

const std::vector<std::int64_t> kSizes = {13, 17, 11, 5};
constexpr std::int64_t kBatch = 24;
constexpr int kSteps = 20;

struct Data {
  std::vector<DenseMatrix> x;
  std::vector<std::vector<int>> labels;
};

Data make_data(std::int64_t inputs, int classes, std::uint64_t seed) {
  Data d;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (int s = 0; s < kSteps; ++s) {
    DenseMatrix x(inputs, kBatch);
    std::vector<int> y;
    for (std::int64_t t = 0; t < kBatch; ++t) {
      for (std::int64_t i = 0; i < inputs; ++i) x(i, t) = normal(rng);
      y.push_back(static_cast<int>(rng() % classes));
    }
    d.x.push_back(std::move(x));
    d.labels.push_back(std::move(y));
  }
  return d;
}

// ---- the float64 reference: dense weights with a mask, ReLU/GELU, softmax CE --------
struct RefLayer {
  std::int64_t out, in;
  std::vector<double> w, mask, b, state_w1, state_w2, state_b1, state_b2;
};

double act(Activation a, double z) {
  if (a == Activation::relu) return z > 0 ? z : 0;
  if (a == Activation::gelu)
    return 0.5 * z * (1 + std::tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)));
  return z;
}
double slope(Activation a, double z) {
  if (a == Activation::relu) return z > 0 ? 1 : 0;
  if (a == Activation::gelu) {
    const double c = 0.7978845608028654, th = std::tanh(c * (z + 0.044715 * z * z * z));
    return 0.5 * (1 + th) + 0.5 * z * (1 - th * th) * c * (1 + 3 * 0.044715 * z * z);
  }
  return 1;
}

struct Reference {
  std::vector<RefLayer> layers;
  std::vector<Activation> acts;
  OptimizerConfig opt;
  std::int64_t step = 0;
  /// Layers run in bf16: their weights are rounded to bf16 where the engines use them
  /// (the products), and their input activations too where the engines hold them in bf16
  /// (see CpuEngine::holds_bf16); everything else stays exact.
  std::vector<bool> bf16_weights, bf16_inputs;
  std::vector<std::vector<double>> last_gw, last_gb;  // the last step's gradients

  static double rounded(const std::vector<bool>& which, std::size_t l, double v) {
    return !which.empty() && which[l] ? round_to_bf16(static_cast<float>(v)) : v;
  }
  double weight(std::size_t l, double v) const { return rounded(bf16_weights, l, v); }
  double input(std::size_t l, double v) const { return rounded(bf16_inputs, l, v); }

  Reference(const ModelMemory& m, std::vector<Activation> a, OptimizerConfig o)
      : acts(std::move(a)), opt(std::move(o)) {
    for (std::int32_t l = 0; l < m.layer_count(); ++l) {
      const CsrMatrix& w = m.weights(l);
      RefLayer r{w.rows(), w.cols(), {}, {}, {}, {}, {}, {}, {}};
      r.w.assign(w.rows() * w.cols(), 0);
      r.mask.assign(w.rows() * w.cols(), 0);
      for (std::int64_t o = 0; o < w.rows(); ++o) {
        for (auto k = w.row_offsets()[o]; k < w.row_offsets()[o + 1]; ++k) {
          r.w[o * w.cols() + w.col_indices()[k]] = w.values()[k];
          r.mask[o * w.cols() + w.col_indices()[k]] = 1;
        }
      }
      r.b.assign(m.bias(l).begin(), m.bias(l).end());
      r.state_w1.assign(r.w.size(), 0);
      r.state_w2.assign(r.w.size(), 0);
      r.state_b1.assign(r.b.size(), 0);
      r.state_b2.assign(r.b.size(), 0);
      layers.push_back(std::move(r));
    }
  }

  void update(std::vector<double>& w, const std::vector<double>& g, std::vector<double>& s1,
              std::vector<double>& s2, const std::vector<double>* mask) {
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (mask && (*mask)[i] == 0) continue;
      if (opt.kind == OptimizerKind::sgd) {
        s1[i] = opt.momentum * s1[i] + g[i];
        w[i] -= opt.learning_rate * s1[i];
      } else {
        s1[i] = opt.beta1 * s1[i] + (1 - opt.beta1) * g[i];
        s2[i] = opt.beta2 * s2[i] + (1 - opt.beta2) * g[i] * g[i];
        const double mh = s1[i] / (1 - std::pow(opt.beta1, step));
        const double vh = s2[i] / (1 - std::pow(opt.beta2, step));
        w[i] -= opt.learning_rate * mh / (std::sqrt(vh) + opt.epsilon);
      }
    }
  }

  double train_step(const DenseMatrix& x, const std::vector<int>& labels) {
    const std::int64_t T = x.cols();
    std::vector<std::vector<double>> A(layers.size() + 1), Z(layers.size());
    A[0].resize(x.rows() * T);
    for (std::int64_t i = 0; i < x.rows(); ++i)
      for (std::int64_t t = 0; t < T; ++t) A[0][i * T + t] = x(i, t);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const RefLayer& L = layers[l];
      Z[l].assign(L.out * T, 0);
      A[l + 1].assign(L.out * T, 0);
      for (std::int64_t o = 0; o < L.out; ++o)
        for (std::int64_t t = 0; t < T; ++t) {
          double acc = L.b.empty() ? 0 : L.b[o];
          for (std::int64_t i = 0; i < L.in; ++i) {
            acc += weight(l, L.w[o * L.in + i]) * input(l, A[l][i * T + t]);
          }
          Z[l][o * T + t] = acc;
          A[l + 1][o * T + t] = act(acts[l], acc);
        }
    }
    const std::int64_t C = layers.back().out;
    std::vector<double> d(C * T);
    double loss = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      double peak = -1e300;
      for (std::int64_t o = 0; o < C; ++o) peak = std::max(peak, A.back()[o * T + t]);
      double sum = 0;
      for (std::int64_t o = 0; o < C; ++o) sum += std::exp(A.back()[o * T + t] - peak);
      const double lse = std::log(sum) + peak;
      loss += lse - A.back()[labels[t] * T + t];
      for (std::int64_t o = 0; o < C; ++o)
        d[o * T + t] = (std::exp(A.back()[o * T + t] - lse) - (o == labels[t])) / T;
    }
    ++step;
    last_gw.assign(layers.size(), {});
    last_gb.assign(layers.size(), {});
    for (std::size_t l = layers.size(); l-- > 0;) {
      RefLayer& L = layers[l];
      for (std::int64_t k = 0; k < L.out * T; ++k) d[k] *= slope(acts[l], Z[l][k]);
      std::vector<double> gw(L.w.size(), 0), gb(L.out, 0), dx(L.in * T, 0);
      for (std::int64_t o = 0; o < L.out; ++o)
        for (std::int64_t t = 0; t < T; ++t) {
          gb[o] += d[o * T + t];
          for (std::int64_t i = 0; i < L.in; ++i) {
            gw[o * L.in + i] += d[o * T + t] * input(l, A[l][i * T + t]) * L.mask[o * L.in + i];
            dx[i * T + t] += weight(l, L.w[o * L.in + i]) * d[o * T + t];
          }
        }
      last_gw[l] = gw;
      last_gb[l] = gb;
      update(L.w, gw, L.state_w1, L.state_w2, &L.mask);
      update(L.b, gb, L.state_b1, L.state_b2, nullptr);
      d = std::move(dx);
    }
    return loss / T;
  }
};

OptimizerConfig sgd_momentum() {
  OptimizerConfig o;
  o.kind = OptimizerKind::sgd;
  o.learning_rate = 0.05;
  o.momentum = 0.9;
  return o;
}

struct RunResult {
  std::vector<double> losses;
  std::vector<CsrMatrix> weights;
  std::vector<std::vector<float>> biases;
};

RunResult run_sluice(std::int32_t engines, Geometry geometry, const OptimizerConfig& opt,
                     const std::vector<Activation>& acts, const Data& data,
                     Reference* reference = nullptr) {
  HostModelMemory memory;
  build_sparse_mlp(memory, kSizes, 0.5, 42);
  memory.set_optimizer(opt);
  if (reference) *reference = Reference(memory, acts, opt);
  LocalFabricOptions fo;
  fo.engines = engines;
  fo.engine.geometry = geometry;
  fo.engine.threads = 1;
  LocalFabric fabric(fo);
  ExecutorOptions eo;
  eo.activations = acts;
  eo.prefetch_depth = 2;
  eo.chunk_packets = 16;  // many chunks: exercises the channel and the broadcast
  LayerStreamingExecutor exec(memory, fabric, eo);
  RunResult r;
  for (int s = 0; s < kSteps; ++s) {
    Batch b{data.x[s].view(), data.labels[s], {}};
    const StepResult res = exec.train_step(b);
    EXPECT_TRUE(res.report.applied);
    r.losses.push_back(res.loss);
  }
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
    r.weights.push_back(memory.weights(l));
    r.biases.push_back(memory.bias(l));
  }
  return r;
}

void expect_matches(const RunResult& r, const std::vector<double>& ref_losses,
                    const Reference& ref) {
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(r.losses[s], ref_losses[s], 1e-4 * std::abs(ref_losses[s])) << "step " << s;
  }
  for (std::size_t l = 0; l < r.weights.size(); ++l) {
    const CsrMatrix& w = r.weights[l];
    const RefLayer& L = ref.layers[l];
    for (std::int64_t o = 0; o < w.rows(); ++o) {
      for (auto k = w.row_offsets()[o]; k < w.row_offsets()[o + 1]; ++k) {
        const double want = L.w[o * L.in + w.col_indices()[k]];
        ASSERT_NEAR(w.values()[k], want, 1e-4 * std::max(1.0, std::abs(want)))
            << "layer " << l << " row " << o;
      }
      ASSERT_NEAR(r.biases[l][o], L.b[o], 1e-4) << "bias layer " << l << " row " << o;
    }
  }
}

const std::vector<Activation> kRelu = {Activation::relu, Activation::relu, Activation::none};

TEST(Executor, MatchesFloat64ReferenceOverEnginesAndGeometries) {
  const Data data = make_data(kSizes.front(), static_cast<int>(kSizes.back()), 5);
  Reference ref(HostModelMemory{}, kRelu, sgd_momentum());
  {
    HostModelMemory m;
    build_sparse_mlp(m, kSizes, 0.5, 42);
    ref = Reference(m, kRelu, sgd_momentum());
  }
  std::vector<double> ref_losses;
  for (int s = 0; s < kSteps; ++s) ref_losses.push_back(ref.train_step(data.x[s], data.labels[s]));
  const std::vector<Geometry> geometries = {Geometry{}, Geometry{1, 2, 4}, Geometry{3, 1, 8}};
  for (std::int32_t engines : {1, 2, 3}) {
    for (const Geometry& g : geometries) {
      SCOPED_TRACE("engines " + std::to_string(engines) + " geometry " + g.to_string());
      expect_matches(run_sluice(engines, g, sgd_momentum(), kRelu, data), ref_losses, ref);
    }
  }
  EXPECT_LT(ref_losses.back(), ref_losses.front());  // it does learn
}

TEST(Executor, AdamWithGeluMatchesReference) {
  const Data data = make_data(kSizes.front(), static_cast<int>(kSizes.back()), 6);
  const std::vector<Activation> acts = {Activation::gelu, Activation::gelu, Activation::none};
  OptimizerConfig adam;
  adam.kind = OptimizerKind::adam;
  adam.learning_rate = 1e-2;
  HostModelMemory m;
  build_sparse_mlp(m, kSizes, 0.5, 42);
  Reference ref(m, acts, adam);
  std::vector<double> ref_losses;
  for (int s = 0; s < kSteps; ++s) ref_losses.push_back(ref.train_step(data.x[s], data.labels[s]));
  for (std::int32_t engines : {1, 2}) {
    SCOPED_TRACE("engines " + std::to_string(engines));
    expect_matches(run_sluice(engines, Geometry{2, 1, 0}, adam, acts, data), ref_losses, ref);
  }
}

TEST(Executor, SameGeometryAndSeedGiveBitwiseIdenticalWeights) {
  const Data data = make_data(kSizes.front(), static_cast<int>(kSizes.back()), 7);
  for (std::int32_t engines : {1, 3}) {
    const RunResult a = run_sluice(engines, Geometry{2, 2, 0}, sgd_momentum(), kRelu, data);
    const RunResult b = run_sluice(engines, Geometry{2, 2, 0}, sgd_momentum(), kRelu, data);
    for (std::size_t l = 0; l < a.weights.size(); ++l) {
      ASSERT_EQ(a.weights[l].values().size(), b.weights[l].values().size());
      EXPECT_EQ(0, std::memcmp(a.weights[l].values().data(), b.weights[l].values().data(),
                               a.weights[l].values().size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(a.biases[l].data(), b.biases[l].data(),
                               a.biases[l].size() * sizeof(float)));
    }
    EXPECT_EQ(a.losses, b.losses);
  }
}

// Loss of a two-layer GELU net with the given weights, through the executor.
double loss_of(const std::vector<CsrMatrix>& w, const std::vector<std::vector<float>>& b,
               const Batch& batch, Fabric& fabric) {
  HostModelMemory m;
  for (std::size_t l = 0; l < w.size(); ++l) m.add_layer(w[l], b[l]);
  ExecutorOptions eo;
  eo.activations = {Activation::gelu, Activation::none};
  LayerStreamingExecutor exec(m, fabric, eo);
  return exec.evaluate(batch).loss;
}

TEST(Executor, GradientsMatchFiniteDifferences) {
  HostModelMemory m;
  build_sparse_mlp(m, {6, 9, 4}, 0.4, 3);
  const Data data = make_data(6, 4, 8);
  const Batch batch{data.x[0].view(), data.labels[0], {}};
  LocalFabricOptions fo;
  fo.engines = 2;
  fo.engine.threads = 1;
  LocalFabric fabric(fo);
  ExecutorOptions eo;
  eo.activations = {Activation::gelu, Activation::none};
  LayerStreamingExecutor exec(m, fabric, eo);
  double loss = 0;
  const std::vector<LayerGradient> g = exec.gradients(batch, &loss);
  ASSERT_EQ(g.size(), 2U);
  std::vector<CsrMatrix> w = {m.weights(0), m.weights(1)};
  std::vector<std::vector<float>> b = {m.bias(0), m.bias(1)};
  EXPECT_NEAR(loss, loss_of(w, b, batch, fabric), 1e-6);
  const double eps = 1e-2;
  for (std::size_t l = 0; l < 2; ++l) {
    ASSERT_EQ(g[l].weights.nnz(), w[l].nnz());
    for (std::int64_t k = 0; k < w[l].nnz(); k += 3) {
      const float saved = w[l].values()[k];
      w[l].values()[k] = saved + static_cast<float>(eps);
      const double up = loss_of(w, b, batch, fabric);
      w[l].values()[k] = saved - static_cast<float>(eps);
      const double down = loss_of(w, b, batch, fabric);
      w[l].values()[k] = saved;
      const double fd = (up - down) / (2 * eps);
      EXPECT_NEAR(g[l].weights.values()[k], fd, 2e-3 + 2e-2 * std::abs(fd))
          << "layer " << l << " nz " << k;
    }
    for (std::size_t o = 0; o < b[l].size(); o += 2) {
      const float saved = b[l][o];
      b[l][o] = saved + static_cast<float>(eps);
      const double up = loss_of(w, b, batch, fabric);
      b[l][o] = saved - static_cast<float>(eps);
      const double down = loss_of(w, b, batch, fabric);
      b[l][o] = saved;
      EXPECT_NEAR(g[l].bias[o], (up - down) / (2 * eps), 2e-3) << "bias layer " << l;
    }
  }
}

TEST(Executor, Bf16LayersMatchTheReferenceOnRoundedOperands) {
  // Layers 0 and 2 in bf16, layer 1 in fp32: gradients of the first batch against the
  // float64 reference that rounds exactly what the engines hold in bf16. Layer 0 is
  // dense enough that the engines hold its inputs in bf16; layer 2 is not.
  const Data data = make_data(kSizes.front(), static_cast<int>(kSizes.back()), 9);
  HostModelMemory m;
  m.add_layer(CsrMatrix::random(kSizes[1], kSizes[0], 0.0, 1), std::vector<float>(kSizes[1], 0.1F));
  m.add_layer(CsrMatrix::random(kSizes[2], kSizes[1], 0.5, 2), std::vector<float>(kSizes[2], 0.0F));
  m.add_layer(CsrMatrix::random(kSizes[3], kSizes[2], 0.5, 3), {});
  ASSERT_TRUE(CpuEngine::holds_bf16(1, m.weights(0).nnz(), kSizes[0], data.x[0].cols()));
  ASSERT_FALSE(CpuEngine::holds_bf16(1, m.weights(2).nnz(), kSizes[2], data.x[0].cols()));
  Reference ref(m, kRelu, sgd_momentum());
  ref.bf16_weights = {true, false, true};
  ref.bf16_inputs = {true, false, false};
  const double ref_loss = ref.train_step(data.x[0], data.labels[0]);
  for (std::int32_t engines : {1, 2}) {
    SCOPED_TRACE("engines " + std::to_string(engines));
    LocalFabricOptions fo;
    fo.engines = engines;
    fo.engine.threads = 1;
    fo.engine.geometry.lanes = 1;
    // The streamed path's rounding is what the reference models (the dense path holds
    // every activation in bf16, and is checked in test_dense_path.cpp): PathCosts alone
    // would pick dense for layer 0 at this batch.
    fo.engine.path = ProductPath::sparse;
    LocalFabric fabric(fo);
    ExecutorOptions eo;
    eo.activations = kRelu;
    eo.precisions = {Precision::bf16, Precision::fp32, Precision::bf16};
    eo.chunk_packets = 16;
    LayerStreamingExecutor exec(m, fabric, eo);
    double loss = 0;
    const std::vector<LayerGradient> g =
        exec.gradients({data.x[0].view(), data.labels[0], {}}, &loss);
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));
    for (std::size_t l = 0; l < g.size(); ++l) {
      const CsrMatrix& gw = g[l].weights;
      double scale = 0;
      for (double v : ref.last_gw[l]) scale = std::max(scale, std::abs(v));
      for (std::int64_t o = 0; o < gw.rows(); ++o) {
        for (auto k = gw.row_offsets()[o]; k < gw.row_offsets()[o + 1]; ++k) {
          const double want = ref.last_gw[l][o * gw.cols() + gw.col_indices()[k]];
          ASSERT_NEAR(gw.values()[k], want, 1e-5 * scale) << "layer " << l << " row " << o;
        }
        if (!g[l].bias.empty()) {
          ASSERT_NEAR(g[l].bias[o], ref.last_gb[l][o], 1e-5 * scale) << "bias layer " << l;
        }
      }
    }
  }
  // A bf16 layer must be addressable with 16-bit indices.
  HostModelMemory wide;
  build_sparse_mlp(wide, {70000, 2}, 0.999, 1);
  LocalFabric fabric;
  ExecutorOptions eo;
  eo.precisions = {Precision::bf16};
  EXPECT_THROW(LayerStreamingExecutor(wide, fabric, eo), UnsupportedError);
  eo.precisions = {Precision::bf16, Precision::bf16};
  EXPECT_THROW(LayerStreamingExecutor(wide, fabric, eo), ShapeError);
}

TEST(Executor, MemoryBudgetIsEnforcedBeforeAllocating) {
  HostModelMemory m;
  build_sparse_mlp(m, kSizes, 0.5, 1);
  LocalFabricOptions fo;
  fo.engines = 2;
  fo.engine.threads = 1;
  LocalFabric fabric(fo);
  ExecutorOptions eo;
  eo.memory_budget_bytes = 1000;
  LayerStreamingExecutor exec(m, fabric, eo);
  // Two engines x 12 tokens (stride 16): Z 17+11+5, A 17+11 rows, 2 x 17 backward rows.
  EXPECT_EQ(exec.activation_bytes(kBatch), 2 * (33 + 28 + 34) * 16 * 4);
  const Data data = make_data(kSizes.front(), 5, 9);
  try {
    exec.train_step({data.x[0].view(), data.labels[0], {}});
    FAIL() << "no ResourceError";
  } catch (const ResourceError& e) {
    EXPECT_NE(std::string(e.what()).find("memory budget"), std::string::npos) << e.what();
  }
  ExecutorOptions roomy;
  roomy.memory_budget_bytes = exec.activation_bytes(kBatch);
  LayerStreamingExecutor fits(m, fabric, roomy);
  StepResult within;
  ASSERT_NO_THROW(within = fits.train_step({data.x[0].view(), data.labels[0], {}}));
  // The refused step left nothing behind, and a budget changes no number: the step is the
  // one an executor without a budget takes on a twin of the model, bit for bit.
  EXPECT_TRUE(within.report.applied);
  EXPECT_EQ(m.step(), 1);
  HostModelMemory twin;
  build_sparse_mlp(twin, kSizes, 0.5, 1);
  LayerStreamingExecutor unbounded(twin, fabric);
  const StepResult plain = unbounded.train_step({data.x[0].view(), data.labels[0], {}});
  EXPECT_EQ(within.loss, plain.loss);
  for (std::int32_t l = 0; l < m.layer_count(); ++l) {
    EXPECT_EQ(m.weights(l).values(), twin.weights(l).values()) << "layer " << l;
    EXPECT_EQ(m.bias(l), twin.bias(l)) << "layer " << l;
  }

  // Evaluation in batches of 32 within a budget for 32 tokens: a set of 33 samples leaves
  // one token, fewer than the engines; the last batches share the rest (17 + 16) rather
  // than one of 33 (17 an engine, a wider padded row than 16), which the budget refuses.
  // Every sample still counts once.
  ExecutorOptions for32;
  for32.memory_budget_bytes = exec.activation_bytes(32, /*training=*/false);
  ASSERT_GT(exec.activation_bytes(33, false), for32.memory_budget_bytes);
  LayerStreamingExecutor tight(m, fabric, for32);
  DenseMatrix x(kSizes.front(), 33);
  std::vector<int> labels(33, 1);
  for (std::int64_t t = 0; t < 33; ++t) {
    for (std::int64_t f = 0; f < x.rows(); ++f) x(f, t) = data.x[0](f, t % kBatch);
  }
  Evaluation e;
  ASSERT_NO_THROW(e = tight.evaluate({x.view(), labels, {}}, 32));
  EXPECT_EQ(e.tokens, 33);
  LayerStreamingExecutor unlimited(m, fabric);
  const Evaluation whole = unlimited.evaluate({x.view(), labels, {}}, 33);
  EXPECT_NEAR(e.loss, whole.loss, 1e-6 * std::abs(whole.loss));
  EXPECT_DOUBLE_EQ(e.accuracy, whole.accuracy);
}

TEST(Executor, RefusesBadBatches) {
  HostModelMemory m;
  build_sparse_mlp(m, kSizes, 0.5, 1);
  LocalFabricOptions fo;
  fo.engines = 3;
  LocalFabric fabric(fo);
  LayerStreamingExecutor exec(m, fabric);
  DenseMatrix x(13, 2);
  EXPECT_THROW(exec.train_step({x.view(), {0, 1}, {}}), ShapeError);  // 2 tokens, 3 engines
  DenseMatrix wrong(12, 6);
  EXPECT_THROW(exec.train_step({wrong.view(), {0, 1, 2, 3, 4, 0}, {}}), ShapeError);
  DenseMatrix ok(13, 6);
  EXPECT_THROW(exec.train_step({ok.view(), {0, 1, 2, 3, 4, 5}, {}}), ArgumentError);  // label 5
  EXPECT_THROW(exec.train_step({ok.view(), {0, 1}, {}}), ShapeError);
  EXPECT_THROW(exec.evaluate({ok.view(), {0, 1, 2, 3, 4, 0}, {}}, 0), ArgumentError);
  EXPECT_THROW(exec.evaluate({ok.view(), {0, 1, 2, 3, 4, 0}, {}}, -4), ArgumentError);
  Evaluation small;  // batches of 1 token grow to 3, one per engine; all 6 tokens count
  ASSERT_NO_THROW(small = exec.evaluate({ok.view(), {0, 1, 2, 3, 4, 0}, {}}, 1));
  const Evaluation whole = exec.evaluate({ok.view(), {0, 1, 2, 3, 4, 0}, {}}, 6);
  EXPECT_EQ(small.tokens, 6);
  EXPECT_TRUE(std::isfinite(small.loss));
  EXPECT_NEAR(small.loss, whole.loss, 1e-6 * std::abs(whole.loss));
  EXPECT_DOUBLE_EQ(small.accuracy, whole.accuracy);
}

// A step that fails half-way (here the schedule throws in the last layer's submit, after
// the others were submitted) leaves nothing pending: the next step runs, and its result is
// what one clean step from the same start gives, bit for bit.
TEST(Executor, AFailedStepLeavesNothingBehind) {
  const Data data = make_data(kSizes.front(), 5, 21);
  auto trained = [&](bool fail_first) {
    auto memory = std::make_unique<HostModelMemory>();
    build_sparse_mlp(*memory, kSizes, 0.5, 3);
    OptimizerConfig adam;
    adam.kind = OptimizerKind::adam;
    auto calls = std::make_shared<std::atomic<int>>(0);
    // Submits run on their own threads; the last layer's is the first to call.
    if (fail_first) adam.schedule = [calls](std::int64_t) { return ++*calls == 1 ? NAN : 1.0; };
    memory->set_optimizer(adam);
    LocalFabricOptions fo;
    fo.engines = 2;
    LocalFabric fabric(fo);
    LayerStreamingExecutor exec(*memory, fabric);
    const Batch batch{data.x[0].view(), data.labels[0], {}};
    if (fail_first) EXPECT_THROW(exec.train_step(batch), ArgumentError);
    EXPECT_EQ(memory->step(), 0);
    const StepResult r = exec.train_step(batch);
    EXPECT_TRUE(r.report.applied);
    EXPECT_EQ(memory->step(), 1);
    std::vector<float> values;
    for (std::int32_t l = 0; l < memory->layer_count(); ++l) {
      const auto& v = memory->weights(l).values();
      values.insert(values.end(), v.begin(), v.end());
    }
    return values;
  };
  const std::vector<float> after_failure = trained(true), clean = trained(false);
  ASSERT_EQ(after_failure.size(), clean.size());
  EXPECT_EQ(std::memcmp(after_failure.data(), clean.data(), clean.size() * sizeof(float)), 0);
}

TEST(Executor, ModelMemoryCanDropAPartialStep) {
  HostModelMemory m;
  build_sparse_mlp(m, kSizes, 0.5, 4);
  const std::vector<float> before = m.weights(0).values();
  WeightStream g = m.stream(0, StreamKind::mask);
  g.header.kind = StreamKind::gradient;
  auto chunk = std::make_shared<StreamChunk>(*g.chunks[0]);
  for (auto& p : chunk->packets) {
    if (!is_control(p)) p.value = 1.0F;
  }
  g.chunks[0] = chunk;
  const std::vector<float> no_bias_gradient(m.bias(0).size(), 0.0F);
  m.submit_gradient(0, g, no_bias_gradient);
  m.discard_step();
  const StepReport report = m.commit_step();  // nothing is pending any more
  EXPECT_EQ(m.step(), 0);
  EXPECT_EQ(m.weights(0).values(), before);
  m.submit_gradient(0, g, no_bias_gradient);  // accepted again
  EXPECT_TRUE(m.commit_step().applied);
  EXPECT_NE(m.weights(0).values(), before);
  (void)report;
}

// The executor plans its buffers and streams from the model's shapes when it is built; a
// model that changed since is refused, not run with the old plan.
TEST(Executor, RefusesAModelThatChangedUnderIt) {
  HostModelMemory m;
  build_sparse_mlp(m, {8, 6, 3}, 0.5, 2);
  LocalFabric fabric(LocalFabricOptions{});
  LayerStreamingExecutor exec(m, fabric);
  DenseMatrix x(8, 4);
  DenseMatrix y;
  ASSERT_NO_THROW(y = exec.infer(x.view()));  // the model as planned: 3 outputs x 4 tokens
  EXPECT_EQ(y.rows(), 3);
  EXPECT_EQ(y.cols(), 4);
  m.add_layer(CsrMatrix::random(2, 3, 0.5, 1), std::vector<float>(2, 0.0F));
  try {
    exec.infer(x.view());
    FAIL() << "ran a stale plan";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("changed since this executor was built"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(exec.train_step({x.view(), {0, 1, 2, 0}, {}}), ArgumentError);
}

// ReLU(NaN) is NaN: a NaN input must not leave the net as a finite output.
TEST(Executor, NanInputsStayNan) {
  HostModelMemory m;
  build_sparse_mlp(m, {4, 8, 2}, 0.0, 5);
  LocalFabric fabric(LocalFabricOptions{});
  for (const Activation hidden : {Activation::relu, Activation::gelu}) {
    ExecutorOptions eo;
    eo.activations = {hidden, Activation::none};
    LayerStreamingExecutor exec(m, fabric, eo);
    DenseMatrix x(4, 2);
    for (std::int64_t f = 0; f < 4; ++f) x(f, 1) = 0.25F;
    x(2, 0) = NAN;
    const DenseMatrix y = exec.infer(x.view());
    EXPECT_TRUE(std::isnan(y(0, 0)) && std::isnan(y(1, 0))) << to_string(hidden);
    EXPECT_TRUE(std::isfinite(y(0, 1)) && std::isfinite(y(1, 1))) << to_string(hidden);
  }
  ExecutorOptions bad;
  bad.activations = {static_cast<Activation>(9), Activation::none};
  EXPECT_THROW(LayerStreamingExecutor(m, fabric, bad), ArgumentError);
  bad = {};
  bad.loss = static_cast<Loss>(7);
  EXPECT_THROW(LayerStreamingExecutor(m, fabric, bad), ArgumentError);
}

TEST(Executor, LocalFabricRefusesBadOptions) {
  LocalFabricOptions fo;
  fo.engines = 0;
  EXPECT_THROW(LocalFabric{fo}, ArgumentError);
  fo = {};
  fo.channel_capacity = 0;
  EXPECT_THROW(LocalFabric{fo}, ArgumentError);
  fo = {};
  fo.engine.threads = -5;  // was taken as 0, "share the cores"
  EXPECT_THROW(LocalFabric{fo}, ArgumentError);
  fo.engine.threads = 0;
  EXPECT_NO_THROW(LocalFabric{fo});
}

TEST(Executor, RefusesModelsWithAnEmptyLayer) {
  HostModelMemory m;
  EXPECT_THROW(build_sparse_mlp(m, {8, 0, 4}, 0.5, 1), ShapeError);
  EXPECT_THROW(build_sparse_mlp(m, {8, 4, 0}, 0.5, 1), ShapeError);
  EXPECT_THROW(build_sparse_mlp(m, {-1, 4}, 0.5, 1), ShapeError);
  EXPECT_EQ(m.layer_count(), 0);  // nothing half-built
}

TEST(Executor, MseLossTrainsAndInferMatchesEngines) {
  HostModelMemory m;
  build_sparse_mlp(m, {8, 16, 3}, 0.5, 2);
  OptimizerConfig adam;
  adam.learning_rate = 1e-2;
  m.set_optimizer(adam);
  LocalFabricOptions fo;
  fo.engines = 2;
  LocalFabric fabric(fo);
  ExecutorOptions eo;
  eo.loss = Loss::mse;
  LayerStreamingExecutor exec(m, fabric, eo);
  const Data data = make_data(8, 3, 10);
  DenseMatrix target(3, kBatch);
  for (std::int64_t t = 0; t < kBatch; ++t)
    for (int o = 0; o < 3; ++o) target(o, t) = 0.5F * data.x[0](o, t) - 0.25F * data.x[0](o + 3, t);
  Batch b{data.x[0].view(), {}, target.view()};
  const double first = exec.train_step(b).loss;
  double last = first;
  for (int s = 0; s < 60; ++s) last = exec.train_step(b).loss;
  EXPECT_LT(last, 0.5 * first);
  const DenseMatrix y = exec.infer(data.x[0].view());
  double mse = 0;
  for (std::int64_t t = 0; t < kBatch; ++t)
    for (int o = 0; o < 3; ++o) mse += 0.5 * std::pow(y(o, t) - target(o, t), 2);
  EXPECT_NEAR(mse / kBatch, exec.evaluate(b).loss, 1e-5);
}

TEST(Executor, MatchesReferenceAcrossMaskChanges) {
  const Data data = make_data(kSizes.front(), static_cast<int>(kSizes.back()), 8);
  HostModelMemory memory;
  build_sparse_mlp(memory, kSizes, 0.5, 42);
  memory.set_optimizer(sgd_momentum());
  Reference ref(memory, kRelu, sgd_momentum());
  LocalFabricOptions fo;
  fo.engines = 2;
  fo.engine.geometry = Geometry{3, 1, 8};  // three lanes: placements matter
  fo.engine.threads = 1;
  LocalFabric fabric(fo);
  ExecutorOptions eo;
  eo.chunk_packets = 16;
  LayerStreamingExecutor exec(memory, fabric, eo);
  for (int s = 0; s < 6; ++s) {
    if (s == 2 || s == 4) {
      for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
        const CsrMatrix before = memory.weights(l);
        memory.regrow(l, random_inactive_positions(before, before.nnz() / 4, 7 + s + l));
        // The same change in the reference: positions that left the mask and positions
        // that joined it both start (or stay) at 0 with zero state.
        RefLayer& L = ref.layers[static_cast<std::size_t>(l)];
        std::vector<double> mask(L.mask.size(), 0);
        const CsrMatrix& after = memory.weights(l);
        for (std::int64_t o = 0; o < after.rows(); ++o) {
          for (auto k = after.row_offsets()[o]; k < after.row_offsets()[o + 1]; ++k) {
            mask[static_cast<std::size_t>(o * L.in + after.col_indices()[k])] = 1;
          }
        }
        for (std::size_t p = 0; p < mask.size(); ++p) {
          if (mask[p] != L.mask[p]) L.w[p] = L.state_w1[p] = L.state_w2[p] = 0;
        }
        L.mask = mask;
      }
    }
    const double want = ref.train_step(data.x[s], data.labels[s]);
    const StepResult got = exec.train_step({data.x[s].view(), data.labels[s], {}});
    ASSERT_NEAR(got.loss, want, 1e-4 * std::abs(want)) << "step " << s;
  }
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
    const CsrMatrix& w = memory.weights(l);
    const RefLayer& L = ref.layers[static_cast<std::size_t>(l)];
    for (std::int64_t o = 0; o < w.rows(); ++o) {
      for (auto k = w.row_offsets()[o]; k < w.row_offsets()[o + 1]; ++k) {
        const double want = L.w[static_cast<std::size_t>(o * L.in + w.col_indices()[k])];
        ASSERT_NEAR(w.values()[k], want, 1e-4 * std::max(1.0, std::abs(want)))
            << "layer " << l << " row " << o;
      }
    }
  }
}

}  // namespace
}  // namespace sluice
