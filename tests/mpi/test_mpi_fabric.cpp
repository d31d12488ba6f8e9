// The MPI fabric against the in-process LocalFabric with the same number of engines (and
// the same engine options): training, gradients and inference must agree. Rank 0 runs the
// tests and the LocalFabric reference; the other ranks serve their engines. Run under
// mpirun with 2 or more ranks. With --inject-corrupt-stream, rank 0 sends the engines a
// corrupt stream instead: every rank must then end with "sluice[rank r]: ..." (not hang).
// With --no-shared-memory, the summed gradient reaches rank 0 by messages only (as
// between nodes).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sluice/dataset.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/gpt.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/mpi_fabric.hpp"

#include "gpt_reference.hpp"

namespace sluice {
namespace {

MpiFabric* g_fabric = nullptr;
// Every rank's copy of one data set, built the same way (engine ranks attach theirs).
const sluice::Dataset g_dataset = sluice::make_synthetic_dataset(90, 12, 4, 3);
constexpr std::int32_t kThreads = 1;  // per engine, both fabrics: the same lane geometry
// Two stream shares on every engine of both fabrics: their dX parts are added in share
// order, so the bits match only if the engine ranks got the geometry too.
constexpr std::int32_t kShares = 2;

LocalFabric make_local(std::int32_t engines) {
  LocalFabricOptions o;
  o.engines = engines;
  o.engine.threads = kThreads;
  o.engine.geometry.shares = kShares;
  return LocalFabric(o);
}

void build(HostModelMemory& memory, const std::vector<std::int64_t>& sizes, OptimizerKind kind) {
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    CsrMatrix w = CsrMatrix::random(sizes[l + 1], sizes[l], 0.6, 42 + l);
    w.fill_values(7 + l, 0.5F);
    // Non-zero biases, so the bias path matters from the first step.
    std::vector<float> bias(static_cast<std::size_t>(sizes[l + 1]));
    for (std::size_t o = 0; o < bias.size(); ++o)
      bias[o] = 0.01F * static_cast<float>(o % 7) - 0.02F;
    memory.add_layer(std::move(w), std::move(bias));
  }
  OptimizerConfig config;
  config.kind = kind;
  config.learning_rate = 1e-2;
  if (kind == OptimizerKind::sgd) config.momentum = 0.9;
  memory.set_optimizer(config);
}

struct Data {
  DenseMatrix x, targets;
  std::vector<int> labels;
};

Data make_data(std::int64_t inputs, std::int64_t outputs, std::int64_t tokens, std::uint64_t seed) {
  Data d{DenseMatrix(inputs, tokens), DenseMatrix(outputs, tokens), {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t i = 0; i < inputs; ++i) d.x(i, t) = normal(rng);
    for (std::int64_t o = 0; o < outputs; ++o) d.targets(o, t) = normal(rng);
    d.labels.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(outputs)));
  }
  return d;
}

// Relative closeness 1e-5 (the contract), and bitwise equality (what the fabric's fixed
// reduction tree gives with the same engines): both are checked.
void expect_same(const std::vector<float>& a, const std::vector<float>& b,
                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  std::size_t differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_NEAR(a[i], b[i], 1e-5 * std::max(1.0F, std::fabs(b[i]))) << what << " at " << i;
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) ++differ;
  }
  EXPECT_EQ(differ, 0U) << what << ": values differ in the last bits";
}

void expect_same_models(const HostModelMemory& a, const HostModelMemory& b) {
  ASSERT_EQ(a.layer_count(), b.layer_count());
  for (std::int32_t l = 0; l < a.layer_count(); ++l) {
    expect_same(a.weights(l).values(), b.weights(l).values(),
                "weights of layer " + std::to_string(l));
    expect_same(a.bias(l), b.bias(l), "bias of layer " + std::to_string(l));
  }
}

/// The same model twice, on the MPI fabric and on a LocalFabric with as many engines,
/// each driven by an executor with the same options.
struct Twins {
  Twins(const std::vector<std::int64_t>& sizes, OptimizerKind kind,
        const ExecutorOptions& options = {})
      : local_fabric(make_local(g_fabric->engine_count())) {
    build(remote, sizes, kind);
    build(local, sizes, kind);
    on_mpi.emplace(remote, *g_fabric, options);
    on_local.emplace(local, local_fabric, options);
  }
  HostModelMemory remote, local;
  LocalFabric local_fabric;
  std::optional<LayerStreamingExecutor> on_mpi, on_local;
};

