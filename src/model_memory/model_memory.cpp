#include "sluice/model_memory.hpp"

#include <tbb/blocked_range.h>
#include "core/huge_pages.hpp"
#include "core/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>
#include <utility>

#include "model_memory/host_model_memory_state.hpp"
#include "model_memory/layer_streams.hpp"
#include "model_memory/mask_update.hpp"
#include "model_memory/optimizer_kernels.hpp"
#include "model_memory/placement_cache.hpp"

namespace sluice {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

using detail::layer_name;

void check_stream_kind(StreamKind kind, const char* where) {
  if (kind != StreamKind::weights && kind != StreamKind::mask) {
    throw ArgumentError(std::string(where) + ": ModelMemory streams weights or masks, not kind " +
                        std::to_string(static_cast<std::uint32_t>(kind)));
  }
}

}  // namespace

// --- ModelMemory: argument checks, then the implementation ---------------------------

void ModelMemory::check_layer(std::int32_t layer) const {
  const std::int32_t count = layer_count_impl();
  if (layer < 0 || layer >= count) {
    throw ArgumentError("ModelMemory: " + layer_name(layer) + " out of range (" +
                        std::to_string(count) + " layers)");
  }
}

std::int32_t ModelMemory::add_layer(CsrMatrix weights, std::vector<float> bias) {
  weights.validate();
  if (weights.rows() > std::numeric_limits<std::uint32_t>::max() ||
      weights.cols() > static_cast<std::int64_t>(kControlBit)) {
    throw ShapeError("add_layer: " + std::to_string(weights.rows()) + "x" +
                     std::to_string(weights.cols()) +
                     " is too large for a stream (at most 2^32-1 outputs and 2^31 inputs)");
  }
  if (!bias.empty() && static_cast<std::int64_t>(bias.size()) != weights.rows()) {
    throw ShapeError("add_layer: bias has " + std::to_string(bias.size()) +
                     " elements, the weights have " + std::to_string(weights.rows()) + " rows");
  }
  for (std::size_t i = 0; i < bias.size(); ++i) {
    if (!std::isfinite(bias[i])) {
      throw FormatError("add_layer: bias[" + std::to_string(i) + "] = " + std::to_string(bias[i]) +
                        " is not finite");
    }
  }
  if (layer_count_impl() == std::numeric_limits<std::int32_t>::max()) {
    throw ResourceError("add_layer: too many layers");
  }
  return add_layer_impl(std::move(weights), std::move(bias));
}

LayerShape ModelMemory::layer_shape(std::int32_t layer) const {
  check_layer(layer);
  return layer_shape_impl(layer);
}

const CsrMatrix& ModelMemory::weights(std::int32_t layer) const {
  check_layer(layer);
  return weights_impl(layer);
}

const CsrMatrix& ModelMemory::weights_impl(std::int32_t layer) const {
  throw ShapeError("weights: " + layer_name(layer) +
                   " is not held in RAM by this ModelMemory; stream it instead");
}

const TransposedPattern& ModelMemory::transposed_impl(std::int32_t layer) const {
  throw ShapeError("transposed: " + layer_name(layer) +
                   " is not held in RAM by this ModelMemory; stream it by input instead");
}

const std::vector<float>& ModelMemory::bias(std::int32_t layer) const {
  check_layer(layer);
  return bias_impl(layer);
}

const Placement& ModelMemory::placement(std::int32_t layer, std::int32_t lanes) {
  check_layer(layer);
  if (lanes < 1) {
    throw ArgumentError("placement: " + layer_name(layer) + ": needs at least one lane, got " +
                        std::to_string(lanes));
  }
  return placement_impl(layer, lanes);
}

StreamHeader ModelMemory::stream_header(std::int32_t layer, StreamKind kind, Precision precision,
                                        StreamOrder order) const {
  check_layer(layer);
  const LayerShape s = layer_shape_impl(layer);
  if (kind == StreamKind::gradient) {
    // What the engines send back: fp32 whatever the weights streamed in.
    StreamHeader h =
        stream_header_for(s.rows, s.cols, s.nnz, StreamKind::weights, Precision::fp32, order);
    h.kind = kind;
    return h;
  }
  check_stream_kind(kind, "stream_header");
  return stream_header_for(s.rows, s.cols, s.nnz, kind, precision, order);
}

