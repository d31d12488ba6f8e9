// Dynamic sparsity: the schedule, prune and regrow on one layer against a plain dense
// reference, SET's draws, and RigL's streaming top-k against a dense top-k.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <set>

#include "engine/gradient_top_k.hpp"
#include "model_memory/mask_update.hpp"
#include "sluice/dataset.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"
#include "sluice/isa.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/stream.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::active_positions;
using testing::thrown_message;

CsrMatrix layer(std::int64_t rows, std::int64_t cols, double sparsity, std::uint64_t seed) {
  CsrMatrix w = CsrMatrix::random(rows, cols, sparsity, seed);
  w.fill_values(seed + 1);
  return w;
}

TEST(DynamicSparsitySchedule, CosineDecayWithinTheWindow) {
  DynamicSparsity d;
  d.rule = MaskUpdateRule::rigl;
  d.update_every = 10;
  d.drop = 0.4;
  d.update_until = 0.5;
  d.total_steps = 200;                           // window: steps 1..99
  EXPECT_NEAR(d.drop_fraction(50), 0.2, 1e-12);  // half way: cos = 0
  EXPECT_NEAR(d.drop_fraction(10), 0.2 * (1 + std::cos(std::numbers::pi * 0.1)), 1e-12);
  EXPECT_EQ(d.drop_fraction(100), 0.0);
  EXPECT_TRUE(d.is_update_step(10));
  EXPECT_TRUE(d.is_update_step(90));
  EXPECT_FALSE(d.is_update_step(95));
  EXPECT_FALSE(d.is_update_step(100));
  EXPECT_FALSE(d.is_update_step(0));
  EXPECT_EQ(d.swap_count(50, 1000, 100000), 200);
  EXPECT_EQ(d.swap_count(50, 1000, 1100), 100);  // only 100 inactive positions
  EXPECT_EQ(d.swap_count(51, 1000, 100000), 0);
  d.rule = MaskUpdateRule::none;
  EXPECT_FALSE(d.is_update_step(10));
  EXPECT_EQ(d.swap_count(50, 1000, 100000), 0);
}

TEST(DynamicSparsitySchedule, BadSettingsAreRefused) {
  DynamicSparsity d;
  d.update_every = 0;
  EXPECT_CONTAINS(thrown_message<ArgumentError>([&] { d.validate(); }), "update_every");
  d = {};
  d.drop = 0;
  EXPECT_CONTAINS(thrown_message<ArgumentError>([&] { d.validate(); }), "drop");
  d = {};
  d.update_until = 1.5;
  EXPECT_CONTAINS(thrown_message<ArgumentError>([&] { d.validate(); }), "update_until");
  d = {};
  d.rule = MaskUpdateRule::set;  // and no run length
  EXPECT_CONTAINS(thrown_message<ArgumentError>([&] { d.validate(); }), "total_steps");
  d.total_steps = 10;
  EXPECT_NO_THROW(d.validate());
  EXPECT_EQ(parse_mask_update_rule("rigl"), MaskUpdateRule::rigl);
  EXPECT_STREQ(to_string(MaskUpdateRule::set), "set");
  EXPECT_CONTAINS(thrown_message<ArgumentError>([] { parse_mask_update_rule("topkast"); }),
                  "topkast");
}

TEST(MaskUpdate, SmallestMagnitudesBreakTiesByPosition) {
  CsrMatrix w = layer(9, 13, 0.6, 3);
  // Plant ties: several equal magnitudes of both signs.
  auto& v = w.values();
  for (std::size_t i = 0; i < v.size(); i += 3) v[i] = (i % 2 == 0 ? 0.25F : -0.25F);
  for (std::int64_t count : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, w.nnz()}) {
    std::vector<std::int64_t> order(v.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return std::fabs(v[a]) < std::fabs(v[b]);
    });
    order.resize(static_cast<std::size_t>(count));
    std::sort(order.begin(), order.end());
    EXPECT_EQ(detail::smallest_magnitudes(w, count), order) << count;
  }
  EXPECT_THROW(detail::smallest_magnitudes(w, w.nnz() + 1), ArgumentError);
}

