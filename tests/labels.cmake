# Run by ctest (from each test program's <name>_labels.cmake, made by
# dibs_test() in tests/CMakeLists.txt) after the program's test cases were
# added: labels each one with the program's kind (unit or server) and with
# its Catch2 tags among [chaos] and [conformance], so that `ctest -L unit`,
# `ctest -L chaos` or `ctest -LE chaos` select by what a test is. A test of
# a unit program that has a tag is labelled by its tags only.
#
# A server program's test takes one slot of its server (a ctest resource,
# tests/resources.json): the tests on one server run side by side, each in
# a folder, table or namespace of its own. One tagged [server-alone] (it
# kills, restarts or pauses the server, or counts what the server logs)
# takes every slot, so it runs with no other test on that server.
#
# In:  dibs_program (the test program), dibs_prefix ("NAME:"), dibs_tests
#      (the ctest names the discovery added), dibs_kind, dibs_server (the
#      resource, for a server program).
if(NOT EXISTS "${dibs_program}")
  return()
endif()
foreach(tag IN ITEMS chaos conformance server-alone)
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
  if(NOT dibs_server STREQUAL "")
    if(labels MATCHES "(^|;)server-alone(;|$)")
      set_tests_properties("${t}" PROPERTIES RESOURCE_GROUPS "${dibs_server}:4")
    else()
      set_tests_properties("${t}" PROPERTIES RESOURCE_GROUPS "${dibs_server}:1")
    endif()
  endif()
  # What starts first when ctest has no timings yet (a fresh clone): the
  # tests that take their server alone (one after another on it), then the
  # other server tests, then the chaos runs; the many short tests fill the
  # slots around them. Left in the order they are declared, the long ones
  # were a tail.
  if(labels MATCHES "(^|;)server-alone(;|$)")
    # First of its server's: alone, while the slots are all free.
    set_tests_properties("${t}" PROPERTIES COST 2000)
  elseif(dibs_kind STREQUAL "server")
    set_tests_properties("${t}" PROPERTIES COST 1000)
  elseif(labels MATCHES "(^|;)chaos(;|$)")
    set_tests_properties("${t}" PROPERTIES COST 500)
  endif()
endforeach()
