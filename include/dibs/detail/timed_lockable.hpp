// dibs/detail/timed_lockable.hpp: the waiting half of Lockable and
// TimedLockable, written once for every lock whose waits all come down to
// one `acquire(until, stop_token)`.
#pragma once

#include <chrono>
#include <stop_token>

namespace dibs::detail {

/// Requires: Derived has `bool acquire(std::chrono::steady_clock::time_point
/// until, const std::stop_token& st)` (accessible to this base), which waits
/// until it holds the lock (true) or `until` passes (false), and throws
/// errc::cancelled when a stop is requested through `st`.
template <class Derived>
class timed_lockable {
  using clock = std::chrono::steady_clock;

public:
  /// Effects: blocks until this object holds the lock.
  void lock() { (void)self().acquire(clock::time_point::max(), {}); }
  /// Effects: blocks until this object holds the lock, or a stop is
  /// requested through `st`. Throws: std::system_error(errc::cancelled) if
  /// stopped; nothing is held then.
  void lock(std::stop_token st) { (void)self().acquire(clock::time_point::max(), st); }
  /// Returns: true if this object holds the lock within `d`.
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& d) {
    return self().acquire(clock::now() + std::chrono::duration_cast<clock::duration>(d), {});
  }
  /// Returns: as try_lock_for(d). Throws: errc::cancelled if a stop is
  /// requested through `st` first.
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& d, std::stop_token st) {
    return self().acquire(clock::now() + std::chrono::duration_cast<clock::duration>(d), st);
  }
  template <class Clock, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& t) {
    return self().acquire(clock::now() + std::chrono::duration_cast<clock::duration>(t - Clock::now()), {});
  }

private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

}  // namespace dibs::detail
