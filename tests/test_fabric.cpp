// The fabric: the gradient tree, the broadcast, and the layer operations over the engines'
// activation stores, against the product operations on views that the executor used
// before the engines held the activations (bit for bit), over 1-3 engines.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "reference.hpp"
#include "sluice/dataset.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"

namespace sluice {
namespace {

TEST(Fabric, ReductionIsATreeAndChecksTags) {
  const CsrMatrix w = CsrMatrix::random(7, 5, 0.3, 1);
  auto gradient = [](const CsrMatrix& g, std::size_t chunk) {
    WeightStream s = encode_stream(g, StreamKind::weights, chunk);
    s.header.kind = StreamKind::gradient;
    return s;
  };
  std::vector<WeightStream> streams;
  std::vector<std::vector<float>> biases;
  for (int k = 0; k < 5; ++k) {
    CsrMatrix g = w;
    // Values whose float sum depends on the order: the tree's order must be the fixed one.
    for (auto& v : g.values()) v = k == 0 ? 1e8F : static_cast<float>(k) * 0.75F;
    streams.push_back(gradient(g, k % 2 == 0 ? 4 : 1000));  // different chunking
    biases.push_back({static_cast<float>(k), 1.0F});
  }
  ReducedGradient r = reduce_gradients(streams, biases);
  // ((s0 + s1) + (s2 + s3)) + s4
  const float want = ((1e8F + 0.75F) + (1.5F + 2.25F)) + 3.0F;
  r.weights.header.kind = StreamKind::weights;
  const CsrMatrix sum = decode_stream(r.weights);
  for (float v : sum.values()) EXPECT_EQ(v, want);
  EXPECT_EQ(r.bias, (std::vector<float>{10.0F, 5.0F}));

  std::vector<WeightStream> bad = streams;
  auto chunk = std::make_shared<StreamChunk>(*bad[3].chunks[0]);
  for (Packet& p : chunk->packets) {
    if (!is_control(p)) {
      p.tag = p.tag == 0 ? 1 : 0;
      break;
    }
  }
  bad[3].chunks[0] = chunk;
  EXPECT_THROW(reduce_gradients(bad, {}), FormatError);
  bad = streams;
  bad[1] = gradient(CsrMatrix::random(7, 6, 0.3, 1), 4);
  EXPECT_THROW(reduce_gradients(bad, {}), FormatError);
  EXPECT_THROW(reduce_gradients({}, {}), ArgumentError);
}

TEST(Fabric, BroadcastForwardMatchesOneEngine) {
  const CsrMatrix w = CsrMatrix::random(19, 23, 0.7, 4);
  const WeightStream stream = encode_stream(w, StreamKind::weights, 8);
  DenseMatrix x(23, 30);
  std::mt19937 rng(1);
  for (std::int64_t i = 0; i < 23; ++i)
    for (std::int64_t t = 0; t < 30; ++t)
      x(i, t) = std::uniform_real_distribution<float>(-1, 1)(rng);
  CpuEngine one(EngineOptions{{1, 1, 0}, 1, {}, false, 0});
  const Placement p1 = round_robin_placement(w, 1);
  DenseMatrix want(19, 30);
  one.forward(stream, p1, x.view(), want.view());
  LocalFabricOptions fo;
  fo.engines = 3;
  fo.channel_capacity = 1;
  LocalFabric fabric(fo);
  DenseMatrix y(19, 30);
  std::vector<const Placement*> ps(3, &p1);
  std::vector<ConstMatrixView> xs;
  std::vector<MutableMatrixView> ys;
  for (int k = 0; k < 3; ++k) {
    xs.push_back({x.data() + 10 * k, 23, 10, x.stride()});
    ys.push_back({y.data() + 10 * k, 19, 10, y.stride()});
  }
  {
    MemoryStreamSource source(stream);
    FabricRequest<void> request = fabric.forward_async(source, ps, xs, ys);
    request.get();
  }
  for (std::int64_t o = 0; o < 19; ++o)
    for (std::int64_t t = 0; t < 30; ++t) EXPECT_NEAR(y(o, t), want(o, t), 1e-5);
  MemoryStreamSource source(stream);
  std::vector<const Placement*> two(2, &p1);
  EXPECT_THROW(fabric.forward(source, two, xs, ys), ShapeError);

  // Async operations run in the order issued, give what the blocking ones give, and
  // hand an operation's error to its request, after which the fabric goes on.
  const DenseMatrix dy = testing::random_dense(19, 30, 9);
  std::vector<ConstMatrixView> dys;
  for (int k = 0; k < 3; ++k) dys.push_back({dy.data() + 10 * k, 19, 10, dy.stride()});
  MemoryStreamSource blocking_source(stream);
  const ReducedGradient blocking = fabric.backward(blocking_source, ps, xs, dys, {}, true);
  MemoryStreamSource bad_source(stream), first_source(stream), second_source(stream);
  FabricRequest<void> bad = fabric.forward_async(bad_source, two, xs, ys);
  FabricRequest<ReducedGradient> first = fabric.backward_async(first_source, ps, xs, dys, {}, true);
  FabricRequest<ReducedGradient> second =
      fabric.backward_async(second_source, ps, xs, dys, {}, true);
  EXPECT_THROW(bad.get(), ShapeError);
  for (FabricRequest<ReducedGradient>* request : {&first, &second}) {
    const ReducedGradient g = request->get();
    EXPECT_EQ(g.bias, blocking.bias);
    ASSERT_EQ(g.weights.chunks.size(), blocking.weights.chunks.size());
    for (std::size_t c = 0; c < g.weights.chunks.size(); ++c) {
      const auto& got = g.weights.chunks[c]->packets;
      const auto& expected = blocking.weights.chunks[c]->packets;
      ASSERT_EQ(got.size(), expected.size());
      for (std::size_t k = 0; k < got.size(); ++k) {
        EXPECT_EQ(got[k].tag, expected[k].tag);
        EXPECT_EQ(got[k].value, expected[k].value);
      }
    }
  }
}

// ---- the step as the executor ran it before the engines held the activations ----------
// X, Z and A of every engine on this side, handed to the fabric's product operations at
// every layer (ReLU hidden layers, softmax cross-entropy): the reference the layer
// operations must reproduce bit for bit.

struct HostPath {
  ModelMemory& memory;
  Fabric& fabric;
  std::vector<Precision> precisions;
  std::map<std::pair<std::int32_t, std::int32_t>, Placement> placements;

