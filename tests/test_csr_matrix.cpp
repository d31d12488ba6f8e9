#include "sluice/csr_matrix.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "sluice/error.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::thrown_message;

// ---- validation -----------------------------------------------------------------

TEST(CsrMatrixValidate, AcceptsWellFormed) {
  const CsrMatrix m(2, 3, {0, 2, 3}, {0, 2, 1}, {1.0F, -2.0F, 3.0F});
  EXPECT_EQ(m.rows(), 2);
  EXPECT_EQ(m.cols(), 3);
  EXPECT_EQ(m.nnz(), 3);
  EXPECT_NO_THROW(m.validate());
  const CsrMatrix empty;
  EXPECT_NO_THROW(empty.validate());
  EXPECT_EQ(empty.nnz(), 0);
}

TEST(CsrMatrixValidate, OffsetsOfWrongSize) {
  const auto msg = thrown_message<FormatError>([] { CsrMatrix(2, 3, {0, 1}, {0}, {1.0F}); });
  EXPECT_CONTAINS(msg, "row_offsets has 2 entries");
  EXPECT_CONTAINS(msg, "rows + 1 = 3");
}

TEST(CsrMatrixValidate, OffsetsNotStartingAtZero) {
  const auto msg = thrown_message<FormatError>([] { CsrMatrix(1, 3, {1, 1}, {}, {}); });
  EXPECT_CONTAINS(msg, "row_offsets[0] is 1");
}

TEST(CsrMatrixValidate, OffsetsDecreasing) {
  const auto msg = thrown_message<FormatError>([] {
    CsrMatrix(3, 3, {0, 2, 1, 2}, {0, 1}, {1.0F, 1.0F});
  });
  EXPECT_CONTAINS(msg, "decrease at row 1");
}

TEST(CsrMatrixValidate, OffsetsNotEndingAtNnz) {
  const auto msg = thrown_message<FormatError>([] {
    CsrMatrix(1, 3, {0, 1}, {0, 1}, {1.0F, 1.0F});
  });
  EXPECT_CONTAINS(msg, "end at 1");
  EXPECT_CONTAINS(msg, "2 column indices");
}

TEST(CsrMatrixValidate, ValuesOfWrongSize) {
  const auto msg = thrown_message<FormatError>([] { CsrMatrix(1, 3, {0, 2}, {0, 1}, {1.0F}); });
  EXPECT_CONTAINS(msg, "1 values for 2");
}

TEST(CsrMatrixValidate, ColumnOutOfRange) {
  const auto msg = thrown_message<FormatError>([] {
    CsrMatrix(2, 3, {0, 1, 2}, {0, 3}, {1.0F, 1.0F});
  });
  EXPECT_CONTAINS(msg, "row 1, position 0");
  EXPECT_CONTAINS(msg, "column index 3 out of range");
}

TEST(CsrMatrixValidate, UnsortedColumns) {
  const auto msg = thrown_message<FormatError>([] {
    CsrMatrix(2, 4, {0, 0, 3}, {0, 3, 2}, {1.0F, 1.0F, 1.0F});
  });
  EXPECT_CONTAINS(msg, "row 1, position 2");
  EXPECT_CONTAINS(msg, "unsorted");
}

TEST(CsrMatrixValidate, DuplicateColumns) {
  const auto msg = thrown_message<FormatError>([] {
    CsrMatrix(1, 4, {0, 3}, {0, 2, 2}, {1.0F, 1.0F, 1.0F});
  });
  EXPECT_CONTAINS(msg, "row 0, position 2");
  EXPECT_CONTAINS(msg, "duplicate column index 2");
}

