// The gather roofline of this machine: the inner step of the streamed product,
// acc[0:T] += w * X[i, 0:T] for a stream of random (w, i), with the activation block X
// sized to sit in L1, L2, L3 or DRAM, on every core at once; in fp32 (64 tokens per row)
// and with X in bf16 (128 tokens per row, the same 256 bytes, widened exactly to fp32);
// the backward-data step, which writes each row back (`scatter_roofline`); and the
// backward-weight step, a dot product of each row with a dY row held in registers, eight
// reduced together as the engine's kernel does (`dot_roofline`).
// Its GFLOP/s per level (all cores together) is what the streamed kernels can approach.
// `sluice_*` report the engine's own useful GFLOP/s on the 4096 x 4096 x 256 layer
// at 90% sparsity (forward, backward-data and backward-weight, fp32 and bf16, by output;
// the backward by input, dX alone and both gradients, which gather dY rows as the forward
// gathers X rows); a table at the end sets each against the probe of its own step with a
// 1 MiB block (a lane's tile) from the same run, as a fraction.
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "engine/kernels/reduce8.hpp"
#include "sluice/isa.hpp"
#include "sluice/planner.hpp"

namespace sluice::bench {
namespace {

constexpr std::int64_t kTokens = 64;     // one fp32 tile: four zmm registers per row
constexpr std::int64_t kRowBytes = 256;  // a row of either probe

/// Rows held as the engine holds a lane's tile: 2 MiB aligned, so no row straddles a cache
/// line, and on huge pages where the kernel allows (the engine's tile measured ~1.5x
/// faster than the same rows in a 16-byte-aligned vector).
class Block {
 public:
  explicit Block(std::size_t floats) {
    constexpr std::size_t kHuge = 2 << 20;
    const std::size_t bytes = (floats * sizeof(float) + kHuge - 1) / kHuge * kHuge;
    data_.reset(static_cast<float*>(std::aligned_alloc(kHuge, bytes)));
    if (!data_) throw std::bad_alloc();
    ::madvise(data_.get(), bytes, MADV_HUGEPAGE);  // a hint: fine if refused
    std::fill_n(data_.get(), floats, 0.5F);        // as bf16 pairs: 0.5 and 0
  }
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
};

struct Probe {
  Block x;  // rows of kRowBytes, contiguous (a packed lane tile)
  std::vector<Packet> packets;
  std::vector<float> gradient;  // the dot probe's output: one sum per packet
};

Probe make_probe(std::int64_t block_bytes, std::uint64_t seed) {
  const std::int64_t rows = std::max<std::int64_t>(1, block_bytes / kRowBytes);
  Probe p{Block(static_cast<std::size_t>(rows * kTokens)), {}};
  std::mt19937_64 rng(seed);
  p.packets.resize(1 << 20);
  for (auto& k : p.packets) k = {static_cast<std::uint32_t>(rng() % rows), 0.001F};
  return p;
}

/// Row `packet.tag` of a block (every probe's rows are kRowBytes, whatever they hold).
template <typename T>
T* row_of(T* block, const Packet& packet) {
  return block +
         static_cast<std::int64_t>(packet.tag) * kRowBytes / static_cast<std::int64_t>(sizeof(T));
}

/// As the engine's kernels do: asks for the rows of the packets 16 ahead of the pair at j
/// (kWrite: to be written).
template <int kWrite, typename T>
void prefetch_pair(T* block, const Packet* k, std::size_t j, std::size_t n) {
  if (j + 18 <= n) {
    __builtin_prefetch(row_of(block, k[j + 16]), kWrite, 3);
    __builtin_prefetch(row_of(block, k[j + 17]), kWrite, 3);
  }
}

__attribute__((target("avx512f"))) float gather_axpy(const Probe& p) {
  __m512 a[4], b[4];
  for (int v = 0; v < 4; ++v) a[v] = b[v] = _mm512_setzero_ps();
  const Packet* k = p.packets.data();
  const float* x = p.x.data();
  const std::size_t n = p.packets.size();
  for (std::size_t j = 0; j + 2 <= n; j += 2) {
    const float* r0 = row_of(x, k[j]);
    const float* r1 = row_of(x, k[j + 1]);
    prefetch_pair<0>(x, k, j, n);
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
  for (std::size_t j = 0; j + 2 <= n; j += 2) {
    const std::uint16_t* r0 = row_of(x, k[j]);
    const std::uint16_t* r1 = row_of(x, k[j + 1]);
    prefetch_pair<0>(x, k, j, n);
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

// The backward-weight step: g[k] += dot(d[0:T], X[i_k, 0:T]) with d in registers; each
// dot is a multiply and three FMAs into 16 partial sums, and eight dots are reduced
// together and added to g at once (add_sums, the engine's kernel's own reduction).
__attribute__((target("avx512f,avx512vl"))) float dot_rows(Probe& p) {
  __m512 d[4];
  for (int v = 0; v < 4; ++v) d[v] = _mm512_set1_ps(0.25F * static_cast<float>(v + 1));
  const Packet* k = p.packets.data();
  const float* x = p.x.data();
  // As the kernel leaves a tile's sums between its first and last tile: added to partials.
  const detail::GradientSums sums{p.gradient.data(), nullptr, false};
  const std::size_t n = p.packets.size();
  for (std::size_t j = 0; j + 8 <= n; j += 8) {
    __m512 part[8];
    for (std::size_t u = 0; u < 8; ++u) {
      if (u % 2 == 0) prefetch_pair<0>(x, k, j + u, n);
      const float* r = row_of(x, k[j + u]);
      const __m512 a =
          _mm512_fmadd_ps(d[1], _mm512_loadu_ps(r + 16), _mm512_mul_ps(d[0], _mm512_loadu_ps(r)));
      const __m512 b = _mm512_fmadd_ps(d[3], _mm512_loadu_ps(r + 48),
                                       _mm512_mul_ps(d[2], _mm512_loadu_ps(r + 32)));
      part[u] = _mm512_add_ps(a, b);
    }
    detail::add_sums(sums, k, static_cast<std::uint32_t>(j), part, 8);
  }
  return p.gradient[0];
}

// The backward-data step: X[i, 0:T] += w * d, a read-modify-write of the row (the engine's
// dX tile) with d in registers. Its rate against the gather's says how much dearer
// scattering a row is than gathering one: the backward pass does one of each per weight
// and token tile (dX and dW), the forward one gather.
__attribute__((target("avx512f"))) float scatter_axpy(Probe& p) {
  __m512 d[4];
  for (int v = 0; v < 4; ++v) d[v] = _mm512_set1_ps(0.25F * static_cast<float>(v + 1));
  const Packet* k = p.packets.data();
  float* x = p.x.data();
  const std::size_t n = p.packets.size();
  for (std::size_t j = 0; j + 2 <= n; j += 2) {
    float* r0 = row_of(x, k[j]);
    float* r1 = row_of(x, k[j + 1]);
    prefetch_pair<1>(x, k, j, n);
    const __m512 w0 = _mm512_set1_ps(k[j].value), w1 = _mm512_set1_ps(k[j + 1].value);
    for (int v = 0; v < 4; ++v) {
      _mm512_storeu_ps(r0 + 16 * v, _mm512_fmadd_ps(w0, d[v], _mm512_loadu_ps(r0 + 16 * v)));
      _mm512_storeu_ps(r1 + 16 * v, _mm512_fmadd_ps(w1, d[v], _mm512_loadu_ps(r1 + 16 * v)));
    }
  }
  return x[0];
}

/// Useful flops of one probe pass: 2 per weight and token.
double probe_flops(const Probe& p, Precision precision) {
  const double tokens = precision == Precision::bf16 ? 2 * kTokens : kTokens;
  return 2.0 * tokens * static_cast<double>(p.packets.size());
}

enum class Step { gather, gather_bf16, scatter, dot };

float run_probe(Probe& p, Step step) {
  switch (step) {
    case Step::gather_bf16:
      return gather_axpy_bf16(p);
    case Step::scatter:
      return scatter_axpy(p);
    case Step::dot:
      return dot_rows(p);
    default:
      return gather_axpy(p);
  }
}

void BM_roofline(benchmark::State& state, Step step) {
  if (!cpu_supports(Isa::avx512)) {
    state.SkipWithError("the probe needs AVX-512");
    return;
  }
  const Precision precision = step == Step::gather_bf16 ? Precision::bf16 : Precision::fp32;
  Probe probe = make_probe(state.range(0), 17 + state.thread_index());
  if (step == Step::dot) probe.gradient.assign(probe.packets.size(), 0.0F);
  for (auto _ : state) benchmark::DoNotOptimize(run_probe(probe, step));
  // Each thread's flops, summed over the threads, times the iterations of all threads:
  // kAvgThreads takes out the second count of the threads, leaving the rate of them all.
  state.counters["GFLOPs"] = benchmark::Counter(
      probe_flops(probe, precision),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kAvgThreads);
  state.counters["block_KiB"] = benchmark::Counter(static_cast<double>(state.range(0)) / 1024,
                                                   benchmark::Counter::kAvgThreads);
}

/// The engine's passes, each to be set against its own probe: the forward gathers rows
/// (gather_roofline), the data gradient scatters them (scatter_roofline), the weight
/// gradient takes dot products with them (dot_roofline). By input, the data gradient
/// gathers dY rows (gather_roofline; in bf16, gather_roofline_bf16: a bf16 layer holds dY
/// in bf16), and both gradients together do twice the arithmetic on the same gathered rows
/// (2 x the gather probe).
enum class Pass {
  forward,
  backward_data,
  backward_weight,
  backward_data_by_input,
  backward_by_input
};

void BM_sluice(benchmark::State& state, Precision precision, Pass pass) {
  if (!cpu_supports(Isa::avx512)) {
    state.SkipWithError("the roofline probe needs AVX-512");
    return;
  }
  const Layer& l = layer(state);
  const Placement placement = placement_for(l);
  const WeightStream& stream = l.weights(precision);
  const WeightStream& by_input = l.backward(precision, StreamOrder::by_input);
  DenseMatrix y(l.w.rows(), l.x.cols()), dx(l.w.cols(), l.x.cols());
  MutableMatrixView dx_view = dx.view();
  for (auto _ : state) {
    switch (pass) {
      case Pass::forward:
        engine().forward(stream, placement, l.x.view(), y.view());
        break;
      case Pass::backward_data:
        engine().backward_data(stream, placement, l.dy.view(), dx_view);
        break;
      case Pass::backward_weight:
        benchmark::DoNotOptimize(
            engine().backward(stream, placement, l.x.view(), l.dy.view(), nullptr));
        break;
      case Pass::backward_data_by_input:
        engine().backward_data(by_input, placement, l.dy.view(), dx_view);
        break;
      case Pass::backward_by_input:
        benchmark::DoNotOptimize(
            engine().backward(by_input, placement, l.x.view(), l.dy.view(), &dx_view));
        break;
    }
  }
  const double products = pass == Pass::backward_by_input ? 2.0 : 1.0;
  const double flops =
      2.0 * products * static_cast<double>(l.w.nnz()) * static_cast<double>(l.x.cols());
  state.counters["useful_GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

/// The default display, plus a note of each benchmark's GFLOP/s by name, so the passes can
/// be set against their probes once everything has run. (A probe timed inside a pass's
/// benchmark measured about half its own run: oneTBB's idle workers spin meanwhile.)
class RecordingReporter final : public benchmark::BenchmarkReporter {
 public:
  explicit RecordingReporter(benchmark::BenchmarkReporter* display) : display_(display) {}
  bool ReportContext(const Context& context) override {
    display_->SetOutputStream(&GetOutputStream());
    display_->SetErrorStream(&GetErrorStream());
    return display_->ReportContext(context);
  }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      // The probes count flops (shown with a G suffix), the passes GFLOPs already.
      for (const auto& [counter, scale] : {std::pair{"GFLOPs", 1e-9}, {"useful_GFLOPs", 1.0}}) {
        const auto c = run.counters.find(counter);
        if (c != run.counters.end() && !run.error_occurred) {
          rates_[run.benchmark_name()] = c->second.value * scale;
        }
      }
    }
    display_->ReportRuns(runs);
  }
  void Finalize() override { display_->Finalize(); }

  /// The GFLOP/s of the first benchmark whose name starts with `prefix` and holds `part`.
  double rate(const std::string& prefix, const std::string& part) const {
    for (const auto& [name, value] : rates_) {
      if (name.rfind(prefix, 0) == 0 && name.find(part) != std::string::npos) return value;
    }
    return 0;
  }

 private:
  benchmark::BenchmarkReporter* display_;  // the library's own, which it keeps for good
  std::map<std::string, double> rates_;
};

/// Each engine pass at 90% against the probe of its own step with a 1 MiB block per core —
/// a lane's tile of 64 fp32 or 128 bf16 tokens of 4096 rows — from this run; and the 99.9%
/// forward against the gather probe from L3 (8 MiB per core): its X and Y (4 MB each) no
/// longer fit the L2s, so its rows come from there.
void print_fractions(const RecordingReporter& r, std::FILE* out) {
  const struct {
    const char* pass;
    const char* probe;
    double times;          ///< flops per gathered element, against the probe's
    bool from_l3 = false;  ///< the 99.9% pass against the 8 MiB probe, else 90% and 1 MiB
  } pairs[] = {{"sluice_forward/", "gather_roofline/", 1},
               {"sluice_forward_bf16/", "gather_roofline_bf16/", 1},
               {"sluice_backward_data/", "scatter_roofline/", 1},
               {"sluice_backward_data_bf16/", "scatter_roofline/", 1},  // its dX work is fp32
               {"sluice_backward_weight/", "dot_roofline/", 1},
               {"sluice_backward_data_by_input/", "gather_roofline/", 1},
               {"sluice_backward_data_by_input_bf16/", "gather_roofline_bf16/", 1},  // dY in bf16
               {"sluice_backward_by_input/", "gather_roofline/", 2},
               {"sluice_backward_by_input_bf16/", "gather_roofline_bf16/", 2},
               {"sluice_forward/", "gather_roofline/", 1, true}};
  std::fprintf(out, "\n%-40s %10s   %-32s %10s %9s\n", "pass (4096x4096x256)", "GFLOP/s",
               "probe (block per core)", "GFLOP/s", "fraction");
  for (const auto& [pass, probe, times, from_l3] : pairs) {
    const double p = r.rate(pass, from_l3 ? "permille:999/" : "permille:900/");
    const double q = times * r.rate(probe, from_l3 ? "/8388608/" : "/1048576/");
    if (p <= 0 || q <= 0) continue;  // filtered out, or skipped
    const std::string pass_name =
        std::string(pass, std::strlen(pass) - 1) + (from_l3 ? " 99.9%" : " 90%");
    const std::string probe_name = (times > 1 ? "2 x " : "") +
                                   std::string(probe, std::strlen(probe) - 1) +
                                   (from_l3 ? " (8 MiB)" : " (1 MiB)");
    std::fprintf(out, "%-40s %10.1f   %-32s %10.1f %8.0f%%\n", pass_name.c_str(), p,
                 probe_name.c_str(), q, 100 * p / q);
  }
}

}  // namespace
}  // namespace sluice::bench

int main(int argc, char** argv) {
  using namespace sluice::bench;
  const int threads = static_cast<int>(engine().threads());
  // L1 (32 KiB), L2 (256 KiB, 512 KiB, 1 MiB), L3 (8 MiB), DRAM (256 MiB) on every core.
  const std::pair<const char*, Step> probes[] = {{"gather_roofline", Step::gather},
                                                 {"gather_roofline_bf16", Step::gather_bf16},
                                                 {"scatter_roofline", Step::scatter},
                                                 {"dot_roofline", Step::dot}};
  for (const auto& [name, step] : probes) {
    for (std::int64_t bytes :
         {32LL << 10, 256LL << 10, 512LL << 10, 1LL << 20, 8LL << 20, 256LL << 20}) {
      benchmark::RegisterBenchmark(name, [step](benchmark::State& s) { BM_roofline(s, step); })
          ->Arg(bytes)
          ->Threads(threads)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  const std::pair<const char*, Pass> passes[] = {
      {"sluice_forward", Pass::forward},
      {"sluice_backward_data", Pass::backward_data},
      {"sluice_backward_weight", Pass::backward_weight},
      {"sluice_backward_data_by_input", Pass::backward_data_by_input},
      {"sluice_backward_by_input", Pass::backward_by_input}};
  for (const auto& [pass_name, pass] : passes) {
    for (const sluice::Precision precision : {sluice::Precision::fp32, sluice::Precision::bf16}) {
      const std::string name =
          std::string(pass_name) + (precision == sluice::Precision::bf16 ? "_bf16" : "");
      auto* bench = benchmark::RegisterBenchmark(
          name.c_str(), [precision, pass](benchmark::State& s) { BM_sluice(s, precision, pass); });
      bench->Args({4096, 4096, 256, 900});
      // The 99.9% forward: bound by gathering from L3, where the 150x target lies.
      if (pass == Pass::forward && precision == sluice::Precision::fp32) {
        bench->Args({4096, 4096, 256, 999});
      }
      bench->ArgNames({"out", "in", "tokens", "sparsity_permille"})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  // The summary goes where the table goes, unless that is JSON or CSV for a program.
  bool machine_format = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    machine_format = machine_format || (arg.rfind("--benchmark_format=", 0) == 0 &&
                                        arg != "--benchmark_format=console");
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RecordingReporter reporter(benchmark::CreateDefaultDisplayReporter());
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_fractions(reporter, machine_format ? stderr : stdout);
  benchmark::Shutdown();
  return 0;
}
