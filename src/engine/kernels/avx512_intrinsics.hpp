#pragma once
// <immintrin.h> for the AVX-512 kernel files whose code GCC 12 warns about falsely from
// inside its own intrinsics (masked loads, gathers, reductions: "may be used
// uninitialized"). The warnings are turned off from here to the end of the including file,
// so include this before the file's own code. Internal; clang has no such warnings.
#include <immintrin.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
