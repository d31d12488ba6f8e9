// The block kernels compiled for AVX2 (blocks/block_kernels.hpp).
#include "blocks/block_kernels_body.hpp"

namespace sluice::detail {

const BlockKernels kAvx2BlockKernels = kThisIsaBlockKernels;

}  // namespace sluice::detail
