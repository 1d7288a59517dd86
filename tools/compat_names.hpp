// dibs started under another tool's name (busybox style: argv[0]'s basename
// is flock, lockfile or dotlockfile) reads that tool's command line and
// exits with its codes, on the locks dibs already has: flock(1) on the
// kernel lock of `dibs lock --kernel`, procmail's lockfile(1) and
// liblockfile's dotlockfile on the presence lock of `dibs lock --dot`
// (dibs::dot_lock). One file per name (as_flock.hpp, as_lockfile.hpp,
// as_dotlockfile.hpp); what they share is here. docs/guide-shell.md says
// where each differs from the real tool, and why. Part of tools/dibs.cpp,
// included after the lock code it reuses; POSIX only (run() refuses the
// names on Windows, which has none of these tools).
#pragma once

// Runs `body`, a name's whole run; an error it throws is said on standard
// error as `name`'s (its "dibs lock: " or "dibs: " read as "name: "), unless
// `quiet`. Returns: body's exit code, or the error's, as `code_for` maps
// dibs's code (ex::usage, ex::noinput, ...) to the tool's.
template <class Body, class Map>
int as_tool(std::string_view name, const bool& quiet, Body&& body, Map&& code_for) {
  const auto say = [&](std::string msg) {
    if (quiet) return;
    for (const std::string_view prefix : {"dibs lock: ", "dibs: "})
      if (msg.rfind(prefix, 0) == 0) {
        msg = std::string{name} + ": " + msg.substr(prefix.size());
        break;
      }
    std::cerr << msg << '\n';
  };
  try {
    return body();
  } catch (const failure& f) {
    say(f.msg);
    return code_for(f.code);
  } catch (const std::system_error& e) {
    const auto [code, hint] = classify(e);
    say(fmt::format("dibs: {}{}", e.what(), hint ? fmt::format(" ({})", hint) : ""));
    return code_for(code);
  } catch (const std::exception& e) {
    say(fmt::format("dibs: {}", e.what()));
    return code_for(ex::software);
  }
}

// A presence lock that lockfile and dotlockfile take and leave behind when
// they end (or remove, lockfile's earlier files, when a later one fails):
// `args` says how it is waited for, `kind` holds it. Not movable (kind
// refers to args): keep them in a std::list.
struct left_lock {
  lock_args args;
  dot_kind kind{args, {}};
};

// Takes `l` for process `behalf` (0: this one) the way its args say: a try,
// then a pause and another try, -r times (-1: forever), in acquire(), the
// loop of `dibs lock --dot -r`. A signal (INT, TERM, HUP, QUIT, USR1, USR2)
// ends a pause, and the wait.
// Returns: whether it was taken, or 128+N for signal N.
std::variant<bool, int> take_presence(left_lock& l, dibs::process_id behalf) {
  l.kind.open(behalf);
  return acquire(l.args, std::nullopt, l.kind, [](milliseconds d) { return sleep_unless_signalled(d); },
                 // Unused: these names always give -r, and acquire's one
                 // long wait (and its watch) is for -w alone.
                 [](std::stop_source) { return std::unique_ptr<int>{}; });
}

#include "as_dotlockfile.hpp"
#include "as_flock.hpp"
#include "as_lockfile.hpp"

// Returns: the exit code of dibs run as the tool `name` (a compat_name).
int run_as(std::string_view name, int argc, char** argv) {
  if (name == "flock") {
    const bool quiet = false;  // flock(1)'s codes are dibs lock --kernel's
    return as_tool(name, quiet, [&] { return as_flock(argc, argv); }, [](int code) { return code; });
  }
  if (name == "lockfile") return as_lockfile(argc, argv);
  return as_dotlockfile(argc, argv);
}
