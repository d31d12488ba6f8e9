// Causal multi-head self-attention arithmetic: the part between the Q, K, V projections and
// the output projection. One task per (sequence, head), writing rows no other task writes.
// Each product is arranged so its inner loop runs over contiguous floats without a reduction
// (which would stay serial): a token's scores against all earlier tokens read K's (or V's)
// feature-major rows as they lie; sums of token vectors (P V, dV, dQ, dK) use token-major
// copies of the head's slices.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "blocks/block_support.hpp"
#include "sluice/blocks.hpp"

namespace sluice {
namespace {

struct HeadTask {
  std::int64_t context = 0, d_head = 0;
  std::int64_t first_row = 0, first_token = 0;
  std::size_t probabilities_offset = 0;
};

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

/// The head's rows of m, token-major: buffer[i * d_head + f] = m(first_row + f, first_token + i).
void gather(ConstMatrixView m, const HeadTask& task, std::vector<float>& buffer) {
  buffer.resize(static_cast<std::size_t>(task.context * task.d_head));
  for (std::int64_t f = 0; f < task.d_head; ++f) {
    const float* row = m.row(task.first_row + f) + task.first_token;
    for (std::int64_t i = 0; i < task.context; ++i) buffer[i * task.d_head + f] = row[i];
  }
}

void scatter(const std::vector<float>& buffer, const HeadTask& task, MutableMatrixView m) {
  for (std::int64_t f = 0; f < task.d_head; ++f) {
    float* row = m.row(task.first_row + f) + task.first_token;
    for (std::int64_t i = 0; i < task.context; ++i) row[i] = buffer[i * task.d_head + f];
  }
}

/// row[j] = sum_f vector[f] * m(first_row + f, first_token + j) for j < n: the head's rows of
/// the feature-major m read as they lie (tokens contiguous), so the loop over j vectorises
/// where a dot product per j would be a serial reduction.
void dot_with_rows(const float* vector, ConstMatrixView m, const HeadTask& task, std::int64_t n,
                   float* row) {
  std::fill(row, row + n, 0.0F);
  for (std::int64_t f = 0; f < task.d_head; ++f) {
    const float x = vector[f];
    const float* m_row = m.row(task.first_row + f) + task.first_token;
    for (std::int64_t j = 0; j < n; ++j) row[j] += x * m_row[j];
  }
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
  for_each_head(q.rows, q.cols, shape, [&](const HeadTask& task) {
    const std::int64_t c = task.context, dh = task.d_head;
    const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dh)));
    std::vector<float> qt, vt, ot(static_cast<std::size_t>(c * dh));
    gather(q, task, qt);
    gather(v, task, vt);
    for (std::int64_t i = 0; i < c; ++i) {
      float* p = probabilities.data() + task.probabilities_offset + i * c;
      // Max-subtracted softmax over the tokens j <= i; the masked ones are exactly zero.
      dot_with_rows(&qt[i * dh], k, task, i + 1, p);
      float max_score = -INFINITY;
      for (std::int64_t j = 0; j <= i; ++j) {
        p[j] *= scale;
        max_score = std::max(max_score, p[j]);
      }
      double sum = 0;
      for (std::int64_t j = 0; j <= i; ++j) {
        p[j] = std::exp(p[j] - max_score);
        sum += p[j];
      }
      const auto inv_sum = static_cast<float>(1.0 / sum);
      for (std::int64_t j = 0; j <= i; ++j) p[j] *= inv_sum;
      std::fill(p + i + 1, p + c, 0.0F);
      float* o = &ot[i * dh];
      for (std::int64_t j = 0; j <= i; ++j) {
        const float* vj = &vt[j * dh];
        for (std::int64_t f = 0; f < dh; ++f) o[f] += p[j] * vj[f];
      }
    }
    scatter(ot, task, out);
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
  for_each_head(q.rows, q.cols, shape, [&](const HeadTask& task) {
    const std::int64_t c = task.context, dh = task.d_head;
    const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dh)));
    const auto size = static_cast<std::size_t>(c * dh);
    std::vector<float> qt, kt, dot_buffer, dqt(size), dkt(size), dvt(size);
    std::vector<float> dp(static_cast<std::size_t>(c));
    gather(q, task, qt);
    gather(k, task, kt);
    gather(d_out, task, dot_buffer);
    for (std::int64_t i = 0; i < c; ++i) {
      const float* p = probabilities.data() + task.probabilities_offset + i * c;
      const float* doi = &dot_buffer[i * dh];
      dot_with_rows(doi, v, task, i + 1, dp.data());
      double row_dot = 0;  // sum_j P(i, j) dP(i, j): the softmax's Jacobian term
      for (std::int64_t j = 0; j <= i; ++j) {
        row_dot += static_cast<double>(p[j]) * dp[j];
        float* dvj = &dvt[j * dh];
        for (std::int64_t f = 0; f < dh; ++f) dvj[f] += p[j] * doi[f];
      }
      float* dqi = &dqt[i * dh];
      const float* qi = &qt[i * dh];
      for (std::int64_t j = 0; j <= i; ++j) {
        const float ds = p[j] * static_cast<float>(dp[j] - row_dot) * scale;
        const float* kj = &kt[j * dh];
        float* dkj = &dkt[j * dh];
        for (std::int64_t f = 0; f < dh; ++f) {
          dqi[f] += ds * kj[f];
          dkj[f] += ds * qi[f];
        }
      }
    }
    scatter(dqt, task, dq);
    scatter(dkt, task, dk);
    scatter(dvt, task, dv);
  });
}

}  // namespace sluice
