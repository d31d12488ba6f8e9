#pragma once
// The weightless blocks' inner loops (a (sequence, head)'s attention, a row's GELU), once per
// ISA like the engine's kernels: the same C++ (blocks/block_kernels_body.hpp) compiled for
// each, so its loops vectorise at the width of the ISA the library runs (SLUICE_ISA caps
// it, so the tests reach every path). Internal.
#include <cstddef>
#include <cstdint>

#include "sluice/dense.hpp"
#include "sluice/isa.hpp"

namespace sluice::detail {

/// One (sequence, head) of an attention call: the head's d_head feature rows from
/// first_row, the sequence's context tokens from first_token, its context^2 probabilities
/// from probabilities_offset.
struct HeadTask {
  std::int64_t context = 0, d_head = 0;
  std::int64_t first_row = 0, first_token = 0;
  std::size_t probabilities_offset = 0;
};

/// Floats of scratch a task's attention forward and backward need.
constexpr std::int64_t attention_scratch_floats(const HeadTask& task) {
  return 2 * task.context * task.d_head + 2 * task.context * task.context;
}

struct BlockKernels {
  /// out's rows of the task = V softmax(Q^T K / sqrt(d_head), causal)^T; P into probs.
  void (*attention_forward)(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                            const HeadTask& task, MutableMatrixView out, float* probs,
                            float* scratch);
  /// dQ, dK, dV of the task's rows from dO and the saved P.
  void (*attention_backward)(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                             const float* probs, const HeadTask& task, ConstMatrixView d_out,
                             MutableMatrixView dq, MutableMatrixView dk, MutableMatrixView dv,
                             float* scratch);
  /// y[t] = gelu(z[t]) for t < n.
  void (*gelu_forward)(const float* z, float* y, std::int64_t n);
  /// dz[t] = dy[t] gelu'(z[t]) for t < n.
  void (*gelu_backward)(const float* z, const float* dy, float* dz, std::int64_t n);
};

extern const BlockKernels kScalarBlockKernels;
extern const BlockKernels kAvx2BlockKernels;
extern const BlockKernels kAvx512BlockKernels;

/// The kernels of `isa`.
const BlockKernels& block_kernels(Isa isa);
/// The kernels of default_isa(), chosen once.
const BlockKernels& block_kernels();

}  // namespace sluice::detail
