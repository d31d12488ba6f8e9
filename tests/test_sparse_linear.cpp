// SparseLinear against the float64 references: forward, dX, dW and db (and dX alone), in
// both layouts, with values held by the ModelMemory or outside it, fp32 and bf16 streams; its
// constructors (dense + mask, files, magnitude pruning); the optimizer step, of one
// gradient or of micro-batches' summed; bad input.
#include "sluice/sparse_linear.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <thread>

#include "reference.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"  // beside sparse_linear.hpp: their names must not clash
#include "sluice/fabric.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::backward_data_error;
using testing::backward_weight_error;
using testing::forward_error;
using testing::random_dense;
using testing::thrown_message;

constexpr double kTolerance = 1e-5;

DenseMatrix transposed(ConstMatrixView m) {
  DenseMatrix t(m.cols, m.rows);
  for (std::int64_t r = 0; r < m.rows; ++r) {
    for (std::int64_t c = 0; c < m.cols; ++c) t(c, r) = m(r, c);
  }
  return t;
}

DenseMatrix nan_matrix(std::int64_t rows, std::int64_t cols) {
  DenseMatrix m(rows, cols);
  m.fill(std::numeric_limits<float>::quiet_NaN());
  return m;
}

bool same_values(ConstMatrixView a, ConstMatrixView b) {
  if (a.rows != b.rows || a.cols != b.cols) return false;
  for (std::int64_t r = 0; r < a.rows; ++r) {
    if (!std::equal(a.row(r), a.row(r) + a.cols, b.row(r))) return false;
  }
  return true;
}

std::vector<float> random_bias(std::int64_t n, std::uint64_t seed) {
  const DenseMatrix b = random_dense(1, n, seed);
  return {b.row(0), b.row(0) + n};
}

/// Largest relative error of Y (feature-major) against W X + b in float64, relative to
/// sum |w x| + |b|: the bias is one more term of the sum.
double forward_error(const CsrMatrix& w, ConstMatrixView x, const std::vector<float>& bias,
                     ConstMatrixView y) {
  double worst = 0;
  const auto& off = w.row_offsets();
  for (std::int64_t o = 0; o < w.rows(); ++o) {
    const double b = bias.empty() ? 0.0 : bias[o];
    for (std::int64_t t = 0; t < x.cols; ++t) {
      double sum = b, scale = std::abs(b);
      for (std::int64_t k = off[o]; k < off[o + 1]; ++k) {
        const double p = double(w.values()[k]) * x(w.col_indices()[k], t);
        sum += p;
        scale += std::abs(p);
      }
      const double err = std::abs(y(o, t) - sum);
      worst = testing::worse(worst, testing::relative_error(err, scale, off[o + 1] - off[o] + 1));
    }
  }
  return worst;
}

double bias_gradient_error(ConstMatrixView dy, const std::vector<float>& got) {
  double worst = 0;
  for (std::int64_t o = 0; o < dy.rows; ++o) {
    double sum = 0, scale = 0;
    for (std::int64_t t = 0; t < dy.cols; ++t) {
      sum += dy(o, t);
      scale += std::abs(dy(o, t));
    }
    worst = testing::worse(worst, testing::relative_error(std::abs(got[o] - sum), scale, dy.cols));
  }
  return worst;
}

struct Shape {
  std::int64_t out, in, tokens;
  double sparsity;
};

class SparseLinearShapes : public ::testing::TestWithParam<std::tuple<Shape, Layout>> {};