TEST(MpiFabric, CountsEnginesAndRefusesToServeOnRankZero) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(g_fabric->engine_count(), size - 1);
  EXPECT_TRUE(g_fabric->is_driver());
  EXPECT_EQ(g_fabric->engine(0).threads(), kThreads);
  EXPECT_THROW(g_fabric->serve(), ArgumentError);
  EXPECT_THROW(g_fabric->engine(size - 1), ShapeError);
}

TEST(MpiFabric, TrainingMatchesLocalFabric) {
  const std::vector<std::int64_t> sizes = {13, 17, 11, 5};
  ExecutorOptions eo;
  eo.chunk_packets = 7;  // many small chunks: the broadcast pipeline really pipelines
  eo.prefetch_depth = 2;
  Twins twins(sizes, OptimizerKind::adam, eo);
  LayerStreamingExecutor& on_mpi = *twins.on_mpi;
  LayerStreamingExecutor& on_local = *twins.on_local;
  for (int step = 0; step < 6; ++step) {
    const std::int64_t tokens = 23 + step;  // odd batches: uneven token slices
    Data d = make_data(sizes.front(), sizes.back(), tokens, 100 + static_cast<std::uint64_t>(step));
    const Batch batch{d.x.view(), d.labels, {}};
    const StepResult a = on_mpi.train_step(batch);
    const StepResult b = on_local.train_step(batch);
    ASSERT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(b.loss)) << "step " << step;
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
    EXPECT_EQ(a.accuracy, b.accuracy);
    EXPECT_GT(a.metrics.stream_packets, 0U);
  }
  expect_same_models(twins.remote, twins.local);
  EXPECT_GT(on_mpi.totals().engine_busy_seconds, 0.0);  // the engine ranks' counters came back
}

// Masks that change (RigL and SET): every rank sees the new masks from the next stream
// on, so the models, masks included, stay those of a LocalFabric.
TEST(MpiFabric, DynamicSparsityMatchesLocalFabric) {
  const std::vector<std::int64_t> sizes = {13, 17, 11, 5};
  for (const MaskUpdateRule rule : {MaskUpdateRule::rigl, MaskUpdateRule::set}) {
    ExecutorOptions eo;
    eo.dynamic.rule = rule;
    eo.dynamic.update_every = 2;
    eo.dynamic.drop = 0.5;
    eo.dynamic.total_steps = 8;
    Twins twins(sizes, OptimizerKind::adam, eo);
    std::vector<std::vector<std::uint32_t>> before;
    for (std::int32_t l = 0; l < twins.remote.layer_count(); ++l) {
      before.push_back(twins.remote.weights(l).col_indices());
    }
    for (int step = 0; step < 8; ++step) {
      Data d =
          make_data(sizes.front(), sizes.back(), 23 + step, 300 + static_cast<std::uint64_t>(step));
      const Batch batch{d.x.view(), d.labels, {}};
      const StepResult a = twins.on_mpi->train_step(batch);
      const StepResult b = twins.on_local->train_step(batch);
      EXPECT_EQ(a.loss, b.loss) << to_string(rule) << " step " << step;
    }
    EXPECT_EQ(twins.on_mpi->totals().mask_updates, 2) << to_string(rule);  // steps 2 and 4
    for (std::int32_t l = 0; l < twins.remote.layer_count(); ++l) {
      EXPECT_EQ(twins.remote.weights(l).row_offsets(), twins.local.weights(l).row_offsets());
      EXPECT_EQ(twins.remote.weights(l).col_indices(), twins.local.weights(l).col_indices());
      EXPECT_NE(twins.remote.weights(l).col_indices(), before[static_cast<std::size_t>(l)]);
    }
    expect_same_models(twins.remote, twins.local);
  }
}

