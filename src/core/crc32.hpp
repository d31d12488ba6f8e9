#pragma once
// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, as zlib, PNG and gzip use it),
// for checkpoints and serialised streams; and CRC-32C (Castagnoli, reflected 0x82F63B78,
// as iSCSI and ext4 use it), which x86-64 computes with an instruction, for the MPI
// fabric's tag checksums. Internal: not installed.
#include <cstddef>
#include <cstdint>
#include <span>

#include "sluice/isa.hpp"

namespace sluice {

/// CRC-32 of `bytes`. Chains: crc32(b, crc32(a)) == crc32(a followed by b), so a long
/// payload can be checked piece by piece. crc32("123456789") == 0xCBF43926.
std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t seed = 0);

/// CRC-32C of `bytes`, chaining as crc32 does. crc32c("123456789") == 0xE3069283.
std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t seed = 0);

namespace detail {

/// crc32 computed as `isa` would: carry-less multiplication where the CPU has it and
/// `isa` is not scalar, else tables. Both compute the same values; crc32 uses
/// default_isa()'s.
std::uint32_t crc32_with(Isa isa, std::span<const std::byte> bytes, std::uint32_t seed = 0);

/// One CRC-32C step over the 8 bytes of `word` (little-endian), without pre- or
/// post-inversion: what the crc32q instruction computes.
std::uint32_t crc32c_word(std::uint32_t crc, std::uint64_t word);

/// Folds `n` words into four interleaved CRC-32C states: word j goes into
/// lanes[(first + j) % 4], one crc32c_word step each. Four lanes because the instruction
/// has a latency of several cycles and a throughput of one a cycle.
using Crc32cLanes = void (*)(std::uint32_t lanes[4], std::uint64_t first,
                             const std::uint64_t* words, std::size_t n);

/// The lane folder for `isa`: the crc32 instruction (every CPU with AVX2 has SSE4.2's
/// crc32), or tables for Isa::scalar and other CPUs. Both compute the same values.
Crc32cLanes crc32c_lanes(Isa isa);

}  // namespace detail
}  // namespace sluice