// Every product of one layer in one layout, against float64.
TEST_P(SparseLinearShapes, MatchesReference) {
  const auto [s, layout] = GetParam();
  const bool tm = layout == Layout::token_major;
  CpuEngine engine(EngineOptions{.threads = 2});
  auto memory = std::make_shared<HostModelMemory>();
  const CsrMatrix w = CsrMatrix::random(s.out, s.in, s.sparsity, 7);
  const std::vector<float> bias = random_bias(s.out, 8);
  const SparseLinear layer(memory, w, bias);
  const DenseMatrix x = random_dense(s.in, s.tokens, 9);     // feature-major
  const DenseMatrix dy = random_dense(s.out, s.tokens, 10);  // feature-major
  const DenseMatrix x_in = tm ? transposed(x) : x.clone();
  const DenseMatrix dy_in = tm ? transposed(dy) : dy.clone();
  const ProductOptions options{.layout = layout};

  DenseMatrix y = tm ? nan_matrix(s.tokens, s.out) : nan_matrix(s.out, s.tokens);
  layer.forward(engine, x_in, y.view(), options);
  const DenseMatrix yf = tm ? transposed(y) : y.clone();
  EXPECT_LT(forward_error(w, x, bias, yf), kTolerance);

  DenseMatrix dx = tm ? nan_matrix(s.tokens, s.in) : nan_matrix(s.in, s.tokens);
  MutableMatrixView dx_view = dx.view();
  const SparseLinearGradient g = layer.backward(engine, x_in, dy_in, &dx_view, options);
  const DenseMatrix dxf = tm ? transposed(dx) : dx.clone();
  EXPECT_LT(backward_data_error(w, dy, dxf), kTolerance);
  ASSERT_EQ(g.weights.size(), static_cast<std::size_t>(w.nnz()));
  EXPECT_LT(backward_weight_error(w, dy, x, g.weights), kTolerance);
  ASSERT_EQ(g.bias.size(), static_cast<std::size_t>(s.out));
  EXPECT_LT(bias_gradient_error(dy, g.bias), kTolerance);
  EXPECT_EQ(g.bias, bias_gradient(dy));  // what an engine of a training run sums, bit for bit

  // Without dX the mask alone is streamed (by output): the same weight gradient.
  const SparseLinearGradient g2 = layer.backward(engine, x_in, dy_in, nullptr, options);
  EXPECT_LT(backward_weight_error(w, dy, x, g2.weights), kTolerance);

  // dX alone (a frozen layer): the same dX, bit for bit, and nothing handed in.
  DenseMatrix dx_alone = tm ? nan_matrix(s.tokens, s.in) : nan_matrix(s.in, s.tokens);
  layer.backward_data(engine, dy_in, dx_alone.view(), options);
  EXPECT_TRUE(same_values(dx_alone, dx));
  EXPECT_FALSE(memory->commit_step().applied);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SparseLinearShapes,
    ::testing::Combine(::testing::Values(Shape{37, 53, 29, 0.7}, Shape{1, 1, 1, 0.0},
                                         Shape{130, 67, 3, 0.95}, Shape{64, 200, 300, 0.9}),
                       ::testing::Values(Layout::feature_major, Layout::token_major)));

TEST(SparseLinear, ValuesHeldOutsideTheModelMemory) {
  CpuEngine engine(EngineOptions{.threads = 2});
  auto memory = std::make_shared<HostModelMemory>();
  const CsrMatrix w = CsrMatrix::random(45, 33, 0.8, 3);
  const SparseLinear layer(memory, w);
  // Other values and a bias that the ModelMemory does not have.
  CsrMatrix other = w;
  other.fill_values(11);
  const std::vector<float> bias = random_bias(45, 12);
  const ProductOptions options{
      .layout = Layout::token_major, .values = other.values(), .bias = bias};
  const DenseMatrix x = random_dense(33, 21, 4), dy = random_dense(45, 21, 5);
  const DenseMatrix x_tm = transposed(x), dy_tm = transposed(dy);
  DenseMatrix y(21, 45), dx(21, 33);
  layer.forward(engine, x_tm, y.view(), options);
  EXPECT_LT(forward_error(other, x, bias, transposed(y)), kTolerance);
  MutableMatrixView dx_view = dx.view();
  const SparseLinearGradient g = layer.backward(engine, x_tm, dy_tm, &dx_view, options);
  EXPECT_LT(backward_data_error(other, dy, transposed(dx)), kTolerance);
  EXPECT_LT(backward_weight_error(other, dy, x, g.weights), kTolerance);
  EXPECT_LT(bias_gradient_error(dy, g.bias), kTolerance);
  DenseMatrix dx_alone = nan_matrix(21, 33);
  layer.backward_data(engine, dy_tm, dx_alone.view(), options);
  EXPECT_LT(backward_data_error(other, dy, transposed(dx_alone)), kTolerance);
  // Submitting is for the ModelMemory's own values only.
  thrown_message<ShapeError>(
      [&] { layer.submit_backward(engine, x_tm, dy_tm, &dx_view, options); });
}

