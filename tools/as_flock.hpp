// dibs started as `flock`: util-linux flock(1)'s grammar (2.38), on the
// kernel lock of `dibs lock --kernel` (lock_kernel in platform/posix.hpp).
//
//   flock [options] FILE|DIR COMMAND [ARGS...]
//   flock [options] FILE|DIR -c STRING
//   flock [options] NUMBER
//
// Options as getopt_long("+sexnoFuw:E:hV") reads them: they end at the first
// argument that is not one; long forms may be shortened while unambiguous.
// Exit codes as flock(1)'s: 1 (or -E) on a conflict, silently; 64 bad usage;
// 65 a descriptor that is not open; 66 a lock file it may not open; 69 a
// COMMAND that cannot be run; 73 a lock file that cannot be made; otherwise
// COMMAND's status (128+N for a signal). Part of tools/dibs.cpp (POSIX only).
#pragma once

// Returns: seconds as flock(1)'s -w reads them (a decimal number, fractions
// allowed, no unit), in milliseconds rounded up so that 0.0001 still waits;
// nullopt for a negative number, which flock(1) takes and fails on later.
std::optional<milliseconds> flock_timeout(const char* text) {
  char* end = nullptr;
  errno = 0;
  const double s = std::strtod(text, &end);
  if (end == text || *end != '\0' || errno == ERANGE || !(s <= 1e9))
    fail(ex::usage, fmt::format("flock: invalid timeout value: '{}'", text));
  if (s < 0) return std::nullopt;
  const double ms = s * 1000.0;
  const auto whole = static_cast<milliseconds::rep>(ms);
  return milliseconds{whole + (static_cast<double>(whole) < ms ? 1 : 0)};
}

// Returns: `text` as flock(1)'s strtos32_or_err reads a whole number.
std::optional<int> flock_number(const char* text) {
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || n < INT32_MIN || n > INT32_MAX) return std::nullopt;
  return static_cast<int>(n);
}

void flock_usage() {
  fmt::print(R"(
Usage:
 flock [options] <file>|<directory> <command> [<argument>...]
 flock [options] <file>|<directory> -c <command>
 flock [options] <file descriptor number>

Manage file locks from shell scripts (dibs {}.{}.{}, under flock(1)'s name).

Options:
 -s, --shared             get a shared lock
 -x, --exclusive          get an exclusive lock (default)
 -u, --unlock             remove a lock
 -n, --nonblock           fail rather than wait
 -w, --timeout <secs>     wait for a limited amount of time
 -E, --conflict-exit-code <number>  exit code after conflict or timeout
 -o, --close              close file descriptor before running command
 -c, --command <command>  run a single command string through the shell
 -F, --no-fork            execute command without forking
     --verbose            increase verbosity

 -h, --help               display this help
 -V, --version            display version

The lock is flock(2)'s, as flock(1) takes it: 'dibs lock --kernel' is the
same lock under dibs's own name (docs/guide-shell.md).
)",
             DIBS_VERSION_MAJOR, DIBS_VERSION_MINOR, DIBS_VERSION_PATCH);
}

int as_flock(int argc, char** argv) {
  lock_args a;
  a.kernel = true;
  a.who = "flock";
  exec_failure_code = 69;  // EX_UNAVAILABLE: flock(1)'s "failed to execute"
  exec_failure_who = "flock";
  enum { verbose_option = 1000 };
  static const ::option long_options[] = {
      {"shared", no_argument, nullptr, 's'},
      {"exclusive", no_argument, nullptr, 'x'},
      {"unlock", no_argument, nullptr, 'u'},
      {"nonblocking", no_argument, nullptr, 'n'},
      {"nb", no_argument, nullptr, 'n'},
      {"nonblock", no_argument, nullptr, 'n'},
      {"timeout", required_argument, nullptr, 'w'},
      {"wait", required_argument, nullptr, 'w'},
      {"conflict-exit-code", required_argument, nullptr, 'E'},
      {"close", no_argument, nullptr, 'o'},
      {"no-fork", no_argument, nullptr, 'F'},
      {"verbose", no_argument, nullptr, verbose_option},
      {"help", no_argument, nullptr, 'h'},
      {"version", no_argument, nullptr, 'V'},
      {nullptr, 0, nullptr, 0},
  };
  bool negative_wait = false;
  const auto try_help = [] { std::cerr << "Try 'flock --help' for more information.\n"; };
  for (int c; (c = ::getopt_long(argc, argv, "+sexnoFuw:E:hV", long_options, nullptr)) != -1;) {
    switch (c) {
      // As flock(1): of -s, -x (-e) and -u the last one wins.
      case 's': a.shared = true, a.exclusive = a.unlock = false; break;
      case 'x':
      case 'e': a.exclusive = true, a.shared = a.unlock = false; break;
      case 'u': a.unlock = true, a.shared = a.exclusive = false; break;
      case 'n': a.nonblock = true; break;
      case 'w':
        if (const auto w = flock_timeout(::optarg)) {
          a.wait = fmt::format("{}ms", w->count());
          negative_wait = false;
        } else {
          negative_wait = true;
        }
        break;
      case 'E': {
        const auto n = flock_number(::optarg);
        if (!n) fail(ex::usage, fmt::format("flock: invalid exit code: '{}'", ::optarg));
        if (*n < 0 || *n > 255) fail(ex::usage, "flock: exit code out of range (expected 0 to 255)");
        a.conflict_code = *n;
        break;
      }
      case 'o': a.close = true; break;
      case 'F': a.no_fork = true; break;
      case verbose_option: a.verbose = true; break;
      case 'h': flock_usage(); return ex::ok;
      case 'V':
        fmt::print("flock from dibs {}.{}.{}\n", DIBS_VERSION_MAJOR, DIBS_VERSION_MINOR, DIBS_VERSION_PATCH);
        return ex::ok;
      default: try_help(); return ex::usage;  // getopt has said what was wrong
    }
  }
  if (a.no_fork && a.close) fail(ex::usage, "flock: the --no-fork and --close options are incompatible");
  const int rest = argc - ::optind;
  if (rest >= 2) {
    a.path = argv[::optind];
    const std::string_view next{argv[::optind + 1]};
    if (next == "-c" || next == "--command") {
      if (rest != 3) fail(ex::usage, fmt::format("flock: {} requires exactly one command argument", next));
      a.command = shell_command(argv[::optind + 2]);
      a.shell = true;
    } else {
      // Everything after FILE is COMMAND, a "--" too (flock(1) runs it).
      a.command.assign(argv + ::optind + 1, argv + argc);
    }
  } else if (rest == 1) {
    const auto fd = flock_number(argv[::optind]);
    if (!fd) fail(ex::usage, fmt::format("flock: bad file descriptor: '{}'", argv[::optind]));
    if (*fd < 0) fail(ex::dataerr, fmt::format("flock: {}: Bad file descriptor", *fd));
    a.fd = *fd;
  } else {
    std::cerr << "flock: not enough arguments\n";
    try_help();
    return ex::usage;
  }
  if (negative_wait) {
    // flock(1) opens (makes) the file, then hands the negative time to
    // setitimer, which refuses it: EX_OSERR.
    if (a.fd < 0) ::close(open_lock_path(a));
    constexpr int oserr = 71;
    fail(oserr, "flock: cannot set up timer: Invalid argument");
  }
  return cmd_lock(a);
}
