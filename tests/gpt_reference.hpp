#pragma once
// A float64 dense-masked reference of a tiny GPT (sluice/gpt.hpp): its sparse weights as
// dense matrices with zeros off the mask, its loss from the blocks' references, and the
// check of every layer's gradient against central differences of it. test_gpt runs it on
// local engines, tests/mpi/test_mpi_fabric over MPI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "block_references.hpp"
#include "sluice/bf16.hpp"
#include "sluice/gpt.hpp"

namespace sluice::testing::gpt_reference {

using namespace sluice::testing::reference;

inline GptConfig tiny_config(std::int64_t blocks = 1) {
  GptConfig c;
  c.vocab = 32;
  c.context = 8;
  c.d_model = 16;
  c.heads = 2;
  c.blocks = blocks;
  c.sparsity = 0.5;
  return c;
}

/// A GPT whose every parameter is random (gains near 1, biases non-zero), so that no
/// gradient is trivially right: the layers in GptLayers' order, as build_gpt adds them.
/// `bf16_exact`: every weight a bf16 value, which a bf16 stream carries unchanged.
inline void build_random_gpt(ModelMemory& memory, const GptConfig& c, std::uint64_t seed,
                             bool bf16_exact = false) {
  const GptLayers layers(c);
  const std::int64_t d = c.d_model;
  auto add = [&](std::int64_t rows, std::int64_t cols, double sparsity, double scale, bool bias,
                 double offset = 0) {
    CsrMatrix w = CsrMatrix::random(rows, cols, sparsity, seed++);
    w.fill_values(seed++, static_cast<float>(scale));
    for (float& v : w.values()) {
      v += static_cast<float>(offset);
      if (bf16_exact) v = round_to_bf16(v);
    }
    std::vector<float> b;
    if (bias) {
      for (const float x : random_vector(rows, static_cast<std::uint32_t>(seed++))) {
        b.push_back((x - 1.0F) * 0.2F);  // in [-0.1, 0.1)
      }
    }
    memory.add_layer(std::move(w), std::move(b));
  };
  const double s = c.sparsity;
  add(c.vocab, d, 0, 0.5, false);
  add(c.context, d, 0, 0.2, false);
  for (std::int64_t b = 0; b < c.blocks; ++b) {
    add(d, 1, 0, 0.3, true, 1.0);
    for (int i = 0; i < 4; ++i) add(d, d, s, 0.6, true);
    add(d, 1, 0, 0.3, true, 1.0);
    add(4 * d, d, s, 0.6, true);
    add(d, 4 * d, s, 0.3, true);
  }
  add(d, 1, 0, 0.3, true, 1.0);
  add(c.vocab, d, s, 0.6, true);
  memory.model = c.describe();
}

// --- the float64 reference -------------------------------------------------------------------

struct Reference {
  std::vector<Grid> w;  // every layer dense, zeros off its mask
  std::vector<std::vector<double>> b;
  /// As a bf16 stream's products take them: the projections' inputs rounded to bf16.
  bool bf16_projections = false;
};

inline Reference reference_of(const ModelMemory& memory) {
  Reference r;
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
    r.w.push_back(to_grid(memory.weights(l).to_dense()));
    r.b.emplace_back(memory.bias(l).begin(), memory.bias(l).end());
  }
  return r;
}

inline Grid affine(const Reference& r, std::int32_t l, const Grid& x) {
  const Grid& w = r.w[static_cast<std::size_t>(l)];
  Grid y(w.rows, x.cols);
  for (std::int64_t o = 0; o < w.rows; ++o)
    for (std::int64_t t = 0; t < x.cols; ++t) {
      double sum = r.b[static_cast<std::size_t>(l)].empty() ? 0 : r.b[l][o];
      for (std::int64_t i = 0; i < w.cols; ++i) {
        const double input =
            r.bf16_projections ? round_to_bf16(static_cast<float>(x(i, t))) : x(i, t);
        sum += w(o, i) * input;
      }
      y(o, t) = sum;
    }
  return y;
}

