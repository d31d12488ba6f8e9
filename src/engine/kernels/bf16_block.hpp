#pragma once
// The AVX2 and AVX-512 kernels' bf16 row layout, for the kernel files that read it (the
// bf16 kernels, and the fp32 kernels' backward from a dY held in bf16), written once over
// the vector width of the file that includes it. Internal; include only from files
// compiled for AVX2 or AVX-512 (as the kernel bodies, everything is in an unnamed
// namespace, so no ISA's copy can stand in for another's at link time).
//
// A block of a bf16 row is one vector of W 32-bit words (W = 8 with AVX2, 16 with
// AVX-512) for 2W tokens: word j holds token j in its high half and token W + j in its low
// half. A block's load then gives tokens 0 to W - 1 as fp32 by masking off the low halves
// and tokens W to 2W - 1 by shifting them up, exactly and in order. The words are a GCC
// vector type, so that logic is written with operators, once.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "sluice/stream_packets.hpp"

namespace sluice::detail {
namespace {

#if defined(__AVX512F__)
using Bf16Words = std::uint32_t __attribute__((vector_size(64)));
using Bf16Floats = __m512;
/// `word` in every lane. (Bf16Words{} + word would do, but GCC 12 then masks a packet's
/// word in a general register before broadcasting it, where this way the broadcast and
/// the mask are one AND from memory.)
inline Bf16Words splat(std::uint32_t word) {
  return Bf16Words(_mm512_set1_epi32(static_cast<int>(word)));
}
#else
using Bf16Words = std::uint32_t __attribute__((vector_size(32)));
using Bf16Floats = __m256;
inline Bf16Words splat(std::uint32_t word) {
  return Bf16Words(_mm256_set1_epi32(static_cast<int>(word)));
}
#endif
/// Tokens in a block: two a word.
constexpr int kBlockTokens = static_cast<int>(2 * sizeof(Bf16Words) / sizeof(std::uint32_t));
constexpr std::uint32_t kHighHalves = 0xFFFF'0000U;

inline Bf16Words load_block(const std::uint16_t* row) {
  Bf16Words block;
  std::memcpy(&block, row, sizeof block);
  return block;
}
/// Tokens 0 to W - 1 and W to 2W - 1 of a block, as fp32.
inline Bf16Floats first_half(Bf16Words block) {
  return Bf16Floats(block & kHighHalves);
}
inline Bf16Floats second_half(Bf16Words block) {
  return Bf16Floats(block << 16);
}

/// A packet's weight in every lane: its 32-bit word (value << 16 | index) without the index.
inline Bf16Floats broadcast_weight(const Bf16Packet& p) {
  std::uint32_t word;
  std::memcpy(&word, &p, sizeof word);
  return Bf16Floats(splat(word) & kHighHalves);
}
inline const std::uint16_t* row_of(const std::uint16_t* x, const Bf16Packet& p, std::int64_t xs) {
  return x + static_cast<std::int64_t>(p.index) * xs;
}

/// fp32 -> bf16 rounding to nearest even, NaN kept a (quiet) NaN: the same bits as
/// to_bf16(), in the high half of each word.
inline Bf16Words rounded_high_halves(Bf16Floats values) {
  const auto bits = Bf16Words(values);
  const Bf16Words rounded = bits + 0x7FFFU + ((bits >> 16) & 1U);
  // |bits| > infinity's bits: both sides are below 2^31, so a signed compare is right
  // (AVX2 has no unsigned one).
  using Signed = std::int32_t __attribute__((vector_size(sizeof(Bf16Words))));
  const auto nan = Bf16Words(Signed(bits & 0x7FFF'FFFFU) > 0x7F80'0000);
  const Bf16Words quiet = bits | 0x0040'0000U;
  return ((quiet & nan) | (rounded & ~nan)) & kHighHalves;
}

}  // namespace
}  // namespace sluice::detail
