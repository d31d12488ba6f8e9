#include "sluice/kernels.hpp"

#include <mutex>

#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/stream.hpp"

namespace sluice {
namespace {

// One engine for the whole process: its arena and kernels are set up once. Calls are
// serialised; a program that wants concurrent products makes a CpuEngine per thread.
CpuEngine& shared_engine(std::unique_lock<std::mutex>& lock) {
  static std::mutex mutex;
  static CpuEngine engine;
  lock = std::unique_lock(mutex);
  return engine;
}

Placement placement_for(const CsrMatrix& w, const Engine& engine, std::int64_t tokens) {
  const Geometry g = engine.geometry_for(w.rows(), w.cols(), tokens);
  // One lane owns everything: no need to count columns.
  if (g.lanes == 1) return Placement::single_lane(w.cols(), w.nnz());
  return round_robin_placement(w, g.lanes);
}

/// Runs product(engine, stream, placement) on the shared engine, `w` encoded as a stream of
/// `kind` and placed for `tokens`.
template <typename Product>
auto on_shared_engine(const CsrMatrix& w, StreamKind kind, std::int64_t tokens, Product&& product) {
  std::unique_lock<std::mutex> lock;
  CpuEngine& engine = shared_engine(lock);
  const WeightStream stream = encode_stream(w, kind);
  return product(engine, stream, placement_for(w, engine, tokens));
}

}  // namespace

void spmm(const CsrMatrix& w, ConstMatrixView x, MutableMatrixView y) {
  on_shared_engine(w, StreamKind::weights, x.cols,
                   [&](CpuEngine& engine, const WeightStream& stream, const Placement& placement) {
                     engine.forward(stream, placement, x, y);
                   });
}

DenseMatrix spmm(const CsrMatrix& w, ConstMatrixView x) {
  DenseMatrix y(w.rows(), x.cols);
  spmm(w, x, y.view());
  return y;
}

void spmm_t(const CsrMatrix& w, ConstMatrixView dy, MutableMatrixView dx) {
  on_shared_engine(w, StreamKind::weights, dy.cols,
                   [&](CpuEngine& engine, const WeightStream& stream, const Placement& placement) {
                     engine.backward_data(stream, placement, dy, dx);
                   });
}

DenseMatrix spmm_t(const CsrMatrix& w, ConstMatrixView dy) {
  DenseMatrix dx(w.cols(), dy.cols);
  spmm_t(w, dy, dx.view());
  return dx;
}

std::vector<float> sddmm(const CsrMatrix& mask, ConstMatrixView dy, ConstMatrixView x) {
  const WeightStream grad = on_shared_engine(
      mask, StreamKind::mask, x.cols,
      [&](CpuEngine& engine, const WeightStream& stream, const Placement& placement) {
        return engine.backward(stream, placement, x, dy, nullptr);
      });
  std::vector<float> values;
  values.reserve(mask.nnz());
  for (const ChunkPtr& chunk : grad.chunks) {
    for (const Packet& p : chunk->packets) {
      if (!is_control(p)) values.push_back(p.value);
    }
  }
  return values;
}

}  // namespace sluice
