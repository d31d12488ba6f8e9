// The one GELU formula (src/executor/gelu.hpp), float and without a math-library call, against
// the double tanh formula over a dense range of inputs: the error it adds must stay far
// below the 1e-5 the blocks' and the GPT's float64 references allow.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "executor/gelu.hpp"

namespace {

double gelu_double(double x) {
  return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

double gelu_slope_double(double x) {
  const double c = 0.7978845608028654, th = std::tanh(c * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * c * (1 + 3 * 0.044715 * x * x);
}

TEST(Gelu, ExpIsWithinTwoUlpOnItsRange) {
  double worst = 0;
  for (double y = -80; y <= 80; y += 1.0 / 1024) {
    const auto yf = static_cast<float>(y);
    const double exact = std::exp(static_cast<double>(yf));
    worst = std::max(worst, std::abs(sluice::detail::exp_bounded(yf) - exact) / exact);
  }
  // Measured: 7.8e-8 relative, under one ulp of float (1.19e-7).
  EXPECT_LT(worst, 2 * 1.19e-7);
}

// Over [-12, 12] in steps of 2^-12 (98,305 inputs, every one a float): measured at most
// 1.4e-7 (value) and 1.7e-7 (slope), as errors relative to max(1, |exact|).
TEST(Gelu, MatchesTheDoubleFormulaOverADenseRange) {
  double worst_value = 0, worst_slope = 0;
  for (double x = -12; x <= 12; x += 1.0 / 4096) {
    const auto xf = static_cast<float>(x);
    const double v = gelu_double(xf), s = gelu_slope_double(xf);
    worst_value =
        std::max(worst_value, std::abs(sluice::detail::gelu(xf) - v) / std::max(1.0, std::abs(v)));
    worst_slope = std::max(
        worst_slope, std::abs(sluice::detail::gelu_slope(xf) - s) / std::max(1.0, std::abs(s)));
  }
  EXPECT_LT(worst_value, 1e-6);
  EXPECT_LT(worst_slope, 1e-6);
}

TEST(Gelu, ExtremesAreTheLimitsAndNanStaysNan) {
  using sluice::detail::gelu;
  using sluice::detail::gelu_slope;
  const float big = std::numeric_limits<float>::max();
  EXPECT_EQ(gelu(1e30F), 1e30F);
  EXPECT_EQ(gelu(big), big);
  EXPECT_EQ(gelu_slope(big), 1.0F);
  EXPECT_LT(std::abs(gelu(-1e30F)), 1e-3F);
  EXPECT_LT(std::abs(gelu_slope(-big)), 1e-30F);
  EXPECT_EQ(gelu(0.0F), 0.0F);
  EXPECT_FLOAT_EQ(gelu_slope(0.0F), 0.5F);
  EXPECT_TRUE(std::isnan(gelu(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(gelu_slope(std::numeric_limits<float>::quiet_NaN())));
  // Small inputs keep their relative accuracy (no 1 - tanh cancellation).
  EXPECT_NEAR(gelu(1e-6F) / 1e-6F, gelu_double(1e-6F) / 1e-6, 1e-6);
}

}  // namespace