TEST(MaskUpdate, PruneAndRegrowMatchesADenseReference) {
  for (std::uint64_t seed : {1, 2, 3}) {
    const CsrMatrix w = layer(11, 17, 0.7, seed);
    const std::int64_t k = w.nnz() / 3;
    const auto drop = detail::smallest_magnitudes(w, k);
    const auto grow = random_inactive_positions(w, k, seed);
    const detail::MaskChange change = detail::prune_and_regrow(w, drop, grow);
    change.weights.validate();
    EXPECT_EQ(change.weights.nnz(), w.nnz());

    // The reference: a dense copy, dropped entries removed, grown ones made active at 0.
    std::vector<int> active(static_cast<std::size_t>(w.rows() * w.cols()), 0);
    std::vector<double> value(active.size(), 0.0);
    for (std::int64_t r = 0; r < w.rows(); ++r) {
      for (std::int64_t j = w.row_offsets()[r]; j < w.row_offsets()[r + 1]; ++j) {
        const auto p = static_cast<std::size_t>(r * w.cols() + w.col_indices()[j]);
        active[p] = 1;
        value[p] = w.values()[j];
      }
    }
    for (std::int64_t j : drop) {
      const auto r = static_cast<std::int64_t>(
          std::upper_bound(w.row_offsets().begin(), w.row_offsets().end(), j) -
          w.row_offsets().begin() - 1);
      active[static_cast<std::size_t>(r * w.cols() + w.col_indices()[j])] = 0;
    }
    for (std::int64_t p : grow) {
      ASSERT_EQ(active[static_cast<std::size_t>(p)], 0) << "grown where active: " << p;
      active[static_cast<std::size_t>(p)] = 1;
      value[static_cast<std::size_t>(p)] = 0.0;
    }
    const CsrMatrix& n = change.weights;
    std::size_t seen = 0;
    for (std::int64_t r = 0; r < n.rows(); ++r) {
      for (std::int64_t j = n.row_offsets()[r]; j < n.row_offsets()[r + 1]; ++j) {
        const auto p = static_cast<std::size_t>(r * n.cols() + n.col_indices()[j]);
        ASSERT_EQ(active[p], 1) << "position " << p;
        EXPECT_EQ(n.values()[j], value[p]) << "position " << p;
        const std::int64_t src = change.source[static_cast<std::size_t>(j)];
        if (src < 0) {
          EXPECT_TRUE(std::binary_search(grow.begin(), grow.end(), static_cast<std::int64_t>(p)));
        } else {
          EXPECT_EQ(w.values()[src], n.values()[j]);
        }
        ++seen;
      }
    }
    EXPECT_EQ(seen, static_cast<std::size_t>(std::count(active.begin(), active.end(), 1)));
  }
}

TEST(MaskUpdate, OptimizerStateCarriesOverAndGrownStartsAtZero) {
  const CsrMatrix w = layer(6, 10, 0.5, 9);
  std::vector<float> state(w.values().size());
  for (std::size_t i = 0; i < state.size(); ++i) state[i] = 1.0F + static_cast<float>(i);
  const auto drop = detail::smallest_magnitudes(w, 4);
  const auto grow = random_inactive_positions(w, 4, 5);
  const auto change = detail::prune_and_regrow(w, drop, grow);
  const auto moved = detail::carry_over(state, change.source);
  ASSERT_EQ(moved.size(), change.source.size());
  int zeros = 0;
  for (std::size_t j = 0; j < moved.size(); ++j) {
    if (change.source[j] < 0) {
      EXPECT_EQ(moved[j], 0.0F);
      ++zeros;
    } else {
      EXPECT_EQ(moved[j], state[static_cast<std::size_t>(change.source[j])]);
    }
  }
  EXPECT_EQ(zeros, 4);
}

TEST(MaskUpdate, BadChangesAreRefused) {
  const CsrMatrix w = layer(5, 8, 0.5, 4);
  const std::int64_t first_active = w.col_indices()[w.row_offsets()[0]];
  const std::vector<std::int64_t> grow_active{first_active};
  EXPECT_CONTAINS(thrown_message<ArgumentError>([&] {
                    detail::prune_and_regrow(w, std::vector<std::int64_t>{0}, grow_active);
                  }),
                  "already active");
  const std::vector<std::int64_t> unordered{3, 2};
  EXPECT_THROW(detail::prune_and_regrow(w, unordered, {}), ArgumentError);
  const std::vector<std::int64_t> outside{40};
  EXPECT_THROW(detail::prune_and_regrow(w, {}, outside), ArgumentError);
}

