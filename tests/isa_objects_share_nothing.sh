#!/usr/bin/env bash
# The files compiled for one ISA (*_avx2.cpp, *_avx512.cpp) must define no weak symbol: an
# inline function or template instantiation they emit out of line is one symbol across the
# library, and the linker keeps one file's copy, so AVX-512 code could serve the AVX2 or
# baseline path and fault on a CPU without AVX-512. Arguments: the library's object files.
set -euo pipefail
status=0
for object in "$@"; do
  case "$object" in
    *_avx2.cpp.o | *_avx512.cpp.o) ;;
    *) continue ;;
  esac
  # (DW.ref.__gxx_personality_v0 is data: the exception personality's address.)
  weak="$(nm -C "$object" | awk '($2 == "W" || $2 == "V") && $3 !~ /^DW\.ref\./' || true)"
  if [ -n "$weak" ]; then
    echo "$(basename "$object") defines weak symbols (make them static or always_inline):"
    echo "$weak"
    status=1
  fi
done
exit $status
