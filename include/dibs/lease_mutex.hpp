// dibs/lease_mutex.hpp: a mutex held as a lease on a record of any
// dibs::shared_store, with fencing tokens; dibs::lock_file is the one on a file.
//
//   dibs::lock_file lock{"/var/log/batch.log.lock"};
//   std::scoped_lock hold{lock};
//   write_log_with(lock.token());
//
// The record names its holder (host, boot id, pid, process start time, lease
// length) in text a person can read. A waiter breaks a lock only on proof:
//   (a) the holder ran on this host in this boot and its pid is gone, or now
//       belongs to a process with another start time (the pid was reused); or
//   (b) the waiter has watched the same version of the record, unchanged, for
//       a whole lease on its own steady clock (a live holder renews the lease
//       about every third of it, which changes the version).
// Wall clocks of different machines are never compared. Breaking is a
// compare-and-set on the version judged, so two breakers cannot both win and
// a lock renewed meanwhile is never broken.
//
// Every acquisition's token() is the record's version at that moment: larger
// than every token handed out before for the key, because store versions only
// grow. Pass it along to whatever the lock protects, so a holder that was
// paused past its lease is refused there too.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/detail/owner.hpp>
#include <dibs/detail/renewal_keeper.hpp>
#include <dibs/error.hpp>
#include <dibs/file_store.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct lease_options {
  /// How long a holder that stops renewing keeps the lock.
  std::chrono::milliseconds lease{10'000};
  /// Renew about every third of the lease, from one renewal thread per
  /// process (no thread is started per lock).
  bool renew = true;
  /// Called once, from the renewal thread or unlock(), when the lease turns
  /// out to have been taken over: stop the work the lock protected.
  std::function<void()> on_lost{};
  /// Waiting between tries (woken early by the store's change notification,
  /// where it has one).
  exponential_backoff wait{std::chrono::microseconds{500}, 2.0, std::chrono::milliseconds{50}, jitter::full};
};

namespace detail {

template <class S>
concept store_with_change_wait = requires(const S& s, std::string_view key, std::chrono::nanoseconds t) {
  { s.wait_for_change(key, t) } -> std::same_as<bool>;
};

inline constexpr std::string_view lease_magic = "dibs-lease 1\n";

}  // namespace detail

/// Meets Lockable and TimedLockable. One holder at a time across every
/// process (and machine) that uses the same store and key; not recursive.
template <shared_store Store>
class lease_mutex {
public:
  /// Requires: `store` outlives this object. Throws: errc::invalid_argument
  /// for a bad key or a lease shorter than 3 ms.
  lease_mutex(Store& store, std::string key, lease_options opts = {})
      : store_(store), key_(std::move(key)), opts_(std::move(opts)) {
    validate_key(key_);
    if (opts_.lease < std::chrono::milliseconds{3})
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::lease_mutex '{}': lease must be at least 3 ms", key_));
  }
  lease_mutex(const lease_mutex&) = delete;
  lease_mutex& operator=(const lease_mutex&) = delete;
  /// Effects: releases the lock if held (errors are swallowed: a destructor must not throw).
  ~lease_mutex() {
    if (held_) {
      try {
        unlock();
      } catch (...) {
      }
    }
  }

  void lock() { (void)acquire(nullptr); }
  bool try_lock() { return try_once(true); }
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& d) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(d);
    return acquire(&until);
  }
  template <class Clock, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& t) {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(t - Clock::now());
    return acquire(&until);
  }

  /// Effects: stops renewing and removes the record if it is still ours (a
  /// compare-and-set: a lock taken over is left to its new holder, and
  /// on_lost is called).
  void unlock() {
    stop_renewal();
    bool newly_lost = false;
    {
      std::lock_guard g{m_};
      if (!held_) return;
      held_ = false;
      if (!lost_ && !store_.erase(key_, version_)) newly_lost = mark_lost();
    }
    notify_lost(newly_lost);
  }

  /// Returns: the fencing token of the current hold (0 if none).
  dibs::version token() const {
    std::lock_guard g{m_};
    return held_ ? token_ : 0;
  }
  /// Returns: true if the lease of the current (or last) hold was taken over.
  bool lost() const noexcept { return lost_.load(); }
  const std::string& key() const noexcept { return key_; }

  /// Effects: renews the lease now. Returns: false if it was lost.
  bool renew() {
    bool newly_lost = false;
    {
      std::lock_guard g{m_};
      if (!held_ || lost_) return false;
      if (auto v = store_.replace(key_, version_, value())) {
        version_ = *v;
        return true;
      }
      newly_lost = mark_lost();
    }
    notify_lost(newly_lost);
    return false;
  }

