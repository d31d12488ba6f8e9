// The blocks composed into a model: token embedding, one pre-LayerNorm transformer block, a
// final LayerNorm and an LM head tied to the token table, with dense projections standing in
// for the sparse layers the executor will stream. Its loss against a float64 reference of the
// same model, and every parameter's gradient against central finite differences of that
// reference: the chain the executor's block model has to reproduce, and a check that the
// blocks' conventions compose (gradients added into shared tables, residual branches summed).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "block_references.hpp"
#include "sluice/blocks.hpp"

namespace sluice {
namespace {

using namespace testing::reference;

constexpr std::int64_t kVocab = 19, kD = 12, kHeads = 3, kContext = 5, kSequences = 2;
constexpr std::int64_t kTokens = kContext * kSequences;
constexpr AttentionShape kShape{kContext, kHeads};

// The parameters, in this order; gains and biases are 1 x d_model.
enum Parameter {
  kTable,
  kPositions,
  kGain1,
  kBias1,
  kWq,
  kWk,
  kWv,
  kWo,
  kGain2,
  kBias2,
  kW1,
  kW2,
  kGainF,
  kBiasF,
  kParameters
};

struct ParameterShape {
  std::int64_t rows, cols;
};
constexpr ParameterShape kParameterShapes[kParameters] = {
    {kVocab, kD}, {kContext, kD}, {1, kD}, {1, kD},      {kD, kD},     {kD, kD}, {kD, kD},
    {kD, kD},     {1, kD},        {1, kD}, {4 * kD, kD}, {kD, 4 * kD}, {1, kD},  {1, kD}};

// --- float64 reference -------------------------------------------------------------------------

Grid matmul(const Grid& w, const Grid& x) {
  Grid y(w.rows, x.cols);
  for (std::int64_t o = 0; o < w.rows; ++o)
    for (std::int64_t i = 0; i < w.cols; ++i)
      for (std::int64_t t = 0; t < x.cols; ++t) y(o, t) += w(o, i) * x(i, t);
  return y;
}

Grid plus(Grid a, const Grid& b) {
  for (std::size_t i = 0; i < a.v.size(); ++i) a.v[i] += b.v[i];
  return a;
}

Grid norm(const Grid& x, const Grid& gain, const Grid& bias) {
  return layer_norm_reference(x, gain.v, bias.v);
}

double reference_loss(const std::vector<Grid>& p, const std::vector<std::int32_t>& tokens,
                      const std::vector<std::int32_t>& targets) {
  const Grid x0 = embedding_reference(tokens, p[kTable], p[kPositions]);
  const Grid a = norm(x0, p[kGain1], p[kBias1]);
  const Grid attention =
      attention_reference(matmul(p[kWq], a), matmul(p[kWk], a), matmul(p[kWv], a), kShape);
  const Grid x1 = plus(x0, matmul(p[kWo], attention));
  const Grid hidden = gelu_reference(matmul(p[kW1], norm(x1, p[kGain2], p[kBias2])));
  const Grid x2 = plus(x1, matmul(p[kW2], hidden));
  return cross_entropy_reference(matmul(p[kTable], norm(x2, p[kGainF], p[kBiasF])), targets);
}

// --- the float model from the blocks -----------------------------------------------------------

DenseMatrix product(const DenseMatrix& w, const DenseMatrix& x) {  // w x
  DenseMatrix y(w.rows(), x.cols());
  for (std::int64_t o = 0; o < w.rows(); ++o)
    for (std::int64_t i = 0; i < w.cols(); ++i)
      for (std::int64_t t = 0; t < x.cols(); ++t) y(o, t) += w(o, i) * x(i, t);
  return y;
}

DenseMatrix product_transposed(const DenseMatrix& w, const DenseMatrix& dy) {  // w^T dy
  DenseMatrix dx(w.cols(), dy.cols());
  for (std::int64_t o = 0; o < w.rows(); ++o)
    for (std::int64_t i = 0; i < w.cols(); ++i)
      for (std::int64_t t = 0; t < dy.cols(); ++t) dx(i, t) += w(o, i) * dy(o, t);
  return dx;
}

void add_outer(DenseMatrix& dw, const DenseMatrix& dy, const DenseMatrix& x) {  // dw += dy x^T
  for (std::int64_t o = 0; o < dw.rows(); ++o)
    for (std::int64_t i = 0; i < dw.cols(); ++i)
      for (std::int64_t t = 0; t < x.cols(); ++t) dw(o, i) += dy(o, t) * x(i, t);
}

std::span<const float> vec(const DenseMatrix& m) {
  return {m.row(0), static_cast<std::size_t>(m.cols())};
}
std::span<float> vec(DenseMatrix& m) {
  return {m.row(0), static_cast<std::size_t>(m.cols())};
}

/// A LayerNorm with what its backward needs.
struct Norm {
  DenseMatrix y;
  std::vector<float> mean = std::vector<float>(kTokens), inv_std = std::vector<float>(kTokens);

