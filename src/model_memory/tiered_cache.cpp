// TieredModelMemory's RAM cache: a layer's pieces read when a stream or an update asks
// for them (the executor asks in its streaming order, so this is the read-ahead), pinned
// while used, evicted least recently used first; and opening a store (every file read and
// checked, leftovers of a killed step removed).
#include <algorithm>
#include <cmath>
#include <set>
#include <system_error>

#include "core/csr_matrix_access.hpp"
#include "core/heap_trim.hpp"
#include "model_memory/layer_streams.hpp"
#include "model_memory/tiered_model_memory_state.hpp"

namespace sluice {
namespace {
using detail::Clock;
using detail::forward_bytes;
using detail::kUpdateChunk;
using detail::layer_name;
using detail::remove_quietly;
using detail::seconds_since;
using detail::transposed_bytes;
}  // namespace

// Frees unused pieces of other layers, least recently used first, until `need` more
// bytes fit under `limit`; false if they do not.
bool TieredModelMemory::State::make_room(std::int64_t need, std::int32_t keep, std::int64_t limit,
                                         detail::EvictedPieces* evicted) {
  while (used + need > limit) {
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
    const std::int64_t bytes = transposed ? transposed_bytes(s) : forward_bytes(s);
    if (transposed) {
      if (evicted != nullptr) evicted->transposed.push_back(std::move(victim->transposed));
      victim->transposed.reset();
    } else {
      if (evicted != nullptr) evicted->forward.push_back(std::move(victim->forward));
      victim->forward.reset();
    }
    used -= bytes;
    freed_since_trim += bytes;  // or reused by the load that evicted it: a trim too early
  }
  return true;
}

void TieredModelMemory::State::release_freed_heap() {
  {
    std::lock_guard lock(mutex);
    if (freed_since_trim < budget / 8) return;
    freed_since_trim = 0;
  }
  detail::release_free_heap();
}

TieredModelMemory::State::Pin TieredModelMemory::State::acquire(std::int32_t l,
                                                                bool want_transposed,
                                                                std::int64_t extra,
                                                                bool between_steps) {
  const auto start = Clock::now();
  bool waited = false;
  detail::EvictedPieces evicted;  // freed after the lock (declared before it)
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
    const std::int64_t limit = between_steps ? budget : capacity();
    if (held + need > limit) {
      throw ResourceError("model store: " + layer_name(l) + " needs " +
                          std::to_string(held + need) + " bytes at once, over the " +
                          std::to_string(limit) + " of the budget of " + std::to_string(budget) +
                          " it may take (the rest is the trainer's, see reserve_ram_bytes)");
    }
    if (!make_room(need, l, limit, &evicted)) {
      evicted = {};  // freed now: no memory outside the count while waiting
      waited = true;
      changed.wait(lock);
      continue;
    }
    used += need;
    if (need_mask || stale || need_t) {
      c.loading = true;
      lock.unlock();
      try {
        load(l, need_mask, need_mask || stale, need_t, evicted);
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

namespace {
// Takes the pieces a load reads into out of what the cache evicted for it: an evicted piece
// of the same kind whole, else the arrays of the same type of a piece of the other kind
// (offsets and column indices), else new. What is not reused is freed here, before the
// reads allocate.
void reuse_evicted(detail::EvictedPieces& evicted, std::shared_ptr<CsrMatrix>* w,
                   std::shared_ptr<TransposedPattern>* t) {
  using detail::CsrMatrixAccess;
  if (w != nullptr && !evicted.forward.empty()) {
    *w = std::move(evicted.forward.back());
    evicted.forward.pop_back();
  }
  if (t != nullptr && !evicted.transposed.empty()) {
    *t = std::move(evicted.transposed.back());
    evicted.transposed.pop_back();
  }
  if (w != nullptr && !*w) {
    *w = std::make_shared<CsrMatrix>();
    if (!evicted.transposed.empty()) {
      TransposedPattern& donor = *evicted.transposed.back();
      CsrMatrixAccess::row_offsets(**w) = std::move(donor.row_offsets);
      CsrMatrixAccess::col_indices(**w) = std::move(donor.col_indices);
      evicted.transposed.pop_back();
    }
  }
  if (t != nullptr && !*t) {
    *t = std::make_shared<TransposedPattern>();
    if (!evicted.forward.empty()) {
      CsrMatrix& donor = *evicted.forward.back();
      (*t)->row_offsets = std::move(CsrMatrixAccess::row_offsets(donor));
      (*t)->col_indices = std::move(CsrMatrixAccess::col_indices(donor));
      evicted.forward.pop_back();
    }
  }
  evicted.forward.clear();
  evicted.transposed.clear();
}
}  // namespace

// Reads the pieces asked for into the layer's cache slots (marked loading, so no other
// thread touches them). The pattern file was checked in full when the store opened
// (verify_layer) or was written from a checked pattern (add_layer, a mask change): its
// CRCs prove the bytes unchanged, so a reload does not validate the pattern again.
void TieredModelMemory::State::load(std::int32_t l, bool mask, bool values, bool transposed,
                                    detail::EvictedPieces& evicted) {
  detail::TieredLayer& c = *layers[l];
  const LayerShape& s = shape(l);
  const auto start = Clock::now();
  std::shared_ptr<CsrMatrix> w;
  std::shared_ptr<TransposedPattern> t;
  if (mask || transposed) {
    reuse_evicted(evicted, mask ? &w : nullptr, transposed ? &t : nullptr);
    io.read_bytes +=
        detail::read_pattern(pattern_file(l), s, w.get(), t.get(), detail::PatternCheck::crc_only);
    io.read_seconds = io.read_seconds + seconds_since(start);
  }
  if (values) {
    detail::StateReader in(state_file(l), committed_layout(l), io);
    std::uint32_t crc = 0;
    in.read(committed_layout(l).values, 0, (w ? *w : *c.forward).values(), crc);
    in.check_crc(committed_layout(l).values, crc, "VALS");
    in.drop_cache();
  }
  // Only now, every read checked: a failed load leaves no piece in the cache (its bytes are
  // no longer counted) nor one whose values are a reused piece's or half read.
  if (w) c.forward = std::move(w);
  if (t) c.transposed = std::move(t);
}

// Reads every byte of the layer's committed files, checking each CRC, and takes its bias
// and bias state; keeps its pieces in the cache where the budget has room.
void TieredModelMemory::State::verify_layer(std::int32_t l) {
  detail::TieredLayer& c = *layers[l];
  const LayerShape& s = shape(l);
  auto w = std::make_shared<CsrMatrix>();
  auto t = std::make_shared<TransposedPattern>();
  io.read_bytes +=
      detail::read_pattern(pattern_file(l), s, w.get(), t.get(), detail::PatternCheck::full);
  c.column_counts.resize(static_cast<std::size_t>(s.cols));
  for (std::int64_t i = 0; i < s.cols; ++i)
    c.column_counts[i] = t->row_offsets[i + 1] - t->row_offsets[i];
  const detail::StateLayout layout = committed_layout(l);
  detail::StateReader in(state_file(l), layout, io);
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
  if (used + bytes <= capacity()) {
    c.forward = std::move(w);
    c.transposed = std::move(t);
    c.values_generation = manifest.layers[l].generation;
    c.last_use = ++clock;
    used += bytes;
  }
}

void TieredModelMemory::State::remove_in_background(std::vector<std::filesystem::path> files) {
  if (removing.valid()) removing.wait();
  auto remove_all = [files = std::move(files)] {
    for (const auto& f : files) remove_quietly(f);
  };
  try {
    removing = std::async(std::launch::async, remove_all);
  } catch (const std::system_error&) {  // no thread to be had: here, then
    removing = {};
    remove_all();
  }
}

void TieredModelMemory::State::remove_spares() {
  std::vector<std::filesystem::path> files;
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(layers.size()); ++l) {
    if (!layers[l]->spare.empty()) files.push_back(std::exchange(layers[l]->spare, {}));
    files.push_back(detail::spill_path(dir, l));
  }
  remove_in_background(std::move(files));
}

// Files no manifest names: a killed step's new state files, a killed add_layer's pattern,
// a manifest never renamed, gradients waiting for a commit that never came.
void TieredModelMemory::State::remove_leftovers() {
  std::set<std::filesystem::path> keep{detail::manifest_path(dir)};
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(manifest.layers.size()); ++l) {
    keep.insert(pattern_file(l));
    keep.insert(state_file(l));
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name.rfind("layer-", 0) == 0 || name == "MANIFEST.tmp";
    if (ours && keep.count(entry.path()) == 0) remove_quietly(entry.path());
  }
}
void TieredModelMemory::State::drop_transposed(std::int32_t l) {
  std::lock_guard lock(mutex);
  detail::TieredLayer& c = *layers[l];
  if (c.loading || !c.transposed || c.transposed.use_count() > 1) return;
  c.transposed.reset();
  used -= transposed_bytes(shape(l));
  freed_since_trim += transposed_bytes(shape(l));
  changed.notify_all();
}

}  // namespace sluice
