# dibs_plain_catch_main(TARGET): TARGET (an object library of Catch2's
# implementation: its runner, reporters and test registry) compiled at -O0
# and without a sanitizer. At -O3 it is the slowest object of a test build
# after the test programs themselves (about 18 s with g++, 65 s with clang,
# over 100 s under -fsanitize=thread on 2 loaded cores); the tests' own code,
# which does the work and the checking, keeps its preset's options. Catch2
# v2 runs its runner on one thread, so the thread sanitizer loses nothing by
# not instrumenting it; -fno-sanitize=all is accepted by g++ and clang++.
function(dibs_plain_catch_main target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -O0 -fno-sanitize=all)
  endif()
endfunction()
