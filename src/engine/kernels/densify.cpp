#include "engine/kernels/densify.hpp"

#include <algorithm>

namespace sluice::detail {
namespace {

template <typename P, typename T>
void densify(const P* run, std::uint32_t n, T* row, std::uint32_t width) {
  std::uint32_t next = 0;
  for (std::uint32_t k = 0; k < n; ++k) {
    const std::uint32_t index = tag_of(run[k]);
    std::fill(row + next, row + index, T{});
    row[index] = run[k].value;
    next = index + 1;
  }
  std::fill(row + next, row + width, T{});
}

template <typename P>
void gradient(const P* run, std::uint32_t n, const float* row, Packet* out) {
  for (std::uint32_t k = 0; k < n; ++k) {
    const std::uint32_t tag = tag_of(run[k]);
    out[k] = {tag, row[tag]};
  }
}

DensifyKernels chosen() {
  DensifyKernels k = kScalarDensify;
  if (default_isa() == Isa::avx512) {
    const DensifyKernels v = avx512_densify();
    if (v.fp32 != nullptr) k.fp32 = v.fp32;
    if (v.bf16 != nullptr) k.bf16 = v.bf16;
    if (v.gradient_fp32 != nullptr) k.gradient_fp32 = v.gradient_fp32;
    if (v.gradient_bf16 != nullptr) k.gradient_bf16 = v.gradient_bf16;
  }
  return k;
}

}  // namespace

const DensifyKernels kScalarDensify{densify<Packet, float>, densify<Bf16Packet, std::uint16_t>,
                                    gradient<Packet>, gradient<Bf16Packet>};

const DensifyKernels& densify_kernels() {
  static const DensifyKernels kernels = chosen();
  return kernels;
}

}  // namespace sluice::detail
