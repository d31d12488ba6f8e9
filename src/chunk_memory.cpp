// The memory of stream chunks' packet buffers (ChunkAllocator in sluice/stream.hpp).
// Large buffers come from arenas of transparent huge pages: a block is carved once and,
// once freed, kept on a list for its size (sizes rounded to 16 KiB; chunks cluster around
// the chunk size, so few sizes occur) and handed out again. Neither oneTBB's scalable
// allocator (its huge pages need THP "always") nor the standard pool resources (they round
// large blocks up to powers of two) serve this.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "huge_pages.hpp"
#include "sluice/stream.hpp"

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
    if (size >= kOwnMapping) return allocate_huge_pages(size);
    const std::lock_guard<std::mutex> lock(mutex_);
    std::vector<void*>& kept = free_[size];
    if (!kept.empty()) {
      void* block = kept.back();
      kept.pop_back();
      return block;
    }
    if (left_ < size) {
      next_ = static_cast<char*>(allocate_huge_pages(kArena));
      left_ = kArena;
    }
    void* block = next_;
    next_ += size;
    left_ -= size;
    return block;
  }

  void free(void* block, std::size_t bytes) noexcept {
    const std::size_t size = round_up(bytes, kStep);
    if (size >= kOwnMapping) {
      std::free(block);
      return;
    }
    const std::lock_guard<std::mutex> lock(mutex_);
    try {
      free_[size].push_back(block);
    } catch (...) {
      // No room to keep it: the block is lost to reuse, nothing else goes wrong.
    }
  }

 private:
#ifdef SLUICE_CHUNK_HUGE_PAGES
  HugeBlocks() : enabled_(transparent_huge_pages()) {}
#else
  HugeBlocks() = default;
#endif

  bool enabled_ = false;
  std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
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
