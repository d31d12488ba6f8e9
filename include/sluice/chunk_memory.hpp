#pragma once
// Where stream chunks' packet buffers live: huge pages for large ones, kept by size for
// reuse, with what they hold and a way to give it back.
#include <cstddef>

namespace sluice {

namespace detail {
/// The memory behind ChunkAllocator.
void* allocate_chunk_memory(std::size_t bytes);
void free_chunk_memory(void* block, std::size_t bytes) noexcept;
/// Whether chunks' large buffers come from huge pages in this process.
bool chunk_memory_in_huge_pages();
}  // namespace detail

/// Freed chunk buffers whose pages are kept, at most, for the next buffer of their size;
/// beyond it a freed buffer's pages go back to the OS (its address stays reserved for
/// reuse). Chunks of different streams differ in size, so without a bound the buffers kept
/// would grow to the peak of every size at once (on the issue #28 model, 768 MiB of arenas
/// for 430 MiB ever live).
inline constexpr std::size_t kChunkMemoryKeptBytes = std::size_t{64} << 20;

/// Memory held for stream chunks' buffers of 16 KiB and more where they come from huge
/// pages (all zero otherwise: operator new then serves them and takes them back):
/// reserved from the OS, of that in buffers now in use, and in freed buffers whose pages
/// are kept for reuse (at most kChunkMemoryKeptBytes). A freed buffer's address stays
/// reserved for the next of its size until release_chunk_memory.
struct ChunkMemoryUsage {
  std::size_t reserved_bytes = 0;
  std::size_t live_bytes = 0;
  std::size_t kept_bytes = 0;
};
ChunkMemoryUsage chunk_memory_usage();
/// Returns to the OS every 64 MiB arena none of whose buffers is in use, and the bytes it
/// released: for a process done with a phase that streamed more, or other shapes, than
/// what follows (the next chunks fault in fresh pages). Thread-safe, buffers in use stay.
std::size_t release_chunk_memory();

/// The allocator of stream chunks' packet buffers. Buffers of 16 KiB and more come from
/// 2 MiB pages where the kernel has transparent huge pages (kept by size and reused, see
/// chunk_memory_usage), smaller ones from operator new. A process that reads
/// another's memory (MpiFabric's engines read rank 0's chunks) pins every page it copies,
/// so fewer, larger pages make that copy cheaper.
template <typename T>
struct ChunkAllocator {
  using value_type = T;
  ChunkAllocator() = default;
  template <typename U>
  ChunkAllocator(const ChunkAllocator<U>& /*other*/) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(detail::allocate_chunk_memory(n * sizeof(T)));
  }
  void deallocate(T* block, std::size_t n) noexcept {
    detail::free_chunk_memory(block, n * sizeof(T));
  }
  template <typename U>
  bool operator==(const ChunkAllocator<U>& /*other*/) const noexcept {
    return true;
  }
};

}  // namespace sluice
