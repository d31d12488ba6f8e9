// TieredModelMemory's interface: creating and opening a store, adding layers, streams,
// gradients and a step's commit (the cache is tiered_cache.cpp, the work per chunk
// tiered_update.cpp).
#include "sluice/tiered_model_memory.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <utility>

#include "model_memory/checkpoint_io.hpp"
#include "model_memory/layer_streams.hpp"
#include "model_memory/model_sections.hpp"
#include "model_memory/placement_cache.hpp"
#include "model_memory/tiered_model_memory_state.hpp"

namespace sluice {
namespace {
using detail::Clock;
using detail::forward_bytes;
using detail::layer_name;
using detail::remove_quietly;
using detail::seconds_since;
using detail::spill_path;
using detail::transposed_bytes;
using detail::update_bytes;
}  // namespace

TieredModelMemory::TieredModelMemory(std::filesystem::path directory, std::int64_t budget_bytes)
    : state_(std::make_unique<State>()) {
  State& st = *state_;
  if (budget_bytes <= 0) {
    throw ArgumentError("TieredModelMemory: the budget must be positive, got " +
                        std::to_string(budget_bytes) + " bytes");
  }
  st.dir = std::move(directory);
  st.budget = budget_bytes;
  std::error_code created, ignored;
  std::filesystem::create_directories(st.dir, created);
  if (!std::filesystem::is_directory(st.dir, ignored)) {
    if (std::filesystem::exists(st.dir, ignored)) {
      throw IoError("model store: " + st.dir.string() + " is a file, not a directory");
    }
    throw IoError("model store: cannot create the directory " + st.dir.string() +
                  (created ? ": " + created.message() : ""));
  }
  st.lock.emplace(st.dir);
  if (!std::filesystem::exists(detail::manifest_path(st.dir))) {
    detail::write_manifest(st.dir, st.manifest);
    st.config = st.manifest.config;
    return;
  }
  st.manifest = detail::read_manifest(st.dir);
  st.config = st.manifest.config;
  seed = st.manifest.seed;
  epochs = st.manifest.epochs;
  dynamic = st.manifest.dynamic;
  model = st.manifest.model;
  class_names = st.manifest.class_names;
  input_mean = st.manifest.input_mean;
  input_scale = st.manifest.input_scale;
  training_data = st.manifest.training_data;
  for (std::size_t l = 0; l < st.manifest.layers.size(); ++l) {
    const LayerShape& s = st.manifest.layers[l].shape;
    if (working_set_bytes(s) > budget_bytes) {
      throw ResourceError("model store " + st.dir.string() + ": " +
                          layer_name(static_cast<std::int32_t>(l)) + " (" + std::to_string(s.rows) +
                          "x" + std::to_string(s.cols) + ", " + std::to_string(s.nnz) +
                          " non-zeros) needs " + std::to_string(working_set_bytes(s)) +
                          " bytes of RAM at once; the budget is " + std::to_string(budget_bytes));
    }
    st.layers.push_back(std::make_unique<detail::TieredLayer>());
  }
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(st.layers.size()); ++l) st.verify_layer(l);
  st.remove_leftovers();
}

TieredModelMemory::~TieredModelMemory() {
  try {
    discard_step_impl();
    state_->remove_spares();
  } catch (...) {  // leftovers are removed when the store opens next
  }
}

bool TieredModelMemory::holds_store(const std::filesystem::path& directory) {
  std::error_code ec;
  return std::filesystem::is_regular_file(detail::manifest_path(directory), ec);
}

const std::filesystem::path& TieredModelMemory::directory() const {
  return state_->dir;
}

std::int64_t TieredModelMemory::budget_bytes() const {
  return state_->budget;
}

std::int64_t TieredModelMemory::ram_budget_bytes_impl() const {
  return state_->budget;
}

namespace {

/// The layer of `manifest` that needs the most RAM at once, and how much.
std::pair<std::int32_t, std::int64_t> largest_working_set(const detail::Manifest& manifest) {
  std::pair<std::int32_t, std::int64_t> largest{0, 0};
  for (std::size_t l = 0; l < manifest.layers.size(); ++l) {
    const std::int64_t w = TieredModelMemory::working_set_bytes(manifest.layers[l].shape);
    if (w > largest.second) largest = {static_cast<std::int32_t>(l), w};
  }
  return largest;
}

}  // namespace

