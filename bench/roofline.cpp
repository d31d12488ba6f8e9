// The gather roofline of this machine: the inner step of the streamed product,
// acc[0:T] += w * X[i, 0:T] for a stream of random (w, i), with the activation block X
// sized to sit in L1, L2, L3 or DRAM, on every core at once. Its GFLOP/s per level is the
// bound the streamed kernels can approach; `sluice_forward` reports the engine's own
// useful GFLOP/s on the 4096 x 4096 x 256 layer at 90% sparsity and its fraction
// of the L2 bound, measured in the same run.
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <cstdint>
#include <random>
#include <vector>

#include "bench_common.hpp"
#include "sluice/isa.hpp"
#include "sluice/planner.hpp"

namespace sluice::bench {
namespace {

constexpr std::int64_t kTokens = 64;  // one tile: four zmm registers per row

struct Probe {
  std::vector<float> x;  // rows x kTokens, contiguous (a packed lane tile)
  std::vector<Packet> packets;
};

Probe make_probe(std::int64_t block_bytes, std::uint64_t seed) {
  const std::int64_t rows = std::max<std::int64_t>(1, block_bytes / (kTokens * 4));
  Probe p;
  p.x.assign(rows * kTokens, 0.5F);
  std::mt19937_64 rng(seed);
  p.packets.resize(1 << 20);
  for (auto& k : p.packets) k = {static_cast<std::uint32_t>(rng() % rows), 0.001F};
  return p;
}

__attribute__((target("avx512f"))) float gather_axpy(const Probe& p) {
  __m512 a[4], b[4];
  for (int v = 0; v < 4; ++v) a[v] = b[v] = _mm512_setzero_ps();
  const Packet* k = p.packets.data();
  const float* x = p.x.data();
  const std::size_t n = p.packets.size();
  for (std::size_t j = 0; j + 2 <= n; j += 2) {
    const float* r0 = x + static_cast<std::int64_t>(k[j].tag) * kTokens;
    const float* r1 = x + static_cast<std::int64_t>(k[j + 1].tag) * kTokens;
    if (j + 18 <= n) {
      _mm_prefetch(
          reinterpret_cast<const char*>(x + static_cast<std::int64_t>(k[j + 16].tag) * kTokens),
          _MM_HINT_T0);
      _mm_prefetch(
          reinterpret_cast<const char*>(x + static_cast<std::int64_t>(k[j + 17].tag) * kTokens),
          _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_set1_ps(k[j].value), w1 = _mm512_set1_ps(k[j + 1].value);
    for (int v = 0; v < 4; ++v) {
      a[v] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(r0 + 16 * v), a[v]);
      b[v] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(r1 + 16 * v), b[v]);
    }
  }
  __m512 s = _mm512_setzero_ps();
  for (int v = 0; v < 4; ++v) s = _mm512_add_ps(s, _mm512_add_ps(a[v], b[v]));
  return _mm512_reduce_add_ps(s);
}

void BM_gather_roofline(benchmark::State& state) {
  if (!cpu_supports(Isa::avx512)) {
    state.SkipWithError("the probe needs AVX-512");
    return;
  }
  const Probe probe = make_probe(state.range(0), 17 + state.thread_index());
  for (auto _ : state) benchmark::DoNotOptimize(gather_axpy(probe));
  state.counters["GFLOPs"] =
      benchmark::Counter(2.0 * kTokens * static_cast<double>(probe.packets.size()),
                         benchmark::Counter::kIsIterationInvariantRate);
  state.counters["block_KiB"] = benchmark::Counter(static_cast<double>(state.range(0)) / 1024,
                                                   benchmark::Counter::kAvgThreads);
}

void BM_sluice_forward(benchmark::State& state) {
  const Layer& l = layer(state);
  time_sparse_forward(state, l, placement_for(l));
}

}  // namespace
}  // namespace sluice::bench

int main(int argc, char** argv) {
  using namespace sluice::bench;
  const int threads = static_cast<int>(engine().threads());
  // L1 (32 KiB), L2 (256 KiB, 512 KiB, 1 MiB), L3 (8 MiB), DRAM (256 MiB) on every core.
  for (std::int64_t bytes :
       {32LL << 10, 256LL << 10, 512LL << 10, 1LL << 20, 8LL << 20, 256LL << 20}) {
    benchmark::RegisterBenchmark("gather_roofline", BM_gather_roofline)
        ->Arg(bytes)
        ->Threads(threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("sluice_forward", BM_sluice_forward)
      ->Args({4096, 4096, 256, 900})
      ->ArgNames({"out", "in", "tokens", "sparsity_permille"})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
