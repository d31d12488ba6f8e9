#include "sluice/dense.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "core/huge_pages.hpp"
#include "sluice/error.hpp"

namespace sluice {
namespace {

// From this size on a matrix starts on a 2 MiB boundary and asks for huge pages; below it
// the rounding would waste more than it saves.
constexpr std::size_t kLargeBytes = std::size_t{4} << 20;

}  // namespace

void DenseMatrix::FreeAligned::operator()(float* p) const noexcept {
  std::free(p);
}

DenseMatrix::DenseMatrix(std::int64_t rows, std::int64_t cols) : rows_(rows), cols_(cols) {
  if (rows < 0 || cols < 0) {
    throw ShapeError("DenseMatrix: negative shape " + std::to_string(rows) + "x" +
                     std::to_string(cols));
  }
  // 16 floats = one 64-byte cache line: every row starts on a line, and the size is a
  // whole number of lines, as aligned_alloc wants.
  stride_ = (cols + 15) / 16 * 16;
  const std::size_t bytes = std::max<std::size_t>(64, sizeof(float) * rows * stride_);
  // A large matrix (a step's activations) is touched for the first time here, and a page
  // fault per 4 KiB is a large part of a short run's first step where faults are slow (in
  // virtual machines most of all); in 2 MiB pages it is one fault per 512 of them.
  auto* p = static_cast<float*>(bytes >= kLargeBytes ? detail::allocate_huge_pages(bytes)
                                                     : std::aligned_alloc(64, bytes));
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  data_.reset(p);
  capacity_ = bytes / sizeof(float);
}

void DenseMatrix::resize(std::int64_t rows, std::int64_t cols) {
  const std::int64_t stride = (cols + 15) / 16 * 16;
  if (rows < 0 || cols < 0 || static_cast<std::size_t>(rows * stride) > capacity_) {
    *this = DenseMatrix(rows, cols);  // checks the shape
    return;
  }
  rows_ = rows;
  cols_ = cols;
  stride_ = stride;
  if (rows * stride > 0) std::memset(data_.get(), 0, sizeof(float) * rows * stride);
}

void DenseMatrix::fill(float value) {
  std::fill_n(data_.get(), rows_ * stride_, value);
}

DenseMatrix DenseMatrix::clone() const {
  DenseMatrix copy(rows_, cols_);
  if (rows_ * stride_ > 0) std::memcpy(copy.data(), data(), sizeof(float) * rows_ * stride_);
  return copy;
}

}  // namespace sluice
