#pragma once
// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, as zlib, PNG and gzip use it),
// for checkpoints and serialised streams. Internal: not installed.
#include <cstddef>
#include <cstdint>
#include <span>

namespace sluice {

/// CRC-32 of `bytes`. Chains: crc32(b, crc32(a)) == crc32(a followed by b), so a long
/// payload can be checked piece by piece. crc32("123456789") == 0xCBF43926.
std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t seed = 0);

}  // namespace sluice
