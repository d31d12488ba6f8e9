// The dense baselines (oneDNN's sgemm, and matmul in f32 and bf16) against float64 on odd
// shapes, every transpose and a padded C: a wrong baseline would make every acceleration
// sluice reports wrong.
#include <gtest/gtest.h>

#include <cmath>

#include "dense_baseline.hpp"
#include "reference.hpp"

namespace {

using sluice::ConstMatrixView;
using sluice::DenseMatrix;
using sluice::baseline::DenseKind;

// Largest |got - want| over the largest sum of |terms| of a row: rounding of fp32 sums
// stays far below 1e-5; one lost or wrong term is of order 1/k.
double product_error(ConstMatrixView a, bool ta, ConstMatrixView b, bool tb, ConstMatrixView c) {
  const std::int64_t m = ta ? a.cols : a.rows, k = ta ? a.rows : a.cols;
  const std::int64_t n = tb ? b.rows : b.cols;
  double worst = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0, size = 0;
      for (std::int64_t p = 0; p < k; ++p) {
        const double term =
            double(ta ? a.row(p)[i] : a.row(i)[p]) * double(tb ? b.row(j)[p] : b.row(p)[j]);
        sum += term;
        size += std::abs(term);
      }
      worst = std::max(worst, std::abs(c.row(i)[j] - sum) / std::max(size, 1e-30));
    }
  }
  return worst;
}

TEST(DenseBaseline, EveryKindMultipliesOddShapesInEveryOrientation) {
  for (const DenseKind kind : sluice::baseline::dense_kinds()) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        const std::int64_t m = 37, k = 53, n = 19;
        const DenseMatrix a = sluice::testing::random_dense(ta ? k : m, ta ? m : k, 7);
        const DenseMatrix b = sluice::testing::random_dense(tb ? n : k, tb ? k : n, 8);
        DenseMatrix c(m, n);
        sluice::baseline::DenseProduct product(kind, a.view(), ta, b.view(), tb);
        product.run(c.view());
        // bf16 multiplies the operands rounded to bf16, summing in fp32.
        const bool bf16 = kind == DenseKind::matmul_bf16;
        const DenseMatrix ra = bf16 ? sluice::testing::rounded_to_bf16(a.view()) : a.clone();
        const DenseMatrix rb = bf16 ? sluice::testing::rounded_to_bf16(b.view()) : b.clone();
        EXPECT_LT(product_error(ra.view(), ta, rb.view(), tb, c.view()), 1e-5)
            << sluice::baseline::to_string(kind) << " ta " << ta << " tb " << tb << " ("
            << product.implementation() << ")";
      }
    }
  }
}

TEST(DenseBaseline, TimingNamesTheSamePrecisionAndTheFastest) {
  const DenseMatrix a = sluice::testing::random_dense(64, 48, 1);
  const DenseMatrix b = sluice::testing::random_dense(48, 32, 2);
  DenseMatrix c(64, 32);
  for (const auto precision : {sluice::Precision::fp32, sluice::Precision::bf16}) {
    const auto t =
        sluice::baseline::time_dense({{a.view(), false, b.view(), false, c.view()}}, precision, 3);
    EXPECT_EQ(t.same_kind, sluice::baseline::same_precision_kind(precision));
    EXPECT_GT(t.same_ms, 0);
    EXPECT_LE(t.best_ms, t.same_ms);
  }
  EXPECT_EQ(sluice::baseline::same_precision_kind(sluice::Precision::fp32), DenseKind::matmul_f32);
}

}  // namespace