WeightStream ModelMemory::stream(std::int32_t layer, StreamKind kind, Precision precision,
                                 StreamOrder order) const {
  check_layer(layer);
  check_stream_kind(kind, "stream");
  WeightStream out;
  const LayerShape s = layer_shape_impl(layer);
  out.header = stream_header_for(s.rows, s.cols, s.nnz, kind, precision, order);
  StreamChannel channel(std::numeric_limits<std::size_t>::max());
  stream_to(layer, kind, channel, kDefaultChunkPackets, precision, order);
  while (ChunkPtr chunk = channel.pop()) out.chunks.push_back(std::move(chunk));
  return out;
}

const TransposedPattern& ModelMemory::transposed(std::int32_t layer) const {
  check_layer(layer);
  return transposed_impl(layer);
}

void ModelMemory::stream_to(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                            std::size_t chunk_packets, Precision precision,
                            StreamOrder order) const {
  try {
    check_layer(layer);
    check_stream_kind(kind, "stream_to");
    if (chunk_packets == 0) throw ArgumentError("stream_to: chunk_packets must be at least 1");
    const LayerShape shape = layer_shape_impl(layer);
    // Refuses what cannot be streamed so before the implementation fetches anything.
    stream_header_for(shape.rows, shape.cols, shape.nnz, kind, precision, order);
    stream_to_impl(layer, kind, channel, chunk_packets, precision, order);
    channel.close();
  } catch (...) {
    channel.fail(std::current_exception());
  }
}

void ModelMemory::check_gradient(const char* who, std::int32_t layer, const WeightStream& gradient,
                                 std::span<const float> bias_gradient) const {
  check_layer(layer);
  const LayerShape w = layer_shape_impl(layer);
  const StreamHeader& h = gradient.header;
  if (h.kind != StreamKind::gradient) {
    throw FormatError(std::string(who) + ": " + layer_name(layer) + ": stream kind " +
                      std::to_string(static_cast<std::uint32_t>(h.kind)) +
                      " is not a gradient stream");
  }
  // Gradients always travel in fp32 packets; the header must say so, and so must they.
  const bool bf16_packets =
      std::any_of(gradient.chunks.begin(), gradient.chunks.end(),
                  [](const ChunkPtr& c) { return c != nullptr && !c->packets_bf16.empty(); });
  if (h.precision != Precision::fp32 || bf16_packets) {
    throw FormatError(std::string(who) + ": " + layer_name(layer) +
                      ": gradient streams must be fp32 (the header says " + to_string(h.precision) +
                      (bf16_packets ? ", the chunks hold bf16)" : ")"));
  }
  if (h.order != StreamOrder::by_output && h.order != StreamOrder::by_input) {
    throw FormatError(std::string(who) + ": " + layer_name(layer) + ": unknown stream order " +
                      std::to_string(static_cast<std::uint32_t>(h.order)));
  }
  if (h.layer_outputs() != static_cast<std::uint64_t>(w.rows) ||
      h.layer_inputs() != static_cast<std::uint64_t>(w.cols) ||
      h.nnz != static_cast<std::uint64_t>(w.nnz)) {
    throw FormatError(std::string(who) + ": " + layer_name(layer) + ": gradient stream is for a " +
                      std::to_string(h.layer_outputs()) + "x" + std::to_string(h.layer_inputs()) +
                      " layer with " + std::to_string(h.nnz) + " non-zeros (" + to_string(h.order) +
                      "), the layer is " + std::to_string(w.rows) + "x" + std::to_string(w.cols) +
                      " with " + std::to_string(w.nnz));
  }
  const auto bias_size = static_cast<std::size_t>(w.bias);
  if (bias_gradient.size() != bias_size) {
    throw ShapeError(std::string(who) + ": " + layer_name(layer) + ": bias gradient has " +
                     std::to_string(bias_gradient.size()) + " elements, the bias has " +
                     std::to_string(bias_size));
  }
}

void ModelMemory::submit_gradient(std::int32_t layer, const WeightStream& gradient,
                                  std::span<const float> bias_gradient) {
  check_gradient("submit_gradient", layer, gradient, bias_gradient);
  submit_gradient_impl(layer, gradient, bias_gradient);
}

void ModelMemory::accumulate_gradient(std::int32_t layer, const WeightStream& gradient,
                                      std::span<const float> bias_gradient) {
  check_gradient("accumulate_gradient", layer, gradient, bias_gradient);
  accumulate_gradient_impl(layer, gradient, bias_gradient);
}

