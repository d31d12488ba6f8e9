#pragma once
// The clock the engine's counters read. Internal.
#include <chrono>

namespace sluice::detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace sluice::detail
