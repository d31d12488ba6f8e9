#include "sluice/tiered_model_memory.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <utility>

#include "core/parallel.hpp"
#include "model_memory/checkpoint_io.hpp"
#include "model_memory/layer_streams.hpp"
#include "model_memory/model_store_files.hpp"
#include "model_memory/optimizer_kernels.hpp"

namespace sluice {
namespace {

using Clock = std::chrono::steady_clock;
using detail::layer_name;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Elements the optimizer reads, updates and writes at a time: large sequential I/O
/// while its buffers stay a small part of a layer.
constexpr std::int64_t kUpdateChunk = std::int64_t{1} << 21;
constexpr std::size_t kOptimizerGrain = 1 << 14;

std::int64_t forward_bytes(const LayerShape& s) {
  return 8 * (s.rows + 1) + 8 * s.nnz;  // offsets, indices, values
}
std::int64_t transposed_bytes(const LayerShape& s) {
  return 8 * (s.cols + 1) + 8 * s.nnz;  // offsets, indices, positions
}
std::int64_t update_bytes(const LayerShape& s) {
  const std::int64_t chunk = std::min(s.nnz, kUpdateChunk);
  return 4 * s.nnz + 4 * chunk * (2 + 2 * detail::kMaxOptimizerSlots);
}

std::filesystem::path spill_path(const std::filesystem::path& dir, std::int32_t l) {
  char name[64];
  std::snprintf(name, sizeof name, "layer-%06d.gradient", l);
  return dir / name;
}

void remove_quietly(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::remove(path, ec);
}

}  // namespace

namespace detail {

struct TieredPending {
  bool submitted = false;
  bool finite = true;
  bool computed = false;  ///< the new state file is written
  bool spilled = false;   ///< the gradient waits in a file for the clipping norm
  double sum_of_squares = 0;
  double seconds = 0;
  std::vector<float> bias_gradient;
  std::vector<float> new_bias;
  std::array<std::vector<float>, kMaxOptimizerSlots> new_bias_state;
};

struct TieredLayer {
  std::vector<float> bias;  ///< committed; biases stay in RAM (one float per output)
  std::array<std::vector<float>, kMaxOptimizerSlots> bias_state;
  std::vector<std::int64_t> column_counts;  ///< for placements
  std::mutex placement_mutex;
  std::map<std::int32_t, Placement> placements;
  // The cache (under State::mutex): pieces are shared while a stream or update uses them.
  std::shared_ptr<CsrMatrix> forward;  ///< mask and values of generation values_generation
  std::int64_t values_generation = -1;
  std::shared_ptr<TransposedPattern> transposed;
  std::uint64_t last_use = 0;
  bool loading = false;
  std::mutex pending_mutex;
  TieredPending pending;
};

}  // namespace detail

struct TieredModelMemory::State {
  std::filesystem::path dir;
  std::int64_t budget = 0;
  detail::Manifest manifest;
  OptimizerConfig config;  ///< the manifest's, with the schedule
  std::vector<std::unique_ptr<detail::TieredLayer>> layers;
  detail::IoCounters io;
  std::atomic<double> wait_seconds{0};

  std::mutex mutex;  ///< the cache: pieces, `used`, `loading`, `last_use`
  std::condition_variable changed;
  std::int64_t used = 0;
  std::uint64_t clock = 0;

  const LayerShape& shape(std::int32_t l) const { return manifest.layers[l].shape; }
  int slots() const { return detail::optimizer_slot_count(config.kind); }
  detail::StateLayout committed_layout(std::int32_t l) const {
    const detail::ManifestLayer& m = manifest.layers[l];
    return detail::StateLayout::of(m.shape.nnz, m.shape.bias, m.has_state ? slots() : 0);
  }

