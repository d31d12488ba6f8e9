// The gather roofline of this machine: the inner step of the streamed product,
// acc[0:T] += w * X[i, 0:T] for a stream of random (w, i), with the activation block X
// sized to sit in L1, L2, L3 or DRAM, on every core at once; in fp32 (64 tokens per row)
// and with X in bf16 (128 tokens per row, the same 256 bytes, widened exactly to fp32).
// Its GFLOP/s per level is the bound the streamed kernels can approach. `sluice_*` report
// the engine's own useful GFLOP/s on the 4096 x 4096 x 256 layer at 90% sparsity
// (forward and backward, fp32 and bf16), to set against the probe with a 1 MiB block in
// the same precision from the same run. (A probe timed inside the engine's benchmark
// measured low: the engine's idle workers and migrated threads disturb it.)
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "sluice/isa.hpp"
#include "sluice/planner.hpp"

namespace sluice::bench {
namespace {

constexpr std::int64_t kTokens = 64;     // one fp32 tile: four zmm registers per row
constexpr std::int64_t kRowBytes = 256;  // a row of either probe

struct Probe {
  std::vector<float> x;  // rows of kRowBytes, contiguous (a packed lane tile)
  std::vector<Packet> packets;
};

Probe make_probe(std::int64_t block_bytes, std::uint64_t seed) {
  const std::int64_t rows = std::max<std::int64_t>(1, block_bytes / kRowBytes);
  Probe p;
  p.x.assign(rows * kTokens, 0.5F);  // as bf16 pairs: 0.5 and 0
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

// The same over bf16 rows of 128 tokens: each 64-byte load widened into even and odd
// tokens (as the engine's bf16 kernels do), eight FMAs per weight.
__attribute__((target("avx512f"))) float gather_axpy_bf16(const Probe& p) {
  __m512 a[8], b[8];
  for (int v = 0; v < 8; ++v) a[v] = b[v] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000U));
  const Packet* k = p.packets.data();
  const auto* x = reinterpret_cast<const std::uint16_t*>(p.x.data());
  const std::size_t n = p.packets.size();
  constexpr std::int64_t row = kRowBytes / 2;
  for (std::size_t j = 0; j + 2 <= n; j += 2) {
    const std::uint16_t* r0 = x + static_cast<std::int64_t>(k[j].tag) * row;
    const std::uint16_t* r1 = x + static_cast<std::int64_t>(k[j + 1].tag) * row;
    if (j + 18 <= n) {
      _mm_prefetch(
          reinterpret_cast<const char*>(x + static_cast<std::int64_t>(k[j + 16].tag) * row),
          _MM_HINT_T0);
      _mm_prefetch(
          reinterpret_cast<const char*>(x + static_cast<std::int64_t>(k[j + 17].tag) * row),
          _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_set1_ps(k[j].value), w1 = _mm512_set1_ps(k[j + 1].value);
    for (int v = 0; v < 4; ++v) {
      const __m512i x0 = _mm512_loadu_si512(r0 + 32 * v), x1 = _mm512_loadu_si512(r1 + 32 * v);
      a[2 * v] = _mm512_fmadd_ps(w0, _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16)), a[2 * v]);
      a[2 * v + 1] =
          _mm512_fmadd_ps(w0, _mm512_castsi512_ps(_mm512_and_si512(x0, high)), a[2 * v + 1]);
      b[2 * v] = _mm512_fmadd_ps(w1, _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16)), b[2 * v]);
      b[2 * v + 1] =
          _mm512_fmadd_ps(w1, _mm512_castsi512_ps(_mm512_and_si512(x1, high)), b[2 * v + 1]);
    }
  }
  __m512 s = _mm512_setzero_ps();
  for (int v = 0; v < 8; ++v) s = _mm512_add_ps(s, _mm512_add_ps(a[v], b[v]));
  return _mm512_reduce_add_ps(s);
}

/// Useful flops of one probe pass: 2 per weight and token.
double probe_flops(const Probe& p, Precision precision) {
  const double tokens = precision == Precision::bf16 ? 2 * kTokens : kTokens;
  return 2.0 * tokens * static_cast<double>(p.packets.size());
}

float run_probe(const Probe& p, Precision precision) {
  return precision == Precision::bf16 ? gather_axpy_bf16(p) : gather_axpy(p);
}

void BM_gather_roofline(benchmark::State& state, Precision precision) {
  if (!cpu_supports(Isa::avx512)) {
    state.SkipWithError("the probe needs AVX-512");
    return;
  }
  const Probe probe = make_probe(state.range(0), 17 + state.thread_index());
  for (auto _ : state) benchmark::DoNotOptimize(run_probe(probe, precision));
  state.counters["GFLOPs"] = benchmark::Counter(probe_flops(probe, precision),
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.counters["block_KiB"] = benchmark::Counter(static_cast<double>(state.range(0)) / 1024,
                                                   benchmark::Counter::kAvgThreads);
}

void BM_sluice(benchmark::State& state, Precision precision, bool backward) {
  if (!cpu_supports(Isa::avx512)) {
    state.SkipWithError("the roofline probe needs AVX-512");
    return;
  }
  const Layer& l = layer(state);
  const Placement placement = placement_for(l);
  const WeightStream& stream = l.weights(precision);
  DenseMatrix y(l.w.rows(), l.x.cols()), dx(l.w.cols(), l.x.cols());
  MutableMatrixView dx_view = dx.view();
  auto run = [&] {
    if (backward) {
      benchmark::DoNotOptimize(
          engine().backward(stream, placement, l.x.view(), l.dy.view(), &dx_view));
    } else {
      engine().forward(stream, placement, l.x.view(), y.view());
    }
  };
  for (auto _ : state) run();
  const double flops =
      (backward ? 4.0 : 2.0) * static_cast<double>(l.w.nnz()) * static_cast<double>(l.x.cols());
  state.counters["useful_GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace
}  // namespace sluice::bench

int main(int argc, char** argv) {
  using namespace sluice::bench;
  const int threads = static_cast<int>(engine().threads());
  // L1 (32 KiB), L2 (256 KiB, 512 KiB, 1 MiB), L3 (8 MiB), DRAM (256 MiB) on every core.
  const std::pair<const char*, sluice::Precision> probes[] = {
      {"gather_roofline", sluice::Precision::fp32},
      {"gather_roofline_bf16", sluice::Precision::bf16}};
  for (const auto& [name, precision] : probes) {
    for (std::int64_t bytes :
         {32LL << 10, 256LL << 10, 512LL << 10, 1LL << 20, 8LL << 20, 256LL << 20}) {
      benchmark::RegisterBenchmark(
          name, [precision](benchmark::State& s) { BM_gather_roofline(s, precision); })
          ->Arg(bytes)
          ->Threads(threads)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (const bool backward : {false, true}) {
    for (const sluice::Precision precision : {sluice::Precision::fp32, sluice::Precision::bf16}) {
      const std::string name = std::string(backward ? "sluice_backward" : "sluice_forward") +
                               (precision == sluice::Precision::bf16 ? "_bf16" : "");
      benchmark::RegisterBenchmark(
          name.c_str(),
          [precision, backward](benchmark::State& s) { BM_sluice(s, precision, backward); })
          ->Args({4096, 4096, 256, 900})
          ->ArgNames({"out", "in", "tokens", "sparsity_permille"})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
