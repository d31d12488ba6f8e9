#pragma once
// Memory in 2 MiB pages where the kernel allows: the engine's resident tiles (read at
// random rows), stream chunks (read by other processes, which pin every page), and the
// model store's large buffers (direct transfers, and layers reloaded every step).
// Internal.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace sluice::detail {

inline constexpr std::size_t kHugePage = std::size_t{2} << 20;

/// `bytes` rounded up to whole 2 MiB pages: what allocate_huge_pages gives.
inline constexpr std::size_t whole_huge_pages(std::size_t bytes) {
  return (bytes + kHugePage - 1) / kHugePage * kHugePage;
}

/// Asks that the whole 2 MiB pages inside [p, p + bytes) of memory not yet touched be huge
/// pages (a hint: fine if refused): touching them then costs a page fault per 2 MiB
/// instead of one per 4 KiB. (allocate_huge_pages for memory the caller allocates here.)
inline void ask_for_huge_pages(void* p, std::size_t bytes) {
#if defined(__linux__)
  const auto begin = (reinterpret_cast<std::uintptr_t>(p) + kHugePage - 1) / kHugePage * kHugePage;
  const auto end = (reinterpret_cast<std::uintptr_t>(p) + bytes) / kHugePage * kHugePage;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

/// At least `bytes`, rounded up to whole 2 MiB pages, 2 MiB aligned and asked to be in
/// huge pages (a hint: fine if refused). Free with std::free. Throws std::bad_alloc.
inline void* allocate_huge_pages(std::size_t bytes) {
  bytes = whole_huge_pages(bytes);
  void* p = std::aligned_alloc(kHugePage, bytes);
  if (p == nullptr) throw std::bad_alloc();
  ask_for_huge_pages(p, bytes);
  return p;
}

}  // namespace sluice::detail