std::int64_t TieredModelMemory::reservable_ram_bytes_impl() const {
  return std::max<std::int64_t>(0, state_->budget - largest_working_set(state_->manifest).second);
}

void TieredModelMemory::reserve_ram_bytes_impl(std::int64_t bytes) {
  State& st = *state_;
  // A reserve cut short would leave the trainer's streams outside the budget, and the
  // process over it by as much: the budget would not be what it says.
  if (bytes > reservable_ram_bytes_impl()) {
    const auto [layer, largest] = largest_working_set(st.manifest);
    throw ResourceError("model store " + st.dir.string() + ": a budget of " +
                        std::to_string(st.budget) + " bytes holds " + layer_name(layer) +
                        "'s working set (" + std::to_string(largest) + " bytes) but not the " +
                        std::to_string(bytes) +
                        " bytes the trainer holds beside it (its streams and gradients); "
                        "it needs at least " +
                        std::to_string(largest + bytes));
  }
  std::lock_guard lock(st.mutex);
  st.reserved = std::max<std::int64_t>(bytes, 0);
  st.make_room(0, -1, st.capacity());  // what is cached beyond the new capacity goes now
}

bool TieredModelMemory::by_input_from_ram_impl() const {
  State& st = *state_;
  std::int64_t pieces = 0, largest_update = 0;
  for (const detail::ManifestLayer& m : st.manifest.layers) {
    pieces += forward_bytes(m.shape) + transposed_bytes(m.shape);
    largest_update = std::max(largest_update, update_bytes(m.shape));
  }
  std::lock_guard lock(st.mutex);
  return pieces + largest_update <= st.capacity();
}

std::int64_t TieredModelMemory::working_set_bytes(const LayerShape& shape) {
  return forward_bytes(shape) + transposed_bytes(shape) + update_bytes(shape);
}

ModelStoreCounters TieredModelMemory::counters() const {
  const State& st = *state_;
  ModelStoreCounters c;
  c.read_bytes = st.io.read_bytes;
  c.write_bytes = st.io.write_bytes;
  c.read_seconds = st.io.read_seconds;
  c.write_seconds = st.io.write_seconds;
  c.wait_seconds = st.wait_seconds;
  std::error_code ec;
  c.store_bytes = std::filesystem::file_size(detail::manifest_path(st.dir), ec);
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(st.manifest.layers.size()); ++l) {
    c.store_bytes += std::filesystem::file_size(st.pattern_file(l), ec);
    c.store_bytes += std::filesystem::file_size(
        detail::state_path(st.dir, l, st.manifest.layers[l].generation), ec);
  }
  return c;
}

namespace {

/// A ModelMemory's public fields into the manifest about to be written. ShapeError, before
/// anything is written, for a model description, class names, input scaling or training
/// data's name a manifest cannot hold.
void stamp(detail::Manifest& next, const ModelMemory& memory) {
  detail::require_storable_model(memory.model, "model store");
  detail::require_storable_class_names(memory.class_names, "model store");
  detail::require_storable_input_scaling(memory.input_mean, memory.input_scale, "model store");
  detail::require_storable_training_data(memory.training_data, "model store");
  next.seed = memory.seed;
  next.epochs = memory.epochs;
  next.dynamic = memory.dynamic;
  next.model = memory.model;
  next.class_names = memory.class_names;
  next.input_mean = memory.input_mean;
  next.input_scale = memory.input_scale;
  next.training_data = memory.training_data;
}

}  // namespace

