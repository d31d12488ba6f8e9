#pragma once
// The library's parallel loops, so engine and optimizer code does not speak oneTBB
// directly. Each loop also publishes its join through an atomic: oneTBB's scheduler is
// not instrumented for ThreadSanitizer, which therefore cannot see that everything the
// tasks wrote happens before the loop returns; the release/acquire pair shows it.
// Internal.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>

#include <atomic>
#include <cstddef>

namespace sluice::detail {

/// fn(i) for every i in [begin, end); with `one_task_each` every index is a task of its
/// own (lanes, which must not be merged), otherwise oneTBB groups them.
template <typename Index, typename Fn>
void parallel_for(Index begin, Index end, Fn&& fn, bool one_task_each = false) {
  std::atomic<int> joined{0};
  auto body = [&](Index i) {
    fn(i);
    joined.fetch_add(1, std::memory_order_release);
  };
  if (one_task_each) {
    tbb::parallel_for(begin, end, body, tbb::simple_partitioner());
  } else {
    tbb::parallel_for(begin, end, body);
  }
  (void)joined.load(std::memory_order_acquire);
}

/// fn(lo, hi) over [begin, end) in pieces of about `grain` elements.
template <typename Fn>
void parallel_for_ranges(std::size_t begin, std::size_t end, std::size_t grain, Fn&& fn) {
  std::atomic<int> joined{0};
  tbb::parallel_for(tbb::blocked_range<std::size_t>(begin, end, grain),
                    [&](const tbb::blocked_range<std::size_t>& r) {
                      fn(r.begin(), r.end());
                      joined.fetch_add(1, std::memory_order_release);
                    });
  (void)joined.load(std::memory_order_acquire);
}

}  // namespace sluice::detail
