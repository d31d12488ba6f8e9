// Causal multi-head self-attention arithmetic: the part between the Q, K, V projections and
// the output projection. One task per (sequence, head), writing rows no other task writes;
// each task's arithmetic is a block kernel of the ISA the library runs
// (blocks/block_kernels_body.hpp: blocked products on the head's rows as they lie, causal
// column blocks stopping at the diagonal).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "blocks/block_kernels.hpp"
#include "blocks/block_support.hpp"
#include "sluice/blocks.hpp"

namespace sluice {
namespace {

using detail::HeadTask;

void check_attention(const char* block, ConstMatrixView q, AttentionShape shape,
                     std::size_t probabilities_size) {
  if (shape.context <= 0 || shape.heads <= 0) {
    throw ShapeError(std::string(block) + ": context and heads must be positive");
  }
  if (q.rows <= 0 || q.rows % shape.heads != 0) {
    throw ShapeError(std::string(block) + ": d_model " + std::to_string(q.rows) +
                     " is not a positive multiple of heads " + std::to_string(shape.heads));
  }
  if (q.cols % shape.context != 0) {
    throw ShapeError(std::string(block) + ": " + std::to_string(q.cols) +
                     " tokens are not whole sequences of context " + std::to_string(shape.context));
  }
  detail::require_shape(block, "q", q, q.rows, q.cols);
  detail::require_size(block, "probabilities", probabilities_size,
                       attention_probabilities_size(q.cols, shape));
}

/// A task's scratch for the kernels, kept by each thread between calls: allocating it
/// per task would map and unmap fresh pages for every head of every block.
float* head_scratch(const HeadTask& task) {
  thread_local std::vector<float> scratch;
  const auto floats = static_cast<std::size_t>(detail::attention_scratch_floats(task));
  if (scratch.size() < floats) scratch.resize(floats);
  return scratch.data();
}

/// fn(task) for every (sequence, head) of a batch, one task each in parallel.
template <typename Fn>
void for_each_head(std::int64_t d_model, std::int64_t tokens, AttentionShape shape, Fn&& fn) {
  const std::int64_t sequences = tokens / shape.context;
  const std::int64_t d_head = d_model / shape.heads;
  detail::for_each_block_row(
      sequences * shape.heads, d_head * shape.context * shape.context, [&](std::int64_t n) {
        const std::int64_t s = n / shape.heads, h = n % shape.heads;
        HeadTask task{shape.context, d_head, h * d_head, s * shape.context,
                      static_cast<std::size_t>(n * shape.context * shape.context)};
        fn(task);
      });
}

}  // namespace

std::int64_t attention_probabilities_size(std::int64_t tokens, AttentionShape shape) {
  if (shape.context <= 0) return 0;
  return tokens / shape.context * shape.heads * shape.context * shape.context;
}

void causal_attention_forward(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                              AttentionShape shape, MutableMatrixView out,
                              std::span<float> probabilities) {
  const char* block = "causal_attention_forward";
  check_attention(block, q, shape, probabilities.size());
  detail::require_shape(block, "k", k, q.rows, q.cols);
  detail::require_shape(block, "v", v, q.rows, q.cols);
  detail::require_shape(block, "out", out, q.rows, q.cols);
  const detail::BlockKernels& kernels = detail::block_kernels();
  for_each_head(q.rows, q.cols, shape, [&](const HeadTask& task) {
    kernels.attention_forward(q, k, v, task, out, probabilities.data() + task.probabilities_offset,
                              head_scratch(task));
  });
}

void causal_attention_backward(ConstMatrixView q, ConstMatrixView k, ConstMatrixView v,
                               std::span<const float> probabilities, AttentionShape shape,
                               ConstMatrixView d_out, MutableMatrixView dq, MutableMatrixView dk,
                               MutableMatrixView dv) {
  const char* block = "causal_attention_backward";
  check_attention(block, q, shape, probabilities.size());
  detail::require_shape(block, "k", k, q.rows, q.cols);
  detail::require_shape(block, "v", v, q.rows, q.cols);
  detail::require_shape(block, "d_out", d_out, q.rows, q.cols);
  detail::require_shape(block, "dq", dq, q.rows, q.cols);
  detail::require_shape(block, "dk", dk, q.rows, q.cols);
  detail::require_shape(block, "dv", dv, q.rows, q.cols);
  const detail::BlockKernels& kernels = detail::block_kernels();
  for_each_head(q.rows, q.cols, shape, [&](const HeadTask& task) {
    kernels.attention_backward(q, k, v, probabilities.data() + task.probabilities_offset, task,
                               d_out, dq, dk, dv, head_scratch(task));
  });
}

}  // namespace sluice