TEST(SetGrowth, DrawsDistinctInactivePositionsAndIsSeeded) {
  const CsrMatrix w = layer(13, 29, 0.8, 6);
  const auto active = active_positions(w);
  const std::int64_t inactive = w.rows() * w.cols() - w.nnz();
  const auto a = random_inactive_positions(w, 40, 11);
  ASSERT_EQ(a.size(), 40U);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_EQ(std::adjacent_find(a.begin(), a.end()), a.end());
  for (std::int64_t p : a) EXPECT_EQ(active.count(p), 0U) << p;
  EXPECT_EQ(random_inactive_positions(w, 40, 11), a);
  EXPECT_NE(random_inactive_positions(w, 40, 12), a);
  // All of them: exactly the complement of the mask.
  const auto all = random_inactive_positions(w, inactive, 1);
  std::vector<std::int64_t> complement;
  for (std::int64_t p = 0; p < w.rows() * w.cols(); ++p) {
    if (active.count(p) == 0) complement.push_back(p);
  }
  EXPECT_EQ(all, complement);
  EXPECT_THROW(random_inactive_positions(w, inactive + 1, 1), ArgumentError);
  // Roughly uniform: every inactive position drawn over many seeds, none far too often.
  std::vector<int> hits(static_cast<std::size_t>(w.rows() * w.cols()), 0);
  for (std::uint64_t s = 0; s < 400; ++s) {
    for (std::int64_t p : random_inactive_positions(w, 30, s)) ++hits[static_cast<std::size_t>(p)];
  }
  const double expected = 400.0 * 30 / static_cast<double>(inactive);  // ~40
  for (std::int64_t p : complement) {
    EXPECT_GT(hits[static_cast<std::size_t>(p)], expected / 3) << p;
    EXPECT_LT(hits[static_cast<std::size_t>(p)], expected * 3) << p;
  }
}

TEST(StreamingTopK, KeepsTheSameSetAsAFullSortInAnyOrder) {
  std::mt19937_64 rng(5);
  std::vector<detail::ScoredPosition> all;
  for (std::int64_t p = 0; p < 500; ++p) {
    all.push_back({p, static_cast<float>(rng() % 40)});  // many ties
  }
  auto better = [](const detail::ScoredPosition& a, const detail::ScoredPosition& b) {
    return a.score > b.score || (a.score == b.score && a.position < b.position);
  };
  for (std::int64_t k : {0, 1, 17, 499, 500}) {
    auto sorted = all;
    std::sort(sorted.begin(), sorted.end(), better);
    std::vector<std::int64_t> want;
    for (std::int64_t i = 0; i < k; ++i)
      want.push_back(sorted[static_cast<std::size_t>(i)].position);
    std::sort(want.begin(), want.end());
    auto shuffled = all;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    detail::StreamingTopK one(k), left(k), right(k);
    for (std::size_t i = 0; i < shuffled.size(); ++i) {
      one.offer(shuffled[i].position, shuffled[i].score);
      (i % 3 == 0 ? left : right).offer(shuffled[i].position, shuffled[i].score);
    }
    left.merge(right);
    EXPECT_EQ(one.positions(), want) << k;
    EXPECT_EQ(left.positions(), want) << k;
    const auto ranked = one.ranked();
    for (std::size_t i = 0; i < ranked.size(); ++i) {
      EXPECT_EQ(ranked[i].position, sorted[i].position);
    }
  }
  detail::StreamingTopK nan(2);
  nan.offer(1, std::nanf(""));
  nan.offer(2, 1.0F);
  EXPECT_EQ(nan.positions(), std::vector<std::int64_t>{2});
}