StepReport ModelMemory::commit_step() {
  return commit_step_impl();
}

void ModelMemory::discard_step() {
  discard_step_impl();
}

void ModelMemory::discard_gradient(std::int32_t layer) {
  check_layer(layer);
  discard_gradient_impl(layer);
}

void ModelMemory::regrow(std::int32_t layer, std::span<const std::int64_t> grow) {
  check_layer(layer);
  const LayerShape w = layer_shape_impl(layer);
  if (static_cast<std::int64_t>(grow.size()) > w.nnz) {
    throw ShapeError("regrow: " + layer_name(layer) + ": " + std::to_string(grow.size()) +
                     " positions to grow, but only " + std::to_string(w.nnz) + " weights to drop");
  }
  const std::int64_t cells = w.rows * w.cols;
  for (std::size_t i = 0; i < grow.size(); ++i) {
    if (grow[i] < 0 || grow[i] >= cells || (i > 0 && grow[i] <= grow[i - 1])) {
      throw ArgumentError("regrow: " + layer_name(layer) + ": position " + std::to_string(grow[i]) +
                          " (entry " + std::to_string(i) + ") is out of range [0, " +
                          std::to_string(cells) + ") or not increasing");
    }
  }
  if (grow.empty()) return;
  regrow_impl(layer, grow);
  ++mask_generation_;
}

void ModelMemory::regrow_impl(std::int32_t layer, std::span<const std::int64_t> /*grow*/) {
  throw Error("regrow: " + layer_name(layer) + ": this ModelMemory cannot change masks");
}

void ModelMemory::set_optimizer(const OptimizerConfig& config) {
  detail::validate_optimizer_config(config);
  set_optimizer_impl(config);
}

const OptimizerConfig& ModelMemory::optimizer() const {
  return optimizer_impl();
}

void ModelMemory::set_non_finite_policy(NonFinitePolicy policy) {
  if (policy != NonFinitePolicy::skip_step && policy != NonFinitePolicy::error) {
    throw ArgumentError("set_non_finite_policy: unknown policy " +
                        std::to_string(static_cast<int>(policy)));
  }
  set_non_finite_policy_impl(policy);
}

std::int64_t ModelMemory::step() const {
  return step_impl();
}

void ModelMemory::save(const std::filesystem::path& path) const {
  if (path.empty()) throw ArgumentError("save: empty checkpoint path");
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) {
    throw ArgumentError("save checkpoint " + path.string() +
                        ": it is not a file (a directory, device or pipe), which saving would "
                        "replace");
  }
  save_impl(path);
}

void ModelMemory::load(const std::filesystem::path& path) {
  if (path.empty()) throw ArgumentError("load: empty checkpoint path");
  load_impl(path);
  ++mask_generation_;
}

// --- HostModelMemory -----------------------------------------------------------------

namespace detail {

void reset_optimizer_state(HostLayer& layer, int slots) {
  const auto nnz = static_cast<std::size_t>(layer.weights.nnz());
  for (int s = 0; s < kMaxOptimizerSlots; ++s) {
    if (s < slots) {
      layer.state[s].clear();  // zeros: resize_for_overwrite value-initialises new elements
      resize_for_overwrite(layer.state[s], nnz);
      layer.bias_state[s].assign(layer.bias.size(), 0.0F);
    } else {
      layer.state[s] = {};
      layer.bias_state[s] = {};
    }
  }
  layer.updates = 0;
}

namespace {

constexpr std::size_t kOptimizerGrain = 1 << 14;

// Computes the layer's update from pending.gradient into the pending buffers; records
// whether everything stayed finite.
void compute_update(HostLayer& layer, const OptimizerConfig& config, double learning_rate,
                    double gradient_scale) {
  PendingUpdate& p = layer.pending;
  const int slots = optimizer_slot_count(config.kind);
  const auto nnz = layer.weights.values().size();
  const auto bias_size = layer.bias.size();
  resize_for_overwrite(p.new_values, nnz);
  p.new_bias.resize(bias_size);
  for (int s = 0; s < slots; ++s) {
    resize_for_overwrite(p.new_state[s], nnz);
    p.new_bias_state[s].resize(bias_size);
  }
  const UpdateScalars scalars =
      make_update_scalars(config, learning_rate, layer.updates + 1, gradient_scale);

  UpdateArrays weights;
  weights.weights = layer.weights.values().data();
  weights.gradient = p.gradient.data();
  weights.new_weights = p.new_values.data();
  UpdateArrays bias;
  bias.weights = layer.bias.data();
  bias.gradient = p.bias_gradient.data();
  bias.new_weights = p.new_bias.data();
  for (int s = 0; s < slots; ++s) {
    weights.state[s] = layer.state[s].data();
    weights.new_state[s] = p.new_state[s].data();
    bias.state[s] = layer.bias_state[s].data();
    bias.new_state[s] = p.new_bias_state[s].data();
  }

  std::atomic<bool> finite{true};
  if (nnz <= kOptimizerGrain) {
    finite = optimizer_update(scalars, weights, 0, nnz);
  } else {
    detail::parallel_for_ranges(0, nnz, kOptimizerGrain, [&](std::size_t lo, std::size_t hi) {
      if (!optimizer_update(scalars, weights, lo, hi)) {
        finite.store(false, std::memory_order_relaxed);
      }
    });
  }
  const bool bias_finite = optimizer_update(scalars, bias, 0, bias_size);
  p.finite = finite.load() && bias_finite;
  p.computed = true;
}

void discard(PendingUpdate& p) {
  p.submitted = false;
  p.computed = false;
  p.finite = true;
  p.sum_of_squares = 0;
  p.seconds = 0;
}

}  // namespace
}  // namespace detail

