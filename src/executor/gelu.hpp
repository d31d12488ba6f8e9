#pragma once
// GELU in its tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), and its
// slope: one formula for every place that applies it (the transformer blocks and the MLP
// engines' Activation::gelu). Internal.
//
// In float, without a call to a math library, so a loop over a row of tokens vectorises:
// a scalar double std::tanh per element bound a GPT step. The same function written without
// tanh: with u = sqrt(2/pi) (x + 0.044715 x^3) and s = 1 / (1 + e^(-2u)),
//   0.5 (1 + tanh u) = s          (so gelu(x) = x s, no cancellation for x << 0),
//   1 - tanh^2 u = 4 s (1 - s),   1 - s = e^(-2u) s   (exact, no cancellation for s near 1),
// and e^y from a Cody-Waite reduction and Cephes' degree-6 polynomial, a few ulp in float.
// tests/test_gelu.cpp states the error against the double formula over a dense range.
#include <algorithm>
#include <bit>
#include <cstdint>

namespace sluice::detail {

inline constexpr float kGeluC = 0.7978845608028654F;  // sqrt(2 / pi)
inline constexpr float kGeluA = 0.044715F;

/// e^y for y clamped to [-80, 80], where e^y and everything GELU makes of it stay normal
/// floats (subnormals are slow in vector units). A NaN stays NaN.
inline float exp_bounded(float y) {
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

/// s = 1 / (1 + e^(-2u)) and e = e^(-2u) at x. Beyond |x| = 20 GELU is x or 0 and its slope
/// 1 or 0 to float precision; clamping there keeps x^3 and x^2 finite for any float x.
struct GeluTerms {
  float s, e;
};
inline GeluTerms gelu_terms(float x) {
  const float u = kGeluC * (x + kGeluA * x * x * x);
  const float e = exp_bounded(-2.0F * u);
  return {1.0F / (1.0F + e), e};
}
inline float gelu_clamp(float x) {
  x = x < -20.0F ? -20.0F : x;
  return x > 20.0F ? 20.0F : x;
}

inline float gelu(float x) {
  return x * gelu_terms(gelu_clamp(x)).s;
}

inline float gelu_slope(float x) {
  const float xc = gelu_clamp(x);
  const GeluTerms t = gelu_terms(xc);
  // 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx
  return t.s + 2.0F * xc * t.s * (t.e * t.s) * kGeluC * (1.0F + 3.0F * kGeluA * xc * xc);
}

}  // namespace sluice::detail