// RigL's growth scores run on the engine ranks (each tile's sums passed from engine to
// engine, the top-k on the last): the positions of a LocalFabric with as many engines,
// bit for bit, and rank 0 receives the candidates only, never the activations.
TEST(MpiFabric, GrowthTopKRunsOnTheEnginesAsOnALocalFabric) {
  const std::vector<std::int64_t> sizes = {150, 140, 9};  // two column tiles, the last partial
  Twins twins(sizes, OptimizerKind::adam);
  Data d = make_data(sizes.front(), sizes.back(), 29, 41);
  const Batch batch{d.x.view(), d.labels, {}};
  twins.on_mpi->gradients(batch);  // leaves every layer's X and dZ in the engines' stores
  twins.on_local->gradients(batch);
  for (std::int32_t l = 0; l < 2; ++l) {
    const CsrMatrix& mask = twins.remote.weights(l);
    const std::int64_t inactive = mask.rows() * mask.cols() - mask.nnz();
    GrowthSource source;
    source.layer = l;
    for (const std::int64_t k : {std::int64_t{1}, std::int64_t{333}, inactive}) {
      const FabricCounters before = g_fabric->counters();
      const std::vector<std::int64_t> remote = g_fabric->growth_top_k(source, mask, k);
      const std::uint64_t received =
          g_fabric->counters().driver_bytes_received - before.driver_bytes_received;
      EXPECT_EQ(remote, twins.local_fabric.growth_top_k(source, mask, k)) << l << " " << k;
      EXPECT_EQ(remote.size(), static_cast<std::size_t>(k));
      EXPECT_EQ(received, 8 * (static_cast<std::uint64_t>(k) + 1)) << "candidates only";
    }
  }
  GrowthSource none;
  none.layer = 2;
  EXPECT_THROW(g_fabric->growth_top_k(none, twins.remote.weights(0), 1), ArgumentError);
}

// Rank 0 sends each engine its shard of the batch once a step, then weights; it receives
// gradients and scalars: what comes back does not depend on the batch, what goes out grows
// by the batch's own bytes only. The bytes are rank 0's actual messages, protocol included.
TEST(MpiFabric, DriverBytesDoNotGrowWithTheBatch) {
  const std::vector<std::int64_t> sizes = {16, 96, 64, 10};
  Twins twins(sizes, OptimizerKind::sgd);
  auto step = [&](std::int64_t tokens) {
    Data d = make_data(sizes.front(), sizes.back(), tokens, 7);
    const StepResult mpi = twins.on_mpi->train_step({d.x.view(), d.labels, {}});
    const StepResult local = twins.on_local->train_step({d.x.view(), d.labels, {}});
    EXPECT_EQ(mpi.loss, local.loss);
    // Commands, placements and replies on top of what the local fabric moves.
    EXPECT_GT(mpi.metrics.driver_bytes_sent, local.metrics.driver_bytes_sent);
    EXPECT_LT(mpi.metrics.driver_bytes_sent, local.metrics.driver_bytes_sent + 64 * 1024);
    return mpi.metrics;
  };
  const StepMetrics small = step(32), large = step(512);
  EXPECT_EQ(large.driver_bytes_received, small.driver_bytes_received);
  EXPECT_EQ(large.driver_bytes_sent - small.driver_bytes_sent,
            (512 - 32) * (sizes.front() * sizeof(float) + sizeof(int)));
  expect_same_models(twins.remote, twins.local);
}

// Engine ranks take batches from their own copy of the data set: rank 0 sends indices.
TEST(MpiFabric, SamplesByIndexMatchLocalFabric) {
  Twins twins({12, 20, 4}, OptimizerKind::adam);
  const Dataset& data = g_dataset;
  g_fabric->attach_dataset(&data);
  twins.local_fabric.attach_dataset(&data);
  const std::vector<std::int64_t> samples = {5, 81, 2, 2, 40, 17, 66, 9, 33, 70, 1};
  for (int step = 0; step < 3; ++step) {
    const StepResult a = twins.on_mpi->train_step_samples(samples);
    const StepResult b = twins.on_local->train_step_samples(samples);
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
  }
  expect_same_models(twins.remote, twins.local);
  g_fabric->attach_dataset(nullptr);
}