std::int32_t TieredModelMemory::add_layer_impl(CsrMatrix weights, std::vector<float> bias) {
  State& st = *state_;
  const LayerShape s{weights.rows(), weights.cols(), weights.nnz(),
                     static_cast<std::int64_t>(bias.size())};
  if (working_set_bytes(s) > st.budget - st.reserved) {
    throw ResourceError(
        "add_layer: a " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + " layer with " +
        std::to_string(s.nnz) + " non-zeros needs " + std::to_string(working_set_bytes(s)) +
        " bytes of RAM at once; the model store's budget is " + std::to_string(st.budget) +
        (st.reserved > 0 ? ", of which a trainer holds " + std::to_string(st.reserved) : ""));
  }
  detail::refuse_if_pending(st.layers, "add_layer");
  detail::Manifest next = st.manifest;
  stamp(next, *this);
  const auto l = static_cast<std::int32_t>(st.layers.size());
  auto t = std::make_shared<TransposedPattern>(transposed_pattern(weights));
  detail::write_pattern(detail::pattern_path(st.dir, l, 0), weights, *t);
  const std::int64_t generation = st.manifest.next_generation;
  {
    detail::StateWriter out(detail::state_path(st.dir, l, generation),
                            detail::StateLayout::of(s.nnz, s.bias, 0), st.io);
    out.write(0, 0, weights.values());
    out.write(1, 0, bias);
    out.finish();
  }
  detail::fsync_directory(st.dir, "model store");
  next.layers.push_back({s, 0, generation, false});
  next.next_generation = generation + 1;
  // Everything that can fail comes before the commit; after it, nothing does.
  auto layer = std::make_unique<detail::TieredLayer>();
  layer->column_counts = weights.column_counts();
  layer->bias = std::move(bias);
  for (int k = 0; k < st.slots(); ++k) layer->bias_state[k].assign(layer->bias.size(), 0.0F);
  auto w = std::make_shared<CsrMatrix>(std::move(weights));
  st.layers.reserve(st.layers.size() + 1);
  detail::write_manifest(st.dir, next);
  {
    std::lock_guard lock(st.mutex);
    st.manifest = std::move(next);
    const std::int64_t bytes = forward_bytes(s) + transposed_bytes(s);
    if (st.used + bytes <= st.capacity()) {  // just written: keep it while there is room
      layer->forward = std::move(w);
      layer->transposed = std::move(t);
      layer->values_generation = generation;
      layer->last_use = ++st.clock;
      st.used += bytes;
    }
    st.layers.push_back(std::move(layer));
  }
  detail::fsync_directory(st.dir, "model store");
  return l;
}

std::int32_t TieredModelMemory::layer_count_impl() const {
  return static_cast<std::int32_t>(state_->layers.size());
}

LayerShape TieredModelMemory::layer_shape_impl(std::int32_t layer) const {
  return state_->shape(layer);
}

const std::vector<float>& TieredModelMemory::bias_impl(std::int32_t layer) const {
  return state_->layers[layer]->bias;
}

const Placement& TieredModelMemory::placement_impl(std::int32_t layer, std::int32_t lanes) {
  detail::TieredLayer& l = *state_->layers[layer];
  return detail::cached_placement(l.placement_mutex, l.placements, l.column_counts, lanes);
}

void TieredModelMemory::stream_to_impl(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                                       std::size_t chunk_packets, Precision precision,
                                       StreamOrder order) const {
  const bool by_input = order == StreamOrder::by_input;
  const State::Pin pin = state_->acquire(layer, by_input, 0);
  detail::encode_layer(*pin.w, pin.t.get(), kind, channel, chunk_packets, precision, order);
}

