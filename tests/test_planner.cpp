// The planner: round-robin placement of input features sorted by non-zero count.
#include <gtest/gtest.h>

#include <numeric>

#include "sluice/error.hpp"
#include "sluice/planner.hpp"

namespace sluice {
namespace {

TEST(Planner, DealsDensestFeaturesRoundRobin) {
  const std::vector<std::int64_t> counts = {1, 9, 5, 7, 3, 0};
  const Placement p = round_robin_placement(counts, 2);
  // Sorted: 1(9), 3(7), 2(5), 4(3), 0(1), 5(0) -> lanes 0,1,0,1,0,1.
  EXPECT_EQ(p.lane_of, (std::vector<std::int32_t>{0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(p.lane_nnz, (std::vector<std::int64_t>{15, 10}));
  EXPECT_DOUBLE_EQ(p.balance(), 15.0 / 12.5);
}

TEST(Planner, EveryFeatureOwnedAndCountsAddUp) {
  const CsrMatrix w = CsrMatrix::random(300, 777, 0.9, 5, RowDistribution::powerlaw);
  for (std::int32_t lanes : {1, 2, 3, 7, 16}) {
    const Placement p = round_robin_placement(w, lanes);
    ASSERT_EQ(p.features(), 777);
    for (auto lane : p.lane_of) ASSERT_TRUE(lane >= 0 && lane < lanes);
    EXPECT_EQ(std::accumulate(p.lane_nnz.begin(), p.lane_nnz.end(), std::int64_t{0}), w.nnz());
  }
}

TEST(Planner, BeatsAContiguousSplitOnASkewedMatrix) {
  // Column counts that grow along the index (a pruned layer whose later inputs matter
  // more): a contiguous split gives the last lane most of the work.
  std::vector<std::int64_t> counts(4096);
  for (std::size_t i = 0; i < counts.size(); ++i)
    counts[i] = 1 + static_cast<std::int64_t>(i * i / 20000);
  for (std::int32_t lanes : {2, 4, 8, 16}) {
    const Placement rr = round_robin_placement(counts, lanes);
    const Placement contiguous = contiguous_placement(counts, lanes);
    EXPECT_LT(rr.balance(), 1.01) << lanes;
    EXPECT_GT(contiguous.balance(), 1.3) << lanes;
  }
}

TEST(Planner, AllZeroAndEmptyAreBalanced) {
  EXPECT_DOUBLE_EQ(round_robin_placement(std::vector<std::int64_t>(10, 0), 3).balance(), 1.0);
  EXPECT_DOUBLE_EQ(round_robin_placement(std::vector<std::int64_t>{}, 3).balance(), 1.0);
}

TEST(Planner, RefusesZeroLanes) {
  EXPECT_THROW(round_robin_placement(std::vector<std::int64_t>(3, 1), 0), ArgumentError);
}

}  // namespace
}  // namespace sluice
