#include "sluice/planner.hpp"

#include <algorithm>
#include <numeric>
#include <string>

#include "sluice/error.hpp"

namespace sluice {
namespace {

void check_lanes(std::int32_t lanes) {
  if (lanes < 1)
    throw ArgumentError("placement needs at least one lane, got " + std::to_string(lanes));
}

}  // namespace

double Placement::balance() const {
  if (lane_nnz.empty()) return 1.0;
  const std::int64_t total = std::accumulate(lane_nnz.begin(), lane_nnz.end(), std::int64_t{0});
  if (total == 0) return 1.0;
  const double mean = static_cast<double>(total) / static_cast<double>(lane_nnz.size());
  return static_cast<double>(max_lane_nnz()) / mean;
}

std::int64_t Placement::max_lane_nnz() const {
  return lane_nnz.empty() ? 0 : *std::max_element(lane_nnz.begin(), lane_nnz.end());
}

Placement round_robin_placement(const std::vector<std::int64_t>& column_counts,
                                std::int32_t lanes) {
  check_lanes(lanes);
  const auto n = static_cast<std::int64_t>(column_counts.size());
  std::vector<std::int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Densest first; ties by index keep the placement deterministic.
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return column_counts[a] > column_counts[b];
  });
  Placement p;
  p.lanes = lanes;
  p.lane_of.assign(n, 0);
  p.lane_nnz.assign(lanes, 0);
  for (std::int64_t k = 0; k < n; ++k) {
    const auto lane = static_cast<std::int32_t>(k % lanes);
    p.lane_of[order[k]] = lane;
    p.lane_nnz[lane] += column_counts[order[k]];
  }
  return p;
}

Placement contiguous_placement(const std::vector<std::int64_t>& column_counts, std::int32_t lanes) {
  check_lanes(lanes);
  const auto n = static_cast<std::int64_t>(column_counts.size());
  Placement p;
  p.lanes = lanes;
  p.lane_of.assign(n, 0);
  p.lane_nnz.assign(lanes, 0);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto lane = static_cast<std::int32_t>(i * lanes / std::max<std::int64_t>(n, 1));
    p.lane_of[i] = lane;
    p.lane_nnz[lane] += column_counts[i];
  }
  return p;
}

}  // namespace sluice
