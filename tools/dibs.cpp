// dibs: the command for shell scripts. lock, log, claim, retry and status
// over the dibs library (docs/guide-shell.md has the whole story; exit codes
// are listed once, in exit_codes below, and printed by `dibs --help`).
// The system calls are in tools/platform/{posix,win32}.hpp (docs/windows.md
// says what differs on Windows).
#if defined(_WIN32)
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#include <shellapi.h>
#else
#include <fcntl.h>
#include <getopt.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;
#endif

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <iostream>
#include <list>
#include <optional>
#include <regex>
#include <span>
#include <string>
#include <string_view>
#include <stop_token>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/dot_lock.hpp>
#include <dibs/error.hpp>
#include <dibs/file_mutex.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/lease_mutex.hpp>
#include <dibs/lease_semaphore.hpp>
#include <dibs/lock_file.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/once.hpp>
#include <dibs/shared_log.hpp>
#include <dibs/text.hpp>
#include <dibs/version.hpp>
#ifdef DIBS_TOOL_SQLITE
#include <dibs/stores/sqlite_store.hpp>
#endif
#ifdef DIBS_TOOL_POSTGRES
#include <dibs/stores/postgres_store.hpp>
#endif


namespace {

char** program_argv = nullptr;  // for dibs-postgres, which gets them as they came

using std::chrono::milliseconds;
using steady = std::chrono::steady_clock;

// The exit codes, in one place: `dibs --help` prints this table, and the
// guide copies it.
namespace ex {
constexpr int ok = 0;
// dibs status of a lock file (lease or presence): 0 held, 1 free (no record,
// or its holder is gone), 2 expired (its holder stopped renewing; the next
// lock breaks it after a lease).
constexpr int status_free = 1;
constexpr int status_expired = 2;
constexpr int conflict = 1;        // lock: held by another (-n, or --wait or -r ran out); see --conflict-exit-code
constexpr int completed = 10;      // claim: the item is already completed
constexpr int taken = 11;          // claim: another worker holds the item (or its record is busy)
constexpr int failed = 12;         // claim: the item failed for good (max attempts reached earlier)
constexpr int damaged = 13;        // claim: the item's record is damaged or not a claim
constexpr int empty = 14;          // claim --next, work: nothing claimable under the prefix
constexpr int claim_lost = 15;     // claim, work: COMMAND succeeded but the claim was taken over before completion
constexpr int lock_lost = 15;      // lock: the lease lock was lost (taken over, or its lease ran out) during the run
constexpr int too_late = 16;       // once: the slot is older than the slots kept (a clock far behind)
constexpr int usage = 64;          // EX_USAGE: bad arguments, unknown store scheme, no COMMAND
constexpr int dataerr = 65;        // EX_DATAERR: the file at the path is not a dibs record; offer: a bad line
constexpr int noinput = 66;        // EX_NOINPUT: a missing file or directory
constexpr int unavailable = 69;    // EX_UNAVAILABLE: a store server cannot be reached
constexpr int software = 70;       // EX_SOFTWARE: an internal error (a bug: please report it)
constexpr int cantcreat = 73;      // EX_CANTCREAT: lock --kernel: the lock file cannot be made (read-only or full filesystem)
constexpr int ioerr = 74;          // EX_IOERR: an I/O error
constexpr int tempfail = 75;       // EX_TEMPFAIL: a transient failure (timed out, busy); try again
constexpr int noperm = 77;         // EX_NOPERM: permission denied
constexpr int cannot_exec = 126;   // COMMAND found but not executable
constexpr int not_found = 127;     // COMMAND not found
}  // namespace ex

// Where the guides are installed (cmake --install: share/doc/dibs).
#ifndef DIBS_DOCDIR
#define DIBS_DOCDIR "the docs/ folder of dibs's sources"
#endif

constexpr const char* exit_code_table = R"(Exit codes (every subcommand):
  0        success; with a COMMAND: COMMAND's own exit status
  1        lock: the lock is held by another (-n, or --wait or --dot's -r ran out); change with -E
  0,1,2    status of a lock file: 0 held, 1 free (no holder, or it is gone), 2 expired (its
           holder stopped renewing: the next lock breaks it after a lease)
  10-15    claim's own outcomes below; COMMAND's status is passed through unchanged,
           so if COMMAND may exit 10-15 too, move these with claim --exit-base N
  10       claim: the item is already completed (nothing run)
  11       claim: another worker holds the item (nothing run)
  12       claim: the item failed for good earlier (nothing run)
  13       claim: the item's record is damaged or not a dibs claim (nothing run)
  14       claim --next, work: nothing claimable under the prefix (work: nothing run at all)
  15       claim, work: COMMAND exited 0 but the claim was taken over first (not completed);
           lock: the lease lock was lost during the run (taken over, or its lease ran out
           unrenewed, e.g. dibs was stopped), whatever COMMAND's status; said on stderr
  10-13,15 once: as for claim, of the slot: 10 another host ran it, 11 another host runs
           it now, 12 it failed for good, 13 its record is damaged, 15 taken over
  16       once: the slot is older than the slots kept (--keep): this host's clock is far
           behind the others' (nothing run)
  64       usage: bad arguments, unknown store scheme, no COMMAND, a connection string
           libpq cannot parse
  65       the file at the path is not a dibs record (another tool's file? not a SQLite
           database? an empty flock(1) lock file?), or a FIFO; offer: an empty line, a key
           too long or given twice on standard input (nothing offered)
  66       a missing file or directory; lock --kernel: a lock file it may not open, as flock(1)
  69       a store server cannot be reached
  70       internal error (please report it)
  73       lock --kernel: the lock file cannot be made (read-only or full filesystem), as flock(1)
  74       I/O error; also: what dibs wrote to standard output did not get there
  75       transient failure (timed out, busy): try again later
  77       permission denied; a PostgreSQL login refused (wrong password, no such role)
  126/127  COMMAND not executable / not found
  128+N    COMMAND (or, for retry, the wait) ended by signal N; work: stopped by signal N
)";

#if !defined(_WIN32)
// The exit status of a COMMAND that cannot be run: 0 for the shell's (127
// not found, 126 otherwise); flock(1)'s name sets 69 and dotlockfile's 127,
// as those tools exit.
int exec_failure_code = 0;
const char* exec_failure_who = "dibs";  // what its message begins with: the name dibs runs as
#endif

// An error that ends the program with `code` after printing `msg`.
struct failure {
  int code;
  std::string msg;
};

[[noreturn]] void fail(int code, std::string msg) { throw failure{code, std::move(msg)}; }

// Returns: the file `s` names (UTF-8, as dibs keeps its arguments; on
// Windows a std::string would be read in the ANSI code page).
std::filesystem::path native_path(const std::string& s) {
#if defined(_WIN32)
  return std::filesystem::path{std::u8string(s.begin(), s.end())};
#else
  return s;
#endif
}

// Returns: the first `size` bytes of the file `path` ("" if it cannot be
// read), opened as dot_lock's waiters open it: on Windows sharing reads,
// writes and deletes, since its holder keeps it open for deletion.
std::string read_head(const std::filesystem::path& path, std::size_t size) {
  std::string text(size, '\0');
#if defined(_WIN32)
  const HANDLE h = ::CreateFileW(path.c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                                 nullptr, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr);
  DWORD n = 0;
  if (h == INVALID_HANDLE_VALUE) return {};
  if (!::ReadFile(h, text.data(), static_cast<DWORD>(size), &n, nullptr)) n = 0;
  ::CloseHandle(h);
  text.resize(n);
#else
  // O_NONBLOCK: a FIFO put at the path must not hold dibs in open().
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return {};
  struct ::stat st {};
  ssize_t n = 0;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    while ((n = ::read(fd, text.data(), size)) < 0 && errno == EINTR) {
    }
  }
  ::close(fd);
  text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
#endif
  return text;
}

// Refuses a FIFO or a socket at `path` (a user's path that dibs would open):
// opening one waits for a peer, for ever. `who`: "dibs status" etc.
void refuse_special(const char* who, const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(native_path(path), ec);
  if (ec) return;  // missing, or not to be looked at: the open says why
  if (std::filesystem::is_fifo(st) || std::filesystem::is_socket(st))
    fail(ex::dataerr, fmt::format("{}: '{}' is a {}, not a file dibs can use: give the path of a regular file", who,
                                  path, std::filesystem::is_fifo(st) ? "FIFO (named pipe)" : "socket"));
}

// Returns: `text` with the library's C++ names in its messages
// ("dibs::file_store: cannot create ...", "dibs::marker_claim<...> 'k'")
// said in words ("file store: cannot create ..."): a script's user reads
// what failed and where, not a class. The messages keep the rest (the file,
// the key, what to do).
std::string plain_names(std::string text) {
  static const std::pair<const char*, const char*> words[] = {
      {"file_store", "file store"},       {"sqlite_store", "SQLite store"}, {"postgres_store", "PostgreSQL store"},
      {"imap_store", "IMAP store"},       {"shm_store", "shared-memory store"}, {"memory_store", "memory store"},
      {"marker_claim", "claim"},          {"lease_semaphore", "semaphore"}, {"lease_mutex", "lock"},
      {"lock_file", "lock file"},         {"file_mutex", "lock file"},    {"dot_lock", "lock file"},
      {"shared_log", "log"},              {"worker_pool", "worker pool"}, {"once", "schedule"},
      {"exponential_backoff", "backoff"}, {"retry", "retry"},             {"imap", "IMAP"}};
  static const std::regex cxx_name{R"(dibs::([a-z_]+)(<[^>\s]*>)?)"};
  std::string out;
  auto from = text.cbegin();
  for (std::sregex_iterator it{text.cbegin(), text.cend(), cxx_name}, end; it != end; ++it) {
    const auto& m = *it;
    out.append(from, m[0].first);
    const std::string name = m[1].str();
    const auto w = std::find_if(std::begin(words), std::end(words), [&](const auto& p) { return name == p.first; });
    out += w != std::end(words) ? std::string(w->second) : m[0].str();
    from = m[0].second;
  }
  out.append(from, text.cend());
  return out;
}

// Returns: `text` with every password it holds replaced by ***: the value
// of a conninfo key `password=...` (quoted or not; also a URI's
// ?password=...), and the password of a URI's user:password@; and the
// library's C++ names said in words (plain_names). Every message dibs
// prints goes through it: a store string may hold a secret.
std::string redact(std::string text) {
  static const std::regex key_value{R"((password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&#']*))", std::regex::icase};
  static const std::regex userinfo{R"((://[^\s/?#@:]*:)[^\s/?#@]*@)"};
  text = std::regex_replace(text, key_value, "$1***");
  return plain_names(std::regex_replace(text, userinfo, "$1***@"));
}

// Returns: the exit code for a library error, and a hint of what to do.
std::pair<int, const char*> classify(const std::system_error& e) {
  const auto& c = e.code();
#ifdef DIBS_TOOL_SQLITE
  // SQLite's own codes: only BUSY and LOCKED are transient (75, below).
  if (c.category() == dibs::sqlite::category()) switch (c.value() & 0xff) {
      case SQLITE_NOTADB:
      case SQLITE_CORRUPT: return {ex::dataerr, "give the path of a dibs SQLite database, or of a file to create"};
      case SQLITE_CANTOPEN: return {ex::noinput, nullptr};
      case SQLITE_PERM:
      case SQLITE_READONLY:
      case SQLITE_AUTH: return {ex::noperm, nullptr};
      case SQLITE_FULL:
      case SQLITE_IOERR: return {ex::ioerr, nullptr};
      default: break;
    }
#endif
#ifdef DIBS_TOOL_POSTGRES
  // A login the server refused (a wrong password, no such role) and a
  // missing database are for good: a retry cannot help.
  if (c == dibs::postgres::make_error_code("28P01") || c == dibs::postgres::make_error_code("28000"))
    return {ex::noperm, nullptr};
  if (c == dibs::postgres::make_error_code("3D000")) return {ex::noinput, nullptr};
#endif
#if defined(_WIN32)
  // GetLastError() codes: the C library's errno names do not match them.
  if (c.category() == std::system_category()) switch (c.value()) {
      case ERROR_FILE_NOT_FOUND:
      case ERROR_PATH_NOT_FOUND:
      case ERROR_INVALID_DRIVE:
      case ERROR_BAD_NETPATH: return {ex::noinput, nullptr};
      case ERROR_ACCESS_DENIED:
      case ERROR_WRITE_PROTECT: return {ex::noperm, "is it writable by this user?"};
      default: break;
    }
#endif
  if (c == dibs::errc::corrupt_record)
    return {ex::dataerr, "it is not a dibs record: is the path right, or was the file made by another tool?"};
  if (c == dibs::errc::invalid_argument || c == std::errc::invalid_argument) return {ex::usage, "see --help"};
  if (c == dibs::errc::connection_lost) return {ex::unavailable, "is the server up and the connection string right?"};
  if (c == std::errc::no_such_file_or_directory || c == std::errc::not_a_directory) return {ex::noinput, nullptr};
  if (c == std::errc::permission_denied || c == std::errc::operation_not_permitted ||
      c == std::errc::read_only_file_system)
    return {ex::noperm, "is it writable by this user?"};
  if (dibs::is_transient(c)) return {ex::tempfail, "try again later"};
  if (c.category() == std::system_category() || c.category() == std::generic_category())
    return {ex::ioerr, nullptr};
  return {ex::unavailable, nullptr};
}

// Durations as flock(1) and timeout(1) take them: a bare number is seconds
// (fractions allowed); suffixes ms, s, m, h.
milliseconds parse_duration(const std::string& what, const std::string& s) {
  std::size_t end = 0;
  double n = 0;
  try {
    n = std::stod(s, &end);
  } catch (...) {
    end = 0;
  }
  const std::string unit = s.substr(end);
  double scale = unit.empty() || unit == "s" ? 1000.0 : unit == "ms" ? 1.0 : unit == "m" ? 60'000.0 : unit == "h" ? 3'600'000.0 : -1.0;
  if (end == 0 || scale < 0 || !(n >= 0) || n > 1e9)
    fail(ex::usage, fmt::format("{}: '{}' is not a duration; write e.g. 10s, 500ms, 2m, 1h or 1.5 (seconds)", what, s));
  return milliseconds{static_cast<milliseconds::rep>(n * scale + 0.5)};
}

