#pragma once
// The placements a model memory hands out for one layer, one per lane count, made on first
// use. Both memories keep them so: the engine asks for a layer's placement every pass,
// and a placement handed out stays valid (map nodes never move; a mask change rebuilds
// the placements in place).
#include <cstdint>
#include <map>
#include <mutex>

#include "sluice/planner.hpp"

namespace sluice::detail {

/// `placements[lanes]` under `mutex`, made from `pattern` (the layer's weights, or its
/// column counts) by round_robin_placement if it is not there yet.
template <typename Pattern>
const Placement& cached_placement(std::mutex& mutex, std::map<std::int32_t, Placement>& placements,
                                  const Pattern& pattern, std::int32_t lanes) {
  std::lock_guard lock(mutex);
  auto it = placements.find(lanes);
  if (it == placements.end()) {
    it = placements.emplace(lanes, round_robin_placement(pattern, lanes)).first;
  }
  return it->second;
}

}  // namespace sluice::detail
