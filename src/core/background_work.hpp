#pragma once
// Work this process does on threads of its own beside the fabric's: ModelMemory's stream
// producers and its optimizer. An MPI fabric's wait polls, and a poll that yields the core
// takes turns with whatever else is runnable on it; while such work runs, the wait sleeps
// between polls instead and leaves the core to it. Internal.
#include <atomic>

namespace sluice::detail {

inline std::atomic<int>& background_work_count() {
  static std::atomic<int> count{0};
  return count;
}

/// Whether some thread is inside a BackgroundWork scope.
inline bool background_work_running() {
  return background_work_count().load(std::memory_order_relaxed) > 0;
}

/// Counts the calling thread's work as background work while the scope lives.
class BackgroundWork {
 public:
  BackgroundWork() { background_work_count().fetch_add(1, std::memory_order_relaxed); }
  ~BackgroundWork() { background_work_count().fetch_sub(1, std::memory_order_relaxed); }
  BackgroundWork(const BackgroundWork&) = delete;
  BackgroundWork& operator=(const BackgroundWork&) = delete;
};

}  // namespace sluice::detail
