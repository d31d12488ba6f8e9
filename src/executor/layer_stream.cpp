#include "executor/layer_stream.hpp"

#include "core/background_work.hpp"
#include "engine/clock.hpp"

namespace sluice::detail {

ChunkPtr MeteredSource::next() {
  const auto t0 = Clock::now();
  ChunkPtr chunk = inner_->next();
  wait_seconds += seconds_since(t0);
  if (chunk) {
    packets += chunk->size();
    bytes += chunk->byte_size();
  }
  return chunk;
}

LayerStream::LayerStream(const ModelMemory& memory, std::int32_t layer, StreamKind kind,
                         std::size_t depth, std::size_t chunk_packets, Precision precision,
                         StreamOrder order, Producers& idle)
    : channel(depth),
      source(memory.stream_header(layer, kind, precision, order), channel),
      metered(source),
      idle_(idle) {
  if (idle_.empty()) {
    idle_.reserve(idle_.capacity() + 1);  // room to give it back: the destructor cannot throw
    producer_ = std::make_unique<EngineWorker>();
  } else {
    producer_ = std::move(idle_.back());
    idle_.pop_back();
  }
  produced_ = producer_->post([&memory, this, layer, kind, chunk_packets, precision, order] {
    const BackgroundWork counted;
    memory.stream_to(layer, kind, channel, chunk_packets, precision, order);
  });
}

LayerStream::~LayerStream() {
  try {
    while (channel.pop() != nullptr) {
    }
  } catch (...) {  // the producer's error was seen (or not needed) by the consumer
  }
  produced_.wait();
  idle_.push_back(std::move(producer_));
}

StreamQueue::StreamQueue(std::vector<std::int64_t> packets, std::int64_t ahead_packets, Opener open)
    : packets_(std::move(packets)), ahead_packets_(ahead_packets), open_(std::move(open)) {}

std::unique_ptr<LayerStream> StreamQueue::take(bool open_ahead) {
  if (opened_.empty()) {
    if (next_ >= packets_.size()) return nullptr;
    opened_.push_back(open_(next_));
    in_queue_ += packets_[next_++];
  }
  std::unique_ptr<LayerStream> taken = std::move(opened_.front());
  opened_.pop_front();
  in_queue_ -= packets_[next_ - opened_.size() - 1];
  if (open_ahead) fill();
  return taken;
}

void StreamQueue::fill() {
  while (next_ < packets_.size() && (opened_.empty() || in_queue_ < ahead_packets_)) {
    opened_.push_back(open_(next_));
    in_queue_ += packets_[next_++];
  }
}

}  // namespace sluice::detail
