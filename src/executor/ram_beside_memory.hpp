#pragma once
// What a LayerStreamingExecutor holds beside a ModelMemory in bounded RAM: each layer's
// channel prefetch (also how the executor sizes its channels). The totals are public
// (executor_ram_beside_memory, executor_least_ram_budget in executor.hpp). Internal.
#include <cstddef>
#include <cstdint>

#include "sluice/executor.hpp"

namespace sluice::detail {

/// The prefetch budget of a layer's channel, in chunks: the old chunk count if given,
/// else the budget's bytes (0: the whole layer's stream, within kMaxPrefetchBytes).
std::size_t channel_chunks_of(const LayerShape& w, Precision precision,
                              const ExecutorOptions& options, std::int64_t ram_budget_bytes);

}  // namespace sluice::detail
