# SLUICE_SANITIZER=address -> AddressSanitizer + UndefinedBehaviorSanitizer
# SLUICE_SANITIZER=thread  -> ThreadSanitizer
if(SLUICE_SANITIZER STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
elseif(SLUICE_SANITIZER STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT SLUICE_SANITIZER STREQUAL "")
  message(FATAL_ERROR "SLUICE_SANITIZER must be '', 'address' or 'thread', not '${SLUICE_SANITIZER}'")
endif()

# Fuzz targets need clang's libFuzzer; the library is instrumented for coverage too.
option(SLUICE_BUILD_FUZZERS "Build the libFuzzer targets in fuzz/ (clang only)" OFF)
if(SLUICE_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "SLUICE_BUILD_FUZZERS needs clang (CXX=clang++)")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()