// Sizes: a bare number of bytes, or with K, M, G (powers of 1024).
std::uint64_t parse_size(const std::string& what, const std::string& s) {
  std::size_t end = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(s, &end);
  } catch (...) {
    end = 0;
  }
  const std::string unit = s.substr(end);
  const std::uint64_t scale = unit.empty() ? 1 : unit == "K" || unit == "k" ? 1024 : unit == "M" ? 1024 * 1024
                              : unit == "G"                                 ? 1024ull * 1024 * 1024
                                                                            : 0;
  if (end == 0 || scale == 0 || s[0] == '-') fail(ex::usage, fmt::format("{}: '{}' is not a size; write e.g. 1048576, 512K, 10M or 1G", what, s));
  return n * scale;
}

// ---------------------------------------------------------------------------
// dibs lock

// Stores by name (below): dibs lock --max --store keeps a semaphore in one.
bool is_store_spec(const std::string& t);
template <class F>
int with_store(const std::string& spec, F&& f, bool read_only = false);

struct lock_args {
  std::string path;
  std::vector<std::string> command;
  bool nonblock = false;
  std::string wait;
  int conflict_code = ex::conflict;
  bool kernel = false;
  bool dot = false;
  std::string lease = "10s";
  std::uint32_t max = 0;  // --max N: one of N permits (dibs::lease_semaphore) instead of the lock; 0: not given
  bool resize = false;    // --resize: set the semaphore's N to --max first, for every user
  std::string store;      // --store STORE: with --max, the semaphore PATH is kept in STORE
  // flock(1)'s
  bool shared = false;
  bool exclusive = false;
  bool unlock = false;
  bool close = false;     // -o: COMMAND does not get the lock
  bool no_fork = false;   // -F: dibs becomes COMMAND
  bool verbose = false;
  bool version = false;   // -V
  std::string command_string;  // -c STRING: run by $SHELL -c (as flock(1)), or sh
  bool has_command_string = false;
  bool shell = false;     // COMMAND is shell_command(STRING) of -c STRING
  int fd = -1;            // --fd N, or the descriptor form 'dibs lock --kernel N'
  // lockfile(1)'s and dotlockfile's, for --dot
  int retries = -2;       // -r N; -1: forever; -2: not given
  std::string sleep;      // -i/--sleep between retries
  std::string stale;      // -l: a lock file older than this is stale (unless its holder lives and touches it)
  bool pid = false;       // -p: the pid is always recorded; accepted for dotlockfile's scripts
  // For the flock, lockfile and dotlockfile names (tools/compat_names.hpp):
  std::string who = "dibs lock";  // what --verbose's lines begin with ("flock" under that name)
  std::optional<dibs::dot_lock_options> dot_options;  // the presence lock's, instead of -l's
  std::function<milliseconds(int)> pause_for;  // the pause before retry n, instead of --sleep's
};

// --verbose, as flock(1) says it (on standard output).
void say_took(const lock_args& a, steady::time_point start) {
  if (!a.verbose) return;
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(steady::now() - start).count();
  fmt::print("{}: getting lock took {}.{:06} seconds\n", a.who, us / 1'000'000, us % 1'000'000);
  std::fflush(stdout);
}
void say_executing(const lock_args& a) {
  if (!a.verbose || a.command.empty()) return;
  fmt::print("{}: executing {}\n", a.who, a.command[0]);
  std::fflush(stdout);  // before fork or exec: nothing buffered is printed twice or lost
}

std::string conflict_message(const std::string& path, const std::optional<dibs::lock_holder>& h, bool waited) {
  return fmt::format("dibs lock: '{}' is held{}{}; {}", path, h ? fmt::format(" by {}", *h) : std::string{},
                     waited ? " (--wait ran out)" : "",
                     "wait longer (-w), or see who holds it with 'dibs status " + path + "'");
}

// The two locks dibs holds on behalf of COMMAND (below): the lease lock and
// the presence lock (--dot). Each: open(pid) makes the lock for that
// process, try_for(d) tries (once if d is 0), conflict(waited) says who
// holds it, token() is the fencing token if the lock has one, unlock().
struct lease_kind {
  lease_kind(const lock_args& args, std::function<void()> lost) : a(args), on_lost(std::move(lost)) {}
  const lock_args& a;
  std::function<void()> on_lost;  // from the library's renewal thread
  std::optional<dibs::lock_file> lk;
  void open(dibs::process_id behalf) {
    const milliseconds lease = parse_duration("--lease", a.lease);
    if (lease < milliseconds{300}) fail(ex::usage, "dibs lock: --lease must be at least 300ms");
    lk.emplace(native_path(a.path), dibs::lease_options{.lease = lease, .on_lost = on_lost,
                                           .on_behalf_of = behalf});
  }
  bool try_for(milliseconds d) { return d.count() == 0 ? lk->try_lock() : lk->try_lock_for(d); }
  // One wait, up to `d` (forever if none), in one place of the waiter queue
  // throughout. Throws: errc::cancelled once a stop is requested through `st`.
  bool wait_for(std::optional<milliseconds> d, std::stop_token st) {
    if (!d) return lk->lock(st), true;
    return lk->try_lock_for(*d, st);
  }
  // Returns: true if the hold was lost at any time (taken over, or its lease
  // ran out unrenewed), also if nobody has noticed it yet.
  bool lost() const { return lk->lost(); }
  std::string conflict(bool waited) {
    std::optional<dibs::lock_holder> h;
    try {
      h = lk->holder();
    } catch (...) {
    }
    return conflict_message(a.path, h, waited);
  }
  std::optional<dibs::version> token() { return lk->token(); }
  std::optional<std::uint32_t> permit() { return std::nullopt; }
  void unlock() { lk->unlock(); }  // a compare-and-set: a lock taken over is left to its new holder
};

// --max N: one of the N permits of a semaphore (dibs::lease_semaphore), as
// the lease lock is one permit: the same lease, renewal, proof rule and
// fencing token (per permit), and the same waiter queue. The semaphore is
// kept in the directory PATH (a file_store there, the semaphore named
// after the directory), or with --store in that STORE, named PATH (for
// hosts that share a database).
template <class Store = dibs::file_store>
struct permit_kind {
  using semaphore = dibs::lease_semaphore<Store>;
  // As lease_kind is made (args, on_lost), and --store's store.
  permit_kind(const lock_args& args, std::function<void()> lost, Store* given = nullptr)
      : a(args), on_lost(std::move(lost)), store(given) {}
  const lock_args& a;
  std::function<void()> on_lost;  // from the library's renewal thread
  Store* store;                   // --store's; else the directory's (own)
  std::optional<dibs::file_store> own;
  std::string name;
  std::optional<semaphore> sem;
  typename semaphore::permit held;

  // The semaphore's name in its directory: the directory's own name.
  static std::string name_of(const std::string& path) {
    auto p = std::filesystem::absolute(native_path(path)).lexically_normal();
    if (!p.has_filename()) p = p.parent_path();  // "dir/" names dir
    return p.filename().string();
  }
  // How a message names the semaphore, and the options that name it again.
  std::string where() const { return a.store.empty() ? a.path : fmt::format("{} in {}", a.path, a.store); }
  std::string again() const { return a.store.empty() ? a.path : fmt::format("--store '{}' {}", a.store, a.path); }
  void open(dibs::process_id behalf) {
    const milliseconds lease = parse_duration("--lease", a.lease);
    if (lease < milliseconds{300}) fail(ex::usage, "dibs lock: --lease must be at least 300ms");
    if (store) {
      name = a.path;
    } else {
      if constexpr (std::is_same_v<Store, dibs::file_store>) {
        const auto dir = native_path(a.path);
        std::error_code ec;
        if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec))
          fail(ex::dataerr, fmt::format("dibs lock --max: '{}' is a file; --max keeps its permits in a directory of "
                                        "their own: give a directory's path (dibs makes it)",
                                        a.path));
        if (!std::filesystem::create_directory(dir, ec) && ec)
          fail(ex::noinput, fmt::format("dibs lock --max: cannot make the directory '{}': {}", a.path, ec.message()));
        name = name_of(a.path);
        if (name.empty() || name == "." || name == "..")
          fail(ex::usage, fmt::format("dibs lock --max: '{}' names no directory of its own; give e.g. "
                                      "/run/lock/exports",
                                      a.path));
        store = &own.emplace(dir);
      }
    }
    if (a.resize) {
      try {
        (void)semaphore::resize(*store, name, a.max);
      } catch (const std::system_error& e) {
        if (e.code() != dibs::errc::invalid_argument || semaphore::inspect(*store, name)) throw;
        // None yet: opening it below makes it with --max permits.
      }
    }
    try {
      sem.emplace(*store, name, a.max, dibs::lease_options{.lease = lease, .on_lost = on_lost, .on_behalf_of = behalf});
    } catch (const std::system_error& e) {
      const auto st = e.code() == dibs::errc::invalid_argument ? semaphore::inspect(*store, name) : std::nullopt;
      if (!st || st->permits == a.max) throw;
      fail(ex::usage, fmt::format("dibs lock --max {}: '{}' has {} permits, not {}: give --max {}, or change it for "
                                  "every user with 'dibs lock --max {} --resize {} -- COMMAND' (holders of permits "
                                  "above the new number keep them until they end)",
                                  a.max, where(), st->permits, a.max, st->permits, a.max, again()));
    }
  }
  bool try_for(milliseconds d) {
    held = d.count() == 0 ? sem->try_acquire() : sem->try_acquire_for(d);
    return bool(held);
  }
  bool wait_for(std::optional<milliseconds> d, std::stop_token st) {
    held = d ? sem->try_acquire_for(*d, st) : sem->acquire(st);
    return bool(held);
  }
  bool lost() const { return held.lost(); }
  std::string conflict(bool waited) {
    std::string who;
    try {
      for (const auto& h : sem->holders())
        who += fmt::format("{}permit {}: {}", who.empty() ? "" : "; ", h.permit, h.holder);
    } catch (...) {
    }
    // A store's name may hold a password: redacted, as every message.
    return redact(fmt::format("dibs lock: all {} permits of '{}' are held{}{}; wait longer (-w), or see who holds them "
                              "with 'dibs status {}'",
                              sem->permits(), where(), who.empty() ? std::string{} : " (" + who + ")",
                              waited ? " (--wait ran out)" : "",
                              a.store.empty() ? a.path : fmt::format("--semaphore {} '{}'", a.path, a.store)));
  }
  std::optional<dibs::version> token() { return held.token(); }
  std::optional<std::uint32_t> permit() { return held.index(); }  // DIBS_PERMIT: 0 to N - 1
  void unlock() { held.release(); }
};

struct dot_kind {
  const lock_args& a;
  std::optional<dibs::dot_lock> lk;
  void open(dibs::process_id behalf) {
    dibs::dot_lock_options o = a.dot_options.value_or(dibs::dot_lock_options{});
    if (!a.dot_options && !a.stale.empty()) o.stale_after = parse_duration("dibs lock -l", a.stale);
    if (o.stale_after < milliseconds{3}) fail(ex::usage, "dibs lock: -l must be at least 3ms");
    o.on_behalf_of = behalf;
    lk.emplace(native_path(a.path), o);
  }
  bool try_for(milliseconds d) { return d.count() == 0 ? lk->try_lock() : lk->try_lock_for(d); }
  bool wait_for(std::optional<milliseconds> d, std::stop_token st) {
    if (!d) return lk->lock(st), true;
    return lk->try_lock_for(*d, st);
  }
  bool lost() const { return false; }  // a presence lock is held while its file exists: nothing to renew
  std::string conflict(bool waited) {
    // The first line of a lock file is its holder's pid (dotlockfile -p and
    // dibs write it; 0 or nothing from the others).
    std::string first = read_head(native_path(a.path), 32);
    first = first.substr(0, first.find('\n'));
    while (!first.empty() && (first.back() == '\n' || first.back() == '\r')) first.pop_back();
    const bool pid = !first.empty() && first != "0" && first.find_first_not_of("0123456789") == std::string::npos;
    return fmt::format("dibs lock: '{}' is held (its lock file exists{}){}; wait longer (-w, -r), or look at who made "
                       "it; a lock whose holder is gone is broken on proof, any other once it is older than -l ({})",
                       a.path, pid ? ", pid " + first : std::string{}, waited ? " (the wait or the retries ran out)" : "",
                       a.stale.empty() ? "5m" : a.stale);
  }
  std::optional<dibs::version> token() { return std::nullopt; }
  std::optional<std::uint32_t> permit() { return std::nullopt; }
  void unlock() { lk->unlock(); }
};