// bf16 layers stream their weights at half the bytes; the engines rebuild the chunks in
// bf16 and the gradients come back in fp32, as in-process.
TEST(MpiFabric, Bf16TrainingMatchesLocalFabric) {
  const std::vector<std::int64_t> sizes = {19, 33, 7};
  ExecutorOptions eo;
  eo.precisions = {Precision::bf16, Precision::fp32};  // one of each on the same fabric
  eo.chunk_packets = 11;
  Twins twins(sizes, OptimizerKind::adam, eo);
  LayerStreamingExecutor& on_mpi = *twins.on_mpi;
  LayerStreamingExecutor& on_local = *twins.on_local;
  for (int step = 0; step < 3; ++step) {
    Data d =
        make_data(sizes.front(), sizes.back(), 21 + step, 300 + static_cast<std::uint64_t>(step));
    const Batch batch{d.x.view(), d.labels, {}};
    const StepResult a = on_mpi.train_step(batch);
    const StepResult b = on_local.train_step(batch);
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
  }
  expect_same_models(twins.remote, twins.local);
}

TEST(MpiFabric, GradientsMatchLocalFabricWithGeluAndMse) {
  const std::vector<std::int64_t> sizes = {9, 31, 4};
  ExecutorOptions eo;
  eo.loss = Loss::mse;
  eo.activations = {Activation::gelu, Activation::none};
  Twins twins(sizes, OptimizerKind::sgd, eo);
  LayerStreamingExecutor& on_mpi = *twins.on_mpi;
  LayerStreamingExecutor& on_local = *twins.on_local;
  Data d = make_data(sizes.front(), sizes.back(), 37, 7);
  Batch batch{d.x.view(), {}, ConstMatrixView(d.targets.view())};
  double la = 0, lb = 0;
  const auto ga = on_mpi.gradients(batch, &la);
  const auto gb = on_local.gradients(batch, &lb);
  EXPECT_EQ(la, lb);
  ASSERT_EQ(ga.size(), gb.size());
  for (std::size_t l = 0; l < ga.size(); ++l) {
    EXPECT_EQ(ga[l].weights.col_indices(), gb[l].weights.col_indices());
    expect_same(ga[l].weights.values(), gb[l].weights.values(), "gradient " + std::to_string(l));
    expect_same(ga[l].bias, gb[l].bias, "bias gradient " + std::to_string(l));
  }
}

TEST(MpiFabric, InferenceAndEvaluationMatchLocalFabric) {
  const std::vector<std::int64_t> sizes = {6, 40, 40, 3};
  Twins twins(sizes, OptimizerKind::adam);
  LayerStreamingExecutor& on_mpi = *twins.on_mpi;
  LayerStreamingExecutor& on_local = *twins.on_local;
  Data d = make_data(sizes.front(), sizes.back(), 50, 3);
  const DenseMatrix ya = on_mpi.infer(d.x.view());
  const DenseMatrix yb = on_local.infer(d.x.view());
  for (std::int64_t o = 0; o < ya.rows(); ++o) {
    for (std::int64_t t = 0; t < ya.cols(); ++t) EXPECT_EQ(ya(o, t), yb(o, t));
  }
  const Evaluation ea = on_mpi.evaluate({d.x.view(), d.labels, {}}, 16);
  const Evaluation eb = on_local.evaluate({d.x.view(), d.labels, {}}, 16);
  EXPECT_EQ(ea.loss, eb.loss);
  EXPECT_EQ(ea.accuracy, eb.accuracy);
}

TEST(MpiFabric, BadShapesAreRefusedBeforeAnythingIsSentAndTheFabricStaysUsable) {
  const std::int32_t engines = g_fabric->engine_count();
  CsrMatrix w = CsrMatrix::random(4, 6, 0.5, 1);
  w.fill_values(2, 1.0F);
  const WeightStream stream = encode_stream(w);
  const Placement placement = round_robin_placement(w, 1);
  std::vector<DenseMatrix> x, y;
  std::vector<const Placement*> ps;
  std::vector<ConstMatrixView> xs;
  std::vector<MutableMatrixView> ys;
  for (std::int32_t k = 0; k < engines; ++k) {
    x.emplace_back(6, 3);
    x.back().fill(1.0F);
    y.emplace_back(5, 3);  // one row too many
  }
  for (std::int32_t k = 0; k < engines; ++k) {
    ps.push_back(&placement);
    xs.push_back(x[static_cast<std::size_t>(k)].view());
    ys.push_back(y[static_cast<std::size_t>(k)].view());
  }
  MemoryStreamSource bad(stream);
  EXPECT_THROW(g_fabric->forward(bad, ps, xs, ys), ShapeError);
  // Right shapes now: Y = W X with X all ones is W's row sums.
  for (std::int32_t k = 0; k < engines; ++k) {
    y[static_cast<std::size_t>(k)] = DenseMatrix(4, 3);
    ys[static_cast<std::size_t>(k)] = y[static_cast<std::size_t>(k)].view();
  }
  MemoryStreamSource good(stream);
  g_fabric->forward(good, ps, xs, ys);
  for (std::int32_t k = 0; k < engines; ++k) {
    for (std::int64_t o = 0; o < 4; ++o) {
      double sum = 0;
      for (std::int64_t j = w.row_offsets()[o]; j < w.row_offsets()[o + 1]; ++j) {
        sum += w.values()[static_cast<std::size_t>(j)];
      }
      for (std::int64_t t = 0; t < 3; ++t) {
        EXPECT_NEAR(y[static_cast<std::size_t>(k)](o, t), sum, 1e-5);
      }
    }
  }
}

