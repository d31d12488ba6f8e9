#pragma once
// The dense baseline every speed-up is measured against: oneDNN's sgemm on the same
// operands with the zeros included. Used by the tool, the benchmarks and the tests;
// not part of the installed library.
#include "sluice/dense.hpp"

namespace sluice::baseline {

/// C = op(A) * op(B), row-major, op = transpose where asked. Shapes are checked.
void dense_sgemm(ConstMatrixView a, bool transpose_a, ConstMatrixView b, bool transpose_b,
                 MutableMatrixView c);

/// Threads oneDNN may use (its OpenMP pool); 0 leaves the default.
void set_dense_threads(int threads);

}  // namespace sluice::baseline
