// dibs/detail/posix/process.hpp: what one process can learn about another
// on Linux, for the proof rule in detail/owner.hpp: start times and states
// from /proc, whether a pid exists, this process's namespaces, host name and
// boot id. Whatever cannot be read is reported as unknown (0, nullopt,
// false, ""), never as an answer: the rule counts the unknown as alive.
// A Windows body (GetProcessTimes, the boot time) goes beside this one.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include <dibs/detail/process_identity.hpp>

namespace dibs::detail {

inline std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

/// Returns: field 22 (start time) of a /proc/<pid>/stat text, or nullopt.
inline std::optional<std::uint64_t> stat_start(const std::string& stat) {
  const auto close = stat.rfind(')');  // the command name may hold spaces and ')'
  if (close == std::string::npos || close + 2 > stat.size()) return std::nullopt;
  std::istringstream fields(stat.substr(close + 2));
  std::string f;
  for (int i = 3; i <= 22 && fields >> f; ++i) {
    if (i == 22) {
      std::uint64_t v = 0;
      const auto [p, ec] = std::from_chars(f.data(), f.data() + f.size(), v);
      if (ec != std::errc{} || v == 0) return std::nullopt;
      return v;
    }
  }
  return std::nullopt;
}

/// Returns: the start time of process `pid` as this process's /proc shows
/// it, or nullopt if it cannot be read (no such process, hidepid, no /proc).
inline std::optional<std::uint64_t> process_start(long pid) {
  return stat_start(read_first_line(fmt::format("/proc/{}/stat", pid).c_str()));
}

/// Returns: true if a /proc/<pid>/stat (or task/<tid>/stat) text says the
/// task has exited (state Z, zombie, or X, dead).
inline bool stat_exited(const std::string& stat) {
  const auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  return stat[close + 2] == 'Z' || stat[close + 2] == 'X';
}

/// Returns: true if process `pid` has exited and only waits to be reaped:
/// every one of its threads has exited. Its first thread alone says Z also
/// when it ended with pthread_exit while other threads run on, so each
/// thread is read; whatever cannot be read counts as running.
inline bool all_threads_exited(long pid) {
  const std::string dir = fmt::format("/proc/{}/task", pid);
  std::unique_ptr<DIR, int (*)(DIR*)> d{::opendir(dir.c_str()), ::closedir};
  if (!d) return false;
  bool any = false;
  while (const dirent* e = ::readdir(d.get())) {
    if (e->d_name[0] == '.') continue;
    const std::string stat = read_first_line(fmt::format("{}/{}/stat", dir, e->d_name).c_str());
    if (!stat_exited(stat)) return false;
    any = true;
  }
  return any;
}

/// Returns: the inode of namespace link `name` of this process (0 if unreadable).
inline std::uint32_t own_namespace(const char* name) {
  struct ::stat st {};
  if (::stat(fmt::format("/proc/self/ns/{}", name).c_str(), &st) != 0) return 0;
  return static_cast<std::uint32_t>(st.st_ino);  // namespace inodes are 32-bit (proc inode numbers)
}

/// Returns: true if /proc is the proc of this process's own PID namespace:
/// /proc/self/status lists one pid in NSpid, and it is getpid(). A /proc of
/// an ancestor namespace (unshare --pid without --mount-proc) lists several,
/// and its /proc/<pid> would name another process.
inline bool proc_is_own_namespace(long pid) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("NSpid:", 0) != 0) continue;
    std::istringstream rest(line.substr(6));
    long first = 0, second = 0;
    if (!(rest >> first)) return false;
    return first == pid && !(rest >> second);
  }
  return false;  // no NSpid line (a kernel before 4.1): cannot tell
}

/// Returns: the text of /proc/<pid>/stat ("" if it cannot be read).
inline std::string process_stat(long pid) { return read_first_line(fmt::format("/proc/{}/stat", pid).c_str()); }

/// Returns: this process's start time (in its own time namespace: /proc/self
/// is this process whichever namespace /proc belongs to), or nullopt.
inline std::optional<std::uint64_t> own_start() { return stat_start(read_first_line("/proc/self/stat")); }

/// Returns: true only if no process has the pid `pid` here (kill(pid, 0)
/// says ESRCH; EPERM means one exists that we may not signal).
inline bool pid_absent(long pid) noexcept {
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

/// Returns: this machine's host name ("" if it cannot be read).
inline std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return host;
}

/// Returns: the id of this boot of the machine ("" if it cannot be read): a
/// pid or a start time means something only within one boot.
inline std::string boot_id() { return read_first_line("/proc/sys/kernel/random/boot_id"); }

/// Returns: this process's identity: its pid, its start time (in its own
/// time namespace: /proc/self is this process whichever namespace /proc
/// belongs to) and its PID and time namespaces.
inline process_identity own_process() {
  return {static_cast<long>(::getpid()), own_start().value_or(0), own_namespace("pid"), own_namespace("time")};
}

/// Returns: true if this process (pid `pid`) can read other processes'
/// start times: /proc is its own PID namespace's.
inline bool own_pids_readable(long pid) { return proc_is_own_namespace(pid); }

/// Returns: true only on proof that process `p`, which ran on this machine
/// in this boot, is gone, judged by `me` (this process's identity; with
/// `proc_own`, /proc shows our namespace's processes):
///   - it ran in our own PID namespace (a pid means nothing across
///     namespaces: two containers of one pod both have a pid 1), and
///   - either its pid no longer exists here (kill(pid, 0) says ESRCH), or
///     a process with that pid exists but started at another time (the pid
///     was reused), where start times are compared only when both sides
///     stand in the same time namespace and /proc is our namespace's, or it
///     exited and only waits to be reaped (all its threads).
inline bool process_gone(const process_identity& p, const process_identity& me, bool proc_own) {
  if (p.pid <= 0 || p.pid_ns == 0 || me.pid_ns == 0 || p.pid_ns != me.pid_ns) return false;
  const bool starts_comparable = p.start != 0 && p.time_ns == me.time_ns;
  if (p.pid == me.pid)  // our own pid: that was us, or an earlier process with our pid
    return starts_comparable && me.start != 0 && p.start != me.start;
  if (pid_absent(p.pid)) return true;
  // The pid exists (EPERM says so too). Reused by a later process?
  if (!starts_comparable || !proc_own) return false;
  const std::string stat = process_stat(p.pid);
  const auto now = stat_start(stat);
  if (!now) return pid_absent(p.pid);  // gone meanwhile, or unreadable: alive
  // The same process, exited but not reaped yet (a zombie: its parent has
  // not waited for it, or it was orphaned and init reaps slowly) is gone
  // too: all its threads, not just its first (which says Z also when it
  // ended with pthread_exit and the others run on).
  return *now != p.start || (stat_exited(stat) && all_threads_exited(p.pid));
}

}  // namespace dibs::detail