TEST(MpiFabric, ProbeEchoSumsEveryEnginesCopyOfTheStream) {
  const std::int32_t engines = g_fabric->engine_count();
  CsrMatrix w = CsrMatrix::random(37, 29, 0.7, 5);
  w.fill_values(6, 1.0F);
  const WeightStream stream = encode_stream(w, StreamKind::weights, 5);  // many chunks
  MemoryStreamSource sink_source(stream);
  EXPECT_EQ(g_fabric->probe(sink_source, false).weights.chunks.size(), 0U);
  MemoryStreamSource echo_source(stream);
  const ReducedGradient sum = g_fabric->probe(echo_source, true);
  EXPECT_EQ(sum.weights.header.kind, StreamKind::gradient);
  WeightStream as_weights = sum.weights;
  as_weights.header.kind = StreamKind::weights;
  const CsrMatrix decoded = decode_stream(as_weights);
  EXPECT_EQ(decoded.col_indices(), w.col_indices());
  for (std::size_t j = 0; j < w.values().size(); ++j) {
    float expected = w.values()[j];
    for (std::int32_t k = 1; k < engines; ++k) expected += w.values()[j];  // exact: small n
    EXPECT_NEAR(decoded.values()[j], expected, 1e-6F * std::fabs(expected));
  }
}

// n copies of v summed in reduce_gradients' pairwise tree order, as the fabric sums them.
float tree_sum(float v, std::int32_t n) {
  std::vector<float> parts(static_cast<std::size_t>(n), v);
  for (std::size_t d = 1; d < parts.size(); d *= 2) {
    for (std::size_t i = 0; i + d < parts.size(); i += 2 * d) parts[i] += parts[i + d];
  }
  return parts.front();
}

// Gradient values travel in segments of 2^18 floats, chunks end anywhere in them, and the
// shared window grows: a stream of ~600k weights in odd-sized chunks crosses all of that.
TEST(MpiFabric, ProbeEchoOfAStreamOfSeveralSegments) {
  const std::int32_t engines = g_fabric->engine_count();
  CsrMatrix w = CsrMatrix::random(601, 2003, 0.5, 12);
  w.fill_values(13, 1.0F);
  const WeightStream stream = encode_stream(w, StreamKind::weights, 10007);
  ASSERT_GT(stream.header.nnz, 2U * (1U << 18));
  for (int repeat = 0; repeat < 2; ++repeat) {  // the second reuses the buffers
    MemoryStreamSource source(stream);
    const ReducedGradient sum = g_fabric->probe(source, true);
    ASSERT_EQ(sum.weights.chunks.size(), stream.chunks.size());
    std::size_t wrong = 0;
    for (std::size_t c = 0; c < stream.chunks.size(); ++c) {
      const auto& sent = stream.chunks[c]->packets;
      const auto& got = sum.weights.chunks[c]->packets;
      ASSERT_EQ(got.size(), sent.size());
      for (std::size_t k = 0; k < sent.size(); ++k) {
        const float expected = is_control(sent[k]) ? 0.0F : tree_sum(sent[k].value, engines);
        if (got[k].tag != sent[k].tag || got[k].value != expected) ++wrong;
      }
    }
    EXPECT_EQ(wrong, 0U) << "repeat " << repeat;
  }
}

