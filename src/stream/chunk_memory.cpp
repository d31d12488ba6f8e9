// The memory of stream chunks' packet buffers (ChunkAllocator in sluice/stream.hpp).
// Large buffers come from arenas of transparent huge pages: a block is carved once and,
// once freed, kept on a list for its size (sizes rounded to 16 KiB; chunks cluster around
// the chunk size, so few sizes occur) and handed out again; freed blocks keep their pages
// up to kChunkMemoryKeptBytes, beyond which a freed block's pages go back to the OS (its
// address stays listed: streams of other orders and gradients differ in size, and kept
// whole every size's peak adds up far beyond what is ever live). Arenas with no live block go
// back to the OS only when asked (release_chunk_memory): training streams the same sizes
// every step, and fresh pages would have to be faulted in again. Neither oneTBB's scalable
// allocator (its huge pages need THP "always") nor the standard pool resources (they
// round large blocks up to powers of two) serve this.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "core/huge_pages.hpp"
#include "sluice/chunk_memory.hpp"

#if defined(__linux__)
#define SLUICE_CHUNK_HUGE_PAGES 1
#endif
#if defined(__SANITIZE_ADDRESS__)
#undef SLUICE_CHUNK_HUGE_PAGES  // operator new, so AddressSanitizer sees every buffer
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#undef SLUICE_CHUNK_HUGE_PAGES
#endif
#endif

namespace sluice::detail {
namespace {

constexpr std::size_t kSmall = std::size_t{16} << 10;       // below: operator new
constexpr std::size_t kStep = std::size_t{16} << 10;        // sizes are rounded up to this
constexpr std::size_t kArena = std::size_t{64} << 20;       // allocated at a time
constexpr std::size_t kOwnMapping = std::size_t{16} << 20;  // blocks allocated alone

std::size_t round_up(std::size_t n, std::size_t step) {
  return (n + step - 1) / step * step;
}

[[maybe_unused]] bool transparent_huge_pages() {
  std::FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (f == nullptr) return false;
  char text[128] = {};
  const std::size_t n = std::fread(text, 1, sizeof text - 1, f);
  std::fclose(f);
  return n > 0 && std::strstr(text, "[never]") == nullptr;
}

class HugeBlocks {
 public:
  // Never destroyed: chunks held by static objects may be freed after it would be.
  static HugeBlocks& instance() {
    static HugeBlocks* blocks = new HugeBlocks;
    return *blocks;
  }

  bool enabled() const { return enabled_; }

  void* allocate(std::size_t bytes) {
    const std::size_t size = round_up(bytes, kStep);
    if (size >= kOwnMapping) {
      void* block = allocate_huge_pages(size);
      const std::lock_guard<std::mutex> lock(mutex_);
      own_bytes_ += size;
      return block;
    }
    const std::lock_guard<std::mutex> lock(mutex_);
    std::vector<void*>& kept = free_[size];
    if (!kept.empty()) {
      void* block = kept.back();
      kept.pop_back();
      kept_bytes_ -= size;
      arena_of(block).live += size;
      return block;
    }
    std::vector<void*>& dropped = dropped_[size];
    if (!dropped.empty()) {  // its pages fault in afresh
      void* block = dropped.back();
      dropped.pop_back();
      arena_of(block).live += size;
      return block;
    }
    if (left_ < size) {
      next_ = static_cast<char*>(allocate_huge_pages(kArena));
      left_ = kArena;
      try {
        arenas_.emplace(next_, Arena{});
      } catch (...) {
        std::free(next_);
        next_ = nullptr;
        left_ = 0;
        throw;
      }
    }
    void* block = next_;
    next_ += size;
    left_ -= size;
    arena_of(block).live += size;
    return block;
  }

