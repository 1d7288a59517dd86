# Benchmarks of dibs::lock_file, marker_claim and the stores (see
# docs/benchmarks-history.md; benchmarks/run_store_benchmarks.sh runs them all).
#
# The liblockfile comparison is built only where the library and its header
# are found (Debian: liblockfile-dev), so the default build never needs it.

find_library(DIBS_BENCH_LIBLOCKFILE NAMES lockfile)
find_path(DIBS_BENCH_LIBLOCKFILE_INCLUDE NAMES lockfile.h)
if(DIBS_BENCH_LIBLOCKFILE AND DIBS_BENCH_LIBLOCKFILE_INCLUDE)
  set(dibs_bench_have_liblockfile 1)
  message(STATUS "dibs store benchmarks: liblockfile comparison on (${DIBS_BENCH_LIBLOCKFILE})")
else()
  set(dibs_bench_have_liblockfile 0)
  message(STATUS "dibs store benchmarks: liblockfile not found, its comparison is left out")
endif()

function(dibs_store_benchmark name)
  add_executable(${name} ${name}.cpp)
  target_link_libraries(${name} PRIVATE dibs::dibs ${ARGN})
  # Designated initialisers that leave members out are meant here.
  target_compile_options(${name} PRIVATE -Wall -Wextra -Wno-missing-field-initializers)
  target_compile_definitions(${name} PRIVATE DIBS_BENCH_HAVE_LIBLOCKFILE=${dibs_bench_have_liblockfile})
  if(dibs_bench_have_liblockfile)
    target_include_directories(${name} PRIVATE ${DIBS_BENCH_LIBLOCKFILE_INCLUDE})
    target_link_libraries(${name} PRIVATE ${DIBS_BENCH_LIBLOCKFILE})
  endif()
endfunction()

# 1. Uncontended lock+unlock against the open(O_EXCL)+close+unlink floor (Google Benchmark).
dibs_store_benchmark(store_lock_uncontended benchmark::benchmark)
# 1b. A plain loop of N lock+unlock, to count system calls with strace -c.
dibs_store_benchmark(store_lock_loop)
# 2. N processes fighting over one lock: throughput and handoff latency.
dibs_store_benchmark(store_lock_contended)
# 2b. The floor of a handoff: a futex round-robin of N processes, no lock record
# (benchmarks/run_handoff_benchmarks.sh runs it beside store_lock_contended).
dibs_store_benchmark(handoff_floor)
# 3. marker_claim claim+complete on file_store and shm_store.
dibs_store_benchmark(store_marker_claim)
# 3b. claim_next + complete on file_store's queue view at 1,000 to 100,000 items queued.
dibs_store_benchmark(file_claim_next benchmark::benchmark)
# 4. lease_semaphore acquire+release against lease_mutex and lock_file, uncontended.
# 4b. P processes sharing N permits against P sharing one lock: throughput, and
# how many held at once (benchmarks/run_semaphore_benchmarks.sh).
if(TARGET dibs::sqlite)
  dibs_store_benchmark(semaphore_uncontended benchmark::benchmark dibs::sqlite)
  dibs_store_benchmark(semaphore_contended dibs::sqlite)
endif()
