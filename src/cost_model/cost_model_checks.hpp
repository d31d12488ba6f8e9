#pragma once
// Argument checks the cost model's sources share (internal).
#include <cstdint>
#include <sstream>
#include <string>

#include "sluice/error.hpp"

namespace sluice::detail {

inline std::string to_text(double value) {
  std::ostringstream out;
  out.precision(4);
  out << value;
  return out.str();
}

inline void check_shape(std::int64_t outputs, std::int64_t inputs, std::int64_t tokens,
                        const char* where) {
  if (outputs < 1 || inputs < 1 || tokens < 1)
    throw ShapeError(std::string(where) + ": outputs, inputs and tokens must be >= 1 (got " +
                     std::to_string(outputs) + " x " + std::to_string(inputs) + ", " +
                     std::to_string(tokens) + " tokens)");
}

inline void check_sparsity(double sparsity, const char* where) {
  if (!(sparsity >= 0.0 && sparsity <= 1.0))
    throw ArgumentError(std::string(where) + ": sparsity must be in [0, 1], got " +
                        to_text(sparsity));
}

}  // namespace sluice::detail
