// The transformer's weightless blocks at a GPT's shapes: causal attention forward and
// backward, LayerNorm forward and backward, the byte cross-entropy. Args: d_model, heads,
// context, sequences. Counters: tokens per second; for attention also the multiply-adds of
// its four products (QK^T, PV forward; dP, dV, dQ, dK backward) over the causal half.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "sluice/blocks.hpp"

namespace sluice {
namespace {

DenseMatrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  DenseMatrix m(rows, cols);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) m(r, c) = normal(rng);
  return m;
}

void set_counters(benchmark::State& state, std::int64_t tokens, double multiply_adds) {
  state.counters["tokens_per_s"] = benchmark::Counter(
      static_cast<double>(tokens), benchmark::Counter::kIsIterationInvariantRate);
  if (multiply_adds > 0) {
    state.counters["flops"] =
        benchmark::Counter(2 * multiply_adds, benchmark::Counter::kIsIterationInvariantRate);
  }
}

void BM_attention(benchmark::State& state) {
  const std::int64_t d = state.range(0), context = state.range(2);
  const std::int64_t tokens = context * state.range(3);
  const AttentionShape shape{context, state.range(1)};
  const DenseMatrix q = random_matrix(d, tokens, 1), k = random_matrix(d, tokens, 2),
                    v = random_matrix(d, tokens, 3), d_out = random_matrix(d, tokens, 4);
  DenseMatrix out(d, tokens), dq(d, tokens), dk(d, tokens), dv(d, tokens);
  std::vector<float> p(static_cast<std::size_t>(attention_probabilities_size(tokens, shape)));
  for (auto _ : state) {
    causal_attention_forward(q, k, v, shape, out, p);
    causal_attention_backward(q, k, v, p, shape, d_out, dq, dk, dv);
  }
  // Six products of d_model x (context^2 / 2) multiply-adds per sequence.
  set_counters(state, tokens, 6.0 * d * context * (context + 1) / 2.0 * state.range(3));
}

void BM_layer_norm(benchmark::State& state) {
  const std::int64_t d = state.range(0), tokens = state.range(2) * state.range(3);
  const DenseMatrix x = random_matrix(d, tokens, 5), dy = random_matrix(d, tokens, 6);
  const std::vector<float> gain(d, 1.0F), bias(d, 0.0F);
  std::vector<float> mean(tokens), inv_std(tokens), d_gain(d), d_bias(d);
  DenseMatrix y(d, tokens), dx(d, tokens);
  for (auto _ : state) {
    layer_norm_forward(x, gain, bias, y, {mean, inv_std});
    layer_norm_backward(x, gain, mean, inv_std, dy, dx, d_gain, d_bias);
  }
  set_counters(state, tokens, 0);
}

void BM_cross_entropy(benchmark::State& state) {
  const std::int64_t tokens = state.range(2) * state.range(3);
  const DenseMatrix logits = random_matrix(256, tokens, 7);
  std::vector<std::int32_t> targets(tokens);
  for (std::int64_t t = 0; t < tokens; ++t) targets[t] = static_cast<std::int32_t>(t * 37 % 256);
  DenseMatrix d(256, tokens);
  for (auto _ : state) benchmark::DoNotOptimize(softmax_cross_entropy(logits, targets, d));
  set_counters(state, tokens, 0);
}

// The GPT: d_model 256, 4 heads, context 128, batch 32.
BENCHMARK(BM_attention)->Args({256, 4, 128, 32})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_layer_norm)->Args({256, 4, 128, 32})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_cross_entropy)->Args({256, 4, 128, 32})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace sluice

BENCHMARK_MAIN();