// Takes `kind`'s lock the way the options say: one try (-n, -w 0, -r 0);
// one wait until -w runs out (the default), so that the lease lock keeps
// one place in lock_file's first-come-first-served queue throughout; or
// lockfile(1)'s way, a try and then a pause (-s), -r times more (-1:
// forever). `stopped(d)` waits up to `d` for a request to stop (a signal
// meant for COMMAND, Ctrl+C) and returns the exit code to end with if one
// came; `watch(src)` returns an object that, while it lives, requests a
// stop through `src` when such a request comes (it does not take it:
// stopped() does); the platforms differ only there.
// Returns: whether the lock was taken, or the exit code to end with.
template <class Kind, class Stopped, class Watch>
std::variant<bool, int> acquire(const lock_args& a, std::optional<milliseconds> wait, Kind& kind, Stopped&& stopped,
                                Watch&& watch) {
  if (a.nonblock || (wait && wait->count() == 0) || a.retries == 0) return kind.try_for(milliseconds{0});
  const auto until = wait ? steady::now() + *wait : steady::time_point::max();
  if (a.retries == -2) {
    for (;;) {
      std::optional<milliseconds> left;
      if (wait) {
        left = std::chrono::duration_cast<milliseconds>(until - steady::now());
        if (*left <= milliseconds{0}) return false;
      }
      std::stop_source src;
      bool got = false, cancelled = false;
      {
        const auto watching = watch(src);
        try {
          got = kind.wait_for(left, src.get_token());
        } catch (const std::system_error& e) {
          if (e.code() != dibs::errc::cancelled) throw;
          cancelled = true;
        }
      }
      if (!cancelled) return got;
      if (const std::optional<int> code = stopped(milliseconds{0})) return *code;
      // Nothing that ends the wait (a SIGCHLD of no child's end): wait on.
    }
  }
  const milliseconds sleep = a.sleep.empty() ? milliseconds{1000} : parse_duration("dibs lock --sleep", a.sleep);
  for (int tries = 0;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(until - steady::now());
    if (left <= milliseconds{0}) return false;
    {
      if (kind.try_for(milliseconds{0})) return true;
      if (a.retries >= 0 && tries >= a.retries) return false;
      const milliseconds pause = a.pause_for ? a.pause_for(tries) : sleep;
      ++tries;
      for (auto end = std::min(until, steady::now() + pause); steady::now() < end;) {
        const auto slice = std::chrono::duration_cast<milliseconds>(end - steady::now());
        if (const std::optional<int> code = stopped(std::max(slice, milliseconds{1}))) return *code;
      }
    }
  }
}

#if defined(_WIN32)
#include "platform/win32.hpp"
#else
#include "platform/posix.hpp"
#endif

// Says which form to use where the lease or presence lock cannot mean what
// a flock(1) option means.
void refuse_unless_kernel(const lock_args& a) {
  const char* lock = a.dot ? "the presence lock (--dot)" : "the lease lock (the default)";
  if (a.fd >= 0)
    fail(ex::usage, fmt::format("dibs lock: a descriptor ({}) is flock(1)'s descriptor form, which only the kernel lock "
                                "has: write 'dibs lock --kernel{}{}{} {}' (or, for a lock file named {}, give a COMMAND)",
                                a.fd, a.unlock ? " -u" : "", a.shared ? " -s" : "", a.nonblock ? " -n" : "", a.fd, a.fd));
  if (a.shared)
    fail(ex::usage, fmt::format("dibs lock: -s (shared): {} has one holder at a time; for shared holders use the kernel "
                                "lock: dibs lock --kernel -s PATH COMMAND{}",
                                lock, a.dot ? " (with --dot, the sleep between retries is -s after --dot: --dot -s SECONDS)" : ""));
  if (a.unlock)
    fail(ex::usage, fmt::format("dibs lock: -u unlocks a descriptor of the calling shell; {} is held only while COMMAND "
                                "runs: write 'dibs lock --kernel -u FD'",
                                lock));
  if (a.no_fork)
    fail(ex::usage, fmt::format("dibs lock: -F (no fork): {} needs dibs to stay, renewing it and removing it after "
                                "COMMAND; drop -F, or use 'dibs lock --kernel -F'",
                                lock));
}

int cmd_lock(lock_args& a) {
  if (a.kernel && a.dot) fail(ex::usage, "dibs lock: --kernel and --dot are two different locks: choose one");
  if (a.max > 0 && (a.kernel || a.dot))
    fail(ex::usage, fmt::format("dibs lock: --max is N permits of the lease lock; it has no {} form",
                                a.kernel ? "--kernel" : "--dot"));
  if (a.resize && a.max == 0) fail(ex::usage, "dibs lock: --resize sets a semaphore's permits to --max N: give --max");
  if (a.no_fork && a.close) fail(ex::usage, "dibs lock: the -F (--no-fork) and -o (--close) options are incompatible");
  if (int n = int{a.shared} + int{a.exclusive} + int{a.unlock}; n > 1)
    fail(ex::usage, "dibs lock: -s, -x and -u are one choice each: give one of them (-x is the default)");
  if (!a.dot && (a.retries != -2 || !a.sleep.empty() || !a.stale.empty() || a.pid))
    fail(ex::usage, "dibs lock: -r, -l, -p and --sleep/-i are lockfile(1)'s and dotlockfile's options, for the "
                    "presence lock: add --dot");
  if (a.retries < -2) fail(ex::usage, "dibs lock -r: retries must be -1 (forever) or more");
  if (a.retries == -2 && !a.sleep.empty()) a.retries = -1;  // lockfile(1): retry forever unless -r says
  if (!a.store.empty() && a.max == 0)
    fail(ex::usage, fmt::format("dibs lock --store: a store keeps a semaphore's permits: give --max N (--max 1: one "
                                "holder at a time), as in 'dibs lock --max 1 --store {} {} -- COMMAND'",
                                a.store, a.path));
  if (!a.kernel) refuse_unless_kernel(a);
  if (!a.kernel && a.fd < 0 && a.store.empty()) refuse_special("dibs lock", a.path);  // --kernel: as flock(1) opens it
  refuse_unported(a);
  if (a.command.empty() && a.fd < 0)
    fail(ex::usage, fmt::format("dibs lock: no COMMAND to run; write: dibs lock {} -- COMMAND [ARGS...]", a.path));
  std::optional<milliseconds> wait;
  if (!a.wait.empty()) wait = parse_duration("dibs lock -w", a.wait);
  if (a.kernel) return lock_kernel(a, wait);
  if (a.dot) return lock_dot(a, wait);
  if (!a.store.empty()) {
    if (!is_store_spec(a.store))
      fail(ex::usage, fmt::format("dibs lock --store: '{}' is not a store (dir:..., sqlite:..., postgres:...)", a.store));
    return with_store(a.store, [&](auto& store) {
      return lock_lease<permit_kind<std::remove_reference_t<decltype(store)>>>(a, wait, &store);
    });
  }
  try {
    return a.max > 0 ? lock_lease<permit_kind<>>(a, wait) : lock_lease(a, wait);
  } catch (const std::system_error& e) {
    // What flock(1) and every flock-style tool leave behind: no record.
    std::error_code ec;
    const auto path = native_path(a.path);
    if (e.code() == dibs::errc::corrupt_record && std::filesystem::is_regular_file(path, ec) &&
        std::filesystem::file_size(path, ec) == 0 && !ec)
      fail(ex::dataerr, fmt::format("dibs lock: '{}' is an empty file, not a dibs lease lock: a --kernel or flock(1) "
                                    "lock file? To go on locking it as flock(1) does (and exclude flock(1) users of "
                                    "it), use 'dibs lock --kernel {}'; to convert it to the lease lock, once no "
                                    "flock(1) user of it is left, remove it ('rm {}'): dibs lock then makes its record",
                                    a.path, a.path, a.path));
    throw;
  }
}

// ---------------------------------------------------------------------------
// dibs log

struct log_args {
  std::string path;
  std::vector<std::string> text;
  std::string rotate_size = "0";
  std::uint64_t keep = 0;
  std::string sync = "none";
  std::string timeout = "10s";
  bool from_stdin = false;  // no argument after PATH
};

int cmd_log(log_args& a) {
  refuse_special("dibs log", a.path);
  dibs::shared_log_options o;
  o.rotate_size = parse_size("dibs log --rotate-size", a.rotate_size);
  o.keep = a.keep;
  o.sync = a.sync == "none"     ? dibs::durability::none
           : a.sync == "record" ? dibs::durability::per_record
           : a.sync == "batch"  ? dibs::durability::per_batch
                                : (fail(ex::usage, fmt::format("dibs log --sync: '{}' is not one of none, record, batch", a.sync)),
                                  dibs::durability::none);
  o.lock_timeout = parse_duration("dibs log --timeout", a.timeout);
  std::optional<dibs::shared_log> opened;
  try {
    opened.emplace(a.path, o);
  } catch (const std::system_error& e) {
#if !defined(_WIN32)
    // The log's lock file beside it is allocated whole at its first use: on
    // a nearly full filesystem it is what does not fit, before any line.
    // (On Windows there is no shared state to allocate: each record is
    // written by its own writer.)
    std::error_code ec;
    const auto dir = std::filesystem::absolute(native_path(a.path), ec).parent_path();
    const auto space = std::filesystem::space(dir, ec);
    if (e.code() == std::errc::no_space_on_device && !ec)
      fail(ex::ioerr, fmt::format("dibs log: no room for the log's lock file beside '{}': it needs {} KiB, and its "
                                  "filesystem has {} KiB free; free some space there (the log's lines need room "
                                  "too). Nothing was written ({})",
                                  a.path, (dibs::shared_log::lock_file_size + 1023) / 1024,
                                  space.available / 1024, e.what()));
#endif
    throw;
  }
  dibs::shared_log& log = *opened;
  if (!a.from_stdin) {
    std::string record;
    for (const auto& t : a.text) {
      if (!record.empty()) record += ' ';
      record += t;
    }
    log.append(record);
    return ex::ok;
  }
  // Each line of standard input is one record, appended before the next is
  // read: a line is in the log once dibs has read the one after it (or ended).
  std::string line;
  while (std::getline(std::cin, line)) log.append(line);
  if (std::cin.bad()) fail(ex::ioerr, "dibs log: cannot read standard input");
  return ex::ok;
}

// ---------------------------------------------------------------------------
// Stores by URL-like name.

