// dibs/detail/posix/shell_command.hpp: running a command line with the
// shell (/bin/sh -c) and taking what it writes to its standard output, with
// a deadline: for imap::token_command, which runs a token helper the way
// mbsync's PassCmd and msmtp's passwordeval do. The command's standard
// error is this process's (a helper says why it failed where our own errors
// go); its standard input is /dev/null unless ours is a terminal (a helper
// may ask a person there; data piped to this program is never its). No
// Windows body yet: imap/client.hpp leaves token_command out there.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <string>
#include <system_error>

#include <dibs/detail/posix/sys.hpp>

extern char** environ;  // POSIX: declared by no header unless _GNU_SOURCE

namespace dibs::detail {

/// What became of a command run by run_shell().
struct shell_result {
  std::string out;          ///< what it wrote to its standard output (at most max_out bytes)
  bool timed_out = false;   ///< it had not finished at the deadline: killed (SIGKILL)
  bool too_long = false;    ///< it wrote more than max_out bytes: killed (SIGKILL)
  int exit_code = -1;       ///< its exit status, if it exited (-1: it did not, or that could not be learned)
  int signal = 0;           ///< the signal that ended it, if one did (SIGKILL after timed_out or too_long)
};

namespace shell_detail {

// The posix_spawn attributes and file actions, destroyed at the end of
// their scope (only those whose init succeeded).
struct spawn_setup {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  bool have_actions = false, have_attr = false;
  spawn_setup() = default;
  spawn_setup(const spawn_setup&) = delete;
  spawn_setup& operator=(const spawn_setup&) = delete;
  ~spawn_setup() {
    if (have_actions) ::posix_spawn_file_actions_destroy(&actions);
    if (have_attr) ::posix_spawnattr_destroy(&attr);
  }
};

// A child not yet waited for: at the end of its scope (an exception, say)
// killed with SIGKILL and reaped, never left a zombie. Before a kill it is
// asked whether it still runs (waitpid WNOHANG): a pid that was reaped
// (by an application's SIGCHLD handler, or SIGCHLD ignored) may be reused.
struct child_guard {
  pid_t pid = -1;
  bool group = false;  // it leads a process group of its own: a kill ends what it started too
  bool reaped = false;
  int status = 0;
  bool known = false;  // status holds how it ended
  child_guard() = default;
  child_guard(const child_guard&) = delete;
  child_guard& operator=(const child_guard&) = delete;
  ~child_guard() {
    if (pid > 0 && !reaped) {
      if (!poll_exit()) kill();
      while (!reaped) wait_blocking();
    }
  }
  // Returns: true if it has ended (reaped here, or gone unseen: ECHILD).
  bool poll_exit() noexcept {
    if (reaped) return true;
    for (;;) {
      const pid_t w = ::waitpid(pid, &status, WNOHANG);
      if (w == pid) return reaped = known = true;
      if (w == 0) return false;
      if (errno == EINTR) continue;
      return reaped = true;  // ECHILD: reaped unseen; how it ended is unknown
    }
  }
  void kill() noexcept {
    if (!poll_exit()) ::kill(group ? -pid : pid, SIGKILL);
  }
  void wait_blocking() noexcept {
    while (!reaped) {
      const pid_t w = ::waitpid(pid, &status, 0);
      if (w == pid) reaped = known = true;
      else if (w < 0 && errno != EINTR) reaped = true;
    }
  }
};

inline void check_setup(int rc, const char* what) {
  if (rc != 0) throw std::system_error(rc, std::generic_category(), what);
}

}  // namespace shell_detail

/// Effects: runs `command` with /bin/sh -c, its standard output read into
/// the result, waiting `timeout` at most for it to finish (then it is
/// killed with SIGKILL, with what it started: it leads a process group of
/// its own, unless our standard input is a terminal). Once the shell has exited, what its output
/// already holds is read and the reading stops: a background process that
/// keeps the output open (a `cmd &`, an agent started on the way) neither
/// holds it up nor loses what the shell printed. It starts with no signal
/// blocked, SIGPIPE and SIGCHLD at their defaults, whatever this process
/// does with them (the dibs command blocks the signals it forwards), and
/// standard input /dev/null unless ours is a terminal. With a terminal it
/// stays in our process group, so that a helper that asks a person can
/// read the terminal (a background group's read stops it), and a kill at
/// the deadline ends the shell only. A process it left running after
/// it exited in time is left alone. Every
/// descriptor is closed and the shell reaped on every path out (an
/// exception too). Returns: what it wrote and how it ended. Throws:
/// std::system_error (errno) if it cannot be started.
inline shell_result run_shell(const std::string& command, std::chrono::milliseconds timeout, std::size_t max_out) {
  using clock = std::chrono::steady_clock;
  using namespace shell_detail;
  const auto until = clock::now() + timeout;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw std::system_error(errno, std::generic_category(), "cannot make a pipe for its output");
  unique_fd read_end{fds[0]}, write_end{fds[1]};
  child_guard child;
  {
    spawn_setup s;
    check_setup(::posix_spawn_file_actions_init(&s.actions), "cannot set up /bin/sh (posix_spawn_file_actions_init)");
    s.have_actions = true;
    check_setup(::posix_spawnattr_init(&s.attr), "cannot set up /bin/sh (posix_spawnattr_init)");
    s.have_attr = true;
    // dup2 leaves the copy without O_CLOEXEC
    check_setup(::posix_spawn_file_actions_adddup2(&s.actions, fds[1], STDOUT_FILENO),
                "cannot set up /bin/sh (posix_spawn_file_actions_adddup2)");
    short flags = POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
    if (!::isatty(STDIN_FILENO)) {
      check_setup(::posix_spawn_file_actions_addopen(&s.actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0),
                  "cannot set up /bin/sh (posix_spawn_file_actions_addopen /dev/null)");
      // A group of its own: a helper killed at the deadline takes what it
      // started with it (dash runs `sleep 30` as a child, which would
      // otherwise outlive it, holding our standard error).
      check_setup(::posix_spawnattr_setpgroup(&s.attr, 0), "cannot set up /bin/sh (posix_spawnattr_setpgroup)");
      flags |= POSIX_SPAWN_SETPGROUP;
      child.group = true;
    }
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGPIPE);
    sigaddset(&defaults, SIGCHLD);  // ignored here, it would stay ignored across exec: a helper's waitpid fails
    check_setup(::posix_spawnattr_setsigmask(&s.attr, &none), "cannot set up /bin/sh (posix_spawnattr_setsigmask)");
    check_setup(::posix_spawnattr_setsigdefault(&s.attr, &defaults),
                "cannot set up /bin/sh (posix_spawnattr_setsigdefault)");
    check_setup(::posix_spawnattr_setflags(&s.attr, flags),
                "cannot set up /bin/sh (posix_spawnattr_setflags)");
    char sh[] = "sh", dash_c[] = "-c";
    char* argv[] = {sh, dash_c, const_cast<char*>(command.c_str()), nullptr};
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, "/bin/sh", &s.actions, &s.attr, argv, environ);
    if (rc != 0) throw std::system_error(rc, std::generic_category(), "cannot start /bin/sh");
    child.pid = pid;
  }
  write_end.reset();

  shell_result r;
  char buf[4096];
  // Reads what is there now (poll `wait_ms`). Returns: false at the end of
  // the output, a read error, or more than max_out bytes (r.too_long).
  auto read_some = [&](int wait_ms, bool& got_any) {
    got_any = false;
    pollfd p{read_end.get(), POLLIN, 0};
    const int n = ::poll(&p, 1, wait_ms);
    if (n < 0) return errno == EINTR;
    if (n == 0) return true;
    const auto got = ::read(read_end.get(), buf, sizeof buf);
    if (got < 0) return errno == EINTR || errno == EAGAIN;
    if (got == 0) return false;  // the end of its output
    if (r.out.size() + static_cast<std::size_t>(got) > max_out) {
      r.too_long = true;
      return false;
    }
    r.out.append(buf, static_cast<std::size_t>(got));
    got_any = true;
    return true;
  };
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      break;
    }
    // Short slices: the shell's exit is learned between them.
    bool got_any = false;
    if (!read_some(static_cast<int>(std::min<long long>(left.count(), 20)), got_any)) break;
    if (!got_any && child.poll_exit()) {
      // The shell has exited: everything it (and what it waited for) wrote
      // is in the pipe now. Take that, and no more: a background process
      // may keep the pipe open for ever.
      while (clock::now() < until && read_some(0, got_any) && got_any) {
      }
      break;
    }
  }
  read_end.reset();
  if (r.timed_out || r.too_long) child.kill();
  // Its output ended: it is exiting, usually at once. One that closed its
  // output and went on is waited for until the deadline, then killed.
  for (auto pause = std::chrono::microseconds{500}; !child.poll_exit();) {
    if (clock::now() >= until) {
      r.timed_out = true;
      child.kill();
      child.wait_blocking();
      break;
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(pause).count();
    timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
    ::nanosleep(&ts, nullptr);
    pause = std::min(pause * 2, std::chrono::microseconds{50'000});
  }
  if (!child.known) return r;  // reaped unseen (SIGCHLD ignored here): how it ended is unknown
  if (WIFEXITED(child.status)) r.exit_code = WEXITSTATUS(child.status);
  if (WIFSIGNALED(child.status)) r.signal = WTERMSIG(child.status);
  return r;
}

}  // namespace dibs::detail
