// dibs/lock_holder.hpp: who holds a lock, as its record says, for people
// and for error messages.
//
//   if (auto h = lock.holder()) fmt::print("busy: {}\n", *h);
//   // busy: pid 4711 on build-7 since 12:03:07, lease 60 s, 41 s left, token 17
//
// The times are the holder's wall clock (since) and an estimate from it
// (lease left): good for a person, never used to judge a holder (dibs never
// compares the wall clocks of two machines for that; see lease_mutex.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <ctime>
#include <optional>
#include <ostream>
#include <string>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/detail/format.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/store.hpp>

namespace dibs {

/// Returns: `t` as local time, as dibs shows a holder's: "12:03:07" today,
/// "2026-12-05 12:03:07" on another day, "unix time N" if the system gives no
/// local time for it.
inline std::string show_time(std::chrono::system_clock::time_point t) {
  const time_t secs = std::chrono::system_clock::to_time_t(t);
  const time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm at{}, today{};
  if (!detail::local_time(secs, at) || !detail::local_time(now, today))
    return fmt::format("unix time {}", static_cast<long long>(secs));
  const auto two = [](int v) { return detail::padded(v, 2); };
  const std::string clock = fmt::format("{}:{}:{}", two(at.tm_hour), two(at.tm_min), two(at.tm_sec));
  if (at.tm_year == today.tm_year && at.tm_yday == today.tm_yday) return clock;
  return fmt::format("{}-{}-{} {}", detail::padded(at.tm_year + 1900, 4), two(at.tm_mon + 1), two(at.tm_mday), clock);
}

/// A process of this host, as the system numbers it (pid_t; a DWORD on
/// Windows): what dot_lock_options::on_behalf_of and lease_options::on_behalf_of take.
using process_id = detail::process_id;

struct lock_holder {
  /// The holder's host name; empty where the lock names none (a presence
  /// lock file of another tool, dot_lock::holder_of).
  std::string host;
  /// Its process id; 0 if the lock names none.
  long pid = 0;
  /// When the hold began, on the holder's wall clock; nothing if the record
  /// does not say (one written by a dibs before issue 12).
  std::optional<std::chrono::system_clock::time_point> since;
  /// The holder's lease; zero for a lock without one (shared_log's).
  std::chrono::milliseconds lease{0};
  /// How much of the lease is left: exact for this object's own hold (its
  /// steady clock); for another's, estimated from the wall clock of the
  /// record's last renewal. Negative: it ran out that long ago (the holder
  /// stopped renewing, or the clocks differ). Nothing if unknown.
  std::optional<std::chrono::milliseconds> lease_left;
  /// The hold's fencing token (for a lease, the record's version when it was
  /// taken); 0 if the lock has none.
  dibs::version token = 0;
  /// True if it is this very object that holds the lock.
  bool mine = false;
  /// True if the holder is provably gone (lease_mutex.hpp's proof rule (a):
  /// same host and boot, its pid gone or reused): the next lock() breaks the
  /// lock at once.
  bool gone = false;

  friend bool operator==(const lock_holder&, const lock_holder&) = default;
};

namespace detail {

/// Returns: `ms` as "60 s" when it is whole seconds, else "250 ms".
inline std::string format_span(std::chrono::milliseconds ms) {
  const auto n = ms.count();
  if (n != 0 && n % 1000 == 0) return fmt::format("{} s", n / 1000);
  if (n >= 10'000 || n <= -10'000) return fmt::format("{} s", n / 1000);
  return fmt::format("{} ms", n);
}

inline std::chrono::system_clock::time_point from_wall_ms(std::int64_t ms) {
  return std::chrono::system_clock::time_point{
      std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::milliseconds{ms})};
}

}  // namespace detail

/// Returns: "pid 4711 on build-7 since 12:03:07, lease 60 s, 41 s left,
/// token 17", leaving out what is not known; " (this object)" if mine.
inline std::string to_string(const lock_holder& h) {
  std::string out = fmt::format("pid {} on {}", h.pid, h.host.empty() ? "an unnamed host" : h.host);
  if (h.since) out += " since " + show_time(*h.since);
  if (h.lease.count() > 0) out += ", lease " + detail::format_span(h.lease);
  if (h.lease_left) {
    if (h.lease_left->count() >= 0) out += ", " + detail::format_span(*h.lease_left) + " left";
    else out += ", ran out " + detail::format_span(-*h.lease_left) + " ago";
  }
  if (h.token != 0) out += fmt::format(", token {}", h.token);
  if (h.mine) out += " (this object)";
  return out;
}

inline std::ostream& operator<<(std::ostream& out, const lock_holder& h) { return out << to_string(h); }

}  // namespace dibs

template <>
struct fmt::formatter<dibs::lock_holder, char> : dibs::detail::name_formatter {
  template <class Context>
  auto format(const dibs::lock_holder& h, Context& ctx) const {
    return write(dibs::to_string(h), ctx);
  }
};
