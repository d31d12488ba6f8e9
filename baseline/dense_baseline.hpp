#pragma once
// The dense baselines every speed-up is measured against, on the same operands with the
// zeros included: oneDNN's sgemm, and oneDNN's matmul in f32 and in bf16 (on AMX or
// AVX512-BF16 where the CPU has them). Used by the tool, the benchmarks and the tests;
// not part of the installed library.
#include <memory>
#include <string>
#include <vector>

#include "sluice/bf16.hpp"
#include "sluice/dense.hpp"

namespace sluice::baseline {

/// C = op(A) * op(B), row-major, op = transpose where asked. Shapes are checked.
void dense_sgemm(ConstMatrixView a, bool transpose_a, ConstMatrixView b, bool transpose_b,
                 MutableMatrixView c);

/// Threads oneDNN may use (its OpenMP pool); 0 leaves the default.
void set_dense_threads(int threads);

enum class DenseKind { sgemm_f32, matmul_f32, matmul_bf16 };
/// "onednn_sgemm_f32", "onednn_matmul_f32", "onednn_matmul_bf16": the JSON's
/// `dense_best_kind`.
const char* to_string(DenseKind kind);

/// The dense products worth timing on this CPU: sgemm and matmul in f32, and matmul in
/// bf16 where the CPU multiplies bf16 in hardware (elsewhere oneDNN emulates it, and no
/// user would pick it).
std::vector<DenseKind> dense_kinds();
/// The dense product of a sparse product's precision: f32 matmul for fp32; bf16 matmul
/// for bf16 (f32 matmul where the CPU has no bf16 arithmetic).
DenseKind same_precision_kind(Precision precision);

/// One dense product op(A) op(B) of `kind`, set up once with its operands copied into
/// the kind's precision (a dense bf16 user holds weights and activations in bf16, so the
/// conversion is not part of the product); `run` is what is timed.
class DenseProduct {
 public:
  DenseProduct(DenseKind kind, ConstMatrixView a, bool transpose_a, ConstMatrixView b,
               bool transpose_b);
  ~DenseProduct();
  DenseProduct(DenseProduct&&) noexcept;
  void run(MutableMatrixView c) const;
  /// oneDNN's kernel ("brg:avx512_core_amx", ...; "gemm" for sgemm).
  std::string implementation() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The operands of one dense product, C = op(A) op(B) (C is where it is written).
struct DenseOperands {
  ConstMatrixView a;
  bool transpose_a = false;
  ConstMatrixView b;
  bool transpose_b = false;
  MutableMatrixView c;
};

/// Median times (ms) of the dense baselines of a sparse product of `precision`: the
/// same-precision kind and the fastest of dense_kinds(). A forward is one product, a
/// backward two (dX and dW); each kind runs all of them per timed call.
struct DenseTiming {
  double same_ms = 0;
  DenseKind same_kind = DenseKind::matmul_f32;
  double best_ms = 0;
  DenseKind best_kind = DenseKind::matmul_f32;
};
DenseTiming time_dense(const std::vector<DenseOperands>& products, Precision precision, int repeat);

}  // namespace sluice::baseline
