// The transformer's weightless blocks against the plain float64 references of
// block_references.hpp, on odd shapes; every backward against central finite differences of
// the float64 forward (so a wrong backward cannot hide behind a reference sharing its mistake).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "block_references.hpp"
#include "blocks/block_kernels.hpp"
#include "executor/gelu.hpp"
#include "sluice/blocks.hpp"
#include "sluice/error.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using namespace testing::reference;

// Tolerances: the float blocks against exact float64 arithmetic on values of order one.
constexpr double kForwardTolerance = 2e-6;
constexpr double kGradientTolerance = 2e-5;

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(Embedding, GathersAndScatterAddsAgainstFiniteDifferences) {
  const std::int64_t vocab = 7, d = 12, context = 5;
  const std::vector<std::int32_t> tokens = {3, 0, 6, 3, 3, 1, 6, 2, 0, 3};  // 2 sequences
  const DenseMatrix table = random_matrix(vocab, d, 1), positions = random_matrix(context, d, 2);
  DenseMatrix x(d, 10);
  embedding_forward(tokens, table, positions, x);
  const Grid table64 = to_grid(table), positions64 = to_grid(positions);
  expect_close(x, embedding_reference(tokens, table64, positions64), kForwardTolerance, "x");

  const DenseMatrix dx = random_matrix(d, 10, 3);
  const Grid weights = to_grid(dx);
  DenseMatrix d_table(vocab, d), d_positions(context, d);
  d_table.fill(0.25F);  // the backward adds to what is there
  d_positions.fill(-0.5F);
  embedding_backward(tokens, dx, d_table, d_positions);
  Grid expected_table = numeric_gradient(table64, [&](const Grid& t) {
    return weighted_sum(embedding_reference(tokens, t, positions64), weights);
  });
  Grid expected_positions = numeric_gradient(positions64, [&](const Grid& p) {
    return weighted_sum(embedding_reference(tokens, table64, p), weights);
  });
  for (auto& g : expected_table.v) g += 0.25;
  for (auto& g : expected_positions.v) g -= 0.5;
  expect_close(d_table, expected_table, kGradientTolerance, "d_tokens_table");
  expect_close(d_positions, expected_positions, kGradientTolerance, "d_positions");
}

