// CRC-32 (src/core/crc32.hpp), which checkpoints and serialised streams are checked with:
// known values, chaining at every split point, and the slicing-by-8 loop against the
// bit-by-bit definition.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/crc32.hpp"

namespace sluice {
namespace {

TEST(Crc32, KnownValuesAndChaining) {
  const std::string check = "123456789";
  const auto bytes = std::as_bytes(std::span(check.data(), check.size()));
  EXPECT_EQ(crc32(bytes), 0xCBF43926U);
  EXPECT_EQ(crc32({}), 0U);
  const std::string fox = "The quick brown fox jumps over the lazy dog";
  EXPECT_EQ(crc32(std::as_bytes(std::span(fox.data(), fox.size()))), 0x414FA339U);
  // Chaining at every split point, across the 8-byte fast path.
  for (std::size_t cut = 0; cut <= fox.size(); ++cut) {
    const auto all = std::as_bytes(std::span(fox.data(), fox.size()));
    EXPECT_EQ(crc32(all.subspan(cut), crc32(all.first(cut))), 0x414FA339U) << cut;
  }
}

TEST(Crc32, MatchesBitwiseReferenceOnRandomData) {
  std::mt19937 rng(5);
  std::vector<std::byte> data(1000);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  for (std::size_t n : {0, 1, 7, 8, 9, 63, 64, 1000}) {
    std::uint32_t c = 0xFFFFFFFFU;
    for (std::size_t i = 0; i < n; ++i) {
      c ^= static_cast<std::uint32_t>(data[i]);
      for (int k = 0; k < 8; ++k) c = (c & 1U) ? 0xEDB88320U ^ (c >> 1) : c >> 1;
    }
    EXPECT_EQ(crc32(std::span(data).first(n)), ~c) << n;
  }
}

}  // namespace
}  // namespace sluice
