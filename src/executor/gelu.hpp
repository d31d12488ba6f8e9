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
// and e^y by core/exp_bounded.hpp.
// tests/test_gelu.cpp states the error against the double formula over a dense range.
#include "core/exp_bounded.hpp"

namespace sluice::detail {

inline constexpr float kGeluC = 0.7978845608028654F;  // sqrt(2 / pi)
inline constexpr float kGeluA = 0.044715F;

/// s = 1 / (1 + e^(-2u)) and e = e^(-2u) at x. Beyond |x| = 20 GELU is x or 0 and its slope
/// 1 or 0 to float precision; clamping there keeps x^3 and x^2 finite for any float x.
struct GeluTerms {
  float s, e;
};
[[gnu::always_inline]] inline GeluTerms gelu_terms(float x) {
  const float u = kGeluC * (x + kGeluA * x * x * x);
  const float e = exp_bounded(-2.0F * u);
  return {1.0F / (1.0F + e), e};
}
[[gnu::always_inline]] inline float gelu_clamp(float x) {
  x = x < -20.0F ? -20.0F : x;
  return x > 20.0F ? 20.0F : x;
}

[[gnu::always_inline]] inline float gelu(float x) {
  return x * gelu_terms(gelu_clamp(x)).s;
}

[[gnu::always_inline]] inline float gelu_slope(float x) {
  const float xc = gelu_clamp(x);
  const GeluTerms t = gelu_terms(xc);
  // 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx
  return t.s + 2.0F * xc * t.s * (t.e * t.s) * kGeluC * (1.0F + 3.0F * kGeluA * xc * xc);
}

}  // namespace sluice::detail
