// CRC-32 (src/core/crc32.hpp), which checkpoints and serialised streams are checked with:
// known values, chaining at every split point, and the slicing-by-8 loop against the
// bit-by-bit definition. CRC-32C, which the MPI fabric's tag checksums use: known values,
// and its four-lane folders (instruction and tables) against the bit-by-bit definition.
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

// The carry-less-multiplication path folds 64 bytes a step with the tail by tables:
// lengths around every boundary (64, 16-byte steps, the tail) and chained seeds.
TEST(Crc32, EveryIsaMatchesTheTables) {
  std::mt19937 rng(11);
  std::vector<std::byte> data(5000);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  for (const Isa isa : supported_isas()) {
    for (std::size_t n = 0; n <= 300; ++n) {
      const std::uint32_t seed = n % 3 == 0 ? 0U : static_cast<std::uint32_t>(rng());
      const auto bytes = std::span(data).subspan(n % 7, n);
      EXPECT_EQ(detail::crc32_with(isa, bytes, seed), detail::crc32_with(Isa::scalar, bytes, seed))
          << to_string(isa) << " n " << n;
    }
    for (std::size_t n : {1023, 1024, 4096, 4999}) {
      const auto bytes = std::span(data).first(n);
      EXPECT_EQ(detail::crc32_with(isa, bytes, 7), detail::crc32_with(Isa::scalar, bytes, 7))
          << to_string(isa) << " n " << n;
    }
    const std::string fox =
        "The quick brown fox jumps over the lazy dog, twice: "
        "the quick brown fox jumps over the lazy dog.";
    const auto fb = std::as_bytes(std::span(fox.data(), fox.size()));
    EXPECT_EQ(detail::crc32_with(isa, fb), crc32(fb)) << to_string(isa);
  }
}

TEST(Crc32c, KnownValuesAndChaining) {
  const std::string check = "123456789";
  const auto bytes = std::as_bytes(std::span(check.data(), check.size()));
  EXPECT_EQ(crc32c(bytes), 0xE3069283U);
  EXPECT_EQ(crc32c({}), 0U);
  for (std::size_t cut = 0; cut <= check.size(); ++cut) {
    EXPECT_EQ(crc32c(bytes.subspan(cut), crc32c(bytes.first(cut))), 0xE3069283U) << cut;
  }
}

// The bit-by-bit definition of one raw CRC-32C step over a little-endian word.
std::uint32_t crc32c_word_reference(std::uint32_t c, std::uint64_t word) {
  for (int b = 0; b < 8; ++b, word >>= 8) {
    c ^= static_cast<std::uint32_t>(word & 0xFFU);
    for (int k = 0; k < 8; ++k) c = (c & 1U) ? 0x82F63B78U ^ (c >> 1) : c >> 1;
  }
  return c;
}

TEST(Crc32c, LanesOfEveryIsaMatchTheDefinition) {
  std::mt19937_64 rng(9);
  std::vector<std::uint64_t> words(1000);
  for (auto& w : words) w = rng();
  EXPECT_EQ(detail::crc32c_word(0x12345678U, words[0]),
            crc32c_word_reference(0x12345678U, words[0]));
  for (const Isa isa : supported_isas()) {
    const detail::Crc32cLanes fold = detail::crc32c_lanes(isa);
    for (const std::uint64_t first : {0, 1, 2, 3, 6}) {
      for (const std::size_t n : {0, 1, 3, 4, 5, 17, 1000}) {
        std::uint32_t lanes[4] = {~0U, 1U, 2U, 3U}, want[4] = {~0U, 1U, 2U, 3U};
        // Folded in two calls, split where the lanes are not aligned.
        fold(lanes, first, words.data(), n / 3);
        fold(lanes, first + n / 3, words.data() + n / 3, n - n / 3);
        for (std::size_t j = 0; j < n; ++j) {
          want[(first + j) % 4] = crc32c_word_reference(want[(first + j) % 4], words[j]);
        }
        for (int l = 0; l < 4; ++l) {
          EXPECT_EQ(lanes[l], want[l]) << to_string(isa) << " first " << first << " n " << n;
        }
      }
    }
  }
}

}  // namespace
}  // namespace sluice
