#include "core/crc32.hpp"

#include <array>
#include <bit>
#include <cstring>

namespace sluice {
namespace {

// Slicing-by-8: eight tables let the loop fold eight bytes per step instead of one, so
// the checksum keeps up with the disk on multi-GB checkpoints.
using CrcTables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr CrcTables make_tables() {
  CrcTables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1U) != 0 ? 0xEDB8'8320U ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t s = 1; s < 8; ++s) {
    for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFU];
  }
  return t;
}

constexpr CrcTables kTables = make_tables();

}  // namespace

std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t seed) {
  std::uint32_t c = ~seed;
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t n = bytes.size();
  // The 8-byte step reads the words as little-endian; byte order is fixed by the tables.
  if constexpr (std::endian::native == std::endian::little) {
    while (n >= 8) {
      std::uint32_t lo = 0, hi = 0;
      std::memcpy(&lo, p, 4);
      std::memcpy(&hi, p + 4, 4);
      lo ^= c;
      c = kTables[7][lo & 0xFFU] ^ kTables[6][(lo >> 8) & 0xFFU] ^ kTables[5][(lo >> 16) & 0xFFU] ^
          kTables[4][lo >> 24] ^ kTables[3][hi & 0xFFU] ^ kTables[2][(hi >> 8) & 0xFFU] ^
          kTables[1][(hi >> 16) & 0xFFU] ^ kTables[0][hi >> 24];
      p += 8;
      n -= 8;
    }
  }
  while (n-- > 0) c = kTables[0][(c ^ *p++) & 0xFFU] ^ (c >> 8);
  return ~c;
}

}  // namespace sluice
