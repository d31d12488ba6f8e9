// Dynamic sparsity on the GPT (issue #29 item 3): SET and RigL change the masks of the
// sparse layers (Q, K, V, O, up, down, LM head) and never those of the dense parameters;
// every layer keeps its non-zeros; runs are deterministic and the same on 1 and 2 engines;
// RigL grows where the dense gradient of the update step is largest, against a reference
// model whose sparse layers are full with zeros off the mask (its gradients are the dense
// gradient); a checkpoint resumes the schedule as an uninterrupted run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "sluice/gpt.hpp"
#include "sluice/tiered_model_memory.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::active_positions;

GptConfig small_config() {
  GptConfig c;
  c.vocab = 256;
  c.context = 8;
  c.d_model = 16;
  c.heads = 2;
  c.blocks = 1;
  c.sparsity = 0.75;
  return c;
}

/// Bytes from a small alphabet in a seeded order: enough structure for gradients that
/// differ between positions.
TextCorpus small_corpus() {
  std::string s;
  std::uint64_t x = 7;
  for (int i = 0; i < 4000; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    s += "abcdefgh ."[(x >> 35) % 10];
  }
  return TextCorpus(std::move(s), small_config().context);
}

DynamicSparsity schedule(MaskUpdateRule rule, std::int64_t total_steps) {
  DynamicSparsity d;
  d.rule = rule;
  d.update_every = 2;
  d.drop = 0.5;
  d.update_until = 0.75;
  d.total_steps = total_steps;
  d.seed = 11;
  return d;
}

void build(ModelMemory& memory) {
  build_gpt(memory, small_config(), 3);
  OptimizerConfig opt;
  opt.kind = OptimizerKind::adam;
  opt.learning_rate = 2e-3;
  memory.set_optimizer(opt);
}

/// Trains steps [first, last) of the shared batch order on `engines` engines.
StepMetrics train(HostModelMemory& memory, const DynamicSparsity& d, std::int32_t engines,
                  int first, int last) {
  static const TextCorpus corpus = small_corpus();
  LocalFabricOptions fo;
  fo.engines = engines;
  fo.engine.threads = 1;
  LocalFabric fabric(fo);
  GptModel model(memory, fabric, gpt_config_of(memory), d);
  for (int step = first; step < last; ++step) {
    EXPECT_TRUE(
        model.train_step(corpus.sample(4, 5, static_cast<std::uint64_t>(step))).report.applied);
  }
  return model.totals();
}

TEST(GptDynamic, SparseLayersChangeMasksKeepNonZerosAndAgreeOverEngines) {
  HostModelMemory initial;
  build(initial);
  const GptLayers layers(small_config());
  const std::vector<std::int32_t> sparse = layers.sparse();
  ASSERT_EQ(sparse.size(), 7U);  // Q, K, V, O, up, down of one block, the head
  for (MaskUpdateRule rule : {MaskUpdateRule::set, MaskUpdateRule::rigl}) {
    const DynamicSparsity d = schedule(rule, 8);  // updates after steps 2 and 4 (< 6)
    HostModelMemory one, again, two;
    for (HostModelMemory* m : {&one, &again, &two}) build(*m);
    const StepMetrics totals = train(one, d, 1, 0, 8);
    train(again, d, 1, 0, 8);
    train(two, d, 2, 0, 8);
    EXPECT_EQ(totals.mask_updates, 2) << to_string(rule);
    EXPECT_GT(totals.mask_update_seconds, 0) << to_string(rule);
    EXPECT_EQ(totals.mask_score_seconds > 0, rule == MaskUpdateRule::rigl) << to_string(rule);
    for (std::int32_t l = 0; l < layers.count; ++l) {
      const CsrMatrix& start = initial.weights(l);
      const bool is_sparse = std::count(sparse.begin(), sparse.end(), l) > 0;
      SCOPED_TRACE(std::string(to_string(rule)) + " layer " + std::to_string(l));
      EXPECT_EQ(one.weights(l).nnz(), start.nnz());
      if (is_sparse) {
        EXPECT_NE(one.weights(l).col_indices(), start.col_indices()) << "never changed";
      } else {
        EXPECT_EQ(one.weights(l).col_indices(), start.col_indices());
        EXPECT_EQ(one.weights(l).row_offsets(), start.row_offsets());
      }
      // Deterministic: the same run again, bit for bit.
      EXPECT_EQ(one.weights(l).col_indices(), again.weights(l).col_indices());
      EXPECT_EQ(one.weights(l).values(), again.weights(l).values());
      // The same masks over two engines.
      EXPECT_EQ(one.weights(l).row_offsets(), two.weights(l).row_offsets());
      EXPECT_EQ(one.weights(l).col_indices(), two.weights(l).col_indices());
    }
  }
  // Rule none changes no mask; set and rigl grow different positions.
  HostModelMemory none, set, rigl;
  for (HostModelMemory* m : {&none, &set, &rigl}) build(*m);
  EXPECT_EQ(train(none, schedule(MaskUpdateRule::none, 8), 1, 0, 4).mask_updates, 0);
  train(set, schedule(MaskUpdateRule::set, 8), 1, 0, 4);
  train(rigl, schedule(MaskUpdateRule::rigl, 8), 1, 0, 4);
  EXPECT_EQ(none.weights(layers.head).col_indices(), initial.weights(layers.head).col_indices());
  EXPECT_NE(set.weights(layers.head).col_indices(), rigl.weights(layers.head).col_indices());
}