/// Token shards of X (cols x tokens) and dY (rows x tokens) with small integer values,
/// whose products and sums are exact in float.
struct Shards {
  std::vector<DenseMatrix> x, dy;
  std::vector<ConstMatrixView> xs, dys;
  Shards(std::int64_t rows, std::int64_t cols, std::vector<std::int64_t> tokens,
         std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (std::int64_t t : tokens) {
      x.emplace_back(cols, t);
      dy.emplace_back(rows, t);
    }
    for (std::size_t e = 0; e < tokens.size(); ++e) {
      for (std::int64_t i = 0; i < cols; ++i)
        for (std::int64_t t = 0; t < tokens[e]; ++t) x[e](i, t) = static_cast<float>(rng() % 7) - 3;
      for (std::int64_t o = 0; o < rows; ++o)
        for (std::int64_t t = 0; t < tokens[e]; ++t)
          dy[e](o, t) = static_cast<float>(rng() % 5) - 2;
      xs.push_back(x[e].view());
      dys.push_back(dy[e].view());
    }
  }
};

class GradientTopK : public testing::ByIsa {};

TEST_P(GradientTopK, MatchesADenseTopKAndIsTheSameOverOneOrTwoEngines) {
  const Isa isa = GetParam();
  // 37 x 300: three column tiles, the last partial; 13 tokens, split 13 or 6 + 7.
  const std::int64_t rows = 37, cols = 300;
  const CsrMatrix mask = layer(rows, cols, 0.9, 21);
  const auto active = active_positions(mask);
  const Shards one(rows, cols, {13}, 3);
  // The same tokens, split over two engines.
  Shards two(rows, cols, {6, 7}, 99);
  for (std::int64_t t = 0; t < 13; ++t) {
    const std::size_t e = t < 6 ? 0 : 1;
    const std::int64_t u = t < 6 ? t : t - 6;
    for (std::int64_t i = 0; i < cols; ++i) two.x[e](i, u) = one.x[0](i, t);
    for (std::int64_t o = 0; o < rows; ++o) two.dy[e](o, u) = one.dy[0](o, t);
  }
  // The dense reference, in double.
  std::vector<detail::ScoredPosition> scores;
  for (std::int64_t o = 0; o < rows; ++o) {
    for (std::int64_t i = 0; i < cols; ++i) {
      if (active.count(o * cols + i) != 0) continue;
      double g = 0;
      for (std::int64_t t = 0; t < 13; ++t)
        g += static_cast<double>(one.dy[0](o, t)) * one.x[0](i, t);
      scores.push_back({o * cols + i, static_cast<float>(std::fabs(g))});
    }
  }
  std::sort(scores.begin(), scores.end(), [](const auto& a, const auto& b) {
    return a.score > b.score || (a.score == b.score && a.position < b.position);
  });
  for (std::int64_t k : {1, 50, 400}) {
    std::vector<std::int64_t> want;
    for (std::int64_t j = 0; j < k; ++j)
      want.push_back(scores[static_cast<std::size_t>(j)].position);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(detail::dense_gradient_top_k(mask, one.xs, one.dys, k, isa), want) << k;
    EXPECT_EQ(detail::dense_gradient_top_k(mask, two.xs, two.dys, k, isa), want) << k;
  }
  const std::int64_t inactive = rows * cols - mask.nnz();
  EXPECT_EQ(detail::dense_gradient_top_k(mask, one.xs, one.dys, inactive).size(),
            static_cast<std::size_t>(inactive));
  EXPECT_THROW(detail::dense_gradient_top_k(mask, one.xs, one.dys, inactive + 1), ArgumentError);
  const Shards wrong(rows, cols + 1, {13}, 3);
  EXPECT_THROW(detail::dense_gradient_top_k(mask, wrong.xs, wrong.dys, 1), ShapeError);
}

