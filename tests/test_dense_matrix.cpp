// DenseMatrix: zeros of its shape, rows on cache lines; resize reshapes in the memory it
// has when that holds the new shape, and zeroes it either way.
#include <gtest/gtest.h>

#include "sluice/dense.hpp"
#include "sluice/error.hpp"

namespace {

using sluice::DenseMatrix;

void expect_zeros(const DenseMatrix& m) {
  for (std::int64_t r = 0; r < m.rows(); ++r) {
    for (std::int64_t c = 0; c < m.stride(); ++c) {
      ASSERT_EQ(m.row(r)[c], 0.0F) << r << ", " << c;  // the padding too
    }
  }
}

TEST(DenseMatrix, RowsStartOnCacheLines) {
  DenseMatrix m(3, 17);
  EXPECT_EQ(m.stride(), 32);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(m.row(1)) % 64, 0U);
  expect_zeros(m);
}

TEST(DenseMatrix, ResizeKeepsTheMemoryThatHoldsTheShapeAndZeroesIt) {
  DenseMatrix m(5, 33);  // 5 rows of 48
  m.fill(1.5F);
  const float* memory = m.data();
  m.resize(7, 20);  // 7 rows of 32: 224 floats of the 240
  EXPECT_EQ(m.data(), memory);
  EXPECT_EQ(m.rows(), 7);
  EXPECT_EQ(m.cols(), 20);
  EXPECT_EQ(m.stride(), 32);
  expect_zeros(m);
  m.fill(2.5F);
  m.resize(5, 33);
  EXPECT_EQ(m.data(), memory);
  expect_zeros(m);
  m.resize(5, 0);
  EXPECT_EQ(m.cols(), 0);
  m.resize(6, 40);  // 288 floats: more than it has
  EXPECT_EQ(m.stride(), 48);
  expect_zeros(m);
  DenseMatrix none;
  none.resize(0, 4);
  EXPECT_EQ(none.rows(), 0);
  none.resize(2, 3);
  expect_zeros(none);
  EXPECT_THROW(none.resize(-1, 3), sluice::ShapeError);
  EXPECT_EQ(none.rows(), 2);  // a refused shape changes nothing
}

}  // namespace