  /// A layer's pieces in use: held, they cannot be evicted; `reserved` bytes of the
  /// budget are the holder's own buffers.
  struct Pin {
    State* st = nullptr;
    std::shared_ptr<const CsrMatrix> w;
    std::shared_ptr<const TransposedPattern> t;
    std::int64_t reserved = 0;
    Pin() = default;
    Pin(Pin&& o) noexcept
        : st(std::exchange(o.st, nullptr)),
          w(std::move(o.w)),
          t(std::move(o.t)),
          reserved(o.reserved) {}
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;
    ~Pin() {
      if (st == nullptr) return;
      std::lock_guard lock(st->mutex);
      w.reset();
      t.reset();
      st->used -= reserved;
      st->changed.notify_all();
    }
  };

  /// Frees unused pieces of other layers, least recently used first, until `need` more
  /// bytes fit; false if they do not.
  bool make_room(std::int64_t need, std::int32_t keep) {
    while (used + need > budget) {
      detail::TieredLayer* victim = nullptr;
      bool transposed = false;
      for (std::size_t i = 0; i < layers.size(); ++i) {
        detail::TieredLayer& c = *layers[i];
        if (static_cast<std::int32_t>(i) == keep || c.loading) continue;
        const bool f = c.forward && c.forward.use_count() == 1;
        const bool t = c.transposed && c.transposed.use_count() == 1;
        if ((f || t) && (victim == nullptr || c.last_use < victim->last_use)) {
          victim = &c;
          transposed = t;  // the transpose first: the forward needs only the mask
        }
      }
      if (victim == nullptr) return false;
      const LayerShape& s = shape(
          static_cast<std::int32_t>(std::find_if(layers.begin(), layers.end(),
                                                 [&](const auto& p) { return p.get() == victim; }) -
                                    layers.begin()));
      if (transposed) {
        victim->transposed.reset();
        used -= transposed_bytes(s);
      } else {
        victim->forward.reset();
        used -= forward_bytes(s);
      }
    }
    return true;
  }

