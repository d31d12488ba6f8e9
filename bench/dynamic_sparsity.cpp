// Dynamic sparsity's costs on one layer: RigL's scores (the streaming top-k of |dY X^T|
// over the inactive positions, the dense gradient never held), and the regrowth in
// ModelMemory (drop the smallest, grow, carry the optimizer state over, rebuild the
// transposed pattern and placements). Args: rows (= cols), sparsity in percent, tokens,
// swapped in percent of the non-zeros. Counters: positions scored per second.
#include <benchmark/benchmark.h>

#include <random>

#include "engine/gradient_top_k.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/model_memory.hpp"

namespace sluice {
namespace {

DenseMatrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed,
                          double zero_fraction) {
  DenseMatrix m(rows, cols);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<double> uniform;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c)
      m(r, c) = uniform(rng) < zero_fraction ? 0 : normal(rng);
  }
  return m;
}

void BM_rigl_scores(benchmark::State& state) {
  const std::int64_t n = state.range(0), tokens = state.range(2);
  const CsrMatrix mask = CsrMatrix::random(n, n, static_cast<double>(state.range(1)) / 100, 1);
  const std::int64_t k = mask.nnz() * state.range(3) / 100;
  // ReLU layers: about half of X and of dY are zeros.
  const DenseMatrix x = random_matrix(n, tokens, 2, 0.5), dy = random_matrix(n, tokens, 3, 0.5);
  const std::vector<ConstMatrixView> xs{x.view()}, dys{dy.view()};
  for (auto _ : state) benchmark::DoNotOptimize(detail::dense_gradient_top_k(mask, xs, dys, k));
  state.counters["positions_per_s"] =
      benchmark::Counter(static_cast<double>(n * n), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_regrow(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  HostModelMemory memory;
  CsrMatrix w = CsrMatrix::random(n, n, static_cast<double>(state.range(1)) / 100, 1);
  w.fill_values(2);
  memory.add_layer(std::move(w));
  memory.placement(0, 2);
  memory.transposed(0);
  const std::int64_t k = memory.weights(0).nnz() * state.range(3) / 100;
  std::uint64_t seed = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const auto grow = random_inactive_positions(memory.weights(0), k, ++seed);
    state.ResumeTiming();
    memory.regrow(0, grow);
  }
}

// digits' 512 x 512 at 95%, 32 tokens, 30% swapped; then a 4096-wide layer at 90%.
BENCHMARK(BM_rigl_scores)
    ->Args({512, 95, 32, 30})
    ->Args({4096, 90, 256, 30})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_regrow)
    ->Args({512, 95, 0, 30})
    ->Args({4096, 90, 0, 30})
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace sluice

BENCHMARK_MAIN();
