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
#include <vector>

#include "sluice/bf16.hpp"
#include "sluice/chunk_memory.hpp"

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

/// Packet buffers in chunk memory (sluice/chunk_memory.hpp).
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

}  // namespace sluice