  Pin acquire(std::int32_t l, bool want_transposed, std::int64_t extra);
  void load(std::int32_t l, bool mask, bool values, bool transposed);
  void write_update(std::int32_t l, std::span<const float> values, const float* gradient,
                    double learning_rate, double scale);
  void verify_layer(std::int32_t l);
  void remove_leftovers();
};

TieredModelMemory::State::Pin TieredModelMemory::State::acquire(std::int32_t l,
                                                                bool want_transposed,
                                                                std::int64_t extra) {
  const auto start = Clock::now();
  bool waited = false;
  std::unique_lock lock(mutex);
  detail::TieredLayer& c = *layers[l];
  const LayerShape& s = shape(l);
  for (;;) {
    if (c.loading) {
      waited = true;
      changed.wait(lock);
      continue;
    }
    const std::int64_t generation = manifest.layers[l].generation;
    const bool need_mask = !c.forward;
    const bool stale = c.forward && c.values_generation != generation;
    const bool need_t = want_transposed && !c.transposed;
    if (stale && c.forward.use_count() > 1) {  // still streamed with the old values
      waited = true;
      changed.wait(lock);
      continue;
    }
    const std::int64_t need =
        (need_mask ? forward_bytes(s) : 0) + (need_t ? transposed_bytes(s) : 0) + extra;
    const std::int64_t held =
        (c.forward ? forward_bytes(s) : 0) + (c.transposed ? transposed_bytes(s) : 0);
    if (held + need > budget) {
      throw ResourceError("model store: " + layer_name(l) + " needs " +
                          std::to_string(held + need) + " bytes at once, over the budget of " +
                          std::to_string(budget));
    }
    if (!make_room(need, l)) {
      waited = true;
      changed.wait(lock);
      continue;
    }
    used += need;
    if (need_mask || stale || need_t) {
      c.loading = true;
      lock.unlock();
      try {
        load(l, need_mask, need_mask || stale, need_t);
      } catch (...) {
        lock.lock();
        c.loading = false;
        used -= need;
        changed.notify_all();
        throw;
      }
      lock.lock();
      c.loading = false;
      c.values_generation = generation;
      waited = true;
      changed.notify_all();
    }
    c.last_use = ++clock;
    Pin pin;
    pin.st = this;
    pin.w = c.forward;
    if (want_transposed) pin.t = c.transposed;
    pin.reserved = extra;
    if (waited) wait_seconds = wait_seconds + seconds_since(start);
    return pin;
  }
}

// Reads the pieces asked for into the layer's cache slots (marked loading, so no other
// thread touches them).
void TieredModelMemory::State::load(std::int32_t l, bool mask, bool values, bool transposed) {
  detail::TieredLayer& c = *layers[l];
  const LayerShape& s = shape(l);
  const auto start = Clock::now();
  if (mask || transposed) {
    auto w = mask ? std::make_shared<CsrMatrix>() : nullptr;
    auto t = transposed ? std::make_shared<TransposedPattern>() : nullptr;
    io.read_bytes += detail::read_pattern(detail::pattern_path(dir, l), s, w.get(), t.get());
    io.read_seconds = io.read_seconds + seconds_since(start);
    if (w) c.forward = std::move(w);
    if (t) c.transposed = std::move(t);
  }
  if (values) {
    detail::StateReader in(detail::state_path(dir, l, manifest.layers[l].generation),
                           committed_layout(l), io);
    std::uint32_t crc = 0;
    in.read(committed_layout(l).values, 0, c.forward->values(), crc);
    in.check_crc(committed_layout(l).values, crc, "VALS");
    in.drop_cache();
  }
}

// Computes the layer's update chunk by chunk — values from `values`, gradient from
// `gradient` (or the layer's spill file if null), optimizer state from its committed
// file — into a state file of the next generation. Sets the pending update's flags.
void TieredModelMemory::State::write_update(std::int32_t l, std::span<const float> values,
                                            const float* gradient, double learning_rate,
                                            double scale) {
  detail::TieredLayer& c = *layers[l];
  detail::TieredPending& p = c.pending;
  const detail::ManifestLayer& m = manifest.layers[l];
  const int n_slots = slots();
  const std::int64_t nnz = m.shape.nnz;
  const detail::StateLayout in_layout = committed_layout(l);
  std::optional<detail::StateReader> in;
  if (m.has_state) in.emplace(detail::state_path(dir, l, m.generation), in_layout, io);
  std::optional<detail::StateReader> spill;
  detail::StateLayout spill_layout = detail::StateLayout::of(nnz, 0, 0);
  if (gradient == nullptr) {
    spill.emplace(spill_path(dir, l), spill_layout, io);
  }
  detail::StateWriter out(detail::state_path(dir, l, manifest.next_generation),
                          detail::StateLayout::of(nnz, m.shape.bias, n_slots), io);
  const detail::UpdateScalars scalars =
      detail::make_update_scalars(config, learning_rate, m.updates + 1, scale);

  const auto chunk = static_cast<std::size_t>(std::min(nnz, kUpdateChunk));
  std::vector<float> grad(gradient == nullptr ? chunk : 0), new_values(chunk);
  std::array<std::vector<float>, detail::kMaxOptimizerSlots> state, new_state;
  std::array<std::uint32_t, detail::kMaxOptimizerSlots> crcs{};
  std::uint32_t spill_crc = 0;
  for (int k = 0; k < n_slots; ++k) {
    state[k].assign(chunk, 0.0F);
    new_state[k].resize(chunk);
  }
  std::atomic<bool> finite{true};
  for (std::int64_t lo = 0; lo < nnz; lo += kUpdateChunk) {
    const auto n = static_cast<std::size_t>(std::min(kUpdateChunk, nnz - lo));
    detail::UpdateArrays a;
    a.weights = values.data() + lo;
    if (spill) {
      spill->read(spill_layout.values, lo, {grad.data(), n}, spill_crc);
      a.gradient = grad.data();
    } else {
      a.gradient = gradient + lo;
    }
    a.new_weights = new_values.data();
    for (int k = 0; k < n_slots; ++k) {
      if (in) in->read(in_layout.state[k], lo, {state[k].data(), n}, crcs[k]);
      a.state[k] = state[k].data();
      a.new_state[k] = new_state[k].data();
    }
    detail::parallel_for_ranges(0, n, kOptimizerGrain, [&](std::size_t b, std::size_t e) {
      if (!detail::optimizer_update(scalars, a, b, e)) finite.store(false);
    });
    out.write(0, lo, {new_values.data(), n});
    for (int k = 0; k < n_slots; ++k) out.write(2 + k, lo, {new_state[k].data(), n});
  }
  for (int k = 0; in && k < n_slots; ++k) {
    in->check_crc(in_layout.state[k], crcs[k], k == 0 ? "STA0" : "STA1");
  }
  if (in) in->drop_cache();
  if (spill) spill->check_crc(spill_layout.values, spill_crc, "VALS");

  const auto bias_size = static_cast<std::size_t>(m.shape.bias);
  p.new_bias.resize(bias_size);
  detail::UpdateArrays b;
  b.weights = c.bias.data();
  b.gradient = p.bias_gradient.data();
  b.new_weights = p.new_bias.data();
  for (int k = 0; k < n_slots; ++k) {
    p.new_bias_state[k].resize(bias_size);
    b.state[k] = c.bias_state[k].data();
    b.new_state[k] = p.new_bias_state[k].data();
  }
  if (!detail::optimizer_update(scalars, b, 0, bias_size)) finite.store(false);
  out.write(1, 0, p.new_bias);
  for (int k = 0; k < n_slots; ++k) out.write(2 + n_slots + k, 0, p.new_bias_state[k]);
  p.finite = p.finite && finite.load();
  if (!p.finite) return;  // `out` removes its file
  out.finish();
  p.computed = true;
}

// Reads every byte of the layer's committed files, checking each CRC, and takes its bias
// and bias state; keeps its pieces in the cache where the budget has room.
void TieredModelMemory::State::verify_layer(std::int32_t l) {
  detail::TieredLayer& c = *layers[l];
  const LayerShape& s = shape(l);
  auto w = std::make_shared<CsrMatrix>();
  auto t = std::make_shared<TransposedPattern>();
  io.read_bytes += detail::read_pattern(detail::pattern_path(dir, l), s, w.get(), t.get());
  c.column_counts.resize(static_cast<std::size_t>(s.cols));
  for (std::int64_t i = 0; i < s.cols; ++i)
    c.column_counts[i] = t->row_offsets[i + 1] - t->row_offsets[i];
  const detail::StateLayout layout = committed_layout(l);
  detail::StateReader in(detail::state_path(dir, l, manifest.layers[l].generation), layout, io);
  std::uint32_t crc = 0;
  in.read(layout.values, 0, w->values(), crc);
  in.check_crc(layout.values, crc, "VALS");
  for (const float v : w->values()) {
    if (!std::isfinite(v)) {
      throw FormatError("model store: state " + in.path().string() + ": a value is not finite");
    }
  }
  c.bias.assign(static_cast<std::size_t>(s.bias), 0.0F);
  crc = 0;
  in.read(layout.bias_at, 0, c.bias, crc);
  in.check_crc(layout.bias_at, crc, "BIAS");
  std::vector<float> chunk(static_cast<std::size_t>(std::min(s.nnz, kUpdateChunk)));
  for (int k = 0; k < slots(); ++k) {
    c.bias_state[k].assign(static_cast<std::size_t>(s.bias), 0.0F);
    if (layout.slots == 0) continue;
    crc = 0;
    for (std::int64_t lo = 0; lo < s.nnz; lo += kUpdateChunk) {
      const auto n = static_cast<std::size_t>(std::min(kUpdateChunk, s.nnz - lo));
      in.read(layout.state[k], lo, {chunk.data(), n}, crc);
    }
    in.check_crc(layout.state[k], crc, k == 0 ? "STA0" : "STA1");
    crc = 0;
    in.read(layout.bias_state[k], 0, c.bias_state[k], crc);
    in.check_crc(layout.bias_state[k], crc, k == 0 ? "BST0" : "BST1");
  }
  in.drop_cache();
  std::lock_guard lock(mutex);
  const std::int64_t bytes = forward_bytes(s) + transposed_bytes(s);
  if (used + bytes <= budget) {
    c.forward = std::move(w);
    c.transposed = std::move(t);
    c.values_generation = manifest.layers[l].generation;
    c.last_use = ++clock;
    used += bytes;
  }
}

// Files no manifest names: a killed step's new state files, a killed add_layer's pattern,
// a manifest never renamed, gradients waiting for a commit that never came.
void TieredModelMemory::State::remove_leftovers() {
  std::set<std::filesystem::path> keep{detail::manifest_path(dir)};
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(manifest.layers.size()); ++l) {
    keep.insert(detail::pattern_path(dir, l));
    keep.insert(detail::state_path(dir, l, manifest.layers[l].generation));
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name.rfind("layer-", 0) == 0 || name == "MANIFEST.tmp";
    if (ours && keep.count(entry.path()) == 0) remove_quietly(entry.path());
  }
}

