#pragma once
// A sparse weight matrix in compressed sparse row form.
// Rows are output features, columns are input features (forward: Y = W * X).
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "sluice/dense.hpp"

namespace sluice {

namespace detail {
struct CsrMatrixAccess;  // internal (src/core/csr_matrix_access.hpp)
}  // namespace detail

/// How the non-zeros of a random matrix are spread over its rows.
enum class RowDistribution {
  uniform,   ///< every entry is non-zero with the same probability (Bernoulli)
  powerlaw,  ///< row densities follow a power law: some rows 10-100x denser than others
};

class CsrMatrix {
 public:
  CsrMatrix() = default;
  /// Takes the arrays as they are and validates them (throws FormatError if they are
  /// not a well-formed CSR: offsets of size rows+1 starting at 0, monotone, ending at
  /// nnz; column indices in range, strictly increasing within each row; finite values).
  CsrMatrix(std::int64_t rows, std::int64_t cols, std::vector<std::int64_t> row_offsets,
            std::vector<std::uint32_t> col_indices, std::vector<float> values);

  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  std::int64_t nnz() const { return static_cast<std::int64_t>(col_indices_.size()); }
  /// Fraction of entries that are zero, in [0, 1]; 0 for an empty shape.
  double sparsity() const;

  const std::vector<std::int64_t>& row_offsets() const { return row_offsets_; }
  const std::vector<std::uint32_t>& col_indices() const { return col_indices_; }
  const std::vector<float>& values() const { return values_; }
  /// Values may be changed in place (the pattern may not).
  std::vector<float>& values() { return values_; }

  /// Non-zeros per column (input feature), the planner's input.
  std::vector<std::int64_t> column_counts() const;

  /// Checks every invariant listed at the constructor; throws FormatError naming the
  /// first broken one (row, position, value).
  void validate() const;

  /// Keeps the entries of `dense` that are not exactly zero.
  static CsrMatrix from_dense(ConstMatrixView dense);
  /// Zeros included.
  DenseMatrix to_dense() const;

  /// A seeded random matrix with about (1 - sparsity) * rows * cols non-zeros, values
  /// uniform in [-1, 1) scaled by 1/sqrt(expected non-zeros per row). Same seed, same matrix.
  static CsrMatrix random(std::int64_t rows, std::int64_t cols, double sparsity, std::uint64_t seed,
                          RowDistribution distribution = RowDistribution::uniform);

  /// Replaces every value with a seeded uniform draw in [-scale, scale).
  void fill_values(std::uint64_t seed, float scale = 1.0F);

 private:
  friend struct detail::CsrMatrixAccess;
  std::int64_t rows_ = 0, cols_ = 0;
  std::vector<std::int64_t> row_offsets_{0};
  std::vector<std::uint32_t> col_indices_;
  std::vector<float> values_;
};

/// The pattern of W^T, and where each of its non-zeros sits in W: W^T's k-th non-zero is
/// W.values()[source[k]]. How a layer is streamed by input (its transpose, for the
/// backward pass) from the one copy of its values that ModelMemory keeps.
struct TransposedPattern {
  std::int64_t rows = 0;                     ///< W's columns
  std::int64_t cols = 0;                     ///< W's rows
  std::vector<std::int64_t> row_offsets{0};  ///< rows + 1 offsets, as in CsrMatrix
  std::vector<std::uint32_t> col_indices;    ///< W's row of each, increasing within a row
  std::vector<std::uint32_t> source;         ///< position of each in W's CSR arrays
  std::int64_t nnz() const { return static_cast<std::int64_t>(col_indices.size()); }
};

/// W^T's pattern and positions (O(nnz + cols)). ShapeError if W has 2^31 rows or more
/// (they become column indices) or 2^32 non-zeros or more (positions are 32-bit).
TransposedPattern transposed_pattern(const CsrMatrix& w);

/// W^T with its values.
CsrMatrix transpose(const CsrMatrix& w);

/// Reads a Matrix Market file: coordinate format; real, integer or pattern; general,
/// symmetric or skew-symmetric (each off-diagonal entry given once, in either triangle, and
/// mirrored). Pattern values are filled from `seed`. Duplicate entries are an error.
/// Errors name the file, the line and what is wrong.
CsrMatrix read_matrix_market(const std::filesystem::path& path, std::uint64_t seed = 1);
/// Writes coordinate real general Matrix Market (values with round-trip precision).
/// Written to a temporary file and renamed, so a failure leaves no partial file.
void write_matrix_market(const CsrMatrix& matrix, const std::filesystem::path& path);
/// Reads a DLMC `.smtx` mask ("rows, cols, nnz" / offsets / column indices); values are
/// filled from `seed`.
CsrMatrix read_smtx(const std::filesystem::path& path, std::uint64_t seed = 1);
/// Writes a `.smtx` mask (the values are not stored).
void write_smtx(const CsrMatrix& matrix, const std::filesystem::path& path);
/// Picks the reader by extension: `.smtx` or `.mtx`, or either gzip'd (`.mtx.gz`). Both
/// readers take a gzip'd file whatever its name.
CsrMatrix read_matrix(const std::filesystem::path& path, std::uint64_t seed = 1);

}  // namespace sluice
