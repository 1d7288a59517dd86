// dibs/lease_semaphore.hpp: at most N holders at a time across every
// process (and machine) that uses the same store and name: N permits, each
// a lease_mutex of its own, with its own fencing token.
//
//   dibs::file_store store{"/var/lib/app/locks"};
//   dibs::lease_semaphore<dibs::file_store> exports{store, "exports", 3};
//   auto p = exports.acquire();            // waits for one of the 3 permits
//   run_export(p.index(), p.token());      // released when p goes out of scope
//
// Each permit is exactly a lease_mutex (<dibs/lease_mutex.hpp>) on a record
// of its own: the record names its holder, the holder renews it about every
// third of the lease and is told when it lost it (the validity rule), and a
// waiter takes a permit over only on proof that its holder is gone (same
// host and boot, its pid gone or reused; or the record unchanged for a whole
// lease on the waiter's steady clock, or by the store's clock where it has
// one). A permit's token() is its record's version when it was taken:
// larger than every token handed out before for that permit (not across
// permits: each has its own sequence). Write it along with whatever the
// permit guards, per permit, so that a holder paused past its lease is
// refused there.
//
// Keys (what a store holds for the semaphore NAME):
//   dibs-semaphore:NAME              the semaphore's own record: how many
//                                    permits it has, and the most it ever had
//   dibs-semaphore-permit-I:NAME     permit I (0 <= I), a lease_mutex record
// The two prefixes differ at their 15th byte (':' against '-'), and I is
// decimal digits ended by the first ':', so no NAME's keys can be another
// NAME's, and no key of the semaphore is a key a program uses unless it
// starts with "dibs-semaphore". NAME is any bytes (as a key is, store.hpp),
// at most max_name_size. On a file_store each key is a file beside the
// others (`cat dibs-semaphore-permit-0:exports.rec` names its holder).
//
// How many permits: the semaphore's record says, and every object that
// opens it must say the same N (another N is errc::invalid_argument, and
// nothing is changed). lease_semaphore::resize(store, name, n) changes it
// for everyone: growing adds permits at once (waiters take them); shrinking
// stops handing out permits n and up, while their holders keep them until
// they release them (or lose them): holders() lists those as above_limit.
// Exactly: a permit that acquire() returns after resize() returned has an
// index below the new N; each acquisition reads the record after taking a
// permit and gives back one that is above it.
//
// Waiting, and in what order:
//   - file_store (Linux): the processes of this host that wait for the
//     semaphore take turns in one first-come, first-served queue (the file
//     `.dibs-queue.dibs-semaphore:NAME` beside the records, as lease_mutex's
//     per key): the first in line tries every permit, and each release wakes
//     it; one that gets a permit wakes the next, which tries in turn, so a
//     release of several permits at once serves several waiters, in order.
//     A waiter killed in line is passed over at once, one stopped in line
//     after detail::queue_patience (lease_mutex.hpp says how). The queue
//     orders the waiters of one host only; a permit is decided by its
//     record's compare-and-set, so processes of other hosts (and
//     try_acquire, which does not queue) compete with the head of the queue
//     unordered.
//   - postgres_store: unordered; a waiter sleeps on the store's change
//     notification for one permit (a different one each time) and backoff,
//     so the release of the permit it watches wakes it at once and that of
//     another within the backoff (lease_options::wait, 50 ms at most).
//   - sqlite_store, shm_store, memory_store, and file_store on Windows:
//     unordered, with backoff only. No order across permits is kept there:
//     a waiter that came later can get the next free permit first.
//
// Threads: one lease_semaphore object may be used by several threads at
// once (their tries take turns on the object; each waits in the queue on
// its own). A permit is one holder's: like a lease_mutex, it must not be
// used by two threads at once. A permit may outlive the lease_semaphore it
// came from (not its store).
//
// fork(): a child's copy of a held permit is the parent's hold, as with a
// lease_mutex: the child never renews or releases it.
#pragma once

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/detail/owner.hpp>
#include <dibs/detail/wait_in_turn.hpp>
#include <dibs/error.hpp>
#include <dibs/lease_mutex.hpp>
#include <dibs/lock_holder.hpp>
#include <dibs/store.hpp>

