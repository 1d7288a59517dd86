// dibs/detail/owner.hpp: who holds a lease, written so a person can read it,
// and the proof rules for deciding that a holder is gone.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <dibs/detail/posix.hpp>

namespace dibs::detail {

/// The identity of a process, as far as another process can check it.
struct owner_id {
  std::string host;
  std::string boot;          // /proc/sys/kernel/random/boot_id
  long pid = 0;
  std::uint64_t start = 0;   // process start time, clock ticks after boot (/proc/<pid>/stat field 22)
  std::chrono::milliseconds lease{0};

  friend bool operator==(const owner_id&, const owner_id&) = default;
};

inline std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

/// Returns: the start time of process `pid` (field 22 of /proc/<pid>/stat),
/// or nullopt if there is no such process.
inline std::optional<std::uint64_t> process_start(long pid) {
  const std::string stat = read_first_line(fmt::format("/proc/{}/stat", pid).c_str());
  const auto close = stat.rfind(')');  // the command name may hold spaces and ')'
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(close + 2));
  std::string f;
  for (int i = 3; i <= 22 && fields >> f; ++i) {
    if (i == 22) {
      std::uint64_t v = 0;
      std::from_chars(f.data(), f.data() + f.size(), v);
      return v;
    }
  }
  return std::nullopt;
}

inline const owner_id& this_process_base() {
  // Per process: recomputed in a forked child, whose pid and start time differ.
  thread_local owner_id id;
  thread_local long for_pid = -1;
  const long pid = current_pid();
  if (for_pid != pid) {
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    id.host = host;
    id.boot = read_first_line("/proc/sys/kernel/random/boot_id");
    id.pid = pid;
    id.start = process_start(pid).value_or(0);
    for_pid = pid;
  }
  return id;
}

inline owner_id this_process(std::chrono::milliseconds lease) {
  owner_id id = this_process_base();
  id.lease = lease;
  return id;
}

/// Returns: the owner lines of a record ("host ...\nboot ...\n...").
inline std::string format_owner(const owner_id& o) {
  return fmt::format("host {}\nboot {}\npid {}\nstart {}\nlease_ms {}\n", o.host, o.boot, o.pid, o.start,
                     o.lease.count());
}

/// Returns: the value of field `name` in "name value\n" lines, or nullopt.
inline std::optional<std::string_view> field(std::string_view text, std::string_view name) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto nl = text.find('\n', pos);
    const auto line = text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    if (line.size() > name.size() && line.substr(0, name.size()) == name && line[name.size()] == ' ')
      return line.substr(name.size() + 1);
    if (nl == std::string_view::npos) break;
    pos = nl + 1;
  }
  return std::nullopt;
}

template <class Int>
std::optional<Int> number_field(std::string_view text, std::string_view name) {
  const auto f = field(text, name);
  if (!f) return std::nullopt;
  Int v{};
  const auto [p, ec] = std::from_chars(f->data(), f->data() + f->size(), v);
  if (ec != std::errc{} || p != f->data() + f->size()) return std::nullopt;
  return v;
}

/// Returns: the owner described by `text`, or nullopt if a field is missing.
inline std::optional<owner_id> parse_owner(std::string_view text) {
  owner_id o;
  const auto host = field(text, "host");
  const auto boot = field(text, "boot");
  const auto pid = number_field<long>(text, "pid");
  const auto start = number_field<std::uint64_t>(text, "start");
  const auto lease = number_field<long long>(text, "lease_ms");
  if (!host || !boot || !pid || !start || !lease) return std::nullopt;
  o.host = std::string(*host);
  o.boot = std::string(*boot);
  o.pid = *pid;
  o.start = *start;
  o.lease = std::chrono::milliseconds{*lease};
  return o;
}

/// Returns: true only on proof that `o` is gone: it ran on this host in this
/// boot, and its pid no longer exists or now belongs to a process that started
/// at another time (the pid was reused). A holder on another host or from
/// another boot is never judged by pid.
inline bool provably_dead(const owner_id& o) {
  const owner_id& me = this_process_base();
  if (o.host != me.host || o.boot != me.boot || o.boot.empty()) return false;
  if (o.pid <= 0) return false;
  if (::kill(static_cast<pid_t>(o.pid), 0) != 0 && errno == ESRCH) return true;
  const auto start = process_start(o.pid);
  if (!start) return true;  // gone between the two checks
  return *start != o.start;
}

}  // namespace dibs::detail