  void free(void* block, std::size_t bytes) noexcept {
    const std::size_t size = round_up(bytes, kStep);
    if (size >= kOwnMapping) {
      std::free(block);
      const std::lock_guard<std::mutex> lock(mutex_);
      own_bytes_ -= size;
      return;
    }
    bool keep = false;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      keep = kept_bytes_ + size <= kChunkMemoryKeptBytes;
      if (keep) kept_bytes_ += size;  // claimed now, so that threads freeing at once agree
    }
    // Beyond the bound the pages go back to the OS before the block is listed (no other
    // thread can have it yet); the address stays for the next block of its size.
    if (!keep) drop_pages(block, size);
    const std::lock_guard<std::mutex> lock(mutex_);
    arena_of(block).live -= size;
    try {
      (keep ? free_ : dropped_)[size].push_back(block);
    } catch (...) {
      // No room to list it: the block is lost to reuse until its arena is released.
      if (keep) kept_bytes_ -= size;
    }
  }

  ChunkMemoryUsage usage() {
    const std::lock_guard<std::mutex> lock(mutex_);
    ChunkMemoryUsage u{own_bytes_ + arenas_.size() * kArena, own_bytes_, kept_bytes_};
    for (const auto& [base, arena] : arenas_) u.live_bytes += arena.live;
    return u;
  }

  /// Frees every arena without a live block, after taking its blocks off the free lists.
  std::size_t release() {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::vector<char*> idle;
    for (const auto& [base, arena] : arenas_) {
      if (arena.live == 0) idle.push_back(base);
    }
    if (idle.empty()) return 0;
    auto in_idle = [&](void* block) {
      auto* p = static_cast<char*>(block);
      const auto after = std::upper_bound(idle.begin(), idle.end(), p);  // idle is sorted
      return after != idle.begin() && p < *(after - 1) + kArena;
    };
    for (auto& [size, kept] : free_) {
      kept_bytes_ -= size * static_cast<std::size_t>(std::erase_if(kept, in_idle));
    }
    for (auto& [size, dropped] : dropped_) std::erase_if(dropped, in_idle);
    for (char* base : idle) {
      if (next_ != nullptr && base <= next_ && next_ < base + kArena) {
        next_ = nullptr;  // the arena being carved: the next block starts a new one
        left_ = 0;
      }
      arenas_.erase(base);
      std::free(base);
    }
    return idle.size() * kArena;
  }

 private:
#ifdef SLUICE_CHUNK_HUGE_PAGES
  HugeBlocks() : enabled_(transparent_huge_pages()) {}
#else
  HugeBlocks() = default;
#endif

  static void drop_pages(void* block, std::size_t size) noexcept {
#if defined(__linux__)
    (void)madvise(block, size, MADV_DONTNEED);  // on failure the pages merely stay
#else
    (void)block;
    (void)size;
#endif
  }

  struct Arena {
    std::size_t live = 0;  // bytes of its blocks handed out and not freed
  };
  /// The arena a block lies in: the last one starting at or before it.
  Arena& arena_of(void* block) {
    return std::prev(arenas_.upper_bound(static_cast<char*>(block)))->second;
  }

  bool enabled_ = false;
  std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;     // pages kept
  std::unordered_map<std::size_t, std::vector<void*>> dropped_;  // pages given back
  std::size_t kept_bytes_ = 0;                                   // in free_
  std::map<char*, Arena> arenas_;                                // by start address
  std::size_t own_bytes_ = 0;                                    // blocks allocated alone, all live
  char* next_ = nullptr;
  std::size_t left_ = 0;
};

}  // namespace

void* allocate_chunk_memory(std::size_t bytes) {
  HugeBlocks& blocks = HugeBlocks::instance();
  if (!blocks.enabled() || bytes < kSmall) return ::operator new(bytes);
  return blocks.allocate(bytes);
}

void free_chunk_memory(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  HugeBlocks& blocks = HugeBlocks::instance();
  if (!blocks.enabled() || bytes < kSmall) {
    ::operator delete(block);
    return;
  }
  blocks.free(block, bytes);
}

bool chunk_memory_in_huge_pages() {
  return HugeBlocks::instance().enabled();
}

}  // namespace sluice::detail

namespace sluice {

ChunkMemoryUsage chunk_memory_usage() {
  detail::HugeBlocks& blocks = detail::HugeBlocks::instance();
  return blocks.enabled() ? blocks.usage() : ChunkMemoryUsage{};
}

std::size_t release_chunk_memory() {
  detail::HugeBlocks& blocks = detail::HugeBlocks::instance();
  return blocks.enabled() ? blocks.release() : 0;
}

}  // namespace sluice
