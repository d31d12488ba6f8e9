#pragma once
// Batched horizontal sums for the weight-gradient kernels: one 8-float partial dot
// product per weight, reduced eight weights at a time. Internal; AVX intrinsics only, so
// both the AVX2 and the AVX-512 kernel files include it.
#include <immintrin.h>

#include <cstdint>

namespace sluice::detail {

/// Horizontal sums of eight vectors at once: [sum(v0), ..., sum(v7)]. Reducing eight
/// together costs about a third of reducing each alone, and the weight gradient needs
/// one reduction per non-zero per tile.
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/// Collects per-weight partial dot products and adds their sums to the gradient eight
/// at a time.
class GradientBatch {
 public:
  explicit GradientBatch(float* grad) : grad_(grad) {}
  void add(std::uint32_t k, __m256 partial) {
    pending_[n_] = partial;
    target_[n_++] = k;
    if (n_ == 8) flush();
  }
  void flush() {
    if (n_ == 0) return;
    for (int j = n_; j < 8; ++j) pending_[j] = _mm256_setzero_ps();
    const __m256 sums = hsum8(pending_);
    if (n_ == 8 && target_[7] == target_[0] + 7) {  // the usual case: eight in a row
      float* g = grad_ + target_[0];
      _mm256_storeu_ps(g, _mm256_add_ps(_mm256_loadu_ps(g), sums));
    } else {
      alignas(32) float each[8];
      _mm256_store_ps(each, sums);
      for (int j = 0; j < n_; ++j) grad_[target_[j]] += each[j];
    }
    n_ = 0;
  }

 private:
  float* grad_;
  __m256 pending_[8];
  std::uint32_t target_[8];
  int n_ = 0;
};

}  // namespace sluice::detail