// A gradient is updated from at once where it can be: without clipping and not to be
// added to. Else it waits in the layer's spill file (the last step's, written over) for
// the clipping norm or the next micro-batch, and commit_step updates from it.
void TieredModelMemory::take_gradient(std::int32_t layer, const WeightStream& gradient,
                                      std::span<const float> bias_gradient, bool add) {
  struct ReleaseAfter {  // what this update and the cache's evictions freed
    State& st;
    ~ReleaseAfter() { st.release_freed_heap(); }
  } release_after{*state_};
  const auto start = Clock::now();
  State& st = *state_;
  detail::TieredLayer& l = *st.layers[layer];
  std::lock_guard lock(l.pending_mutex);
  detail::TieredPending& p = l.pending;
  if (p.submitted && !add) {
    throw ShapeError("submit_gradient: " + layer_name(layer) +
                     " already has a gradient for this step (commit_step first, or "
                     "accumulate_gradient to add to it)");
  }
  if (p.submitted && p.computed) {
    throw ShapeError("accumulate_gradient: " + layer_name(layer) +
                     ": the update of the gradient submit_gradient handed in is computed, so a "
                     "model store cannot add to it (hand every micro-batch in by "
                     "accumulate_gradient)");
  }
  const LayerShape& s = st.shape(layer);
  const bool by_input = gradient.header.by_input();
  std::lock_guard update_lock(st.update_mutex);
  State::Pin pin = st.acquire(layer, by_input, st.update_room(layer));
  detail::UpdateBuffers& buffers = st.update_buffers_for(layer, pin);
  // Not zero-filled: the scan writes every element or throws (the layer's mask is checked).
  const auto n = static_cast<std::size_t>(s.nnz);
  float* const g = buffers.gradient.data();
  double sum_of_squares = detail::scan_gradient(layer, gradient, *pin.w, pin.t.get(), g);
  pin.release_transposed();
  const bool adding = p.submitted;
  const bool bad_before = adding && !p.finite;  // the sum stays non-finite
  const bool hold = add || st.config.clip_global_norm > 0;
  try {
    if (adding && p.spilled) {
      st.add_spilled_gradient(layer, buffers, g);
      sum_of_squares = 0;
      for (std::size_t i = 0; i < n; ++i) sum_of_squares += static_cast<double>(g[i]) * g[i];
    }
    if (adding) {
      for (std::size_t i = 0; i < bias_gradient.size(); ++i) p.bias_gradient[i] += bias_gradient[i];
    } else {
      p.bias_gradient.assign(bias_gradient.begin(), bias_gradient.end());
    }
    for (float x : p.bias_gradient) sum_of_squares += static_cast<double>(x) * x;
    p.sum_of_squares = sum_of_squares;
    p.finite = !bad_before && std::isfinite(sum_of_squares);
    p.computed = false;
    if (p.finite && !hold) {
      st.write_update(layer, pin.w->values(), buffers, true,
                      detail::scheduled_learning_rate(st.config, st.manifest.step + 1), 1.0);
    } else if (p.finite) {
      const std::filesystem::path spill = spill_path(st.dir, layer);  // the last step's, reused
      detail::StateWriter out(spill, detail::StateLayout::of(s.nnz, 0, 0), st.io,
                              detail::StateWriter::Durability::scratch, spill);
      out.write(0, 0, {g, n});
      out.finish();
      p.spilled = true;
    }
  } catch (...) {
    p = {};  // an added gradient whose sum could not be kept drops the layer's step
    throw;
  }
  p.seconds += seconds_since(start);
  p.submitted = true;
}

void TieredModelMemory::submit_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                             std::span<const float> bias_gradient) {
  take_gradient(layer, gradient, bias_gradient, false);
}

void TieredModelMemory::accumulate_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                                 std::span<const float> bias_gradient) {
  take_gradient(layer, gradient, bias_gradient, true);
}

void TieredModelMemory::discard_step_impl() {
  for (std::int32_t i = 0; i < layer_count_impl(); ++i) discard_gradient_impl(i);
}

void TieredModelMemory::discard_gradient_impl(std::int32_t layer) {
  State& st = *state_;
  detail::TieredLayer& l = *st.layers[layer];
  std::lock_guard lock(l.pending_mutex);
  if (l.pending.computed) {
    remove_quietly(detail::state_path(st.dir, layer, st.manifest.next_generation));
    std::lock_guard cache_lock(st.mutex);  // values the update left in the cache
    if (l.values_generation == st.manifest.next_generation) l.values_generation = -1;
  }
  if (l.pending.spilled) remove_quietly(spill_path(st.dir, layer));
  l.pending = {};
}

