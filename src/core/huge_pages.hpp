#pragma once
// Memory in 2 MiB pages where the kernel allows: the engine's resident tiles (read at
// random rows), stream chunks (read by other processes, which pin every page), the model
// store's large buffers (direct transfers, and layers reloaded every step), and the large
// arrays a training step writes whole (activations, the optimizer's update and state).
// Internal.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

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

/// Makes `v` hold `n` elements for the caller to overwrite, keeping its memory where it has
/// room for them and is not much larger (a larger buffer kept would hold memory the model
/// store's budget does not count); only elements beyond its old size are value-initialised.
/// New memory is asked to be in huge pages: a layer's arrays are tens of megabytes, written
/// in whole, and a 4 KiB page fault per page of them was most of a model store's reload
/// and of a first training step.
template <typename T>
void resize_for_overwrite(std::vector<T>& v, std::size_t n) {
  if (v.capacity() < n || v.capacity() - n > n / 4 + 1024) {
    std::vector<T>().swap(v);
    v.reserve(n);
    ask_for_huge_pages(v.data(), n * sizeof(T));
  }
  v.resize(n);
}

}  // namespace sluice::detail
