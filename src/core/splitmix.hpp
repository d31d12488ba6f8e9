#pragma once
// splitmix64: the one portable mixing step behind sluice's seeded shuffles and samples, so
// a seed gives the same data order on every platform and standard library. Internal.
#include <cstdint>

namespace sluice::detail {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace sluice::detail
