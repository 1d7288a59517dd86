# Benchmarks of dibs::file_mutex and dibs::shared_log against the kernel
# floor, Boost.Interprocess and the lock-file idiom. Run them all with
# benchmarks/run_lock_benchmarks.sh; the figures are in docs/BENCHMARKS.md.

# Single-process figures (Google Benchmark).
add_executable(file_mutex_uncontended ${CMAKE_CURRENT_LIST_DIR}/file_mutex_uncontended.cpp)
target_link_libraries(file_mutex_uncontended PRIVATE dibs::dibs benchmark::benchmark)

# Multi-process figures (fork-based harnesses of their own).
add_executable(file_mutex_contended ${CMAKE_CURRENT_LIST_DIR}/file_mutex_contended.cpp)
target_link_libraries(file_mutex_contended PRIVATE dibs::dibs)

add_executable(shared_log_throughput ${CMAKE_CURRENT_LIST_DIR}/shared_log_throughput.cpp)
target_link_libraries(shared_log_throughput PRIVATE dibs::dibs)

if(TARGET dibs_warnings)
  foreach(t file_mutex_uncontended file_mutex_contended shared_log_throughput)
    target_link_libraries(${t} PRIVATE dibs_warnings)
  endforeach()
endif()
