// TieredModelMemory: trains bit for bit as HostModelMemory does (every optimizer, fp32 and
// bf16, one and two engines, with clipping, SET and RIGL mask updates, across a reopen), survives
// SIGKILL at any moment at a committed step, writes each step over the files the last commit
// left unnamed (no file created or freed a step), refuses corrupt or missing files naming
// them and changes nothing, and refuses a budget smaller than a layer.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "optimizer_reference.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/tiered_model_memory.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::TempDirTest;
using testing::thrown_message;

const std::vector<std::int64_t> kSizes{12, 40, 33, 10};
constexpr std::int64_t kBatch = 16;

struct Data {
  std::vector<DenseMatrix> x;
  std::vector<std::vector<int>> labels;
};

Data make_data(int steps, std::uint64_t seed) {
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

OptimizerConfig config_of(OptimizerKind kind, double clip = 0) {
  OptimizerConfig c;
  c.kind = kind;
  c.learning_rate = 0.01;
  if (kind == OptimizerKind::sgd) c.momentum = 0.9;
  if (kind != OptimizerKind::adam) c.weight_decay = 1e-3;
  c.clip_global_norm = clip;
  return c;
}

/// Every layer's values (decoded from its stream) and bias.
std::vector<std::vector<float>> snapshot(const ModelMemory& m) {
  std::vector<std::vector<float>> out;
  for (std::int32_t l = 0; l < m.layer_count(); ++l) {
    out.push_back(decode_stream(m.stream(l)).values());
    out.push_back(m.bias(l));
  }
  return out;
}

void expect_bitwise_equal(const std::vector<std::vector<float>>& a,
                          const std::vector<std::vector<float>>& b, const std::string& where) {
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
ExecutorOptions trainer_options(Precision precision, DynamicSparsity dynamic, std::size_t layers,
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
std::int64_t tight_budget(const std::vector<LayerShape>& shapes, int engines) {
  std::int64_t most = 0;
  for (const LayerShape& s : shapes) most = std::max(most, TieredModelMemory::working_set_bytes(s));
  const ExecutorOptions eo = trainer_options(Precision::fp32, {}, shapes.size(), std::nullopt);
  return executor_least_ram_budget(shapes, eo, engines, most);
}

/// The same for kSizes' layers taken dense, the most they hold, and two engines at most.
std::int64_t tight_budget() {
  std::vector<LayerShape> shapes;
  for (std::size_t l = 0; l + 1 < kSizes.size(); ++l) {
    shapes.push_back({kSizes[l + 1], kSizes[l], kSizes[l + 1] * kSizes[l], kSizes[l + 1]});
  }
  return tight_budget(shapes, 2);
}

/// The shapes of the layers of `memory`.
std::vector<LayerShape> shapes_of(const ModelMemory& memory) {
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

struct Case {
  Precision precision;
  OptimizerKind kind;
  int engines;
  double clip;
};

class TrainsLikeHost : public TempDirTest, public ::testing::WithParamInterface<Case> {};

TEST_P(TrainsLikeHost, BitForBitAcrossStepsAndAReopen) {
  const Case c = GetParam();
  const Data data = make_data(5, 7);
  HostModelMemory host;
  build_sparse_mlp(host, kSizes, 0.5, 3);
  host.set_optimizer(config_of(c.kind, c.clip));
  const auto store = dir_ / "store";
  {
    TieredModelMemory tiered(store, tight_budget());
    tiered.set_optimizer(config_of(c.kind, c.clip));  // before the layers: no state to reset
    build_sparse_mlp(tiered, kSizes, 0.5, 3);
    expect_bitwise_equal(snapshot(host), snapshot(tiered), "built");
    Trainer tt(tiered, c.engines, c.precision);
    Trainer th(host, c.engines, c.precision, {}, kSizes.size() - 1, tt.order());
    for (int s = 0; s < 3; ++s) {
      const StepResult a = th.step(data, s), b = tt.step(data, s);
      ASSERT_TRUE(a.report.applied);
      ASSERT_TRUE(b.report.applied);
      EXPECT_EQ(a.loss, b.loss);
      EXPECT_EQ(b.report.step, s + 1);
      expect_bitwise_equal(snapshot(host), snapshot(tiered), "step " + std::to_string(s + 1));
    }
    const ModelStoreCounters k = tiered.counters();
    EXPECT_GT(k.read_bytes, 0U);
    EXPECT_GT(k.write_bytes, 0U);
    EXPECT_GT(k.store_bytes, 0U);
  }
  // Reopened with room for everything: the same model, optimizer state and step.
  TieredModelMemory reopened(store, std::int64_t{1} << 30);
  EXPECT_EQ(reopened.step(), 3);
  EXPECT_EQ(reopened.optimizer().kind, c.kind);
  expect_bitwise_equal(snapshot(host), snapshot(reopened), "reopened");
  Trainer tt(reopened, c.engines, c.precision);
  Trainer th(host, c.engines, c.precision, {}, kSizes.size() - 1, tt.order());
  for (int s = 3; s < 5; ++s) {
    th.step(data, s);
    tt.step(data, s);
    expect_bitwise_equal(snapshot(host), snapshot(reopened), "resumed step " + std::to_string(s));
  }
}

INSTANTIATE_TEST_SUITE_P(Tiered, TrainsLikeHost,
                         ::testing::Values(Case{Precision::fp32, OptimizerKind::sgd, 1, 0},
                                           Case{Precision::fp32, OptimizerKind::adam, 1, 0},
                                           Case{Precision::fp32, OptimizerKind::adamw, 2, 0},
                                           Case{Precision::bf16, OptimizerKind::adam, 2, 0},
                                           Case{Precision::bf16, OptimizerKind::sgd, 1, 0},
                                           Case{Precision::fp32, OptimizerKind::adamw, 1, 0.05},
                                           Case{Precision::bf16, OptimizerKind::adam, 2, 0.05}));

// A layer of more than one update chunk (kUpdateChunk, 2^21 non-zeros): its state is
// read, updated and written chunk by chunk, each section's CRC chained over the chunks;
// with clipping the gradient comes back from its file chunk by chunk too.
TEST_F(TempDirTest, ALayerOfSeveralUpdateChunksTrainsLikeHost) {
  const std::vector<std::int64_t> sizes{12, 2100, 2050, 10};  // 2.15M non-zeros at 50%
  const Data data = make_data(3, 13);
  for (const double clip : {0.0, 0.05}) {
    HostModelMemory host;
    host.set_optimizer(config_of(OptimizerKind::adamw, clip));
    build_sparse_mlp(host, sizes, 0.5, 5);
    const auto store = dir_ / ("store" + std::to_string(clip));
    TieredModelMemory tiered(store, std::int64_t{1} << 30);
    tiered.set_optimizer(config_of(OptimizerKind::adamw, clip));
    build_sparse_mlp(tiered, sizes, 0.5, 5);
    ASSERT_GT(tiered.layer_shape(1).nnz, std::int64_t{1} << 21);
    Trainer tt(tiered, 1, Precision::fp32);
    Trainer th(host, 1, Precision::fp32, {}, sizes.size() - 1, tt.order());
    for (int s = 0; s < 3; ++s) {
      th.step(data, s);
      tt.step(data, s);
      expect_bitwise_equal(snapshot(host), snapshot(tiered),
                           "clip " + std::to_string(clip) + ", step " + std::to_string(s + 1));
    }
  }
}

/// The inode of `path` (0 if it is missing).
ino_t inode_of(const std::filesystem::path& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 ? info.st_ino : 0;
}

/// Layer 1's state files in `store`, oldest generation first.
std::vector<std::filesystem::path> layer1_state_files(const std::filesystem::path& store) {
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::directory_iterator(store)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("layer-000001.g") && name.ends_with(".state")) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A step writes each layer's new state over the file of two generations before (which no
// manifest names since the last commit) and its spilled gradient over the last step's, so
// the store creates and frees no file a step; a file of another size (the optimizer's
// state grew or shrank) is cut to the new one. Closed, only the named files are left.
TEST_F(TempDirTest, AStepWritesOverTheFilesTheStoreNoLongerNames) {
  const Data data = make_data(8, 17);
  const double clip = 0.05;  // every layer's gradient spills until the commit
  HostModelMemory host;
  host.set_optimizer(config_of(OptimizerKind::adam, clip));
  build_sparse_mlp(host, kSizes, 0.5, 3);
  const auto store = dir_ / "store";
  {
    TieredModelMemory tiered(store, std::int64_t{1} << 30);
    tiered.set_optimizer(config_of(OptimizerKind::adam, clip));
    build_sparse_mlp(tiered, kSizes, 0.5, 3);
    auto trainers = std::make_unique<std::pair<Trainer, Trainer>>(
        std::piecewise_construct, std::forward_as_tuple(tiered, 1, Precision::fp32),
        std::forward_as_tuple(host, 1, Precision::fp32));
    ino_t committed_after_2 = 0, spill_after_2 = 0;
    for (int s = 0; s < 8; ++s) {
      if (s == 4 || s == 6) {  // Adam to SGD (one slot: smaller files), then back (larger)
        const OptimizerKind kind = s == 4 ? OptimizerKind::sgd : OptimizerKind::adam;
        trainers.reset();
        host.set_optimizer(config_of(kind, clip));
        tiered.set_optimizer(config_of(kind, clip));
        trainers = std::make_unique<std::pair<Trainer, Trainer>>(
            std::piecewise_construct, std::forward_as_tuple(tiered, 1, Precision::fp32),
            std::forward_as_tuple(host, 1, Precision::fp32));
      }
      const StepResult a = trainers->second.step(data, s), b = trainers->first.step(data, s);
      ASSERT_TRUE(b.report.applied);
      EXPECT_EQ(a.loss, b.loss) << "step " << s + 1;
      expect_bitwise_equal(snapshot(host), snapshot(tiered), "step " + std::to_string(s + 1));
      const std::vector<std::filesystem::path> states = layer1_state_files(store);
      ASSERT_EQ(states.size(), 2U) << "step " << s + 1;  // the committed one and a spare
      if (s == 1) {
        committed_after_2 = inode_of(states.back());
        spill_after_2 = inode_of(store / "layer-000001.gradient");
        ASSERT_NE(spill_after_2, 0U);
      }
      if (s == 3) {
        EXPECT_EQ(inode_of(states.back()), committed_after_2) << "not written over";
        EXPECT_EQ(inode_of(store / "layer-000001.gradient"), spill_after_2);
      }
    }
  }
  // Closed: the manifest, and a pattern and a state file per layer.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(store), {}),
            static_cast<std::ptrdiff_t>(1 + 2 * (kSizes.size() - 1)));
  TieredModelMemory reopened(store, std::int64_t{1} << 30);  // every file's size checked
  expect_bitwise_equal(snapshot(host), snapshot(reopened), "reopened");
}

// Layers of one shape under a budget that holds a layer's working set: every load after
// the first evictions reads into the arrays of a piece just evicted (of the same kind, or
// the other kind's offsets and indices), and the pattern is checked by its CRCs alone.
TEST_F(TempDirTest, LayersReadIntoEvictedPiecesTrainLikeHost) {
  const std::vector<std::int64_t> sizes{12, 48, 48, 48, 48, 10};
  const Data data = make_data(4, 21);
  std::vector<std::uint64_t> reads;
  HostModelMemory model;
  build_sparse_mlp(model, sizes, 0.3, 11);
  for (const std::int64_t budget : {tight_budget(shapes_of(model), 1), std::int64_t{1} << 30}) {
    HostModelMemory host;
    host.set_optimizer(config_of(OptimizerKind::adam));
    build_sparse_mlp(host, sizes, 0.3, 11);
    TieredModelMemory tiered(dir_ / ("store" + std::to_string(budget)), budget);
    tiered.set_optimizer(config_of(OptimizerKind::adam));
    build_sparse_mlp(tiered, sizes, 0.3, 11);
    Trainer tt(tiered, 1, Precision::fp32, {}, sizes.size() - 1);
    Trainer th(host, 1, Precision::fp32, {}, sizes.size() - 1, tt.order());
    for (int s = 0; s < 4; ++s) {
      const StepResult a = th.step(data, s), b = tt.step(data, s);
      EXPECT_EQ(a.loss, b.loss) << "step " << s + 1;
      expect_bitwise_equal(snapshot(host), snapshot(tiered),
                           "budget " + std::to_string(budget) + ", step " + std::to_string(s + 1));
    }
    reads.push_back(tiered.counters().read_bytes);
  }
  EXPECT_GT(reads[0], reads[1]);  // the tight budget read patterns again: it evicted
}

// A budget that holds one layer's working set, not the model's transposed patterns: the
// executor streams the backward by output, and the store reads no pattern for it, so a
// step reads fewer bytes than by input. With room for the model, or in a HostModelMemory,
// by input.
TEST_F(TempDirTest, ABudgetWithoutRoomForTheTransposesStreamsTheBackwardByOutput) {
  const std::vector<std::int64_t> sizes{12, 48, 48, 48, 48, 10};
  const std::size_t layers = sizes.size() - 1;
  const Data data = make_data(2, 9);
  HostModelMemory model;
  build_sparse_mlp(model, sizes, 0.3, 11);
  const std::int64_t tight = tight_budget(shapes_of(model), 1);
  std::vector<std::uint64_t> reads;
  for (const std::optional<StreamOrder> order :
       {std::optional<StreamOrder>(), std::optional<StreamOrder>(StreamOrder::by_input)}) {
    TieredModelMemory tiered(dir_ / (order ? "by_input" : "auto"), tight);
    build_sparse_mlp(tiered, sizes, 0.3, 11);
    Trainer t(tiered, 1, Precision::fp32, {}, layers, order);
    EXPECT_FALSE(tiered.by_input_from_ram());
    EXPECT_EQ(t.exec->backward_order(0), StreamOrder::by_output);  // the mask alone
    EXPECT_EQ(t.order(), order ? StreamOrder::by_input : StreamOrder::by_output);
    const std::uint64_t before = tiered.counters().read_bytes;
    for (int s = 0; s < 2; ++s) ASSERT_TRUE(t.step(data, s).report.applied);
    reads.push_back(tiered.counters().read_bytes - before);
  }
  EXPECT_LT(reads[0], reads[1]);

  TieredModelMemory roomy(dir_ / "roomy", std::int64_t{1} << 30);
  build_sparse_mlp(roomy, sizes, 0.3, 11);
  EXPECT_EQ(Trainer(roomy, 1, Precision::fp32, {}, layers).order(), StreamOrder::by_input);
  HostModelMemory host;
  build_sparse_mlp(host, sizes, 0.3, 11);
  EXPECT_TRUE(host.by_input_from_ram());
  EXPECT_EQ(Trainer(host, 1, Precision::fp32, {}, layers).order(), StreamOrder::by_input);
}

// With room for the model, an update leaves its new values in the cache: the steps after
// the first read each layer's optimizer state from the store and nothing else (no values
// read back after the commit), and train as HostModelMemory does. A discarded step's
// values are not kept.
TEST_F(TempDirTest, AStoreWithRoomReadsOnlyTheOptimizerStateAfterItsFirstStep) {
  const Data data = make_data(4, 5);
  for (const OptimizerKind kind : {OptimizerKind::sgd, OptimizerKind::adam}) {
    HostModelMemory host;
    host.set_optimizer(config_of(kind));
    build_sparse_mlp(host, kSizes, 0.5, 3);
    TieredModelMemory tiered(dir_ / to_string(kind), std::int64_t{1} << 30);
    tiered.set_optimizer(config_of(kind));
    build_sparse_mlp(tiered, kSizes, 0.5, 3);
    Trainer tt(tiered, 1, Precision::fp32);
    Trainer th(host, 1, Precision::fp32, {}, kSizes.size() - 1, tt.order());
    th.step(data, 0);
    tt.step(data, 0);
    std::uint64_t state_bytes = 0;
    for (std::int32_t l = 0; l < tiered.layer_count(); ++l) {
      state_bytes += 4 * static_cast<std::uint64_t>(tiered.layer_shape(l).nnz) *
                     (kind == OptimizerKind::sgd ? 1 : 2);
    }
    for (int s = 1; s < 3; ++s) {
      const std::uint64_t before = tiered.counters().read_bytes;
      th.step(data, s);
      tt.step(data, s);
      EXPECT_EQ(tiered.counters().read_bytes - before, state_bytes) << "step " << s + 1;
      expect_bitwise_equal(snapshot(host), snapshot(tiered), "step " + std::to_string(s + 1));
    }
    // Updates discarded: the values they left in the cache are dropped, the committed
    // ones read back.
    for (std::int32_t l = 0; l < tiered.layer_count(); ++l) {
      const CsrMatrix mask = decode_stream(tiered.stream(l, StreamKind::mask));
      const std::vector<float> g(static_cast<std::size_t>(mask.nnz()), 0.5F);
      tiered.submit_gradient(l, optimizer_reference::gradient_stream(mask, g), tiered.bias(l));
    }
    tiered.discard_step();
    expect_bitwise_equal(snapshot(host), snapshot(tiered), "discarded");
  }
}

/// Every layer's mask (row offsets and columns) and values, decoded from its stream.
std::vector<std::vector<std::int64_t>> masks(const ModelMemory& m) {
  std::vector<std::vector<std::int64_t>> out;
  for (std::int32_t l = 0; l < m.layer_count(); ++l) {
    const CsrMatrix w = decode_stream(m.stream(l, StreamKind::mask));
    out.push_back(w.row_offsets());
    out.emplace_back(w.col_indices().begin(), w.col_indices().end());
  }
  return out;
}

class MaskUpdatesLikeHost : public TempDirTest,
                            public ::testing::WithParamInterface<MaskUpdateRule> {};

// SET and RigL change the masks every other step: the store's masks, values and carried-
// over optimizer state (seen in the steps after) stay those of HostModelMemory, across a
// reopen, with a budget that makes the store evict between layers.
TEST_P(MaskUpdatesLikeHost, BitForBitAcrossUpdatesAndAReopen) {
  DynamicSparsity d;
  d.rule = GetParam();
  d.update_every = 2;
  d.drop = 0.4;
  d.update_until = 1;
  d.total_steps = 12;
  d.seed = 9;
  const Data data = make_data(8, 4);
  HostModelMemory host;
  build_sparse_mlp(host, kSizes, 0.6, 3);
  host.set_optimizer(config_of(OptimizerKind::adam));
  const auto store = dir_ / "store";
  const auto before = masks(host);
  {
    TieredModelMemory tiered(store, tight_budget());
    tiered.set_optimizer(config_of(OptimizerKind::adam));
    build_sparse_mlp(tiered, kSizes, 0.6, 3);
    Trainer tt(tiered, 2, Precision::fp32, d);
    Trainer th(host, 2, Precision::fp32, d, kSizes.size() - 1, tt.order());
    for (int s = 0; s < 7; ++s) {
      const StepResult a = th.step(data, s), b = tt.step(data, s);
      EXPECT_EQ(a.loss, b.loss) << "step " << s + 1;
      ASSERT_EQ(masks(host), masks(tiered)) << "step " << s + 1;
      expect_bitwise_equal(snapshot(host), snapshot(tiered), "step " + std::to_string(s + 1));
    }
    EXPECT_EQ(tt.exec->totals().mask_updates, 3);
    EXPECT_EQ(th.exec->totals().mask_updates, 3);
  }
  EXPECT_NE(masks(host), before);  // the masks did change
  {
    TieredModelMemory reopened(store, std::int64_t{1} << 30);
    ASSERT_EQ(masks(host), masks(reopened));
    expect_bitwise_equal(snapshot(host), snapshot(reopened), "reopened");
    Trainer tt(reopened, 1, Precision::fp32);
    Trainer th(host, 1, Precision::fp32, {}, kSizes.size() - 1, tt.order());
    for (int s = 7; s < 9; ++s) {
      th.step(data, s);
      tt.step(data, s);
      expect_bitwise_equal(snapshot(host), snapshot(reopened), "resumed step " + std::to_string(s));
    }
  }
  // Closed (a commit's old files go on a thread of their own, which closing waits for),
  // only the files the manifest names are left: one pattern and one state file per layer.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(store), {}),
            static_cast<std::ptrdiff_t>(1 + 2 * (kSizes.size() - 1)));
}

INSTANTIATE_TEST_SUITE_P(Tiered, MaskUpdatesLikeHost,
                         ::testing::Values(MaskUpdateRule::set, MaskUpdateRule::rigl),
                         [](const auto& info) { return std::string(to_string(info.param)); });

class TieredStore : public TempDirTest {
 protected:
  std::filesystem::path store() const { return dir_ / "store"; }
  /// A store of kSizes trained `steps` Adam steps.
  void make_store(int steps) {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    m.set_optimizer(config_of(OptimizerKind::adam));
    build_sparse_mlp(m, kSizes, 0.5, 3);
    Trainer t(m, 1, Precision::fp32);
    const Data d = make_data(steps, 7);
    for (int s = 0; s < steps; ++s) t.step(d, s);
  }
  std::map<std::string, std::string> files() const {
    std::map<std::string, std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(store())) {
      std::ifstream in(e.path(), std::ios::binary);
      out[e.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
    return out;
  }
  void write(const std::string& name, const std::string& bytes) const {
    std::ofstream(store() / name, std::ios::binary | std::ios::trunc) << bytes;
  }
  /// Writes `bytes` as `name` with one bit flipped at random; returns the byte's offset.
  std::size_t write_flipped(const std::string& name, const std::string& bytes,
                            std::mt19937_64& rng) const {
    std::string bad = bytes;
    const std::size_t at = rng() % bad.size();
    bad[at] = static_cast<char>(bad[at] ^ (1 << (rng() % 8)));
    write(name, bad);
    return at;
  }
};

TEST_F(TieredStore, EveryCorruptByteIsRefusedNamingTheFileAndNothingChanges) {
  make_store(2);
  const auto good = files();
  EXPECT_EQ(good.size(), 1U + 2 * (kSizes.size() - 1));  // MANIFEST, pattern and state per layer
  std::mt19937_64 rng(5);
  for (const auto& [name, bytes] : good) {
    for (int trial = 0; trial < 12; ++trial) {
      const std::size_t at = write_flipped(name, bytes, rng);
      std::string message;
      try {
        TieredModelMemory m(store(), std::int64_t{1} << 30);
        ADD_FAILURE() << name << ": byte " << at << " flipped, and the store opened";
      } catch (const FormatError& e) {
        message = e.what();
      } catch (const IoError& e) {
        message = e.what();
      }
      EXPECT_CONTAINS(message, name);
      EXPECT_CONTAINS(message, "byte");
      auto now = files();
      now[name] = bytes;
      EXPECT_EQ(now, good) << "a refused open changed the store (" << name << ")";
      write(name, bytes);
    }
    // Truncated, and missing.
    write(name, bytes.substr(0, bytes.size() / 2));
    EXPECT_ANY_THROW(TieredModelMemory(store(), std::int64_t{1} << 30)) << name;
    std::filesystem::remove(store() / name);
    std::string message;
    try {
      TieredModelMemory m(store(), std::int64_t{1} << 30);
      if (name != "MANIFEST") ADD_FAILURE() << name << " missing, and the store opened";
    } catch (const Error& e) {
      message = e.what();
    }
    if (name != "MANIFEST") EXPECT_CONTAINS(message, name);
    write(name, bytes);
  }
  TieredModelMemory m(store(), std::int64_t{1} << 30);
  EXPECT_EQ(m.step(), 2);
}

// A pattern file is checked in full when the store opens; a layer evicted and read again
// is checked by its CRCs, which still refuse any changed byte, naming the file and the byte,
// and leave the layer to be read again once the file is whole — also when its values (from
// the state file) are what fails: the failed load keeps none of what it read.
TEST_F(TieredStore, AFileCorruptedAfterTheOpenIsRefusedWhenReadAgain) {
  const CsrMatrix layer = CsrMatrix::random(64, 64, 0.5, 1);
  const LayerShape shape{64, 64, layer.nnz(), 64};
  TieredModelMemory m(store(), TieredModelMemory::working_set_bytes(shape));
  for (int l = 0; l < 4; ++l) m.add_layer(layer, std::vector<float>(64));
  auto by_input = [&](std::int32_t l) {
    return m.stream(l, StreamKind::weights, Precision::fp32, StreamOrder::by_input);
  };
  const WeightStream expected = by_input(0);
  for (std::int32_t l = 1; l < 4; ++l) by_input(l);  // layer 0's pieces are evicted
  const std::string name = "layer-000000.pattern";
  const std::string bytes = files().at(name);
  std::mt19937_64 rng(8);
  for (int trial = 0; trial < 24; ++trial) {
    const std::size_t at = write_flipped(name, bytes, rng);
    std::string message;
    try {
      by_input(0);
      ADD_FAILURE() << "byte " << at << " flipped, and the layer was read";
    } catch (const FormatError& e) {
      message = e.what();
    }
    EXPECT_CONTAINS(message, name);
    EXPECT_CONTAINS(message, "byte");
  }
  write(name, bytes);
  // The values come from the state file: a changed byte of them is refused the same way,
  // and the load that failed leaves nothing behind in the cache.
  std::string state;
  for (const auto& [file, content] : files()) {
    if (file.rfind("layer-000000.", 0) == 0 && file.ends_with(".state")) state = file;
  }
  ASSERT_FALSE(state.empty());
  const std::string state_bytes = files().at(state);
  const std::size_t values_at = state_bytes.find("VALS") + 16;  // tag, length, CRC
  ASSERT_LT(values_at + 4 * static_cast<std::size_t>(layer.nnz()), state_bytes.size());
  for (int trial = 0; trial < 4; ++trial) {
    std::string bad = state_bytes;
    const std::size_t at = values_at + rng() % (4 * static_cast<std::size_t>(layer.nnz()));
    bad[at] = static_cast<char>(bad[at] ^ 0x10);
    for (std::int32_t l = 1; l < 4; ++l) by_input(l);  // layer 0's pieces are evicted
    write(state, bad);
    EXPECT_CONTAINS(thrown_message<FormatError>([&] { by_input(0); }), state);
    write(state, state_bytes);
    ASSERT_EQ(decode_stream(by_input(0)).values(), decode_stream(expected).values()) << trial;
  }
  EXPECT_EQ(decode_stream(by_input(0)).values(), decode_stream(expected).values());
  EXPECT_EQ(decode_stream(by_input(0)).col_indices(), decode_stream(expected).col_indices());
}

TEST_F(TieredStore, AStoreIsOpenInOneProcessAndObjectAtATime) {
  make_store(2);
  const auto before = files();
  auto refused = [&] {
    try {
      TieredModelMemory second(store(), std::int64_t{1} << 30);
    } catch (const IoError& e) {
      return std::string(e.what()).find("is open in another process") != std::string::npos;
    }
    return false;
  };
  {
    TieredModelMemory first(store(), std::int64_t{1} << 30);
    EXPECT_TRUE(refused());
    // Another process: it would take this one's uncommitted files for leftovers.
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) _exit(refused() ? 0 : 1);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    EXPECT_EQ(first.layer_count(), static_cast<std::int32_t>(kSizes.size()) - 1);
  }
  EXPECT_EQ(files(), before);
  TieredModelMemory again(store(), std::int64_t{1} << 30);  // free once the first is gone
  EXPECT_EQ(again.layer_count(), static_cast<std::int32_t>(kSizes.size()) - 1);
  // A file where the store's directory should be.
  write("not-a-store", "x");
  EXPECT_THROW(TieredModelMemory(store() / "not-a-store", std::int64_t{1} << 30), IoError);
}

TEST_F(TieredStore, ABudgetSmallerThanALayerIsRefused) {
  {
    TieredModelMemory m(store(), 4096);
    const std::string message = thrown_message<ResourceError>(
        [&] { m.add_layer(CsrMatrix::random(64, 64, 0.5, 1), std::vector<float>(64)); });
    EXPECT_CONTAINS(message, "budget");
    EXPECT_EQ(m.layer_count(), 0);
  }
  make_store(1);
  const std::string message =
      thrown_message<ResourceError>([&] { TieredModelMemory m(store(), 4096); });
  EXPECT_CONTAINS(message, "layer 0");
  EXPECT_CONTAINS(message, "budget");
  EXPECT_THROW(TieredModelMemory(store(), 0), ArgumentError);
}

// The trainer's reserve (ModelMemory::reserve_ram_bytes) comes out of the cache: a layer
// that fitted beside the others is evicted and read again. It never takes a layer's
// working set: a reserve that would is refused, and so is a layer added that does not fit
// beside the reserve.
TEST_F(TieredStore, TheTrainersReserveComesOutOfTheCacheAndOneLeavingNoLayerRoomIsRefused) {
  const CsrMatrix layer = CsrMatrix::random(64, 64, 0.5, 1);
  const LayerShape shape{64, 64, layer.nnz(), 64};
  const std::int64_t ws = TieredModelMemory::working_set_bytes(shape);
  TieredModelMemory m(store(), 3 * ws);  // every layer's mask, values and transpose fit
  for (int l = 0; l < 3; ++l) m.add_layer(layer, std::vector<float>(64));
  auto reads = [&] { return m.counters().read_bytes; };
  auto stream_all = [&] {
    for (std::int32_t l = 0; l < 3; ++l) {
      m.stream(l, StreamKind::weights, Precision::fp32, StreamOrder::by_input);
    }
  };
  stream_all();
  const std::uint64_t cached = reads();
  stream_all();
  EXPECT_EQ(reads(), cached);   // all three held
  m.reserve_ram_bytes(2 * ws);  // room for two layers' pieces, not three
  stream_all();
  EXPECT_GT(reads(), cached);
  m.reserve_ram_bytes(0);
  stream_all();
  const std::uint64_t again = reads();
  stream_all();
  EXPECT_EQ(reads(), again);
  // A reserve that leaves no layer's working set room would put the process over the
  // budget: refused, naming the least budget that holds both, and the old one stays.
  const std::string message =
      thrown_message<ResourceError>([&] { m.reserve_ram_bytes(2 * ws + 1); });
  EXPECT_CONTAINS(message, "needs at least " + std::to_string(3 * ws + 1));
  EXPECT_CONTAINS(message, "layer 0's working set (" + std::to_string(ws) + " bytes)");
  stream_all();
  EXPECT_EQ(reads(), again);
  m.reserve_ram_bytes(2 * ws);  // exactly what leaves one working set
  EXPECT_NO_THROW(stream_all());
  EXPECT_EQ(m.ram_budget_bytes(), 3 * ws);
  // A layer added later must fit beside the reserve too: a denser one does not.
  const std::string denser = thrown_message<ResourceError>(
      [&] { m.add_layer(CsrMatrix::random(64, 64, 0.25, 2), std::vector<float>(64)); });
  EXPECT_CONTAINS(denser, "of which a trainer holds " + std::to_string(2 * ws));
  EXPECT_EQ(m.layer_count(), 3);
}

TEST_F(TieredStore, SaveAndLoadSayTheStoreIsTheCheckpoint) {
  TieredModelMemory m(store(), 1 << 20);
  EXPECT_CONTAINS(thrown_message<UnsupportedError>([&] { m.save(dir_ / "x.ckpt"); }),
                  "own checkpoint");
  EXPECT_THROW(m.load(dir_ / "x.ckpt"), UnsupportedError);
  EXPECT_THROW(m.weights(0), ArgumentError);
}

// What a trainer resuming from the store needs besides the model, as a checkpoint keeps it.
TEST_F(TieredStore, StepEpochsSeedAndOptimizerAreCommittedWithTheStore) {
  make_store(3);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.step(), 3);
    EXPECT_EQ(m.seed, 0U);
    EXPECT_EQ(m.epochs, 0);
    m.epochs = 4;
    m.seed = 11;
    m.commit_counters();
    OptimizerConfig c;
    c.kind = OptimizerKind::adamw;
    c.learning_rate = 0.003;
    c.weight_decay = 0.01;
    m.set_optimizer(c);
  }
  TieredModelMemory m(store(), std::int64_t{1} << 30);
  EXPECT_EQ(m.epochs, 4);
  EXPECT_EQ(m.seed, 11U);
  EXPECT_EQ(m.step(), 3);
  EXPECT_EQ(m.optimizer().kind, OptimizerKind::adamw);
  EXPECT_EQ(m.optimizer().learning_rate, 0.003);
  EXPECT_EQ(m.optimizer().weight_decay, 0.01);
}
TEST_F(TieredStore, TheSchedulesModelClassesScalingAndDataAreCommittedAndOlderManifestsHaveNone) {
  make_store(1);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::none);
    EXPECT_FALSE(m.optimizer().decay.active());
    EXPECT_EQ(m.model, "");
    m.model = "gpt vocab=256 (a description)";
    m.class_names = {"cat", "dog"};
    m.input_mean = {-3.0};
    m.input_scale = {0.125};
    m.training_data = "synthetic";
    m.dynamic.rule = MaskUpdateRule::set;
    m.dynamic.drop = 0.25;
    m.dynamic.total_steps = 40;
    m.dynamic.seed = 8;
    m.commit_counters();
    OptimizerConfig c = m.optimizer();
    c.decay = {5, 30, 0.2};
    m.set_optimizer(c);
  }
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::set);
    EXPECT_EQ(m.dynamic.drop, 0.25);
    EXPECT_EQ(m.dynamic.total_steps, 40);
    EXPECT_EQ(m.dynamic.seed, 8U);
    EXPECT_EQ(m.optimizer().decay, (LearningRateDecay{5, 30, 0.2}));
    EXPECT_EQ(m.model, "gpt vocab=256 (a description)");
    EXPECT_EQ(m.class_names, (std::vector<std::string>{"cat", "dog"}));
    EXPECT_EQ(m.input_mean, std::vector<double>{-3.0});
    EXPECT_EQ(m.input_scale, std::vector<double>{0.125});
    EXPECT_EQ(m.training_data, "synthetic");
    m.model = std::string(1, '\n');  // no manifest holds it: refused, nothing written
    EXPECT_THROW(m.commit_counters(), ShapeError);
    m.model = "gpt vocab=256 (a description)";
    m.class_names = {"cat", "cat"};  // nor these
    EXPECT_THROW(m.commit_counters(), ShapeError);
    m.class_names = {"cat", "dog"};
    m.training_data = std::string("a\0b", 3);  // nor this
    EXPECT_THROW(m.commit_counters(), ShapeError);
  }
  // Version 6 wrote no training data: it opens as none; version 5 no class names or input
  // scaling either, version 4 no model section (a stack of layers), version 3 no decay
  // section, version 2 no schedule.
  std::string bytes = files()["MANIFEST"];
  const std::size_t data = bytes.find("DATA");
  ASSERT_NE(data, std::string::npos);
  bytes.erase(data, 16 + 9);
  std::uint32_t version = 6;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.training_data, "");
    EXPECT_EQ(m.class_names, (std::vector<std::string>{"cat", "dog"}));
  }
  const std::size_t names = bytes.find("CLAS");
  ASSERT_NE(names, std::string::npos);
  bytes.erase(names, 16 + 8 + 16 + 8 + 16);
  version = 5;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_TRUE(m.class_names.empty());
    EXPECT_TRUE(m.input_mean.empty() && m.input_scale.empty());
    EXPECT_EQ(m.model, "gpt vocab=256 (a description)");
  }
  const std::size_t model = bytes.find("MODL");
  ASSERT_NE(model, std::string::npos);
  bytes.erase(model, 16 + 29);
  version = 4;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.model, "");
    EXPECT_EQ(m.optimizer().decay, (LearningRateDecay{5, 30, 0.2}));
  }
  const std::size_t decay = bytes.find("LRDC");
  ASSERT_NE(decay, std::string::npos);
  bytes.erase(decay, 16 + 24);
  version = 3;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.optimizer().decay, LearningRateDecay{});
    EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::set);
  }
  const std::size_t at = bytes.find("DYNS");
  ASSERT_NE(at, std::string::npos);
  bytes.erase(at, 16 + 44);
  version = 2;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  TieredModelMemory m(store(), std::int64_t{1} << 30);
  EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::none);
  EXPECT_EQ(m.step(), 1);
}

