// The memory behind stream chunks' packet buffers (ChunkAllocator): every size, reuse of
// freed blocks, no two live blocks overlapping, from several threads at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "sluice/stream.hpp"

namespace sluice {
namespace {

struct Block {
  unsigned char* data;
  std::size_t bytes;
};

// Fills a block with a pattern of its own, so a block handed out twice shows.
void fill(const Block& b, unsigned char tag) {
  std::memset(b.data, tag, b.bytes);
}
bool intact(const Block& b, unsigned char tag) {
  return std::all_of(b.data, b.data + b.bytes, [&](unsigned char c) { return c == tag; });
}

TEST(ChunkMemory, BlocksOfEverySizeAreDistinctAndAligned) {
  // Below the huge-page threshold, around it, odd sizes, one with a mapping of its own.
  const std::vector<std::size_t> sizes = {1,
                                          8,
                                          4096,
                                          (16 << 10) - 8,
                                          16 << 10,
                                          (16 << 10) + 8,
                                          100'000,
                                          256 << 10,
                                          (256 << 10) + 24,
                                          3 << 20,
                                          (17 << 20) + 5};
  std::vector<Block> live;
  for (int round = 0; round < 3; ++round) {
    for (const std::size_t bytes : sizes) {
      auto* p = static_cast<unsigned char*>(detail::allocate_chunk_memory(bytes));
      ASSERT_NE(p, nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % alignof(std::max_align_t), 0U) << bytes;
      live.push_back({p, bytes});
      fill(live.back(), static_cast<unsigned char>(live.size()));
    }
  }
  for (std::size_t i = 0; i < live.size(); ++i) {
    EXPECT_TRUE(intact(live[i], static_cast<unsigned char>(i + 1))) << "block " << i;
  }
  // Live blocks never overlap.
  std::vector<Block> sorted = live;
  std::sort(sorted.begin(), sorted.end(),
            [](const Block& a, const Block& b) { return a.data < b.data; });
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    EXPECT_LE(sorted[i - 1].data + sorted[i - 1].bytes, sorted[i].data);
  }
  for (const Block& b : live) detail::free_chunk_memory(b.data, b.bytes);
}

TEST(ChunkMemory, AFreedBlockServesTheNextRequestOfItsSize) {
  if (!detail::chunk_memory_in_huge_pages()) GTEST_SKIP() << "operator new serves all sizes";
  const std::size_t bytes = (256 << 10) + 40;
  void* first = detail::allocate_chunk_memory(bytes);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % (16 << 10), 0U);
  detail::free_chunk_memory(first, bytes);
  void* again = detail::allocate_chunk_memory(bytes);
  EXPECT_EQ(again, first);  // kept and handed out again, not carved anew
  detail::free_chunk_memory(again, bytes);
}

TEST(ChunkMemory, ThreadsAllocatingAtOnceGetTheirOwnBlocks) {
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &failures] {
      const auto tag = static_cast<unsigned char>(0x40 + t);
      for (int r = 0; r < kRounds; ++r) {
        const std::size_t bytes = (r % 3 == 0 ? 20 << 10 : 256 << 10) + static_cast<std::size_t>(t);
        Block b{static_cast<unsigned char*>(detail::allocate_chunk_memory(bytes)), bytes};
        fill(b, tag);
        std::this_thread::yield();
        if (!intact(b, tag)) ++failures[static_cast<std::size_t>(t)];
        detail::free_chunk_memory(b.data, b.bytes);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[static_cast<std::size_t>(t)], 0) << t;
}

// Freed buffers of many sizes (as different streams' chunks are) keep their pages up to
// kChunkMemoryKeptBytes; the rest give theirs back, and their addresses are reused.
TEST(ChunkMemory, FreedBuffersKeepAtMostTheBoundInPages) {
  if (!detail::chunk_memory_in_huge_pages()) GTEST_SKIP() << "operator new serves all sizes";
  release_chunk_memory();
  const ChunkMemoryUsage before = chunk_memory_usage();
  std::vector<Block> blocks;
  std::size_t total = 0;
  for (int i = 0; total < 2 * kChunkMemoryKeptBytes; ++i) {  // every size different
    const std::size_t bytes = (std::size_t{1} << 20) + static_cast<std::size_t>(i) * (16 << 10);
    blocks.push_back({static_cast<unsigned char*>(detail::allocate_chunk_memory(bytes)), bytes});
    fill(blocks.back(), 0x11);
    total += bytes;
  }
  const ChunkMemoryUsage busy = chunk_memory_usage();
  for (const Block& b : blocks) detail::free_chunk_memory(b.data, b.bytes);
  const ChunkMemoryUsage idle = chunk_memory_usage();
  EXPECT_LE(idle.kept_bytes, kChunkMemoryKeptBytes);
  EXPECT_GE(idle.kept_bytes + (std::size_t{2} << 20), kChunkMemoryKeptBytes);  // up to it
  EXPECT_EQ(idle.live_bytes, before.live_bytes);
  EXPECT_EQ(idle.reserved_bytes, busy.reserved_bytes);  // addresses stay for reuse
  // The same sizes again come from the lists, kept or given back: no arena is added.
  for (Block& b : blocks) {
    b.data = static_cast<unsigned char*>(detail::allocate_chunk_memory(b.bytes));
    fill(b, 0x22);
  }
  EXPECT_EQ(chunk_memory_usage().reserved_bytes, busy.reserved_bytes);
  EXPECT_EQ(chunk_memory_usage().kept_bytes, 0U);
  for (const Block& b : blocks) {
    EXPECT_TRUE(intact(b, 0x22));
    detail::free_chunk_memory(b.data, b.bytes);
  }
  release_chunk_memory();
  EXPECT_EQ(chunk_memory_usage().live_bytes, before.live_bytes);
}

