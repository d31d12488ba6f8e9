#pragma once
// A product's intake: takes a layer's stream from its source, checks each chunk and
// routes its packets to the lanes that own their input features. Internal.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "engine/kernels/lane_kernels.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

struct LaneLayout;

/// One lane's share of one chunk. With a single lane the packets stay in the chunk
/// (no copy) and only the run bounds are recorded.
struct LaneShare {
  std::vector<Packet> packets;           // routed weight packets (empty when P == 1)
  std::vector<Bf16Packet> packets_bf16;  // the same for a bf16 stream
  std::vector<std::uint32_t> begin, end;
  std::vector<std::uint32_t> origin;  // position of each routed packet in the chunk

  std::size_t routed_count() const { return packets.size() + packets_bf16.size(); }
};

/// A lane's routed packets of one format (const or not).
template <typename PacketT, typename Share>
auto& routed(Share& share) {
  if constexpr (std::is_same_v<PacketT, Packet>) {
    return share.packets;
  } else {
    return share.packets_bf16;
  }
}

template <typename PacketT>
const auto& packets_of(const StreamChunk& chunk) {
  if constexpr (std::is_same_v<PacketT, Packet>) {
    return chunk.packets;
  } else {
    return chunk.packets_bf16;
  }
}

/// A chunk as the intake took it: the chunk and each lane's runs of it.
struct TakenChunk {
  ChunkPtr chunk;
  std::vector<LaneShare> lanes;

  template <typename PacketT>
  Runs<PacketT> runs(std::int32_t lane) const {
    const LaneShare& s = lanes[lane];
    // One lane reads the chunk in place.
    const PacketT* packets =
        lanes.size() == 1 ? packets_of<PacketT>(*chunk).data() : routed<PacketT>(s).data();
    return {packets, s.begin.data(), s.end.data(), static_cast<std::int64_t>(chunk->outputs)};
  }
  /// Runs [first, first + count) of lane `lane`'s.
  template <typename PacketT>
  Runs<PacketT> runs(std::int32_t lane, std::uint32_t first, std::uint32_t count) const {
    Runs<PacketT> r = runs<PacketT>(lane);
    r.begin += first;
    r.end += first;
    r.runs = count;
    return r;
  }
};

/// The lanes' shares of a product's chunks, kept between products (per chunk position):
/// routing into fresh vectors would cost a page fault per 4 KiB of routed packets. Holds
/// at most the largest stream's routed packets; a product's shares come back when it
/// ends, or are dropped if it throws.
using SpareShares = std::vector<std::vector<LaneShare>>;

/// A product's chunks as the intake took them; gives their lanes' vectors back to the
/// spares when the product is done with them.
class TakenChunks {
 public:
  explicit TakenChunks(SpareShares& spares) : spares_(spares) {}
  TakenChunks(const TakenChunks&) = delete;
  TakenChunks& operator=(const TakenChunks&) = delete;
  ~TakenChunks() {
    if (spares_.size() < chunks.size()) spares_.resize(chunks.size());
    for (std::size_t c = 0; c < chunks.size(); ++c) spares_[c] = std::move(chunks[c].lanes);
  }
  SpareShares& spares() { return spares_; }

  std::vector<TakenChunk> chunks;

 private:
  SpareShares& spares_;
};

/// Pulls every chunk from the source, then checks each and routes it to the lanes (with
/// several lanes, routed packets carry the row's index in its lane's resident tile, and
/// with `keep_origin` their position in the chunk). Chunks may be taken in parallel, all
/// at once before the product (take_all) or each by the task about to compute it (a
/// one-pass product, whose stream is then read once while in cache); finish() checks the
/// whole after the last.
class Intake {
 public:
  Intake(TakenChunks& into, StreamSource& source, const Placement& placement,
         const LaneLayout& layout, bool keep_origin);

  std::size_t chunks() const { return taken_.size(); }
  std::uint64_t bytes() const { return bytes_; }

  /// Checks chunk c and routes it to the lanes.
  void take(std::size_t c);
  /// After every chunk is taken: what only the whole stream can show.
  void finish() const;
  /// Every chunk taken, in parallel, then finish().
  void take_all();

 private:
  std::vector<TakenChunk>& taken_;
  SpareShares& spares_;
  const StreamHeader header_;
  const Placement& placement_;
  const LaneLayout& layout_;
  const bool keep_origin_;
  std::uint64_t outputs_ = 0;
  std::uint64_t bytes_ = 0;
  std::vector<std::uint64_t> weights_;  // per chunk, as take() found them
  std::vector<char> ends_;
};

}  // namespace sluice::detail
