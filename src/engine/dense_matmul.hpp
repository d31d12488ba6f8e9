#pragma once
// oneDNN's matmul, set up once for one problem and run on caller's buffers: the dense
// kernel of the engine's dense path and of the dense baselines. In bf16 it runs on AMX
// or AVX512-BF16 where the CPU has them (oneDNN picks the kernel).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "sluice/path_cost.hpp"

namespace sluice::detail {

enum class DenseType { f32, bf16 };

/// C = op(A) op(B): A is m x k (stored k x m when `transpose_a`), B is k x n (stored n x k
/// when `transpose_b`), both of `type`, row-major with the given row strides; C is m x n
/// fp32 with row stride ldc, overwritten.
///
/// With `packed_b`, run() takes B in the layout this kernel reads it in (pack_b writes it
/// from B as described): a B multiplied by many A's (the dense path's tiles) is then
/// reordered once, not in every run.
class DenseMatmul {
 public:
  DenseMatmul(DenseType type, std::int64_t m, std::int64_t n, std::int64_t k, bool transpose_a,
              std::int64_t lda, bool transpose_b, std::int64_t ldb, std::int64_t ldc,
              bool packed_b = false);
  ~DenseMatmul();
  DenseMatmul(DenseMatmul&&) noexcept;
  DenseMatmul& operator=(DenseMatmul&&) noexcept;

  /// Runs on `threads` OpenMP threads (0: oneDNN's default); the caller's OpenMP setting
  /// is restored after.
  void run(const void* a, const void* b, float* c, int threads = 0) const;
  /// Whether this matmul reads a packed B as `other` packs it (the same B, other A's).
  bool packs_b_as(const DenseMatmul& other) const;
  /// m, the rows of A and C.
  std::int64_t rows() const;
  /// Bytes of B in the packed layout (packed_b only).
  std::size_t packed_b_bytes() const;
  /// Rows [first, last) of B (of its k), stored as the constructor says but in fp32 where
  /// `b_f32` (rounded as they are packed), into `packed` (packed_b_bytes(), 64-byte
  /// aligned), on the calling thread. `first` is a multiple of kPackRows; rows apart go
  /// to disjoint bytes, so tasks can pack a B in parts at once (without an OpenMP team).
  void pack_b(const void* b, bool b_f32, void* packed, std::int64_t first, std::int64_t last) const;
  /// k, the rows of B.
  std::int64_t inner() const;
  /// Parts of B packed apart start at multiples of this many rows (every blocking oneDNN
  /// picks for B divides it).
  static constexpr std::int64_t kPackRows = 64;
  /// The kernel oneDNN chose (e.g. "brg:avx512_core_amx"), for reports.
  std::string implementation() const;

  /// What multiplies bf16 on this CPU as oneDNN finds it (AMX, AVX512-BF16, or neither:
  /// there oneDNN emulates bf16, slower than f32).
  static Bf16Unit bf16_unit();
  /// Whether this CPU multiplies bf16 in hardware (AMX or AVX512-BF16).
  static bool bf16_native() { return bf16_unit() != Bf16Unit::none; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sluice::detail
