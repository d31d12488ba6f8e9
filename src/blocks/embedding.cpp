// Token embedding plus learned positions: a gather forward, a scatter-add backward.
#include <algorithm>
#include <string>

#include "blocks/block_support.hpp"
#include "sluice/blocks.hpp"

namespace sluice {
namespace {

// The tables are symbol-major (a row per symbol), the activations feature-major, so the
// backward's tasks own groups of features (columns of the tables): no two tasks add into
// the same element, and a group fills whole cache lines of a table row.
constexpr std::int64_t kFeatureGroup = 16;

void check_embedding(const char* block, std::span<const std::int32_t> tokens,
                     ConstMatrixView tokens_table, ConstMatrixView positions, ConstMatrixView x) {
  const std::int64_t d_model = tokens_table.cols;
  const std::int64_t context = positions.rows;
  detail::require_shape(block, "tokens_table", tokens_table, tokens_table.rows, d_model);
  detail::require_shape(block, "positions", positions, context, d_model);
  if (context <= 0 || static_cast<std::int64_t>(tokens.size()) % context != 0) {
    throw ShapeError(std::string(block) + ": " + std::to_string(tokens.size()) +
                     " tokens are not whole sequences of the positions' context " +
                     std::to_string(context));
  }
  detail::require_shape(block, "activations", x, d_model, static_cast<std::int64_t>(tokens.size()));
  detail::require_symbols(block, tokens, tokens_table.rows);
}

}  // namespace

void embedding_forward(std::span<const std::int32_t> tokens, ConstMatrixView tokens_table,
                       ConstMatrixView positions, MutableMatrixView x) {
  check_embedding("embedding_forward", tokens, tokens_table, positions, x);
  const std::int64_t context = positions.rows;
  detail::for_each_block_row(x.rows, x.cols, [&](std::int64_t f) {
    float* out = x.row(f);
    for (std::int64_t t = 0; t < x.cols; ++t) {
      out[t] = tokens_table(tokens[static_cast<std::size_t>(t)], f) + positions(t % context, f);
    }
  });
}

void embedding_backward(std::span<const std::int32_t> tokens, ConstMatrixView dx,
                        MutableMatrixView d_tokens_table, MutableMatrixView d_positions) {
  check_embedding("embedding_backward", tokens, d_tokens_table, d_positions, dx);
  const std::int64_t context = d_positions.rows;
  const std::int64_t d_model = dx.rows;
  const std::int64_t groups = (d_model + kFeatureGroup - 1) / kFeatureGroup;
  detail::for_each_block_row(groups, kFeatureGroup * dx.cols, [&](std::int64_t g) {
    const std::int64_t f_end = std::min(d_model, (g + 1) * kFeatureGroup);
    for (std::int64_t t = 0; t < dx.cols; ++t) {
      float* table_row = d_tokens_table.row(tokens[static_cast<std::size_t>(t)]);
      float* position_row = d_positions.row(t % context);
      for (std::int64_t f = g * kFeatureGroup; f < f_end; ++f) {
        table_row[f] += dx(f, t);
        position_row[f] += dx(f, t);
      }
    }
  });
}

}  // namespace sluice
