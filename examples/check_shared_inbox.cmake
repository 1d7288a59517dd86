# Runs the shared_inbox demo with chaos on and checks the figures of its JSON
# summary: every message delivered and completed, no duplicate effect, every
# log line found and none torn, workers really killed and their claims
# recovered.
#
#   cmake -DDEMO=path/to/shared_inbox -DOUT=summary.json [-DSTORE=postgres -DPG_DIR=dir] -P check_shared_inbox.cmake
#
# PG_DIR: a server of scripts/pg.sh (its conninfo file).
set(messages 1500)
set(store_args)
if(STORE STREQUAL "postgres")
  file(STRINGS ${PG_DIR}/conninfo conninfo LIMIT_COUNT 1)
  set(store_args --store postgres --pg ${conninfo})
endif()
file(REMOVE ${OUT})
execute_process(COMMAND ${DEMO} ${store_args} --workers 4 --messages ${messages} --kills 8 --rate 1000 --json ${OUT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT EXISTS ${OUT})
  message(FATAL_ERROR "the demo wrote no summary (exit ${rc})")
endif()
file(READ ${OUT} json)

function(expect field op value)
  string(JSON got ERROR_VARIABLE error GET "${json}" ${field})
  if(error)
    message(FATAL_ERROR "summary has no '${field}': ${error}")
  endif()
  if(NOT got ${op} ${value})
    message(FATAL_ERROR "summary: ${field} = ${got}, expected ${op} ${value}")
  endif()
endfunction()

expect(delivered EQUAL ${messages})
expect(completed EQUAL ${messages})
expect(duplicates EQUAL 0)
expect(missing_effects EQUAL 0)
expect(lost_updates EQUAL 0)
expect(log_lines_expected EQUAL ${messages})
expect(log_lines_found EQUAL ${messages})
expect(torn EQUAL 0)
expect(stray EQUAL 0)
expect(worker_errors EQUAL 0)
expect(killed EQUAL 8)
# Killed workers held claims often enough that at least one must have been recovered;
# the exact number depends on where the kills landed.
string(JSON recovered GET "${json}" recovered)
message("claims recovered from killed workers: ${recovered}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the demo exited with ${rc} although its figures look right")
endif()
