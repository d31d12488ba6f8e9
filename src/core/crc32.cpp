#include "core/crc32.hpp"

#include <array>
#include <bit>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <nmmintrin.h>
#define SLUICE_CRC32C_INSTRUCTION 1
#endif

namespace sluice {
namespace {

// Slicing-by-8: eight tables let the loop fold eight bytes per step instead of one, so
// the checksum keeps up with the disk on multi-GB checkpoints.
using CrcTables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr CrcTables make_tables(std::uint32_t polynomial) {
  CrcTables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1U) != 0 ? polynomial ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t s = 1; s < 8; ++s) {
    for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFU];
  }
  return t;
}

constexpr CrcTables kTables = make_tables(0xEDB8'8320U);
constexpr CrcTables kTablesC = make_tables(0x82F6'3B78U);

// Eight little-endian bytes folded into `c` (no inversion).
inline std::uint32_t fold8(const CrcTables& t, std::uint32_t c, std::uint32_t lo,
                           std::uint32_t hi) {
  lo ^= c;
  return t[7][lo & 0xFFU] ^ t[6][(lo >> 8) & 0xFFU] ^ t[5][(lo >> 16) & 0xFFU] ^ t[4][lo >> 24] ^
         t[3][hi & 0xFFU] ^ t[2][(hi >> 8) & 0xFFU] ^ t[1][(hi >> 16) & 0xFFU] ^ t[0][hi >> 24];
}

std::uint32_t crc_of(const CrcTables& t, std::span<const std::byte> bytes, std::uint32_t seed) {
  std::uint32_t c = ~seed;
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t n = bytes.size();
  // The 8-byte step reads the words as little-endian; byte order is fixed by the tables.
  if constexpr (std::endian::native == std::endian::little) {
    for (; n >= 8; p += 8, n -= 8) {
      std::uint32_t lo = 0, hi = 0;
      std::memcpy(&lo, p, 4);
      std::memcpy(&hi, p + 4, 4);
      c = fold8(t, c, lo, hi);
    }
  }
  while (n-- > 0) c = t[0][(c ^ *p++) & 0xFFU] ^ (c >> 8);
  return ~c;
}

void lanes_by_table(std::uint32_t lanes[4], std::uint64_t first, const std::uint64_t* words,
                    std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) {
    std::uint32_t& lane = lanes[(first + j) % 4];
    lane = fold8(kTablesC, lane, static_cast<std::uint32_t>(words[j]),
                 static_cast<std::uint32_t>(words[j] >> 32));
  }
}

#ifdef SLUICE_CRC32C_INSTRUCTION
__attribute__((target("sse4.2"))) void lanes_by_instruction(std::uint32_t lanes[4],
                                                            std::uint64_t first,
                                                            const std::uint64_t* words,
                                                            std::size_t n) {
  std::size_t j = 0;
  for (; j < n && (first + j) % 4 != 0; ++j) {
    std::uint32_t& lane = lanes[(first + j) % 4];
    lane = static_cast<std::uint32_t>(_mm_crc32_u64(lane, words[j]));
  }
  std::uint64_t c0 = lanes[0], c1 = lanes[1], c2 = lanes[2], c3 = lanes[3];
  for (; j + 4 <= n; j += 4) {
    c0 = _mm_crc32_u64(c0, words[j]);
    c1 = _mm_crc32_u64(c1, words[j + 1]);
    c2 = _mm_crc32_u64(c2, words[j + 2]);
    c3 = _mm_crc32_u64(c3, words[j + 3]);
  }
  lanes[0] = static_cast<std::uint32_t>(c0), lanes[1] = static_cast<std::uint32_t>(c1);
  lanes[2] = static_cast<std::uint32_t>(c2), lanes[3] = static_cast<std::uint32_t>(c3);
  for (; j < n; ++j) {  // (first + j) % 4 == j % 4 == lane of the tail, in order
    std::uint32_t& lane = lanes[(first + j) % 4];
    lane = static_cast<std::uint32_t>(_mm_crc32_u64(lane, words[j]));
  }
}

// CRC-32 by carry-less multiplication (Intel, "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ", 2009; the bit-reflected constants of its appendix, as
// zlib and Linux use them): four 128-bit lanes fold 64 bytes a step, then fold into one
// and Barrett-reduce. Tables fold 8 bytes a step and fall well behind the disk, and the
// model store checks every byte it reads and writes. `c` is the CRC without inversion;
// `n` is a multiple of 16, at least 64.
__attribute__((target("sse4.1,pclmul"))) inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(hi, lo), next);
}

