#pragma once
// The bounded hand-over of a stream's chunks from a producer thread to an engine.
#include <cstddef>
#include <exception>
#include <memory>
#include <vector>

#include "sluice/stream_packets.hpp"

namespace sluice {

/// A bounded, thread-safe hand-over of chunks from one producer to one consumer.
/// `push` blocks while `capacity` chunks wait; `pop` blocks until a chunk arrives and
/// returns nullptr once the producer has called `close()` and the queue is drained.
/// A producer that fails calls `fail()`, and the consumer's `pop` rethrows its error.
class StreamChannel {
 public:
  explicit StreamChannel(std::size_t capacity = 4);
  ~StreamChannel();
  StreamChannel(const StreamChannel&) = delete;
  StreamChannel& operator=(const StreamChannel&) = delete;

  void push(ChunkPtr chunk);
  /// Several chunks at once, with one lock and at most one wake-up of the consumer (the
  /// MPI fabric hands over a received frame so). Blocks while `capacity` chunks wait.
  void push(std::vector<ChunkPtr> chunks);
  void close();
  void fail(std::exception_ptr error);
  ChunkPtr pop();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace sluice