// MpiFabric's scheme: each engine continues the previous engine's tile sums with its own
// tokens (gradient_tile with accumulate) and the last one offers the tile to the top-k. On
// real values, whose float sums depend on their order, the tiles are bit for bit those of
// dense_gradient_top_k over the same shards, so the positions and scores are the same.
TEST_P(GradientTopK, EnginesChainingTilesScoreAsTheSharedTiles) {
  const Isa isa = GetParam();
  const std::int64_t rows = 23, cols = 290;  // three column tiles, the last partial
  const CsrMatrix mask = layer(rows, cols, 0.85, 5);
  std::mt19937_64 rng(4);
  std::normal_distribution<float> normal;
  for (const std::vector<std::int64_t>& split :
       {std::vector<std::int64_t>{11}, {5, 6}, {3, 1, 7}}) {
    std::vector<DenseMatrix> x, dy;
    std::vector<ConstMatrixView> xs, dys;
    for (const std::int64_t t : split) {
      x.emplace_back(cols, t);
      dy.emplace_back(rows, t);
      for (std::int64_t i = 0; i < cols; ++i)
        for (std::int64_t u = 0; u < t; ++u) x.back()(i, u) = normal(rng);
      for (std::int64_t o = 0; o < rows; ++o)
        for (std::int64_t u = 0; u < t; ++u) dy.back()(o, u) = (u % 3 == 0) ? 0.0F : normal(rng);
    }
    for (std::size_t e = 0; e < split.size(); ++e) {
      xs.push_back(x[e].view());
      dys.push_back(dy[e].view());
    }
    for (const std::int64_t k : {1, 37, 900}) {
      detail::StreamingTopK chained(k);
      std::vector<float> tile, xt;
      const std::int64_t width = detail::gradient_tile_columns();
      for (std::int64_t c0 = 0; c0 < cols; c0 += width) {
        const std::int64_t c1 = std::min(cols, c0 + width);
        tile.assign(static_cast<std::size_t>(rows * (c1 - c0)), -1.0F);
        for (std::size_t e = 0; e < split.size(); ++e) {
          detail::gradient_tile(xs[e], dys[e], c0, c1, e > 0, xt, tile.data(), isa);
        }
        detail::offer_gradient_tile(mask, c0, c1, tile.data(), chained);
      }
      const auto want = detail::dense_gradient_top_k(mask, xs, dys, k, isa);
      EXPECT_EQ(chained.positions(), want) << split.size() << " engines, k " << k;
      // The scores kept are |dY X^T| at their positions (float64 reference).
      for (const detail::ScoredPosition& p : chained.ranked()) {
        const std::int64_t o = p.position / cols, c = p.position % cols;
        double g = 0, magnitude = 0;
        for (std::size_t e = 0; e < split.size(); ++e) {
          for (std::int64_t u = 0; u < split[e]; ++u) {
            g += static_cast<double>(dy[e](o, u)) * x[e](c, u);
            magnitude += std::fabs(static_cast<double>(dy[e](o, u)) * x[e](c, u));
          }
        }
        EXPECT_NEAR(p.score, std::fabs(g), 1e-5 * magnitude) << p.position;
      }
    }
  }
  std::vector<float> xt, tile(64);
  const DenseMatrix x(10, 4), dy(3, 5);
  EXPECT_THROW(detail::gradient_tile(x.view(), dy.view(), 0, 2, false, xt, tile.data()),
               ShapeError);
}

