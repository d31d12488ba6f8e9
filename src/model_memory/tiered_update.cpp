// TieredModelMemory's work per chunk of a layer: the optimizer's update (and a mask
// change's carried-over state), read from the committed state file and written to the
// next generation's, in chunks of kUpdateChunk elements.
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "core/parallel.hpp"
#include "model_memory/tiered_model_memory_state.hpp"

namespace sluice {
namespace {
using detail::kOptimizerGrain;
using detail::kUpdateChunk;
using detail::spill_path;
static_assert(4 * kUpdateChunk % detail::kDirectAlign == 0,
              "a chunk's file range keeps its place in a block from chunk to chunk");
}  // namespace

std::int64_t TieredModelMemory::State::update_room(std::int32_t l) const {
  const LayerShape& s = shape(l);
  return std::max<std::int64_t>(0, detail::update_buffer_bytes(s) - update_buffers.bytes) +
         detail::update_bytes(s) - detail::update_buffer_bytes(s);
}

detail::UpdateBuffers& TieredModelMemory::State::update_buffers_for(std::int32_t l, Pin& pin) {
  const LayerShape& s = shape(l);
  const std::int64_t need = detail::update_buffer_bytes(s);
  detail::UpdateBuffers& b = update_buffers;
  if (need > b.bytes) {
    const std::int64_t growth = need - b.bytes;
    const std::int64_t old = std::exchange(b, {}).bytes;  // freed before the new are taken
    try {
      const auto chunk = static_cast<std::size_t>(std::min(s.nnz, kUpdateChunk));
      b.gradient = detail::PhasedBuffer<float>(static_cast<std::size_t>(s.nnz), 0);
      for (auto& c : b.chunks) c = detail::PhasedBuffer<float>(chunk, 0);
    } catch (...) {
      b = {};
      std::lock_guard lock(mutex);
      used -= old;
      freed_since_trim += old;
      changed.notify_all();
      throw;
    }
    b.bytes = need;
    std::lock_guard lock(mutex);
    pin.reserved -= growth;
    freed_since_trim += old;
  }
  return b;
}

void TieredModelMemory::State::add_spilled_gradient(std::int32_t l, detail::UpdateBuffers& buffers,
                                                    float* gradient) {
  const std::int64_t nnz = manifest.layers[l].shape.nnz;
  const detail::StateLayout layout = detail::StateLayout::of(nnz, 0, 0);
  detail::StateReader spill(spill_path(dir, l), layout, io);
  detail::PhasedBuffer<float>& chunk = buffers.chunks[0];
  chunk.set_phase(detail::direct_phase(layout.values));
  std::uint32_t crc = 0;
  for (std::int64_t lo = 0; lo < nnz; lo += kUpdateChunk) {
    const auto n = static_cast<std::size_t>(std::min(kUpdateChunk, nnz - lo));
    spill.read(layout.values, lo, {chunk.data(), n}, crc);
    for (std::size_t i = 0; i < n; ++i) gradient[lo + i] += chunk.data()[i];
  }
  spill.check_crc(layout.values, crc, "VALS");
}

// Computes the layer's update chunk by chunk — values from `values`, gradient from
// buffers.gradient (or the layer's spill file), optimizer state from its committed
// file — into a state file of the next generation. Sets the pending update's flags.
void TieredModelMemory::State::write_update(std::int32_t l, std::span<const float> values,
                                            detail::UpdateBuffers& buffers, bool gradient,
                                            double learning_rate, double scale) {
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
  if (!gradient) spill.emplace(spill_path(dir, l), spill_layout, io);
  const detail::StateLayout out_layout = detail::StateLayout::of(nnz, m.shape.bias, n_slots);
  detail::StateWriter out(detail::state_path(dir, l, manifest.next_generation), out_layout, io,
                          detail::StateWriter::Durability::committed, std::exchange(c.spare, {}));
  const detail::UpdateScalars scalars =
      detail::make_update_scalars(config, learning_rate, m.updates + 1, scale);

  // Each chunk array lies at its file range's place in a 4 KiB block (chunks are whole
  // blocks long), so direct reads and writes go straight between it and the device; none
  // is zero-filled but the state a layer without any starts from.
  using detail::direct_phase;
  auto& [grad, new_values, s0, s1, n0, n1] = buffers.chunks;
  std::array<detail::PhasedBuffer<float>*, detail::kMaxOptimizerSlots> state{&s0, &s1},
      new_state{&n0, &n1};
  static_assert(detail::kMaxOptimizerSlots == 2, "the chunk arrays name two slots");
  const auto chunk = static_cast<std::size_t>(std::min(nnz, kUpdateChunk));
  grad.set_phase(direct_phase(spill_layout.values));
  new_values.set_phase(direct_phase(out_layout.values));
  std::array<std::uint32_t, detail::kMaxOptimizerSlots> crcs{};
  std::uint32_t spill_crc = 0;
  // The new values go into the cached piece too, where this update holds it alone: the
  // next step's forward then finds them in RAM instead of reading them back.
  float* const cached = values_to_overwrite(l, values);
  for (int k = 0; k < n_slots; ++k) {
    state[k]->set_phase(direct_phase(in_layout.state[k]));
    if (!in) std::fill_n(state[k]->data(), chunk, 0.0F);
    new_state[k]->set_phase(direct_phase(out_layout.state[k]));
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
      a.gradient = buffers.gradient.data() + lo;
    }
    a.new_weights = new_values.data();
    for (int k = 0; k < n_slots; ++k) {
      if (in) in->read(in_layout.state[k], lo, {state[k]->data(), n}, crcs[k]);
      a.state[k] = state[k]->data();
      a.new_state[k] = new_state[k]->data();
    }
    detail::parallel_for_ranges(0, n, kOptimizerGrain, [&](std::size_t b, std::size_t e) {
      if (!detail::optimizer_update(scalars, a, b, e)) finite.store(false);
    });
    out.write(0, lo, {new_values.data(), n});
    for (int k = 0; k < n_slots; ++k) out.write(2 + k, lo, {new_state[k]->data(), n});
    if (cached != nullptr) std::copy_n(new_values.data(), n, cached + lo);
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
  if (cached != nullptr) {
    std::lock_guard lock(mutex);
    c.values_generation = manifest.next_generation;
  }
}

float* TieredModelMemory::State::values_to_overwrite(std::int32_t l,
                                                     std::span<const float> values) {
  std::lock_guard lock(mutex);
  detail::TieredLayer& c = *layers[l];
  if (!c.forward || c.loading || c.forward->values().data() != values.data() ||
      c.forward.use_count() != 2) {
    return nullptr;
  }
  c.values_generation = -1;  // neither generation's until the update is done
  return c.forward->values().data();
}

// The carried-over state is read in order: a kept weight's old index grows with its new
// one, so each slot's old section streams through one chunk buffer, its CRC checked.
void TieredModelMemory::State::write_mask_change(std::int32_t l, const detail::MaskChange& change,
                                                 std::int64_t generation) {
  const detail::TieredLayer& c = *layers[l];
  const detail::StateLayout layout = committed_layout(l);
  const std::int64_t nnz = layout.nnz;
  detail::StateWriter out(detail::state_path(dir, l, generation), layout, io);
  out.write(0, 0, change.weights.values());
  out.write(1, 0, c.bias);
  if (layout.slots > 0) {
    detail::StateReader in(state_file(l), layout, io);
    const auto chunk = static_cast<std::size_t>(std::min(nnz, kUpdateChunk));
    std::vector<float> old(chunk), fresh(chunk);
    for (int k = 0; k < layout.slots; ++k) {
      std::uint32_t crc = 0;
      std::int64_t old_lo = 0, old_n = 0;  // the old elements in `old`
      auto read_next = [&] {
        old_lo += old_n;
        old_n = std::min<std::int64_t>(kUpdateChunk, nnz - old_lo);
        in.read(layout.state[k], old_lo, {old.data(), static_cast<std::size_t>(old_n)}, crc);
      };
      for (std::int64_t lo = 0; lo < nnz; lo += kUpdateChunk) {
        const std::int64_t n = std::min(kUpdateChunk, nnz - lo);
        for (std::int64_t j = 0; j < n; ++j) {
          const std::int64_t from = change.source[static_cast<std::size_t>(lo + j)];
          while (from >= old_lo + old_n) read_next();
          fresh[j] = from < 0 ? 0.0F : old[from - old_lo];
        }
        out.write(2 + k, lo, {fresh.data(), static_cast<std::size_t>(n)});
      }
      while (old_lo + old_n < nnz) read_next();
      in.check_crc(layout.state[k], crc, k == 0 ? "STA0" : "STA1");
      out.write(2 + layout.slots + k, 0, c.bias_state[k]);
    }
    in.drop_cache();
  }
  out.finish();
}

}  // namespace sluice