TEST(GptDynamic, RiglGrowsWhereTheDenseGradientIsLargest) {
  static const TextCorpus corpus = small_corpus();
  const GptConfig c = small_config();
  const GptLayers layers(c);
  const DynamicSparsity d = schedule(MaskUpdateRule::rigl, 8);
  for (std::int32_t engines : {1, 2}) {
    SCOPED_TRACE(std::to_string(engines) + " engines");
    HostModelMemory memory;
    build(memory);
    train(memory, d, engines, 0, 1);  // the update comes after step 2
    // The reference: the same model with every sparse layer full, zeros off the mask, so
    // that its gradients are the dense gradient dY X^T everywhere.
    HostModelMemory full;
    for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
      const CsrMatrix& w = memory.weights(l);
      CsrMatrix f = CsrMatrix::random(w.rows(), w.cols(), 0.0, 1);
      const DenseMatrix dense = w.to_dense();
      std::size_t i = 0;
      for (std::int64_t r = 0; r < w.rows(); ++r) {
        for (std::int64_t col = 0; col < w.cols(); ++col) f.values()[i++] = dense(r, col);
      }
      full.add_layer(std::move(f), memory.bias(l));
    }
    full.model = memory.model;
    LocalFabric fabric;
    GptModel reference(full, fabric, c);
    const TextBatch batch = corpus.sample(4, 5, 1);
    const std::vector<LayerGradient> g = reference.gradients(batch);

    std::vector<std::set<std::int64_t>> before;
    for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
      before.push_back(active_positions(memory.weights(l)));
    }
    train(memory, d, engines, 1, 2);  // step 2: scored, then the masks change
    for (const std::int32_t l : layers.sparse()) {
      SCOPED_TRACE("layer " + std::to_string(l));
      const auto& was = before[static_cast<std::size_t>(l)];
      const CsrMatrix& dense_gradient = g[static_cast<std::size_t>(l)].weights;
      const std::int64_t cols = dense_gradient.cols();
      std::vector<std::pair<float, std::int64_t>> ranked;  // -|g|, position
      for (std::int64_t r = 0; r < dense_gradient.rows(); ++r) {
        for (std::int64_t col = 0; col < cols; ++col) {
          const std::int64_t p = r * cols + col;
          const float v = dense_gradient.values()[static_cast<std::size_t>(p)];
          if (was.count(p) == 0) ranked.push_back({-std::fabs(v), p});
        }
      }
      std::sort(ranked.begin(), ranked.end());
      const std::int64_t k =
          d.swap_count(2, static_cast<std::int64_t>(was.size()), dense_gradient.rows() * cols);
      ASSERT_GT(k, 4);
      const auto after = active_positions(memory.weights(l));
      std::int64_t grown = 0;
      for (const std::int64_t p : after) grown += was.count(p) == 0 ? 1 : 0;
      EXPECT_EQ(grown, k);
      EXPECT_EQ(after.size(), was.size());
      // Clear winners only: a near-tie at the cut may go either way in float.
      const double cut = -ranked[static_cast<std::size_t>(k)].first;
      std::int64_t checked = 0;
      for (std::int64_t j = 0; j < k; ++j) {
        if (-ranked[static_cast<std::size_t>(j)].first > cut * (1 + 1e-3) + 1e-9) {
          EXPECT_EQ(after.count(ranked[static_cast<std::size_t>(j)].second), 1U) << "rank " << j;
          ++checked;
        }
      }
      EXPECT_GT(checked, k / 2);
    }
  }
}