namespace dibs {

/// Who holds one permit of a lease_semaphore (lease_semaphore::holders()).
struct permit_holder {
  /// The permit's index (0 to N - 1, or above if N was made smaller since).
  std::uint32_t permit = 0;
  /// True if the permit is at or above the semaphore's current N (it was
  /// resized smaller): its holder keeps it until it releases it, and no one
  /// gets it after that until N grows again.
  bool above_limit = false;
  /// As lease_mutex::holder() says it (host, pid, since, lease, token, gone).
  lock_holder holder;
  friend bool operator==(const permit_holder&, const permit_holder&) = default;
};

namespace detail {

inline constexpr std::string_view semaphore_magic = "dibs-semaphore 1\n";
inline constexpr std::string_view semaphore_prefix = "dibs-semaphore:";
inline constexpr std::string_view permit_prefix = "dibs-semaphore-permit-";

inline std::string semaphore_key(std::string_view name) {
  std::string k(semaphore_prefix);
  k += name;
  return k;
}
inline std::string permit_key(std::string_view name, std::uint32_t i) {
  return fmt::format("{}{}:", permit_prefix, i).append(name);
}

// The semaphore's record: N now, and the highest N it ever had (the
// permits a holder may still hold, for holders()).
struct semaphore_config {
  std::uint32_t permits = 0;
  std::uint32_t highest = 0;
};
inline std::string format_semaphore(const semaphore_config& c) {
  return fmt::format("{}permits {}\nhighest {}\n", semaphore_magic, c.permits, c.highest);
}
// Returns: the record's N and highest N, or nothing if it is not a
// semaphore's record of this format.
inline std::optional<semaphore_config> parse_semaphore(std::string_view text) {
  if (text.substr(0, semaphore_magic.size()) != semaphore_magic) return std::nullopt;
  const auto n = number_field<std::uint32_t>(text, "permits");
  const auto h = number_field<std::uint32_t>(text, "highest");
  if (!n || !h || *n == 0 || *h < *n) return std::nullopt;
  return semaphore_config{*n, *h};
}

}  // namespace detail

template <shared_store Store>
class lease_semaphore {
public:
  /// The longest name: a key has at most key_rules::max_key_size bytes,
  /// and a permit's key adds its prefix, index and ':' to the name.
  static constexpr std::size_t max_name_size =
      key_rules::max_key_size - std::string_view("dibs-semaphore-permit-9999:").size();  // 997
  /// The most permits a semaphore may have: each is a record, and a waiter
  /// reads each permit's record before it sleeps.
  static constexpr std::uint32_t max_permits = 10'000;

  /// One permit held: a movable RAII handle (as std::unique_lock is for a
  /// mutex). Empty when default-made, moved from, released, or returned by
  /// a try that got nothing.
  class permit {
  public:
    permit() = default;
    permit(permit&& o) noexcept
        : lock_(std::move(o.lock_)), waker_(std::move(o.waker_)), index_(o.index_), held_(std::exchange(o.held_, false)) {}
    /// Effects: release() of the permit this object holds, then takes `o`'s.
    /// Throws: as release() (then `o` is untouched).
    permit& operator=(permit&& o) {
      if (this != &o) {
        release();
        lock_ = std::move(o.lock_);
        waker_ = std::move(o.waker_);
        index_ = o.index_;
        held_ = std::exchange(o.held_, false);
      }
      return *this;
    }
    /// Effects: release(); errors are swallowed (a destructor must not throw).
    ~permit() {
      try {
        release();
      } catch (...) {
      }
    }