private:
  std::string value() const {
    return std::string(detail::lease_magic) + detail::format_owner(detail::this_process(opts_.lease));
  }

  // One try. `free_first`: try to create the record before reading it,
  // which saves a read when the lock is free (the first try); later tries
  // of a waiter read first, so that they do not queue for the record's
  // write lock in front of the holder's unlock.
  // Returns: true if this object now holds the lock.
  bool try_once(bool free_first) {
    std::lock_guard g{m_};
    if (held_) throw std::system_error(make_error_code(std::errc::resource_deadlock_would_occur),
                                       fmt::format("dibs::lease_mutex '{}': already held by this object", key_));
    if (free_first) {
      if (auto v = store_.create(key_, value())) return became_holder(*v);
    }
    const auto r = store_.read(key_);
    if (!r) {
      if (auto v = store_.create(key_, value())) return became_holder(*v);
      return false;
    }
    if (std::string_view(r->value).substr(0, detail::lease_magic.size()) != detail::lease_magic)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::lease_mutex '{}': the record is not a dibs lease (it starts '{}'); "
                                          "was it left by another tool or an older format?",
                                          key_, r->value.substr(0, r->value.find('\n'))));
    const auto owner = detail::parse_owner(r->value);
    if (!owner)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::lease_mutex '{}': the lease record lacks an owner field", key_));
    bool stale = detail::provably_dead(*owner);
    const auto now = std::chrono::steady_clock::now();
    if (!stale) {
      if (!seen_version_ || *seen_version_ != r->version) {
        seen_version_ = r->version;  // start watching this version on our own clock
        seen_since_ = now;
      } else if (now - seen_since_ >= owner->lease) {
        stale = true;  // unchanged for a whole lease: its holder stopped renewing
      }
    }
    if (!stale) return false;
    if (auto v = store_.replace(key_, r->version, value())) return became_holder(*v);
    return false;
  }

  bool acquire(const std::chrono::steady_clock::time_point* until) {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    for (std::uint64_t n = 0;; ++n) {
      if (try_once(n == 0)) return true;
      auto delay = opts_.wait.delay(n, {}, std::uniform_real_distribution<double>{0.0, 1.0}(rng));
      if (until) {
        const auto left = *until - std::chrono::steady_clock::now();
        if (left <= std::chrono::steady_clock::duration::zero()) return false;
        delay = std::min<std::chrono::nanoseconds>(delay, left);
      }
      if constexpr (detail::store_with_change_wait<Store>) (void)store_.wait_for_change(key_, delay);
      else std::this_thread::sleep_for(delay);
    }
  }

  // Requires: m_ held.
  bool became_holder(dibs::version v) {
    held_ = true;
    lost_ = false;
    version_ = v;
    token_ = v;
    seen_version_.reset();
    if (opts_.renew) {
      last_renewed_ = std::chrono::steady_clock::now();
      renewal_id_ = detail::renewal_keeper::instance().add(opts_.lease / 3, [this] { return renew_tick(); });
    }
    return true;
  }

  // Called by the process's renewal thread. Returns: false to stop renewing.
  bool renew_tick() {
    try {
      if (!renew()) return false;
      last_renewed_ = std::chrono::steady_clock::now();
      return true;
    } catch (...) {
      // The store failed for a moment: try again next time, unless the
      // lease has run out meanwhile, in which case it cannot be trusted.
      if (std::chrono::steady_clock::now() - last_renewed_ < opts_.lease) return true;
      bool newly_lost;
      {
        std::lock_guard g{m_};
        newly_lost = mark_lost();
      }
      notify_lost(newly_lost);
      return false;
    }
  }

  void stop_renewal() {
    if (renewal_id_) detail::renewal_keeper::instance().remove(std::exchange(renewal_id_, 0));
  }

  // Requires: m_ held. Returns: true the first time.
  bool mark_lost() { return !lost_.exchange(true); }
  // Called without m_, so on_lost may call unlock().
  void notify_lost(bool newly_lost) {
    if (newly_lost && opts_.on_lost) opts_.on_lost();
  }

  Store& store_;
  std::string key_;
  lease_options opts_;
  mutable std::mutex m_;
  bool held_ = false;
  std::atomic<bool> lost_{false};
  dibs::version version_ = 0;  // the record's current version (renewals move it)
  dibs::version token_ = 0;    // the version at acquisition
  std::optional<dibs::version> seen_version_;
  std::chrono::steady_clock::time_point seen_since_{};
  std::uint64_t renewal_id_ = 0;
  std::chrono::steady_clock::time_point last_renewed_{};
};

namespace detail {
struct lock_file_store {
  file_store store;
};
inline std::filesystem::path lock_dir(const std::filesystem::path& p) {
  return p.has_parent_path() ? p.parent_path() : std::filesystem::path{"."};
}
}  // namespace detail

/// A lock file: lease_mutex over the file at `path` itself (a dibs record
/// you can `cat`). Throws: as file_store for a missing or unwritable
/// directory; errc::invalid_argument for a bad file name.
class lock_file : private detail::lock_file_store, public lease_mutex<file_store> {
public:
  explicit lock_file(const std::filesystem::path& path, lease_options opts = {})
      : detail::lock_file_store{file_store{detail::lock_dir(path), {.suffix = "", .in_place = true}}},
        lease_mutex<file_store>(store, path.filename().string(), std::move(opts)),
        path_(path) {}
  const std::filesystem::path& path() const noexcept { return path_; }

private:
  std::filesystem::path path_;
};

}  // namespace dibs