class GptDynamicResume : public testing::TempDirTest {};

TEST_F(GptDynamicResume, ACheckpointGoesOnWithTheSchedule) {
  for (MaskUpdateRule rule : {MaskUpdateRule::set, MaskUpdateRule::rigl}) {
    SCOPED_TRACE(to_string(rule));
    const DynamicSparsity d = schedule(rule, 10);  // updates after 2, 4, 6
    HostModelMemory straight, first, resumed;
    build(straight);
    build(first);
    train(straight, d, 1, 0, 8);
    train(first, d, 1, 0, 3);
    first.dynamic = d;  // what the checkpoint keeps (DYNS)
    const auto path = dir_ / "gpt_dynamic.ck";
    first.save(path);
    resumed.load(path);
    ASSERT_EQ(resumed.dynamic.rule, rule);
    ASSERT_EQ(resumed.dynamic.total_steps, 10);
    train(resumed, resumed.dynamic, 1, 3, 8);
    for (std::int32_t l = 0; l < straight.layer_count(); ++l) {
      EXPECT_EQ(resumed.weights(l).col_indices(), straight.weights(l).col_indices()) << l;
      EXPECT_EQ(resumed.weights(l).values(), straight.weights(l).values()) << l;
    }
  }
}

// In a model store too small for the model (layers and transposed patterns evicted and read
// back), SET and RigL change the masks as in RAM: every step's loss and a held-out loss
// the same bits.
class GptDynamicStore : public testing::TempDirTest {};

TEST_F(GptDynamicStore, MasksChangeAsInRam) {
  static const TextCorpus corpus = small_corpus();
  LocalFabric fabric;
  auto run = [&](ModelMemory& memory, const DynamicSparsity& d) {
    build(memory);
    GptModel model(memory, fabric, gpt_config_of(memory), d);
    std::vector<double> losses;
    for (int step = 0; step < 6; ++step) {
      const GptStep s = model.train_step(corpus.sample(4, 5, static_cast<std::uint64_t>(step)));
      EXPECT_TRUE(s.report.applied);
      losses.push_back(s.loss);
    }
    EXPECT_EQ(model.totals().mask_updates, 2);  // after steps 2 and 4
    losses.push_back(model.loss(corpus.held_out_batch(0, 4)));
    return losses;
  };
  HostModelMemory shapes;
  build(shapes);
  std::int64_t largest = 0;
  for (std::int32_t l = 0; l < shapes.layer_count(); ++l) {
    largest = std::max(largest, TieredModelMemory::working_set_bytes(shapes.layer_shape(l)));
  }
  for (MaskUpdateRule rule : {MaskUpdateRule::set, MaskUpdateRule::rigl}) {
    SCOPED_TRACE(to_string(rule));
    const DynamicSparsity d = schedule(rule, 8);
    HostModelMemory in_ram;
    TieredModelMemory store(dir_ / to_string(rule), largest + largest / 8);
    EXPECT_EQ(run(store, d), run(in_ram, d));
    EXPECT_FALSE(store.by_input_from_ram());
    EXPECT_GT(store.counters().read_bytes, 0U);
  }
}

TEST(GptDynamic, AnInvalidScheduleIsRefused) {
  HostModelMemory memory;
  build(memory);
  LocalFabric fabric;
  DynamicSparsity d = schedule(MaskUpdateRule::rigl, 0);  // a rule needs a horizon
  EXPECT_THROW(GptModel(memory, fabric, small_config(), d), ArgumentError);
  d.total_steps = 8;
  d.drop = 0;
  EXPECT_THROW(GptModel(memory, fabric, small_config(), d), ArgumentError);
}

}  // namespace
}  // namespace sluice