    /// Returns: true if this object holds a permit (lost or not: see lost()).
    explicit operator bool() const noexcept { return held_; }
    bool held() const noexcept { return held_; }
    /// Returns: the permit's index, 0 to N - 1 (of the N when it was taken).
    /// Requires: this object holds or held a permit.
    std::uint32_t index() const noexcept { return index_; }
    /// Returns: the fencing token of this hold (0 if none): larger than
    /// every token handed out before for this permit.
    dibs::version token() const noexcept { return held_ && lock_ ? lock_->token() : 0; }
    /// Returns: true if the hold (current, or the last one) was lost: taken
    /// over, or its lease ran out before a renewal was confirmed.
    bool lost() const noexcept { return lock_ && lock_->lost(); }
    /// Returns: the permit's key in the store (empty if none was held).
    std::string_view key() const noexcept { return lock_ ? std::string_view(lock_->key()) : std::string_view{}; }
    /// Effects, Returns: as lease_mutex::renew() for this permit's record.
    bool renew() { return held_ && lock_->renew(); }
    /// Effects, Returns, Throws: as lease_mutex::holder() for this permit's
    /// record (`mine` if it is this object's hold).
    std::optional<lock_holder> holder() const {
      if (!lock_) return std::nullopt;
      return lock_->holder();
    }
    /// Effects: if this object holds a permit, gives it back as
    /// lease_mutex::unlock() does (its record is erased if still ours; a
    /// permit taken over is left to its new holder), then wakes the first
    /// waiter of this host queued for the semaphore. The object is then
    /// empty; lost() still tells about the hold that ended. In a forked
    /// child it only forgets the parent's hold. Throws: as lease_mutex::unlock().
    void release() {
      if (!std::exchange(held_, false)) return;
      lock_->unlock();
      if constexpr (detail::store_with_waiter_queue<Store>) {
        if (waker_ && *waker_) waker_->wake_first();
      }
    }

  private:
    friend class lease_semaphore;
    using queue_type = typename detail::waiter_queue_of<Store>::type;
    permit(std::unique_ptr<lease_mutex<Store>> lock, std::shared_ptr<queue_type> waker, std::uint32_t index)
        : lock_(std::move(lock)), waker_(std::move(waker)), index_(index), held_(true) {}

    std::unique_ptr<lease_mutex<Store>> lock_;  // on the heap: its renewal points to it, whatever moves the permit
    std::shared_ptr<queue_type> waker_;         // the semaphore's waiter queue (for wake_first only), if the store has one
    std::uint32_t index_ = 0;
    bool held_ = false;
  };

