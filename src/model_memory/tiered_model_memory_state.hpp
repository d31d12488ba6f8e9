#pragma once
// Internal: the state of a TieredModelMemory, shared by its files by role —
// tiered_model_memory.cpp (the interface, a step's commit), tiered_cache.cpp (the RAM
// cache, its reads in the executor's order, opening a store) and tiered_update.cpp (the
// optimizer's and a mask change's work per chunk, writing a layer's next state file).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <system_error>
#include <utility>
#include <vector>

#include "model_memory/mask_update.hpp"
#include "model_memory/model_store_files.hpp"
#include "model_memory/optimizer_kernels.hpp"
#include "sluice/tiered_model_memory.hpp"

namespace sluice {
namespace detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Elements the optimizer reads, updates and writes at a time: large sequential I/O
/// while its buffers stay a small part of a layer.
constexpr std::int64_t kUpdateChunk = std::int64_t{1} << 21;
constexpr std::size_t kOptimizerGrain = 1 << 14;

inline std::int64_t forward_bytes(const LayerShape& s) {
  return 8 * (s.rows + 1) + 8 * s.nnz;  // offsets, indices, values
}
inline std::int64_t transposed_bytes(const LayerShape& s) {
  return 8 * (s.cols + 1) + 8 * s.nnz;  // offsets, indices, positions
}
/// What UpdateBuffers hold for a layer: its gradient and the chunk arrays.
inline std::int64_t update_buffer_bytes(const LayerShape& s) {
  const std::int64_t chunk = std::min(s.nnz, kUpdateChunk);
  return 4 * s.nnz + 4 * chunk * (2 + 2 * detail::kMaxOptimizerSlots);
}
inline std::int64_t update_bytes(const LayerShape& s) {
  // The update's buffers and the state file writer's aligned buffer.
  return update_buffer_bytes(s) +
         direct_write_buffer_bytes(StateLayout::of(s.nnz, s.bias, kMaxOptimizerSlots));
}

/// The buffers of a layer's update — its gradient's copy, and the chunk arrays
/// write_update reads into and writes from — kept from one update to the next: fresh
/// ones would be faulted in by every update, and glibc keeps freed blocks of some of these
/// sizes resident. Sized for the largest layer updated yet; from the update that grew
/// them on, their bytes stay in the cache's `used`.
struct UpdateBuffers {
  PhasedBuffer<float> gradient;
  /// The spill file's gradient, the new values, state[k], new_state[k].
  std::array<PhasedBuffer<float>, 2 + 2 * kMaxOptimizerSlots> chunks;
  std::int64_t bytes = 0;  ///< update_buffer_bytes of the layer they were sized for
};

inline std::filesystem::path spill_path(const std::filesystem::path& dir, std::int32_t l) {
  char name[64];
  std::snprintf(name, sizeof name, "layer-%06d.gradient", l);
  return dir / name;
}

inline void remove_quietly(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::remove(path, ec);
}

struct TieredPending {
  bool submitted = false;
  bool finite = true;
  bool computed = false;  ///< the new state file is written
  bool spilled = false;   ///< the gradient waits in a file (clipping norm, more micro-batches)
  double sum_of_squares = 0;
  double seconds = 0;
  std::vector<float> bias_gradient;
  std::vector<float> new_bias;
  std::array<std::vector<float>, kMaxOptimizerSlots> new_bias_state;
};

/// Pieces the cache evicted to make room for a load: the load reads into their arrays
/// (memory already allocated and faulted in) rather than new zero-filled ones; what it does
/// not reuse is freed before it reads.
struct EvictedPieces {
  std::vector<std::shared_ptr<CsrMatrix>> forward;
  std::vector<std::shared_ptr<TransposedPattern>> transposed;
};

struct TieredLayer {
  std::vector<float> bias;  ///< committed; biases stay in RAM (one float per output)
  std::array<std::vector<float>, kMaxOptimizerSlots> bias_state;
  std::vector<std::int64_t> column_counts;  ///< for placements
  std::mutex placement_mutex;
  std::map<std::int32_t, Placement> placements;
  // The cache (under State::mutex): pieces are shared while a stream or update uses them.
  std::shared_ptr<CsrMatrix> forward;   ///< mask and values of generation values_generation
  std::int64_t values_generation = -1;  ///< -1: none (being overwritten, or a step's discarded)
  std::shared_ptr<TransposedPattern> transposed;
  std::uint64_t last_use = 0;
  bool loading = false;
  std::mutex pending_mutex;
  TieredPending pending;
  /// The state file of the generation before the committed one, which no manifest names
  /// any more: the layer's next update writes over it (StateWriter's `recycled`); empty
  /// once taken. Touched by the layer's update and by the commit, never at once.
  std::filesystem::path spare;
};

}  // namespace detail

