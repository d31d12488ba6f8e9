#include "engine/kernels/lane_kernels.hpp"

namespace sluice::detail {

const LaneKernels& lane_kernels(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return kAvx512Kernels;
    case Isa::avx2:
      return kAvx2Kernels;
    case Isa::scalar:
      break;
  }
  return kScalarKernels;
}

const Bf16LaneKernels& bf16_lane_kernels(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return kAvx512Bf16Kernels;
    case Isa::avx2:
      return kAvx2Bf16Kernels;
    case Isa::scalar:
      break;
  }
  return kScalarBf16Kernels;
}

}  // namespace sluice::detail