constexpr const char* store_table = R"(Stores (STORE):
  dir:/path/to/dir                 file_store: one file per item in an existing directory
  sqlite:/path/file.db[#table]     sqlite_store (table dibs_records unless #table))"
#ifndef DIBS_TOOL_SQLITE
                                    " [not built in]"
#endif
                                    R"(
  postgres:[conninfo or URI][#table]  postgres_store; empty conninfo: the PG* environment)"
#if !defined(DIBS_TOOL_POSTGRES) && !defined(DIBS_TOOL_POSTGRES_HELPER)
                                    " [not built in]"
#endif
                                    R"(
                                   e.g. postgres:host=db1 dbname=jobs, postgres:postgresql://db1/jobs#queue
)";

// `read_only`: for dibs status, which must write nothing: a store that
// does not exist yet is not made.
template <class F>
int with_store(const std::string& spec, F&& f, bool read_only) {
  const auto colon = spec.find(':');
  const std::string scheme = colon == std::string::npos ? std::string{} : spec.substr(0, colon);
  std::string rest = colon == std::string::npos ? spec : spec.substr(colon + 1);
  auto split_table = [&](const char* dflt) {
    const auto hash = rest.rfind('#');
    std::string table = dflt;
    if (hash != std::string::npos) {
      table = rest.substr(hash + 1);
      rest.resize(hash);
    }
    return table;
  };
#ifndef DIBS_TOOL_POSTGRES
  // dibs-postgres is run by dibs for the postgres: scheme only: it compiles
  // the commands for postgres_store alone (each scheme's instantiations of
  // them are most of this file's build).
  if (scheme == "dir") {
    if (rest.empty()) fail(ex::usage, "dibs: store 'dir:' names no directory; write dir:/path/to/dir");
    dibs::file_store s{native_path(rest)};
    return f(s);
  }
#endif
#if defined(DIBS_TOOL_SQLITE) && !defined(DIBS_TOOL_POSTGRES)
  if (scheme == "sqlite") {
    const std::string table = split_table("dibs_records");
    if (rest.empty()) fail(ex::usage, "dibs: store 'sqlite:' names no file; write sqlite:/path/file.db");
    refuse_special("dibs", rest);
    if (read_only && !std::filesystem::exists(native_path(rest)))
      fail(ex::noinput, fmt::format("dibs status: no database at '{}' (a status creates nothing)", rest));
    if (!std::filesystem::is_directory(std::filesystem::absolute(native_path(rest)).parent_path()))
      fail(ex::noinput, fmt::format("dibs: store '{}': the directory of '{}' does not exist (create it first)", spec, rest));
    dibs::sqlite_store s{native_path(rest), dibs::sqlite_store_options{.table = table}};
    return f(s);
  }
#endif
#if !defined(DIBS_TOOL_POSTGRES) && defined(DIBS_TOOL_POSTGRES_HELPER)
  // libpq and what it loads (TLS, Kerberos, LDAP) cost more than the rest
  // of a dibs invocation: the postgres: scheme lives in dibs-postgres, the
  // same program built with it, beside this one.
  if (scheme == "postgres") {
    if (signals_blocked) ::pthread_sigmask(SIG_SETMASK, &original_mask, nullptr);
    const auto helper = std::filesystem::read_symlink("/proc/self/exe").parent_path() / DIBS_TOOL_POSTGRES_HELPER;
    ::execv(helper.c_str(), program_argv);
    fail(ex::unavailable, fmt::format("dibs: store '{}' needs {}, which cannot be run: {} (is it installed beside dibs?)",
                                      spec, helper.string(), std::strerror(errno)));
  }
#endif
#ifdef DIBS_TOOL_POSTGRES
  if (scheme == "postgres") {
    const std::string table = split_table("dibs_records");
    dibs::postgres_store_options o;
    o.table = table;
    dibs::postgres_store s{rest, o};
    return f(s);
  }
#endif
  (void)split_table;
  (void)read_only;
#ifdef DIBS_TOOL_POSTGRES
  if (scheme == "dir" || scheme == "sqlite")
    fail(ex::usage, fmt::format("dibs-postgres: store '{}': this program serves the postgres: scheme only; run dibs", spec));
#endif
  fail(ex::usage, fmt::format("dibs: unknown store '{}': {}\n{}", spec,
                              scheme.empty() ? "it has no scheme" : "scheme '" + scheme + "' is not built in or does not exist",
                              store_table));
}

// ---------------------------------------------------------------------------
// dibs claim

struct claim_args {
  std::string store;
  std::string key;
  std::string next;
  bool has_next = false;
  std::vector<std::string> command;
  std::string lease = "60s";
  std::uint32_t max_attempts = 5;
  std::string retry_after;  // empty: claim_options::retry_backoff's default
  bool quiet = false;
  int exit_base = ex::completed;  // dibs's own outcomes exit exit_base + 0..5
};

// Refuses an --exit-base N (of dibs claim or dibs work, `who`) whose moved
// codes N..N+5 would meet success, dibs's errors (64-77) or 126/127, which
// keep their meaning.
void check_exit_base(const char* who, int base) {
  const int lo = base, hi = base + (ex::claim_lost - ex::completed);
  if (lo < 1 || hi > 255 || (lo <= ex::noperm && hi >= ex::usage) || (lo <= ex::not_found && hi >= ex::cannot_exec))
    fail(ex::usage, fmt::format("{} --exit-base: {} would make the codes {}-{}; choose N with N >= 1 and N+5 <= 255 "
                                "that meets neither 64-77 nor 126-127, e.g. 200",
                                who, base, lo, hi));
}

int cmd_claim(claim_args& a) {
  if (a.command.empty()) fail(ex::usage, "dibs claim: no COMMAND to run; write: dibs claim STORE KEY -- COMMAND [ARGS...]");
  if (!a.has_next && a.key.empty()) fail(ex::usage, "dibs claim: no KEY; write: dibs claim STORE KEY -- COMMAND, or --next PREFIX");
  if (a.max_attempts == 0) fail(ex::usage, "dibs claim --max-attempts: must be at least 1");
  check_exit_base("dibs claim", a.exit_base);
  // dibs's own outcome `code` (one of ex::completed ... ex::claim_lost), moved by --exit-base.
  auto outcome = [&](int code) { return code - ex::completed + a.exit_base; };
  dibs::claim_options o;
  o.lease = parse_duration("dibs claim --lease", a.lease);
  o.max_attempts = a.max_attempts;
  std::optional<std::chrono::milliseconds> retry_after;
  if (!a.retry_after.empty()) retry_after = parse_duration("dibs claim --retry-after", a.retry_after);
  block_forwarded();  // before marker_claim starts its renewal thread
  auto say = [&](const std::string& m) {
    if (!a.quiet) std::cerr << redact(m) << '\n';
  };
  return with_store(a.store, [&](auto& store) -> int {
    using S = std::remove_reference_t<decltype(store)>;
    std::string damaged_what;
    o.on_damaged = [&](std::string_view, std::string_view what) { damaged_what = what; };
    dibs::marker_claim<S> claims{store, o};
    std::optional<typename dibs::marker_claim<S>::claim> c;
    if (a.has_next) {
      c = claims.claim_next(a.next);
      if (!c) {
        say(fmt::format("dibs claim: nothing claimable under prefix '{}' in {}", a.next, a.store));
        return outcome(ex::empty);
      }
    } else {
      c = claims.try_claim(a.key);
      if (!c) {
        const auto s = claims.status(a.key);
        switch (s.state) {
          case dibs::claim_state::completed: say(fmt::format("dibs claim: '{}' is already completed", a.key)); return outcome(ex::completed);
          case dibs::claim_state::failed:
            say(fmt::format("dibs claim: '{}' failed for good after {} attempts ({}); see 'dibs status {}'", a.key,
                            s.attempts, s.error, a.store));
            return outcome(ex::failed);
          case dibs::claim_state::damaged:
            say(fmt::format("dibs claim: the record of '{}' is damaged: {}", a.key, s.error.empty() ? damaged_what : s.error));
            return outcome(ex::damaged);
          case dibs::claim_state::released:
          case dibs::claim_state::offered:
            if (s.not_before > std::chrono::system_clock::now()) {
              say(fmt::format("dibs claim: '{}' is not claimable for another {} (attempt {} was given back: {}); "
                              "--retry-after chooses that wait",
                              a.key, dibs::show_duration(s.not_before - std::chrono::system_clock::now()), s.attempts,
                              s.error.empty() ? "scheduled" : s.error));
              return outcome(ex::taken);
            }
            [[fallthrough]];
          default: say(fmt::format("dibs claim: '{}' is held by another worker: {}", a.key, s)); return outcome(ex::taken);
        }
      }
    }
    const std::string key = c->key();
    std::vector<std::string> cmd = a.command;
    if (a.has_next) cmd.push_back(key);
    exec_args ea{cmd,
                 {{"DIBS_TOKEN", std::to_string(c->token())},
                  {"DIBS_KEY", key},
                  {"DIBS_ATTEMPT", std::to_string(c->attempts())}}};
    // If dibs dies, its claim is recovered by the next worker at once (its
    // pid is gone): COMMAND is stopped then too, so that it does not go on
    // beside the next worker's run. The token tells the two apart anyway.
    const int code = run_command(ea, true);
    if (code == 0) {
      try {
        c->complete(fmt::format("exit 0, token {}", c->token()));
      } catch (const std::system_error& e) {
        if (e.code() != dibs::errc::lease_lost) throw;
        std::cerr << "dibs claim: " << redact(e.what()) << '\n';
        return outcome(ex::claim_lost);
      }
      return ex::ok;
    }
    const bool last = c->attempts() >= a.max_attempts;
    const auto error = fmt::format("COMMAND exited {}", code);
    (void)(retry_after ? c->release(error, *retry_after) : c->release(error));
    if (last) say(fmt::format("dibs claim: '{}' failed for good: attempt {} of {} exited {}", key, a.max_attempts, a.max_attempts, code));
    if (code >= outcome(ex::completed) && code <= outcome(ex::claim_lost))
      say(fmt::format("dibs claim: '{}': COMMAND ran and exited {}, a code dibs also uses for its own outcomes ({}-{}); "
                      "the item was given back; to tell the two apart, move dibs's codes with --exit-base (e.g. 200)",
                      key, code, outcome(ex::completed), outcome(ex::claim_lost)));
    return code;
  });
}

// ---------------------------------------------------------------------------
// dibs once: a crontab line on every host, COMMAND run once per slot

struct once_args {
  std::string name;
  std::vector<std::string> command;
  std::string store;     // empty: default_once_store()
  std::string every;     // --every DURATION: a periodic schedule
  std::string slot;      // --slot NAME: a slot the caller names
  std::string lease = "60s";
  std::string standby;   // empty: the library's default
  std::string catch_up = "skip";
  std::uint32_t keep = 1000;
  std::uint32_t max_attempts = 3;
  bool quiet = false;
};

// The store of `dibs once` without --store: a directory of this user's
// (XDG_STATE_HOME/dibs/once, ~/.local/state/dibs/once; on Windows
// %LOCALAPPDATA%\dibs\once), made if missing. One host only: give --store
// for a schedule shared by several.
std::string default_once_store() {
  namespace fs = std::filesystem;
  fs::path dir;
  const char* state = std::getenv("XDG_STATE_HOME");
#ifdef _WIN32
  const char* home = std::getenv("LOCALAPPDATA");
  if (state && *state) dir = native_path(state);
  else if (home && *home) dir = native_path(home);
#else
  const char* home = std::getenv("HOME");
  if (state && *state) dir = native_path(state);
  else if (home && *home) dir = native_path(home) / ".local" / "state";
#endif
  if (dir.empty()) fail(ex::usage, "dibs once: no --store, and neither XDG_STATE_HOME nor HOME says where to keep it");
  dir /= "dibs";
  dir /= "once";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(ex::cantcreat, fmt::format("dibs once: cannot make '{}' for its records: {} (give --store)", dir.string(), ec.message()));
  return "dir:" + dir.string();
}

// COMMAND's exit status when it is not 0: the slot is given back with it.
struct command_failed : std::runtime_error {
  int code;
  explicit command_failed(int c) : std::runtime_error(fmt::format("COMMAND exited {}", c)), code(c) {}
};

int cmd_once(once_args& a) {
  if (a.command.empty())
    fail(ex::usage, fmt::format("dibs once: no COMMAND to run; write: dibs once --every 1h {} -- COMMAND [ARGS...]", a.name));
  if (a.every.empty() && a.slot.empty())
    fail(ex::usage, "dibs once: give --every PERIOD (a slot of each period, e.g. 1h, 1d) or --slot NAME (e.g. a date)");
  if (a.max_attempts == 0) fail(ex::usage, "dibs once --max-attempts: must be at least 1");
  if (a.keep == 0) fail(ex::usage, "dibs once --keep: must be at least 1");
  if (a.catch_up != "skip" && a.catch_up != "latest")
    fail(ex::usage, fmt::format("dibs once --catch-up: '{}' is not skip or latest", a.catch_up));
  dibs::once_options o;
  o.claims.lease = parse_duration("dibs once --lease", a.lease);
  o.claims.max_attempts = a.max_attempts;
  o.keep = a.keep;
  o.missed = a.catch_up == "latest" ? dibs::catch_up::latest : dibs::catch_up::skip;
  if (!a.standby.empty()) o.standby = parse_duration("dibs once --standby", a.standby);
  std::chrono::milliseconds period{0};
  if (!a.every.empty()) {
    period = parse_duration("dibs once --every", a.every);
    if (period.count() < 1) fail(ex::usage, "dibs once --every: the period must be at least 1ms");
  }
  if (a.store.empty()) a.store = default_once_store();
  block_forwarded();  // before the claim's renewal thread starts
  auto say = [&](const std::string& m) {
    if (!a.quiet) std::cerr << redact(m) << '\n';
  };
  return with_store(a.store, [&](auto& store) -> int {
    using S = std::remove_reference_t<decltype(store)>;
    std::optional<dibs::once<S>> job;
    if (period.count() > 0) job.emplace(store, a.name, period, o);
    else job.emplace(store, a.name, o);
    auto fn = [&](const auto& slot) {
      exec_args ea{a.command,
                   {{"DIBS_TOKEN", std::to_string(slot.token())},
                    {"DIBS_SLOT", slot.id()},
                    {"DIBS_ATTEMPT", std::to_string(slot.attempt())}}};
      // If dibs dies, COMMAND is stopped too: the slot is then taken over on
      // proof by a host standing by, and must not run twice side by side.
      const int code = run_command(ea, true);
      if (code != 0) throw command_failed{code};
    };
    dibs::once_result r;
    try {
      r = a.slot.empty() ? job->run(fn) : job->run_slot(a.slot, fn);
    } catch (const command_failed& e) {
      say(fmt::format("dibs once: '{}': {}; the slot was given back for another run (up to --max-attempts {} in all)",
                      a.name, e.what(), a.max_attempts));
      return e.code;
    } catch (const std::system_error& e) {
      if (e.code() == dibs::errc::lease_lost) {
        std::cerr << "dibs once: " << redact(e.what()) << '\n';
        return ex::claim_lost;
      }
      if (e.code() == dibs::errc::corrupt_record && std::string_view{e.what()}.find("slot '") != std::string_view::npos) {
        say(fmt::format("dibs once: {}", e.what()));
        return ex::damaged;
      }
      throw;
    }
    switch (r.outcome) {
      case dibs::once_outcome::ran: return ex::ok;
      case dibs::once_outcome::done:
        say(fmt::format("dibs once: '{}' slot {}: already run (attempt {})", a.name, r.slot, r.attempt));
        return ex::completed;
      case dibs::once_outcome::taken:
        say(fmt::format("dibs once: '{}' slot {}: another host runs it; see 'dibs status --once {} {}'", a.name, r.slot,
                        a.name, a.store));
        return ex::taken;
      case dibs::once_outcome::failed:
        say(fmt::format("dibs once: '{}' slot {}: failed for good after {} runs ({})", a.name, r.slot, r.attempt, r.error));
        return ex::failed;
      case dibs::once_outcome::too_late:
        say(fmt::format("dibs once: '{}' slot {}: {} (is this host's clock behind?)", a.name, r.slot, r.error));
        return ex::too_late;
    }
    return ex::software;
  });
}

// ---------------------------------------------------------------------------
// dibs offer and dibs work: a queue from the shell

#include "offer.hpp"
#include "work.hpp"

// ---------------------------------------------------------------------------
// dibs retry

struct retry_args {
  std::vector<std::string> command;
  std::uint32_t attempts = 5;
  std::string deadline;
  std::string initial = "100ms";
  std::string cap = "10s";
  double multiplier = 2.0;
  std::string jitter = "full";
  std::vector<int> codes{75};
  bool verbose = false;
};

int cmd_retry(retry_args& a) {
  if (a.command.empty()) fail(ex::usage, "dibs retry: no COMMAND to run; write: dibs retry [options] -- COMMAND [ARGS...]");
  if (a.attempts == 0) fail(ex::usage, "dibs retry --attempts: must be at least 1");
  const dibs::jitter j = a.jitter == "none"           ? dibs::jitter::none
                         : a.jitter == "full"         ? dibs::jitter::full
                         : a.jitter == "equal"        ? dibs::jitter::equal
                         : a.jitter == "decorrelated" ? dibs::jitter::decorrelated
                                                      : (fail(ex::usage, fmt::format("dibs retry --jitter: '{}' is not one of "
                                                                                     "none, full, equal, decorrelated",
                                                                                     a.jitter)),
                                                         dibs::jitter::none);
  std::optional<dibs::exponential_backoff> backoff;
  try {
    backoff.emplace(parse_duration("--initial", a.initial), a.multiplier, parse_duration("--cap", a.cap), j);
  } catch (const std::invalid_argument& e) {
    fail(ex::usage, fmt::format("dibs retry: {}", e.what()));
  }
  const auto start = steady::now();
  std::optional<steady::time_point> end;
  if (!a.deadline.empty()) end = start + parse_duration("dibs retry --deadline", a.deadline);
  std::mt19937_64 rng{std::random_device{}()};
  dibs::exponential_backoff::duration previous{0};
  exec_args ea{a.command, {}};
  for (std::uint32_t n = 0;; ++n) {
    const int code = run_command(ea, false);
    const bool transient = std::find(a.codes.begin(), a.codes.end(), code) != a.codes.end();
    if (!transient) return code;
    if (n + 1 >= a.attempts) {
      if (a.verbose) std::cerr << fmt::format("dibs retry: giving up: attempt {} of {} exited {}\n", n + 1, a.attempts, code);
      return code;
    }
    auto delay = backoff->delay(n, previous, std::uniform_real_distribution<double>{0.0, 1.0}(rng));
    previous = delay;
    if (end) {
      const auto left = *end - steady::now();
      if (left <= steady::duration::zero()) {
        if (a.verbose) std::cerr << fmt::format("dibs retry: giving up: the deadline passed after attempt {} (exit {})\n", n + 1, code);
        return code;
      }
      delay = std::min<dibs::exponential_backoff::duration>(delay, std::chrono::duration_cast<dibs::exponential_backoff::duration>(left));
    }
    if (a.verbose)
      std::cerr << fmt::format("dibs retry: attempt {} exited {}; next in {} ms\n", n + 1, code,
                               std::chrono::duration_cast<milliseconds>(delay).count());
    if (const auto st = sleep_unless_signalled(delay)) return *st;
    if (end && steady::now() >= *end) {
      if (a.verbose) std::cerr << "dibs retry: giving up: the deadline passed\n";
      return code;
    }
  }
}

// ---------------------------------------------------------------------------
// dibs status

// Returns: `s` as one word of a shell command line: as it is if it has
// only characters no shell treats specially, else in single quotes.
std::string shell_word(std::string_view s) {
  const bool plain = !s.empty() && s.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                       "0123456789@%+=:,./_-") == std::string_view::npos;
  if (plain) return std::string(s);
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string{"'\\''"} : std::string(1, c);
  return out + "'";
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      out += fmt::format("\\u{:04x}", c);
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::int64_t unix_ms(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(t.time_since_epoch()).count();
}

// Returns: `ms` as "60 s" (whole seconds, or 10 s and more), else "250 ms".
std::string span(milliseconds ms) {
  const auto n = ms.count();
  if ((n != 0 && n % 1000 == 0) || n >= 10'000 || n <= -10'000) return fmt::format("{} s", n / 1000);
  return fmt::format("{} ms", n);
}

struct status_args {
  std::string target;
  std::string prefix;
  std::string once;       // --once NAME: a schedule of dibs once
  std::string semaphore;  // --semaphore NAME: a semaphore of dibs lock --max --store
  std::size_t last = 24;  // --last N: its recent slots shown
  bool json = false;
};

bool is_store_spec(const std::string& t) {
  for (const char* s : {"dir:", "sqlite:", "postgres:"})
    if (t.rfind(s, 0) == 0) return true;
  return false;
}

// Returns: the exit code of dibs status for a lock in `state` ("held",
// "free", "expired"). Notes that a status is shown: a failed write to
// standard output is then 74 whatever the state (checked_stdout()).
bool showing_status = false;
int status_code(std::string_view state) {
  showing_status = true;
  return state == "free" ? ex::status_free : state == "expired" ? ex::status_expired : ex::ok;
}

// A presence lock file (dibs lock --dot, dotlockfile, lockfile(1)): its
// first line is a pid, or "0", or nothing; dibs's has its holder's record
// after it. Returns: the exit code if `a.target` is one, else nullopt.
std::optional<int> dot_status(const status_args& a) {
  const std::string text = read_head(native_path(a.target), 4096);
  const auto nl = text.find('\n');
  const std::string first = text.substr(0, nl);
  if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const auto holder = dibs::dot_lock::holder_of(native_path(a.target));
  if (!holder) return std::nullopt;  // gone since it was read
  const bool ours = !holder->host.empty();  // dibs's record, not another tool's bare pid
  if (!ours && nl != std::string::npos && nl + 1 < text.size()) return std::nullopt;  // more than a pid: not one
  const bool gone = holder->gone;
  const char* state = gone ? "free" : "held";
  if (a.json) {
    fmt::print("{{\"kind\": \"presence\", \"state\": \"{}\", \"held\": {}, \"gone\": {}, \"dibs\": {}, \"pid\": {}{}}}\n",
               state, gone ? "false" : "true", gone ? "true" : "false", ours ? "true" : "false", first,
               ours ? fmt::format(", \"host\": {}", json_string(holder->host)) : std::string{});
    return status_code(state);
  }
  if (!ours)
    fmt::print("{}: held: a presence lock of another tool (dotlockfile, lockfile(1), O_EXCL){}; dibs lock --dot breaks "
               "it only once it is older than -l (5m by default)\n",
               a.target, first == "0" ? std::string{", no pid in it"} : ", pid " + first);
  else if (gone)
    fmt::print("{}: free: its holder, pid {} on {} (a presence lock, dibs lock --dot), is gone; the next lock breaks it "
               "at once\n",
               a.target, holder->pid, holder->host);
  else
    fmt::print("{}: held: a presence lock (dibs lock --dot) of pid {} on {}\n", a.target, holder->pid, holder->host);
  return status_code(state);
}

// dibs status --once NAME STORE: a schedule's recent slots (periodic), or
// every slot that has a record (named slots).
int once_status(const std::string& target, const std::string& name, std::size_t last, bool json) {
  return with_store(target, [&](auto& store) -> int {
    using S = std::remove_reference_t<decltype(store)>;
    const auto period = dibs::once<S>::period_of(store, name);
    if (!period) fail(ex::noinput, fmt::format("dibs status: {} has no schedule '{}'", target, name));
    std::vector<dibs::once_slot_status> slots;
    if (period->count() > 0) {
      dibs::once<S> job{store, name, *period};
      slots = job.recent(last);
    } else {
      dibs::once<S> job{store, name};
      slots = job.list();
    }
    if (json) {
      std::string out = "[";
      for (const auto& s : slots) {
        out += fmt::format("{}\n  {{\"slot\": {}, \"state\": \"{}\", \"attempts\": {}", out.size() > 1 ? "," : "",
                           json_string(s.slot), dibs::to_string(s.st), s.attempts);
        if (s.owner) out += fmt::format(", \"host\": {}, \"pid\": {}", json_string(s.owner->host), s.owner->pid);
        if (s.token != 0) out += fmt::format(", \"token\": {}", s.token);
        if (!s.result.empty()) out += fmt::format(", \"result\": {}", json_string(s.result));
        if (!s.error.empty()) out += fmt::format(", \"error\": {}", json_string(s.error));
        out += "}";
      }
      fmt::print("{}\n]\n", out);
      return ex::ok;
    }
    fmt::print("{:<26} {:<12} {}\n", "SLOT", "STATE", "");
    for (const auto& s : slots) {
      std::string what = s.result;
      if (s.owner) what = "by " + dibs::to_string(*s.owner);
      if (!s.error.empty()) what += (what.empty() ? "" : "; ") + std::string("last error: ") + s.error;
      if (s.attempts > 1) what += fmt::format(" (attempt {})", s.attempts);
      fmt::print("{:<26} {:<12} {}\n", s.slot, dibs::to_string(s.st), what);
    }
    return ex::ok;
  }, true);
}

// What the next taker of a lease would do with it: take a free one, or one
// whose holder is provably gone, at once (the library's proof rule:
// h.gone); break an expired one once it has seen it unchanged for a lease;
// wait for a held one.
const char* lease_state(const std::optional<dibs::lock_holder>& h) {
  return !h || h->gone                                  ? "free"
         : h->lease_left && h->lease_left->count() < 0 ? "expired"
                                                        : "held";
}

// A semaphore of dibs lock --max: its permits and holders. `label` names
// it in what is printed (the directory, or NAME in STORE).
template <class Store>
int show_semaphore(Store& store, const std::string& name, const std::string& label, bool json, const std::string& none) {
  const auto st = dibs::lease_semaphore<Store>::inspect(store, name);
  if (!st) fail(ex::noinput, none);
  std::size_t held = 0;
  for (const auto& p : st->holders) held += std::string_view{lease_state(p.holder)} != "free";
  if (json) {
    std::string out = fmt::format("{{\"path\": {}, \"kind\": \"semaphore\", \"permits\": {}, \"held\": {}, \"holders\": [",
                                  json_string(label), st->permits, held);
    for (const auto& p : st->holders) {
      const auto& h = p.holder;
      out += fmt::format("{}\n  {{\"permit\": {}, \"state\": \"{}\", \"above_limit\": {}, \"host\": {}, \"pid\": {}, "
                         "\"since_ms\": {}, \"lease_ms\": {}, \"lease_left_ms\": {}, \"token\": {}}}",
                         &p == &st->holders.front() ? "" : ",", p.permit, lease_state(h), p.above_limit ? "true" : "false",
                         json_string(h.host), h.pid, h.since ? unix_ms(*h.since) : 0, h.lease.count(),
                         h.lease_left ? std::to_string(h.lease_left->count()) : "null", h.token);
    }
    fmt::print("{}{}]}}\n", out, st->holders.empty() ? "" : "\n");
    return ex::ok;
  }
  fmt::print("{}: {} of {} permits held\n", label, held, st->permits);
  if (st->holders.empty()) return ex::ok;
  fmt::print("{:<8} {:<8} {:<8} {:<20} {:<10} {:<10} {:<8} {}\n", "PERMIT", "HOST", "PID", "SINCE", "LEASE", "LEFT",
             "TOKEN", "STATE");
  for (const auto& p : st->holders) {
    const auto& h = p.holder;
    fmt::print("{:<8} {:<8} {:<8} {:<20} {:<10} {:<10} {:<8} {}{}\n", p.permit, h.host, h.pid,
               h.since ? dibs::show_time(*h.since) : "?", span(h.lease), h.lease_left ? span(*h.lease_left) : "?", h.token,
               lease_state(h), p.above_limit ? " (above the permits now: not handed out again)" : "");
  }
  return ex::ok;
}

// A directory of dibs lock --max.
int semaphore_status(const status_args& a) {
  dibs::file_store store{native_path(a.target)};
  return show_semaphore(store, permit_kind<>::name_of(a.target), a.target, a.json,
                        fmt::format("dibs status: '{}' is a directory with no semaphore of 'dibs lock --max' in it (a "
                                    "store? write dir:{})",
                                    a.target, a.target));
}

int cmd_status(status_args& a) {
  if (!a.once.empty()) {
    if (!is_store_spec(a.target))
      fail(ex::usage, fmt::format("dibs status --once {}: '{}' is not a store; give the STORE of dibs once --store "
                                  "(dir:..., sqlite:..., postgres:...)",
                                  a.once, a.target));
    return once_status(a.target, a.once, a.last, a.json);
  }
  if (!a.semaphore.empty()) {
    if (!is_store_spec(a.target))
      fail(ex::usage, fmt::format("dibs status --semaphore {}: '{}' is not a store; give the STORE of dibs lock --max "
                                  "--store (dir:..., sqlite:..., postgres:...), or the directory of dibs lock --max "
                                  "without --semaphore",
                                  a.semaphore, a.target));
    return with_store(a.target, [&](auto& store) -> int {
      return show_semaphore(store, a.semaphore, redact(fmt::format("{} in {}", a.semaphore, a.target)), a.json,
                            fmt::format("dibs status: {} has no semaphore '{}'", a.target, a.semaphore));
    }, true);
  }
  if (is_store_spec(a.target)) {
    return with_store(a.target, [&](auto& store) -> int {
      using S = std::remove_reference_t<decltype(store)>;
      dibs::marker_claim<S> claims{store};
      auto items = claims.list(a.prefix);
      // The records of semaphores and schedules are not items: they are
      // listed by name after the items (unless --prefix asks for them).
      if (a.prefix.rfind("dibs-", 0) != 0)
        std::erase_if(items, [](const auto& it) {
          return it.key.rfind("dibs-semaphore", 0) == 0 || it.key.rfind("dibs-once:", 0) == 0;
        });
      if (a.json) {
        std::string out = "[";
        for (const auto& it : items) {
          const auto& s = it.status;
          out += fmt::format("{}\n  {{\"key\": {}, \"state\": \"{}\", \"attempts\": {}, \"version\": {}, \"changed_ms\": {}",
                             out.size() > 1 ? "," : "", json_string(it.key), dibs::to_string(s.state), s.attempts,
                             s.version, unix_ms(s.changed));
          if (s.owner) out += fmt::format(", \"host\": {}, \"pid\": {}", json_string(s.owner->host), s.owner->pid);
          if (!s.error.empty()) out += fmt::format(", \"error\": {}", json_string(s.error));
          if (!s.result.empty()) out += fmt::format(", \"result\": {}", json_string(s.result));
          if (s.token != 0) out += fmt::format(", \"token\": {}", s.token);
          out += "}";
        }
        fmt::print("{}\n]\n", out);
        return ex::ok;
      }
      std::map<std::string, int> counts;
      for (const auto& it : items) ++counts[dibs::to_string(it.status.state)];
      fmt::print("{:<32} {}\n", "KEY", "STATE");
      for (const auto& it : items) fmt::print("{:<32} {}\n", it.key, it.status);
      std::string sum;
      for (const auto& [state, n] : counts) sum += fmt::format("{}{} {}", sum.empty() ? "" : ", ", n, state);
      fmt::print("{} item(s){}{}\n", items.size(), sum.empty() ? "" : ": ", sum);
      if (!a.prefix.empty()) return ex::ok;
      for (const auto& name : dibs::lease_semaphore<S>::names(store)) {
        std::size_t held = 0, permits = 0;
        if (const auto st = dibs::lease_semaphore<S>::inspect(store, name)) {
          permits = st->permits;
          for (const auto& p : st->holders) held += std::string_view{lease_state(p.holder)} != "free";
        }
        fmt::print("semaphore {}: {} of {} permits held (dibs status --semaphore {} {})\n", name, held, permits,
                   shell_word(name), shell_word(redact(a.target)));
      }
      for (const auto& name : dibs::once<S>::names(store)) {
        const auto period = dibs::once<S>::period_of(store, name);
        fmt::print("schedule {}: {} (dibs status --once {} {})\n", name,
                   period && period->count() > 0 ? "every " + dibs::show_duration(*period) : std::string{"named slots"},
                   shell_word(name), shell_word(redact(a.target)));
      }
      return ex::ok;
    }, true);
  }
  refuse_special("dibs status", a.target);
  const auto target = native_path(a.target);
  if (!std::filesystem::exists(target))
    fail(ex::noinput, fmt::format("dibs status: '{}' does not exist (a lock file, or a store such as dir:/path)", a.target));
  if (std::filesystem::is_directory(target)) return semaphore_status(a);
  if (std::filesystem::is_regular_file(target) && std::filesystem::file_size(target) == 0)
    fail(ex::dataerr, fmt::format("dibs status: '{}' is an empty file, not a dibs lease lock (a --kernel or flock(1) "
                                  "lock file?); the kernel does not say who holds those: try 'fuser -v {}'",
                                  a.target, a.target));
  if (const auto code = dot_status(a)) return *code;
  dibs::lock_file lk{target};
  const auto h = lk.holder();  // reads the record; takes nothing
  const char* state = lease_state(h);
  if (a.json) {
    if (!h) {
      fmt::print("{{\"path\": {}, \"state\": \"free\", \"held\": false}}\n", json_string(a.target));
    } else {
      fmt::print("{{\"path\": {}, \"state\": \"{}\", \"held\": {}, \"gone\": {}, \"host\": {}, \"pid\": {}, "
                 "\"since_ms\": {}, \"lease_ms\": {}, \"lease_left_ms\": {}, \"token\": {}}}\n",
                 json_string(a.target), state, h->gone ? "false" : "true", h->gone ? "true" : "false",
                 json_string(h->host), h->pid, h->since ? unix_ms(*h->since) : 0, h->lease.count(),
                 h->lease_left ? std::to_string(h->lease_left->count()) : "null", h->token);
    }
    return status_code(state);
  }
  if (!h) {
    fmt::print("{}: free\n", a.target);
    return status_code(state);
  }
  if (h->gone) {
    fmt::print("{}: free: its holder, pid {} on {} (token {}), is gone; the next lock breaks it at once\n", a.target,
               h->pid, h->host, h->token);
    return status_code(state);
  }
  fmt::print("{:<8} {:<8} {:<20} {:<10} {:<10} {:<8} {}\n", "HOST", "PID", "SINCE", "LEASE", "LEFT", "TOKEN", "STATE");
  fmt::print("{:<8} {:<8} {:<20} {:<10} {:<10} {:<8} {}\n", h->host, h->pid, h->since ? dibs::show_time(*h->since) : "?",
             span(h->lease), h->lease_left ? span(*h->lease_left) : "?", h->token, state);
  if (std::string_view{state} == "expired")
    fmt::print("{}: expired: pid {} on {} stopped renewing (its lease ran out {} ago, as the time in its record says); the "
               "next lock breaks it once it has seen it unchanged for a lease ({})\n",
               a.target, h->pid, h->host, span(-*h->lease_left), span(h->lease));
  return status_code(state);
}

// ---------------------------------------------------------------------------
// The command line. As with flock(1) (getopt's "+"), a subcommand's options
// end at its first argument that is not an option (or at "--"): from there
// on everything is data, taken verbatim, never parsed as an option. So a key
// named '--next=order' or a log line '--help' is a key or a line, whatever
// it looks like. CLI11 is given the options alone.

// Returns: true if `sub` has an option named `name` (long, without its
// dashes, or one short letter) that takes a value.
bool takes_value(const CLI::App& sub, std::string_view name, bool is_long) {
  for (const CLI::Option* o : sub.get_options()) {
    const bool named = is_long ? o->check_lname(std::string(name)) : o->check_sname(std::string(name));
    if (named) return o->get_items_expected_min() > 0;
  }
  return false;  // unknown: CLI11 will say so
}

// Returns: the index in argv of the first data argument of `sub`, whose
// arguments start at argv[first]; `*dashes`: the index of the "--" that
// ended the options, or -1.
int data_start(const CLI::App& sub, int argc, char** argv, int first, int* dashes) {
  *dashes = -1;
  int i = first;
  while (i < argc) {
    const std::string_view a{argv[i]};
    if (a == "--") {
      *dashes = i;
      return i + 1;
    }
    if (a.size() < 2 || a[0] != '-') return i;  // "-" alone is data too
    ++i;
    if (a[1] == '-') {
      if (a.find('=') == std::string_view::npos && takes_value(sub, a.substr(2), true)) ++i;
      continue;
    }
    for (std::size_t k = 1; k < a.size(); ++k) {  // a cluster: -nE0, -w 5
      if (takes_value(sub, a.substr(k, 1), false)) {
        if (k + 1 == a.size()) ++i;  // the value is the next argument
        break;
      }
    }
  }
  return std::min(i, argc);
}

// Returns: true if --dot is among lock's options (argv[2] on), reading -s
// as an option that takes a value (its --dot meaning); a value "--dot" of
// another option is no --dot.
bool dot_among_options(const CLI::App& lock, int argc, char** argv) {
  for (int i = 2; i < argc; ++i) {
    const std::string_view a{argv[i]};
    if (a == "--" || a.size() < 2 || a[0] != '-') return false;
    if (a == "--dot") return true;
    if (a[1] == '-') {
      if (a.find('=') == std::string_view::npos && takes_value(lock, a.substr(2), true)) ++i;
      continue;
    }
    for (std::size_t k = 1; k < a.size(); ++k) {
      if (a[k] == 's' || takes_value(lock, a.substr(k, 1), false)) {
        if (k + 1 == a.size()) ++i;
        break;
      }
    }
  }
  return false;
}

// Effects: names what each option of `app`'s subcommands takes, in their
// help: DURATION, CODE, N, SIZE, ... instead of CLI11's TEXT and
// "INT:INT in [0 - 255]" (the checks still apply; a default is shown as
// DURATION=10s). The man page and the completions are made from this help.
void name_values(CLI::App& app) {
  static const std::map<std::string, std::string, std::less<>> kinds{
      {"wait", "DURATION"},     {"lease", "DURATION"},   {"sleep", "DURATION"},      {"lock-timeout", "DURATION"},
      {"retry-after", "DURATION"}, {"deadline", "DURATION"}, {"initial", "DURATION"}, {"cap", "DURATION"},
      {"standby", "DURATION"},  {"every", "DURATION"},   {"timeout", "DURATION"},    {"conflict-exit-code", "CODE"},
      {"on", "CODE[,CODE...]"}, {"exit-base", "CODE"},   {"max", "N"},               {"retries", "N"},
      {"keep", "N"},            {"max-attempts", "N"},   {"jobs", "N"},              {"attempts", "N"},
      {"last", "N"},            {"priority", "N"},       {"fd", "FD"},               {"rotate-size", "SIZE"},
      {"multiplier", "X"},      {"jitter", "none|full|equal|decorrelated"},         {"sync", "none|record|batch"},
      {"catch-up", "skip|latest"}, {"store", "STORE"},   {"slot", "NAME"},           {"once", "NAME"},       {"semaphore", "NAME"},
      {"prefix", "PREFIX"},     {"next", "PREFIX"},      {"command", "STRING"},      {"not-before", "TIME"}};
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    for (CLI::Option* o : sub->get_options()) {
      if (o->get_items_expected_min() == 0) continue;  // a flag
      for (const std::string& n : o->get_lnames())
        if (const auto it = kinds.find(n); it != kinds.end()) {
          const std::string def = o->get_default_str();
          o->option_text(def.empty() ? it->second : it->second + "=" + def);
          break;
        }
    }
}

// Returns: true if lock's options (up to the data) have a -s, alone or among
// other letters ('-s', '-s5', '-ps 5').
bool s_among_options(const CLI::App& lock, int argc, char** argv) {
  for (int i = 2; i < argc; ++i) {
    const std::string_view a{argv[i]};
    if (a == "--" || a.size() < 2 || a[0] != '-') return false;
    if (a[1] == '-') {
      if (a.find('=') == std::string_view::npos && takes_value(lock, a.substr(2), true)) ++i;
      continue;
    }
    std::size_t k = 1;
    while (k < a.size() && a[k] != 's' && !takes_value(lock, a.substr(k, 1), false)) ++k;
    if (k < a.size() && a[k] == 's') return true;
    if (k + 1 == a.size()) ++i;  // its last letter takes the next argument
  }
  return false;
}

// Returns: which of lock's -s, -x (-e) and -u comes last among its options
// `args` (argv[2] on), as 's', 'x' or 'u'; 0 if none.
char last_lock_mode(const CLI::App& lock, const std::vector<char*>& args) {
  char last = 0;
  for (std::size_t i = 2; i < args.size(); ++i) {
    const std::string_view a{args[i]};
    if (a.size() < 2 || a[0] != '-') continue;
    if (a[1] == '-') {
      const auto name = a.substr(2, a.find('=') == std::string_view::npos ? std::string_view::npos : a.find('=') - 2);
      if (name == "shared") last = 's';
      if (name == "exclusive") last = 'x';
      if (name == "unlock") last = 'u';
      if (a.find('=') == std::string_view::npos && takes_value(lock, name, true)) ++i;
      continue;
    }
    for (std::size_t k = 1; k < a.size(); ++k) {
      const char c = a[k];
      if (c == 's' || c == 'u') last = c;
      if (c == 'x' || c == 'e') last = 'x';
      if (takes_value(lock, a.substr(k, 1), false)) {
        if (k + 1 == a.size()) ++i;
        break;
      }
    }
  }
  return last;
}

// A subcommand's data arguments, taken in order.
struct data_args {
  std::vector<std::string> v;
  std::size_t at = 0;
  bool done() const { return at == v.size(); }
  std::string take() { return v[at++]; }
  // Returns: the rest, without one "--" before it (the separator of
  // 'PATH -- COMMAND'). A "--" that is the very last argument is data.
  std::vector<std::string> rest() {
    if (v.size() - at >= 2 && v[at] == "--") ++at;
    std::vector<std::string> r(v.begin() + static_cast<std::ptrdiff_t>(at), v.end());
    at = v.size();
    return r;
  }
};

// The synopses printed as each subcommand's usage line (CLI11 knows only
// the options).
struct usage_formatter : CLI::Formatter {
  std::string make_usage(const CLI::App* app, std::string name) const override {
    static const std::pair<const char*, const char*> synopses[] = {
        {"lock", "[OPTIONS] PATH [--] COMMAND [ARGS...]\n       dibs lock [OPTIONS] PATH -c STRING\n"
                 "       dibs lock --kernel [OPTIONS] FD\n       dibs lock --kernel [OPTIONS] --fd FD COMMAND [ARGS...]\n"
                 "       dibs lock --dot [-r RETRIES] [-i PAUSE] [-l AGE] [OPTIONS] PATH [--] COMMAND [ARGS...]"},
        {"log", "[OPTIONS] PATH [--] [TEXT...]"},
        {"claim", "[OPTIONS] STORE KEY [--] COMMAND [ARGS...]\n       dibs claim [OPTIONS] --next PREFIX STORE [--] COMMAND [ARGS...]"},
        {"offer", "[OPTIONS] STORE < KEYS"},
        {"work", "[OPTIONS] STORE [--] COMMAND [ARGS...]"},
        {"retry", "[OPTIONS] [--] COMMAND [ARGS...]"},
        {"status", "[OPTIONS] TARGET"},
    };
    for (const auto& [sub, synopsis] : synopses)
      if (app->get_name() == sub) return fmt::format("Usage: dibs {} {}\n", sub, synopsis);
    return CLI::Formatter::make_usage(app, std::move(name));
  }
};

constexpr const char* data_rule = R"(
Options go first: the first argument that is not an option (or '--') ends
them, and it and everything after it are data, taken as written, whatever
they look like (a key '--next=x', a log line '--help').)";

