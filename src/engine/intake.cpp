#include "engine/intake.hpp"

#include <string>

#include "core/parallel.hpp"
#include "engine/resident_tile.hpp"
#include "sluice/error.hpp"
#include "stream/stream_check.hpp"

namespace sluice::detail {
namespace {

/// Sends each weight packet of a chunk to the lane that owns its input feature, with the
/// row's index in that lane's resident tile as its tag, and records each lane's runs.
template <typename PacketT>
void route(const StreamChunk& chunk, std::vector<LaneShare>& shares, std::uint64_t weights,
           const Placement& placement, const LaneLayout& layout, bool keep_origin) {
  const auto lanes = static_cast<std::uint64_t>(shares.size());
  for (auto& s : shares) {
    routed<PacketT>(s).reserve(weights / lanes + weights / (4 * lanes) + 16);
    if (keep_origin) s.origin.reserve(weights / lanes + weights / (4 * lanes) + 16);
  }
  const auto& packets = packets_of<PacketT>(chunk);
  std::uint32_t r = 0;
  const std::int32_t* lane_of = placement.lane_of.data();
  if (chunk.outputs > 0) {
    for (auto& s : shares) s.begin[0] = 0;
  }
  for (std::size_t k = 0; k < packets.size(); ++k) {
    const PacketT packet = packets[k];
    if (!is_control(packet)) {
      const std::uint32_t tag = tag_of(packet);
      LaneShare& s = shares[lane_of[tag]];
      if constexpr (std::is_same_v<PacketT, Packet>) {
        s.packets.push_back({layout.local[tag], packet.value});
      } else {
        s.packets_bf16.push_back({static_cast<std::uint16_t>(layout.local[tag]), packet.value});
      }
      if (keep_origin) s.origin.push_back(static_cast<std::uint32_t>(k));
    } else if (tag_of(packet) == kCarriageReturn) {
      for (auto& s : shares) {
        const auto size = static_cast<std::uint32_t>(routed<PacketT>(s).size());
        s.end[r] = size;
        if (r + 1 < chunk.outputs) s.begin[r + 1] = size;
      }
      ++r;
    }
  }
}

}  // namespace

Intake::Intake(TakenChunks& into, StreamSource& source, const Placement& placement,
               const LaneLayout& layout, bool keep_origin)
    : taken_(into.chunks),
      spares_(into.spares()),
      source_(source),
      header_(source.header()),
      placement_(placement),
      layout_(layout),
      keep_origin_(keep_origin) {
  check_header(header_);
  // Every chunk but the last closes an output at least (else its pushes could move the
  // chunks the tasks are reading): room for all, reserved, not touched.
  taken_.reserve(std::size_t{header_.outputs} + 2);
}

std::uint64_t Intake::expected_bytes() const {
  const std::uint64_t packet =
      header_.precision == Precision::bf16 ? sizeof(Bf16Packet) : sizeof(Packet);
  return (header_.nnz + header_.outputs + 1) * packet;
}

bool Intake::pull_until(std::size_t n) {
  const std::lock_guard lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  try {
    while (arrived_.load(std::memory_order_relaxed) < n &&
           !ended_.load(std::memory_order_relaxed)) {
      pull_one();
    }
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
  return arrived_.load(std::memory_order_relaxed) >= n;
}

void Intake::pull_one() {
  if (!started_) {
    started_ = true;
    arrival_begin_ = Clock::now();
  }
  ChunkPtr chunk = source_.next();
  if (!chunk) {
    arrival_end_ = Clock::now();
    if (taking_) finish();
    ended_.store(true, std::memory_order_release);
    return;
  }
  const std::size_t c = taken_.size();
  check_sequence(header_, *chunk, c, outputs_, false);
  if (c == taken_.capacity()) {
    throw FormatError(describe_chunk(*chunk, c) + ": more chunks than a layer of " +
                      std::to_string(header_.outputs) + " outputs has (empty chunks)");
  }
  outputs_ += chunk->outputs;
  bytes_ += chunk->byte_size();
  taken_.push_back({std::move(chunk), {}});
  if (taking_) take(c);
  if (on_arrival_) on_arrival_(c);
  arrived_.store(c + 1, std::memory_order_release);
}

void Intake::start_live(bool take_each, std::function<void(std::size_t)> on_arrival) {
  const std::lock_guard lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  try {
    taking_ = take_each;
    on_arrival_ = std::move(on_arrival);
    for (std::size_t c = 0; c < arrived_.load(std::memory_order_relaxed); ++c) {
      if (taking_) take(c);
      if (on_arrival_) on_arrival_(c);
    }
    if (taking_ && ended_.load(std::memory_order_relaxed)) finish();
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
}

void Intake::take(std::size_t c) {
  TakenChunk& taken = taken_[c];
  const StreamChunk& chunk = *taken.chunk;
  auto& shares = taken.lanes;
  const std::int32_t lanes = placement_.lanes;
  if (c < spares_.size()) shares = std::move(spares_[c]);
  shares.resize(lanes);
  for (auto& s : shares) {
    s.packets.clear();
    s.packets_bf16.clear();
    s.origin.clear();
    s.begin.resize(chunk.outputs);
    s.end.resize(chunk.outputs);
  }
  // One lane: the runs lie between the carriage returns the check finds anyway.
  const ChunkFacts facts =
      check_chunk(header_, chunk, c, lanes == 1 ? shares[0].end.data() : nullptr);
  taken.weights = facts.weights;
  taken.ends_layer = facts.ends_layer;
  if (lanes == 1) {
    auto& s = shares[0];
    for (std::uint32_t r = 0; r < chunk.outputs; ++r) s.begin[r] = r == 0 ? 0 : s.end[r - 1] + 1;
  } else if (header_.precision == Precision::bf16) {
    route<Bf16Packet>(chunk, shares, facts.weights, placement_, layout_, keep_origin_);
  } else {
    route<Packet>(chunk, shares, facts.weights, placement_, layout_, keep_origin_);
  }
}

void Intake::finish() const {
  std::uint64_t total = 0;
  for (std::size_t c = 0; c < taken_.size(); ++c) {
    if (taken_[c].ends_layer && c + 1 != taken_.size()) {
      throw FormatError(describe_chunk(*taken_[c + 1].chunk, c + 1) + ": data after end-of-layer");
    }
    total += taken_[c].weights;
  }
  check_finished(header_, outputs_, total, !taken_.empty() && taken_.back().ends_layer);
}

void Intake::take_all() {
  pull_all();
  parallel_for(std::size_t{0}, taken_.size(), [&](std::size_t c) { take(c); });
  finish();
}

}  // namespace sluice::detail
