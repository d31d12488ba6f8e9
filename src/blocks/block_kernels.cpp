// The block kernels at the baseline ISA, and the choice among the ISAs' kernels.
#include "blocks/block_kernels.hpp"

#include "blocks/block_kernels_body.hpp"
#include "core/isa_choice.hpp"

namespace sluice::detail {

const BlockKernels kScalarBlockKernels = kThisIsaBlockKernels;

const BlockKernels& block_kernels(Isa isa) {
  return *for_isa(isa, &kScalarBlockKernels, &kAvx2BlockKernels, &kAvx512BlockKernels);
}

const BlockKernels& block_kernels() {
  static const BlockKernels& chosen = block_kernels(default_isa());
  return chosen;
}

}  // namespace sluice::detail