inline Grid norm(const Reference& r, std::int32_t l, const Grid& x) {
  return layer_norm_reference(x, r.w[static_cast<std::size_t>(l)].v,
                              r.b[static_cast<std::size_t>(l)]);
}

inline Grid plus(Grid a, const Grid& b) {
  for (std::size_t i = 0; i < a.v.size(); ++i) a.v[i] += b.v[i];
  return a;
}

/// The mean loss over the batch's tokens, in float64.
inline double reference_loss(const Reference& r, const GptConfig& c, const TextBatch& batch) {
  const GptLayers layers(c);
  Grid x = embedding_reference(batch.inputs, r.w[0], r.w[1]);
  for (const GptLayers::Block& l : layers.blocks) {
    const Grid a = norm(r, l.norm1, x);
    const Grid att = attention_reference(affine(r, l.q, a), affine(r, l.k, a), affine(r, l.v, a),
                                         {c.context, c.heads});
    const Grid mid = plus(x, affine(r, l.o, att));
    x = plus(mid, affine(r, l.down, gelu_reference(affine(r, l.up, norm(r, l.norm2, mid)))));
  }
  const Grid logits = affine(r, layers.head, norm(r, layers.final_norm, x));
  return cross_entropy_reference(logits, batch.targets) / static_cast<double>(x.cols);
}

inline TextBatch random_batch(const GptConfig& c, std::int64_t sequences, std::uint32_t seed) {
  TextBatch b;
  b.sequences = sequences;
  b.context = c.context;
  const std::int64_t n = sequences * c.context;
  b.inputs = random_targets(n, static_cast<std::int32_t>(c.vocab), seed);
  b.targets = random_targets(n, static_cast<std::int32_t>(c.vocab), seed + 1);
  return b;
}

/// Every gradient of `grads` against central differences of the reference loss: at the mask
/// positions of every layer, and every bias.
inline void expect_gradients_match(const ModelMemory& memory, const GptConfig& c,
                                   const TextBatch& batch, const std::vector<LayerGradient>& grads,
                                   double tolerance) {
  Reference r = reference_of(memory);
  ASSERT_EQ(grads.size(), static_cast<std::size_t>(memory.layer_count()));
  constexpr double h = 1e-6;
  auto numeric = [&](double& x) {
    const double keep = x;
    x = keep + h;
    const double up = reference_loss(r, c, batch);
    x = keep - h;
    const double down = reference_loss(r, c, batch);
    x = keep;
    return (up - down) / (2 * h);
  };
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const CsrMatrix& mask = memory.weights(l);
    const LayerGradient& g = grads[static_cast<std::size_t>(l)];
    ASSERT_EQ(g.weights.nnz(), mask.nnz());
    ASSERT_EQ(g.bias.size(), memory.bias(l).size());
    std::vector<double> expected, actual;
    for (std::int64_t row = 0; row < mask.rows(); ++row) {
      for (std::int64_t k = mask.row_offsets()[row]; k < mask.row_offsets()[row + 1]; ++k) {
        ASSERT_EQ(g.weights.col_indices()[k], mask.col_indices()[k]);
        expected.push_back(numeric(r.w[l](row, mask.col_indices()[k])));
        actual.push_back(g.weights.values()[k]);
      }
    }
    for (std::size_t o = 0; o < g.bias.size(); ++o) {
      expected.push_back(numeric(r.b[l][o]));
      actual.push_back(g.bias[o]);
    }
    double bound = 1e-3;  // a layer's gradients relative to its largest one
    for (const double e : expected) bound = std::max(bound, std::abs(e));
    for (std::size_t i = 0; i < expected.size(); ++i) {
      ASSERT_NEAR(actual[i], expected[i], tolerance * bound) << "element " << i;
    }
  }
}

}  // namespace sluice::testing::gpt_reference
