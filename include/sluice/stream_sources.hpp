#pragma once
// Where an engine reads a stream from: a whole stream in memory or a live channel.
#include <cstddef>

#include "sluice/stream_channel.hpp"
#include "sluice/stream_packets.hpp"

namespace sluice {

/// A stream an engine reads, chunk by chunk.
class StreamSource {
 public:
  virtual ~StreamSource() = default;
  virtual const StreamHeader& header() const = 0;
  /// The next chunk, or nullptr after the last one.
  virtual ChunkPtr next() = 0;
};

/// A whole stream in memory, its chunks handed out in order.
class MemoryStreamSource final : public StreamSource {
 public:
  explicit MemoryStreamSource(const WeightStream& stream) : stream_(&stream) {}
  const StreamHeader& header() const override { return stream_->header; }
  ChunkPtr next() override {
    return next_ < stream_->chunks.size() ? stream_->chunks[next_++] : nullptr;
  }

 private:
  const WeightStream* stream_;
  std::size_t next_ = 0;
};

/// A live stream: its header known, its chunks popped from a channel as they arrive.
class ChannelStreamSource final : public StreamSource {
 public:
  ChannelStreamSource(StreamHeader header, StreamChannel& channel)
      : header_(header), channel_(&channel) {}
  const StreamHeader& header() const override { return header_; }
  ChunkPtr next() override { return channel_->pop(); }

 private:
  StreamHeader header_;
  StreamChannel* channel_;
};

}  // namespace sluice
