#pragma once
// Dense activations: row-major, rows = features, columns = tokens.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace sluice {

/// A non-owning row-major view: element (r, c) is data[r * stride + c].
template <typename T>
struct MatrixView {
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t stride = 0;  // elements between the starts of two rows, >= cols

  T* row(std::int64_t r) const { return data + r * stride; }
  T& operator()(std::int64_t r, std::int64_t c) const { return data[r * stride + c]; }
  // A view on constant data converts implicitly.
  operator MatrixView<const T>() const { return {data, rows, cols, stride}; }
};

using ConstMatrixView = MatrixView<const float>;
using MutableMatrixView = MatrixView<float>;

/// An owning dense float matrix, 64-byte aligned rows (stride rounded up to 16 floats),
/// zero-initialised.
class DenseMatrix {
 public:
  DenseMatrix() = default;
  DenseMatrix(std::int64_t rows, std::int64_t cols);

  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  std::int64_t stride() const { return stride_; }
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  float* row(std::int64_t r) { return data_.get() + r * stride_; }
  const float* row(std::int64_t r) const { return data_.get() + r * stride_; }
  float& operator()(std::int64_t r, std::int64_t c) { return data_.get()[r * stride_ + c]; }
  float operator()(std::int64_t r, std::int64_t c) const { return data_.get()[r * stride_ + c]; }

  MutableMatrixView view() { return {data_.get(), rows_, cols_, stride_}; }
  ConstMatrixView view() const { return {data_.get(), rows_, cols_, stride_}; }
  operator MutableMatrixView() { return view(); }
  operator ConstMatrixView() const { return view(); }

  void fill(float value);
  DenseMatrix clone() const;
  /// Makes this rows x cols zeros, as DenseMatrix(rows, cols) would, in the memory it has
  /// when that holds them: a buffer reshaped from batch to batch is touched for the first
  /// time once.
  void resize(std::int64_t rows, std::int64_t cols);

 private:
  struct FreeAligned {
    void operator()(float* p) const noexcept;
  };
  std::int64_t rows_ = 0, cols_ = 0, stride_ = 0;
  std::size_t capacity_ = 0;  // floats allocated
  std::unique_ptr<float[], FreeAligned> data_;
};

}  // namespace sluice