TEST(CsrMatrixValidate, NonFiniteValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto msg = thrown_message<FormatError>([&] { CsrMatrix(2, 4, {0, 1, 2}, {1, 3}, {1.0F, nan}); });
  EXPECT_CONTAINS(msg, "row 1, col 3");
  EXPECT_CONTAINS(msg, "not finite");
  msg = thrown_message<FormatError>([&] { CsrMatrix(1, 4, {0, 1}, {2}, {-inf}); });
  EXPECT_CONTAINS(msg, "row 0, col 2");

  // Values are mutable in place; validate() catches what was written.
  CsrMatrix m(1, 2, {0, 1}, {1}, {1.0F});
  m.values()[0] = inf;
  msg = thrown_message<FormatError>([&] { m.validate(); });
  EXPECT_CONTAINS(msg, "row 0, col 1");
}

TEST(CsrMatrixValidate, BadShape) {
  auto msg = thrown_message<FormatError>([] { CsrMatrix(-1, 3, {0}, {}, {}); });
  EXPECT_CONTAINS(msg, "negative");
  msg = thrown_message<FormatError>([] { CsrMatrix(0, std::int64_t{1} << 31, {0}, {}, {}); });
  EXPECT_CONTAINS(msg, "2^31");
}

// ---- simple queries --------------------------------------------------------------

TEST(CsrMatrix, SparsityAndColumnCounts) {
  const CsrMatrix m(3, 4, {0, 2, 2, 5}, {0, 3, 0, 1, 3}, {1, 2, 3, 4, 5});
  EXPECT_DOUBLE_EQ(m.sparsity(), 1.0 - 5.0 / 12.0);
  EXPECT_EQ(m.column_counts(), (std::vector<std::int64_t>{2, 1, 0, 2}));
  EXPECT_EQ(CsrMatrix().sparsity(), 0.0);
  EXPECT_EQ(CsrMatrix(0, 5, {0}, {}, {}).sparsity(), 0.0);
  EXPECT_EQ(CsrMatrix(0, 5, {0}, {}, {}).column_counts(), std::vector<std::int64_t>(5, 0));
  EXPECT_EQ(CsrMatrix(2, 2, {0, 0, 0}, {}, {}).sparsity(), 1.0);
}

// ---- dense round trips ----------------------------------------------------------

DenseMatrix dense_from(std::int64_t rows, std::int64_t cols, const std::vector<float>& values) {
  DenseMatrix d(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c)
      d(r, c) = values[static_cast<std::size_t>(r * cols + c)];
  }
  return d;
}

void expect_same_dense(const DenseMatrix& a, const DenseMatrix& b) {
  ASSERT_EQ(a.rows(), b.rows());
  ASSERT_EQ(a.cols(), b.cols());
  for (std::int64_t r = 0; r < a.rows(); ++r) {
    for (std::int64_t c = 0; c < a.cols(); ++c) {
      EXPECT_EQ(a(r, c), b(r, c)) << "at (" << r << ", " << c << ")";
    }
  }
}

/// from_dense keeps exactly the non-zeros, in order; to_dense gives the input back.
void check_round_trip(std::int64_t rows, std::int64_t cols, const std::vector<float>& values) {
  const DenseMatrix dense = dense_from(rows, cols, values);
  const CsrMatrix sparse = CsrMatrix::from_dense(dense);
  EXPECT_EQ(sparse.rows(), rows);
  EXPECT_EQ(sparse.cols(), cols);
  std::vector<std::int64_t> offsets{0};
  std::vector<std::uint32_t> col_indices;
  std::vector<float> kept;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const float v = values[static_cast<std::size_t>(r * cols + c)];
      if (v != 0.0F) {
        col_indices.push_back(static_cast<std::uint32_t>(c));
        kept.push_back(v);
      }
    }
    offsets.push_back(static_cast<std::int64_t>(col_indices.size()));
  }
  EXPECT_EQ(sparse.row_offsets(), offsets);
  EXPECT_EQ(sparse.col_indices(), col_indices);
  EXPECT_EQ(sparse.values(), kept);
  expect_same_dense(sparse.to_dense(), dense);
}

