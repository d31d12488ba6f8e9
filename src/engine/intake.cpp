#include "engine/intake.hpp"

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
      header_(source.header()),
      placement_(placement),
      layout_(layout),
      keep_origin_(keep_origin) {
  check_header(header_);
  while (ChunkPtr chunk = source.next()) {
    check_sequence(header_, *chunk, taken_.size(), outputs_, false);
    outputs_ += chunk->outputs;
    bytes_ += chunk->byte_size();
    taken_.push_back({std::move(chunk), {}});
  }
  weights_.resize(taken_.size());
  ends_.resize(taken_.size());
}

void Intake::take(std::size_t c) {
  const StreamChunk& chunk = *taken_[c].chunk;
  auto& shares = taken_[c].lanes;
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
  weights_[c] = facts.weights;
  ends_[c] = facts.ends_layer ? 1 : 0;
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
    if (ends_[c] && c + 1 != taken_.size()) {
      throw FormatError(describe_chunk(*taken_[c + 1].chunk, c + 1) + ": data after end-of-layer");
    }
    total += weights_[c];
  }
  check_finished(header_, outputs_, total, !taken_.empty() && ends_.back());
}

void Intake::take_all() {
  parallel_for(std::size_t{0}, taken_.size(), [&](std::size_t c) { take(c); });
  finish();
}

}  // namespace sluice::detail
