// The Windows test program's main(): a helper role when the first argument
// names one (win_support.hpp), else the Catch2 session. Compiled once for
// both Windows test programs, with Catch2's implementation, at -O0
// (cmake/catch-main.cmake).
#define CATCH_CONFIG_RUNNER
#include "win_support.hpp"

int main(int argc, char** argv) {
  if (argc >= 2) {
    const auto r = win_test::roles().find(argv[1]);
    if (r != win_test::roles().end()) return r->second(argc - 2, argv + 2);
  }
  return Catch::Session().run(argc, argv);
}
