// The backward from a stream by input (the layer's transpose): one lane holds a token tile
// of dY and, for each input feature i (a run), gathers the dY rows its weights name once
// for both products: dX[i, :] = sum w * dY[o, :] as a sum kept in registers, and
// dot(X[i, :], dY[o, :]) for each weight. Each run writes its own dX row, so the stream's
// chunks can be claimed (TaskChunks), and the first tile's taken as they arrive.
#include <atomic>

#include "core/parallel.hpp"
#include "engine/clock.hpp"
#include "engine/passes.hpp"

namespace sluice::detail {

void backward_by_input_pass(EngineState& engine, const BackwardPlan& plan, const ProductInputs& in,
                            const ConstMatrixView* x, ConstMatrixView dy, MutableMatrixView* dx,
                            GradientOut* gradient) {
  const TokenTiling& tiling = plan.weight_tiling;
  const bool claim_chunks = TaskChunks::claimed(tiling, 1);
  std::atomic<std::size_t> claims{0};
  auto task_body = [&](std::int64_t task) {
    const std::int32_t q = tiling.task(task, 1).block;
    TaskClock clock(in.busy[task], in.spans[task]);
    TaskChunks mine(tiling, tiling.task(task, 1).share,
                    in.live ? std::nullopt : std::optional<std::size_t>(in.chunks.size()),
                    claim_chunks ? &claims : nullptr);
    HeldRows rows(plan.holding.hold(), in.layout.rows[0], dy, tiling.tile, engine.kernels.bf16);
    for (std::int64_t t = tiling.first_tile(q); t < tiling.first_tile(q + 1); ++t) {
      const std::int64_t t0 = tiling.begin(t), width = tiling.width(t);
      const HeldTile dy_tile = rows.hold(t0, width);
      auto arrive = [&](std::size_t c) { return in.intake.arrive(c, &clock); };
      mine.on_tile(
          t == tiling.first_tile(q),
          [&](std::size_t c, bool first_visit) {
            if (first_visit && plan.taken_as_computed) in.intake.take(c);
            if (first_visit && plan.direct && gradient != nullptr) gradient->write_controls(c);
            const std::int64_t first = in.chunks[c].chunk->first_output;  // an input feature
            const Tile x_rows =
                x != nullptr ? Tile{x->row(first) + t0, x->stride} : Tile{nullptr, 0};
            const MutableTile dx_rows =
                dx != nullptr ? MutableTile{dx->row(first) + t0, dx->stride} : MutableTile{};
            const GradientSums sums =
                gradient != nullptr ? gradient->sums(tiling, 0, q, c, t) : GradientSums{};
            plan.by_input_step(engine.kernels, in.chunks[c], dy_tile, x_rows, dx_rows, sums, width);
          },
          arrive);
    }
  };
  engine.arena.execute([&] {
    parallel_for(std::int64_t{0}, tiling.tasks(1), task_body, /*one_task_each=*/true);
    if (plan.taken_as_computed) in.intake.finish();
  });
}

}  // namespace sluice::detail