HostModelMemory::HostModelMemory() : state_(std::make_unique<State>()) {}
HostModelMemory::~HostModelMemory() = default;

std::int32_t HostModelMemory::add_layer_impl(CsrMatrix weights, std::vector<float> bias) {
  auto layer = std::make_unique<detail::HostLayer>();
  layer->weights = std::move(weights);
  layer->bias = std::move(bias);
  detail::reset_optimizer_state(*layer, detail::optimizer_slot_count(state_->config.kind));
  state_->layers.push_back(std::move(layer));
  return static_cast<std::int32_t>(state_->layers.size() - 1);
}

std::int32_t HostModelMemory::layer_count_impl() const {
  return static_cast<std::int32_t>(state_->layers.size());
}

LayerShape HostModelMemory::layer_shape_impl(std::int32_t layer) const {
  const detail::HostLayer& l = *state_->layers[layer];
  return {l.weights.rows(), l.weights.cols(), l.weights.nnz(),
          static_cast<std::int64_t>(l.bias.size())};
}

void HostModelMemory::stream_to_impl(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                                     std::size_t chunk_packets, Precision precision,
                                     StreamOrder order) const {
  const TransposedPattern* t = order == StreamOrder::by_input ? &transposed_impl(layer) : nullptr;
  detail::encode_layer(state_->layers[layer]->weights, t, kind, channel, chunk_packets, precision,
                       order);
}

const CsrMatrix& HostModelMemory::weights_impl(std::int32_t layer) const {
  return state_->layers[layer]->weights;
}

const std::vector<float>& HostModelMemory::bias_impl(std::int32_t layer) const {
  return state_->layers[layer]->bias;
}

const TransposedPattern& HostModelMemory::transposed_impl(std::int32_t layer) const {
  detail::HostLayer& l = *state_->layers[layer];
  std::lock_guard lock(l.placement_mutex);
  if (!l.transposed) {
    l.transposed = std::make_unique<TransposedPattern>(transposed_pattern(l.weights));
  }
  return *l.transposed;
}

const Placement& HostModelMemory::placement_impl(std::int32_t layer, std::int32_t lanes) {
  detail::HostLayer& l = *state_->layers[layer];
  return detail::cached_placement(l.placement_mutex, l.placements, l.weights, lanes);
}

