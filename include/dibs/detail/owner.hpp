// dibs/detail/owner.hpp: who holds a lease, written so a person can read it,
// and the one proof rule every policy (and shared_log's slots, and
// file_store's temporaries) uses to decide that a holder is gone.
//
// The rule: a holder is provably gone only if
//   - it ran on this machine in this boot (boot id, host name), and
//   - it ran in the observer's own PID namespace (the inode of
//     /proc/self/ns/pid; a pid means nothing across namespaces: two
//     containers of one pod both have a pid 1), and
//   - either its pid no longer exists here (kill(pid, 0) says ESRCH), or a
//     process with that pid exists but started at another time (the pid was
//     reused), where start times are compared only when both sides stand in
//     the same time namespace (a time namespace shifts the start times that
//     /proc shows) and the observer's /proc is its own PID namespace's.
// Whatever cannot be read or compared counts as alive: a /proc mounted with
// hidepid=2, a /proc of another namespace, a record without namespace fields
// (from an older dibs). Then only the lease can free the hold, which is always
// safe: an alive verdict costs time, a wrong dead verdict costs a second
// holder. (A zombie, exited but not reaped, has ended: it counts as gone.)
//
// That is the rule on Linux (detail/posix/process.hpp). On Windows
// (detail/win32/process.hpp) the host is the computer name, the boot is the
// machine's boot time, there are no namespaces (a process id is unique on
// the machine across sessions), and the start time is the process's
// creation time (GetProcessTimes); a process that cannot be opened for lack
// of rights is alive. Each platform's process_gone() holds its half of the
// rule; this header holds the record and the host-and-boot half.
#pragma once


#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include <dibs/detail/process.hpp>
#include <dibs/detail/sys.hpp>

namespace dibs::detail {

/// The identity of a process, as far as another process can check it.
struct owner_id {
  std::string host;
  std::string boot;  // /proc/sys/kernel/random/boot_id
  long pid = 0;
  std::uint64_t start = 0;
  std::uint32_t pid_ns = 0;
  std::uint32_t time_ns = 0;
  std::chrono::milliseconds lease{0};
  // Wall clock (unix ms) of the holder, for people and diagnostics only:
  // never compared across machines, never used to judge a holder. 0: not
  // recorded (a record of an older dibs, or a claim).
  std::int64_t since_ms = 0;    // when the hold began
  std::int64_t written_ms = 0;  // when this record was written (its last renewal)

  process_identity process() const noexcept { return {pid, start, pid_ns, time_ns}; }
  friend bool operator==(const owner_id&, const owner_id&) = default;
};

struct this_process_info {
  owner_id id;
  bool proc_own = false;  // other processes' start times can be read here (own_pids_readable)
};

inline const this_process_info& this_process_info_cached() {
  // Per process: recomputed in a forked child, whose pid and start time differ.
  thread_local this_process_info info;
  thread_local long for_pid = -1;
  const long pid = static_cast<long>(current_pid());
  if (for_pid != pid) {
    const process_identity me = own_process();
    info.id.host = host_name();
    info.id.boot = boot_id();
    info.id.pid = me.pid;
    info.id.start = me.start;
    info.id.pid_ns = me.pid_ns;
    info.id.time_ns = me.time_ns;
    info.proc_own = own_pids_readable(pid);
    for_pid = pid;
  }
  return info;
}

inline const owner_id& this_process_base() { return this_process_info_cached().id; }

inline owner_id this_process(std::chrono::milliseconds lease) {
  owner_id id = this_process_base();
  id.lease = lease;
  return id;
}

/// Returns: true only on proof that process `p` (which ran on this machine
/// in this boot: the caller has checked that) is gone: this platform's
/// half of the rule (process_gone in detail/<platform>/process.hpp).
inline bool provably_gone(const process_identity& p) {
  const this_process_info& me = this_process_info_cached();
  return process_gone(p, me.id.process(), me.proc_own);
}

/// Returns: the owner lines a hold taken on behalf of process `pid` (one
/// this process started) records: this process's host and boot, `pid`, and
/// its start time where this process can read it (else 0: unknown, so only
/// "no such process" will prove it gone).
/// Throws: std::errc::no_such_process, with `what` and the pid in its
/// message, if there is no such process.
inline owner_id other_process(std::chrono::milliseconds lease, long pid, std::string_view what) {
  owner_id o = this_process(lease);
  o.pid = pid;
  o.start = 0;
  if (pid <= 0 || pid_absent(pid))
    throw std::system_error(std::make_error_code(std::errc::no_such_process),
                            fmt::format("{}: on_behalf_of names pid {}, which does not exist (start the process "
                                        "first, and do not reap it before the lock is released)",
                                        what, pid));
  if (this_process_info_cached().proc_own) o.start = process_start(pid).value_or(0);
  return o;
}

/// Returns: true only on proof that `o` is gone: it ran on this host in this
/// boot and provably_gone(o.process()).
inline bool provably_dead(const owner_id& o) {
  const owner_id& me = this_process_base();
  if (o.host != me.host || o.boot.empty() || o.boot != me.boot) return false;
  return provably_gone(o.process());
}

/// Returns: a line "nonce <16 hex digits>\n", random for every write, so that
/// a value a policy writes is its own and no other's: when a write's outcome
/// is unknown, the value read back is this write's only if it is equal to it
/// (the owner lines alone name a process, and two objects or threads of one
/// process could write them alike in the same millisecond).
inline std::string write_nonce();

/// Effects: appends the decimal digits of `v` to `out` (what fmt's "{}"
/// writes, without parsing a format string: records are made on every
/// claim, and their formatting showed in its profile).
template <class Int>
void append_number(std::string& out, Int v) {
  char digits[24];
  const auto end = std::to_chars(digits, digits + sizeof digits, v).ptr;
  // The length bounded by the buffer's, which to_chars keeps anyway: GCC 12
  // at -O3 cannot see it and warns of a copy of 2^63 bytes (-Wrestrict,
  // -Wstringop-overflow) in programs that build with -Werror.
  out.append(digits, std::min(static_cast<std::size_t>(end - digits), sizeof digits));
}

/// Effects: appends the line write_nonce() returns to `out`.
inline void append_nonce(std::string& out) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::uint64_t n = rng();
  char line[] = "nonce 0000000000000000\n";
  for (int i = 21; i >= 6; --i, n >>= 4) line[i] = "0123456789abcdef"[n & 0xf];
  out.append(line, sizeof line - 1);
}

