// Uses an installed sluice: one streamed sparse product checked against a plain loop,
// and one training step. Exits non-zero on any failure.
#include <cmath>
#include <cstdio>
#include <exception>

#include "sluice/csr_matrix.hpp"
#include "sluice/engine.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

int main() {
  using namespace sluice;
  try {
    const CsrMatrix w = CsrMatrix::random(32, 48, 0.9, 1);
    DenseMatrix x(48, 20), y(32, 20);
    for (std::int64_t i = 0; i < 48; ++i)
      for (std::int64_t t = 0; t < 20; ++t) x(i, t) = static_cast<float>((i * 7 + t) % 11) - 5;
    CpuEngine engine;
    const Geometry g = engine.geometry_for(32, 48, 20);
    engine.forward(encode_stream(w), round_robin_placement(w, g.lanes), x.view(), y.view());
    for (std::int64_t o = 0; o < 32; ++o) {
      for (std::int64_t t = 0; t < 20; ++t) {
        double want = 0;
        for (auto k = w.row_offsets()[o]; k < w.row_offsets()[o + 1]; ++k)
          want += w.values()[k] * x(w.col_indices()[k], t);
        if (std::abs(y(o, t) - want) > 1e-4 * (1 + std::abs(want))) {
          std::fprintf(stderr, "spmm mismatch at %lld,%lld\n", static_cast<long long>(o),
                       static_cast<long long>(t));
          return 1;
        }
      }
    }
    HostModelMemory memory;
    build_sparse_mlp(memory, {48, 16, 4}, 0.5, 2);
    LocalFabric fabric;
    LayerStreamingExecutor executor(memory, fabric);
    Batch batch{x.view(), std::vector<int>(20, 1), {}};
    const StepResult r = executor.train_step(batch);
    if (!r.report.applied || !std::isfinite(r.loss) || memory.step() != 1) {
      std::fprintf(stderr, "training step failed\n");
      return 1;
    }
    std::printf("consumer ok: loss %.4f\n", r.loss);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
