# dibs_header_test_sources(<out> <exclude>): the sources of a header test,
# generated: each public header of include/dibs alone in a translation unit
# of its own, included twice (the second time checks its include guard);
# the paths of 0.1 that forward to a header's new place all in one
# translation unit (what they forward to is checked alone). Headers in
# detail/ are left out, and those matching the regular expression
# <exclude> (the adapters a build does not have), if it is not empty.
# Used by tests/ (Linux) and tests/windows.
function(dibs_header_test_sources out exclude)
  file(GLOB_RECURSE headers RELATIVE ${PROJECT_SOURCE_DIR}/include CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/include/dibs/*.hpp)
  set(sources)
  # Their notes (with g++) are the old_path_note test's: not said here.
  set(forwarding_includes "#define DIBS_NO_OLD_PATH_NOTES\n")
  foreach(header IN LISTS headers)
    if(header MATCHES "/detail/" OR (NOT exclude STREQUAL "" AND header MATCHES "${exclude}"))
      continue()
    endif()
    file(STRINGS ${PROJECT_SOURCE_DIR}/include/${header} first LIMIT_COUNT 1)
    if(first MATCHES "^// Deprecated: this path forwards to")
      string(APPEND forwarding_includes "#include <${header}>\n")
      continue()
    endif()
    string(REPLACE "/" "__" id "${header}")  # dibs/imap_store.hpp and dibs/imap/store.hpp apart
    string(MAKE_C_IDENTIFIER "${id}" id)
    set(src ${CMAKE_CURRENT_BINARY_DIR}/headers/${id}.cpp)
    file(GENERATE OUTPUT ${src} CONTENT "#include <${header}>\n#include <${header}> // include guard\n")
    list(APPEND sources ${src})
  endforeach()
  set(src ${CMAKE_CURRENT_BINARY_DIR}/headers/forwarding_headers.cpp)
  file(GENERATE OUTPUT ${src} CONTENT "${forwarding_includes}")
  list(APPEND sources ${src})
  set(${out} ${sources} PARENT_SCOPE)
endfunction()
