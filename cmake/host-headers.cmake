# For a cross build (the windows preset): the core's header-only
# dependencies, Boost and fmt, the dibs command's CLI11, and Catch2 v2's
# single header, taken from this
# Debian machine's packages. Only their own directories are put on the
# include path (a directory of its own with links to them), never
# /usr/include, whose C library headers are Linux's. fmt is used header-only.
set(dibs_host_include ${CMAKE_BINARY_DIR}/host-include)
file(MAKE_DIRECTORY ${dibs_host_include})
foreach(dir boost fmt catch2 CLI)
  if(NOT EXISTS /usr/include/${dir})
    message(FATAL_ERROR "dibs: /usr/include/${dir} is missing: run scripts/install-deps.sh windows")
  endif()
  file(CREATE_LINK /usr/include/${dir} ${dibs_host_include}/${dir} SYMBOLIC)
endforeach()
add_library(Boost::headers INTERFACE IMPORTED)
target_include_directories(Boost::headers INTERFACE ${dibs_host_include})
add_library(fmt::fmt INTERFACE IMPORTED)
target_include_directories(fmt::fmt INTERFACE ${dibs_host_include})
target_compile_definitions(fmt::fmt INTERFACE FMT_HEADER_ONLY)
add_library(Catch2::Catch2 INTERFACE IMPORTED)
target_include_directories(Catch2::Catch2 INTERFACE ${dibs_host_include})
add_library(CLI11::CLI11 INTERFACE IMPORTED)
target_include_directories(CLI11::CLI11 INTERFACE ${dibs_host_include})