struct TieredModelMemory::State {
  std::filesystem::path dir;
  std::optional<detail::StoreLock> lock;  ///< held from the open on
  std::int64_t budget = 0;
  /// Of the budget, what a trainer holds beside the cache (ModelMemory::reserve_ram_bytes).
  std::int64_t reserved = 0;
  std::int64_t capacity() const { return budget - reserved; }
  detail::Manifest manifest;
  OptimizerConfig config;  ///< the manifest's, with the schedule
  std::vector<std::unique_ptr<detail::TieredLayer>> layers;
  detail::IoCounters io;
  std::atomic<double> wait_seconds{0};

  /// One layer's update at a time: they share `update_buffers`. Taken before the pin
  /// (an update waiting for it holds no room in the cache).
  std::mutex update_mutex;
  detail::UpdateBuffers update_buffers;

  std::mutex mutex;  ///< the cache: pieces, `used`, `loading`, `last_use`
  std::condition_variable changed;
  std::int64_t used = 0;
  /// Bytes of pieces and buffers freed since the C library's free heap was last given back
  /// (release_freed_heap).
  std::int64_t freed_since_trim = 0;
  std::uint64_t clock = 0;

  const LayerShape& shape(std::int32_t l) const { return manifest.layers[l].shape; }
  int slots() const { return detail::optimizer_slot_count(config.kind); }
  std::filesystem::path pattern_file(std::int32_t l) const {
    return detail::pattern_path(dir, l, manifest.layers[l].pattern_generation);
  }
  std::filesystem::path state_file(std::int32_t l) const {
    return detail::state_path(dir, l, manifest.layers[l].generation);
  }
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
    /// Lets the transposed pattern go (evictable again) while the rest stays held: an
    /// update needs it only to scan a by-input gradient, and the next layer's stream
    /// needs the room while the update runs.
    void release_transposed() {
      if (st == nullptr || !t) return;
      std::lock_guard lock(st->mutex);
      t.reset();
      st->changed.notify_all();
    }
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
  /// bytes fit under `limit`; false if they do not.
  /// The pieces freed go to `evicted` where given (for the load to reuse).
  bool make_room(std::int64_t need, std::int32_t keep, std::int64_t limit,
                 detail::EvictedPieces* evicted = nullptr);
  /// Gives the C library's free heap back to the system (heap_trim.hpp) once the cache has
  /// freed an eighth of the budget since it last did, so that the process holds at most that
  /// much freed memory beyond the budget. Not after every update: a trim releases every free
  /// page of the process, which the engines' next buffers fault in again.
  void release_freed_heap();
  /// `between_steps`: no trainer's stream is in flight (a mask change), so the pin may
  /// take the trainer's reserve too.
  Pin acquire(std::int32_t l, bool want_transposed, std::int64_t extra, bool between_steps = false);
  void load(std::int32_t l, bool mask, bool values, bool transposed,
            detail::EvictedPieces& evicted);
  /// Room an update of layer l asks of the cache beside its pieces (under update_mutex):
  /// the growth of update_buffers it needs and the state file writer's buffer.
  std::int64_t update_room(std::int32_t l) const;
  /// update_buffers grown for layer l where needed (under update_mutex, `pin` holding
  /// update_room(l)): the growth moves from the pin's reserve into `used` for good.
  detail::UpdateBuffers& update_buffers_for(std::int32_t l, Pin& pin);
  /// The layer's cached values for its update to overwrite with the new ones (so that a
  /// commit leaves them cached), where `values` are the cached piece's and only the
  /// update's pin and the cache hold it; null otherwise. Until the update marks them the
  /// next generation's, a reader finds them stale and reloads.
  float* values_to_overwrite(std::int32_t l, std::span<const float> values);
  /// The update of layer l from `buffers` (`gradient`: its gradient is buffers.gradient;
  /// else in its spill file). Leaves the new values in the cache where it can.
  void write_update(std::int32_t l, std::span<const float> values, detail::UpdateBuffers& buffers,
                    bool gradient, double learning_rate, double scale);
  /// Adds layer l's spilled gradient into `gradient` (nnz floats), its CRC checked,
  /// through the first of `buffers`' chunk arrays.
  void add_spilled_gradient(std::int32_t l, detail::UpdateBuffers& buffers, float* gradient);
  /// Writes the state file of `generation` for the layer's new mask: its new values, its
  /// bias, and its committed optimizer state carried over (zero where grown).
  void write_mask_change(std::int32_t l, const detail::MaskChange& change, std::int64_t generation);
  /// Drops the layer's cached transposed pattern unless a stream holds it.
  void drop_transposed(std::int32_t l);
  void verify_layer(std::int32_t l);
  void remove_leftovers();
  /// Removes `files` (which the manifest no longer names: a mask change's old files, spares
  /// left over) on a thread of its own, after the removal before it: freeing a large file's
  /// blocks takes the file system a while, and the next step need not wait for it. A kill
  /// leaves them to the next open's remove_leftovers.
  void remove_in_background(std::vector<std::filesystem::path> files);
  /// Removes the layers' spare state files and their last spills (the store closes).
  void remove_spares();

  // Last, so that it is waited for first when the store goes.
  std::future<void> removing;  ///< remove_in_background's last removal
};

}  // namespace sluice