TEST(MpiFabric, ProbeEchoOfABf16StreamSumsItsWidenedValuesInFp32) {
  const std::int32_t engines = g_fabric->engine_count();
  CsrMatrix w = CsrMatrix::random(23, 41, 0.6, 8);
  w.fill_values(9, 1.0F);
  const WeightStream stream = encode_stream(w, StreamKind::weights, 6, Precision::bf16);
  ASSERT_EQ(stream.header.precision, Precision::bf16);
  MemoryStreamSource source(stream);
  const ReducedGradient sum = g_fabric->probe(source, true);
  EXPECT_EQ(sum.weights.header.precision, Precision::fp32);
  ASSERT_EQ(sum.weights.chunks.size(), stream.chunks.size());
  for (std::size_t c = 0; c < stream.chunks.size(); ++c) {
    const auto& sent = stream.chunks[c]->packets_bf16;
    const auto& got = sum.weights.chunks[c]->packets;
    ASSERT_EQ(got.size(), sent.size());
    for (std::size_t k = 0; k < sent.size(); ++k) {
      ASSERT_EQ(got[k].tag, tag_of(sent[k]));
      const float expected =
          is_control(sent[k]) ? 0.0F : value_of(sent[k]) * static_cast<float>(engines);
      EXPECT_EQ(got[k].value, expected);  // n equal bf16 values: exact in fp32
    }
  }
}

// --- the GPT (sluice/gpt.hpp) on the engine ranks' block stores --------------------------

namespace gpt = testing::gpt_reference;

// Issue #26 item 4 over MPI: the tiny GPT's loss and every layer's gradient against central
// differences of the float64 dense-masked reference (3 sequences: 2 engines take 1 and 2).
TEST(MpiFabricGpt, LossAndEveryGradientMatchTheFloat64Reference) {
  for (const std::int64_t blocks : {1, 2}) {
    SCOPED_TRACE(std::to_string(blocks) + " blocks");
    const GptConfig c = gpt::tiny_config(blocks);
    HostModelMemory memory;
    gpt::build_random_gpt(memory, c, 11);
    GptModel model(memory, *g_fabric, c);
    const TextBatch batch = gpt::random_batch(c, 3, 5);
    double loss = 0;
    const std::vector<LayerGradient> grads = model.gradients(batch, &loss);
    const double expected = gpt::reference_loss(gpt::reference_of(memory), c, batch);
    EXPECT_NEAR(loss, expected, 1e-5 * expected);
    EXPECT_NEAR(model.loss(batch), expected, 1e-5 * expected);
    gpt::expect_gradients_match(memory, c, batch, grads, 1e-5);
  }
}

// N engine ranks compute bit for bit what N local engines compute: steps, gradients, logits.
TEST(MpiFabricGpt, TrainingGradientsAndGenerationMatchLocalFabric) {
  const GptConfig c = gpt::tiny_config(2);
  HostModelMemory on_mpi, on_local;
  for (HostModelMemory* m : {&on_mpi, &on_local}) {
    gpt::build_random_gpt(*m, c, 23);
    m->set_optimizer({.kind = OptimizerKind::adam, .learning_rate = 1e-2});
  }
  LocalFabric local = make_local(g_fabric->engine_count());
  GptModel a(on_mpi, *g_fabric, c), b(on_local, local, c);
  for (std::uint32_t step = 0; step < 3; ++step) {
    const TextBatch batch = gpt::random_batch(c, 5, 40 + step);
    EXPECT_EQ(a.train_step(batch).loss, b.train_step(batch).loss) << "step " << step;
  }
  const TextBatch batch = gpt::random_batch(c, 4, 77);
  const std::vector<LayerGradient> ga = a.gradients(batch), gb = b.gradients(batch);
  ASSERT_EQ(ga.size(), gb.size());
  for (std::size_t l = 0; l < ga.size(); ++l) {
    ASSERT_EQ(ga[l].weights.values(), gb[l].weights.values()) << "layer " << l;
    ASSERT_EQ(ga[l].bias, gb[l].bias) << "layer " << l;
  }
  EXPECT_EQ(a.loss(batch), b.loss(batch));
  const std::vector<std::int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3};
  EXPECT_EQ(a.next_logits(prompt), b.next_logits(prompt));
  const std::string bytes = {'\x03', '\x01', '\x04'};  // inside the vocabulary of 32
  EXPECT_EQ(generate_text(a, bytes, 12, 0.8, 5), generate_text(b, bytes, 12, 0.8, 5));
}

