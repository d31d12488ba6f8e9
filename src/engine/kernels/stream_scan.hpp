#pragma once
// The fast path of the stream check: one pass over a chunk's packets, without branches on
// the data, that accepts only a well-formed chunk. Internal; one implementation per ISA.
// A chunk it does not accept goes through the packet-by-packet check in stream.cpp,
// which names the fault, so a scan only ever has to be right about "all well".
#include <bit>
#include <cstddef>
#include <cstdint>

#include "sluice/isa.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

/// True if every weight's index is < `inputs` and increases within its output, every
/// value is finite (if `check_values`), every control packet is a carriage return or a
/// final end-of-layer right after one, the chunk ends closed and holds exactly `outputs`
/// carriage returns. Then `carriage_returns` (if not null, room for `outputs`) holds
/// their positions. On false its contents are unspecified.
struct StreamScan {
  bool (*fp32)(const Packet* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
               bool check_values, std::uint32_t* carriage_returns);
  bool (*bf16)(const Bf16Packet* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
               bool check_values, std::uint32_t* carriage_returns);
};

const StreamScan& stream_scan(Isa isa);

extern const StreamScan kScalarStreamScan;
extern const StreamScan kAvx2StreamScan;
extern const StreamScan kAvx512StreamScan;

/// The rules above for packets [begin, n), `prev` the tag before `begin` (a carriage
/// return at the start): the scalar scan, and the tail of the vector ones. Accumulates
/// into `bad`, `returns` and `ends`; writes carriage-return positions from `*written`
/// while fewer than `outputs` have been written (more make the chunk bad anyway).
template <typename PacketT>
void scan_packets(const PacketT* p, std::size_t begin, std::size_t n, std::uint32_t prev,
                  std::uint32_t inputs, std::uint32_t outputs, bool check_values,
                  std::uint32_t* carriage_returns, std::uint32_t& bad, std::uint32_t& returns,
                  std::uint32_t& ends) {
  const std::uint32_t values = check_values ? 1U : 0U;
  for (std::size_t k = begin; k < n; ++k) {
    const std::uint32_t tag = tag_of(p[k]);
    const bool finite = [&] {
      if constexpr (sizeof(PacketT) == 8) {
        return (std::bit_cast<std::uint32_t>(p[k].value) & 0x7F80'0000U) != 0x7F80'0000U;
      } else {
        return (p[k].value & 0x7F80U) != 0x7F80U;
      }
    }();
    const std::uint32_t weight = (tag >> 31) ^ 1U;
    const std::uint32_t after_weight = (prev >> 31) ^ 1U;
    bad |= weight & static_cast<std::uint32_t>(tag >= inputs);
    bad |= weight & after_weight & static_cast<std::uint32_t>(tag <= prev);
    bad |= weight & values & static_cast<std::uint32_t>(!finite);
    bad |= (weight ^ 1U) & static_cast<std::uint32_t>(tag != kCarriageReturn) &
           static_cast<std::uint32_t>(tag != kEndOfLayer);
    if (tag == kCarriageReturn) {
      if (carriage_returns != nullptr && returns < outputs) {
        carriage_returns[returns] = static_cast<std::uint32_t>(k);
      }
      ++returns;
    }
    ends += static_cast<std::uint32_t>(tag == kEndOfLayer);
    prev = tag;
  }
}

/// The checks on the whole chunk once every packet has been scanned.
template <typename PacketT>
bool scan_verdict(const PacketT* p, std::size_t n, std::uint32_t outputs, std::uint32_t bad,
                  std::uint32_t returns, std::uint32_t ends) {
  if (n == 0) return outputs == 0;
  // Closed by a carriage return, or by end-of-layer right after one (or alone).
  const std::uint32_t last = tag_of(p[n - 1]);
  const bool closed = last == kCarriageReturn || (last == kEndOfLayer && ends == 1 &&
                                                  (n == 1 || tag_of(p[n - 2]) == kCarriageReturn));
  return bad == 0 && closed && (last == kEndOfLayer || ends == 0) && returns == outputs;
}

/// What the vector scans keep of a chunk's packets, folded over their lanes: the largest
/// weight tag (controls as 0), the largest control as ~tag (0 a carriage return, 1
/// end-of-layer; weights as 0), the smallest step between neighbours (a control as -1
/// before and 2^30 after, so a step involving one is positive; weights must increase) and
/// the largest exponent bits of a weight's value. Judged once per chunk: a compare into a
/// mask per rule and step made the AVX-512 scan four times slower (mask instructions, not
/// loads, bound it).
struct VectorRules {
  static constexpr std::int32_t kFarAhead = 1 << 30;
  static constexpr std::int32_t kExponent = 0x7F80'0000;  // an fp32's exponent bits
  /// Steps are 32-bit differences: the vector rules hold for 1 to 2^30 inputs.
  static bool apply(std::uint32_t inputs) {
    return inputs >= 1 && inputs <= static_cast<std::uint32_t>(kFarAhead);
  }

  std::uint32_t largest_tag = 0, largest_control = 0;
  std::int32_t smallest_step = 1;
  std::uint32_t largest_exponent = 0;

  /// The end of a vector scan: these rules' verdict, then packets [from, n) by the scalar
  /// rules, `prev` the tag before them (a control may stand as a carriage return).
  template <typename PacketT>
  bool finish(const PacketT* p, std::size_t from, std::size_t n, std::uint32_t prev,
              std::uint32_t inputs, std::uint32_t outputs, bool check_values,
              std::uint32_t* carriage_returns, std::uint32_t returns, std::uint32_t ends) const {
    const bool broken = largest_tag >= inputs || largest_control > 1 || smallest_step <= 0 ||
                        (check_values && largest_exponent == static_cast<std::uint32_t>(kExponent));
    std::uint32_t bad = broken ? 1U : 0U;
    scan_packets(p, from, n, prev, inputs, outputs, check_values, carriage_returns, bad, returns,
                 ends);
    return scan_verdict(p, n, outputs, bad, returns, ends);
  }
};

}  // namespace sluice::detail
