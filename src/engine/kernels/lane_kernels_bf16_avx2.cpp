// AVX2 + FMA lane kernels for bf16 streams: lane_kernels_bf16_body.hpp at 8 fp32 lanes (16
// tokens a block, groups of up to 64). Only the last vector of a group is masked, and
// masked loads and stores are avoided where a vector is whole (they are slow on AMD cores).
#include <immintrin.h>

#include <algorithm>

#include "engine/kernels/lane_kernels_bf16_body.hpp"

namespace sluice::detail {
namespace {

struct Bf16Lanes {
  using Tail = __m256i;
  static constexpr std::uint32_t kStreamAhead = 0;  // the stream is not asked for
  static constexpr bool kPrefetchDy = false;
  static constexpr bool kMaskEveryVector = false;
  /// With one or two blocks each packet of the two in flight gets its own accumulators,
  /// so enough FMA chains run at once; with three or four there are enough chains already
  /// and two sets would not fit sixteen registers.
  static constexpr int forward_sets(int nv) { return nv <= 2 ? 2 : 1; }
  /// A forward row's every line.
  static constexpr std::int64_t forward_row_bytes(int nv) { return 32 * nv; }

  /// Mask of the fp32 lanes in [0, 8) that are < n, for maskload/maskstore.
  static Tail first(std::int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(
        _mm256_set1_epi32(static_cast<int>(std::clamp<std::int64_t>(n, 0, 8))), lanes);
  }
  static __m256 load(const float* in) { return _mm256_loadu_ps(in); }
  static __m256 load(const float* in, Tail tail) { return _mm256_maskload_ps(in, tail); }
  /// The first `n` of in[0, 8), zeros after; reads nothing past them.
  static __m256 load_first(const float* in, std::int64_t n) {
    if (n >= 8) return _mm256_loadu_ps(in);
    if (n <= 0) return _mm256_setzero_ps();
    return _mm256_maskload_ps(in, first(n));
  }
  static void store(float* out, __m256 value) { _mm256_storeu_ps(out, value); }
  static void store(float* out, __m256 value, Tail tail) { _mm256_maskstore_ps(out, tail, value); }
  /// Writes the first `n` lanes of `value` to out[0, 8); touches nothing past them.
  static void store_first(float* out, __m256 value, std::int64_t n) {
    if (n >= 8) {
      _mm256_storeu_ps(out, value);
    } else if (n > 0) {
      _mm256_maskstore_ps(out, first(n), value);
    }
  }
  static __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fold8(__m256 sum) { return sum; }
};

}  // namespace

const Bf16LaneKernels kAvx2Bf16Kernels{forward_groups<Bf16Lanes>, backward_data<Bf16Lanes>,
                                       backward_weight_groups<Bf16Lanes>, pack<Bf16Lanes>};

}  // namespace sluice::detail
