#pragma once
// Shared set-up for the benchmark suites: the shapes and sparsities of the issue, cached
// operands, and the dense baseline time measured in the same run.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "dense_baseline.hpp"
#include "reference.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/engine.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace sluice::bench {

inline const std::vector<double> kSparsities = {0, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.999};
inline const std::vector<std::vector<std::int64_t>> kShapes = {
    {4096, 4096, 256}, {1024, 1024, 64}, {8192, 2048, 128}};

/// Registers fn over every shape x sparsity; args are out, in, tokens, sparsity x 1000.
template <typename Fn>
void register_sweep(const char* name, Fn fn) {
  for (const auto& shape : kShapes) {
    for (double s : kSparsities) {
      benchmark::RegisterBenchmark(name, fn)
          ->Args({shape[0], shape[1], shape[2], static_cast<std::int64_t>(s * 1000 + 0.5)})
          ->ArgNames({"out", "in", "tokens", "sparsity_permille"})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
}

struct Layer {
  CsrMatrix w;
  DenseMatrix w_dense, x, dy;
  WeightStream stream, mask;
  WeightStream stream_bf16;              ///< the same weights streamed in bf16
  WeightStream by_input, by_input_bf16;  ///< the layer's transpose, for the backward

  const WeightStream& weights(Precision precision) const {
    return precision == Precision::bf16 ? stream_bf16 : stream;
  }
  const WeightStream& backward(Precision precision, StreamOrder order) const {
    if (order == StreamOrder::by_output) return weights(precision);
    return precision == Precision::bf16 ? by_input_bf16 : by_input;
  }
};

/// Operands for (out, in, tokens, sparsity), built once per process.
inline const Layer& layer(const benchmark::State& state) {
  static std::map<std::vector<std::int64_t>, std::unique_ptr<Layer>> cache;
  const std::vector<std::int64_t> key = {state.range(0), state.range(1), state.range(2),
                                         state.range(3)};
  auto& slot = cache[key];
  if (!slot) {
    slot = std::make_unique<Layer>();
    slot->w = CsrMatrix::random(key[0], key[1], key[3] / 1000.0, 42);
    slot->w_dense = slot->w.to_dense();
    slot->x = testing::random_dense(key[1], key[2], 43);
    slot->dy = testing::random_dense(key[0], key[2], 44);
    slot->stream = encode_stream(slot->w);
    slot->mask = encode_stream(slot->w, StreamKind::mask);
    slot->stream_bf16 =
        encode_stream(slot->w, StreamKind::weights, kDefaultChunkPackets, Precision::bf16);
    slot->by_input = encode_stream(slot->w, StreamKind::weights, kDefaultChunkPackets,
                                   Precision::fp32, StreamOrder::by_input);
    slot->by_input_bf16 = encode_stream(slot->w, StreamKind::weights, kDefaultChunkPackets,
                                        Precision::bf16, StreamOrder::by_input);
  }
  return *slot;
}

/// Median seconds of fn over a few runs (after a warm-up): the in-run baseline.
template <typename Fn>
double median_seconds(Fn&& fn, int repeats = 5) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

inline CpuEngine& engine() {
  static CpuEngine instance;
  return instance;
}

/// The layer's placement for the shared engine's geometry.
inline Placement placement_for(const Layer& l) {
  return round_robin_placement(l.w,
                               engine().geometry_for(l.w.rows(), l.w.cols(), l.x.cols()).lanes);
}

/// Times the streamed forward of the benchmark's layer and sets its useful GFLOP/s.
inline void time_sparse_forward(benchmark::State& state, const Layer& l, const Placement& placement,
                                Precision precision = Precision::fp32) {
  DenseMatrix y(l.w.rows(), l.x.cols());
  const WeightStream& stream = l.weights(precision);
  for (auto _ : state) engine().forward(stream, placement, l.x.view(), y.view());
  const double flops = 2.0 * static_cast<double>(l.w.nnz()) * static_cast<double>(l.x.cols());
  state.counters["useful_GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

/// The dense baselines' counters of a sparse product that took `sparse_seconds`: dense_ms
/// and acceleration against oneDNN's matmul of the same precision, dense_best_ms and
/// acceleration_vs_best against the fastest dense of any (named in the label).
inline void set_dense_counters(benchmark::State& state, const baseline::DenseTiming& dense,
                               double sparse_seconds) {
  state.counters["dense_ms"] = dense.same_ms;
  state.counters["acceleration"] = dense.same_ms * 1e-3 / sparse_seconds;
  state.counters["dense_best_ms"] = dense.best_ms;
  state.counters["acceleration_vs_best"] = dense.best_ms * 1e-3 / sparse_seconds;
  state.SetLabel(std::string("best dense: ") + baseline::to_string(dense.best_kind));
}

}  // namespace sluice::bench
