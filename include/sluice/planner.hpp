#pragma once
// Placement of input features on engine lanes (done once per layer, kept with the layer).
// Matrix multiplication is invariant under permutation of the input features, so the
// placement changes nothing but the balance of work over lanes.
#include <cstdint>
#include <vector>

#include "sluice/csr_matrix.hpp"

namespace sluice {

struct Placement {
  std::int32_t lanes = 1;
  /// lane_of[i]: the lane that owns input feature i (and keeps its activation row).
  std::vector<std::int32_t> lane_of;
  /// Non-zeros that each lane receives (its AXPY count per token vector).
  std::vector<std::int64_t> lane_nnz;

  std::int64_t features() const { return static_cast<std::int64_t>(lane_of.size()); }
  /// max lane nnz / mean lane nnz; 1.0 is perfect, 1.0 too for an all-zero matrix.
  double balance() const;
  std::int64_t max_lane_nnz() const;

  /// Every one of `features` on one lane, which receives all `nnz` non-zeros.
  static Placement single_lane(std::int64_t features, std::int64_t nnz = 0) {
    Placement p;
    p.lane_of.assign(static_cast<std::size_t>(features), 0);
    p.lane_nnz = {nnz};
    return p;
  }
};

/// The planner's placement: sort input features by non-zero count, descending (ties by
/// index, so it is deterministic), and deal them round-robin to `lanes` lanes.
Placement round_robin_placement(const std::vector<std::int64_t>& column_counts, std::int32_t lanes);
inline Placement round_robin_placement(const CsrMatrix& w, std::int32_t lanes) {
  return round_robin_placement(w.column_counts(), lanes);
}

/// The naive alternative, for comparison: contiguous blocks of input features.
Placement contiguous_placement(const std::vector<std::int64_t>& column_counts, std::int32_t lanes);

/// Lane that owns output feature o in the *next* layer: where the ring reduction of
/// output o should end. Features are dealt round-robin by index when the next layer's
/// placement is not known.
inline std::int32_t default_output_lane(std::int64_t o, std::int32_t lanes) {
  return static_cast<std::int32_t>(o % lanes);
}

}  // namespace sluice
