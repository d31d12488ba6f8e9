// CpuEngine: the engine on this machine's cores, a thin front over a product's plan and
// its passes (src/engine/).
//
// Mapping of the wafer's design onto a CPU:
// * A lane task (p, q) plays engine row p on token block q. Its activation tile (the
//   rows of X it owns x `tile_tokens` tokens) is sized to stay in the core's cache while
//   the whole layer's stream flows past it, once per tile (TilingPolicy, ResidentTile).
// * The intake takes the stream as it arrives (lanes compute the first chunks while later
//   ones are produced), checks each chunk and routes its packets to the lanes that own their
//   input features (Intake).
// * A product's plan (plan.hpp) decides once per call how the lanes hold the activations,
//   which kernel each step calls and which schedule runs the tasks; the passes
//   (forward, backward by output, backward by input) execute it, and GradientOut lays
//   out the weight-gradient stream.
// * With several lanes, a carriage return ends a lane's accumulation for one output into
//   partial rows of its own; the last lane to finish a chunk adds all lanes' partial rows
//   in ring order (LastLaneRingSum). No lane ever waits for another, and the summation
//   order is fixed, so results are bitwise reproducible whatever the thread timing.
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/clock.hpp"
#include "engine/dense_path.hpp"
#include "engine/engine_state.hpp"
#include "engine/gradient_out.hpp"
#include "engine/holding.hpp"
#include "engine/intake.hpp"
#include "engine/passes.hpp"
#include "engine/plan.hpp"
#include "engine/resident_tile.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/path_cost.hpp"
#include "sluice/topology.hpp"