TEST_P(GradientTopK, RealValuedScoresAgreeWithFloat64) {
  const Isa isa = GetParam();
  // Real values: float sums may differ from double in the last bits, so only positions
  // clearly inside the reference top-k are required (a near-tie at the cut may go either way).
  const std::int64_t rows = 20, cols = 150, tokens = 9;
  const CsrMatrix mask = layer(rows, cols, 0.8, 8);
  const auto active = active_positions(mask);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal;
  DenseMatrix x(cols, tokens), dy(rows, tokens);
  for (std::int64_t i = 0; i < cols; ++i)
    for (std::int64_t t = 0; t < tokens; ++t) x(i, t) = normal(rng);
  for (std::int64_t o = 0; o < rows; ++o)
    for (std::int64_t t = 0; t < tokens; ++t) dy(o, t) = normal(rng);
  std::vector<double> score(static_cast<std::size_t>(rows * cols), -1.0);
  std::vector<double> inactive_scores;
  for (std::int64_t o = 0; o < rows; ++o) {
    for (std::int64_t i = 0; i < cols; ++i) {
      if (active.count(o * cols + i) != 0) continue;
      double g = 0;
      for (std::int64_t t = 0; t < tokens; ++t) g += static_cast<double>(dy(o, t)) * x(i, t);
      score[static_cast<std::size_t>(o * cols + i)] = std::fabs(g);
      inactive_scores.push_back(std::fabs(g));
    }
  }
  std::sort(inactive_scores.rbegin(), inactive_scores.rend());
  const std::int64_t k = 100;
  const double cut = inactive_scores[static_cast<std::size_t>(k - 1)];
  const std::vector<ConstMatrixView> xs{x.view()}, dys{dy.view()};
  const auto got = detail::dense_gradient_top_k(mask, xs, dys, k, isa);
  ASSERT_EQ(got.size(), static_cast<std::size_t>(k));
  for (std::int64_t p : got) {  // (an active position scores -1)
    EXPECT_GE(score[static_cast<std::size_t>(p)], cut * (1 - 1e-5)) << p;
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, GradientTopK, ::testing::ValuesIn(testing::kAllIsas),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace sluice

namespace sluice {
namespace {

/// A gradient stream for `mask` carrying `values` (in CSR order).
WeightStream gradient_for(const CsrMatrix& mask, const std::vector<float>& values) {
  CsrMatrix g(mask.rows(), mask.cols(), mask.row_offsets(), mask.col_indices(), values);
  WeightStream s = encode_stream(g, StreamKind::weights);
  s.header.kind = StreamKind::gradient;
  return s;
}

std::vector<float> ramp(std::size_t n, float scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * (1.0F + static_cast<float>(i % 7));
  return v;
}

class Regrow : public testing::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    OptimizerConfig c;
    c.kind = OptimizerKind::sgd;
    c.learning_rate = 0.5;
    c.momentum = 0.9;
    mm.set_optimizer(c);
    mm.add_layer(layer(4, 6, 0.5, 1), std::vector<float>(4, 0.0F));
    mm.add_layer(layer(9, 14, 0.7, 2), std::vector<float>(9, 0.0F));
  }
  void step(const std::vector<float>& g) {
    mm.submit_gradient(1, gradient_for(mm.weights(1), g), std::vector<float>(9, 0.0F));
    ASSERT_TRUE(mm.commit_step().applied);
  }
  HostModelMemory mm;
};

TEST_F(Regrow, DropsTheSmallestGrowsAtZeroAndResetsTheirState) {
  const std::size_t nnz = static_cast<std::size_t>(mm.weights(1).nnz());
  const auto g1 = ramp(nnz, 0.01F);
  step(g1);  // SGD velocity v1 = g1
  const CsrMatrix before = mm.weights(1);
  const TransposedPattern& t = mm.transposed(1);
  const Placement& p = mm.placement(1, 3);
  const std::uint64_t generation = mm.mask_generation();

  const std::int64_t k = 5;
  const auto dropped = detail::smallest_magnitudes(before, k);
  const auto grow = random_inactive_positions(before, k, 77);
  mm.regrow(1, grow);
  const CsrMatrix& after = mm.weights(1);
  EXPECT_EQ(after.nnz(), before.nnz());
  EXPECT_EQ(mm.mask_generation(), generation + 1);
  const auto expected = detail::prune_and_regrow(before, dropped, grow);
  EXPECT_EQ(after.row_offsets(), expected.weights.row_offsets());
  EXPECT_EQ(after.col_indices(), expected.weights.col_indices());
  EXPECT_EQ(after.values(), expected.weights.values());
  // The same objects, now of the new mask.
  EXPECT_EQ(&mm.transposed(1), &t);
  EXPECT_EQ(t.col_indices, transposed_pattern(after).col_indices);
  EXPECT_EQ(t.source, transposed_pattern(after).source);
  EXPECT_EQ(&mm.placement(1, 3), &p);
  EXPECT_EQ(p.lane_nnz, round_robin_placement(after, 3).lane_nnz);
  // A by-input stream follows the new mask too (decoded back to W).
  EXPECT_EQ(decode_stream(mm.stream(1, StreamKind::weights, Precision::fp32, StreamOrder::by_input))
                .col_indices(),
            after.col_indices());

  // Next step: kept weights go on with their velocity, grown ones start from zero.
  const auto g2 = ramp(nnz, -0.02F);
  step(g2);
  const CsrMatrix& w2 = mm.weights(1);
  for (std::size_t j = 0; j < nnz; ++j) {
    const std::int64_t src = expected.source[j];
    const double v = (src < 0 ? 0.0 : 0.9 * g1[static_cast<std::size_t>(src)]) + g2[j];
    const double want = (src < 0 ? 0.0 : before.values()[static_cast<std::size_t>(src)]) - 0.5 * v;
    EXPECT_NEAR(w2.values()[j], want, 1e-6) << j << (src < 0 ? " grown" : " kept");
  }
}

TEST_F(Regrow, BadRequestsChangeNothing) {
  const CsrMatrix before = mm.weights(1);
  const std::int64_t active = before.col_indices()[before.row_offsets()[1]] + before.cols();
  const std::vector<std::int64_t> grow_active{active};
  EXPECT_CONTAINS(thrown_message<ArgumentError>([&] { mm.regrow(1, grow_active); }),
                  "already active");
  const std::vector<std::int64_t> unordered{5, 3};
  EXPECT_CONTAINS(thrown_message<ArgumentError>([&] { mm.regrow(1, unordered); }), "increasing");
  const std::vector<std::int64_t> outside{9 * 14};
  EXPECT_THROW(mm.regrow(1, outside), ArgumentError);
  EXPECT_THROW(mm.regrow(2, {}), ArgumentError);
  EXPECT_EQ(mm.weights(1).col_indices(), before.col_indices());
  EXPECT_EQ(mm.mask_generation(), 0U);

  // Not while a gradient waits for its commit.
  mm.submit_gradient(1, gradient_for(before, ramp(static_cast<std::size_t>(before.nnz()), 0.1F)),
                     std::vector<float>(9, 0.0F));
  const auto grow = random_inactive_positions(before, 2, 1);
  EXPECT_CONTAINS(thrown_message<ShapeError>([&] { mm.regrow(1, grow); }), "commit_step");
  EXPECT_EQ(mm.weights(1).col_indices(), before.col_indices());
}

TEST_F(Regrow, CheckpointKeepsTheNewMaskAndState) {
  const std::size_t nnz = static_cast<std::size_t>(mm.weights(1).nnz());
  step(ramp(nnz, 0.01F));
  mm.regrow(1, random_inactive_positions(mm.weights(1), 6, 3));
  const auto path = dir_ / "dynamic.ckpt";
  mm.save(path);
  HostModelMemory loaded;
  loaded.load(path);
  EXPECT_EQ(loaded.weights(1).col_indices(), mm.weights(1).col_indices());
  EXPECT_EQ(loaded.weights(1).values(), mm.weights(1).values());
  EXPECT_EQ(loaded.mask_generation(), 1U);
  // The same next step from both: the optimizer state came along too.
  const auto g = ramp(nnz, 0.03F);
  step(g);
  loaded.submit_gradient(1, gradient_for(loaded.weights(1), g), std::vector<float>(9, 0.0F));
  ASSERT_TRUE(loaded.commit_step().applied);
  EXPECT_EQ(loaded.weights(1).values(), mm.weights(1).values());
}

}  // namespace
}  // namespace sluice

