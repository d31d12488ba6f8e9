#pragma once
// The products alone, for trainers that bring their own loop. Each call streams W
// through a shared CpuEngine (all cores, automatic geometry), so the results are the
// engine's results. Dense operands are row-major features x tokens.
#include "sluice/csr_matrix.hpp"
#include "sluice/dense.hpp"

namespace sluice {

/// Y = W X. W: out x in, X: in x tokens, Y: out x tokens (overwritten).
void spmm(const CsrMatrix& w, ConstMatrixView x, MutableMatrixView y);
DenseMatrix spmm(const CsrMatrix& w, ConstMatrixView x);

/// dX = W^T dY. dY: out x tokens, dX: in x tokens (overwritten).
void spmm_t(const CsrMatrix& w, ConstMatrixView dy, MutableMatrixView dx);
DenseMatrix spmm_t(const CsrMatrix& w, ConstMatrixView dy);

/// Weight gradient at the mask's positions: dW[k] = dot(dY[o,:], X[i,:]) for the k-th
/// non-zero (o, i) of `mask`, in CSR order. Values of `mask` are not used.
std::vector<float> sddmm(const CsrMatrix& mask, ConstMatrixView dy, ConstMatrixView x);

}  // namespace sluice
