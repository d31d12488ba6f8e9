#pragma once
// One layer's stream on its way from ModelMemory to the engines, for the executor: the
// producer thread that fills its channel, and what the engines' pulls cost. Internal.
#include <cstdint>
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

}  // namespace sluice::detail