namespace sluice {
namespace {

/// Trains a 20-40-30-5 MLP at 80% for `steps` steps of 24 tokens on `engines` engines
/// with masks updated every 2 steps; returns the memory's masks and the totals.
struct Trained {
  std::vector<CsrMatrix> weights;
  StepMetrics totals;
};

Trained train_dynamic(MaskUpdateRule rule, std::int32_t engines, std::int64_t steps) {
  HostModelMemory memory;
  build_sparse_mlp(memory, {20, 40, 30, 5}, 0.8, 4);
  LocalFabricOptions fo;
  fo.engines = engines;
  fo.engine.threads = 1;
  LocalFabric fabric(fo);
  ExecutorOptions eo;
  eo.dynamic.rule = rule;
  eo.dynamic.update_every = 2;
  eo.dynamic.drop = 0.5;
  eo.dynamic.update_until = 0.75;
  eo.dynamic.total_steps = steps;
  eo.dynamic.seed = 9;
  LayerStreamingExecutor executor(memory, fabric, eo);
  const Dataset data = make_synthetic_dataset(24 * steps, 20, 5, 3);
  for (std::int64_t s = 0; s < steps; ++s) {
    Batch b;
    b.features = {data.features.data() + s * 24, 20, 24, data.features.stride()};
    b.labels.assign(data.labels.begin() + s * 24, data.labels.begin() + (s + 1) * 24);
    executor.train_step(b);
  }
  Trained out;
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) out.weights.push_back(memory.weights(l));
  out.totals = executor.totals();
  return out;
}

TEST(DynamicTraining, SameSeedSameMasksOnOneOrTwoEngines) {
  HostModelMemory initial;
  build_sparse_mlp(initial, {20, 40, 30, 5}, 0.8, 4);
  for (MaskUpdateRule rule : {MaskUpdateRule::set, MaskUpdateRule::rigl}) {
    const Trained one = train_dynamic(rule, 1, 12);
    const Trained two = train_dynamic(rule, 2, 12);
    EXPECT_EQ(one.totals.mask_updates, 4) << to_string(rule);  // steps 2, 4, 6, 8 (< 9)
    EXPECT_GT(one.totals.mask_update_seconds, 0);
    for (std::size_t l = 0; l < one.weights.size(); ++l) {
      const CsrMatrix& start = initial.weights(static_cast<std::int32_t>(l));
      EXPECT_EQ(one.weights[l].nnz(), start.nnz()) << l;
      EXPECT_NE(one.weights[l].col_indices(), start.col_indices()) << l << " never changed";
      EXPECT_EQ(one.weights[l].row_offsets(), two.weights[l].row_offsets()) << to_string(rule) << l;
      EXPECT_EQ(one.weights[l].col_indices(), two.weights[l].col_indices()) << to_string(rule) << l;
    }
  }
  // The rules grow different positions.
  EXPECT_NE(train_dynamic(MaskUpdateRule::set, 1, 4).weights[1].col_indices(),
            train_dynamic(MaskUpdateRule::rigl, 1, 4).weights[1].col_indices());
  EXPECT_EQ(train_dynamic(MaskUpdateRule::none, 1, 4).weights[1].col_indices(),
            initial.weights(1).col_indices());
}

TEST(DynamicTraining, RiglGrowsWhereTheDenseGradientIsLargest) {
  // One step on a one-layer model: the grown positions are the dense top-k of |dY X^T|,
  // from the executor's own gradients (a dense reference of the full product).
  HostModelMemory memory;
  build_sparse_mlp(memory, {12, 9}, 0.7, 2);
  const CsrMatrix start = memory.weights(0);
  LocalFabric fabric;
  ExecutorOptions eo;
  eo.dynamic.rule = MaskUpdateRule::rigl;
  eo.dynamic.update_every = 1;
  eo.dynamic.drop = 0.3;
  eo.dynamic.update_until = 1;
  eo.dynamic.total_steps = 1000;
  LayerStreamingExecutor executor(memory, fabric, eo);
  const Dataset data = make_synthetic_dataset(16, 12, 9, 1);
  Batch b{data.features.view(), data.labels, {}};
  // The dense gradient of the mean loss: softmax minus one-hot, over the tokens.
  const DenseMatrix y = executor.infer(b.features);
  std::vector<double> dense(9 * 12, 0.0);
  for (std::int64_t t = 0; t < 16; ++t) {
    double peak = y(0, t), sum = 0;
    for (std::int64_t o = 1; o < 9; ++o) peak = std::max<double>(peak, y(o, t));
    for (std::int64_t o = 0; o < 9; ++o) sum += std::exp(y(o, t) - peak);
    for (std::int64_t o = 0; o < 9; ++o) {
      const double dy = (std::exp(y(o, t) - peak) / sum - (o == b.labels[t] ? 1 : 0)) / 16;
      for (std::int64_t i = 0; i < 12; ++i) dense[o * 12 + i] += dy * data.features(i, t);
    }
  }
  const auto active = active_positions(start);
  std::vector<std::pair<double, std::int64_t>> ranked;
  for (std::int64_t p = 0; p < 9 * 12; ++p) {
    if (active.count(p) == 0) ranked.push_back({-std::fabs(dense[p]), p});
  }
  std::sort(ranked.begin(), ranked.end());
  const std::int64_t k = eo.dynamic.swap_count(1, start.nnz(), 9 * 12);
  ASSERT_GT(k, 2);
  executor.train_step(b);
  const auto after = active_positions(memory.weights(0));
  for (std::int64_t j = 0; j < k; ++j) {
    // Clear winners only: a near-tie at the cut may go either way in float.
    if (-ranked[j].first > -ranked[k].first * (1 + 1e-4)) {
      EXPECT_EQ(after.count(ranked[j].second), 1U) << "rank " << j;
    }
  }
  std::int64_t grown = 0;
  for (std::int64_t p : after) grown += active.count(p) == 0 ? 1 : 0;
  EXPECT_EQ(grown, k);
}

}  // namespace
}  // namespace sluice
