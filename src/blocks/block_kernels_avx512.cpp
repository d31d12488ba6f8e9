// The block kernels compiled for AVX512 (blocks/block_kernels.hpp).
#include "blocks/block_kernels_body.hpp"

namespace sluice::detail {

const BlockKernels kAvx512BlockKernels = kThisIsaBlockKernels;

}  // namespace sluice::detail