  Norm(const DenseMatrix& x, const DenseMatrix& gain, const DenseMatrix& bias) : y(kD, kTokens) {
    layer_norm_forward(x, vec(gain), vec(bias), y, {mean, inv_std});
  }
  DenseMatrix backward(const DenseMatrix& x, const DenseMatrix& gain, const DenseMatrix& dy,
                       DenseMatrix& d_gain, DenseMatrix& d_bias) const {
    DenseMatrix dx(kD, kTokens);
    layer_norm_backward(x, vec(gain), mean, inv_std, dy, dx, vec(d_gain), vec(d_bias));
    return dx;
  }
};

/// The loss (summed over the tokens) and every parameter's gradient, through the blocks.
double model_loss_and_gradients(const std::vector<DenseMatrix>& p,
                                const std::vector<std::int32_t>& tokens,
                                const std::vector<std::int32_t>& targets,
                                std::vector<DenseMatrix>& g) {
  DenseMatrix x0(kD, kTokens);
  embedding_forward(tokens, p[kTable], p[kPositions], x0);
  const Norm n1(x0, p[kGain1], p[kBias1]);
  const DenseMatrix q = product(p[kWq], n1.y), k = product(p[kWk], n1.y), v = product(p[kWv], n1.y);
  DenseMatrix attention(kD, kTokens);
  std::vector<float> probabilities(attention_probabilities_size(kTokens, kShape));
  causal_attention_forward(q, k, v, kShape, attention, probabilities);
  DenseMatrix x1 = product(p[kWo], attention);
  residual_add(x1, x0);
  const Norm n2(x1, p[kGain2], p[kBias2]);
  const DenseMatrix u = product(p[kW1], n2.y);
  DenseMatrix hidden(4 * kD, kTokens);
  gelu_forward(u, hidden);
  DenseMatrix x2 = product(p[kW2], hidden);
  residual_add(x2, x1);
  const Norm nf(x2, p[kGainF], p[kBiasF]);
  const DenseMatrix logits = product(p[kTable], nf.y);
  DenseMatrix d_logits(kVocab, kTokens);
  const double loss = softmax_cross_entropy(logits, targets, d_logits);

  // Backward, the head first: the tied table's gradient collects the head's and the
  // embedding's parts.
  add_outer(g[kTable], d_logits, nf.y);
  DenseMatrix dx2 =
      nf.backward(x2, p[kGainF], product_transposed(p[kTable], d_logits), g[kGainF], g[kBiasF]);
  add_outer(g[kW2], dx2, hidden);
  DenseMatrix d_u(4 * kD, kTokens);
  gelu_backward(u, product_transposed(p[kW2], dx2), d_u);
  add_outer(g[kW1], d_u, n2.y);
  DenseMatrix dx1 =
      n2.backward(x1, p[kGain2], product_transposed(p[kW1], d_u), g[kGain2], g[kBias2]);
  residual_add(dx1, dx2);  // the residual branch
  add_outer(g[kWo], dx1, attention);
  DenseMatrix dq(kD, kTokens), dk(kD, kTokens), dv(kD, kTokens);
  causal_attention_backward(q, k, v, probabilities, kShape, product_transposed(p[kWo], dx1), dq, dk,
                            dv);
  add_outer(g[kWq], dq, n1.y);
  add_outer(g[kWk], dk, n1.y);
  add_outer(g[kWv], dv, n1.y);
  DenseMatrix d_a = product_transposed(p[kWq], dq);
  residual_add(d_a, product_transposed(p[kWk], dk));
  residual_add(d_a, product_transposed(p[kWv], dv));
  DenseMatrix dx0 = n1.backward(x0, p[kGain1], d_a, g[kGain1], g[kBias1]);
  residual_add(dx0, dx1);
  embedding_backward(tokens, dx0, g[kTable], g[kPositions]);
  return loss;
}

TEST(TransformerBlock, LossAndEveryGradientMatchTheFloat64Reference) {
  std::vector<DenseMatrix> p;
  for (int i = 0; i < kParameters; ++i) {
    const auto [rows, cols] = kParameterShapes[i];
    const bool projection = (i >= kWq && i <= kWo) || i == kW1 || i == kW2;
    // Projections scaled by 1/sqrt(fan-in) so activations stay of order one.
    p.push_back(random_matrix(rows, cols, 100 + i, projection ? 1.0 / std::sqrt(cols) : 1.0));
    if (i == kGain1 || i == kGain2 || i == kGainF) {  // gains in (0, 2)
      for (std::int64_t f = 0; f < cols; ++f) p.back()(0, f) += 1.0F;
    }
  }
  const std::vector<std::int32_t> tokens = {3, 0, 18, 3, 7, 1, 11, 2, 0, 3};
  const std::vector<std::int32_t> targets = {0, 18, 3, 7, 9, 11, 2, 0, 3, 5};
  std::vector<DenseMatrix> g;
  for (const auto& [rows, cols] : kParameterShapes) g.emplace_back(rows, cols);
  const double loss = model_loss_and_gradients(p, tokens, targets, g);

  std::vector<Grid> p64;
  for (const auto& m : p) p64.push_back(to_grid(m));
  const double expected = reference_loss(p64, tokens, targets);
  EXPECT_NEAR(loss, expected, 1e-5 * expected);
  for (int i = 0; i < kParameters; ++i) {
    const Grid numeric = numeric_gradient(p64[i], [&](const Grid& x) {
      std::vector<Grid> varied = p64;
      varied[i] = x;
      return reference_loss(varied, tokens, targets);
    });
    SCOPED_TRACE("parameter " + std::to_string(i));
    expect_close(g[i], numeric, 2e-5, "gradient");
  }
}

}  // namespace
}  // namespace sluice