TEST(Embedding, RefusesBadSymbolsAndShapes) {
  const DenseMatrix table(7, 12), positions(5, 12);
  DenseMatrix x(12, 5);
  const std::vector<std::int32_t> bad = {0, 1, 7, 2, 3};
  const auto message =
      testing::thrown_message<ArgumentError>([&] { embedding_forward(bad, table, positions, x); });
  EXPECT_CONTAINS(message, "symbol 7 at token 2");
  const std::vector<std::int32_t> partial = {0, 1, 2};  // not a whole sequence of 5
  testing::thrown_message<ShapeError>([&] { embedding_forward(partial, table, positions, x); });
  DenseMatrix wrong(11, 5);
  const std::vector<std::int32_t> good = {0, 1, 2, 3, 4};
  testing::thrown_message<ShapeError>([&] { embedding_forward(good, table, positions, wrong); });
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

struct LayerNormCase {
  std::int64_t d, tokens;
};

class LayerNorm : public ::testing::TestWithParam<LayerNormCase> {};

TEST_P(LayerNorm, MatchesReferenceAndFiniteDifferences) {
  const auto [d, tokens] = GetParam();
  DenseMatrix x = random_matrix(d, tokens, 4, 2.0);
  for (std::int64_t f = 0; f < d; ++f) x(f, 0) += 3.0F;  // an offset the centring must remove
  const std::vector<float> gain = random_vector(d, 5), bias = random_vector(d, 6);
  DenseMatrix y(d, tokens);
  std::vector<float> mean(tokens), inv_std(tokens);
  layer_norm_forward(x, gain, bias, y, {mean, inv_std});
  const Grid x64 = to_grid(x);
  const std::vector<double> gain64(gain.begin(), gain.end()), bias64(bias.begin(), bias.end());
  expect_close(y, layer_norm_reference(x64, gain64, bias64), kForwardTolerance, "y");

  const DenseMatrix dy = random_matrix(d, tokens, 7);
  const Grid weights = to_grid(dy);
  DenseMatrix dx(d, tokens);
  std::vector<float> d_gain(d, 1.0F), d_bias(d, 2.0F);
  layer_norm_backward(x, gain, mean, inv_std, dy, dx, d_gain, d_bias);
  expect_close(dx,
               numeric_gradient(x64,
                                [&](const Grid& v) {
                                  return weighted_sum(layer_norm_reference(v, gain64, bias64),
                                                      weights);
                                }),
               kGradientTolerance, "dx");
  auto expected_gain = numeric_gradient(gain64, [&](const std::vector<double>& g) {
    return weighted_sum(layer_norm_reference(x64, g, bias64), weights);
  });
  auto expected_bias = numeric_gradient(bias64, [&](const std::vector<double>& b) {
    return weighted_sum(layer_norm_reference(x64, gain64, b), weights);
  });
  for (auto& g : expected_gain) g += 1.0;
  for (auto& g : expected_bias) g += 2.0;
  expect_close(d_gain, expected_gain, kGradientTolerance, "d_gain");
  expect_close(d_bias, expected_bias, kGradientTolerance, "d_bias");
}

// 12 x 10: two sequences of 5; 70 tokens cross a chunk boundary; 7 features, one token.
INSTANTIATE_TEST_SUITE_P(Shapes, LayerNorm,
                         ::testing::Values(LayerNormCase{12, 10}, LayerNormCase{7, 70},
                                           LayerNormCase{5, 1}));

TEST(LayerNormParallel, ManyTokensMatchTheReference) {
  const std::int64_t d = 16, tokens = 3001;  // enough chunks to run on every core
  const DenseMatrix x = random_matrix(d, tokens, 8);
  const std::vector<float> gain = random_vector(d, 9), bias = random_vector(d, 10);
  DenseMatrix y(d, tokens);
  std::vector<float> mean(tokens), inv_std(tokens);
  layer_norm_forward(x, gain, bias, y, {mean, inv_std});
  expect_close(
      y, layer_norm_reference(to_grid(x), {gain.begin(), gain.end()}, {bias.begin(), bias.end()}),
      kForwardTolerance, "y");
}

TEST(LayerNormArguments, RefuseWrongSizes) {
  const DenseMatrix x(12, 10);
  DenseMatrix y(12, 10);
  std::vector<float> gain(12), bias(11), mean(10), inv_std(10);
  const auto message = testing::thrown_message<ShapeError>([&] {
    layer_norm_forward(x, gain, bias, y, {mean, inv_std});
  });
  EXPECT_CONTAINS(message, "layer_norm_forward: bias has 11 elements, expected 12");
  bias.resize(12);
  mean.resize(9);
  testing::thrown_message<ShapeError>([&] {
    layer_norm_forward(x, gain, bias, y, {mean, inv_std});
  });
  mean.resize(10);
  std::vector<float> d_gain(12), d_bias(13);
  const auto backward_message = testing::thrown_message<ShapeError>(
      [&] { layer_norm_backward(x, gain, mean, inv_std, x, y, d_gain, d_bias); });
  EXPECT_CONTAINS(backward_message, "layer_norm_backward: d_bias has 13 elements, expected 12");
}

// ---------------------------------------------------------------------------------------------
// Causal attention

struct AttentionCase {
  std::int64_t d_model, heads, context, sequences;
  double scale;  // of Q and K: large values test the max-subtracted softmax
};

class Attention : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(Attention, MatchesReferenceAndFiniteDifferences) {
  const auto [d, heads, context, sequences, scale] = GetParam();
  const AttentionShape shape{context, heads};
  const std::int64_t tokens = context * sequences;
  const DenseMatrix q = random_matrix(d, tokens, 11, scale),
                    k = random_matrix(d, tokens, 12, scale), v = random_matrix(d, tokens, 13);
  DenseMatrix out(d, tokens);
  std::vector<float> p(attention_probabilities_size(tokens, shape));
  ASSERT_EQ(static_cast<std::int64_t>(p.size()), sequences * heads * context * context);
  causal_attention_forward(q, k, v, shape, out, p);
  const Grid q64 = to_grid(q), k64 = to_grid(k), v64 = to_grid(v);
  std::vector<double> p64;
  // Scores of magnitude `scale^2` lose float precision in exp: the tolerance grows with them.
  const double forward_tolerance = kForwardTolerance * scale * scale;
  expect_close(out, attention_reference(q64, k64, v64, shape, &p64), forward_tolerance, "out");
  expect_close(p, p64, forward_tolerance, "probabilities");

  const DenseMatrix d_out = random_matrix(d, tokens, 14);
  const Grid weights = to_grid(d_out);
  DenseMatrix dq(d, tokens), dk(d, tokens), dv(d, tokens);
  dq.fill(9.0F);  // overwritten, not added to
  causal_attention_backward(q, k, v, p, shape, d_out, dq, dk, dv);
  const double tolerance = kGradientTolerance * scale * scale;
  expect_close(dq,
               numeric_gradient(q64,
                                [&](const Grid& x) {
                                  return weighted_sum(attention_reference(x, k64, v64, shape),
                                                      weights);
                                }),
               tolerance, "dq");
  expect_close(dk,
               numeric_gradient(k64,
                                [&](const Grid& x) {
                                  return weighted_sum(attention_reference(q64, x, v64, shape),
                                                      weights);
                                }),
               tolerance, "dk");
  expect_close(dv,
               numeric_gradient(v64,
                                [&](const Grid& x) {
                                  return weighted_sum(attention_reference(q64, k64, x, shape),
                                                      weights);
                                }),
               tolerance, "dv");
}

INSTANTIATE_TEST_SUITE_P(Shapes, Attention,
                         ::testing::Values(AttentionCase{12, 3, 5, 2, 1.0},     // d_head 4
                                           AttentionCase{6, 1, 7, 1, 1.0},      // one head
                                           AttentionCase{8, 2, 1, 3, 1.0},      // context 1
                                           AttentionCase{12, 3, 5, 2, 6.0},     // sharp softmax
                                           AttentionCase{40, 2, 37, 1, 1.0}));  // whole tiles

TEST(AttentionSoftmax, SharesBelowTwoToTheMinus64AreZeroAndNoneSubnormal) {
  // Scores far apart: a sharp softmax's small shares would otherwise be subnormal factors
  // in the attention's products (slow in vector units). Shares below 2^-64 are zero,
  // larger ones match the float64 softmax, and the output still matches the reference.
  const std::int64_t d = 16, context = 24;
  const AttentionShape shape{context, 2};
  const DenseMatrix q = random_matrix(d, context, 31, 12.0),
                    k = random_matrix(d, context, 32, 12.0), v = random_matrix(d, context, 33);
  DenseMatrix out(d, context);
  std::vector<float> p(attention_probabilities_size(context, shape));
  causal_attention_forward(q, k, v, shape, out, p);
  std::vector<double> p64;
  const Grid reference = attention_reference(to_grid(q), to_grid(k), to_grid(v), shape, &p64);
  std::int64_t zeroed = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    ASSERT_NE(std::fpclassify(p[i]), FP_SUBNORMAL) << "probability " << i;
    if (p64[i] < 0x1p-66) {
      EXPECT_EQ(p[i], 0.0F) << "probability " << i << " (float64 " << p64[i] << ")";
      ++zeroed;
    } else if (p64[i] > 0x1p-62) {
      EXPECT_NEAR(p[i], p64[i], 1e-3 * p64[i] + 1e-6) << "probability " << i;
    }
  }
  EXPECT_GT(zeroed, 0) << "the case has no share below 2^-64: it tests nothing";
  expect_close(out, reference, kForwardTolerance * 144.0, "out");
}