  const Placement* placement(std::int32_t l, std::int64_t tokens, std::int32_t k) {
    const CsrMatrix& w = memory.weights(l);
    const std::int32_t lanes =
        std::max(1, fabric.engine(k).geometry_for(w.rows(), w.cols(), tokens, precisions[l]).lanes);
    auto it = placements.find({l, lanes});
    if (it == placements.end())
      it = placements.emplace(std::pair{l, lanes}, memory.placement(l, lanes)).first;
    return &it->second;
  }

  double step(const DenseMatrix& x, const std::vector<int>& labels) {
    const std::int32_t n = fabric.engine_count(), layers = memory.layer_count();
    const std::int64_t total = x.cols();
    struct State {
      Fabric::TokenRange r;
      std::vector<DenseMatrix> z, a;
      DenseMatrix grad, below;
    };
    std::vector<State> st(static_cast<std::size_t>(n));
    std::int64_t widest = 0;
    for (std::int32_t l = 0; l < layers; ++l) widest = std::max(widest, memory.weights(l).rows());
    for (std::int32_t k = 0; k < n; ++k) {
      State& s = st[k];
      s.r = Fabric::shard_of(k, n, total);
      for (std::int32_t l = 0; l < layers; ++l) {
        s.z.emplace_back(memory.weights(l).rows(), s.r.count);
        s.a.emplace_back(l + 1 < layers ? DenseMatrix(memory.weights(l).rows(), s.r.count)
                                        : DenseMatrix());
      }
      s.grad = DenseMatrix(widest, s.r.count);
      s.below = DenseMatrix(widest, s.r.count);
    }
    auto in = [&](State& s, std::int32_t l) -> ConstMatrixView {
      if (l == 0) return {x.data() + s.r.first, x.rows(), s.r.count, x.stride()};
      return st.empty() ? ConstMatrixView{} : s.a[l - 1].view();
    };
    auto rows = [](DenseMatrix& m, std::int64_t r) -> MutableMatrixView {
      return {m.data(), r, m.cols(), m.stride()};
    };
    for (std::int32_t l = 0; l < layers; ++l) {
      std::vector<const Placement*> ps;
      std::vector<ConstMatrixView> xs;
      std::vector<MutableMatrixView> ys;
      for (std::int32_t k = 0; k < n; ++k) {
        ps.push_back(placement(l, st[k].r.count, k));
        xs.push_back(in(st[k], l));
        ys.push_back(st[k].z[l].view());
      }
      const WeightStream w = memory.stream(l, StreamKind::weights, precisions[l]);
      MemoryStreamSource source(w);
      fabric.forward(source, ps, xs, ys);
      for (State& s : st) {
        for (std::int64_t o = 0; o < s.z[l].rows(); ++o) {
          const float b = memory.bias(l)[static_cast<std::size_t>(o)];
          for (std::int64_t t = 0; t < s.r.count; ++t) {
            if (b != 0.0F) s.z[l](o, t) += b;
            if (l + 1 < layers) s.a[l](o, t) = s.z[l](o, t) <= 0 ? 0.0F : s.z[l](o, t);
          }
        }
      }
    }
    double loss = 0;
    const std::int64_t outputs = memory.weights(layers - 1).rows();
    for (State& s : st) {
      const DenseMatrix& y = s.z[layers - 1];
      for (std::int64_t t = 0; t < s.r.count; ++t) {
        const int label = labels[static_cast<std::size_t>(s.r.first + t)];
        double peak = y(0, t);
        for (std::int64_t o = 1; o < outputs; ++o) peak = std::max<double>(peak, y(o, t));
        double sum = 0;
        for (std::int64_t o = 0; o < outputs; ++o) sum += std::exp(y(o, t) - peak);
        const double log_sum = std::log(sum) + peak;
        loss += log_sum - y(label, t);
        for (std::int64_t o = 0; o < outputs; ++o) {
          const double p = std::exp(y(o, t) - log_sum);
          s.grad(o, t) = static_cast<float>((p - (o == label ? 1.0 : 0.0)) *
                                            (1.0 / static_cast<double>(total)));
        }
      }
    }
    for (std::int32_t l = layers - 1; l >= 0; --l) {
      const std::int64_t out = memory.weights(l).rows(), inputs = memory.weights(l).cols();
      std::vector<const Placement*> ps;
      std::vector<ConstMatrixView> xs, dys;
      std::vector<MutableMatrixView> dx(static_cast<std::size_t>(n));
      std::vector<MutableMatrixView*> dxs;
      for (std::int32_t k = 0; k < n; ++k) {
        State& s = st[k];
        if (l + 1 < layers) {
          for (std::int64_t o = 0; o < out; ++o)
            for (std::int64_t t = 0; t < s.r.count; ++t)
              s.grad(o, t) = s.grad(o, t) * (s.z[l](o, t) > 0 ? 1.0F : 0.0F);
        }
        ps.push_back(placement(l, s.r.count, k));
        xs.push_back(in(s, l));
        dys.push_back(rows(s.grad, out));
        if (l > 0) {
          dx[k] = rows(s.below, inputs);
          dxs.push_back(&dx[k]);
        }
      }
      const WeightStream w =
          l == 0 ? memory.stream(l, StreamKind::mask, precisions[l])
                 : memory.stream(l, StreamKind::weights, precisions[l], StreamOrder::by_input);
      MemoryStreamSource source(w);
      const ReducedGradient g = fabric.backward(source, ps, xs, dys, dxs, true);
      memory.submit_gradient(l, g.weights, g.bias);
      for (State& s : st) std::swap(s.grad, s.below);
    }
    memory.commit_step();
    return loss / static_cast<double>(total);
  }
};

std::vector<float> all_parameters(const ModelMemory& m) {
  std::vector<float> v;
  for (std::int32_t l = 0; l < m.layer_count(); ++l) {
    v.insert(v.end(), m.weights(l).values().begin(), m.weights(l).values().end());
    v.insert(v.end(), m.bias(l).begin(), m.bias(l).end());
  }
  return v;
}

TEST(Fabric, LayerOperationsTrainBitForBitAsTheViewOperationsDid) {
  const std::vector<std::int64_t> sizes = {13, 40, 21, 5};
  constexpr std::int64_t kTokens = 29;  // odd: engines get unequal shards
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<DenseMatrix> xs;
  std::vector<std::vector<int>> labels;
  for (int s = 0; s < 4; ++s) {
    xs.emplace_back(sizes.front(), kTokens);
    labels.emplace_back();
    for (std::int64_t t = 0; t < kTokens; ++t) {
      for (std::int64_t i = 0; i < sizes.front(); ++i) xs.back()(i, t) = normal(rng);
      labels.back().push_back(static_cast<int>(rng() % 5));
    }
  }
  for (const bool bf16 : {false, true}) {
    const std::vector<Precision> precisions =
        bf16 ? std::vector<Precision>{Precision::bf16, Precision::fp32, Precision::bf16}
             : std::vector<Precision>(3, Precision::fp32);
    for (std::int32_t engines = 1; engines <= 3; ++engines) {
      auto make = [&] {
        auto m = std::make_unique<HostModelMemory>();
        for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {  // biases that matter
          CsrMatrix w = CsrMatrix::random(sizes[l + 1], sizes[l], 0.5, 17 + l);
          w.fill_values(29 + l, 0.5F);
          std::vector<float> b(static_cast<std::size_t>(sizes[l + 1]));
          for (std::size_t o = 0; o < b.size(); ++o) b[o] = 0.01F * static_cast<float>(o % 7);
          m->add_layer(std::move(w), b);
        }
        OptimizerConfig adam;
        adam.kind = OptimizerKind::adam;
        m->set_optimizer(adam);
        return m;
      };
      LocalFabricOptions fo;
      fo.engines = engines;
      fo.engine.threads = 1;
      fo.engine.geometry.shares = 2;
      auto on_stores = make(), on_views = make();
      LocalFabric stores_fabric(fo), views_fabric(fo);
      ExecutorOptions eo;
      eo.precisions = precisions;
      eo.chunk_packets = 16;
      LayerStreamingExecutor exec(*on_stores, stores_fabric, eo);
      HostPath host{*on_views, views_fabric, precisions, {}};
      for (int s = 0; s < 4; ++s) {
        const double got = exec.train_step({xs[s].view(), labels[s], {}}).loss;
        const double want = host.step(xs[s], labels[s]);
        // Engines sum their tokens' losses, then the fabric adds the sums: the mean may
        // differ from one running sum in its last bits.
        EXPECT_NEAR(got, want, 1e-12 * std::abs(want)) << engines << " engines, step " << s;
      }
      const std::vector<float> a = all_parameters(*on_stores), b = all_parameters(*on_views);
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << engines << " engines, " << (bf16 ? "bf16" : "fp32");
      // Inference gathers what the engines hold: the forward of the view path.
      const DenseMatrix y = exec.infer(xs[0].view());
      EXPECT_EQ(y.rows(), sizes.back());
      EXPECT_EQ(y.cols(), kTokens);
    }
  }
}

TEST(Fabric, DriverBytesPerStepDoNotGrowWithTheBatch) {
  HostModelMemory m;
  build_sparse_mlp(m, {16, 256, 256, 10}, 0.5, 5);
  LocalFabricOptions fo;
  fo.engines = 2;
  fo.engine.threads = 1;
  LocalFabric fabric(fo);
  LayerStreamingExecutor exec(m, fabric);
  auto per_step = [&](std::int64_t tokens) {
    const DenseMatrix x = testing::random_dense(16, tokens, 7);
    std::vector<int> labels(static_cast<std::size_t>(tokens));
    for (std::size_t t = 0; t < labels.size(); ++t) labels[t] = static_cast<int>(t % 10);
    const FabricCounters before = fabric.counters();
    const StepResult r = exec.train_step({x.view(), labels, {}});
    EXPECT_EQ(r.metrics.driver_bytes_sent,
              fabric.counters().driver_bytes_sent - before.driver_bytes_sent);
    EXPECT_EQ(r.metrics.steps, 1);
    return r.metrics;
  };
  const StepMetrics small = per_step(32), large = per_step(512);
  // What goes out grows by the batch itself (its features and labels, once a step), what
  // comes back (gradients, bias gradients, loss scalars) not at all: no activations move.
  EXPECT_EQ(large.driver_bytes_sent - small.driver_bytes_sent,
            (512 - 32) * (16 * sizeof(float) + sizeof(int)));
  EXPECT_EQ(large.driver_bytes_received, small.driver_bytes_received);
  // Every layer's stream, forward and backward, went out once (not once per engine).
  EXPECT_GE(small.driver_bytes_sent, small.stream_bytes);
  EXPECT_LT(small.driver_bytes_sent, small.stream_bytes + 64 * 1024);
  EXPECT_GE(large.overlap(), 0.0);
  EXPECT_LE(large.overlap(), 1.0);
  // The passes are part of the step: timed, and no longer than it.
  for (const StepMetrics& m : {small, large}) {
    EXPECT_GT(m.pass_seconds, 0.0);
    EXPECT_LE(m.pass_seconds, m.wall_seconds);
    EXPECT_GE(m.step_over_passes(), 1.0);
  }
}

TEST(Fabric, LayerOperationsKeepEachEnginesShardAndRefuseBadCalls) {
  HostModelMemory m;
  build_sparse_mlp(m, {6, 9, 4}, 0.3, 2);
  LocalFabricOptions fo;
  fo.engines = 3;
  fo.engine.threads = 1;
  LocalFabric fabric(fo);
  std::vector<const Placement*> ps(3);
  const Placement p = m.placement(0, 1);
  for (auto& q : ps) q = &p;
  {
    const WeightStream w = m.stream(0);
    MemoryStreamSource source(w);
    EXPECT_THROW(fabric.forward_layer(source, ps, 0, {}), ArgumentError);  // nothing loaded
  }
  PassSpec spec{
      {6, 9, 4}, {Activation::relu, Activation::none}, Loss::softmax_cross_entropy, false};
  const DenseMatrix x = testing::random_dense(6, 8, 1);
  EXPECT_THROW(fabric.load_batch(spec, {{x.data(), 6, 2, x.stride()}, {}, {}}), ShapeError);
  fabric.load_batch(spec, {x.view(), {}, {}});
  for (std::int32_t k = 0; k < 3; ++k) {
    EXPECT_EQ(fabric.engine(k).store().tokens(), Fabric::shard_of(k, 3, 8).count);
    const ConstMatrixView in = fabric.engine(k).store().in(0);
    const std::int64_t first = Fabric::shard_of(k, 3, 8).first;
    for (std::int64_t t = 0; t < in.cols; ++t) EXPECT_EQ(in(5, t), x(5, first + t));
  }
  const WeightStream w = m.stream(0);
  MemoryStreamSource wrong_bias(w);
  const std::vector<float> bias(8, 0.0F);  // the layer has 9 outputs
  EXPECT_THROW(fabric.forward_layer(wrong_bias, ps, 0, bias), ShapeError);
  EXPECT_THROW(fabric.loss(false, 8), ArgumentError);  // loaded without labels
}

// Batches by sample index: the engines take features and labels from the data set the
// fabric holds; the step is bit for bit the one on a batch built from the same samples,
// and the driver sends 8 bytes a token instead of the features.
TEST(Fabric, SamplesByIndexTrainAsTheirBatchDoes) {
  const Dataset data = make_synthetic_dataset(90, 12, 4, 3);
  const std::vector<std::int64_t> samples = {5, 81, 2, 2, 40, 17, 66, 9, 33, 70, 1};
  for (std::int32_t engines = 1; engines <= 3; ++engines) {
    HostModelMemory by_index, by_batch;
    build_sparse_mlp(by_index, {12, 20, 4}, 0.4, 8);
    build_sparse_mlp(by_batch, {12, 20, 4}, 0.4, 8);
    LocalFabricOptions fo;
    fo.engines = engines;
    fo.engine.threads = 1;
    LocalFabric index_fabric(fo), batch_fabric(fo);
    LayerStreamingExecutor a(by_index, index_fabric), b(by_batch, batch_fabric);
    EXPECT_THROW(a.train_step_samples(samples), ArgumentError);  // no data set attached yet
    index_fabric.attach_dataset(&data);
    DenseMatrix x(12, static_cast<std::int64_t>(samples.size()));
    Batch batch;
    for (std::size_t t = 0; t < samples.size(); ++t) {
      for (std::int64_t f = 0; f < 12; ++f)
        x(f, static_cast<std::int64_t>(t)) = data.features(f, samples[t]);
      batch.labels.push_back(data.labels[static_cast<std::size_t>(samples[t])]);
    }
    batch.features = x.view();
    for (int step = 0; step < 3; ++step) {
      const StepResult ra = a.train_step_samples(samples), rb = b.train_step(batch);
      EXPECT_EQ(ra.loss, rb.loss);
      EXPECT_EQ(ra.metrics.driver_bytes_sent - rb.metrics.driver_bytes_sent +
                    samples.size() * (12 * sizeof(float) + sizeof(int)),
                samples.size() * sizeof(std::int64_t));
    }
    const std::vector<float> pa = all_parameters(by_index), pb = all_parameters(by_batch);
    ASSERT_EQ(pa.size(), pb.size());
    EXPECT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)), 0) << engines;
    const std::vector<std::int64_t> outside = {1, 90};
    EXPECT_THROW(a.train_step_samples(outside), ArgumentError);
  }
}

}  // namespace
}  // namespace sluice
