#pragma once
// The engine's dense path (docs/dense_path.md): where a layer is faster multiplied dense,
// the packets that arrive are scattered into dense tiles of the stream's matrix, a few
// dozen rows at a time, and each tile is multiplied by oneDNN's matmul (AMX in bf16 where
// the CPU has it) while it is in cache. The stream stays sparse on the wire and is checked
// as the sparse path checks it; the weight gradient leaves as the same gradient stream.
//
// The stream's matrix M is W (a stream by output) or W^T (by input). Row products take M
// tile by tile: Y = M X forward, dX = M dY by input; so does the weight gradient at the
// mask positions, G = A B^T with (A, B) = (dY, X) by output and (X, dY) by input. By
// output, dX = M^T dY sums over every row of M: M is densified whole, then multiplied by
// slices of its columns. Every matmul runs on one engine thread (no OpenMP team).
#include <oneapi/tbb/task_arena.h>

#include "sluice/dense.hpp"
#include "sluice/engine.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

class DensePath {
 public:
  explicit DensePath(tbb::task_arena& arena) : arena_(arena) {}

  /// Y = W X from a stream by output (as Engine::forward; FormatError on a corrupt stream).
  void forward(StreamSource& weights, ConstMatrixView x, MutableMatrixView y,
               EngineCounters& counters);
  /// As Engine::backward_impl: dX where `dx` is given, the gradient stream where `x` is.
  WeightStream backward(StreamSource& weights, const ConstMatrixView* x, ConstMatrixView dy,
                        MutableMatrixView* dx, EngineCounters& counters);

 private:
  tbb::task_arena& arena_;
};

}  // namespace sluice::detail
