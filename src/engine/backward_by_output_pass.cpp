// The backward from a stream by output, the wafer's dual of the forward: each lane adds
// w * dY[o, :] into the dX rows it owns, and a second pass takes the weight gradients.
// Two passes, each keeping one matrix resident: a fused pass would have to keep X and dX
// in cache together, halving the tile and doubling the passes over the stream, which
// costs more than the second pass.
#include <algorithm>
#include <atomic>

#include "core/parallel.hpp"
#include "engine/clock.hpp"
#include "engine/passes.hpp"

namespace sluice::detail {
namespace {

/// A lane's rows of dX on one tile, accumulated where the plan holds them: in its
/// resident tile (zeroed, then stored into dX) or in dX itself (zeroed in place).
class DxRows {
 public:
  DxRows(bool pack, const std::vector<std::uint32_t>& rows, MutableMatrixView target,
         std::int64_t tile)
      : pack_(pack), rows_(rows), target_(target) {
    if (pack) resident_.resize(rows.size(), tile);
  }
  MutableTile start(std::int64_t t0, std::int64_t width) {
    if (pack_) {
      resident_.zero(width);
      return resident_.mutable_tile();
    }
    for (std::int64_t r = 0; r < target_.rows; ++r) std::fill_n(target_.row(r) + t0, width, 0.0F);
    return {target_.data + t0, target_.stride};
  }
  void finish(std::int64_t t0, std::int64_t width) {
    if (pack_) resident_.store(rows_, target_.data, target_.stride, t0, width);
  }

 private:
  bool pack_;
  const std::vector<std::uint32_t>& rows_;
  MutableMatrixView target_;
  ResidentTile resident_;
};

struct ByOutput {
  EngineState& engine;
  const BackwardPlan& plan;
  const ProductInputs& in;
  const ConstMatrixView* x;
  ConstMatrixView dy;
  MutableMatrixView* dx;
  GradientOut* gradient;
  std::int32_t lanes;

  /// Runs fn(task, lane, block, chunks) for every task of `tiling`.
  template <typename Fn>
  void tasks(const TokenTiling& tiling, bool claim, Fn&& fn) {
    std::atomic<std::size_t> claims{0};
    parallel_for(
        std::int64_t{0}, tiling.tasks(lanes),
        [&](std::int64_t task) {
          const TokenTiling::Task here = tiling.task(task, lanes);
          TaskChunks mine(tiling, here.share, in.chunks.size(), claim ? &claims : nullptr);
          const TaskClock clock(in.busy[task], in.spans[task]);
          fn(here, mine);
        },
        /*one_task_each=*/true);
  }
  /// Whether the stream (taken whole before the pass) has a chunk c.
  bool has(std::size_t c) const { return c < in.chunks.size(); }
  Tile dy_rows(std::size_t c, std::int64_t t0) const {
    return {dy.row(in.chunks[c].chunk->first_output) + t0, dy.stride};
  }

  /// dX. Stream shares each add their chunks' part of dX: share 0 into dX, the others
  /// into their own matrices, added to dX after the pass in share order (so the sums are
  /// the same whatever the thread timing, and which chunks a share has fixes them).
  void data_pass() {
    const TokenTiling& tiling = plan.data_tiling;
    const std::vector<MutableMatrixView> shares = dx_shares();
    tasks(tiling, false, [&](const TokenTiling::Task& here, TaskChunks& mine) {
      const std::int32_t p = here.lane;
      const MutableMatrixView target = here.share == 0 ? *dx : shares[here.share - 1];
      DxRows rows(plan.holding.pack, in.layout.rows[p], target, tiling.tile);
      for (std::int64_t t = tiling.first_tile(here.block); t < tiling.first_tile(here.block + 1);
           ++t) {
        const std::int64_t t0 = tiling.begin(t), width = tiling.width(t);
        const MutableTile dx_tile = rows.start(t0, width);
        mine.on_tile(
            t == tiling.first_tile(here.block),
            [&](std::size_t c, bool /*first*/) {
              plan.data_step(engine.kernels, in.chunks[c], p, dy_rows(c, t0), dx_tile, width);
            },
            [&](std::size_t c) { return has(c); });
        rows.finish(t0, width);
      }
    });
    if (shares.empty()) return;
    parallel_for(std::int64_t{0}, dx->rows, [&](std::int64_t r) {
      float* out = dx->row(r);
      for (const MutableMatrixView& part : shares) {
        const float* from = part.row(r);
        for (std::int64_t t = 0; t < dx->cols; ++t) out[t] += from[t];
      }
    });
  }
  std::vector<MutableMatrixView> dx_shares() const {
    std::vector<MutableMatrixView> shares;
    const std::int32_t S = plan.data_tiling.shares;
    if (S <= 1) return shares;
    const auto size = static_cast<std::size_t>(dx->rows * dx->cols);
    if (engine.dx_share_scratch.size() < (S - 1) * size) {
      engine.dx_share_scratch.resize((S - 1) * size);
    }
    for (std::int32_t share = 1; share < S; ++share) {
      shares.push_back(
          {engine.dx_share_scratch.data() + (share - 1) * size, dx->rows, dx->cols, dx->cols});
    }
    return shares;
  }

  /// The weight gradients, X held as the plan says.
  void weight_pass() {
    const TokenTiling& tiling = plan.weight_tiling;
    tasks(tiling, TaskChunks::claimed(tiling, lanes),
          [&](const TokenTiling::Task& here, TaskChunks& mine) {
            const std::int32_t p = here.lane, q = here.block;
            HeldRows rows(plan.holding.hold(), in.layout.rows[p], *x, tiling.tile,
                          engine.kernels.bf16);
            for (std::int64_t t = tiling.first_tile(q); t < tiling.first_tile(q + 1); ++t) {
              const std::int64_t t0 = tiling.begin(t), width = tiling.width(t);
              const HeldTile held = rows.hold(t0, width);
              mine.on_tile(
                  t == tiling.first_tile(q),
                  [&](std::size_t c, bool first_visit) {
                    if (first_visit && plan.direct) gradient->write_controls(c);
                    plan.weight_step(engine.kernels, in.chunks[c], p, dy_rows(c, t0), held,
                                     gradient->sums(tiling, p, q, c, t), width);
                  },
                  [&](std::size_t c) { return has(c); });
            }
          });
  }
};

}  // namespace

void backward_by_output_pass(EngineState& engine, const BackwardPlan& plan, const ProductInputs& in,
                             const ConstMatrixView* x, ConstMatrixView dy, MutableMatrixView* dx,
                             GradientOut* gradient) {
  ByOutput pass{engine, plan, in,       x,
                dy,     dx,   gradient, static_cast<std::int32_t>(in.layout.rows.size())};
  engine.arena.execute([&] {
    if (dx != nullptr) pass.data_pass();
    if (gradient != nullptr) pass.weight_pass();
  });
}

}  // namespace sluice::detail
