// Backward: dX = W^T dY and dW = dY X^T at the mask, streamed, vs oneDNN dense for both
// products (same precision, and the fastest of any), in fp32 and bf16; the layer streamed by input
// (one pass, dY gathered once for both gradients, as training streams it) and by output (the
// wafer's order: dX scattered, then a pass for dW). Counters: useful GFLOP/s (4 nnz tokens / time),
// acceleration over dense, and backward / forward time in the same precision.
#include "bench_common.hpp"
#include "sluice/planner.hpp"

namespace sluice::bench {
namespace {

void BM_sparse_backward(benchmark::State& state, Precision precision, StreamOrder order) {
  const Layer& l = layer(state);
  const WeightStream& stream = l.backward(precision, order);
  CpuEngine& e = engine();
  const Placement placement = placement_for(l);
  DenseMatrix dx(l.w.cols(), l.x.cols());
  MutableMatrixView dx_view = dx.view();
  auto step = [&] {
    benchmark::DoNotOptimize(e.backward(stream, placement, l.x.view(), l.dy.view(), &dx_view));
  };
  for (auto _ : state) step();
  const double flops = 4.0 * static_cast<double>(l.w.nnz()) * static_cast<double>(l.x.cols());
  state.counters["useful_GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  // The engine first: oneDNN's OpenMP threads spin on after each call and would slow it.
  DenseMatrix y(l.w.rows(), l.x.cols());
  const double forward =
      median_seconds([&] { e.forward(l.weights(precision), placement, l.x.view(), y.view()); });
  const double backward = median_seconds(step);
  DenseMatrix dx_dense(l.w.cols(), l.x.cols()), dw_dense(l.w.rows(), l.w.cols());
  const baseline::DenseTiming dense =
      baseline::time_dense({{l.w_dense.view(), true, l.dy.view(), false, dx_dense.view()},
                            {l.dy.view(), false, l.x.view(), true, dw_dense.view()}},
                           precision, 5);
  set_dense_counters(state, dense, backward);
  state.counters["backward_over_forward"] = backward / forward;
}

}  // namespace
}  // namespace sluice::bench

int main(int argc, char** argv) {
  using namespace sluice::bench;
  using sluice::Precision;
  using sluice::StreamOrder;
  register_sweep("sparse_backward", [](benchmark::State& s) {
    BM_sparse_backward(s, Precision::fp32, StreamOrder::by_input);
  });
  register_sweep("sparse_backward_bf16", [](benchmark::State& s) {
    BM_sparse_backward(s, Precision::bf16, StreamOrder::by_input);
  });
  register_sweep("sparse_backward_by_output", [](benchmark::State& s) {
    BM_sparse_backward(s, Precision::fp32, StreamOrder::by_output);
  });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