namespace {

// Hands a layer its gradient. The first of a step is scanned into place; a later one (only
// when `add`) into scratch, checked whole before it is added, so a rejected stream leaves
// the sum as it was. A submitted gradient's update does not depend on the other layers
// without clipping, so it is computed now, while the engines work on the next layer; an
// accumulated one's waits for commit_step, computed once from the whole sum (a trainer's
// backward passes would otherwise pay an update each).
void take_gradient(detail::HostLayer& l, std::int32_t layer, const WeightStream& gradient,
                   const TransposedPattern* transposed, std::span<const float> bias_gradient,
                   const OptimizerConfig& config, std::int64_t next_step, bool add) {
  const auto start = Clock::now();
  std::lock_guard lock(l.pending_mutex);
  detail::PendingUpdate& p = l.pending;
  if (p.submitted && !add) {
    throw ShapeError("submit_gradient: " + detail::layer_name(layer) +
                     " already has a gradient for this step (commit_step first, or "
                     "accumulate_gradient to add to it)");
  }
  const bool update_now = config.clip_global_norm == 0 && !add;
  // A schedule that throws does so before anything is taken.
  const double learning_rate = update_now ? detail::scheduled_learning_rate(config, next_step) : 0;
  const std::size_t n = l.weights.values().size();
  double sum_of_squares = 0;
  if (!p.submitted) {
    detail::resize_for_overwrite(p.gradient, n);  // scan_gradient writes all
    sum_of_squares =
        detail::scan_gradient(layer, gradient, l.weights, transposed, p.gradient.data());
    p.bias_gradient.assign(bias_gradient.begin(), bias_gradient.end());
    p.seconds = 0;
  } else {
    std::vector<float> more;
    detail::resize_for_overwrite(more, n);
    detail::scan_gradient(layer, gradient, l.weights, transposed, more.data());
    for (std::size_t i = 0; i < n; ++i) {
      p.gradient[i] += more[i];
      sum_of_squares += static_cast<double>(p.gradient[i]) * p.gradient[i];
    }
    for (std::size_t i = 0; i < bias_gradient.size(); ++i) p.bias_gradient[i] += bias_gradient[i];
  }
  for (float g : p.bias_gradient) sum_of_squares += static_cast<double>(g) * g;
  p.sum_of_squares = sum_of_squares;
  p.finite = std::isfinite(sum_of_squares);
  p.computed = false;
  p.submitted = true;  // an update that fails to allocate is computed again at commit_step
  if (p.finite && update_now) detail::compute_update(l, config, learning_rate, 1.0);
  p.seconds += seconds_since(start);
}

}  // namespace

void HostModelMemory::submit_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                           std::span<const float> bias_gradient) {
  const TransposedPattern* t = gradient.header.by_input() ? &transposed_impl(layer) : nullptr;
  take_gradient(*state_->layers[layer], layer, gradient, t, bias_gradient, state_->config,
                state_->step + 1, false);
}

void HostModelMemory::accumulate_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                               std::span<const float> bias_gradient) {
  const TransposedPattern* t = gradient.header.by_input() ? &transposed_impl(layer) : nullptr;
  take_gradient(*state_->layers[layer], layer, gradient, t, bias_gradient, state_->config,
                state_->step + 1, true);
}

void HostModelMemory::discard_step_impl() {
  for (std::int32_t i = 0; i < layer_count_impl(); ++i) discard_gradient_impl(i);
}

void HostModelMemory::discard_gradient_impl(std::int32_t layer) {
  detail::HostLayer& l = *state_->layers[layer];
  std::lock_guard lock(l.pending_mutex);
  detail::discard(l.pending);
}

