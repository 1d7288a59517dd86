// dibs/detail/posix/shell_command.hpp: running a command line with the
// shell (/bin/sh -c) and taking what it writes to its standard output, with
// a deadline: for imap::token_command, which runs a token helper the way
// mbsync's PassCmd and msmtp's passwordeval do. The command's standard
// input and standard error are this process's (a helper may ask a person on
// the terminal, and says why it failed where our own errors go). No Windows
// body yet: imap/client.hpp leaves token_command out there.
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

/// Effects: runs `command` with /bin/sh -c, its standard output read into
/// the result, waiting `timeout` at most for it to finish (then it is
/// killed with SIGKILL; only the shell: a process it left running in the
/// background is left alone). It starts with no signal blocked and SIGPIPE
/// at its default, whatever this process does with them (the dibs command
/// blocks the signals it forwards). Not in a process group of its own: a
/// helper that asks on the terminal still can. Returns: what it wrote and
/// how it ended. Throws: std::system_error (errno) if it cannot be started.
inline shell_result run_shell(const std::string& command, std::chrono::milliseconds timeout, std::size_t max_out) {
  using clock = std::chrono::steady_clock;
  const auto until = clock::now() + timeout;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw std::system_error(errno, std::generic_category(), "cannot make a pipe for its output");
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawnattr_init(&attr);
  ::posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);  // dup2 leaves the copy without O_CLOEXEC
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  ::posix_spawnattr_setsigmask(&attr, &none);
  ::posix_spawnattr_setsigdefault(&attr, &defaults);
  ::posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  char sh[] = "sh", dash_c[] = "-c";
  char* argv[] = {sh, dash_c, const_cast<char*>(command.c_str()), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, "/bin/sh", &actions, &attr, argv, environ);
  ::posix_spawn_file_actions_destroy(&actions);
  ::posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    throw std::system_error(rc, std::generic_category(), "cannot start /bin/sh");
  }

  shell_result r;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1'000'000)));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) continue;  // the loop's top tells whether the deadline passed
    const auto got = ::read(fds[0], buf, sizeof buf);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) break;  // the end of its output (or a read error: taken as the end)
    if (r.out.size() + static_cast<std::size_t>(got) > max_out) {
      r.too_long = true;
      break;
    }
    r.out.append(buf, static_cast<std::size_t>(got));
  }
  ::close(fds[0]);
  bool killed = r.timed_out || r.too_long;
  if (killed) ::kill(pid, SIGKILL);
  // Its output ended: it is exiting, usually at once. One that closed its
  // output and went on is waited for until the deadline, then killed.
  int status = 0;
  for (auto pause = std::chrono::microseconds{500};;) {
    const pid_t w = ::waitpid(pid, &status, killed ? 0 : WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return r;  // ECHILD: SIGCHLD is ignored here, the child was reaped unseen; how it ended is unknown
    if (clock::now() >= until) {
      ::kill(pid, SIGKILL);
      r.timed_out = killed = true;
      continue;
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(pause).count();
    timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
    ::nanosleep(&ts, nullptr);
    pause = std::min(pause * 2, std::chrono::microseconds{50'000});
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

}  // namespace dibs::detail