// A child trains on the store and is killed with SIGKILL at a random moment; the store
// must open at a committed step whose weights are exactly the reference's after as many
// steps, with nothing left over from the step that was cut short.
// Every other round clips, so that the gradients are spilled to files until the commit
// (and written over the last step's spills).
TEST_F(TieredStore, KilledAtARandomMomentOpensAtACommittedStep) {
  constexpr int kMaxSteps = 60;
  const Data data = make_data(kMaxSteps, 11);
  const std::array<double, 2> clips{0.0, 0.05};
  std::array<std::vector<std::vector<std::vector<float>>>, 2> references;
  for (std::size_t c = 0; c < clips.size(); ++c) {
    HostModelMemory host;
    host.set_optimizer(config_of(OptimizerKind::adamw, clips[c]));
    build_sparse_mlp(host, kSizes, 0.5, 3);
    Trainer t(host, 1, Precision::fp32);
    references[c].push_back(snapshot(host));
    for (int s = 0; s < kMaxSteps; ++s) {
      t.step(data, s);
      references[c].push_back(snapshot(host));
    }
  }
  std::mt19937_64 rng(99);
  int mid_run = 0;
  for (int round = 0; round < 12; ++round) {
    const auto& reference = references[static_cast<std::size_t>(round % 2)];
    const double clip = clips[static_cast<std::size_t>(round % 2)];
    std::filesystem::remove_all(store());
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      try {
        TieredModelMemory m(store(), tight_budget());
        m.set_optimizer(config_of(OptimizerKind::adamw, clip));
        build_sparse_mlp(m, kSizes, 0.5, 3);
        Trainer t(m, 1, Precision::fp32);
        for (int s = 0; s < kMaxSteps; ++s) t.step(data, s);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    ::usleep(static_cast<useconds_t>(2000 + rng() % 150000));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    if (WIFSIGNALED(status)) ++mid_run;
    if (!std::filesystem::exists(store() / "MANIFEST")) continue;  // killed before creating it
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    const std::int64_t step = m.step();
    ASSERT_LE(step, kMaxSteps);
    if (m.layer_count() < static_cast<std::int32_t>(kSizes.size()) - 1) {
      EXPECT_EQ(step, 0);  // killed while the layers were being added
      continue;
    }
    expect_bitwise_equal(reference[static_cast<std::size_t>(step)], snapshot(m),
                         "round " + std::to_string(round) + ", step " + std::to_string(step));
    EXPECT_EQ(files().size(), 1U + 2 * (kSizes.size() - 1)) << "leftovers not removed";
  }
  EXPECT_GT(mid_run, 0) << "no child was killed mid-run";
}

}  // namespace
}  // namespace sluice