StepReport TieredModelMemory::commit_step_impl() {
  const auto start = Clock::now();
  State& st = *state_;
  StepReport report;
  report.step = st.manifest.step;
  std::vector<std::int32_t> submitted;
  double sum_of_squares = 0, submit_seconds = 0;
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(st.layers.size()); ++i) {
    const detail::TieredPending& p = st.layers[i]->pending;
    if (!p.submitted) continue;
    submitted.push_back(i);
    sum_of_squares += p.sum_of_squares;
    submit_seconds += p.seconds;
    if (!p.finite) report.bad_layers.push_back(i);
  }
  report.gradient_norm = std::sqrt(sum_of_squares);
  auto finish = [&] { report.seconds = submit_seconds + seconds_since(start); };
  if (submitted.empty()) {
    finish();
    return report;
  }
  try {
    const bool clip = st.config.clip_global_norm > 0;
    const bool any_held = std::any_of(submitted.begin(), submitted.end(), [&](std::int32_t i) {
      return st.layers[i]->pending.spilled;
    });
    if (report.bad_layers.empty() && any_held) {
      // Clipping needs the norm over all layers, known only now, and micro-batches' sums
      // are complete only now: each such layer's gradient comes back from its file.
      const double scale =
          clip ? std::min(1.0, st.config.clip_global_norm / (report.gradient_norm + 1e-6)) : 1.0;
      const double learning_rate = detail::scheduled_learning_rate(st.config, st.manifest.step + 1);
      for (std::int32_t i : submitted) {
        if (!st.layers[i]->pending.spilled) continue;
        std::lock_guard update_lock(st.update_mutex);
        State::Pin pin = st.acquire(i, false, st.update_room(i));
        st.write_update(i, pin.w->values(), st.update_buffers_for(i, pin), false, learning_rate,
                        scale);
      }
    }
    for (std::int32_t i : submitted) {
      const detail::TieredPending& p = st.layers[i]->pending;
      if (report.bad_layers.empty() && !p.computed && p.finite) {
        throw Error("commit_step: internal error: update of " + layer_name(i) + " not computed");
      }
      if (report.bad_layers.empty() && !p.finite) report.bad_layers.push_back(i);
    }
  } catch (...) {
    discard_step_impl();
    throw;
  }
  if (!report.bad_layers.empty()) {
    discard_step_impl();
    finish();
    if (st.manifest.policy == NonFinitePolicy::error) {
      detail::throw_skipped_step(report.bad_layers, st.manifest.step + 1);
    }
    return report;
  }

  // The commit: the new state files' names made durable, then the manifest naming them
  // renamed over the old one.
  detail::Manifest next = st.manifest;
  // Each update took its layer's spare; the committed files become the new spares.
  std::vector<std::filesystem::path> spares;
  for (std::int32_t i : submitted) {
    detail::ManifestLayer& m = next.layers[i];
    spares.push_back(detail::state_path(st.dir, i, m.generation));
    m.generation = st.manifest.next_generation;
    m.updates += 1;
    m.has_state = true;
  }
  next.step += 1;
  next.next_generation += 1;
  try {
    stamp(next, *this);
    detail::fsync_directory(st.dir, "model store");
    detail::write_manifest(st.dir, next);
  } catch (...) {
    discard_step_impl();
    throw;
  }
  {
    std::lock_guard lock(st.mutex);
    st.manifest = std::move(next);  // cached values of the updated layers are now stale
  }
  for (std::size_t k = 0; k < submitted.size(); ++k) {
    detail::TieredLayer& l = *st.layers[submitted[k]];
    std::swap(l.bias, l.pending.new_bias);
    for (int s = 0; s < st.slots(); ++s) std::swap(l.bias_state[s], l.pending.new_bias_state[s]);
    l.spare = std::move(spares[k]);  // the spill stays too, for the next step's to write over
    l.pending = {};
  }
  report.applied = true;
  report.step = st.manifest.step;
  detail::fsync_directory(st.dir, "model store");  // if it throws, the step stays committed
  finish();
  return report;
}

// A mask change commits on its own, as a step does: the new pattern and state files of a
// new generation, then the manifest naming them.
void TieredModelMemory::regrow_impl(std::int32_t layer, std::span<const std::int64_t> grow) {
  State& st = *state_;
  detail::TieredLayer& c = *st.layers[layer];
  {
    std::lock_guard lock(c.pending_mutex);
    if (c.pending.submitted) {
      throw ShapeError("regrow: " + layer_name(layer) +
                       " has a gradient waiting for commit_step (change masks between steps)");
    }
  }
  const LayerShape& s = st.shape(layer);
  st.drop_transposed(layer);  // rebuilt for the new mask: its room goes to the new pieces
  // Room for the new mask and its transpose and for where each new weight was; between
  // steps, so the trainer's reserve too.
  const State::Pin pin =
      st.acquire(layer, false, forward_bytes(s) + transposed_bytes(s) + 8 * s.nnz, true);
  const auto drop = detail::smallest_magnitudes(*pin.w, static_cast<std::int64_t>(grow.size()));
  detail::MaskChange change = detail::prune_and_regrow(*pin.w, drop, grow);
  const std::int64_t generation = st.manifest.next_generation;
  const std::filesystem::path pattern = detail::pattern_path(st.dir, layer, generation);
  detail::Manifest next = st.manifest;
  stamp(next, *this);
  // What the new mask needs in RAM is made before the commit: after it nothing may fail.
  std::vector<std::filesystem::path> old_files{st.pattern_file(layer), st.state_file(layer)};
  std::vector<std::int64_t> column_counts = change.weights.column_counts();
  std::map<std::int32_t, Placement> placements;
  {
    std::lock_guard lock(c.placement_mutex);
    for (const auto& [lanes, p] : c.placements) {
      placements.emplace(lanes, round_robin_placement(column_counts, lanes));
    }
  }
  std::shared_ptr<CsrMatrix> forward;
  try {
    detail::write_pattern(pattern, change.weights, transposed_pattern(change.weights));
    st.write_mask_change(layer, change, generation);
    detail::fsync_directory(st.dir, "model store");
    detail::ManifestLayer& m = next.layers[layer];
    m.generation = generation;
    m.pattern_generation = generation;
    next.next_generation = generation + 1;
    forward = std::make_shared<CsrMatrix>(std::move(change.weights));  // the same bytes
    detail::write_manifest(st.dir, next);
  } catch (...) {
    remove_quietly(pattern);
    remove_quietly(detail::state_path(st.dir, layer, generation));
    throw;
  }
  {
    std::lock_guard lock(st.mutex);
    st.manifest = std::move(next);
    c.forward = std::move(forward);
    c.values_generation = generation;
  }
  {
    // In place: placements handed out before stay valid and see the new mask (between
    // steps no engine asks for one, so none was added since).
    std::lock_guard lock(c.placement_mutex);
    c.column_counts = std::move(column_counts);
    for (auto& [lanes, p] : c.placements) p = std::move(placements[lanes]);
  }
  st.remove_in_background(std::move(old_files));  // as a step's commit does
  detail::fsync_directory(st.dir, "model store");
}