TEST(CsrMatrixDense, RoundTrips) {
  check_round_trip(1, 1, {2.5F});
  check_round_trip(1, 1, {0.0F});
  check_round_trip(3, 3,
                   {1, 2, 0,  //
                    0, 0, 0,  // empty row
                    0, 0, -3});
  check_round_trip(2, 4,
                   {1, 0, 0, 4,  // empty middle columns
                    5, 0, 0, 8});
  check_round_trip(3, 5, std::vector<float>(15, 0.0F));  // all zero
  std::vector<float> full(6 * 17);
  for (std::size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>(i) - 200.5F;
  check_round_trip(6, 17, full);  // fully dense, cols not a multiple of the stride
  check_round_trip(0, 0, {});
  check_round_trip(0, 5, {});
  check_round_trip(4, 0, {});
}

TEST(CsrMatrixDense, FromStridedView) {
  DenseMatrix big(4, 20);
  big(1, 2) = 7.0F;
  big(2, 4) = -1.0F;
  big(1, 10) = 99.0F;  // outside the 3-column window
  const ConstMatrixView window{big.row(1) + 2, 2, 3, big.stride()};
  const CsrMatrix m = CsrMatrix::from_dense(window);
  EXPECT_EQ(m.row_offsets(), (std::vector<std::int64_t>{0, 1, 2}));
  EXPECT_EQ(m.col_indices(), (std::vector<std::uint32_t>{0, 2}));
  EXPECT_EQ(m.values(), (std::vector<float>{7.0F, -1.0F}));
}

TEST(CsrMatrixDense, BadViewRefused) {
  float data[4] = {};
  EXPECT_THROW(CsrMatrix::from_dense(ConstMatrixView{data, 2, 2, 1}), ShapeError);
  EXPECT_THROW(CsrMatrix::from_dense(ConstMatrixView{data, -1, 2, 2}), ShapeError);
  data[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(CsrMatrix::from_dense(ConstMatrixView{data, 2, 2, 2}), FormatError);
}

// ---- random ---------------------------------------------------------------------

std::vector<std::int64_t> row_counts(const CsrMatrix& m) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(m.rows()));
  for (std::size_t r = 0; r < counts.size(); ++r) {
    counts[r] = m.row_offsets()[r + 1] - m.row_offsets()[r];
  }
  return counts;
}

double median(std::vector<std::int64_t> v) {
  std::sort(v.begin(), v.end());
  return static_cast<double>(v[v.size() / 2]);
}

TEST(CsrMatrixRandom, DeterministicBySeed) {
  for (const auto dist : {RowDistribution::uniform, RowDistribution::powerlaw}) {
    for (const double sparsity : {0.3, 0.97}) {  // both samplers (per entry, skipping)
      const CsrMatrix a = CsrMatrix::random(70, 300, sparsity, 42, dist);
      const CsrMatrix b = CsrMatrix::random(70, 300, sparsity, 42, dist);
      const CsrMatrix c = CsrMatrix::random(70, 300, sparsity, 43, dist);
      EXPECT_EQ(a.row_offsets(), b.row_offsets());
      EXPECT_EQ(a.col_indices(), b.col_indices());
      EXPECT_EQ(a.values(), b.values());
      EXPECT_NE(a.col_indices(), c.col_indices());
      EXPECT_NE(a.values(), c.values());
    }
  }
}

TEST(CsrMatrixRandom, SparsityNearTarget) {
  for (const auto dist : {RowDistribution::uniform, RowDistribution::powerlaw}) {
    for (const double sparsity : {0.0, 0.05, 0.5, 0.9, 0.95, 0.99, 1.0}) {
      const CsrMatrix m = CsrMatrix::random(512, 1024, sparsity, 7, dist);
      EXPECT_NEAR(m.sparsity(), sparsity, 0.01)
          << "sparsity " << sparsity << " powerlaw " << (dist == RowDistribution::powerlaw);
      EXPECT_NO_THROW(m.validate());
    }
  }
  EXPECT_EQ(CsrMatrix::random(33, 65, 0.0, 1).nnz(), 33 * 65);
  EXPECT_EQ(CsrMatrix::random(33, 65, 0.0, 1, RowDistribution::powerlaw).nnz(), 33 * 65);
  EXPECT_EQ(CsrMatrix::random(33, 65, 1.0, 1).nnz(), 0);
  EXPECT_EQ(CsrMatrix::random(33, 65, 1.0, 1, RowDistribution::powerlaw).nnz(), 0);
}

