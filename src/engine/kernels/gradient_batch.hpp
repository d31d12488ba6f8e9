#pragma once
// Batched horizontal sums for the weight-gradient kernels: one 8-float partial dot
// product per weight, reduced eight weights at a time and left as GradientSums say.
// Internal; AVX intrinsics only, so both the AVX2 and the AVX-512 kernel files include it.
#include <immintrin.h>

#include <cstdint>

#include "engine/kernels/lane_kernels.hpp"

namespace sluice::detail {

/// Horizontal sums of eight vectors at once: [sum(v0), ..., sum(v7)]. Reducing eight
/// together costs about a third of reducing each alone, and the weight gradient needs
/// one reduction per non-zero per tile.
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/// The tags of packets[0, 8) in the even floats of two ymm (the odd ones are to be
/// replaced): an fp32 stream's packets as they are, a bf16 stream's indices widened.
inline void tags8(const Packet* packets, __m256* tags) {
  const auto* words = reinterpret_cast<const float*>(packets);
  tags[0] = _mm256_loadu_ps(words);
  tags[1] = _mm256_loadu_ps(words + 8);
}
inline void tags8(const Bf16Packet* packets, __m256* tags) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packets));
  const __m256i index = _mm256_and_si256(words, _mm256_set1_epi32(0xFFFF));
  tags[0] = _mm256_castsi256_ps(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(index)));
  tags[1] = _mm256_castsi256_ps(_mm256_cvtepu32_epi64(_mm256_extracti128_si256(index, 1)));
}

/// Leaves the sums of packets k, ..., k + 7 as `g` says, as leave_sum does for each. Sent
/// out, each total is blended in beside its packet's tag: the tags are never computed on.
template <typename PacketT>
inline void leave_sums8(const GradientSums& g, const PacketT* packets, std::uint32_t k,
                        __m256 sums) {
  if (!g.first) sums = _mm256_add_ps(_mm256_loadu_ps(g.partial + k), sums);
  if (g.out == nullptr) {
    _mm256_storeu_ps(g.partial + k, sums);
    return;
  }
  const __m256 lo = _mm256_unpacklo_ps(sums, sums);  // s0 s0 s1 s1 | s4 s4 s5 s5
  const __m256 hi = _mm256_unpackhi_ps(sums, sums);  // s2 s2 s3 s3 | s6 s6 s7 s7
  __m256 tags[2];
  tags8(packets + k, tags);
  auto* out = reinterpret_cast<float*>(g.out + k);
  _mm256_storeu_ps(out, _mm256_blend_ps(tags[0], _mm256_permute2f128_ps(lo, hi, 0x20), 0xAA));
  _mm256_storeu_ps(out + 8, _mm256_blend_ps(tags[1], _mm256_permute2f128_ps(lo, hi, 0x31), 0xAA));
}

/// Collects per-weight partial dot products and leaves their sums eight at a time.
template <typename PacketT>
class GradientBatch {
 public:
  GradientBatch(const GradientSums& g, const PacketT* packets) : g_(g), packets_(packets) {}
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
      leave_sums8(g_, packets_, target_[0], sums);
    } else {
      alignas(32) float each[8];
      _mm256_store_ps(each, sums);
      for (int j = 0; j < n_; ++j) leave_sum(g_, packets_, target_[j], each[j]);
    }
    n_ = 0;
  }

 private:
  GradientSums g_;
  const PacketT* packets_;
  __m256 pending_[8];
  std::uint32_t target_[8];
  int n_ = 0;
};

}  // namespace sluice::detail
