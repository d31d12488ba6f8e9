#pragma once
// The dense path's packet kernels (docs/dense_path.md): a checked run of packets written
// whole into a dense row (its weights, and zeros between and after them),
// and a run's weight gradient read from a dense gradient row at its tags. Internal; one
// implementation per ISA, as the stream scan.
#include <cstdint>

#include "sluice/isa.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

struct DensifyKernels {
  /// row[0, width) = the run's weights at their indices, zeros elsewhere; nothing past
  /// width is written. The run is checked: indices strictly increasing and < width, no
  /// control packets.
  void (*fp32)(const Packet* run, std::uint32_t n, float* row, std::uint32_t width);
  void (*bf16)(const Bf16Packet* run, std::uint32_t n, std::uint16_t* row, std::uint32_t width);
  /// out[k] = {tag, row[tag]} for the run's packets.
  void (*gradient_fp32)(const Packet* run, std::uint32_t n, const float* row, Packet* out);
  void (*gradient_bf16)(const Bf16Packet* run, std::uint32_t n, const float* row, Packet* out);
};

/// The kernels for this CPU, as default_isa() caps it.
const DensifyKernels& densify_kernels();

extern const DensifyKernels kScalarDensify;
DensifyKernels avx512_densify();

}  // namespace sluice::detail
