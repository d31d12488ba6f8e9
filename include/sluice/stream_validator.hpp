#pragma once
// Checking a stream as it arrives (the format: sluice/stream_packets.hpp).
#include <cstdint>

#include "sluice/stream_packets.hpp"

namespace sluice {

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

}  // namespace sluice