TieredModelMemory::TieredModelMemory(std::filesystem::path directory, std::int64_t budget_bytes)
    : state_(std::make_unique<State>()) {
  State& st = *state_;
  if (budget_bytes <= 0) {
    throw ShapeError("TieredModelMemory: the budget must be positive, got " +
                     std::to_string(budget_bytes) + " bytes");
  }
  st.dir = std::move(directory);
  st.budget = budget_bytes;
  std::error_code ec;
  std::filesystem::create_directories(st.dir, ec);
  if (!std::filesystem::is_directory(st.dir, ec)) {
    throw IoError("model store: cannot create the directory " + st.dir.string() +
                  (ec ? ": " + ec.message() : ""));
  }
  if (!std::filesystem::exists(detail::manifest_path(st.dir))) {
    detail::write_manifest(st.dir, st.manifest);
    st.config = st.manifest.config;
    return;
  }
  st.manifest = detail::read_manifest(st.dir);
  st.config = st.manifest.config;
  seed = st.manifest.seed;
  epochs = st.manifest.epochs;
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
  } catch (...) {  // leftovers are removed when the store opens next
  }
}

const std::filesystem::path& TieredModelMemory::directory() const {
  return state_->dir;
}

std::int64_t TieredModelMemory::budget_bytes() const {
  return state_->budget;
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
    c.store_bytes += std::filesystem::file_size(detail::pattern_path(st.dir, l), ec);
    c.store_bytes += std::filesystem::file_size(
        detail::state_path(st.dir, l, st.manifest.layers[l].generation), ec);
  }
  return c;
}

