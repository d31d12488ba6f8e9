#include "kernels/lane_kernels.hpp"

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
  // AVX2 has no fast bf16 path of its own yet: the portable loops serve it.
  return isa == Isa::avx512 ? kAvx512Bf16Kernels : kScalarBf16Kernels;
}

}  // namespace sluice::detail
