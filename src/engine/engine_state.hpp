#pragma once
// What a CpuEngine keeps between products: its kernels, its threads' arena and the
// buffers its passes reuse. Internal.
#include <oneapi/tbb/task_arena.h>

#include <memory>
#include <vector>

#include "engine/intake.hpp"
#include "engine/kernels/lane_kernels.hpp"
#include "engine/tiling.hpp"
#include "stream/chunk_pool.hpp"

namespace sluice::detail {

/// The kernel tables of an engine's ISA.
struct KernelTables {
  const LaneKernels& fp32;
  const Bf16LaneKernels& bf16;
  const ByInputKernels& by_input;
};

struct EngineState {
  EngineState(const TilingPolicy& policy, Isa isa, std::int32_t threads)
      : policy(policy),
        kernels{lane_kernels(isa), bf16_lane_kernels(isa), by_input_kernels(isa)},
        arena(threads) {}

  TilingPolicy policy;
  KernelTables kernels;
  tbb::task_arena arena;
  // Kept between calls: faulting in fresh pages for every product cost more than the
  // work done in them. The weight gradients' partial sums (per token block, and between
  // tiles), the gradient streams' chunks, stream shares' parts of dX (every share but
  // the first), each lane's partial sums of Y, and the lanes' shares of the chunks.
  std::vector<float> gradient_scratch;
  std::shared_ptr<ChunkPool> gradient_chunks = std::make_shared<ChunkPool>();
  std::vector<float> dx_share_scratch;
  std::vector<float> lane_partial_scratch;
  SpareShares spare_shares;
};

}  // namespace sluice::detail