std::int32_t TieredModelMemory::add_layer_impl(CsrMatrix weights, std::vector<float> bias) {
  State& st = *state_;
  const LayerShape s{weights.rows(), weights.cols(), weights.nnz(),
                     static_cast<std::int64_t>(bias.size())};
  if (working_set_bytes(s) > st.budget) {
    throw ResourceError(
        "add_layer: a " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + " layer with " +
        std::to_string(s.nnz) + " non-zeros needs " + std::to_string(working_set_bytes(s)) +
        " bytes of RAM at once; the model store's budget is " + std::to_string(st.budget));
  }
  detail::refuse_if_pending(st.layers, "add_layer");
  const auto l = static_cast<std::int32_t>(st.layers.size());
  auto t = std::make_shared<TransposedPattern>(transposed_pattern(weights));
  detail::write_pattern(detail::pattern_path(st.dir, l), weights, *t);
  const std::int64_t generation = st.manifest.next_generation;
  {
    detail::StateWriter out(detail::state_path(st.dir, l, generation),
                            detail::StateLayout::of(s.nnz, s.bias, 0), st.io);
    out.write(0, 0, weights.values());
    out.write(1, 0, bias);
    out.finish();
  }
  detail::fsync_directory(st.dir, "model store");
  detail::Manifest next = st.manifest;
  next.layers.push_back({s, 0, generation, false});
  next.next_generation = generation + 1;
  next.seed = seed;
  next.epochs = epochs;
  detail::write_manifest(st.dir, next);

  auto layer = std::make_unique<detail::TieredLayer>();
  layer->column_counts = weights.column_counts();
  layer->bias = std::move(bias);
  for (int k = 0; k < st.slots(); ++k) layer->bias_state[k].assign(layer->bias.size(), 0.0F);
  std::lock_guard lock(st.mutex);
  st.manifest = std::move(next);
  const std::int64_t bytes = forward_bytes(s) + transposed_bytes(s);
  if (st.used + bytes <= st.budget) {  // just written: keep it while there is room
    layer->forward = std::make_shared<CsrMatrix>(std::move(weights));
    layer->transposed = std::move(t);
    layer->values_generation = generation;
    layer->last_use = ++st.clock;
    st.used += bytes;
  }
  st.layers.push_back(std::move(layer));
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
  std::lock_guard lock(l.placement_mutex);
  auto it = l.placements.find(lanes);
  if (it == l.placements.end()) {
    it = l.placements.emplace(lanes, round_robin_placement(l.column_counts, lanes)).first;
  }
  return it->second;
}

