#pragma once
// Precision of a layer's weight stream and resident activations. bfloat16 keeps fp32's
// sign and exponent and the top 7 mantissa bits, so it halves the bytes a layer streams
// and gathers while covering fp32's range; sluice always accumulates in fp32.
#include <bit>
#include <cstdint>
#include <string>

namespace sluice {

enum class Precision : std::uint32_t { fp32 = 1, bf16 = 2 };

const char* to_string(Precision precision);
/// Parses "fp32" or "bf16"; throws ArgumentError otherwise.
Precision parse_precision(const std::string& name);

/// fp32 -> bf16, rounding to nearest even. Infinities stay infinite, NaN stays NaN;
/// finite values beyond bf16's largest round to infinity, as IEEE rounding does.
constexpr std::uint16_t to_bf16(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7FFF'FFFFU) > 0x7F80'0000U) {  // NaN: keep it quiet and a NaN
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040U);
  }
  const std::uint32_t rounding = 0x7FFFU + ((bits >> 16) & 1U);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

/// bf16 -> fp32 (exact).
constexpr float from_bf16(std::uint16_t value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value) << 16);
}

/// The fp32 value nearest to `value` that bf16 can hold.
constexpr float round_to_bf16(float value) {
  return from_bf16(to_bf16(value));
}

}  // namespace sluice
