#pragma once
// Chunk checks shared by the stream validator and the engine's intake, which runs them
// in parallel over chunks while it routes packets to lanes.
#include <cstdint>
#include <string>

#include "sluice/stream_packets.hpp"

namespace sluice::detail {

struct ChunkFacts {
  std::uint64_t weights = 0;  ///< weight packets in the chunk
  bool ends_layer = false;    ///< last packet is end-of-layer
};

/// The header alone: a known precision, and one the layer's shape and kind allow.
void check_header(const StreamHeader& header);

/// Everything that can be checked from the chunk alone: tags in range, indices strictly
/// increasing within an output, `outputs` carriage returns, end-of-layer only last,
/// finite values (unless a mask). `chunk_index` is for the message. If given,
/// `carriage_returns` (room for chunk.outputs) receives the position of each carriage
/// return, which is all a single-lane engine needs to find its runs.
ChunkFacts check_chunk(const StreamHeader& header, const StreamChunk& chunk,
                       std::uint64_t chunk_index, std::uint32_t* carriage_returns = nullptr);

/// What depends on the order: the chunk starts where the previous one ended, nothing
/// follows end-of-layer, the outputs do not overrun the header.
void check_sequence(const StreamHeader& header, const StreamChunk& chunk, std::uint64_t chunk_index,
                    std::uint64_t outputs_closed, bool ended);

/// After the last chunk.
void check_finished(const StreamHeader& header, std::uint64_t outputs_closed, std::uint64_t weights,
                    bool ended);

std::string describe_chunk(const StreamChunk& chunk, std::uint64_t chunk_index);

}  // namespace sluice::detail
