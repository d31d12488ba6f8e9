#include "sluice/stream_channel.hpp"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "sluice/error.hpp"

namespace sluice {

struct StreamChannel::State {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<ChunkPtr> queue;
  std::size_t capacity;
  bool closed = false;
  std::exception_ptr error;
};

StreamChannel::StreamChannel(std::size_t capacity) : state_(std::make_unique<State>()) {
  state_->capacity = std::max<std::size_t>(1, capacity);
}
StreamChannel::~StreamChannel() = default;

void StreamChannel::push(ChunkPtr chunk) {
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] {
    return state_->queue.size() < state_->capacity || state_->closed || state_->error;
  });
  if (state_->closed || state_->error) throw Error("StreamChannel: push after close");
  state_->queue.push_back(std::move(chunk));
  state_->changed.notify_all();
}

void StreamChannel::push(std::vector<ChunkPtr> chunks) {
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] {
    return state_->queue.size() < state_->capacity || state_->closed || state_->error;
  });
  if (state_->closed || state_->error) throw Error("StreamChannel: push after close");
  for (ChunkPtr& c : chunks) state_->queue.push_back(std::move(c));
  state_->changed.notify_all();
}

void StreamChannel::close() {
  std::lock_guard lock(state_->mutex);
  state_->closed = true;
  state_->changed.notify_all();
}

void StreamChannel::fail(std::exception_ptr error) {
  std::lock_guard lock(state_->mutex);
  state_->error = std::move(error);
  state_->changed.notify_all();
}

ChunkPtr StreamChannel::pop() {
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock,
                       [&] { return !state_->queue.empty() || state_->closed || state_->error; });
  if (state_->error) std::rethrow_exception(state_->error);
  if (state_->queue.empty()) return nullptr;
  ChunkPtr chunk = std::move(state_->queue.front());
  state_->queue.pop_front();
  state_->changed.notify_all();
  return chunk;
}

}  // namespace sluice