void TieredModelMemory::stream_to_impl(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                                       std::size_t chunk_packets, Precision precision,
                                       StreamOrder order) const {
  const bool by_input = order == StreamOrder::by_input;
  const State::Pin pin = state_->acquire(layer, by_input, 0);
  detail::encode_layer(*pin.w, pin.t.get(), kind, channel, chunk_packets, precision, order);
}

void TieredModelMemory::submit_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                                             std::span<const float> bias_gradient) {
  const auto start = Clock::now();
  State& st = *state_;
  detail::TieredLayer& l = *st.layers[layer];
  std::lock_guard lock(l.pending_mutex);
  detail::TieredPending& p = l.pending;
  if (p.submitted) {
    throw ShapeError("submit_gradient: " + layer_name(layer) +
                     " already has a gradient for this step (commit_step first)");
  }
  const LayerShape& s = st.shape(layer);
  const bool by_input = gradient.header.by_input();
  const State::Pin pin = st.acquire(layer, by_input, update_bytes(s));
  std::vector<float> g(static_cast<std::size_t>(s.nnz));
  double sum_of_squares = detail::scan_gradient(layer, gradient, *pin.w, pin.t.get(), g.data());
  p.bias_gradient.assign(bias_gradient.begin(), bias_gradient.end());
  for (float x : bias_gradient) sum_of_squares += static_cast<double>(x) * x;
  p.sum_of_squares = sum_of_squares;
  p.finite = std::isfinite(sum_of_squares);
  p.computed = false;
  p.spilled = false;
  try {
    if (p.finite && st.config.clip_global_norm == 0) {
      // No clipping: this layer's update does not depend on the others, so compute it now,
      // while the engines work on the next layer.
      st.write_update(layer, pin.w->values(), g.data(),
                      detail::scheduled_learning_rate(st.config, st.manifest.step + 1), 1.0);
    } else if (p.finite) {
      detail::StateWriter out(spill_path(st.dir, layer), detail::StateLayout::of(s.nnz, 0, 0),
                              st.io);
      out.write(0, 0, g);
      out.finish();
      p.spilled = true;
    }
  } catch (...) {
    p = {};
    throw;
  }
  p.seconds = seconds_since(start);
  p.submitted = true;
}