TEST(SparseLinear, Bf16Stream) {
  CpuEngine engine(EngineOptions{.threads = 2});
  auto memory = std::make_shared<HostModelMemory>();
  const CsrMatrix w = CsrMatrix::random(70, 90, 0.9, 21);
  const SparseLinear layer(memory, w);
  const DenseMatrix x = random_dense(90, 40, 22), dy = random_dense(70, 40, 23);
  DenseMatrix y(70, 40), dx(90, 40);
  const ProductOptions options{.precision = Precision::bf16};
  layer.forward(engine, x, y.view(), options);
  // The engine may hold X in bf16 where it packs tiles: compare with both rounded.
  const CsrMatrix wb = testing::rounded_to_bf16(w);
  const DenseMatrix xb = testing::rounded_to_bf16(x);
  EXPECT_LT(std::min(forward_error(wb, x, y), forward_error(wb, xb, y)), kTolerance);
  MutableMatrixView dx_view = dx.view();
  const SparseLinearGradient g = layer.backward(engine, x, dy, &dx_view, options);
  const DenseMatrix dyb = testing::rounded_to_bf16(dy);
  EXPECT_LT(std::min(backward_data_error(wb, dy, dx), backward_data_error(wb, dyb, dx)),
            kTolerance);
  EXPECT_LT(backward_weight_error(w, dy, x, g.weights), 1e-2);  // dY may be held in bf16
  DenseMatrix dx_alone = nan_matrix(90, 40);
  layer.backward_data(engine, dy, dx_alone.view(), options);
  EXPECT_LT(std::min(backward_data_error(wb, dy, dx_alone), backward_data_error(wb, dyb, dx_alone)),
            kTolerance);
}

TEST(SparseLinear, SubmittedGradientIsAppliedByStep) {
  CpuEngine engine(EngineOptions{.threads = 2});
  auto memory = std::make_shared<HostModelMemory>();
  OptimizerConfig sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.learning_rate = 0.5;
  memory->set_optimizer(sgd);
  const CsrMatrix w = CsrMatrix::random(20, 30, 0.6, 31);
  const std::vector<float> bias = random_bias(20, 32);
  SparseLinear layer(memory, w, bias);
  const DenseMatrix x = random_dense(30, 17, 33), dy = random_dense(20, 17, 34);
  const SparseLinearGradient g = layer.backward(engine, x, dy, nullptr);
  layer.submit_backward(engine, x, dy, nullptr);
  const StepReport report = layer.step();
  EXPECT_TRUE(report.applied);
  EXPECT_EQ(memory->step(), 1);
  for (std::int64_t k = 0; k < w.nnz(); ++k) {
    EXPECT_NEAR(layer.weights().values()[k], w.values()[k] - 0.5F * g.weights[k], 1e-6) << k;
  }
  for (std::int64_t o = 0; o < 20; ++o) {
    EXPECT_NEAR(layer.bias()[o], bias[o] - 0.5F * g.bias[o], 1e-6) << o;
  }
}

