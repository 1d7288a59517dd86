# Benchmarks of marker_claim<sqlite_store> against the same work written by
# hand (benchmarks/run_sqlite_benchmarks.sh runs them; docs/BENCHMARKS.md has
# the figures).
if(TARGET dibs::sqlite)
  add_executable(sqlite_claim_single sqlite_claim_single.cpp)
  target_link_libraries(sqlite_claim_single PRIVATE dibs::sqlite benchmark::benchmark)
  add_executable(sqlite_queue_scaling sqlite_queue_scaling.cpp)
  target_link_libraries(sqlite_queue_scaling PRIVATE dibs::sqlite benchmark::benchmark)
  add_executable(sqlite_claim_procs sqlite_claim_procs.cpp)
  target_link_libraries(sqlite_claim_procs PRIVATE dibs::sqlite)
endif()
