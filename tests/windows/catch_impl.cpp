// Catch2's implementation for the Windows test programs, compiled once for
// both (and at -O0: cmake/catch-main.cmake); main.cpp has their main().
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
