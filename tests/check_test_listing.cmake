# Run after a Catch2 test binary links (laminar_add_test): fails the build unless the binary lists
# its tests. Catch's test discovery registers nothing, and says nothing, when the binary crashes as
# it starts (it accepts only a count or a negative result), so such a binary would drop out of every
# CTest run instead of failing.
# Usage: cmake -DTEST_EXECUTABLE=<binary> -P check_test_listing.cmake
execute_process(COMMAND ${TEST_EXECUTABLE} --list-test-names-only
  OUTPUT_VARIABLE output ERROR_VARIABLE errors RESULT_VARIABLE result)
# Catch exits with the number of tests it lists (modulo 256, so any number will do) and prints their
# names; a crash reads as a signal's name.
if(NOT result MATCHES "^[0-9]+$" OR output STREQUAL "")
  message(FATAL_ERROR "${TEST_EXECUTABLE} did not list its tests (exit: ${result})\n${output}${errors}")
endif()
