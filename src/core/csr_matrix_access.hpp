#pragma once
// Internal: a CsrMatrix's arrays, writable, for the model store's cache: it reads a layer's
// pattern into the arrays of a piece it evicted (memory already allocated and faulted in,
// not new zero-filled vectors), and a pattern it validated when the store opened or wrote
// it is not validated again on each reload (its CRC proves the bytes unchanged). Whoever
// writes through this keeps the invariants CsrMatrix's constructor checks.
#include <cstdint>
#include <vector>

#include "core/huge_pages.hpp"
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

/// Makes `v` hold `n` elements for the caller to overwrite, keeping its memory where it has
/// room for them and is not much larger (a larger buffer kept would hold memory the model
/// store's budget does not count); only elements beyond its old size are value-initialised.
/// New memory is asked to be in huge pages: a layer's arrays are tens of megabytes, read
/// in whole, and a 4 KiB page fault per page of them was most of a reload's time.
template <typename T>
void resize_for_overwrite(std::vector<T>& v, std::size_t n) {
  if (v.capacity() < n || v.capacity() - n > n / 4 + 1024) {
    std::vector<T>().swap(v);
    v.reserve(n);
    ask_for_huge_pages(v.data(), n * sizeof(T));
  }
  v.resize(n);
}

}  // namespace sluice::detail