TEST(AttentionParallel, BatchEqualsSequenceBySequence) {
  // Enough (sequence, head) tasks to run in parallel; each sequence alone runs serially.
  const std::int64_t d = 32, context = 16, sequences = 40, tokens = context * sequences;
  const AttentionShape shape{context, 4};
  const DenseMatrix q = random_matrix(d, tokens, 15), k = random_matrix(d, tokens, 16),
                    v = random_matrix(d, tokens, 17), d_out = random_matrix(d, tokens, 18);
  DenseMatrix out(d, tokens), dq(d, tokens), dk(d, tokens), dv(d, tokens);
  std::vector<float> p(attention_probabilities_size(tokens, shape));
  causal_attention_forward(q, k, v, shape, out, p);
  causal_attention_backward(q, k, v, p, shape, d_out, dq, dk, dv);
  const std::int64_t per_sequence = attention_probabilities_size(context, shape);
  for (std::int64_t s = 0; s < sequences; s += 13) {
    auto slice = [&](const DenseMatrix& m) {
      return ConstMatrixView{m.data() + s * context, d, context, m.stride()};
    };
    DenseMatrix o1(d, context), dq1(d, context), dk1(d, context), dv1(d, context);
    std::vector<float> p1(per_sequence);
    causal_attention_forward(slice(q), slice(k), slice(v), shape, o1, p1);
    causal_attention_backward(slice(q), slice(k), slice(v), p1, shape, slice(d_out), dq1, dk1, dv1);
    for (std::int64_t f = 0; f < d; ++f) {
      for (std::int64_t i = 0; i < context; ++i) {
        ASSERT_EQ(out(f, s * context + i), o1(f, i));
        ASSERT_EQ(dq(f, s * context + i), dq1(f, i));
        ASSERT_EQ(dk(f, s * context + i), dk1(f, i));
        ASSERT_EQ(dv(f, s * context + i), dv1(f, i));
      }
    }
  }
}

