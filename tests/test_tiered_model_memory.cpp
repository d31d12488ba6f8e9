// TieredModelMemory trains bit for bit as HostModelMemory does: every optimizer, fp32 and
// bf16, one and two engines, with clipping, SET and RIGL mask updates, across a reopen; a
// layer of several update chunks, layers read into evicted pieces, a budget that streams the
// backward by output; and each step writes over the files the last commit left unnamed (no
// file created or freed a step). Its store's files, corrupt, locked and killed:
// test_model_store.cpp.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "optimizer_reference.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/tiered_model_memory.hpp"
#include "test_support.hpp"
#include "tiered_training.hpp"

namespace sluice {
namespace {

// The helpers of tiered_training.hpp, TempDirTest and thrown_message.
using namespace testing;

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

}  // namespace
}  // namespace sluice
