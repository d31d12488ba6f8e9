#pragma once
// e^y in float without a call to a math library, so that a loop applying it vectorises:
// a Cody-Waite reduction and Cephes' degree-6 polynomial, under one ulp in float
// (tests/test_gelu.cpp). Its users: GELU (executor/gelu.hpp) and the attention's softmax.
// The files whose loops call it are compiled with -fno-trapping-math (CMakeLists.txt):
// under GCC 12's default the clamps below followed by float arithmetic stay branches.
// Always inlined, so a file compiled for an ISA (blocks/block_kernels_body.hpp) keeps its
// own copy. Internal.
#include <bit>
#include <cstdint>

namespace sluice::detail {

/// e^y for y clamped to [-80, 80], where e^y and everything GELU makes of it stay normal
/// floats (subnormals are slow in vector units). A NaN stays NaN.
[[gnu::always_inline]] inline float exp_bounded(float y) {
  y = y < -80.0F ? -80.0F : y;  // (ternaries on values: std::min and max kept GCC 12 from
  y = y > 80.0F ? 80.0F : y;    // vectorising)
  // n = round(y / ln 2) by the 1.5 * 2^23 trick: exact and branch-free in round-to-nearest.
  constexpr float kShift = 12582912.0F;
  const float shifted = y * 1.44269504088896341F + kShift;
  const float n = shifted - kShift;
  const std::int32_t n_int =
      std::bit_cast<std::int32_t>(shifted) - std::bit_cast<std::int32_t>(kShift);
  // r = y - n ln 2 in two steps (ln 2's high part has few bits, so n * it is exact).
  const float r = (y - n * 0.693359375F) - n * -2.12194440e-4F;
  float p = 1.9875691500e-4F;
  p = p * r + 1.3981999507e-3F;
  p = p * r + 8.3334519073e-3F;
  p = p * r + 4.1665795894e-2F;
  p = p * r + 1.6666665459e-1F;
  p = p * r + 5.0000001201e-1F;
  const float e_r = p * r * r + r + 1.0F;
  return e_r * std::bit_cast<float>((n_int + 127) << 23);  // |n| <= 116: a normal 2^n
}

}  // namespace sluice::detail