  /// Requires: `store` outlives this object and every permit it hands out.
  /// Effects: opens the semaphore `name` of `store`, making its record with
  /// `permits` permits if it has none.
  /// Throws: errc::invalid_argument, writing nothing, for an empty name or
  /// one longer than max_name_size, for permits of 0 or above max_permits,
  /// a lease shorter than 3 ms, and if the semaphore exists with another
  /// number of permits (the message says how many, and how to change it);
  /// errc::corrupt_record if the semaphore's key holds something that is
  /// not a semaphore's record; as the store's read and create.
  lease_semaphore(Store& store, std::string name, std::uint32_t permits, lease_options opts = {})
      : store_(&store), name_(std::move(name)), opts_(std::move(opts)) {
    check_name(name_, "dibs::lease_semaphore");
    check_permits(name_, permits, "dibs::lease_semaphore");
    if (opts_.lease < std::chrono::milliseconds{3})
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::lease_semaphore '{}': lease must be at least 3 ms",
                                          detail::show_key(name_)));
    config_key_ = detail::semaphore_key(name_);
    for (;;) {
      if (const auto r = detail::store_read(*store_, config_key_, dibs::time_limit::max())) {
        const auto c = parse(*r, name_);
        if (c.permits != permits)
          throw std::system_error(
              make_error_code(errc::invalid_argument),
              fmt::format("dibs::lease_semaphore '{}': opened with {} permits, but the semaphore has {} (its record "
                          "'{}' says so); open it with {}, or change it for every user with "
                          "lease_semaphore::resize(store, name, {})",
                          detail::show_key(name_), permits, c.permits, detail::show_key(config_key_), c.permits,
                          permits));
        n_ = c.permits;
        break;
      }
      if (detail::store_create(*store_, config_key_, detail::format_semaphore({permits, permits}),
                               dibs::time_limit::max())) {
        n_ = permits;
        break;
      }
      // Made by another process meanwhile: read what it made.
    }
    for (std::uint32_t i = 0; i < n_; ++i)
      slots_.push_back(std::make_unique<lease_mutex<Store>>(*store_, detail::permit_key(name_, i), opts_));
    if constexpr (detail::store_with_waiter_queue<Store>) {
      // Made now, so that waiters and releases find it.
      waker_ = std::make_shared<queue_type>(store_->open_waiter_queue(config_key_, true));
    }
  }
  lease_semaphore(const lease_semaphore&) = delete;
  lease_semaphore& operator=(const lease_semaphore&) = delete;

  /// Effects: blocks until this object holds one of the permits.
  /// Returns: the permit. Throws: as the store's operations.
  permit acquire() { return *acquire_until(dibs::time_limit::max(), {}); }
  /// Effects: as acquire(), or until a stop is requested through `st`.
  /// Throws: errc::cancelled if stopped first (nothing is held then).
  permit acquire(std::stop_token st) { return *acquire_until(dibs::time_limit::max(), st); }
  /// Effects: one look at each permit, waiting for nothing but a record
  /// another process is writing at that moment (detail::try_wait each).
  /// Returns: a permit, or an empty one if every permit is held (also by a
  /// stopped process). Does not queue.
  permit try_acquire() {
    permit p;
    const auto limit = clock::now() + detail::try_wait;
    (void)try_round(true, limit, p);
    return p;
  }
  /// Returns: a permit if one could be had within `d` (waiting as
  /// acquire()), else an empty one.
  template <class Rep, class Period>
  permit try_acquire_for(const std::chrono::duration<Rep, Period>& d) {
    auto p = acquire_until(clock::now() + std::chrono::duration_cast<clock::duration>(d), {});
    return p ? std::move(*p) : permit{};
  }
  /// Returns: as try_acquire_for(d). Throws: errc::cancelled if a stop is
  /// requested through `st` first.
  template <class Rep, class Period>
  permit try_acquire_for(const std::chrono::duration<Rep, Period>& d, std::stop_token st) {
    auto p = acquire_until(clock::now() + std::chrono::duration_cast<clock::duration>(d), st);
    return p ? std::move(*p) : permit{};
  }

  /// Effects: reads the semaphore's record and each permit's; takes
  /// nothing, changes nothing.
  /// Returns: the permits held now, by index, with their holders as
  /// lease_mutex::holder() describes them (`mine` is never set here: a
  /// permit's own holder() says it); permits held above the current N
  /// (after a resize() that shrank it) too, marked above_limit.
  /// Throws: errc::corrupt_record for a record that is not the
  /// semaphore's; as the store's read.
  std::vector<permit_holder> holders() const {
    return holders_of(*store_, name_, read_config(dibs::time_limit::max()));
  }

  /// A semaphore as a status tool shows it (dibs status).
  struct state {
    std::uint32_t permits = 0;           ///< N, as its record says now
    std::vector<permit_holder> holders;  ///< as holders() says
  };
  /// Effects: reads the semaphore `name` of `store` without opening it:
  /// nothing is written (no record made, no waiter queue).
  /// Returns: its state, or nullopt if `store` has no semaphore `name`.
  /// Throws: errc::invalid_argument for a bad name (as the constructor);
  /// errc::corrupt_record if the semaphore's key holds something that is
  /// not a semaphore's record; as the store's read.
  static std::optional<state> inspect(Store& store, std::string_view name) {
    check_name(name, "dibs::lease_semaphore::inspect");
    const auto r = detail::store_read(store, detail::semaphore_key(name), dibs::time_limit::max());
    if (!r) return std::nullopt;
    const auto c = parse(*r, name);
    return state{c.permits, holders_of(store, name, c)};
  }

  /// Returns: the names of the semaphores `store` holds, sorted (what a
  /// status tool lists; open or inspect() each by name). Reads only.
  static std::vector<std::string> names(Store& store)
    requires listable_store<Store>
  {
    std::vector<std::string> out;
    for (auto& k : store.keys(detail::semaphore_prefix)) out.push_back(k.substr(detail::semaphore_prefix.size()));
    std::sort(out.begin(), out.end());
    return out;
  }

  /// Returns: the number of permits, as this object last read it.
  std::uint32_t permits() const {
    std::lock_guard g{m_};
    return n_;
  }
  const std::string& name() const noexcept { return name_; }

  /// Effects: sets the number of permits of the existing semaphore `name`
  /// of `store` to `permits`, for every user (a compare-and-set of its
  /// record). Growing: the new permits can be taken at once, and waiters
  /// queued on this host are woken to take them. Shrinking: permits
  /// `permits` and up are no longer handed out; whoever holds one keeps it
  /// until they release it (or lose it), and holders() marks it
  /// above_limit. Objects opened before keep working with the new N (each
  /// acquisition reads it); new ones must be opened with it.
  /// Returns: the number of permits before.
  /// Throws: errc::invalid_argument, writing nothing, for a bad name or
  /// number (as the constructor), or if the store has no semaphore `name`
  /// (open one with lease_semaphore(store, name, permits) first);
  /// errc::corrupt_record as the constructor; as the store's operations.
  static std::uint32_t resize(Store& store, std::string_view name, std::uint32_t permits) {
    check_name(name, "dibs::lease_semaphore::resize");
    check_permits(name, permits, "dibs::lease_semaphore::resize");
    const auto key = detail::semaphore_key(name);
    for (;;) {
      const auto r = detail::store_read(store, key, dibs::time_limit::max());
      if (!r)
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("dibs::lease_semaphore::resize: there is no semaphore '{}' in this store "
                                            "(no record '{}'); open it with lease_semaphore(store, name, {}) to "
                                            "make it",
                                            detail::show_key(name), detail::show_key(key), permits));
      const auto c = parse(*r, name);
      if (c.permits == permits) return permits;
      const detail::semaphore_config next{permits, std::max(c.highest, permits)};
      if (detail::store_replace(store, key, r->version, detail::format_semaphore(next), dibs::time_limit::max())) {
        if constexpr (detail::store_with_waiter_queue<Store>) {
          // The first waiter in line tries the new permits, and wakes the next.
          if (permits > c.permits) {
            if (auto q = store.open_waiter_queue(key, false)) q.wake_first();
          }
        }
        return c.permits;
      }
      // Changed by someone else meanwhile: judge it again.
    }
  }