#if !defined(_WIN32)
#include "compat_names.hpp"
#endif

// Returns: the tool dibs was started as, if argv[0]'s basename is one of
// the names it answers to (flock, lockfile, dotlockfile; tools/
// compat_names.hpp), else "".
std::string_view compat_name(const char* arg0) {
  if (!arg0) return {};
  std::string_view base{arg0};
  if (const auto slash = base.find_last_of(
#if defined(_WIN32)
          "/\\"
#else
          "/"
#endif
          );
      slash != std::string_view::npos)
    base.remove_prefix(slash + 1);
#if defined(_WIN32)
  if (base.size() > 4 && (base.substr(base.size() - 4) == ".exe" || base.substr(base.size() - 4) == ".EXE"))
    base.remove_suffix(4);
#endif
  for (const std::string_view name : {"flock", "lockfile", "dotlockfile"})
    if (base == name) return name;
  return {};
}

int run(int argc, char** argv) {
  if (const std::string_view name = compat_name(argc > 0 ? argv[0] : nullptr); !name.empty()) {
#if defined(_WIN32)
    std::cerr << fmt::format("{}: dibs answers to the name {} on POSIX systems only; on Windows use 'dibs lock {}' "
                             "(docs/guide-shell.md)\n",
                             name, name, name == "flock" ? "--kernel" : "--dot");
    return ex::usage;
#else
    return run_as(name, argc, argv);
#endif
  }
#if defined(_WIN32)
  // The arguments as UTF-8 (argv is in the ANSI code page).
  std::vector<std::string> utf8_args = utf8_arguments();
  std::vector<char*> utf8_argv;
  for (auto& x : utf8_args) utf8_argv.push_back(x.data());
  utf8_argv.push_back(nullptr);
  argc = static_cast<int>(utf8_args.size());
  argv = utf8_argv.data();
#endif
  program_argv = argv;

  CLI::App app{"dibs: locks, a shared log, exactly-once claims and retries for shell scripts", "dibs"};
  app.formatter(std::make_shared<usage_formatter>());  // before the subcommands: they copy it
  app.require_subcommand(1);
  app.set_version_flag("-V,--version", fmt::format("dibs {}.{}.{}", DIBS_VERSION_MAJOR, DIBS_VERSION_MINOR, DIBS_VERSION_PATCH));
  app.footer(std::string("\n") + exit_code_table + "\n" + store_table +
             "\nStarted as flock, lockfile or dotlockfile (a link of that name to dibs), dibs reads that\n"
             "tool's own command line and exits with its codes.\n"
             "\nSee 'dibs SUBCOMMAND --help', 'man dibs', and the guides in " DIBS_DOCDIR
             " (guide-shell.md:\nthis command; guarantees.md: what holds and what does not).");

  lock_args la;
  auto* lock = app.add_subcommand("lock", "Run COMMAND holding a lock on PATH (as flock(1), lockfile(1), dotlockfile)");
  lock->add_flag("-n,--nonblock,--nonblocking,--nb", la.nonblock, "Fail (exit 1, or -E) rather than wait if the lock is held");
  // As flock(1): an option given twice takes its last value.
  lock->add_option("-w,--wait,--timeout", la.wait, "Wait at most DURATION (10s, 500ms, 2m; a bare number is seconds; 0: as -n)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  lock->add_option("-E,--conflict-exit-code", la.conflict_code, "Exit code when the lock is not had (default 1)")
      ->check(CLI::Range(0, 255))
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  lock->add_flag("-V,--version", la.version, "Print the version and exit, as flock -V");
  lock->add_flag("--kernel", la.kernel,
                 "A kernel lock (flock(2), interoperates with flock(1)) instead of the lease lock; COMMAND inherits "
                 "its descriptor (DIBS_LOCK_FD), as with flock(1)'s default");
  lock->add_flag("--dot", la.dot,
                 "A presence lock (held while the file exists; interoperates with dotlockfile, lockfile(1), O_EXCL "
                 "and noclobber scripts) instead of the lease lock");
  lock->add_option("--lease", la.lease, "Lease lock: how long a lock is respected after dibs stops renewing it")
      ->capture_default_str();
  lock->add_option("--max", la.max,
                   "At most N at a time (as sem -j N): hold one of N permits of the semaphore kept in the directory "
                   "PATH (made if missing) instead of the lock; each permit a lease lock with its own token")
      ->check(CLI::Range(1u, 10000u));
  lock->add_option("--store", la.store,
                   "With --max N: keep the semaphore in STORE (dir:..., sqlite:..., postgres:...), named PATH, "
                   "instead of in the directory PATH: at most N at a time across the hosts that share STORE");
  lock->add_flag("--resize", la.resize,
                 "With --max N: first set the semaphore's number of permits to N, for every user");
  lock->add_flag("-s,--shared", la.shared, "Kernel lock: a shared lock");
  lock->add_flag("-x,-e,--exclusive", la.exclusive, "An exclusive lock (the default)");
  lock->add_flag("-u,--unlock", la.unlock, "Kernel lock, descriptor form: unlock FD (dibs lock --kernel -u 9)");
  lock->add_flag("-o,--close", la.close,
                 "COMMAND does not get the lock: kernel lock: no descriptor of it; lease and presence locks: the "
                 "record names dibs, so the lock ends with dibs even if COMMAND runs on");
  lock->add_option("-c,--command", la.command_string, "Run STRING with $SHELL -c (or /bin/sh -c), as flock(1)");
  lock->add_flag("-F,--no-fork", la.no_fork, "Kernel lock: dibs becomes COMMAND (exec) instead of waiting for it");
  lock->add_flag("--verbose", la.verbose,
                 "Say how long the lock took and what runs (on standard output), and why the lock was not had (on "
                 "standard error), as flock(1); without it a conflict is silent");
  lock->add_option("--fd", la.fd, "Kernel lock: lock descriptor N of the calling shell, then run COMMAND (no PATH)")
      ->check(CLI::NonNegativeNumber);
  lock->add_option("-r,--retries", la.retries, "--dot: tries after the first before giving up (-1: forever), with "
                                               "--sleep between them");
  lock->add_option("--sleep,-i,--interval", la.sleep,
                   "--dot: pause between retries (default 1s; -s with --dot, as lockfile(1)'s -SECONDS)");
  lock->add_option("-l,--lock-timeout", la.stale,
                   "--dot: a lock file older than this is stale (default 5m); a live dibs holder touches its file, so "
                   "only a foreign or dead holder's lock is broken");
  lock->add_flag("-p,--pid", la.pid, "--dot: record the pid (always done; accepted for dotlockfile's scripts)");
  lock->footer(std::string(data_rule) + R"(

As flock(1): 'dibs lock PATH COMMAND -la' passes -la to COMMAND, 'dibs lock
PATH -c STRING' runs STRING with the shell, and the descriptor form
'exec 9>/var/lock/app; dibs lock --kernel 9' locks the shell's own
descriptor (-s, -x, -u, -n, -w, -E apply), which stays locked after dibs ends.

Three locks:
  (default)  dibs's lease lock (dibs::lock_file): the lock file is a readable
             record (host, pid, since, token); a lock whose holder died is
             broken at once on proof, and COMMAND gets its fencing token in
             DIBS_TOKEN. It is held by COMMAND's own process: it lasts until
             COMMAND ends, even if dibs is killed. Unlike flock(1): it does
             not exclude flock(1) users of PATH, has no shared holders (-s),
             no descriptor form, no -u and no -F: those need --kernel.
  --kernel   flock(2), exactly flock(1)'s lock; no token.
  --dot      a presence lock (dibs::dot_lock), as dotlockfile and lockfile(1):
             held while the file exists; its first line is the holder's pid.
             Unlike theirs, a lock is broken only on proof (its holder gone)
             or by age (-l) when no live dibs keeps touching it; no token.

At most N at a time (--max N, as GNU parallel's sem -j N): PATH is then a
directory (made if missing) holding a semaphore of N permits
(dibs::lease_semaphore), each permit a lease lock as above: COMMAND holds
one while it runs, gets its token in DIBS_TOKEN and the permit's number
(0 to N-1) in DIBS_PERMIT; a permit whose holder died is taken back on
proof. Waiters are served in turn. Every user of PATH gives the same N;
--resize changes it for all of them.

Exit codes: COMMAND's status; 1 (or -E) if the lock is held (-n), or -w or
the retries (-r) ran out, silently unless --verbose; 15 if the lease lock was
lost during the run (taken over, or its lease ran out unrenewed). flock(1) exits the same; dotlockfile exits 4 when
its retries run out, lockfile(1) 73: give -E 4 or -E 73 where scripts test it.

Examples:
  dibs lock /run/lock/nightly.lock -- ./nightly.sh
  dibs lock -n -E 0 /run/lock/backup.lock -- rsync -a src/ dst/   # skip if running
  dibs lock -w 30s counter.lock -- sh -c 'n=$(cat n); echo $((n+1)) > n'
  dibs lock --kernel /var/lock/x.lock make -j4  # excludes 'flock /var/lock/x.lock ...'
  exec 9>/var/lock/app; dibs lock --kernel -n 9 || exit 1       # as 'flock -n 9'
  dibs lock --dot -r 3 -s 5 /var/mail/alice.lock -- ./fetch      # as 'lockfile -5 -r 3'
  dibs lock --max 3 /run/lock/exports -- ./export.sh             # at most 3 at once, as 'sem -j 3'
)");

  log_args lg;
  auto* logc = app.add_subcommand("log", "Append TEXT, or each line of standard input, to a log shared by many writers");
  logc->add_option("--rotate-size", lg.rotate_size, "Rotate to PATH.1, PATH.2, ... at this size (bytes, or 10M, 512K); 0: never")
      ->capture_default_str();
  logc->add_option("--keep", lg.keep, "Rotated files to keep (0: all)")->capture_default_str();
  logc->add_option("--sync", lg.sync, "Durability: none (the kernel's), record (fdatasync each), batch")->capture_default_str();
  logc->add_option("--timeout", lg.timeout, "Give up (exit 75, nothing written) if the log stays locked this long")
      ->capture_default_str();
  logc->footer(std::string(data_rule) + R"(

TEXT (its words joined by spaces) is one line; with no argument after PATH,
each line of standard input is one. Every line is appended whole and once,
never torn or interleaved with another writer's (dibs or C++
dibs::shared_log). Exit 0: every line is in the log. Every writer of the log
must go through dibs (not '>>').

Examples:
  dibs log /var/log/batch.log "job $JOB done"
  while read -r line; do dibs log batch.log -- "$line"; done < lines
  ./job.sh 2>&1 | dibs log --rotate-size 10M --keep 5 /var/log/batch.log
)");

  claim_args ca;
  auto* claim = app.add_subcommand("claim", "Run COMMAND only if KEY is claimed now; completed on exit 0");
  claim->add_option("--next", ca.next, "Claim the next claimable item whose key starts with PREFIX; its key is passed as COMMAND's last argument");
  claim->add_option("--lease", ca.lease, "How long a claim is respected once its worker stops renewing")->capture_default_str();
  claim->add_option("--max-attempts", ca.max_attempts, "Failed runs before the item fails for good")->capture_default_str();
  claim->add_option("--retry-after", ca.retry_after,
                    "How long an item whose COMMAND failed waits before it is claimable again (0: at once); default: "
                    "0.5-1 s after the first failure, doubling up to 10 min");
  claim->add_flag("-q,--quiet", ca.quiet, "No message for the 'nothing run' exits (10-14, or as moved by --exit-base)");
  claim->add_option("--exit-base", ca.exit_base,
                    "dibs's own outcomes exit N..N+5 instead of 10..15 (completed N, held N+1, failed N+2, damaged "
                    "N+3, nothing under --next N+4, claim lost N+5); COMMAND's status is passed through unchanged, so "
                    "choose N outside COMMAND's codes")
      ->capture_default_str();
  claim->footer(std::string(data_rule) + R"(

COMMAND runs with DIBS_KEY, DIBS_TOKEN (the claim's fencing token, larger for
every new claim of the key) and DIBS_ATTEMPT. Exit 0: the item is marked
completed. Any other status: the item is given back (claimable again after
--retry-after or the default backoff) and dibs exits with that status; after
--max-attempts runs it is failed for good.
If dibs is killed, COMMAND is killed too and the item is claimable again at
once (the worker is provably gone).

)" + store_table + R"(
Examples:
  dibs claim dir:/srv/claims invoice-17 -- ./send-invoice 17
  ls inbox | xargs -P4 -I{} dibs claim -q dir:/srv/claims {} -- ./handle inbox/{}
  dibs claim --next mail/ sqlite:/srv/q.db -- ./handle-mail    # key as last argument
)");

  offer_args oa;
  auto* offer = app.add_subcommand("offer", "Put the keys of standard input (one a line) in a claim store's queue");
  offer->add_option("--priority", oa.priority, "Claimed before items of a lower priority (dibs work, claim --next)")
      ->capture_default_str();
  offer->add_option("--not-before", oa.not_before,
                    "Not claimable before WHEN: a duration from now (10m, 2h) or @SECONDS since the epoch");
  offer->add_flag("-q,--quiet", oa.quiet, "Print nothing on success");
  offer->add_flag("-v,--verbose", oa.verbose, "Say each batch on standard error, and '0 offered' when there are no keys");
  offer->footer(std::string(data_rule) + R"(

Reads every line of standard input first, one key a line (a trailing CR is
dropped, for files written on Windows), and checks them all before anything
is written: an empty line, a key over 1,024 bytes or a key given twice ends
dibs with 65, naming the line(s), and nothing is offered. Then offers them,
1,000 per statement or transaction, as items claimable by 'dibs work' and
'dibs claim --next'; a key that already has a record (offered, claimed,
done) is left as it is. Prints "N offered, M already had a record" on
standard output (-q: nothing). No keys at all: nothing to do, exit 0.

)" + store_table + R"(
Examples:
  ls inbox | dibs offer sqlite:/srv/q.db
  seq -f 'job-%g' 1 100 | dibs offer --priority 5 dir:/srv/q
  echo report-2024-06 | dibs offer --not-before @1719792000 sqlite:/srv/q.db
)");

  work_args wa;
  auto* work = app.add_subcommand("work", "Run COMMAND once per claimed item of a queue, KEY as its last argument, -j at a time");
  work->add_option("--prefix", wa.prefix, "Only items whose key starts with PREFIX");
  work->add_option("-j,--jobs", wa.jobs, "At most N COMMANDs at once (1 to 1,024)")->capture_default_str();
  work->add_flag("--wait", wa.wait,
                 "When nothing is claimable, wait for new items (looking from every 10 ms to every 1 s) until a "
                 "signal, instead of ending");
  work->add_option("--lease", wa.lease, "How long a claim is respected once its worker stops renewing")->capture_default_str();
  work->add_option("--max-attempts", wa.max_attempts, "Failed runs before an item fails for good")->capture_default_str();
  work->add_option("--retry-after", wa.retry_after,
                   "How long an item whose COMMAND failed waits before it is claimable again (0: at once); default: "
                   "0.5-1 s after the first failure, doubling up to 10 min");
  work->add_flag("-q,--quiet", wa.quiet, "No message for failed COMMANDs, nor for 'nothing claimable' (14)");
  work->add_option("--exit-base", wa.exit_base,
                   "dibs's own outcomes exit N..N+5 instead of 10..15 (nothing claimable N+4, claim lost N+5), as "
                   "with dibs claim")
      ->capture_default_str();
  work->footer(std::string(data_rule) + R"(

Claims the queue's items (offered by 'dibs offer', given back, or of a
worker that is gone) and runs COMMAND KEY for each, at most -j at once, with
DIBS_KEY, DIBS_TOKEN and DIBS_ATTEMPT set as 'dibs claim' sets them. Exit 0
completes the item (the ends that come together in one statement); any other
status gives it back (claimable again after --retry-after or the default
backoff; failed for good after --max-attempts). It claims only for free
slots: an item it holds is an item it runs. Without --wait it ends when
nothing is claimable and nothing runs.
Signals INT, TERM, HUP, QUIT, USR1, USR2 are forwarded to every running
COMMAND; after INT, TERM, HUP or QUIT dibs claims nothing more, waits for the
running COMMANDs, completes or gives back their items by their status (an
item whose COMMAND that signal ended is claimable again at once), and exits
128+N. If dibs is killed, its COMMANDs are killed too and their items are
claimable again at once (the worker is provably gone).

Exit codes: 0 if every COMMAND it ran exited 0 and was completed; 14 (or
--exit-base's N+4) if nothing was claimable at all; else the status of the
last COMMAND that exited non-zero (its item was given back); else 15 (N+5)
if a claim was taken over before its completion; 128+N after signal N.

)" + store_table + R"(
Examples:
  ls inbox | dibs offer sqlite:/srv/q.db && dibs work -j 4 sqlite:/srv/q.db -- ./handle
  dibs work --wait -j 8 --prefix mail/ sqlite:/srv/q.db -- ./send-mail    # a service: until SIGTERM
  dibs work -j 2 --retry-after 1m dir:/srv/q -- sh -c 'convert "inbox/$1" "out/$1.pdf"' sh
)");

  retry_args ra;
  auto* retry = app.add_subcommand("retry", "Re-run COMMAND with backoff while it exits with a transient code");
  retry->add_option("-a,--attempts", ra.attempts, "Runs at most")->capture_default_str();
  retry->add_option("-d,--deadline", ra.deadline, "Start no run after this long (sleeps are cut to it)");
  retry->add_option("--initial", ra.initial, "First delay")->capture_default_str();
  retry->add_option("--cap", ra.cap, "Largest delay")->capture_default_str();
  retry->add_option("--multiplier", ra.multiplier, "Growth of the delay")->capture_default_str();
  retry->add_option("--jitter", ra.jitter, "none, full, equal or decorrelated")->capture_default_str();
  retry->add_option("--on", ra.codes, "Exit codes that are retried (repeat or comma-separate), each 0-255")
      ->delimiter(',')
      ->check(CLI::Range(0, 255))
      ->capture_default_str();
  retry->add_flag("-v,--verbose", ra.verbose, "Say each retry on standard error");
  retry->footer(std::string(data_rule) + R"(

Exits with COMMAND's last status. Signals (INT, TERM, HUP, QUIT, USR1, USR2)
are forwarded to COMMAND; one that comes during a sleep ends dibs with 128+N.
A run is never cut short: use timeout(1) inside for that.

Examples:
  dibs retry -- curl -fsS https://example.org/ping   # retries curl's exit 75
  dibs retry --on 75,7 --attempts 8 --deadline 2m --cap 30s -- ./upload.sh
)");

  once_args na;
  auto* once = app.add_subcommand("once", "Run COMMAND once per slot of a schedule, across every host that runs it");
  once->add_option("--every", na.every, "A slot of each PERIOD from the epoch, in UTC (1h, 1d, 15m)");
  once->add_option("--slot", na.slot, "The slot's name, given by the caller (e.g. $(date +%F)), instead of --every's");
  once->add_option("--store", na.store,
                   "Where the slots are kept; for several hosts a shared one (postgres:..., a dir: every host "
                   "sees); default: dir:$XDG_STATE_HOME/dibs/once (this host only)");
  once->add_option("--lease", na.lease, "How long a run is respected once its dibs stops renewing")->capture_default_str();
  once->add_option("--standby", na.standby,
                   "How long to stand by while another host runs the slot, to take it over if that host dies "
                   "(default: until the slot ends; 0: not at all)");
  once->add_option("--max-attempts", na.max_attempts, "Runs of a slot in all (failed, or whose host died)")
      ->capture_default_str();
  once->add_option("--catch-up", na.catch_up,
                   "skip: a slot no host ran stays missed; latest: run the latest missed one first")
      ->capture_default_str();
  once->add_option("--keep", na.keep, "Slots kept; older ones are never run again")->capture_default_str();
  once->add_flag("-q,--quiet", na.quiet, "No message for the 'nothing run' exits (10-12, 16)");
  once->footer(std::string(data_rule) + R"(

For a crontab line on every host: each runs it at the slot, one of them
runs COMMAND, the others stand by (and take the slot over if that host
dies mid-run), then exit 10. COMMAND gets DIBS_SLOT (the slot: its start in
UTC, or --slot's name), DIBS_TOKEN (the run's fencing token, larger for each
run of the slot) and DIBS_ATTEMPT. Exit 0: the slot is done, never run again.
Another status: the slot is given back, and a host standing by runs it
again, up to --max-attempts runs. Slots are by the server's clock on
postgres:, else by each host's: a host whose clock is off runs a slot early
or late, never twice.

Exit codes: COMMAND's status if it ran here; 10 another host ran the slot;
11 another host runs it now (--standby ran out); 12 it failed for good; 13
its record is damaged; 15 COMMAND exited 0 but the run was taken over; 16
the slot is older than --keep slots (this host's clock is far behind); 64+
as every subcommand (69: the store cannot be reached). 'dibs status --once
NAME STORE' shows who ran each recent slot, and the missed ones.

)" + store_table + R"(
Examples:
  0 * * * * dibs once --every 1h --store postgres:host=db1 cleanup -- ./cleanup.sh
  30 2 * * * dibs once --slot $(date -u +\%F) --store postgres:host=db1 nightly -- ./export.sh
)");

  status_args sa;
  auto* status = app.add_subcommand("status", "Who holds a lock file, or the items of a claim store by state");
  status->add_option("--prefix", sa.prefix, "Only items whose key starts with PREFIX");
  status->add_flag("--json", sa.json, "JSON for programs instead of a table");
  status->add_option("--once", sa.once, "The schedule NAME of dibs once in STORE: its recent slots, missed ones too");
  status->add_option("--semaphore", sa.semaphore,
                     "The semaphore NAME of dibs lock --max --store in STORE: its permits and holders");
  status->add_option("--last", sa.last, "With --once: how many recent slots")->capture_default_str()->check(CLI::Range(1, 100000));
  status->footer(std::string(data_rule) + R"(

TARGET: a lock file (lease, or presence: dibs lock --dot, dotlockfile,
lockfile(1)), a directory of dibs lock --max, or a STORE (dir:...,
sqlite:..., postgres:...): its items, then the semaphores and schedules it
keeps; with --once NAME or --semaphore NAME, the STORE of that schedule
or semaphore. Reads only: takes no lock, changes nothing.

Examples:
  dibs status /run/lock/nightly.lock
  dibs status /run/lock/exports                        # a semaphore's permits
  dibs status --once nightly-export postgres:host=db1  # who ran each slot, and the missed ones
  dibs status --semaphore exports postgres:host=db1    # dibs lock --max 3 --store postgres:host=db1 exports
  dibs status --json dir:/srv/claims | jq '.[] | select(.state == "failed")'
)");

  name_values(app);

  // lock's -s is flock(1)'s --shared, and only that. A presence lock has no
  // shared form, and its pause between tries is -i or --sleep: -s with --dot
  // is refused, naming them. (It was lockfile(1)'s pause there once, a
  // letter with two meanings; under the name lockfile, -s is still
  // lockfile(1)'s: tools/as_lockfile.hpp.)
  if (argc >= 2 && std::string_view{argv[1]} == "lock" && dot_among_options(*lock, argc, argv) &&
      s_among_options(*lock, argc, argv)) {
    std::cerr << "dibs lock --dot: -s is --shared, which a presence lock does not have; the pause between tries is "
                 "-i SECS or --sleep SECS (lockfile(1)'s -s, under the name lockfile, is unchanged)\n";
    return ex::usage;
  }
  // CLI11 gets the options; the data after them is taken apart below.
  std::vector<char*> cli_argv(argv, argv + std::min(argc, 2));
  data_args data;
  if (argc >= 2) {
    const CLI::App* sub = nullptr;
    for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
      if (s->get_name() == argv[1]) sub = s;
    if (!sub) {
      cli_argv.assign(argv, argv + argc);  // top-level options, or an unknown subcommand: CLI11 says which
    } else {
      int dashes = -1;
      const int start = data_start(*sub, argc, argv, 2, &dashes);
      for (int i = 2; i < start; ++i)
        if (i != dashes) cli_argv.push_back(argv[i]);
      data.v.assign(argv + start, argv + argc);
    }
  }
  // What a subcommand needs as its first data argument; says so if absent.
  auto need = [&](const char* sub, const char* what, const char* synopsis) {
    if (data.done()) fail(ex::usage, fmt::format("dibs {}: no {}; write: dibs {} {}", sub, what, sub, synopsis));
    return data.take();
  };

  try {
    try {
      app.parse(static_cast<int>(cli_argv.size()), cli_argv.data());
    } catch (const CLI::CallForHelp& e) {
      return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
      return app.exit(e);
    } catch (const CLI::CallForVersion& e) {
      return app.exit(e);
    } catch (const CLI::ParseError& e) {
      const auto* sub = app.get_subcommands().empty() ? nullptr : app.get_subcommands().front();
      std::cerr << "dibs" << (sub ? " " + sub->get_name() : std::string{}) << ": " << redact(e.what()) << "\nRun 'dibs"
                << (sub ? " " + sub->get_name() : std::string{}) << " --help' for usage.\n";
      return ex::usage;
    }
    if (lock->parsed()) {
      if (la.version) {
        fmt::print("dibs lock from dibs {}.{}.{}\n", DIBS_VERSION_MAJOR, DIBS_VERSION_MINOR, DIBS_VERSION_PATCH);
        return ex::ok;
      }
      // As flock(1): of -s, -x (-e) and -u, the last one given wins.
      if (const char m = last_lock_mode(*lock, cli_argv)) {
        la.shared = m == 's';
        la.exclusive = m == 'x';
        la.unlock = m == 'u';
      }
      const bool has_string = lock->count("--command") > 0;
      if (lock->count("--fd") == 0) {
        la.path = need("lock", "PATH", "[OPTIONS] PATH -- COMMAND [ARGS...]");
        // flock(1)'s 'PATH -c STRING': the string is the whole command.
        if (!data.done() && (data.v[data.at] == "-c" || data.v[data.at] == "--command")) {
          const std::string opt = data.take();
          if (data.v.size() - data.at != 1)
            fail(ex::usage, fmt::format("dibs lock: {} after PATH takes exactly one argument, the command string; "
                                        "quote it: dibs lock {} {} 'COMMAND ARGS...'",
                                        opt, la.path, opt));
          la.command = shell_command(data.take());
          la.shell = true;
        }
      }
      if (la.command.empty()) la.command = data.rest();
      if (has_string) {
        if (!la.command.empty())
          fail(ex::usage, "dibs lock: -c STRING and a COMMAND after PATH: give one of them");
        la.command = shell_command(la.command_string);
        la.shell = true;
      }
      // flock(1)'s descriptor form: a number and nothing after it.
      int fd = -1;
      const char* end = la.path.data() + la.path.size();
      if (la.fd < 0 && la.command.empty() && !la.path.empty() &&
          std::from_chars(la.path.data(), end, fd).ptr == end && fd >= 0)
        la.fd = fd;
      return cmd_lock(la);
    }
    if (logc->parsed()) {
      lg.path = need("log", "PATH", "[OPTIONS] PATH [--] [TEXT...]");
      lg.text = data.rest();
      lg.from_stdin = lg.text.empty();
      return cmd_log(lg);
    }
    if (claim->parsed()) {
      ca.has_next = claim->count("--next") > 0;
      ca.store = need("claim", "STORE", "[OPTIONS] STORE KEY -- COMMAND [ARGS...]");
      if (!ca.has_next) ca.key = need("claim", "KEY", "[OPTIONS] STORE KEY -- COMMAND [ARGS...], or --next PREFIX");
      ca.command = data.rest();
      return cmd_claim(ca);
    }
    if (offer->parsed()) {
      oa.store = need("offer", "STORE", "[OPTIONS] STORE < KEYS");
      if (!data.done())
        fail(ex::usage, fmt::format("dibs offer: '{}' after STORE '{}' is not expected: the keys come on standard "
                                    "input, one a line (e.g. printf '%s\\n' KEY... | dibs offer STORE); options go "
                                    "before STORE",
                                    data.take(), oa.store));
      return cmd_offer(oa);
    }
    if (work->parsed()) {
      wa.store = need("work", "STORE", "[OPTIONS] STORE -- COMMAND [ARGS...]");
      wa.command = data.rest();
      return cmd_work(wa);
    }
    if (retry->parsed()) {
      ra.command = data.rest();
      return cmd_retry(ra);
    }
    if (once->parsed()) {
      na.name = need("once", "NAME", "[OPTIONS] NAME -- COMMAND [ARGS...]");
      na.command = data.rest();
      return cmd_once(na);
    }
    if (status->parsed()) {
      sa.target = need("status", "TARGET", "[OPTIONS] TARGET");
      if (!data.done())
        fail(ex::usage, fmt::format("dibs status: '{}' after TARGET '{}' is not expected (options go before TARGET; "
                                    "one TARGET at a time)",
                                    data.take(), sa.target));
      return cmd_status(sa);
    }
  } catch (const failure& f) {
    std::cerr << redact(f.msg) << '\n';
    return f.code;
  } catch (const std::system_error& e) {
    const auto [code, hint] = classify(e);
    std::cerr << redact(fmt::format("dibs: {}{}", e.what(), hint ? fmt::format(" ({})", hint) : "")) << '\n';
    return code;
  } catch (const std::exception& e) {
    std::cerr << "dibs: " << redact(e.what()) << '\n';
    return ex::software;
  }
  return ex::usage;
}

// Returns: `code`, or 74 if it is 0 and what dibs wrote to standard output
// did not all get there (a closed descriptor, a full disk, /dev/full): a
// script must not take a status it never saw for success.
int checked_stdout(int code) {
  std::cout.flush();
  errno = 0;
  const bool failed = std::fflush(stdout) != 0 || std::ferror(stdout) || std::cout.fail();
  if (!failed) return code;
  const int e = errno;
  std::cerr << fmt::format("dibs: cannot write to standard output{}{}\n", e ? ": " : "", e ? std::strerror(e) : "");
  return code != 0 && !showing_status ? code : ex::ioerr;
}

}  // namespace

int main(int argc, char** argv) { return checked_stdout(run(argc, argv)); }
