#pragma once
// What the AVX2 and AVX-512 stream scans (stream_scan_avx2.cpp, stream_scan_avx512.cpp) do
// alike, written once over the including file's ScanLanes traits (its vector of 32-bit
// lanes, a GCC vector type, so lane-wise logic and arithmetic are plain operators; and how
// that width loads packets, takes maxima, looks at the lane before, writes carriage-return
// positions and folds lanes): the rules on a vector of packets kept as VectorRules says,
// and the walk over a chunk a vector at a time, the packets left after the last whole
// vector by the scalar rules. Internal. As lane_kernels_body.hpp, everything here is in an
// unnamed namespace, so each file keeps its own copy and no ISA's code can stand in for
// another's at link time (tests/isa_objects_share_nothing.sh).
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "engine/kernels/stream_scan.hpp"

namespace sluice::detail {
namespace {

/// Two vectors, as ScanLanes::load and ScanLanes::predecessors give them.
template <typename Vec>
struct VectorPair {
  Vec first, second;
};

/// The rules on ScanLanes::kWidth packets a step, given their tags and their values'
/// exponent bits, kept as VectorRules says; only carriage returns (their positions) and
/// ends-of-layer (their count) are looked at every step.
template <typename ScanLanes>
class Scanner {
 public:
  using Vec = typename ScanLanes::Vec;

  Scanner(std::uint32_t inputs, std::uint32_t outputs, bool check_values,
          std::uint32_t* carriage_returns)
      : carriage_returns_(carriage_returns),
        inputs_(inputs),
        outputs_(outputs),
        check_values_(check_values) {}

  void step(std::size_t k, Vec tags, Vec exponents) {
    const Vec control = tags >> 31;           // all ones for a control
    const Vec weight_tags = ~control & tags;  // controls as 0
    largest_tag_ = ScanLanes::max_unsigned(largest_tag_, weight_tags);
    largest_control_ = ScanLanes::max_unsigned(largest_control_, ~tags & control);
    // Each packet's step from the one before: a weight after a weight must increase, and
    // a control as a predecessor is -1 and as a successor 2^30, so any step involving one
    // is positive.
    const auto [before, carry] = ScanLanes::predecessors(tags | control, carry_);
    smallest_step_ = ScanLanes::min_signed(
        smallest_step_, (weight_tags | (control & VectorRules::kFarAhead)) - before);
    largest_exponent_ = ScanLanes::max_unsigned(largest_exponent_, ~control & exponents);
    carry_ = carry;
    returns_ += ScanLanes::write_returns(tags, k, carriage_returns_, returns_, outputs_);
    ends_ += ScanLanes::count(tags, kEndOfLayer);
  }

  /// Finishes packets [from, n) with the scalar rules and gives the verdict.
  template <typename PacketT>
  bool finish(const PacketT* p, std::size_t from, std::size_t n) const {
    const VectorRules rules{ScanLanes::largest(largest_tag_), ScanLanes::largest(largest_control_),
                            ScanLanes::smallest(smallest_step_),
                            ScanLanes::largest(largest_exponent_)};
    return rules.finish(p, from, n, ScanLanes::last_tag(carry_), inputs_, outputs_, check_values_,
                        carriage_returns_, returns_, ends_);
  }

 private:
  // The last step's tags as ScanLanes::predecessors keeps them (controls as all ones).
  Vec carry_ = Vec{} + static_cast<std::int32_t>(kCarriageReturn);
  Vec largest_tag_{};
  Vec largest_control_{};
  Vec smallest_step_ = Vec{} + 1;
  Vec largest_exponent_{};
  std::uint32_t* carriage_returns_;
  std::uint32_t inputs_;
  std::uint32_t outputs_;
  std::uint32_t returns_ = 0, ends_ = 0;
  bool check_values_;
};

/// The stream check's fast path on an fp32 or bf16 chunk (StreamScan's contract).
template <typename ScanLanes, typename PacketT>
bool scan(const PacketT* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
          bool check_values, std::uint32_t* carriage_returns) {
  if (!VectorRules::apply(inputs)) {
    if constexpr (std::is_same_v<PacketT, Packet>) {
      return kScalarStreamScan.fp32(p, n, inputs, outputs, check_values, carriage_returns);
    } else {
      return kScalarStreamScan.bf16(p, n, inputs, outputs, check_values, carriage_returns);
    }
  }
  Scanner<ScanLanes> scanner(inputs, outputs, check_values, carriage_returns);
  std::size_t k = 0;
  for (; k + ScanLanes::kWidth <= n; k += ScanLanes::kWidth) {
    const auto [tags, exponents] = ScanLanes::load(p, k);
    scanner.step(k, tags, exponents);
  }
  return scanner.finish(p, k, n);
}

}  // namespace
}  // namespace sluice::detail
