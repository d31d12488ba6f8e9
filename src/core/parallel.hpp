#pragma once
// The library's parallel loops, so engine and optimizer code does not speak oneTBB
// directly. Under ThreadSanitizer each loop also annotates its fork and its join: Debian's
// oneTBB is not instrumented, so TSan cannot see that what the caller wrote happens before
// the tasks run, nor that what the tasks wrote happens before the loop returns. With the
// hand-overs annotated, races between the tasks themselves are still reported.
// Internal.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>

#include <cstddef>

#if defined(__SANITIZE_THREAD__)
#define SLUICE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SLUICE_TSAN 1
#endif
#endif
#ifdef SLUICE_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace sluice::detail {

/// A happens-before edge for ThreadSanitizer from every release on `token` to every
/// later acquire on it; nothing in other builds.
inline void tsan_release([[maybe_unused]] void* token) {
#ifdef SLUICE_TSAN
  __tsan_release(token);
#endif
}
inline void tsan_acquire([[maybe_unused]] void* token) {
#ifdef SLUICE_TSAN
  __tsan_acquire(token);
#endif
}

/// The edges of one parallel loop: the caller's fork before any task, each task's end
/// (also when it throws) before the caller goes on (also when the loop rethrows).
class TsanLoopEdges {
 public:
  TsanLoopEdges() { tsan_release(&fork_); }
  ~TsanLoopEdges() { tsan_acquire(&join_); }
  TsanLoopEdges(const TsanLoopEdges&) = delete;
  TsanLoopEdges& operator=(const TsanLoopEdges&) = delete;

  /// Held by a task while it runs.
  class Task {
   public:
    explicit Task(TsanLoopEdges& loop) : loop_(loop) { tsan_acquire(&loop_.fork_); }
    ~Task() { tsan_release(&loop_.join_); }
    Task(const Task&) = delete;
    Task& operator=(const Task&) = delete;

   private:
    TsanLoopEdges& loop_;
  };

 private:
  char fork_ = 0, join_ = 0;  // tokens: only their addresses are used
};

/// fn(i) for every i in [begin, end); with `one_task_each` every index is a task of its
/// own (lanes, which must not be merged), otherwise oneTBB groups them.
template <typename Index, typename Fn>
void parallel_for(Index begin, Index end, Fn&& fn, bool one_task_each = false) {
  TsanLoopEdges edges;
  auto body = [&](Index i) {
    const TsanLoopEdges::Task task(edges);
    fn(i);
  };
  if (one_task_each) {
    tbb::parallel_for(begin, end, body, tbb::simple_partitioner());
  } else {
    tbb::parallel_for(begin, end, body);
  }
}

/// fn(lo, hi) over [begin, end) in pieces of about `grain` elements.
template <typename Fn>
void parallel_for_ranges(std::size_t begin, std::size_t end, std::size_t grain, Fn&& fn) {
  TsanLoopEdges edges;
  tbb::parallel_for(tbb::blocked_range<std::size_t>(begin, end, grain),
                    [&](const tbb::blocked_range<std::size_t>& r) {
                      const TsanLoopEdges::Task task(edges);
                      fn(r.begin(), r.end());
                    });
}

}  // namespace sluice::detail