TEST(ChunkMemory, ReleaseReturnsIdleArenasAndKeepsLiveBlocks) {
  if (!detail::chunk_memory_in_huge_pages()) {
    EXPECT_EQ(chunk_memory_usage().reserved_bytes, 0U);  // operator new: nothing held
    EXPECT_EQ(release_chunk_memory(), 0U);
    GTEST_SKIP() << "operator new serves all sizes";
  }
  release_chunk_memory();
  const ChunkMemoryUsage before = chunk_memory_usage();
  // One block kept alive across the release, then 150 MiB in blocks of 1 MiB + a little
  // (rounded to 1 MiB + 16 KiB): more than two 64 MiB arenas.
  const std::size_t bytes = (1 << 20) + 100, rounded = (1 << 20) + (16 << 10);
  Block kept{static_cast<unsigned char*>(detail::allocate_chunk_memory(bytes)), bytes};
  fill(kept, 0x5A);
  std::vector<Block> blocks;
  for (int i = 0; i < 150; ++i) {
    blocks.push_back({static_cast<unsigned char*>(detail::allocate_chunk_memory(bytes)), bytes});
  }
  // A block of its own mapping counts while it lives.
  const std::size_t alone = std::size_t{20} << 20;
  void* big = detail::allocate_chunk_memory(alone);
  const ChunkMemoryUsage busy = chunk_memory_usage();
  EXPECT_EQ(busy.live_bytes, before.live_bytes + 151 * rounded + alone);
  EXPECT_GE(busy.reserved_bytes, busy.live_bytes);
  EXPECT_GE(busy.reserved_bytes, before.reserved_bytes + 150 * rounded);
  detail::free_chunk_memory(big, alone);
  for (const Block& b : blocks) detail::free_chunk_memory(b.data, b.bytes);
  const ChunkMemoryUsage idle = chunk_memory_usage();
  EXPECT_EQ(idle.live_bytes, before.live_bytes + rounded);
  EXPECT_EQ(idle.reserved_bytes, busy.reserved_bytes - alone);  // freed blocks stay reserved

  const std::size_t released = release_chunk_memory();
  const ChunkMemoryUsage after = chunk_memory_usage();
  EXPECT_GE(released, std::size_t{64} << 20);  // at least one arena held only freed blocks
  EXPECT_EQ(after.reserved_bytes, idle.reserved_bytes - released);
  EXPECT_EQ(after.live_bytes, idle.live_bytes);
  // What stays reserved is what was before plus the arena the live block holds, at most.
  EXPECT_LE(after.reserved_bytes, before.reserved_bytes + (std::size_t{64} << 20));
  EXPECT_TRUE(intact(kept, 0x5A));
  EXPECT_EQ(release_chunk_memory(), 0U);  // nothing idle is left

  // New blocks never come from released memory's free lists: none overlaps the live one.
  for (int i = 0; i < 80; ++i) {
    Block b{static_cast<unsigned char*>(detail::allocate_chunk_memory(bytes)), bytes};
    EXPECT_TRUE(b.data + b.bytes <= kept.data || kept.data + kept.bytes <= b.data);
    fill(b, 0x33);
    blocks[static_cast<std::size_t>(i)] = b;
  }
  EXPECT_TRUE(intact(kept, 0x5A));
  for (int i = 0; i < 80; ++i) detail::free_chunk_memory(blocks[i].data, blocks[i].bytes);
  detail::free_chunk_memory(kept.data, kept.bytes);
  release_chunk_memory();
  EXPECT_EQ(chunk_memory_usage().live_bytes, before.live_bytes);
}

TEST(ChunkMemory, PacketVectorsBehaveAsVectors) {
  PacketVector a(40'000, Packet{3, 1.5F});
  PacketVector b = a;  // copies allocate through the same memory
  b.resize(70'000, Packet{4, 2.5F});
  a.clear();
  a.shrink_to_fit();
  ASSERT_EQ(b.size(), 70'000U);
  EXPECT_EQ(b[39'999].tag, 3U);
  EXPECT_EQ(b[40'000].tag, 4U);
  Bf16PacketVector c(5, Bf16Packet{1, 2});
  c.insert(c.end(), 100'000, Bf16Packet{7, 8});
  EXPECT_EQ(c.back().index, 7U);
  EXPECT_EQ(ChunkAllocator<Packet>{}, ChunkAllocator<Bf16Packet>{});
}

}  // namespace
}  // namespace sluice
