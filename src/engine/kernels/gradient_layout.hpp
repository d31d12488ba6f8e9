#pragma once
// Rank 0 of MpiFabric lays out each chunk of a summed gradient stream: only the values
// came back from the engines (4 bytes per weight), the tags and control packets are those
// of the chunk rank 0 sent. Internal; one implementation per ISA, as stream_scan.hpp.
#include <cstddef>

#include "sluice/isa.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

/// Writes `n` fp32 packets to `out`: packet k has the tag of `sent[k]` (a bf16 control as
/// its fp32 tag) and, for a weight, the next of `values` (in order), for a control 0.
/// `streaming`: non-temporal stores, for a result larger than the caches (writing around
/// them saves reading every line first, a third of the memory traffic).
struct GradientLayout {
  void (*fp32)(const Packet* sent, std::size_t n, const float* values, Packet* out, bool streaming);
  void (*bf16)(const Bf16Packet* sent, std::size_t n, const float* values, Packet* out,
               bool streaming);
};

const GradientLayout& gradient_layout(Isa isa);

extern const GradientLayout kScalarGradientLayout;
extern const GradientLayout kAvx512GradientLayout;

/// Packets [begin, end) one at a time; returns `values` past the ones used.
template <typename PacketT>
const float* lay_out_packets(const PacketT* sent, std::size_t begin, std::size_t end,
                             const float* values, Packet* out) {
  for (std::size_t k = begin; k < end; ++k) {
    out[k] =
        is_control(sent[k]) ? Packet{tag_of(sent[k]), 0.0F} : Packet{tag_of(sent[k]), *values++};
  }
  return values;
}

}  // namespace sluice::detail
