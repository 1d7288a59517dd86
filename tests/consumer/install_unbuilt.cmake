# cmake -P: the README's install route, configured: its build builds the
# dibs command and nothing else (a dry run says so), and `cmake --install`
# of it before it is built stops before it copies anything, and says why
# (it used to copy the headers, then fail on the missing dibs command: half
# an install). How long the route takes is measured, not tested (README).
#
# In: SOURCE_DIR (dibs's tree), WORK_DIR (emptied). The preset chooses the
# generator (Ninja) and the compiler.
cmake_policy(VERSION 3.25)
file(REMOVE_RECURSE ${WORK_DIR})
# The README's install route: the install preset, here into WORK_DIR.
execute_process(COMMAND ${CMAKE_COMMAND} --preset install -B ${WORK_DIR}/build
                WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --preset install failed: ${err}")
endif()
# What its build would build (ninja -t commands: the commands of the
# default targets, run by no one): the dibs command and nothing else, no
# test, example or benchmark (it once built 65 targets).
execute_process(COMMAND ninja -C ${WORK_DIR}/build -t commands
                RESULT_VARIABLE rc OUTPUT_VARIABLE plan ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ninja -t commands in the install preset's build failed: ${err}")
endif()
string(REGEX MATCHALL " -o [^ \n]+" outputs "${plan}")
set(built)
foreach(o IN LISTS outputs)
  string(SUBSTRING "${o}" 4 -1 o)
  if(NOT o MATCHES "\\.(o|obj)$")
    list(APPEND built ${o})
  endif()
endforeach()
string(REGEX MATCHALL "\n" nsteps "${plan}")
list(LENGTH nsteps nsteps)
set(expected tools/dibs)
if("tools/dibs-postgres" IN_LIST built)
  list(APPEND expected tools/dibs-postgres)
endif()
list(SORT built)
list(SORT expected)
if(NOT built STREQUAL expected)
  message(FATAL_ERROR "the install preset builds ${built}, not only the dibs command (${expected}):\n${plan}")
endif()
message("install_unbuilt: the install preset builds only the dibs command (${nsteps} commands)")
execute_process(COMMAND ${CMAKE_COMMAND} --install ${WORK_DIR}/build --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "the install of an unbuilt tree succeeded: ${out}")
endif()
string(REGEX REPLACE "[ \n]+" " " said "${err}")
if(NOT said MATCHES "nothing was installed: .*tools/dibs is not built")
  message(FATAL_ERROR "the refusal does not say what is missing: ${err}")
endif()
if(EXISTS ${WORK_DIR}/prefix)
  file(GLOB_RECURSE left RELATIVE ${WORK_DIR}/prefix ${WORK_DIR}/prefix/*)
  message(FATAL_ERROR "a refused install left files behind: ${left}")
endif()
message("install_unbuilt: refused, nothing installed")
