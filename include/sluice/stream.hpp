#pragma once
// The weight stream: how a layer's weights travel from ModelMemory to the engines,
// and (same format, reverse direction) how weight gradients travel back.
//
// For each output feature o, in order: one packet per non-zero (input index, value) —
// zeros are never sent — then a carriage return that closes o. After the last output,
// one end-of-layer packet. Packets travel in chunks that hold whole outputs, so a
// producer and the engines can work concurrently through a bounded channel.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sluice/csr_matrix.hpp"

namespace sluice {

/// One 8-byte packet: a weight (tag = input feature index, < 2^31) or a control packet.
struct Packet {
  std::uint32_t tag;
  float value;
};
static_assert(sizeof(Packet) == 8);

inline constexpr std::uint32_t kControlBit = 0x8000'0000U;
inline constexpr std::uint32_t kCarriageReturn = 0xFFFF'FFFFU;
inline constexpr std::uint32_t kEndOfLayer = 0xFFFF'FFFEU;

inline bool is_control(const Packet& p) {
  return (p.tag & kControlBit) != 0;
}

enum class StreamKind : std::uint32_t {
  weights = 1,   ///< values are the weights
  mask = 2,      ///< values are not meaningful: only the pattern travels (backward-weight)
  gradient = 3,  ///< values are weight gradients, in the weight stream's order
};
const char* to_string(StreamKind kind);

struct StreamHeader {
  StreamKind kind = StreamKind::weights;
  std::uint32_t outputs = 0;  ///< rows of W: carriage returns in the stream
  std::uint32_t inputs = 0;   ///< columns of W: every weight tag is < inputs
  std::uint64_t nnz = 0;      ///< weight packets in the stream
};

/// A run of whole outputs: [first_output, first_output + outputs), the packets of each
/// closed by a carriage return; the last chunk of a stream ends with end-of-layer.
struct StreamChunk {
  std::uint32_t first_output = 0;
  std::uint32_t outputs = 0;
  std::vector<Packet> packets;
};
using ChunkPtr = std::shared_ptr<const StreamChunk>;

/// Checks a stream chunk by chunk as it arrives; throws FormatError saying which chunk,
/// which packet and what is wrong (index out of range, unsorted or duplicate indices in
/// an output, a weight after end-of-layer, a missing carriage return, wrong counts,
/// a non-finite weight). Cheap enough to run on every untrusted stream.
class StreamValidator {
 public:
  explicit StreamValidator(const StreamHeader& header);
  void check(const StreamChunk& chunk);
  /// Call after the last chunk: throws if end-of-layer or any output is missing.
  void finish() const;
  bool ended() const { return ended_; }

 private:
  StreamHeader header_;
  std::uint64_t chunks_seen_ = 0;
  std::uint64_t outputs_closed_ = 0;
  std::uint64_t weights_seen_ = 0;
  bool ended_ = false;
};

/// A whole stream in memory: a header and its chunks (shared, never copied when the
/// stream is broadcast to several engines).
struct WeightStream {
  StreamHeader header;
  std::vector<ChunkPtr> chunks;

  /// Full validation (see StreamValidator).
  void validate() const;
  std::uint64_t packet_count() const;
  std::uint64_t byte_size() const { return packet_count() * sizeof(Packet); }
};

/// Default chunk size in packets: large enough to amortise the hand-over, small enough
/// that the first chunk reaches the engine early.
inline constexpr std::size_t kDefaultChunkPackets = 1 << 15;

/// Encodes a CSR matrix as a stream of the given kind (`mask` sends zeros as values).
WeightStream encode_stream(const CsrMatrix& matrix, StreamKind kind = StreamKind::weights,
                           std::size_t chunk_packets = kDefaultChunkPackets);

/// Decodes a complete, valid stream back into CSR (values from the packets).
CsrMatrix decode_stream(const WeightStream& stream);

/// Serialises a stream to bytes (magic "SLWS", version, header, framed chunks, CRC-32 per
/// chunk), for files and for fabrics that cross process boundaries.
std::vector<std::byte> serialize_stream(const WeightStream& stream);
/// Parses and fully validates serialised bytes; throws FormatError on any corruption.
WeightStream deserialize_stream(std::span<const std::byte> bytes);

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
  void close();
  void fail(std::exception_ptr error);
  ChunkPtr pop();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace sluice

namespace sluice {

/// Where an engine reads a stream from: a whole stream in memory or a live channel.
class StreamSource {
 public:
  virtual ~StreamSource() = default;
  virtual const StreamHeader& header() const = 0;
  /// The next chunk, or nullptr after the last one.
  virtual ChunkPtr next() = 0;
};

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
