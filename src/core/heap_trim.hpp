#pragma once
// Gives the C library's free heap memory back to the system. glibc keeps a freed block
// below its mmap threshold in its heap, and raises that threshold (up to 32 MiB) each time
// a larger mapped block is freed: the arrays of a model store's evicted pieces and its
// files' buffers then stay resident once freed, and the process holds more than the
// store's budget. A bounded ModelMemory calls this after an update once its cache has
// freed an eighth of its budget (TieredModelMemory::State::release_freed_heap); with other
// C libraries it does nothing.
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace sluice::detail {

inline void release_free_heap() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace sluice::detail
