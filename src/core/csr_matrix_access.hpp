#pragma once
// Internal: a CsrMatrix's arrays, writable, for the model store's cache: it reads a layer's
// pattern into the arrays of a piece it evicted (memory already allocated and faulted in,
// not new zero-filled vectors), and a pattern it validated when the store opened or wrote
// it is not validated again on each reload (its CRC proves the bytes unchanged). Whoever
// writes through this keeps the invariants CsrMatrix's constructor checks.
#include <cstdint>
#include <vector>

#include "sluice/csr_matrix.hpp"

namespace sluice::detail {

struct CsrMatrixAccess {
  static std::vector<std::int64_t>& row_offsets(CsrMatrix& m) { return m.row_offsets_; }
  static std::vector<std::uint32_t>& col_indices(CsrMatrix& m) { return m.col_indices_; }
  static void set_shape(CsrMatrix& m, std::int64_t rows, std::int64_t cols) {
    m.rows_ = rows;
    m.cols_ = cols;
  }
};

}  // namespace sluice::detail
