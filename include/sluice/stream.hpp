#pragma once
// The weight stream: how a layer's weights travel from ModelMemory to the engines,
// and (same format, reverse direction) how weight gradients travel back.
//
// For each output feature o, in order: one packet per non-zero (input index, value) —
// zeros are never sent — then a carriage return that closes o. After the last output,
// one end-of-layer packet. Packets travel in chunks that hold whole outputs, so a
// producer and the engines can work concurrently through a bounded channel.
//
// A stream by input (StreamOrder::by_input) is the same format carrying the layer's
// transpose: one run per input feature i, closed by a carriage return, its packets
// (output index, value) sorted by output. The backward pass reads it: a CPU engine then
// gathers dY rows for both gradients instead of writing a dX row back for every weight.
//
// A stream has a precision. fp32 streams carry 8-byte `Packet`s; bf16 streams carry
// 4-byte `Bf16Packet`s (16-bit input index, bfloat16 value), half the bytes, for layers
// with at most 65535 inputs. Gradient streams are always fp32.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sluice/bf16.hpp"
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

/// One 4-byte packet of a bf16 stream. A weight: its input index (< 65535) and its value
/// in bfloat16. A control packet: index 0xFFFF, and the low half of the fp32 control tag
/// as value (so carriage return and end-of-layer keep their meaning, see `tag_of`).
/// Read as a little-endian 32-bit word, the high half is the weight's fp32 bit pattern,
/// which is how the kernels widen it.
struct Bf16Packet {
  std::uint16_t index;
  std::uint16_t value;
};
static_assert(sizeof(Bf16Packet) == 4);

inline constexpr std::uint16_t kBf16ControlIndex = 0xFFFF;
/// Layers a bf16 stream can address: input indices 0 ... 65534.
inline constexpr std::uint32_t kMaxBf16Inputs = 0xFFFF;

inline bool is_control(const Bf16Packet& p) {
  return p.index == kBf16ControlIndex;
}
inline constexpr Bf16Packet bf16_control(std::uint32_t control_tag) {
  return {kBf16ControlIndex, static_cast<std::uint16_t>(control_tag & 0xFFFFU)};
}
/// The fp32 stream's tag for a packet of either format (controls map to kCarriageReturn
/// and kEndOfLayer), and its value as fp32.
inline std::uint32_t tag_of(const Packet& p) {
  return p.tag;
}
inline std::uint32_t tag_of(const Bf16Packet& p) {
  return is_control(p) ? 0xFFFF'0000U | p.value : p.index;
}
inline float value_of(const Packet& p) {
  return p.value;
}
inline float value_of(const Bf16Packet& p) {
  return from_bf16(p.value);
}

enum class StreamKind : std::uint32_t {
  weights = 1,   ///< values are the weights
  mask = 2,      ///< values are not meaningful: only the pattern travels (backward-weight)
  gradient = 3,  ///< values are weight gradients, in the weight stream's order
};
const char* to_string(StreamKind kind);

/// Which way a stream walks its layer's weights.
enum class StreamOrder : std::uint32_t {
  by_output = 0,  ///< W: a run per output feature, tags are input features (forward)
  by_input = 1,   ///< W^T: a run per input feature, tags are output features (backward)
};
const char* to_string(StreamOrder order);

/// A stream's shape is the matrix it carries: W by output, W^T by input. Every check of
/// runs and tags reads `outputs` and `inputs` the same either way; the layer's own shape
/// is layer_outputs() x layer_inputs().
struct StreamHeader {
  StreamKind kind = StreamKind::weights;
  std::uint32_t outputs = 0;              ///< runs: carriage returns in the stream
  std::uint32_t inputs = 0;               ///< every weight tag is < inputs
  std::uint64_t nnz = 0;                  ///< weight packets in the stream
  Precision precision = Precision::fp32;  ///< which packets the chunks carry
  StreamOrder order = StreamOrder::by_output;

  bool by_input() const { return order == StreamOrder::by_input; }
  std::uint32_t layer_outputs() const { return by_input() ? inputs : outputs; }
  std::uint32_t layer_inputs() const { return by_input() ? outputs : inputs; }
};

namespace detail {
/// The memory behind ChunkAllocator.
void* allocate_chunk_memory(std::size_t bytes);
void free_chunk_memory(void* block, std::size_t bytes) noexcept;
/// Whether chunks' large buffers come from huge pages in this process.
bool chunk_memory_in_huge_pages();
}  // namespace detail

