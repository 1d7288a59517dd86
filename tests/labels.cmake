# Run by ctest (from each test program's <name>_labels.cmake, made by
# dibs_test() in tests/CMakeLists.txt) after the program's test cases were
# added: labels each one with the program's kind (unit or server) and with
# its Catch2 tags among [chaos] and [conformance], so that `ctest -L unit`,
# `ctest -L chaos` or `ctest -LE chaos` select by what a test is. A test of
# a unit program that has a tag is labelled by its tags only.
#
# In:  dibs_program (the test program), dibs_prefix ("NAME:"), dibs_tests
#      (the ctest names the discovery added), dibs_kind.
if(NOT EXISTS "${dibs_program}")
  return()
endif()
foreach(tag IN ITEMS chaos conformance)
  execute_process(COMMAND "${dibs_program}" "[${tag}]" --list-test-names-only
                  OUTPUT_VARIABLE names RESULT_VARIABLE rc ERROR_QUIET)
  string(REPLACE "\n" ";" names "${names}")
  foreach(n IN LISTS names)
    if(NOT n STREQUAL "")
      string(MD5 key "${n}")
      list(APPEND dibs_tags_${key} ${tag})
    endif()
  endforeach()
endforeach()
string(LENGTH "${dibs_prefix}" prefix_length)
foreach(t IN LISTS dibs_tests)
  # The discovery may keep or drop the blank after the prefix's ":".
  string(SUBSTRING "${t}" ${prefix_length} -1 n)
  string(STRIP "${n}" n)
  string(MD5 key "${n}")
  # A tagged test of a unit program is that tag's, not "unit" (ctest -L unit
  # stays quick); a server test stays "server" as well.
  if(dibs_tags_${key} AND dibs_kind STREQUAL "unit")
    set(labels "${dibs_tags_${key}}")
  else()
    set(labels "${dibs_kind};${dibs_tags_${key}}")
  endif()
  set_tests_properties("${t}" PROPERTIES LABELS "${labels}")
  # What starts first when ctest has no timings yet (a fresh clone): the
  # server tests, which take turns on their server (a chain of about 75 s
  # each), then the chaos runs; the many short tests fill the slots around
  # them. Left in the order they are declared, the long ones were a tail.
  if(dibs_kind STREQUAL "server")
    set_tests_properties("${t}" PROPERTIES COST 1000)
  elseif(labels MATCHES "(^|;)chaos(;|$)")
    set_tests_properties("${t}" PROPERTIES COST 500)
  endif()
endforeach()
