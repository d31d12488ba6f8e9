#pragma once
// The clock the engine's counters read, and the spans of a product's tasks spent computing
// (between waits for the stream). Internal.
#include <algorithm>
#include <chrono>
#include <vector>

namespace sluice::detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Span {
  Clock::time_point begin, end;
};

/// A task's computing time: it runs from construction to destruction, less the waits for
/// chunks (pause / resume). Adds its seconds to `busy` and its spans to `spans`.
class TaskClock {
 public:
  TaskClock(double& busy, std::vector<Span>& spans)
      : busy_(busy), spans_(spans), start_(Clock::now()) {}
  ~TaskClock() { pause(); }
  TaskClock(const TaskClock&) = delete;
  TaskClock& operator=(const TaskClock&) = delete;

  void pause() {
    if (!running_) return;
    const Clock::time_point now = Clock::now();
    busy_ += seconds_between(start_, now);
    spans_.push_back({start_, now});
    running_ = false;
  }
  void resume() {
    if (running_) return;
    start_ = Clock::now();
    running_ = true;
  }

 private:
  double& busy_;
  std::vector<Span>& spans_;
  Clock::time_point start_;
  bool running_ = true;
};

/// Seconds of [window.begin, window.end] during which at least one of the spans ran.
inline double covered_seconds(const std::vector<std::vector<Span>>& per_task, Span window) {
  std::vector<Span> spans;
  for (const auto& task : per_task) {
    for (const Span& s : task) {
      const Span cut{std::max(s.begin, window.begin), std::min(s.end, window.end)};
      if (cut.begin < cut.end) spans.push_back(cut);
    }
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  double covered = 0;
  Clock::time_point reached = window.begin;
  for (const Span& s : spans) {
    const Clock::time_point from = std::max(s.begin, reached);
    if (s.end > from) {
      covered += seconds_between(from, s.end);
      reached = s.end;
    }
  }
  return covered;
}

}  // namespace sluice::detail