// Every ISA's block kernels (the public blocks run the default ISA's) on whole register tiles
// and ragged edges: the attention against the float64 reference, its backward against the
// baseline build's within rounding (FMA contracts differently), GELU against its formula.
TEST(BlockKernels, EveryIsaMatchesTheReference) {
  const std::int64_t d = 48, heads = 2, context = 41, sequences = 2, tokens = context * sequences;
  const AttentionShape shape{context, heads};
  const DenseMatrix q = random_matrix(d, tokens, 21), k = random_matrix(d, tokens, 22),
                    v = random_matrix(d, tokens, 23), d_out = random_matrix(d, tokens, 24);
  const Grid expected = attention_reference(to_grid(q), to_grid(k), to_grid(v), shape);
  const auto run = [&](const detail::BlockKernels& kernels, DenseMatrix& out, DenseMatrix& dq,
                       DenseMatrix& dk, DenseMatrix& dv) {
    std::vector<float> p(attention_probabilities_size(tokens, shape));
    for (std::int64_t s = 0; s < sequences; ++s) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const detail::HeadTask task{context, d / heads, h * (d / heads), s * context,
                                    static_cast<std::size_t>((s * heads + h) * context * context)};
        std::vector<float> scratch(detail::attention_scratch_floats(task));
        float* const probs = p.data() + task.probabilities_offset;
        kernels.attention_forward(q, k, v, task, out, probs, scratch.data());
        kernels.attention_backward(q, k, v, probs, task, d_out, dq, dk, dv, scratch.data());
      }
    }
  };
  DenseMatrix base_out(d, tokens), base_dq(d, tokens), base_dk(d, tokens), base_dv(d, tokens);
  run(detail::block_kernels(Isa::scalar), base_out, base_dq, base_dk, base_dv);
  for (const Isa isa : supported_isas()) {
    SCOPED_TRACE(to_string(isa));
    DenseMatrix out(d, tokens), dq(d, tokens), dk(d, tokens), dv(d, tokens);
    run(detail::block_kernels(isa), out, dq, dk, dv);
    expect_close(out, expected, kForwardTolerance, "out");
    expect_close(dq, to_grid(base_dq), kForwardTolerance, "dq");
    expect_close(dk, to_grid(base_dk), kForwardTolerance, "dk");
    expect_close(dv, to_grid(base_dv), kForwardTolerance, "dv");

    const std::int64_t n = 37;  // a whole vector and a ragged tail at every width
    std::vector<float> z(n), dy(n, 1.5F), y(n), dz(n);
    for (std::int64_t t = 0; t < n; ++t) z[t] = -9.0F + 0.5F * static_cast<float>(t);
    detail::block_kernels(isa).gelu_forward(z.data(), y.data(), n);
    detail::block_kernels(isa).gelu_backward(z.data(), dy.data(), dz.data(), n);
    for (std::int64_t t = 0; t < n; ++t) {
      EXPECT_NEAR(y[t], detail::gelu(z[t]), 2e-7 * (1 + std::abs(z[t]))) << "z = " << z[t];
      EXPECT_NEAR(dz[t], 1.5F * detail::gelu_slope(z[t]), 4e-7) << "z = " << z[t];
    }
  }
}

