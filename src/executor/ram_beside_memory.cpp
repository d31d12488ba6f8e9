// What a LayerStreamingExecutor holds beside a ModelMemory in bounded RAM, and the least
// budget that holds it beside a layer's working set.
#include "executor/ram_beside_memory.hpp"

#include <algorithm>

#include "sluice/chunk_memory.hpp"

namespace sluice {
namespace {

// A layer's stream through a channel: every packet, a control packet per row and chunk,
// and one more.
std::int64_t channel_packets(const LayerShape& w) {
  return w.nnz + 2 * (w.rows + w.cols) + 1;
}

}  // namespace

namespace detail {

std::size_t channel_chunks_of(const LayerShape& w, Precision precision,
                              const ExecutorOptions& options, std::int64_t ram_budget_bytes) {
  if (options.prefetch_depth > 0) return options.prefetch_depth;
  const std::int64_t packet_bytes = precision == Precision::bf16
                                        ? static_cast<std::int64_t>(sizeof(Bf16Packet))
                                        : static_cast<std::int64_t>(sizeof(Packet));
  const std::int64_t chunk_bytes = static_cast<std::int64_t>(options.chunk_packets) * packet_bytes;
  std::int64_t budget = options.prefetch_bytes;
  if (budget == 0) {  // the whole layer
    budget = std::min(kMaxPrefetchBytes, channel_packets(w) * packet_bytes + chunk_bytes);
    // A ModelMemory in bounded RAM keeps the layer itself in its cache, which is the
    // read-ahead; the channel needs only enough to keep the engines fed, and a whole
    // layer's stream beside the cache would put the process far over the budget.
    if (ram_budget_bytes > 0) {
      budget = std::min(budget, std::max(chunk_bytes, ram_budget_bytes / kBoundedPrefetchShare));
    }
  }
  return static_cast<std::size_t>(std::max<std::int64_t>(1, budget / chunk_bytes));
}

}  // namespace detail

// For the largest layer: its stream, which an engine keeps whole for the pass (chunks are
// shared between engines), each engine's gradient of it and the reduced one being
// submitted (one waits at most, see forward_backward_loaded), and two channels' prefetch;
// and the chunk buffers kept for reuse (ChunkAllocator).
std::int64_t executor_ram_beside_memory(std::span<const LayerShape> shapes,
                                        const ExecutorOptions& options, std::int32_t engines,
                                        std::int64_t ram_budget_bytes) {
  std::int64_t most = 0;
  for (std::size_t l = 0; l < shapes.size(); ++l) {
    const LayerShape& w = shapes[l];
    const Precision precision =
        l < options.precisions.size() ? options.precisions[l] : Precision::fp32;
    constexpr auto packet = static_cast<std::int64_t>(sizeof(Packet));
    const std::int64_t stream = (w.nnz + w.rows + w.cols + 1) * packet;
    const std::int64_t chunk = static_cast<std::int64_t>(options.chunk_packets) * packet;
    // A channel's chunks hold the packets streamed, control packets included, no more.
    const std::int64_t prefetch = std::min(static_cast<std::int64_t>(detail::channel_chunks_of(
                                               w, precision, options, ram_budget_bytes)) *
                                               chunk,
                                           channel_packets(w) * packet);
    most = std::max(most, (2 + std::int64_t{engines}) * stream + 2 * prefetch);
  }
  // Freed chunk buffers stay resident for the next of their size, up to a bound, and no
  // more than the streams held.
  return most + std::min(most, static_cast<std::int64_t>(kChunkMemoryKeptBytes));
}

std::int64_t executor_least_ram_budget(std::span<const LayerShape> shapes,
                                       const ExecutorOptions& options, std::int32_t engines,
                                       std::int64_t working_set_bytes) {
  // budget - beside(budget) never falls as the budget grows (the prefetch takes a 16th of
  // it at most), so this climbs to the least budget and stops there.
  std::int64_t budget = working_set_bytes;
  for (;;) {
    const std::int64_t need =
        working_set_bytes + executor_ram_beside_memory(shapes, options, engines, budget);
    if (need <= budget) return budget;
    budget = need;
  }
}

}  // namespace sluice
