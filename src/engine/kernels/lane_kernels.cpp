#include "engine/kernels/lane_kernels.hpp"

#include "core/isa_choice.hpp"

namespace sluice::detail {

const LaneKernels& lane_kernels(Isa isa) {
  return *for_isa(isa, &kScalarKernels, &kAvx2Kernels, &kAvx512Kernels);
}

const Bf16LaneKernels& bf16_lane_kernels(Isa isa) {
  return *for_isa(isa, &kScalarBf16Kernels, &kAvx2Bf16Kernels, &kAvx512Bf16Kernels);
}

const ByInputKernels& by_input_kernels(Isa isa) {
  return *for_isa(isa, &kScalarByInput, &kAvx2ByInput, &kAvx512ByInput);
}

}  // namespace sluice::detail
