#pragma once
// Stream chunks whose memory outlives them. Internal.
#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "sluice/stream_packets.hpp"

namespace sluice::detail {

/// Chunks of the gradient streams a component hands out: a chunk's last owner, in
/// whatever thread, gives it back here instead of freeing it (a deleter, under a mutex),
/// so the next stream is written into pages already mapped. (A fresh gradient stream costs
/// a page fault and a zeroed page per 4 KiB, inside the weight-gradient pass.) Keeps at most
/// the largest stream's worth of chunks; lives on, through the deleters, while any does.
class ChunkPool : public std::enable_shared_from_this<ChunkPool> {
 public:
  /// A chunk for a stream of `stream_chunks` chunks. Its fields are as its last user left
  /// them (its packets keep their capacity): the caller sets every one it uses.
  std::shared_ptr<StreamChunk> take(std::size_t stream_chunks) {
    std::unique_ptr<StreamChunk> chunk;
    {
      const std::lock_guard lock(mutex_);
      limit_ = std::max(limit_, stream_chunks);
      if (!free_.empty()) {
        chunk = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!chunk) chunk = std::make_unique<StreamChunk>();
    return {chunk.release(), [pool = shared_from_this()](StreamChunk* c) { pool->give_back(c); }};
  }

 private:
  void give_back(StreamChunk* c) {
    std::unique_ptr<StreamChunk> chunk(c);
    const std::lock_guard lock(mutex_);
    if (free_.size() < limit_) free_.push_back(std::move(chunk));
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<StreamChunk>> free_;
  std::size_t limit_ = 0;
};

}  // namespace sluice::detail
