#pragma once
// One layer's stream on its way from ModelMemory to the engines, for the executor: the
// producer thread that fills its channel, and what the engines' pulls cost. Internal.
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <vector>

#include "engine/engine_worker.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

/// Counts what the engines pull from ModelMemory and how long they wait for it.
class MeteredSource final : public StreamSource {
 public:
  explicit MeteredSource(StreamSource& inner) : inner_(&inner) {}
  const StreamHeader& header() const override { return inner_->header(); }
  ChunkPtr next() override;
  double wait_seconds = 0;
  std::uint64_t packets = 0, bytes = 0;

 private:
  StreamSource* inner_;
};

/// Persistent threads for the layers' stream producers, lent to one stream at a time: a
/// thread started and joined per layer, twice per layer and step, costs more than a small
/// layer's product.
using Producers = std::vector<std::unique_ptr<EngineWorker>>;

/// One layer's stream on its way out of ModelMemory: a producer thread fills a bounded
/// channel. The destructor drains what the consumer left (after an error), waits for the
/// producer and gives its thread back.
struct LayerStream {
  LayerStream(const ModelMemory& memory, std::int32_t layer, StreamKind kind, std::size_t depth,
              std::size_t chunk_packets, Precision precision, StreamOrder order, Producers& idle);
  LayerStream(const LayerStream&) = delete;
  LayerStream& operator=(const LayerStream&) = delete;
  ~LayerStream();
  StreamChannel channel;
  ChannelStreamSource source;
  MeteredSource metered;

 private:
  Producers& idle_;
  std::unique_ptr<EngineWorker> producer_;
  std::future<void> produced_;
};

/// The streams of one call, in the order the engines take them (a step: every layer's
/// forward stream, then every backward stream from the last layer down), opened ahead:
/// after a stream is taken, those after it are opened until they add up to
/// `ahead_packets` (at least the next one). A small layer's successor would otherwise
/// start its production only when the small layer's short pass begins, and the engines
/// wait for it: so the last layer's backward stream, and the one after it, are produced
/// during the forward pass.
class StreamQueue {
 public:
  using Opener = std::function<std::unique_ptr<LayerStream>(std::size_t)>;
  /// `packets[i]`: stream i's size; `open(i)` opens stream i.
  StreamQueue(std::vector<std::int64_t> packets, std::int64_t ahead_packets, Opener open);
  /// The next stream; with `open_ahead`, opens those after it first (else `fill` does).
  std::unique_ptr<LayerStream> take(bool open_ahead = true);
  /// Opens streams after the one taken last, as `take` does.
  void fill();

 private:
  std::vector<std::int64_t> packets_;
  std::int64_t ahead_packets_;
  Opener open_;
  std::deque<std::unique_ptr<LayerStream>> opened_;
  std::size_t next_ = 0;       // the next stream to open
  std::int64_t in_queue_ = 0;  // packets of `opened_`
};

}  // namespace sluice::detail
