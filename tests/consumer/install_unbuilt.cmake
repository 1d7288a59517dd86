# cmake -P: `cmake --install` of a build directory that was configured but
# not built stops before it copies anything, and says why (it used to copy
# the headers, then fail on the missing dibs command: half an install).
#
# In: SOURCE_DIR (dibs's tree), WORK_DIR (emptied), GENERATOR, CXX_COMPILER.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
                        -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DDIBS_BUILD_TESTS=OFF -DDIBS_BUILD_EXAMPLES=OFF
                        -DDIBS_BUILD_BENCHMARKS=OFF -DDIBS_TEST_CONSUMERS=OFF -DDIBS_TEST_HEADERS=OFF
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configure failed: ${err}")
endif()
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
