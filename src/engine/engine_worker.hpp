#pragma once
// A persistent thread that runs the jobs posted to it, in order. Fabrics drive each
// engine from one of these, and the executor its stream producers and gradient
// submissions, so the thread's oneTBB registration and caches are kept across
// operations: starting a fresh thread per call costs more than a small layer's product,
// several times per layer and step. Internal.
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

namespace sluice::detail {

class EngineWorker {
 public:
  EngineWorker() : thread_([this] { loop(); }) {}
  ~EngineWorker() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }
  /// Runs `job` after the jobs posted before it; its result (or exception) comes back
  /// through the future. `job` may be move-only (a packaged_task holds it, shared with
  /// the queue's copyable entry).
  template <typename Job>
  std::future<std::invoke_result_t<Job&>> post(Job job) {
    using Result = std::invoke_result_t<Job&>;
    auto task = std::make_shared<std::packaged_task<Result()>>(std::move(job));
    std::future<Result> done = task->get_future();
    {
      std::lock_guard lock(mutex_);
      jobs_.emplace_back([task] { (*task)(); });
    }
    wake_.notify_one();
    return done;
  }

 private:
  void loop() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        task = std::move(jobs_.front());
        jobs_.pop_front();
      }
      task();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace sluice::detail
