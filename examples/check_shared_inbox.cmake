# Runs the shared_inbox demo with chaos on and checks the figures of its JSON
# summary: every message delivered and completed, no duplicate effect, every
# log line found and none torn, workers really killed and their claims
# recovered; on IMAP also every message shown done ($Completed, or in Done)
# and none found twice.
#
#   cmake -DDEMO=path/to/shared_inbox -DOUT=summary.json [-DSTORE=postgres -DPG_DIR=dir] [-DSTORE=redis -DREDIS_DIR=dir]
#         [-DSTORE=imap -DIMAP_SCRIPT=scripts/imap.sh -DIMAP_DIR=dir [-DEXCHANGE_PROXY=tests/scripts/imap_proxy.py]]
#         [-DRUNNER=launcher] [-DMESSAGES=N -DKILLS=K -DRATE=R] -P check_shared_inbox.cmake
#
# RUNNER runs the demo (scripts/wine-run.sh for the Windows build); MESSAGES,
# KILLS and RATE replace the run's size (where processes start slowly, a
# longer delivery lets the kills land while workers work).
# PG_DIR: a server of scripts/pg.sh (its conninfo file); REDIS_DIR: one of
# scripts/redis.sh (its url file). IMAP_DIR: where this
# script starts a throwaway Dovecot with IMAP_SCRIPT for the run (and stops it).
# EXCHANGE_PROXY: the demo reaches that Dovecot through the proxy, which
# makes it look like Exchange Online's IMAP (no \\* in PERMANENTFLAGS, no
# QRESYNC or CONDSTORE), with --imap-claims sqlite: the folder view, the
# claims in SQLite.
set(messages 1500)
set(kills 8)
set(rate 1000)
set(store_args)
if(STORE STREQUAL "postgres")
  file(STRINGS ${PG_DIR}/conninfo conninfo LIMIT_COUNT 1)
  set(store_args --store postgres --pg ${conninfo})
elseif(STORE STREQUAL "redis")
  file(STRINGS ${REDIS_DIR}/url url LIMIT_COUNT 1)
  set(store_args --store redis --redis ${url})
elseif(STORE STREQUAL "imap")
  # A smaller run: each message costs a few IMAP round trips. At 100 a second
  # the delivery lasts 1.2 s, and the kills land in it.
  set(messages 120)
  set(kills 4)
  set(rate 100)
  set(store_args --store imap)
  execute_process(COMMAND ${IMAP_SCRIPT} start ${IMAP_DIR} RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "cannot start the IMAP server (${IMAP_SCRIPT} start ${IMAP_DIR}): ${err}")
  endif()
  file(STRINGS ${IMAP_DIR}/env env_lines)
  foreach(line IN LISTS env_lines)
    if(line MATCHES "^(DIBS_IMAP_[A-Z]+)=(.*)$")
      set(ENV{${CMAKE_MATCH_1}} "${CMAKE_MATCH_2}")
    endif()
  endforeach()
  if(EXCHANGE_PROXY)
    # In the background (its output to files, so that execute_process
    # returns), until it says its port; stopped at the end.
    set(proxy_port_file ${IMAP_DIR}/proxy-port)
    file(REMOVE ${proxy_port_file})
    execute_process(COMMAND sh -c "python3 '${EXCHANGE_PROXY}' --to 127.0.0.1:$ENV{DIBS_IMAP_PORT} --no-star --no-qresync \
                                   >'${proxy_port_file}' 2>'${IMAP_DIR}/proxy.log' </dev/null & echo $! >'${IMAP_DIR}/proxy.pid'")
    foreach(i RANGE 300)
      if(EXISTS ${proxy_port_file})
        file(STRINGS ${proxy_port_file} proxy_port LIMIT_COUNT 1)
        if(proxy_port)
          break()
        endif()
      endif()
      execute_process(COMMAND sleep 0.1)
    endforeach()
    if(NOT proxy_port)
      execute_process(COMMAND ${IMAP_SCRIPT} stop ${IMAP_DIR})
      message(FATAL_ERROR "the proxy (${EXCHANGE_PROXY}) said no port in 30 s")
    endif()
    set(ENV{DIBS_IMAP_PORT} ${proxy_port})
    # A lease of 5 s: a message whose move to Done a kill cut short is
    # repaired a lease after its claim was completed (30 s by default).
    list(APPEND store_args --imap-claims sqlite --lease 5)
  endif()
endif()
foreach(v MESSAGES KILLS RATE)
  if(DEFINED ${v})
    string(TOLOWER ${v} lower)
    set(${lower} ${${v}})
  endif()
endforeach()
file(REMOVE ${OUT})
execute_process(COMMAND ${RUNNER} ${DEMO} ${store_args} --workers 4 --messages ${messages} --kills ${kills} --rate ${rate} --json ${OUT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(STORE STREQUAL "imap")
  if(EXCHANGE_PROXY)
    execute_process(COMMAND sh -c "kill $(cat '${IMAP_DIR}/proxy.pid')")
  endif()
  execute_process(COMMAND ${IMAP_SCRIPT} stop ${IMAP_DIR})
endif()
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
expect(killed EQUAL ${kills})
if(STORE STREQUAL "imap")
  expect(shown_completed EQUAL ${messages})
  expect(copies EQUAL 0)
endif()
# Killed workers held claims often enough that at least one must have been recovered;
# the exact number depends on where the kills landed.
string(JSON recovered GET "${json}" recovered)
message("claims recovered from killed workers: ${recovered}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the demo exited with ${rc} although its figures look right")
endif()