TEST(CsrMatrixRandom, EmptyShapes) {
  for (const auto dist : {RowDistribution::uniform, RowDistribution::powerlaw}) {
    EXPECT_EQ(CsrMatrix::random(0, 0, 0.5, 1, dist).nnz(), 0);
    EXPECT_EQ(CsrMatrix::random(0, 9, 0.5, 1, dist).row_offsets().size(), 1U);
    const CsrMatrix no_cols = CsrMatrix::random(9, 0, 0.5, 1, dist);
    EXPECT_EQ(no_cols.nnz(), 0);
    EXPECT_EQ(no_cols.row_offsets().size(), 10U);
  }
}

TEST(CsrMatrixRandom, ColumnsUniformIncludingEdges) {
  // Many rows, few columns: each column's count is binomial; an off-by-one in
  // the skip sampler would starve or favour the first or last column.
  for (const double sparsity : {0.95, 0.5}) {
    const std::int64_t rows = 40000, cols = 8;
    const CsrMatrix m = CsrMatrix::random(rows, cols, sparsity, 3);
    const double expected = static_cast<double>(rows) * (1.0 - sparsity);
    const double sd = std::sqrt(expected * sparsity);
    for (const auto count : m.column_counts()) {
      EXPECT_NEAR(static_cast<double>(count), expected, 5 * sd) << "sparsity " << sparsity;
    }
  }
}

TEST(CsrMatrixRandom, ValuesScaledAndNonZero) {
  const double sparsity = 0.75;
  const std::int64_t cols = 1024;
  const CsrMatrix m = CsrMatrix::random(64, cols, sparsity, 11);
  const float scale = 1.0F / std::sqrt(static_cast<float>(cols) * 0.25F);
  float lo = 1e9F, hi = -1e9F;
  double sum = 0.0;
  for (const float v : m.values()) {
    ASSERT_NE(v, 0.0F);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    sum += v;
  }
  EXPECT_GE(lo, -scale * 1.0001F);
  EXPECT_LT(hi, scale * 1.0001F);
  EXPECT_LT(lo, -0.99F * scale);  // the whole range is used
  EXPECT_GT(hi, 0.99F * scale);
  EXPECT_NEAR(sum / static_cast<double>(m.nnz()), 0.0, 0.02 * scale);
  // Fewer than one expected non-zero per row: scale 1.
  const CsrMatrix very_sparse = CsrMatrix::random(50, 10, 0.95, 1);
  for (const float v : very_sparse.values()) EXPECT_LE(std::fabs(v), 1.0F);
}

TEST(CsrMatrixRandom, PowerlawIsSkewed) {
  const CsrMatrix m = CsrMatrix::random(512, 2048, 0.9, 5, RowDistribution::powerlaw);
  const auto counts = row_counts(m);
  const double max_count = static_cast<double>(*std::max_element(counts.begin(), counts.end()));
  EXPECT_GE(max_count / median(counts), 10.0);
  EXPECT_LE(max_count, 2048.0);

  const CsrMatrix very_sparse = CsrMatrix::random(2048, 512, 0.98, 5, RowDistribution::powerlaw);
  const auto sparse_counts = row_counts(very_sparse);
  EXPECT_GE(static_cast<double>(*std::max_element(sparse_counts.begin(), sparse_counts.end())) /
                median(sparse_counts),
            20.0);
}

TEST(CsrMatrixRandom, UniformIsNotSkewed) {
  const CsrMatrix m = CsrMatrix::random(512, 2048, 0.9, 5, RowDistribution::uniform);
  const auto counts = row_counts(m);
  const double max_count = static_cast<double>(*std::max_element(counts.begin(), counts.end()));
  EXPECT_LT(max_count / median(counts), 1.5);
}