StepReport HostModelMemory::commit_step_impl() {
  const auto start = Clock::now();
  State& st = *state_;
  StepReport report;
  report.step = st.step;

  std::vector<std::int32_t> submitted;
  double sum_of_squares = 0;
  double submit_seconds = 0;
  for (std::size_t i = 0; i < st.layers.size(); ++i) {
    detail::HostLayer& l = *st.layers[i];
    std::lock_guard lock(l.pending_mutex);
    if (!l.pending.submitted) continue;
    submitted.push_back(static_cast<std::int32_t>(i));
    sum_of_squares += l.pending.sum_of_squares;
    submit_seconds += l.pending.seconds;
    if (!l.pending.finite) report.bad_layers.push_back(static_cast<std::int32_t>(i));
  }
  report.gradient_norm = std::sqrt(sum_of_squares);
  auto discard_all = [&] {
    for (std::int32_t i : submitted) detail::discard(st.layers[i]->pending);
  };
  auto finish = [&] { report.seconds = submit_seconds + seconds_since(start); };
  // Nothing submitted: nothing to apply, and the step count stays.
  if (submitted.empty()) {
    finish();
    return report;
  }

  const OptimizerConfig& config = st.config;
  if (report.bad_layers.empty()) {
    // Clipping needs the norm over all layers, known only now; without it, an update is
    // computed here where its gradient was accumulated or its submit could not finish it.
    try {
      const double scale =
          config.clip_global_norm > 0
              ? std::min(1.0, config.clip_global_norm / (report.gradient_norm + 1e-6))
              : 1.0;
      const double learning_rate = detail::scheduled_learning_rate(config, st.step + 1);
      for (std::int32_t i : submitted) {
        if (config.clip_global_norm > 0 || !st.layers[i]->pending.computed) {
          detail::compute_update(*st.layers[i], config, learning_rate, scale);
        }
      }
    } catch (...) {
      discard_all();
      throw;
    }
    // An update can overflow even from a finite gradient; such a layer is bad too.
    for (std::int32_t i : submitted) {
      const detail::PendingUpdate& p = st.layers[i]->pending;
      if (!p.computed) {
        discard_all();
        throw Error("commit_step: internal error: update of " + layer_name(i) + " not computed");
      }
      if (!p.finite) report.bad_layers.push_back(i);
    }
  }

  if (!report.bad_layers.empty()) {
    discard_all();
    finish();
    if (st.policy == NonFinitePolicy::error) {
      detail::throw_skipped_step(report.bad_layers, st.step + 1);
    }
    return report;
  }

  const int slots = detail::optimizer_slot_count(config.kind);
  for (std::int32_t i : submitted) {
    detail::HostLayer& l = *st.layers[i];
    detail::PendingUpdate& p = l.pending;
    // Swapping keeps the old arrays as next step's staging buffers.
    std::swap(l.weights.values(), p.new_values);
    std::swap(l.bias, p.new_bias);
    for (int s = 0; s < slots; ++s) {
      std::swap(l.state[s], p.new_state[s]);
      std::swap(l.bias_state[s], p.new_bias_state[s]);
    }
    ++l.updates;
    detail::discard(p);
  }
  ++st.step;
  report.applied = true;
  report.step = st.step;
  finish();
  return report;
}

void HostModelMemory::regrow_impl(std::int32_t layer, std::span<const std::int64_t> grow) {
  detail::HostLayer& l = *state_->layers[layer];
  {
    std::lock_guard lock(l.pending_mutex);
    if (l.pending.submitted) {
      throw ShapeError("regrow: " + layer_name(layer) +
                       " has a gradient waiting for commit_step (change masks between steps)");
    }
  }
  // Everything new is built first: a throw leaves the layer as it was.
  const auto drop = detail::smallest_magnitudes(l.weights, static_cast<std::int64_t>(grow.size()));
  detail::MaskChange change = detail::prune_and_regrow(l.weights, drop, grow);
  std::array<std::vector<float>, detail::kMaxOptimizerSlots> state;
  const int slots = detail::optimizer_slot_count(state_->config.kind);
  for (int s = 0; s < slots; ++s) state[s] = detail::carry_over(l.state[s], change.source);
  std::lock_guard lock(l.placement_mutex);
  std::vector<Placement> placements;
  for (const auto& [lanes, p] : l.placements) {
    placements.push_back(round_robin_placement(change.weights, lanes));
  }
  std::unique_ptr<TransposedPattern> transposed;
  if (l.transposed) {
    transposed = std::make_unique<TransposedPattern>(transposed_pattern(change.weights));
  }
  l.weights = std::move(change.weights);
  for (int s = 0; s < slots; ++s) l.state[s] = std::move(state[s]);
  // In place: references handed out before stay valid and see the new mask.
  std::size_t i = 0;
  for (auto& entry : l.placements) entry.second = std::move(placements[i++]);
  if (transposed) *l.transposed = std::move(*transposed);
}

void HostModelMemory::set_optimizer_impl(const OptimizerConfig& config) {
  State& st = *state_;
  detail::refuse_if_pending(st.layers, "set_optimizer");
  // Adam and AdamW keep the same moments, so switching between them keeps the state;
  // switching to or from SGD starts the new optimizer from zero.
  const int slots = detail::optimizer_slot_count(config.kind);
  if (slots != detail::optimizer_slot_count(st.config.kind)) {
    for (auto& layer : st.layers) detail::reset_optimizer_state(*layer, slots);
  }
  st.config = config;
}

const OptimizerConfig& HostModelMemory::optimizer_impl() const {
  return state_->config;
}

void HostModelMemory::set_non_finite_policy_impl(NonFinitePolicy policy) {
  state_->policy = policy;
}

std::int64_t HostModelMemory::step_impl() const {
  return state_->step;
}

}  // namespace sluice
