#include <gtest/gtest.h>

#include <algorithm>

#include "sluice/topology.hpp"

namespace sluice {
namespace {

constexpr std::int64_t kMiB = std::int64_t{1} << 20;

Topology machine(std::int32_t cores, std::int64_t l2, std::int64_t l3, std::int32_t l3_caches) {
  Topology t;
  t.packages = 1;
  t.cores = cores;
  t.hardware_threads = cores;
  t.l2_bytes = l2;
  t.l3_bytes = l3;
  t.l3_caches = l3_caches;
  return t;
}

TEST(Topology, CacheShareIsTheL3OverTheCoresSharingIt) {
  // 16 cores, two 32 MiB L3s (two chiplets): 4 MiB each.
  EXPECT_EQ(machine(16, kMiB, 32 * kMiB, 2).cache_share_bytes(), 4 * kMiB);
  // One L3 counted once when hwloc reports no instances.
  EXPECT_EQ(machine(4, kMiB, 32 * kMiB, 0).cache_share_bytes(), 8 * kMiB);
}

TEST(Topology, CacheShareIsAtLeastTheL2AndAtMost12MiB) {
  EXPECT_EQ(machine(64, 2 * kMiB, 32 * kMiB, 1).cache_share_bytes(), 2 * kMiB);
  // A VM claiming its host's whole L3 for its 2 cores (seen: two of 508 MiB).
  EXPECT_EQ(machine(2, kMiB, 508 * kMiB, 2).cache_share_bytes(), 12 * kMiB);
}

TEST(Topology, DetectedMachineHasSaneCaches) {
  const Topology& t = topology();
  EXPECT_GE(t.cores, 1);
  EXPECT_GE(t.l3_caches, 1);
  EXPECT_GE(t.cache_share_bytes(), t.l2_bytes);
  EXPECT_LE(t.cache_share_bytes(), std::max<std::int64_t>(t.l2_bytes, 12 * kMiB));
}

}  // namespace
}  // namespace sluice