// Micro-batches: each accumulate_backward adds its gradient; step() applies the sum. A
// second submit_backward in a step is refused.
TEST(SparseLinear, AccumulatedGradientsAreAppliedAsTheirSum) {
  CpuEngine engine(EngineOptions{.threads = 2});
  auto memory = std::make_shared<HostModelMemory>();
  OptimizerConfig sgd;
  sgd.kind = OptimizerKind::sgd;
  sgd.learning_rate = 0.25;
  memory->set_optimizer(sgd);
  const CsrMatrix w = CsrMatrix::random(23, 19, 0.7, 35);
  const std::vector<float> bias = random_bias(23, 36);
  SparseLinear layer(memory, w, bias);
  std::vector<double> sum(static_cast<std::size_t>(w.nnz())), bias_sum(bias.size());
  for (int micro = 0; micro < 3; ++micro) {
    const DenseMatrix x = random_dense(19, 5 + micro, 37 + micro);
    const DenseMatrix dy = random_dense(23, 5 + micro, 47 + micro);
    const SparseLinearGradient g = layer.backward(engine, x, dy, nullptr);
    for (std::size_t k = 0; k < sum.size(); ++k) sum[k] += g.weights[k];
    for (std::size_t o = 0; o < bias_sum.size(); ++o) bias_sum[o] += g.bias[o];
    layer.accumulate_backward(engine, x, dy, nullptr);
    if (micro == 0) {
      EXPECT_CONTAINS(
          thrown_message<ShapeError>([&] { layer.submit_backward(engine, x, dy, nullptr); }),
          "already has a gradient for this step");
    }
  }
  ASSERT_TRUE(layer.step().applied);
  for (std::size_t k = 0; k < sum.size(); ++k) {
    EXPECT_NEAR(layer.weights().values()[k], w.values()[k] - 0.25 * sum[k], 1e-5) << k;
  }
  for (std::size_t o = 0; o < bias_sum.size(); ++o) {
    EXPECT_NEAR(layer.bias()[o], bias[o] - 0.25 * bias_sum[o], 1e-5) << o;
  }
}

TEST(SparseLinear, FromDenseAndMask) {
  auto memory = std::make_shared<HostModelMemory>();
  const DenseMatrix dense = random_dense(5, 7, 41);
  DenseMatrix mask(5, 7);
  mask(0, 0) = 1;
  mask(2, 6) = 1;
  mask(4, 3) = 2;  // any non-zero
  const SparseLinear layer = SparseLinear::from_dense(memory, dense, mask);
  ASSERT_EQ(layer.nnz(), 3);
  EXPECT_EQ(layer.weights().col_indices(), (std::vector<std::uint32_t>{0, 6, 3}));
  EXPECT_EQ(layer.weights().values(), (std::vector<float>{dense(0, 0), dense(2, 6), dense(4, 3)}));
  EXPECT_EQ(layer.in_features(), 7);
  EXPECT_EQ(layer.out_features(), 5);
  EXPECT_CONTAINS(thrown_message<ShapeError>(
                      [&] { SparseLinear::from_dense(memory, dense, DenseMatrix(7, 5).view()); }),
                  "mask is 7x5");
  // A NaN in the mask says neither: refused by position, not taken as non-zero.
  mask(3, 5) = std::numeric_limits<float>::quiet_NaN();
  EXPECT_CONTAINS(
      thrown_message<FormatError>([&] { SparseLinear::from_dense(memory, dense, mask); }),
      "mask (3, 5) is NaN");
}

TEST(SparseLinear, MagnitudePruning) {
  auto memory = std::make_shared<HostModelMemory>();
  DenseMatrix dense(4, 5);
  for (std::int64_t k = 0; k < 20; ++k) dense(k / 5, k % 5) = (k % 2 ? -1.0F : 1.0F) * float(k);
  const SparseLinear layer = SparseLinear::pruned(memory, dense, 0.75);  // keeps 5: 15..19
  ASSERT_EQ(layer.nnz(), 5);
  EXPECT_EQ(layer.weights().values(), (std::vector<float>{-15, 16, -17, 18, -19}));
  // Ties go to the first in row-major order; at least one weight stays.
  const DenseMatrix ones = [] {
    DenseMatrix m(3, 3);
    m.fill(1.0F);
    return m;
  }();
  const SparseLinear tie = SparseLinear::pruned(memory, ones, 0.99);
  ASSERT_EQ(tie.nnz(), 1);
  EXPECT_EQ(tie.weights().col_indices()[0], 0U);
  EXPECT_EQ(tie.weights().row_offsets()[1], 1);
  thrown_message<ArgumentError>([&] { SparseLinear::pruned(memory, dense, 1.0); });
  thrown_message<ArgumentError>([&] { SparseLinear::pruned(memory, dense, -0.1); });
  thrown_message<ArgumentError>(
      [&] { SparseLinear::pruned(memory, dense, std::numeric_limits<double>::quiet_NaN()); });
  // A weight that is not finite has no magnitude to rank, kept or not.
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -HUGE_VALF}) {
    dense(1, 2) = bad;
    EXPECT_CONTAINS(thrown_message<FormatError>([&] { SparseLinear::pruned(memory, dense, 0.75); }),
                    "weight (1, 2) is not finite");
  }
}