private:
  using clock = std::chrono::steady_clock;
  using queue_type = typename detail::waiter_queue_of<Store>::type;

  static void check_name(std::string_view name, std::string_view call) {
    if (name.empty())
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("{}: invalid name '': a semaphore's name must not be empty", call));
    if (name.size() > max_name_size)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("{}: invalid name '{}': a semaphore's name must be at most {} bytes (it has "
                                          "{}); name it by a digest of the long name instead",
                                          call, detail::show_key(name), max_name_size, name.size()));
  }
  static void check_permits(std::string_view name, std::uint32_t permits, std::string_view call) {
    if (permits == 0 || permits > max_permits)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("{} '{}': {} permits: a semaphore has 1 to {} permits", call,
                                          detail::show_key(name), permits, max_permits));
  }
  // Throws: errc::corrupt_record if `r` is not a semaphore's record.
  static detail::semaphore_config parse(const record& r, std::string_view name) {
    const auto c = detail::parse_semaphore(r.value);
    if (!c)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::lease_semaphore '{}': the record '{}' is not a dibs semaphore's (it "
                                          "starts '{}'); is the key used by another program?",
                                          detail::show_key(name), detail::show_key(detail::semaphore_key(name)),
                                          detail::show_key(r.value.substr(0, r.value.find('\n')))));
    return *c;
  }
  static std::vector<permit_holder> holders_of(Store& store, std::string_view name, const detail::semaphore_config& c) {
    std::vector<permit_holder> out;
    for (std::uint32_t i = 0; i < c.highest; ++i) {
      const lease_mutex<Store> look{store, detail::permit_key(name, i)};
      if (auto h = look.holder()) out.push_back({i, i >= c.permits, std::move(*h)});
    }
    return out;
  }
  // Throws: as parse; errc::corrupt_record if the record is gone (removed
  // by hand: the semaphore no longer says how many permits it has).
  detail::semaphore_config read_config(dibs::time_limit until) const {
    const auto r = detail::store_read(*store_, config_key_, until);
    if (!r)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::lease_semaphore '{}': its record '{}' is gone (removed by hand?); "
                                          "open the semaphore again to make it",
                                          detail::show_key(name_), detail::show_key(config_key_)));
    return parse(*r, name_);
  }

  // Requires: m_ held. Effects: n_ = the record's N, and a slot for each permit.
  void refresh(dibs::time_limit until) {
    n_ = read_config(until).permits;
    while (slots_.size() < n_)
      slots_.push_back(std::make_unique<lease_mutex<Store>>(
          *store_, detail::permit_key(name_, static_cast<std::uint32_t>(slots_.size())), opts_));
  }

  // One look at every permit, from the one after the last taken (so that
  // the processes of one host spread over the permits). `free_first`: the
  // first permit looked at is probably free: create its record before
  // reading (the others, and the record that says N, are read first).
  // Returns: true, with `out` holding the permit, if one was taken; false
  // if every permit was held, or the store could not be had by `limit`.
  bool try_round(bool free_first, dibs::time_limit limit, permit& out) {
    std::lock_guard g{m_};
    try {
      // The first look of a try_acquire or of a waiter just woken: the
      // permit after the last one taken, by N as last read, is probably free.
      if (free_first && try_permit(next_ % n_, true, limit, out)) return true;
      refresh(limit);  // N may have changed since we read it
      for (std::uint32_t k = 0; k < n_; ++k)
        if (try_permit((next_ + k) % n_, false, limit, out)) return true;
      return false;
    } catch (const std::system_error& e) {
      if (detail::timed_out(e)) return false;
      throw;
    }
  }

  // Requires: m_ held. Returns: true, with `out` holding permit i, if it
  // was taken and is below N (read after taking it).
  bool try_permit(std::uint32_t i, bool free_first, dibs::time_limit limit, permit& out) {
    if (!slots_[i]->try_once(free_first, limit) || !taken_below_limit(i, limit)) return false;
    next_ = i + 1;
    auto lock = std::exchange(slots_[i], std::make_unique<lease_mutex<Store>>(*store_, detail::permit_key(name_, i), opts_));
    out = permit{std::move(lock), waker_, i};
    return true;
  }

  // Requires: m_ held, slots_[i] just taken. Effects: reads N (after the
  // taking, so that a resize() that returned before it is seen); gives the
  // permit back if it is at or above N (N shrank since we read it).
  // Returns: true if it is below.
  bool taken_below_limit(std::uint32_t i, dibs::time_limit limit) {
    try {
      refresh(limit);
    } catch (...) {
      give_back(i);
      throw;
    }
    if (i < n_) return true;
    give_back(i);
    return false;
  }
  void give_back(std::uint32_t i) noexcept {
    try {
      slots_[i]->unlock();
    } catch (...) {
      // It expires with its lease: this object no longer renews it.
    }
  }

  std::optional<permit> acquire_until(dibs::time_limit until, const std::stop_token& st) {
    permit p;
    queue_type queue;  // this wait's own place in the semaphore's queue (opened when it first waits)
    std::uint32_t watch = 0;
    auto change_wait = [&] {
      if constexpr (detail::store_with_change_wait<Store>)
        return [&](std::chrono::nanoseconds d) {
          std::string key;
          {
            std::lock_guard g{m_};
            key = detail::permit_key(name_, watch++ % n_);
          }
          return store_->wait_for_change(key, d);
        };
      else
        return nullptr;
    }();
    const bool got = detail::wait_in_turn(
        queue,
        [&](bool create) {
          if constexpr (detail::store_with_waiter_queue<Store>) {
            if (!queue) queue = store_->open_waiter_queue(config_key_, create);
            return static_cast<bool>(queue);
          } else {
            (void)create;
            return false;
          }
        },
        [&](bool free_first, dibs::time_limit limit) { return try_round(free_first, limit, p); }, change_wait,
        [&]() {
          throw std::system_error(make_error_code(errc::cancelled),
                                  fmt::format("dibs::lease_semaphore '{}': wait for a permit cancelled (a stop was "
                                              "requested); all {} permits were held",
                                              detail::show_key(name_), permits()));
        },
        opts_.wait, true, until, st);
    if (!got) return std::nullopt;
    return p;
  }

  Store* store_;
  std::string name_;
  std::string config_key_;
  lease_options opts_;
  mutable std::mutex m_;
  std::uint32_t n_ = 0;     // the number of permits, as last read
  std::uint32_t next_ = 0;  // where the next look at the permits starts
  // One lease_mutex per permit, never held: it tries, and keeps what a
  // waiter watched of the permit's record (proof (b) is a whole lease of
  // watching the same version). The one that takes a permit moves into it.
  std::vector<std::unique_ptr<lease_mutex<Store>>> slots_;
  std::shared_ptr<queue_type> waker_;  // for permits to wake the queue's first waiter
};

}  // namespace dibs
