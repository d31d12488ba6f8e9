#pragma once
// The tag checksum of a gradient stream. Rank 0 knows every tag and control packet of a
// gradient stream (they are the weight stream's), so only values travel; each engine's
// checksum of its stream's tags proves it returned them in the order rank 0 expects.
//
// The checksum is CRC-32C (src/crc32.hpp) in four lanes: the tags in order, two to a
// 64-bit word (the first in the low half), word j into lane j mod 4, an odd last tag
// alone into the next lane; then the CRC-32C of the word count and the four lanes.
// Four lanes, because the CPU's CRC-32C instruction has a throughput of several times
// its latency. Internal.
#include <cstdint>

#include "core/crc32.hpp"
#include "sluice/stream.hpp"

namespace sluice::mpi {

/// The tags of a stream, chunk by chunk (chunk boundaries do not matter), into the
/// checksum above; optionally the weight packets' values out, as fp32, in the same pass.
class TagChecksum {
 public:
  TagChecksum();
  /// The chunk's packets of the stream's precision; returns its number of weight packets.
  std::uint64_t add(const StreamChunk& chunk, Precision precision, float* values = nullptr);
  std::uint32_t checksum() const;

 private:
  template <typename P>
  std::uint64_t scan(const P* p, std::size_t n, float* values);

  detail::Crc32cLanes fold_;
  std::uint32_t lane_[4] = {~0U, ~0U, ~0U, ~0U};
  std::uint64_t words_ = 0;  ///< 64-bit words folded into the lanes so far
  bool pending_ = false;     ///< an odd tag waits for the next chunk's first
  std::uint32_t pending_tag_ = 0;
};

}  // namespace sluice::mpi
