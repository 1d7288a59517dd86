# dibs_check_test_names(SOURCES...): refuses, at configure time, a Catch2
# test case name that a suite could not run or report, naming the file and
# the case, rather than leaving it to a failing or silent ctest entry.
#   - ";": ctest cuts a test's name there, and the case would not run.
#   - a name longer than 79 characters whose first ": " comes after column
#     60: Catch2 v2's console reporter indents a wrapped name at that ": ",
#     so a failing case's name is printed one word per line, and from
#     column 77 on the reporter aborts on an assertion of its own instead
#     of reporting the failure.
function(dibs_check_test_names)
  foreach(src IN LISTS ARGN)
    get_filename_component(path ${src} ABSOLUTE)
    file(READ ${path} text)
    # The whole name, its string literals joined as the compiler does: a ';'
    # splits the ctest test in two, a backslash (\\* or \\Deleted) is an
    # escape in Catch2's test spec, so ctest's filter would not find it.
    string(REPLACE ";" "<semicolon>" marked "${text}")
    string(REGEX MATCHALL "TEST_CASE\\(\"[^\"]*\"([ \t\r\n]*\"[^\"]*\")*" full_names "${marked}")
    foreach(case IN LISTS full_names)
      if(case MATCHES "<semicolon>" OR case MATCHES "[\\]")
        message(FATAL_ERROR "${src}: a test case name with ';' or a backslash, which ctest cannot run: ${case}")
      endif()
    endforeach()
    string(REGEX MATCHALL "TEST_CASE\\(\"[^\"\n]*\"" names "${text}")
    foreach(case IN LISTS names)
      string(FIND "${case}" ": " colon)  # counted from TEST_CASE(" (11 characters)
      string(LENGTH "${case}" length)    # the name's and 12
      if(colon GREATER 71 AND length GREATER 91)
        message(FATAL_ERROR "${src}: put the \": \" of a long test case name before column 60 "
                            "(Catch2 v2 cannot print it when the case fails): ${case}")
      endif()
    endforeach()
  endforeach()
endfunction()
