// The forward pass: Y = W X, in the schedule its plan chose.
#include <atomic>
#include <mutex>

#include "core/parallel.hpp"
#include "engine/clock.hpp"
#include "engine/last_lane_ring_sum.hpp"
#include "engine/passes.hpp"

namespace sluice::detail {
namespace {

struct Forward {
  EngineState& engine;
  const ForwardPlan& plan;
  const ProductInputs& in;
  ConstMatrixView x;
  MutableMatrixView y;

  HeldRows held_rows(std::int32_t lane) const {
    return {plan.holding.hold(), in.layout.rows[lane], x, plan.tiling.tile, engine.kernels.bf16};
  }
  void step(std::size_t c, std::int32_t lane, std::uint32_t first, std::uint32_t count,
            const HeldTile& held, MutableTile out, std::int64_t width) const {
    plan.step(engine.kernels, in.chunks[c], lane, first, count, held, out, width);
  }

  /// The one-lane tasks: work(task, rows, clock) each, with rows held on its own thread.
  template <typename Work>
  void one_lane_tasks(Work&& work) {
    engine.arena.execute([&] {
      parallel_for(
          std::int64_t{0}, plan.tiling.tasks(1),
          [&](std::int64_t task) {
            TaskClock clock(in.busy[task], in.spans[task]);
            HeldRows rows = held_rows(0);
            work(task, rows, clock);
          },
          /*one_task_each=*/true);
    });
  }

  /// ForwardSchedule::taken_as_computed: each task claims the next chunk as it arrives.
  void taken_as_computed() {
    std::atomic<std::size_t> next_chunk{0};
    one_lane_tasks([&](std::int64_t /*task*/, HeldRows& rows, TaskClock& clock) {
      const HeldTile held = rows.hold(0, plan.tiling.width(0));
      for (;;) {
        const std::size_t c = next_chunk.fetch_add(1, std::memory_order_relaxed);
        if (!in.intake.arrive(c, &clock)) break;
        in.intake.take(c);
        const StreamChunk& chunk = *in.chunks[c].chunk;
        step(c, 0, 0, chunk.outputs, held, {y.row(chunk.first_output), y.stride},
             plan.tiling.width(0));
      }
    });
    in.intake.finish();
  }

