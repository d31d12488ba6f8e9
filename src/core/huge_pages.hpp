#pragma once
// Memory in 2 MiB pages where the kernel allows: the engine's resident tiles (read at
// random rows) and stream chunks (read by other processes, which pin every page).
// Internal.
#include <cstddef>
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

/// At least `bytes`, rounded up to whole 2 MiB pages, 2 MiB aligned and asked to be in
/// huge pages (a hint: fine if refused). Free with std::free. Throws std::bad_alloc.
inline void* allocate_huge_pages(std::size_t bytes) {
  bytes = whole_huge_pages(bytes);
  void* p = std::aligned_alloc(kHugePage, bytes);
  if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__)
  ::madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace sluice::detail
