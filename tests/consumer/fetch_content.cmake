# cmake -DSOURCE_DIR=... -DWORK_DIR=... -DSNIPPET=... -DGENERATOR=... -DCXX_COMPILER=... -P fetch_content.cmake
#
# Makes a git repository of the source tree as it is now (committed or not:
# the copy is committed on a branch `main`), then builds and runs the
# consumer project through the README's FetchContent snippet pointed at it
# (file://, no network). What a user does with their mirror of dibs.
cmake_minimum_required(VERSION 3.21)
find_package(Git REQUIRED)

set(repo ${WORK_DIR}/repo)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${repo})
file(GLOB items RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/*)
foreach(item IN LISTS items)
  # build: the presets' build trees; any other build tree in the source
  # tree (cmake -B build-x) would otherwise be copied into itself, recursively.
  if(NOT item MATCHES "^(\\.git|build)$" AND NOT EXISTS ${SOURCE_DIR}/${item}/CMakeCache.txt)
    file(COPY ${SOURCE_DIR}/${item} DESTINATION ${repo})
  endif()
endforeach()

function(git)
  execute_process(COMMAND ${GIT_EXECUTABLE} -c user.name=dibs-test -c user.email=dibs-test@localhost
                          ${ARGN}
                  WORKING_DIRECTORY ${repo} OUTPUT_QUIET COMMAND_ERROR_IS_FATAL ANY)
endfunction()
git(init -q -b main)
git(add -A)
git(commit -q -m "dibs as it is under test")

file(READ ${SNIPPET} snippet)
string(REGEX REPLACE "GIT_REPOSITORY [^ \n)]+" "GIT_REPOSITORY file://${repo}" snippet "${snippet}")
file(WRITE ${WORK_DIR}/fetch_dibs.cmake "${snippet}")
message(STATUS "the README's snippet, as tested:\n${snippet}")

execute_process(COMMAND ${CMAKE_CTEST_COMMAND} --build-and-test ${CMAKE_CURRENT_LIST_DIR} ${WORK_DIR}/build
                        --build-generator ${GENERATOR}
                        --build-options -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DDIBS_CONSUME=FetchContent
                                        -DDIBS_FETCH_SNIPPET=${WORK_DIR}/fetch_dibs.cmake
                        --test-command consumer
                COMMAND_ERROR_IS_FATAL ANY)