TEST(AttentionArguments, RefuseBadShapes) {
  const DenseMatrix q(12, 10), k(12, 10), v(12, 10);
  DenseMatrix out(12, 10);
  std::vector<float> p(attention_probabilities_size(10, {5, 3}));
  auto message = testing::thrown_message<ShapeError>([&] {
    causal_attention_forward(q, k, v, {5, 5}, out, p);
  });
  EXPECT_CONTAINS(message, "d_model 12 is not a positive multiple of heads 5");
  message = testing::thrown_message<ShapeError>([&] {
    causal_attention_forward(q, k, v, {4, 3}, out, p);
  });
  EXPECT_CONTAINS(message, "10 tokens are not whole sequences of context 4");
  std::vector<float> short_p(p.size() - 1);
  testing::thrown_message<ShapeError>([&] {
    causal_attention_forward(q, k, v, {5, 3}, out, short_p);
  });
  const DenseMatrix v_wrong(12, 5);
  testing::thrown_message<ShapeError>([&] {
    causal_attention_forward(q, k, v_wrong, {5, 3}, out, p);
  });
}

// ---------------------------------------------------------------------------------------------
// Elementwise

TEST(Gelu, MatchesReferenceAndFiniteDifferences) {
  const DenseMatrix z = random_matrix(12, 10, 19, 4.0);
  DenseMatrix y(12, 10), dz(12, 10);
  gelu_forward(z, y);
  const Grid z64 = to_grid(z);
  expect_close(y, gelu_reference(z64), kForwardTolerance, "y");
  const DenseMatrix dy = random_matrix(12, 10, 20);
  gelu_backward(z, dy, dz);
  const Grid weights = to_grid(dy);
  expect_close(dz,
               numeric_gradient(
                   z64, [&](const Grid& x) { return weighted_sum(gelu_reference(x), weights); }),
               kGradientTolerance, "dz");
}

TEST(ResidualAdd, AddsElementwiseAndRefusesOtherShapes) {
  DenseMatrix y = random_matrix(12, 10, 21);
  const DenseMatrix before = y.clone(), x = random_matrix(12, 10, 22);
  residual_add(y, x);
  for (std::int64_t r = 0; r < 12; ++r)
    for (std::int64_t c = 0; c < 10; ++c) ASSERT_EQ(y(r, c), before(r, c) + x(r, c));
  const DenseMatrix other(12, 9);
  testing::thrown_message<ShapeError>([&] { residual_add(y, other); });
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

TEST(CrossEntropy, LossAndGradientAgainstFiniteDifferences) {
  const std::int64_t vocab = 11, tokens = 70;  // crosses a chunk boundary
  const DenseMatrix logits = random_matrix(vocab, tokens, 23, 3.0);
  const auto targets = random_targets(tokens, vocab, 24);
  DenseMatrix d(vocab, tokens);
  const double loss = softmax_cross_entropy(logits, targets, d, 0.5F);
  const Grid l64 = to_grid(logits);
  const double expected = cross_entropy_reference(l64, targets);
  EXPECT_NEAR(loss, expected, 1e-6 * expected);
  Grid gradient = numeric_gradient(
      l64, [&](const Grid& x) { return 0.5 * cross_entropy_reference(x, targets); });
  expect_close(d, gradient, kGradientTolerance, "dlogits");
  EXPECT_NEAR(softmax_cross_entropy(logits, targets, {}), expected, 1e-6 * expected);
}

TEST(CrossEntropy, ByteLogitsStayFiniteWhenLarge) {
  const std::int64_t vocab = 256, tokens = 9;
  const DenseMatrix logits = random_matrix(vocab, tokens, 25, 500.0);
  const auto targets = random_targets(tokens, vocab, 26);
  DenseMatrix d(vocab, tokens);
  const double loss = softmax_cross_entropy(logits, targets, d);
  const Grid l64 = to_grid(logits);
  EXPECT_NEAR(loss, cross_entropy_reference(l64, targets), 1e-4 * loss);
  for (std::int64_t t = 0; t < tokens; ++t) {  // softmax - one_hot sums to zero per token
    double sum = 0;
    for (std::int64_t r = 0; r < vocab; ++r) {
      ASSERT_TRUE(std::isfinite(d(r, t)));
      sum += d(r, t);
    }
    EXPECT_NEAR(sum, 0.0, 1e-5);
  }
}

TEST(CrossEntropy, RefusesTargetsOutsideTheVocabulary) {
  const DenseMatrix logits(256, 3);
  DenseMatrix d(256, 3);
  const std::vector<std::int32_t> targets = {0, 256, 1};
  const auto message =
      testing::thrown_message<ArgumentError>([&] { softmax_cross_entropy(logits, targets, d); });
  EXPECT_CONTAINS(message, "symbol 256 at token 1 is outside 0..255");
}

}  // namespace
}  // namespace sluice
