#pragma once
// Plain float64 references of the transformer blocks (include/sluice/blocks.hpp) and the
// tools to check gradients against them: what test_blocks checks each block with, and what a
// reference of a whole model is built from.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "sluice/blocks.hpp"
#include "sluice/dense.hpp"

namespace sluice::testing::reference {

/// A feature-major float64 matrix: (r, c) at r * cols + c.
struct Grid {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Grid(std::int64_t r, std::int64_t c) : rows(r), cols(c), v(static_cast<std::size_t>(r * c)) {}
  double& operator()(std::int64_t r, std::int64_t c) { return v[r * cols + c]; }
  double operator()(std::int64_t r, std::int64_t c) const { return v[r * cols + c]; }
};

inline DenseMatrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed,
                                 double scale = 1.0) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0F, 1.0F);
  DenseMatrix m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) m(r, c) = static_cast<float>(u(rng) * scale);
  return m;
}

inline Grid to_grid(const DenseMatrix& m) {
  Grid g(m.rows(), m.cols());
  for (std::int64_t r = 0; r < m.rows(); ++r)
    for (std::int64_t c = 0; c < m.cols(); ++c) g(r, c) = m(r, c);
  return g;
}

inline std::vector<float> random_vector(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.5F, 1.5F);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = u(rng);
  return v;
}

/// Expects |actual - expected| <= tolerance * max(1, max |expected|) everywhere.
inline void expect_close(const DenseMatrix& actual, const Grid& expected, double tolerance,
                         const char* what) {
  ASSERT_EQ(actual.rows(), expected.rows);
  ASSERT_EQ(actual.cols(), expected.cols);
  double bound = 1.0;
  for (const double x : expected.v) bound = std::max(bound, std::abs(x));
  for (std::int64_t r = 0; r < expected.rows; ++r)
    for (std::int64_t c = 0; c < expected.cols; ++c)
      ASSERT_NEAR(actual(r, c), expected(r, c), tolerance * bound)
          << what << " at (" << r << ", " << c << ")";
}

inline void expect_close(std::span<const float> actual, const std::vector<double>& expected,
                         double tolerance, const char* what) {
  ASSERT_EQ(actual.size(), expected.size());
  double bound = 1.0;
  for (const double x : expected) bound = std::max(bound, std::abs(x));
  for (std::size_t i = 0; i < expected.size(); ++i)
    ASSERT_NEAR(actual[i], expected[i], tolerance * bound) << what << " at " << i;
}

/// Central differences of f at x (every element of x in turn).
inline std::vector<double> numeric_gradient(
    std::vector<double> x, const std::function<double(const std::vector<double>&)>& f,
    double h = 1e-6) {
  std::vector<double> g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = f(x);
    x[i] = keep - h;
    const double down = f(x);
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

inline Grid numeric_gradient(const Grid& x, const std::function<double(const Grid&)>& f) {
  Grid g(x.rows, x.cols);
  g.v = numeric_gradient(x.v, [&](const std::vector<double>& v) {
    Grid y(x.rows, x.cols);
    y.v = v;
    return f(y);
  });
  return g;
}

/// The objective the backward checks use: sum of weights .* y.
inline double weighted_sum(const Grid& y, const Grid& weights) {
  double s = 0;
  for (std::size_t i = 0; i < y.v.size(); ++i) s += y.v[i] * weights.v[i];
  return s;
}

inline Grid embedding_reference(const std::vector<std::int32_t>& tokens, const Grid& table,
                                const Grid& positions) {
  Grid x(table.cols, static_cast<std::int64_t>(tokens.size()));
  for (std::int64_t t = 0; t < x.cols; ++t)
    for (std::int64_t f = 0; f < x.rows; ++f)
      x(f, t) = table(tokens[t], f) + positions(t % positions.rows, f);
  return x;
}

inline Grid layer_norm_reference(const Grid& x, const std::vector<double>& gain,
                                 const std::vector<double>& bias) {
  Grid y(x.rows, x.cols);
  for (std::int64_t t = 0; t < x.cols; ++t) {
    double mean = 0, var = 0;
    for (std::int64_t f = 0; f < x.rows; ++f) mean += x(f, t);
    mean /= static_cast<double>(x.rows);
    for (std::int64_t f = 0; f < x.rows; ++f) var += (x(f, t) - mean) * (x(f, t) - mean);
    var /= static_cast<double>(x.rows);
    for (std::int64_t f = 0; f < x.rows; ++f)
      y(f, t) = gain[f] * (x(f, t) - mean) / std::sqrt(var + kLayerNormEpsilon) + bias[f];
  }
  return y;
}

/// out and, when asked, the probabilities (sequence, head, i, j) of the reference.
inline Grid attention_reference(const Grid& q, const Grid& k, const Grid& v, AttentionShape shape,
                                std::vector<double>* probabilities = nullptr) {
  const std::int64_t c = shape.context, dh = q.rows / shape.heads;
  Grid out(q.rows, q.cols);
  if (probabilities != nullptr) probabilities->assign(q.cols / c * shape.heads * c * c, 0.0);
  for (std::int64_t s = 0; s < q.cols / c; ++s) {
    for (std::int64_t h = 0; h < shape.heads; ++h) {
      for (std::int64_t i = 0; i < c; ++i) {
        std::vector<double> score(static_cast<std::size_t>(i + 1));
        for (std::int64_t j = 0; j <= i; ++j) {
          for (std::int64_t f = h * dh; f < (h + 1) * dh; ++f)
            score[j] += q(f, s * c + i) * k(f, s * c + j);
          score[j] /= std::sqrt(static_cast<double>(dh));
        }
        const double top = *std::max_element(score.begin(), score.end());
        double sum = 0;
        for (auto& x : score) sum += (x = std::exp(x - top));
        for (std::int64_t j = 0; j <= i; ++j) {
          const double p = score[j] / sum;
          if (probabilities != nullptr)
            (*probabilities)[((s * shape.heads + h) * c + i) * c + j] = p;
          for (std::int64_t f = h * dh; f < (h + 1) * dh; ++f)
            out(f, s * c + i) += p * v(f, s * c + j);
        }
      }
    }
  }
  return out;
}

inline Grid gelu_reference(const Grid& z) {
  Grid y(z.rows, z.cols);
  for (std::size_t i = 0; i < z.v.size(); ++i) {
    const double x = z.v[i];
    y.v[i] = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
  }
  return y;
}

inline double cross_entropy_reference(const Grid& logits,
                                      const std::vector<std::int32_t>& targets) {
  double loss = 0;
  for (std::int64_t t = 0; t < logits.cols; ++t) {
    double top = -INFINITY, sum = 0;
    for (std::int64_t r = 0; r < logits.rows; ++r) top = std::max(top, logits(r, t));
    for (std::int64_t r = 0; r < logits.rows; ++r) sum += std::exp(logits(r, t) - top);
    loss += std::log(sum) + top - logits(targets[t], t);
  }
  return loss;
}

inline std::vector<std::int32_t> random_targets(std::int64_t n, std::int32_t vocab,
                                                std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(vocab));
  return t;
}

}  // namespace sluice::testing::reference