// Dynamic sparsity on the GPT: RigL's scores run on the engine ranks' block stores (the
// tiles passed from engine to engine), SET's draws on rank 0; the masks and weights are
// those of a LocalFabric with as many engines, bit for bit.
TEST(MpiFabricGpt, DynamicSparsityMatchesLocalFabric) {
  const GptConfig c = gpt::tiny_config(1);
  for (const MaskUpdateRule rule : {MaskUpdateRule::rigl, MaskUpdateRule::set}) {
    DynamicSparsity d;
    d.rule = rule;
    d.update_every = 2;
    d.drop = 0.5;
    d.total_steps = 8;
    HostModelMemory on_mpi, on_local;
    for (HostModelMemory* m : {&on_mpi, &on_local}) {
      gpt::build_random_gpt(*m, c, 29);
      m->set_optimizer({.kind = OptimizerKind::adam, .learning_rate = 1e-2});
    }
    const HostModelMemory& start = on_local;
    const std::vector<std::uint32_t> head_before = start.weights(GptLayers(c).head).col_indices();
    LocalFabric local = make_local(g_fabric->engine_count());
    GptModel a(on_mpi, *g_fabric, c, d), b(on_local, local, c, d);
    for (std::uint32_t step = 0; step < 5; ++step) {
      const TextBatch batch = gpt::random_batch(c, 5, 60 + step);
      EXPECT_EQ(a.train_step(batch).loss, b.train_step(batch).loss)
          << to_string(rule) << " step " << step;
    }
    EXPECT_EQ(a.totals().mask_updates, 2) << to_string(rule);  // after steps 2 and 4
    EXPECT_NE(on_mpi.weights(GptLayers(c).head).col_indices(), head_before);
    for (std::int32_t l = 0; l < on_mpi.layer_count(); ++l) {
      EXPECT_EQ(on_mpi.weights(l).col_indices(), on_local.weights(l).col_indices()) << l;
      EXPECT_EQ(on_mpi.weights(l).values(), on_local.weights(l).values()) << l;
    }
  }
}

// Rank 0 streams a weight with an input index out of range: the engine ranks' validation
// throws inside serve(), which must end every rank.
void send_corrupt_stream() {
  const std::int32_t engines = g_fabric->engine_count();
  CsrMatrix w = CsrMatrix::random(4, 6, 0.5, 1);
  WeightStream stream = encode_stream(w);
  auto chunk = std::make_shared<StreamChunk>(*stream.chunks.front());
  chunk->packets.front().tag = 1000;  // inputs are 6
  stream.chunks.front() = chunk;
  const Placement placement = round_robin_placement(w, 1);
  DenseMatrix x(6, 2), y(4, 2);
  std::vector<const Placement*> ps(static_cast<std::size_t>(engines), &placement);
  std::vector<ConstMatrixView> xs(static_cast<std::size_t>(engines), x.view());
  std::vector<MutableMatrixView> ys(static_cast<std::size_t>(engines), y.view());
  MemoryStreamSource source(stream);
  g_fabric->forward(source, ps, xs, ys);
}

}  // namespace
}  // namespace sluice

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  bool inject = false, shared_memory = true;
  for (int i = 1; i < argc; ++i) {
    inject = inject || std::string(argv[i]) == "--inject-corrupt-stream";
    shared_memory = shared_memory && std::string(argv[i]) != "--no-shared-memory";
  }
  int result = 0;
  try {
    sluice::MpiFabricOptions options;
    options.engine.threads = sluice::kThreads;
    options.engine.geometry.shares = sluice::kShares;
    options.window = 3;
    // Small frames: the larger streams take tens of them, so the frames in flight are
    // reused many times over.
    options.frame_bytes = std::size_t{128} << 10;
    options.shared_memory = shared_memory;
    sluice::MpiFabric fabric(options);
    if (rank == 0) {
      sluice::g_fabric = &fabric;
      if (inject) {
        sluice::send_corrupt_stream();
        std::fprintf(stderr, "rank 0: the corrupt stream was not refused\n");
        result = 3;
      } else {
        ::testing::InitGoogleTest(&argc, argv);
        result = RUN_ALL_TESTS();
      }
      fabric.stop();
    } else {
      fabric.attach_dataset(&sluice::g_dataset);
      fabric.serve();
    }
  } catch (const std::exception& e) {
    sluice::abort_all_ranks(e);
  }
  MPI_Bcast(&result, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return result;
}