/// Memory held for stream chunks' buffers of 16 KiB and more where they come from huge
/// pages (both zero otherwise: operator new then serves them and takes them back):
/// reserved from the OS, and of that, in buffers now in use. A freed buffer stays
/// reserved for the next of its size, so a process keeps the peak of what it streamed at
/// once until release_chunk_memory.
struct ChunkMemoryUsage {
  std::size_t reserved_bytes = 0;
  std::size_t live_bytes = 0;
};
ChunkMemoryUsage chunk_memory_usage();
/// Returns to the OS every 64 MiB arena none of whose buffers is in use, and the bytes it
/// released: for a process done with a phase that streamed more, or other shapes, than
/// what follows (the next chunks fault in fresh pages). Thread-safe, buffers in use stay.
std::size_t release_chunk_memory();

/// The allocator of stream chunks' packet buffers. Buffers of 16 KiB and more come from
/// 2 MiB pages where the kernel has transparent huge pages (kept by size and reused, see
/// chunk_memory_usage), smaller ones from operator new. A process that reads
/// another's memory (MpiFabric's engines read rank 0's chunks) pins every page it copies,
/// so fewer, larger pages make that copy cheaper.
template <typename T>
struct ChunkAllocator {
  using value_type = T;
  ChunkAllocator() = default;
  template <typename U>
  ChunkAllocator(const ChunkAllocator<U>& /*other*/) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(detail::allocate_chunk_memory(n * sizeof(T)));
  }
  void deallocate(T* block, std::size_t n) noexcept {
    detail::free_chunk_memory(block, n * sizeof(T));
  }
  template <typename U>
  bool operator==(const ChunkAllocator<U>& /*other*/) const noexcept {
    return true;
  }
};
using PacketVector = std::vector<Packet, ChunkAllocator<Packet>>;
using Bf16PacketVector = std::vector<Bf16Packet, ChunkAllocator<Bf16Packet>>;

/// A run of whole outputs: [first_output, first_output + outputs), the packets of each
/// closed by a carriage return; the last chunk of a stream ends with end-of-layer.
/// The packets are in `packets` (fp32 stream) or `packets_bf16` (bf16 stream).
struct StreamChunk {
  std::uint32_t first_output = 0;
  std::uint32_t outputs = 0;
  PacketVector packets;
  Bf16PacketVector packets_bf16;

  std::size_t size() const { return packets.size() + packets_bf16.size(); }
  std::size_t byte_size() const {
    return packets.size() * sizeof(Packet) + packets_bf16.size() * sizeof(Bf16Packet);
  }
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
  std::uint64_t byte_size() const;
};

/// Default chunk size in packets: large enough to amortise the hand-over, small enough
/// that the first chunk reaches the engine early.
inline constexpr std::size_t kDefaultChunkPackets = 1 << 15;

/// Encodes a layer's CSR matrix as a stream of the given kind (`mask` sends zeros as
/// values), by output or by input (then the stream carries the matrix's transpose).
/// In bf16 the values are rounded to nearest even; a stream whose tags would exceed
/// 65534 (inputs by output, outputs by input), or a finite weight too large for bf16, is
/// refused with ShapeError.
WeightStream encode_stream(const CsrMatrix& matrix, StreamKind kind = StreamKind::weights,
                           std::size_t chunk_packets = kDefaultChunkPackets,
                           Precision precision = Precision::fp32,
                           StreamOrder order = StreamOrder::by_output);

/// The pieces of encode_stream, for producers that encode a layer chunk by chunk:
/// the stream's header (ShapeError if the layer cannot be streamed so), where the chunk
/// that starts at run `first` ends (whole runs, about `chunk_packets` packets, at least
/// one run), and the chunk of runs [first, last) (end-of-layer after the last run). By
/// input, the runs are the transpose's rows, its values read through its positions in
/// the layer's values (so a producer needs no second copy of them).
StreamHeader stream_header_for(const CsrMatrix& matrix, StreamKind kind,
                               Precision precision = Precision::fp32,
                               StreamOrder order = StreamOrder::by_output);
/// The same from the layer's shape alone (`rows` x `cols` with `nnz` non-zeros), for a
/// producer that does not hold the matrix.
StreamHeader stream_header_for(std::int64_t rows, std::int64_t cols, std::int64_t nnz,
                               StreamKind kind, Precision precision = Precision::fp32,
                               StreamOrder order = StreamOrder::by_output);
std::int64_t chunk_end(const CsrMatrix& matrix, std::int64_t first, std::size_t chunk_packets);
std::int64_t chunk_end(const TransposedPattern& transposed, std::int64_t first,
                       std::size_t chunk_packets);
ChunkPtr encode_chunk(const CsrMatrix& matrix, StreamKind kind, std::int64_t first,
                      std::int64_t last, Precision precision = Precision::fp32);
ChunkPtr encode_chunk(const TransposedPattern& transposed, std::span<const float> values,
                      StreamKind kind, std::int64_t first, std::int64_t last,
                      Precision precision = Precision::fp32);

/// Decodes a complete, valid stream back into the layer's CSR matrix (values from the
/// packets, widened to fp32 from a bf16 stream; a stream by input is transposed back).
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
