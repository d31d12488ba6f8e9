#pragma once
// What the block files share: argument checks (every public block function checks its shapes
// once, up front, and says which block and which argument did not fit) and a row loop that
// goes parallel only when the work pays for waking the cores. Internal.
#include <cstdint>
#include <span>
#include <string>

#include "core/parallel.hpp"
#include "sluice/dense.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {

inline std::string shape_text(std::int64_t rows, std::int64_t cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

/// Throws ShapeError unless `m` is a usable rows x cols view.
template <typename T>
void require_shape(const char* block, const char* name, MatrixView<T> m, std::int64_t rows,
                   std::int64_t cols) {
  if (m.rows != rows || m.cols != cols) {
    throw ShapeError(std::string(block) + ": " + name + " is " + shape_text(m.rows, m.cols) +
                     ", expected " + shape_text(rows, cols));
  }
  if (m.stride < m.cols || (m.data == nullptr && rows * cols > 0)) {
    throw ShapeError(std::string(block) + ": " + name + " has no data or a stride below its " +
                     std::to_string(cols) + " columns");
  }
}

/// Throws ShapeError unless a span has `size` elements.
inline void require_size(const char* block, const char* name, std::size_t actual,
                         std::int64_t size) {
  if (static_cast<std::int64_t>(actual) != size) {
    throw ShapeError(std::string(block) + ": " + name + " has " + std::to_string(actual) +
                     " elements, expected " + std::to_string(size));
  }
}

/// Throws ArgumentError unless 0 <= tokens[t] < vocab for every t.
inline void require_symbols(const char* block, std::span<const std::int32_t> tokens,
                            std::int64_t vocab) {
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t] < 0 || tokens[t] >= vocab) {
      throw ArgumentError(std::string(block) + ": symbol " + std::to_string(tokens[t]) +
                          " at token " + std::to_string(t) + " is outside 0.." +
                          std::to_string(vocab - 1));
    }
  }
}

/// fn(r) for every r in [0, rows) of a pass over rows x cols elements: serial when small.
template <typename Fn>
void for_each_block_row(std::int64_t rows, std::int64_t cols, Fn&& fn) {
  constexpr std::int64_t kParallelElements = std::int64_t{1} << 15;
  if (rows * cols < kParallelElements) {
    for (std::int64_t r = 0; r < rows; ++r) fn(r);
  } else {
    parallel_for(std::int64_t{0}, rows, fn);
  }
}

}  // namespace sluice::detail
