// Forward: the streamed sparse product (fp32 and bf16) vs oneDNN's dense products with the
// zeros included, over the shapes and sparsities. Counters: useful GFLOP/s (2 nnz
// tokens / time), acceleration over oneDNN's matmul of the same precision and over the
// fastest dense of any (acceleration_vs_best; the label names it), both measured in this run.
#include "bench_common.hpp"
#include "sluice/planner.hpp"

namespace sluice::bench {
namespace {

void BM_sparse_forward(benchmark::State& state, Precision precision) {
  const Layer& l = layer(state);
  CpuEngine& e = engine();
  const Placement placement = placement_for(l);
  time_sparse_forward(state, l, placement, precision);
  DenseMatrix y(l.w.rows(), l.x.cols());
  // The engine first: oneDNN's OpenMP threads spin on after each call and would slow it.
  const double sparse_s =
      median_seconds([&] { e.forward(l.weights(precision), placement, l.x.view(), y.view()); });
  const baseline::DenseTiming dense =
      baseline::time_dense({{l.w_dense.view(), false, l.x.view(), false, y.view()}}, precision, 5);
  set_dense_counters(state, dense, sparse_s);
  state.counters["balance"] = placement.balance();
}

void BM_dense_forward(benchmark::State& state) {
  const Layer& l = layer(state);
  DenseMatrix y(l.w.rows(), l.x.cols());
  for (auto _ : state) {
    baseline::dense_sgemm(l.w_dense.view(), false, l.x.view(), false, y.view());
  }
  const double flops = 2.0 * l.w.rows() * l.w.cols() * static_cast<double>(l.x.cols());
  state.counters["GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace
}  // namespace sluice::bench

int main(int argc, char** argv) {
  using namespace sluice::bench;
  register_sweep("sparse_forward",
                 [](benchmark::State& s) { BM_sparse_forward(s, sluice::Precision::fp32); });
  register_sweep("sparse_forward_bf16",
                 [](benchmark::State& s) { BM_sparse_forward(s, sluice::Precision::bf16); });
  register_sweep("dense_forward", BM_dense_forward);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
