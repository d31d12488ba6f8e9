#pragma once
// The frame channel: how a weight stream goes from rank 0 to every engine rank. Chunks
// travel in frames (wire.hpp), several in flight: frame i's broadcast carries frame i + 1's
// sizes, which arrive at once (they are small), so the engines post frame i + 1 while
// frame i is still in transfer. With direct reads (direct_read.hpp) only the sizes and
// addresses are broadcast and each engine copies the frame out of rank 0's memory. An
// engine rank receives on its main thread and hands each complete frame to its engine's
// thread through a StreamChannel, so transfer and compute overlap. Internal.
#include <cstdint>
#include <memory>
#include <vector>

#include "fabric/mpi/link.hpp"
#include "fabric/mpi/tag_checksum.hpp"
#include "fabric/mpi/wire.hpp"
#include "sluice/stream.hpp"

namespace sluice::mpi {

/// A frame's chunks: pointers on rank 0.
struct Frame {
  std::vector<ChunkPtr> chunks;
  std::size_t budget = 0;  ///< the bytes it was pulled to (the last chunk may go past)
  FrameMeta meta(Precision precision) const;
};

/// Rank 0: the stream it broadcast, kept for the gradient streams that come back in its
/// order: their tags are checked against it and the sum is laid out like it.
struct SentStream {
  std::vector<ChunkPtr> chunks;
  std::vector<std::uint64_t> chunk_values;  ///< weight packets in each chunk
  Precision precision = Precision::fp32;
  std::uint64_t packets = 0, values = 0;
  TagChecksum tags;
};

struct FrameOptions {
  std::size_t window = 4;                          ///< frames in flight
  std::size_t frame_bytes = std::size_t{4} << 20;  ///< a frame's size, once grown
  bool direct = false;                             ///< engines read frames from rank 0's memory
};

/// Rank 0's side.
class FrameSender {
 public:
  FrameSender(Link& link, FrameOptions options) : link_(&link), options_(options) {}

  /// Takes chunks for one frame: up to `budget` bytes (at least one chunk; 0: the first
  /// frame's, see kFirstFrameBytes), at most kMaxFrameChunks.
  Frame pull(StreamSource& source, std::size_t budget = 0) const;
  /// Sends the rest of `source`, `first` (already announced in the command) first.
  /// `kept`, if given, collects the chunks and their tag checksum, computed while the
  /// frames are in flight.
  void send(StreamSource& source, Frame first, SentStream* kept) const;

 private:
  Link* link_;
  FrameOptions options_;
};

/// An engine rank's side. Keeps the chunk buffers of earlier streams for the next ones
/// (no fresh pages to fault in and zero for every layer).
class FrameReceiver {
 public:
  FrameReceiver(Link& link, FrameOptions options, std::int64_t driver_pid)
      : link_(&link), options_(options), driver_pid_(driver_pid) {}

  /// Receives the stream whose first frame is `first` into `channel`, then closes it.
  /// The chunks' buffers are reused once `reclaim` is called (the engine let go of them).
  void receive(const FrameMeta& first, Precision precision, StreamChannel& channel);
  void reclaim();

 private:
  struct Posted;
  void take(const FrameMeta& meta, Precision precision, std::vector<ChunkPtr>& chunks);
  std::unique_ptr<Posted> post(const FrameMeta& meta, Precision precision);
  void receive_directly(const FrameMeta& first, Precision precision, StreamChannel& channel);

  Link* link_;
  FrameOptions options_;
  std::int64_t driver_pid_;
  std::vector<std::shared_ptr<StreamChunk>> pool_, used_;
  // The buffers and sizes (in packets) of the frame last taken.
  std::vector<void*> buffers_;
  std::vector<std::size_t> sizes_;
};

/// FormatError unless the frame's chunk count is one a sender can send.
void check_frame(const FrameMeta& meta);

}  // namespace sluice::mpi
