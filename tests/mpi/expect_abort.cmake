# Runs COMMAND (a list) and passes only if it fails (exit code != 0) within 120 s and its
# output matches the regular expression EXPECT: a failed rank must end the whole job with
# a clear message instead of leaving the others blocked.
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out
  TIMEOUT 120)
message("${out}")
if(rc MATCHES "timeout|Process terminated due to timeout")
  message(FATAL_ERROR "the job hung: ${rc}")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "the job succeeded; a failure was expected")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "exit code ${rc}, but the output does not match '${EXPECT}'")
endif()
message("failed as expected (exit code ${rc})")