namespace sluice {
namespace {

using detail::Clock;
using detail::seconds_since;

/// Pins each thread that joins the engine's arena to a core of its own.
class PinningObserver final : public tbb::task_scheduler_observer {
 public:
  explicit PinningObserver(tbb::task_arena& arena) : tbb::task_scheduler_observer(arena) {
    observe(true);
  }
  ~PinningObserver() override { observe(false); }
  void on_scheduler_entry(bool) override {
    pin_current_thread_to_core(tbb::this_task_arena::current_thread_index());
  }
};

/// A product's stream, the lanes' computing time, and how much of the stream's arrival
/// they computed through.
void count_product(EngineCounters& counters, const std::vector<detail::TakenChunk>& chunks,
                   const detail::Intake& intake, const std::vector<double>& busy,
                   const std::vector<std::vector<detail::Span>>& spans) {
  for (const auto& c : chunks) {
    counters.packets += c.chunk->size();
    counters.bytes += c.chunk->byte_size();
  }
  for (double b : busy) counters.busy_seconds += b;
  const detail::Span arrival = intake.arrival();
  counters.stream_arrival_seconds += detail::seconds_between(arrival.begin, arrival.end);
  counters.overlapped_seconds += detail::covered_seconds(spans, arrival);
}

}  // namespace

struct CpuEngine::Impl {
  Impl(const EngineOptions& options, Isa isa, std::int32_t threads, std::int64_t tile_cache_bytes)
      : options(options),
        isa(isa),
        threads(threads),
        state({options.geometry, threads, tile_cache_bytes}, isa, threads) {
    // Read here, so a bad SLUICE_PATH_COSTS file fails the engine, not its first product.
    if (options.path == ProductPath::automatic) path_costs = PathCosts::for_this_cpu();
  }
  EngineOptions options;
  PathCosts path_costs;
  Isa isa;
  std::int32_t threads;
  detail::EngineState state;
  std::unique_ptr<PinningObserver> pinning;
};

CpuEngine::CpuEngine(EngineOptions options) {
  const Isa isa = options.isa.value_or(default_isa());
  if (!cpu_supports(isa)) {
    throw UnsupportedError(std::string("this CPU cannot run the ") + to_string(isa) + " kernels");
  }
  if (options.threads < 0) throw ArgumentError("engine threads must be >= 0");
  const std::int32_t threads =
      options.threads > 0 ? options.threads : tbb::this_task_arena::max_concurrency();
  const std::int64_t cache =
      options.tile_cache_bytes > 0 ? options.tile_cache_bytes : topology().cache_share_bytes();
  const Geometry& g = options.geometry;
  if (g.lanes < 0 || g.blocks < 0 || g.tile_tokens < 0 || g.shares < 0) {
    throw ArgumentError("engine geometry must not be negative: " + g.to_string());
  }
  impl_ = std::make_unique<Impl>(options, isa, threads, cache);
  impl_->state.arena.initialize(threads);
  if (options.pin_threads) impl_->pinning = std::make_unique<PinningObserver>(impl_->state.arena);
}

CpuEngine::~CpuEngine() = default;

bool CpuEngine::packs_tiles(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs) {
  return detail::packs_tiles(lanes, nnz, inputs);
}

bool CpuEngine::holds_bf16(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs,
                           std::int64_t tokens) {
  return detail::holds_bf16(lanes, nnz, inputs, tokens);
}

Isa CpuEngine::isa() const {
  return impl_->isa;
}
std::int32_t CpuEngine::threads() const {
  return impl_->threads;
}

Geometry CpuEngine::geometry_for(std::int64_t outputs, std::int64_t inputs, std::int64_t tokens,
                                 Precision precision, std::uint64_t nnz) const {
  (void)outputs;
  return impl_->state.policy.geometry_for(inputs, tokens, precision, nnz);
}

ProductPath CpuEngine::path_for(const StreamHeader& header, std::int64_t tokens) const {
  if (impl_->options.path != ProductPath::automatic) return impl_->options.path;
  return impl_->path_costs.choose(header.layer_outputs(), header.layer_inputs(),
                                  static_cast<double>(header.nnz), tokens, header.precision,
                                  impl_->threads);
}

void CpuEngine::on_engine_threads(const std::function<void()>& fn) {
  impl_->state.arena.execute(fn);
}

void CpuEngine::forward_impl(StreamSource& weights, const Placement& placement, ConstMatrixView x,
                             MutableMatrixView y, const Placement* next_placement) {
  detail::EngineState& engine = impl_->state;
  if (path_for(weights.header(), x.cols) == ProductPath::dense) {
    detail::DensePath(engine.arena).forward(weights, x, y, counters_);
    return;
  }
  const auto t_intake = Clock::now();
  const detail::LaneLayout layout(placement);
  detail::TakenChunks taken(engine.spare_shares);
  detail::Intake intake(taken, weights, placement, layout, false);
  const detail::ForwardPlan plan = detail::plan_forward(engine.policy, weights.header(),
                                                        placement.lanes, x.cols, y.rows, intake);
  // One lane computes chunks as they arrive; several wait for the whole stream (their
  // ring sum is laid out per chunk).
  const bool live =
      x.cols > 0 && y.rows > 0 && plan.schedule != detail::ForwardSchedule::lanes_in_ring;
  if (live) {
    intake.start_live(plan.schedule == detail::ForwardSchedule::one_lane_pieces);
  } else {
    engine.arena.execute([&] { intake.take_all(); });
  }
  counters_.intake_seconds += seconds_since(t_intake);
  if (x.cols == 0 || y.rows == 0) return;

  const auto tasks = static_cast<std::size_t>(plan.tiling.tasks(placement.lanes));
  std::vector<double> busy(tasks, 0.0);
  std::vector<std::vector<detail::Span>> spans(tasks);
  detail::forward_pass(engine, plan, {layout, intake, taken.chunks, busy, spans, live}, x, y,
                       next_placement);
  count_product(counters_, taken.chunks, intake, busy, spans);
}

WeightStream CpuEngine::backward_impl(StreamSource& weights, const Placement& placement,
                                      const ConstMatrixView* x, ConstMatrixView dy,
                                      MutableMatrixView* dx) {
  detail::EngineState& engine = impl_->state;
  const StreamHeader header = weights.header();
  if (path_for(header, dy.cols) == ProductPath::dense) {
    return detail::DensePath(engine.arena).backward(weights, x, dy, dx, counters_);
  }
  const bool want_grad = x != nullptr;
  // By input, one lane holds dY: the placement is checked, not used.
  const Placement one_lane =
      header.by_input() ? Placement::single_lane(header.inputs) : Placement{};
  const Placement& lanes_of = header.by_input() ? one_lane : placement;
  const std::int32_t P = lanes_of.lanes;
  detail::BackwardPlan plan = detail::plan_backward(engine.policy, header, P, dy.cols);

  const auto t_intake = Clock::now();
  const detail::LaneLayout layout(lanes_of);
  detail::TakenChunks taken(engine.spare_shares);
  detail::Intake intake(taken, weights, lanes_of, layout, P > 1);
  detail::complete_backward_plan(plan, engine.policy, P, want_grad, intake);
  std::optional<detail::GradientOut> gradient;
  if (want_grad) gradient.emplace(engine, plan, P, taken.chunks, header);
  std::function<void(std::size_t)> add_gradient;
  if (gradient) add_gradient = [&](std::size_t c) { gradient->add(c); };
  // By input the first tile's tasks compute chunks as they arrive (those tasks that can
  // before the chunks are counted); by output the dX pass waits for the whole stream.
  const bool live = plan.by_input && dy.cols > 0 && detail::TaskChunks::live(plan.weight_tiling, P);
  if (live) {
    intake.start_live(!plan.taken_as_computed, add_gradient);
  } else {
    engine.arena.execute([&] {
      if (plan.taken_as_computed) {
        intake.pull_all();
      } else {
        intake.take_all();
      }
    });
    if (add_gradient) {
      for (std::size_t c = 0; c < taken.chunks.size(); ++c) add_gradient(c);
    }
  }
  counters_.intake_seconds += seconds_since(t_intake);

  const auto tasks =
      static_cast<std::size_t>(std::max(plan.data_tiling.tasks(P), plan.weight_tiling.tasks(P)));
  std::vector<double> busy(tasks, 0.0);
  std::vector<std::vector<detail::Span>> spans(tasks);
  if (dy.cols > 0) {
    const detail::ProductInputs in{layout, intake, taken.chunks, busy, spans, live};
    detail::GradientOut* out = gradient ? &*gradient : nullptr;
    if (plan.by_input) {
      detail::backward_by_input_pass(engine, plan, in, x, dy, dx, out);
    } else {
      detail::backward_by_output_pass(engine, plan, in, x, dy, dx, out);
    }
  }
  count_product(counters_, taken.chunks, intake, busy, spans);
  if (!want_grad) return {};

  gradient->lay_out(dy.cols);
  WeightStream out = gradient->stream(header);
  counters_.bytes += out.byte_size();  // the gradient stream going out
  return out;
}

}  // namespace sluice
