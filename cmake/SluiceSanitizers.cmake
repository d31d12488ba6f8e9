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
