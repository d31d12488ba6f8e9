#pragma once
// Gives the C library's free heap memory back to the system. glibc keeps a freed block
// below its mmap threshold in its heap, and raises that threshold (up to 32 MiB) each time
// a larger mapped block is freed: after a model store's first update, the gradient copy
// and the update's buffers of a mid-sized layer come from the heap and stay resident once
// freed, and the process holds far more than the store's budget. A bounded ModelMemory
// calls this after each layer's update; elsewhere (other C libraries) it does nothing.
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