__attribute__((target("sse4.1,pclmul"))) std::uint32_t fold_by_clmul(std::uint32_t c,
                                                                     const unsigned char* p,
                                                                     std::size_t n) {
  const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
  const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
  const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124);
  const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
  const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
  auto load = [](const unsigned char* at) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  };
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
    x1 = fold(x1, k1k2, load(p));
    x2 = fold(x2, k1k2, load(p + 16));
    x3 = fold(x3, k1k2, load(p + 32));
    x4 = fold(x4, k1k2, load(p + 48));
  }
  x1 = fold(fold(fold(x1, k3k4, x2), k3k4, x3), k3k4, x4);
  for (; n >= 16; p += 16, n -= 16) x1 = fold(x1, k3k4, load(p));
  // 128 bits to 64, then to 32 by Barrett reduction.
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, k3k4, 0x10));
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 4),
                     _mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5, 0x00));
  __m128i x2r = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), poly, 0x10);
  x2r = _mm_clmulepi64_si128(_mm_and_si128(x2r, low32), poly, 0x00);
  return static_cast<std::uint32_t>(_mm_extract_epi32(_mm_xor_si128(x1, x2r), 1));
}

std::uint32_t crc32_by_clmul(std::span<const std::byte> bytes, std::uint32_t seed) {
  const std::size_t whole = bytes.size() < 64 ? 0 : bytes.size() & ~std::size_t{15};
  if (whole == 0) return crc_of(kTables, bytes, seed);
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::uint32_t c = ~fold_by_clmul(~seed, p, whole);
  return crc_of(kTables, bytes.subspan(whole), c);
}
#endif

std::uint32_t crc32_by_table(std::span<const std::byte> bytes, std::uint32_t seed) {
  return crc_of(kTables, bytes, seed);
}

// Every CPU with AVX2 (Haswell on) has PCLMULQDQ.
using Crc32Fn = std::uint32_t (*)(std::span<const std::byte>, std::uint32_t);
Crc32Fn crc32_for(Isa isa) {
#ifdef SLUICE_CRC32C_INSTRUCTION
  if (isa != Isa::scalar && cpu_supports(isa) && __builtin_cpu_supports("pclmul")) {
    return &crc32_by_clmul;
  }
#else
  (void)isa;
#endif
  return &crc32_by_table;
}

}  // namespace

std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t seed) {
  static const Crc32Fn chosen = crc32_for(default_isa());
  return chosen(bytes, seed);
}

std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t seed) {
  return crc_of(kTablesC, bytes, seed);
}

namespace detail {

std::uint32_t crc32_with(Isa isa, std::span<const std::byte> bytes, std::uint32_t seed) {
  return crc32_for(isa)(bytes, seed);
}

std::uint32_t crc32c_word(std::uint32_t crc, std::uint64_t word) {
  return fold8(kTablesC, crc, static_cast<std::uint32_t>(word),
               static_cast<std::uint32_t>(word >> 32));
}

Crc32cLanes crc32c_lanes(Isa isa) {
#ifdef SLUICE_CRC32C_INSTRUCTION
  if (isa != Isa::scalar && cpu_supports(isa)) return &lanes_by_instruction;
#else
  (void)isa;
#endif
  return &lanes_by_table;
}

}  // namespace detail
}  // namespace sluice