class SparseLinearFiles : public testing::TempDirTest {};

TEST_F(SparseLinearFiles, FromSmtxAndMtx) {
  auto memory = std::make_shared<HostModelMemory>();
  const CsrMatrix w = CsrMatrix::random(12, 9, 0.5, 51);
  write_matrix_market(w, dir_ / "w.mtx");
  write_smtx(w, dir_ / "w.smtx");
  const SparseLinear from_mtx = SparseLinear::from_file(memory, dir_ / "w.mtx");
  EXPECT_EQ(from_mtx.weights().values(), w.values());
  const SparseLinear from_smtx = SparseLinear::from_file(memory, dir_ / "w.smtx", 3);
  EXPECT_EQ(from_smtx.weights().col_indices(), w.col_indices());
  EXPECT_EQ(from_smtx.weights().row_offsets(), w.row_offsets());
  EXPECT_EQ(memory->layer_count(), 2);
  thrown_message<IoError>([&] { SparseLinear::from_file(memory, dir_ / "missing.mtx"); });
}

TEST(SparseLinear, BadShapesSayWhat) {
  CpuEngine engine(EngineOptions{.threads = 1});
  auto memory = std::make_shared<HostModelMemory>();
  const SparseLinear layer(memory, CsrMatrix::random(8, 6, 0.5, 61));
  DenseMatrix x(6, 4), y(8, 4), wrong(5, 4);
  EXPECT_CONTAINS(thrown_message<ShapeError>([&] { layer.forward(engine, wrong, y.view()); }),
                  "X is 5x4 (features x tokens), expected 6 features");
  EXPECT_CONTAINS(thrown_message<ShapeError>(
                      [&] { layer.forward(engine, x, y.view(), {.layout = Layout::token_major}); }),
                  "(tokens x features)");
  DenseMatrix y3(8, 3);
  EXPECT_CONTAINS(thrown_message<ShapeError>([&] { layer.forward(engine, x, y3.view()); }),
                  "expected 8 features and 4 tokens");
  const std::vector<float> few(3);
  EXPECT_CONTAINS(
      thrown_message<ShapeError>([&] { layer.forward(engine, x, y.view(), {.values = few}); }),
      "3 values for a layer of");
  EXPECT_CONTAINS(thrown_message<ArgumentError>([] { SparseLinear(nullptr, CsrMatrix()); }),
                  "no ModelMemory");
  EXPECT_CONTAINS(thrown_message<ArgumentError>([&] { SparseLinear(memory, 5); }), "no layer 5");
}

// Products only read the layer: two threads, each with its own engine, at once.
TEST(SparseLinear, ConcurrentProductsOnTheirOwnEngines) {
  auto memory = std::make_shared<HostModelMemory>();
  const CsrMatrix w = CsrMatrix::random(64, 48, 0.8, 71);
  const SparseLinear layer(memory, w);
  const DenseMatrix x = random_dense(48, 33, 72);
  double errors[2] = {1, 1};
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      CpuEngine engine(EngineOptions{.threads = 1});
      for (int r = 0; r < 5; ++r) {
        DenseMatrix y(64, 33);
        layer.forward(engine, x, y.view());
        errors[i] = std::max(r == 0 ? 0.0 : errors[i], forward_error(w, x, y));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT(errors[0], kTolerance);
  EXPECT_LT(errors[1], kTolerance);
}

}  // namespace
}  // namespace sluice