  /// ForwardSchedule::one_lane_pieces. Items are (tile, piece), numbered tile by tile;
  /// block q's are those of its tiles. Each task first computes its block's first tile
  /// as the stream arrives (the block's tasks claim its chunks in order), then works
  /// through the rest of its block from the front, then takes what is left of the
  /// others' from the back, so it packs tiles their owners will not reach; an item is
  /// claimed once, and a side stops where it finds the other's claim. Every item writes
  /// its own part of Y the same way whoever runs it: results stay bitwise reproducible.
  void one_lane_pieces() {
    const TokenTiling& tiling = plan.tiling;
    std::vector<std::atomic<std::size_t>> first_tile_chunk(static_cast<std::size_t>(tiling.blocks));
    // Known once the stream has arrived: set up by the first task past its first tile.
    std::once_flag counted;
    std::vector<StreamPiece> pieces;
    std::int64_t per_tile = 0;
    std::vector<std::atomic<std::uint8_t>> claimed;
    std::vector<std::atomic<std::int64_t>> front(static_cast<std::size_t>(tiling.blocks));
    std::vector<std::atomic<std::int64_t>> back(static_cast<std::size_t>(tiling.blocks));
    auto count_items = [&] {
      pieces = stream_pieces(in.chunks);
      per_tile = static_cast<std::int64_t>(pieces.size());
      claimed =
          std::vector<std::atomic<std::uint8_t>>(static_cast<std::size_t>(tiling.count * per_tile));
      for (std::int32_t q = 0; q < tiling.blocks; ++q) {  // the first tiles are done
        const std::int64_t lo = tiling.first_tile(q) * per_tile;
        for (std::int64_t i = lo; i < lo + per_tile; ++i)
          claimed[static_cast<std::size_t>(i)].store(1);
        front[static_cast<std::size_t>(q)].store(per_tile);
      }
    };
    auto claim = [&](std::int64_t item) {
      return claimed[static_cast<std::size_t>(item)].exchange(1, std::memory_order_relaxed) == 0;
    };
    one_lane_tasks([&](std::int64_t task, HeldRows& rows, TaskClock& clock) {
      const std::int32_t home = tiling.task(task, 1).block;
      std::int64_t held_tile = tiling.first_tile(home);
      HeldTile held = rows.hold(tiling.begin(held_tile), tiling.width(held_tile));
      auto& next = first_tile_chunk[static_cast<std::size_t>(home)];
      for (std::size_t c = next.fetch_add(1, std::memory_order_relaxed);
           in.intake.arrive(c, &clock); c = next.fetch_add(1, std::memory_order_relaxed)) {
        const auto outputs = static_cast<std::uint32_t>(in.chunks[c].chunk->outputs);
        for (std::uint32_t r = 0; r < outputs; r += kPieceOutputs) {
          run_piece({c, r, std::min(kPieceOutputs, outputs - r)}, held_tile, held);
        }
      }
      std::call_once(counted, count_items);
      auto run = [&](std::int64_t item) {
        const std::int64_t t = item / per_tile;
        if (t != held_tile) held = rows.hold(tiling.begin(t), tiling.width(t));
        held_tile = t;
        run_piece(pieces[static_cast<std::size_t>(item % per_tile)], t, held);
      };
      for (std::int32_t k = 0; k < tiling.blocks; ++k) {
        const std::int32_t q = (home + k) % tiling.blocks;
        const std::int64_t lo = tiling.first_tile(q) * per_tile;
        const std::int64_t hi = tiling.first_tile(q + 1) * per_tile;
        auto& taken = (k == 0 ? front : back)[static_cast<std::size_t>(q)];
        for (;;) {
          const std::int64_t n = taken.fetch_add(1, std::memory_order_relaxed);
          const std::int64_t item = k == 0 ? lo + n : hi - 1 - n;
          if (item < lo || item >= hi || !claim(item)) break;
          run(item);
        }
      }
    });
  }
  void run_piece(const StreamPiece& piece, std::int64_t t, const HeldTile& held) const {
    const TokenTiling& tiling = plan.tiling;
    const std::int64_t row = in.chunks[piece.chunk].chunk->first_output + piece.first;
    step(piece.chunk, 0, piece.first, piece.count, held, {y.row(row) + tiling.begin(t), y.stride},
         tiling.width(t));
  }

  /// ForwardSchedule::lanes_in_ring.
  void lanes_in_ring(const Placement* next_placement) {
    const TokenTiling& tiling = plan.tiling;
    const std::int32_t P = static_cast<std::int32_t>(in.layout.rows.size());
    LastLaneRingSum ring(engine.lane_partial_scratch, P, tiling.count, in.chunks.size(), y,
                         next_placement);
    engine.arena.execute([&] {
      parallel_for(
          std::int64_t{0}, tiling.tasks(P),
          [&](std::int64_t task) {
            const TokenTiling::Task here = tiling.task(task, P);
            const std::int32_t p = here.lane, q = here.block, share = here.share;
            const std::size_t c_end = tiling.first_chunk(share + 1, in.chunks.size());
            const TaskClock clock(in.busy[task], in.spans[task]);
            HeldRows rows = held_rows(p);
            for (std::int64_t t = tiling.first_tile(q); t < tiling.first_tile(q + 1); ++t) {
              const std::int64_t t0 = tiling.begin(t), width = tiling.width(t);
              const HeldTile held = rows.hold(t0, width);
              for (std::size_t c = tiling.first_chunk(share, in.chunks.size()); c < c_end; ++c) {
                const StreamChunk& chunk = *in.chunks[c].chunk;
                step(c, p, 0, chunk.outputs, held, ring.lane_rows(p, chunk.first_output, t0),
                     width);
                ring.lane_done(t, c, chunk, t0, width);
              }
            }
          },
          /*one_task_each=*/true);
    });
  }
};

}  // namespace

void forward_pass(EngineState& engine, const ForwardPlan& plan, const ProductInputs& in,
                  ConstMatrixView x, MutableMatrixView y, const Placement* next_placement) {
  Forward pass{engine, plan, in, x, y};
  switch (plan.schedule) {
    case ForwardSchedule::taken_as_computed:
      return pass.taken_as_computed();
    case ForwardSchedule::one_lane_pieces:
      return pass.one_lane_pieces();
    case ForwardSchedule::lanes_in_ring:
      return pass.lanes_in_ring(next_placement);
  }
}

}  // namespace sluice::detail
