// Softmax cross-entropy over the symbols of every token (a logits column). Columns are
// strided in the feature-major layout, so a task takes a chunk of tokens and runs over the
// symbols outside, the chunk's tokens inside.
#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "blocks/block_support.hpp"
#include "sluice/blocks.hpp"

namespace sluice {
namespace {

constexpr std::int64_t kTokenChunk = 64;

/// The chunk [begin, end)'s loss sum; its dlogits when `dlogits` has data.
double chunk_loss(ConstMatrixView logits, std::span<const std::int32_t> targets,
                  MutableMatrixView dlogits, float scale, std::int64_t begin, std::int64_t end) {
  const std::int64_t n = end - begin, vocab = logits.rows;
  std::array<float, kTokenChunk> max_logit;
  std::fill(max_logit.begin(), max_logit.end(), -INFINITY);
  for (std::int64_t r = 0; r < vocab; ++r) {
    const float* z = logits.row(r) + begin;
    for (std::int64_t i = 0; i < n; ++i) max_logit[i] = std::max(max_logit[i], z[i]);
  }
  std::array<double, kTokenChunk> sum{};
  for (std::int64_t r = 0; r < vocab; ++r) {
    const float* z = logits.row(r) + begin;
    for (std::int64_t i = 0; i < n; ++i) sum[i] += std::exp(z[i] - max_logit[i]);
  }
  double loss = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t target = targets[static_cast<std::size_t>(begin + i)];
    loss += std::log(sum[i]) + max_logit[i] - logits(target, begin + i);
  }
  if (dlogits.data == nullptr) return loss;
  std::array<float, kTokenChunk> factor{};
  for (std::int64_t i = 0; i < n; ++i) factor[i] = static_cast<float>(scale / sum[i]);
  for (std::int64_t r = 0; r < vocab; ++r) {
    const float* z = logits.row(r) + begin;
    float* d = dlogits.row(r) + begin;
    for (std::int64_t i = 0; i < n; ++i) d[i] = std::exp(z[i] - max_logit[i]) * factor[i];
  }
  for (std::int64_t i = 0; i < n; ++i) {
    dlogits(targets[static_cast<std::size_t>(begin + i)], begin + i) -= scale;
  }
  return loss;
}

}  // namespace

double softmax_cross_entropy(ConstMatrixView logits, std::span<const std::int32_t> targets,
                             MutableMatrixView dlogits, float scale) {
  const char* block = "softmax_cross_entropy";
  const auto tokens = static_cast<std::int64_t>(targets.size());
  if (logits.rows <= 0) throw ShapeError(std::string(block) + ": no symbols");
  detail::require_shape(block, "logits", logits, logits.rows, tokens);
  if (dlogits.data != nullptr)
    detail::require_shape(block, "dlogits", dlogits, logits.rows, tokens);
  detail::require_symbols(block, targets, logits.rows);
  const std::int64_t chunks = (tokens + kTokenChunk - 1) / kTokenChunk;
  std::vector<double> losses(static_cast<std::size_t>(chunks));
  detail::for_each_block_row(chunks, logits.rows * kTokenChunk, [&](std::int64_t c) {
    losses[static_cast<std::size_t>(c)] = chunk_loss(
        logits, targets, dlogits, scale, c * kTokenChunk, std::min(tokens, (c + 1) * kTokenChunk));
  });
  double total = 0;  // in chunk order: the same sum however the chunks were scheduled
  for (const double l : losses) total += l;
  return total;
}

}  // namespace sluice