TEST(CsrMatrixRandom, BadArgumentsRefused) {
  EXPECT_THROW(CsrMatrix::random(4, 4, -0.01, 1), ArgumentError);
  EXPECT_THROW(CsrMatrix::random(4, 4, 1.01, 1), ArgumentError);
  EXPECT_THROW(CsrMatrix::random(4, 4, std::nan(""), 1), ArgumentError);
  EXPECT_THROW(CsrMatrix::random(-1, 4, 0.5, 1), ShapeError);
  EXPECT_THROW(CsrMatrix::random(4, -1, 0.5, 1), ShapeError);
  const auto msg = thrown_message<ArgumentError>([] { CsrMatrix::random(4, 4, 2.0, 1); });
  EXPECT_CONTAINS(msg, "sparsity");
}

TEST(CsrMatrix, TransposeAndItsPositions) {
  for (const CsrMatrix& w :
       {CsrMatrix::random(37, 23, 0.7, 5, RowDistribution::powerlaw),
        CsrMatrix(3, 4, {0, 0, 0, 0}, {}, {}), CsrMatrix(1, 1, {0, 1}, {0}, {2.5F}),
        CsrMatrix::random(5, 40, 0.0, 2)}) {
    const TransposedPattern t = transposed_pattern(w);
    ASSERT_EQ(t.rows, w.cols());
    ASSERT_EQ(t.cols, w.rows());
    ASSERT_EQ(t.nnz(), w.nnz());
    const CsrMatrix wt = transpose(w);
    EXPECT_NO_THROW(wt.validate());  // sorted, in range
    EXPECT_EQ(wt.row_offsets(), t.row_offsets);
    EXPECT_EQ(wt.col_indices(), t.col_indices);
    const DenseMatrix d = w.to_dense(), dt = wt.to_dense();
    for (std::int64_t r = 0; r < w.rows(); ++r) {
      for (std::int64_t c = 0; c < w.cols(); ++c) ASSERT_EQ(dt(c, r), d(r, c)) << r << "," << c;
    }
    // Each position names the same weight in W: its row is the tag, its column the run.
    std::vector<bool> seen(static_cast<std::size_t>(w.nnz()), false);
    for (std::int64_t i = 0; i < t.rows; ++i) {
      for (std::int64_t k = t.row_offsets[i]; k < t.row_offsets[i + 1]; ++k) {
        const std::uint32_t at = t.source[k];
        ASSERT_LT(at, static_cast<std::uint32_t>(w.nnz()));
        EXPECT_FALSE(seen[at]);
        seen[at] = true;
        EXPECT_EQ(w.col_indices()[at], i);
        const std::int64_t row = t.col_indices[k];
        EXPECT_GE(static_cast<std::int64_t>(at), w.row_offsets()[row]);
        EXPECT_LT(static_cast<std::int64_t>(at), w.row_offsets()[row + 1]);
      }
    }
    EXPECT_EQ(transpose(wt).values(), w.values());
  }
}

TEST(CsrMatrix, FillValues) {
  CsrMatrix m = CsrMatrix::random(100, 100, 0.5, 1);
  const auto pattern = m.col_indices();
  m.fill_values(9, 0.25F);
  const auto first = m.values();
  EXPECT_EQ(m.col_indices(), pattern);
  for (const float v : first) {
    EXPECT_GE(v, -0.25F);
    EXPECT_LT(v, 0.25F);
    EXPECT_NE(v, 0.0F);
  }
  m.fill_values(9, 0.25F);
  EXPECT_EQ(m.values(), first);
  m.fill_values(10, 0.25F);
  EXPECT_NE(m.values(), first);
  EXPECT_THROW(m.fill_values(1, std::numeric_limits<float>::infinity()), ArgumentError);
}

}  // namespace
}  // namespace sluice