inline std::string write_nonce() {
  std::string out;
  append_nonce(out);
  return out;
}

/// How much longer than its lease a record must be unwritten, by a store's
/// own clock, before it is judged run out: the store's clock and the
/// holder's steady clock may run at different rates while NTP slews them
/// (chrony slews by up to 8.3 %; the two may err in opposite directions).
template <class Rep, class Period>
constexpr std::chrono::duration<Rep, Period> clock_margin(std::chrono::duration<Rep, Period> lease) {
  return lease / 4;
}

/// Returns: now on the wall clock, in unix milliseconds.
inline std::int64_t wall_ms() noexcept {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

/// Returns: the owner lines of a record ("host ...\nboot ...\n..."); since_ms
/// and written_ms only when recorded (nonzero).
inline std::string format_owner(const owner_id& o) {
  std::string out = fmt::format("host {}\nboot {}\npid {}\nstart {}\npid_ns {}\ntime_ns {}\nlease_ms {}\n", o.host,
                                o.boot, o.pid, o.start, o.pid_ns, o.time_ns, o.lease.count());
  if (o.since_ms != 0) out += fmt::format("since_ms {}\n", o.since_ms);
  if (o.written_ms != 0) out += fmt::format("written_ms {}\n", o.written_ms);
  return out;
}

/// Returns: format_owner(this_process(lease)), formatted once per process
/// (a forked child formats its own) and lease, per thread: a claim writes
/// the same owner lines every time.
inline const std::string& this_process_lines(std::chrono::milliseconds lease) {
  thread_local std::string text;
  thread_local long for_pid = -1;
  thread_local std::chrono::milliseconds for_lease{-1};
  const long pid = static_cast<long>(current_pid());
  if (pid != for_pid || lease != for_lease) {
    text = format_owner(this_process(lease));
    for_pid = pid;
    for_lease = lease;
  }
  return text;
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
/// A record without pid_ns and time_ns (an older dibs) parses with both 0:
/// its holder is then never judged by pid. One without since_ms and
/// written_ms (before issue 12) parses with both 0: not recorded.
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
  o.pid_ns = number_field<std::uint32_t>(text, "pid_ns").value_or(0);
  o.time_ns = number_field<std::uint32_t>(text, "time_ns").value_or(0);
  o.lease = std::chrono::milliseconds{*lease};
  o.since_ms = number_field<std::int64_t>(text, "since_ms").value_or(0);
  o.written_ms = number_field<std::int64_t>(text, "written_ms").value_or(0);
  return o;
}

}  // namespace dibs::detail