void TieredModelMemory::commit_counters() {
  State& st = *state_;
  detail::Manifest next = st.manifest;
  stamp(next, *this);
  detail::write_manifest(st.dir, next);
  {
    std::lock_guard lock(st.mutex);
    st.manifest = std::move(next);
  }
  detail::fsync_directory(st.dir, "model store");
}

void TieredModelMemory::set_optimizer_impl(const OptimizerConfig& config) {
  State& st = *state_;
  detail::refuse_if_pending(st.layers, "set_optimizer");
  // Adam and AdamW keep the same moments; switching to or from SGD starts the new
  // optimizer from zero: the layers' files keep their values and their state is ignored.
  const int slots = detail::optimizer_slot_count(config.kind);
  const bool reset = slots != st.slots();
  detail::Manifest next = st.manifest;
  next.config = config;
  next.config.schedule = nullptr;
  if (reset) {
    for (detail::ManifestLayer& m : next.layers) {
      m.has_state = false;
      m.updates = 0;
    }
  }
  // Made before the commit: after it nothing may fail.
  OptimizerConfig taken = config;
  std::vector<std::array<std::vector<float>, detail::kMaxOptimizerSlots>> bias_states;
  for (std::size_t l = 0; reset && l < st.layers.size(); ++l) {
    auto& fresh = bias_states.emplace_back();
    for (int k = 0; k < slots; ++k) fresh[k].assign(st.layers[l]->bias.size(), 0.0F);
  }
  detail::write_manifest(st.dir, next);
  {
    std::lock_guard lock(st.mutex);
    st.manifest = std::move(next);
    st.config = std::move(taken);
    for (std::size_t l = 0; l < bias_states.size(); ++l) {
      std::swap(st.layers[l]->bias_state, bias_states[l]);
    }
  }
  detail::fsync_directory(st.dir, "model store");
}

const OptimizerConfig& TieredModelMemory::optimizer_impl() const {
  return state_->config;
}

void TieredModelMemory::set_non_finite_policy_impl(NonFinitePolicy policy) {
  State& st = *state_;
  detail::Manifest next = st.manifest;
  next.policy = policy;
  detail::write_manifest(st.dir, next);
  {
    std::lock_guard lock(st.mutex);
    st.manifest = std::move(next);
  }
  detail::fsync_directory(st.dir, "model store");
}

std::int64_t TieredModelMemory::step_impl() const {
  return state_->manifest.step;
}

void TieredModelMemory::save_impl(const std::filesystem::path& path) const {
  throw UnsupportedError("save " + path.string() + ": a TieredModelMemory is its own checkpoint (" +
                         state_->dir.string() + "); copy the directory instead");
}

void TieredModelMemory::load_impl(const std::filesystem::path& path) {
  throw UnsupportedError("load " + path.string() +
                         ": a TieredModelMemory loads its store when it is opened; open a "
                         "TieredModelMemory on the store directory instead");
}

}  // namespace sluice
