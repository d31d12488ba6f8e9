#pragma once
// A product's intake: takes a layer's stream from its source, checks each chunk and
// routes its packets to the lanes that own their input features. Internal.
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <type_traits>
#include <vector>

#include "engine/clock.hpp"

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
  std::uint64_t weights = 0;  // as take() found them
  bool ends_layer = false;

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

/// Takes a layer's stream from its source as it arrives: a task asks for chunk c
/// (arrive) and computes on it while later chunks are still on their way, so the stream
/// overlaps the arithmetic. Chunks are pulled in order, by whichever task asks first (one
/// at a time), and checked and routed to the lanes (with several lanes, routed packets
/// carry the row's index in its lane's resident tile, and with `keep_origin` their
/// position in the chunk): either by the task that pulls them (start_live), or by the
/// task about to compute each (take: a one-pass product, whose stream is then read once
/// while in cache), or all at once in parallel after the whole stream (take_all).
/// finish() checks the whole after the last. A chunk, once arrived, stays where it is
/// while later ones arrive: `into.chunks` is reserved for as many chunks as the layer
/// can have (an output per chunk, and an end), and may only be sized or walked whole
/// once the stream has arrived (arrived_all).
class Intake {
 public:
  Intake(TakenChunks& into, StreamSource& source, const Placement& placement,
         const LaneLayout& layout, bool keep_origin);

  const StreamHeader& header() const { return header_; }
  /// Once the stream has arrived: its chunks and bytes.
  std::size_t chunks() const { return taken_.size(); }
  std::uint64_t bytes() const { return bytes_; }
  /// The bytes of the stream the header describes (every weight, a carriage return per
  /// output and the end of the layer): known before it arrives.
  std::uint64_t expected_bytes() const;

  /// Whether chunk c arrives (waits for it; false once the stream ended before it). The
  /// task's clock, if given, stops while it waits.
  bool arrive(std::size_t c, TaskClock* clock = nullptr) {
    if (c < arrived_.load(std::memory_order_acquire)) return true;
    if (clock != nullptr) clock->pause();
    const bool got = pull_until(c + 1);
    if (clock != nullptr) clock->resume();
    return got;
  }
  /// Whether the stream has at least n chunks (waits for them or for its end).
  bool has_at_least(std::size_t n) { return pull_until(n); }
  /// Waits for the whole stream.
  void pull_all() { pull_until(static_cast<std::size_t>(-1)); }
  bool arrived_all() const { return ended_.load(std::memory_order_acquire); }

  /// For a pass that starts before the stream has arrived: from now on each chunk is
  /// taken by whoever pulls it (with `take_each`; else the pass takes it), then
  /// `on_arrival(c)` is called (both also for the chunks already there), before any task
  /// sees it; after the last, finish() (with `take_each`). Errors go to every task that
  /// asks for a chunk.
  void start_live(bool take_each, std::function<void(std::size_t)> on_arrival = {});

  /// Checks chunk c and routes it to the lanes.
  void take(std::size_t c);
  /// After every chunk is taken: what only the whole stream can show.
  void finish() const;
  /// The whole stream pulled, every chunk taken in parallel, then finish().
  void take_all();

  /// From the first chunk asked for to the end of the stream seen (once it arrived).
  Span arrival() const { return {arrival_begin_, arrival_end_}; }

 private:
  bool pull_until(std::size_t n);
  void pull_one();  // under mutex_

  std::vector<TakenChunk>& taken_;
  SpareShares& spares_;
  StreamSource& source_;
  const StreamHeader header_;
  const Placement& placement_;
  const LaneLayout& layout_;
  const bool keep_origin_;
  std::uint64_t outputs_ = 0;
  std::uint64_t bytes_ = 0;

  std::mutex mutex_;  // the puller's
  std::atomic<std::size_t> arrived_{0};
  std::atomic<bool> ended_{false};
  std::exception_ptr error_;
  bool started_ = false, taking_ = false;
  std::function<void(std::size_t)> on_arrival_;
  Clock::time_point arrival_begin_{}, arrival_end_{};
};

}  // namespace sluice::detail
