// dibs/detail/validity.hpp: the holder's side of a lease, kept once for
// lease_mutex and marker_claim's claims (the validity rule): a hold is valid
// until the start of its last confirmed renewal (or of the call that made
// it) plus the lease, on this process's steady clock, or until it is found
// taken over, whatever the store or any other lease is doing.
#pragma once

#include <atomic>
#include <chrono>
#include <system_error>

#include <dibs/error.hpp>

namespace dibs::detail {

class validity {
public:
  using clock = std::chrono::steady_clock;

  /// Effects: a new hold, valid until `start + lease`.
  void begin(clock::time_point start, clock::duration lease) noexcept {
    lost_.store(false);
    set_end(start + lease);
  }
  /// Effects: takes the state of `o` (a hold moved to another object).
  /// Requires: nothing changes `o` meanwhile (no renewal of it is running).
  void assign(const validity& o) noexcept {
    lost_.store(o.lost_.load());
    end_.store(o.end_.load(std::memory_order_acquire), std::memory_order_release);
  }
  /// Effects: no hold any more: it runs out never (a lost() already seen stays).
  void finish() noexcept { set_end(clock::time_point::max()); }

  /// Returns: true if the hold was found taken over, or has run out. Lock-free.
  bool lost() const noexcept { return lost_.load() || expired(); }
  /// Returns: true if the lease's end has passed.
  bool expired() const noexcept { return clock::now() >= end(); }
  /// Returns: true if it was marked lost (taken over, or seen run out).
  bool marked_lost() const noexcept { return lost_.load(); }
  /// Effects: marks the hold lost. Returns: true the first time (the caller
  /// then tells its holder, once).
  bool mark_lost() noexcept { return !lost_.exchange(true); }

  clock::time_point end() const noexcept { return clock::time_point{clock::duration{end_.load(std::memory_order_acquire)}}; }

  /// Effects: renews by `replace(end)`, a compare-and-set in the store that
  /// waits in it at most until `end`, the lease's end: waiting longer is
  /// pointless, the hold is over then. On success the hold is valid until
  /// the start of this call plus `lease`.
  /// Returns: true if renewed; false if the lease had run out, the store's
  /// wait ended at the lease's end (errc::timed_out), or the record moved.
  template <class Replace>
  bool renew(clock::duration lease, Replace&& replace) {
    const auto start = clock::now();
    const auto until = end();
    if (start >= until) return false;
    try {
      if (!replace(until)) return false;
    } catch (const std::system_error& e) {
      if (e.code() != make_error_code(errc::timed_out)) throw;
      return false;
    }
    set_end(start + lease);
    return true;
  }

private:
  void set_end(clock::time_point t) noexcept { end_.store(t.time_since_epoch().count(), std::memory_order_release); }

  std::atomic<bool> lost_{false};
  std::atomic<clock::rep> end_{clock::time_point::max().time_since_epoch().count()};
};

}  // namespace dibs::detail