void TieredModelMemory::discard_step_impl() {
  State& st = *state_;
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(st.layers.size()); ++i) {
    detail::TieredLayer& l = *st.layers[i];
    std::lock_guard lock(l.pending_mutex);
    if (l.pending.computed)
      remove_quietly(detail::state_path(st.dir, i, st.manifest.next_generation));
    if (l.pending.spilled) remove_quietly(spill_path(st.dir, i));
    l.pending = {};
  }
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
    if (report.bad_layers.empty() && st.config.clip_global_norm > 0) {
      // Clipping needs the norm over all layers, known only now: each layer's gradient
      // comes back from its file.
      const double scale =
          std::min(1.0, st.config.clip_global_norm / (report.gradient_norm + 1e-6));
      const double learning_rate = detail::scheduled_learning_rate(st.config, st.manifest.step + 1);
      for (std::int32_t i : submitted) {
        const State::Pin pin = st.acquire(i, false, update_bytes(st.shape(i)));
        st.write_update(i, pin.w->values(), nullptr, learning_rate, scale);
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
  std::vector<std::filesystem::path> old_files;
  for (std::int32_t i : submitted) {
    detail::ManifestLayer& m = next.layers[i];
    old_files.push_back(detail::state_path(st.dir, i, m.generation));
    m.generation = st.manifest.next_generation;
    m.updates += 1;
    m.has_state = true;
  }
  next.step += 1;
  next.next_generation += 1;
  next.seed = seed;
  next.epochs = epochs;
  try {
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
  for (std::int32_t i : submitted) {
    detail::TieredLayer& l = *st.layers[i];
    std::swap(l.bias, l.pending.new_bias);
    for (int k = 0; k < st.slots(); ++k) std::swap(l.bias_state[k], l.pending.new_bias_state[k]);
    if (l.pending.spilled) remove_quietly(spill_path(st.dir, i));
    l.pending = {};
  }
  for (const auto& f : old_files) remove_quietly(f);
  report.applied = true;
  report.step = st.manifest.step;
  finish();
  return report;
}

void TieredModelMemory::commit_counters() {
  State& st = *state_;
  detail::Manifest next = st.manifest;
  next.seed = seed;
  next.epochs = epochs;
  detail::write_manifest(st.dir, next);
  std::lock_guard lock(st.mutex);
  st.manifest = std::move(next);
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
  detail::write_manifest(st.dir, next);
  std::lock_guard lock(st.mutex);
  st.manifest = std::move(next);
  st.config = config;
  if (reset) {
    for (auto& l : st.layers) {
      for (int k = 0; k < detail::kMaxOptimizerSlots; ++k) {
        l->bias_state[k].assign(k < slots ? l->bias.size() : 0, 0.0F);
      }
    }
  }
}

const OptimizerConfig& TieredModelMemory::optimizer_impl() const {
  return state_->config;
}

void TieredModelMemory::set_non_finite_policy_impl(NonFinitePolicy policy) {
  State& st = *state_;
  detail::Manifest next = st.manifest;
  next.policy = policy;
  detail::write_manifest(st.dir, next);
  std::lock_guard lock(st.mutex);
  st.manifest = std::move(next);
}

std::int64_t TieredModelMemory::step_impl() const {
  return state_->manifest.step;
}

void TieredModelMemory::save_impl(const std::filesystem::path& path) const {
  throw ShapeError("save " + path.string() + ": a TieredModelMemory is its own checkpoint (" +
                   state_->dir.string() + "); copy the directory instead");
}

void TieredModelMemory::load_impl(const std::filesystem::path& path) {
  throw ShapeError("load " + path.string() +
                   ": a TieredModelMemory loads its store when it is opened; open a "
                   "TieredModelMemory on the store directory instead");
}

}  // namespace sluice
