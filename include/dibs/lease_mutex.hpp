// dibs/lease_mutex.hpp: a mutex held as a lease on a record of any
// dibs::shared_store, with fencing tokens; dibs::lock_file (<dibs/lock_file.hpp>) is the one on a file.
//
//   dibs::lock_file lock{"/var/log/batch.log.lock"};
//   std::scoped_lock hold{lock};
//   write_log_with(lock.token());
//
// The record names its holder (host, boot id, pid, process start time, PID
// and time namespaces, lease length) in text a person can read. A waiter
// breaks a lock only on proof:
//   (a) the holder ran on this host in this boot, in the waiter's own PID
//       namespace, and its pid is gone, or now belongs to a process with
//       another start time (the pid was reused); whatever the waiter cannot
//       read or compare counts as alive (detail/owner.hpp has the rule); or
//   (b) the waiter has watched the same version of the record, unchanged, for
//       a whole lease on its own steady clock (a live holder renews the lease
//       about every third of it, which changes the version).
// On a store with its own clock (dibs::store_with_clock: postgres_store),
// (b) is judged by that one clock instead: the record was last written at
// least a lease and a quarter ago by the server's clock (the quarter for
// clocks that NTP slews at different rates), so a waiter that just arrived
// need not watch for a whole lease first.
// Wall clocks of different machines are never compared. Breaking is a
// compare-and-set on the version judged, so two breakers cannot both win and
// a lock renewed meanwhile is never broken.
//
// The holder's side of the lease (the validity rule): a hold is valid until
// the start of its last confirmed renewal (or of its acquisition) plus the
// lease, on the holder's own steady clock. From then on lost() is true and
// on_lost has been called, whatever the store or the renewal of another
// lease is doing: a waiter may break the lock one lease after it last saw
// the record change, which is never earlier.
//
// fork(): a child inherits a copy of a held lease_mutex, but the hold stays
// the parent's. The child's copy never renews, releases or erases it.
//
// Waiting: on a store with a waiter queue (file_store, so lock_file), the
// processes of one host that wait take turns first come, first served, and
// unlock() wakes the next one itself; a holder that asks again at once
// queues behind them. A waiter killed while queued is passed over at once;
// one that stands still when its turn comes (stopped) is passed after
// detail::queue_patience. The queue only orders the tries: who holds the
// lock is decided by the record's compare-and-set, as without it.
// try_lock() does not queue. Other stores wait unordered, with backoff and
// their change notification. docs/file-locks.md, "Waiting in turn".
//
// Every acquisition's token() is the record's version at that moment: larger
// than every token handed out before for the key, because store versions only
// grow. Pass it along to whatever the lock protects, so a holder that was
// paused past its lease is refused there too.
//
// Who holds it: holder() reads the record (it takes nothing) and says host,
// pid, since when (the holder's wall clock, `since_ms`), the lease and what
// is left of it, and the token (written into the record from the first
// renewal on as `token`; before that it is the record's version). A wait
// cancelled through a stop token names the holder it waited on.
//
// Holding for another process: with lease_options::on_behalf_of = pid, the
// record names that process (its pid and start time) instead of this one,
// while this object takes, renews and releases the hold as usual. That is
// how a launcher holds a lock for a COMMAND it starts (dibs lock: fork,
// lock on behalf of the child, let it exec): once the child is gone, any
// taker breaks the lock on proof (a), even while this object still renews
// it; and if this process dies, the hold stays with the child until it
// ends, or for one lease without renewal.
//
// Moving: a lease_mutex (and a lock_file) is a movable handle. A held lock
// moved to another object stays held and is renewed by that object; the
// moved-from one holds nothing and may only be destroyed or assigned to.
// Moving, like every use of one object, must not race with another thread's
// use of it.
#pragma once


#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
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
#include <dibs/detail/cancel.hpp>
#include <dibs/detail/owner.hpp>
#include <dibs/detail/renewal_keeper.hpp>
#include <dibs/detail/validity.hpp>
#include <dibs/detail/wait_in_turn.hpp>
#include <dibs/detail/timed_lockable.hpp>
#include <dibs/error.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/lock_holder.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct lease_options {
  /// How long a holder that stops renewing keeps the lock.
  std::chrono::milliseconds lease{10'000};
  /// Renew about every third of the lease, from one renewal thread per
  /// process (no thread is started per lock).
  bool renew = true;
  /// Called once, from a renewal thread or unlock(), when the lease has run
  /// out unrenewed or turns out to have been taken over: stop the work the
  /// lock protected. With `renew`, it is called by the lease's end at the
  /// latest (the validity rule above).
  std::function<void()> on_lost{};
  /// Waiting between tries (woken early by the store's change notification,
  /// where it has one).
  exponential_backoff wait{std::chrono::microseconds{500}, 2.0, std::chrono::milliseconds{50}, jitter::full};
  /// The process the lock is held for; 0: this process. See "Holding for
  /// another process" at the top of this header.
  process_id on_behalf_of = 0;
};

namespace detail {

inline constexpr std::string_view lease_magic = "dibs-lease 1\n";

}  // namespace detail

template <shared_store Store>
class lease_semaphore;

/// Meets Lockable and TimedLockable. One holder at a time across every
/// process (and machine) that uses the same store and key; not recursive.
template <shared_store Store>
class lease_mutex : public detail::timed_lockable<lease_mutex<Store>> {
  friend class detail::timed_lockable<lease_mutex<Store>>;
  friend class lease_semaphore<Store>;  // tries a permit's record as one try of a waiter (try_once)

public:
  /// Requires: `store` outlives this object. With opts.on_behalf_of: that
  /// pid names a live process of this host, in this process's PID namespace
  /// (a child this process forked, typically, not yet reaped).
  /// Effects: with opts.on_behalf_of, reads that process's start time now;
  /// every record this object writes names it as the holder.
  /// Throws: errc::invalid_argument for a bad key or a lease shorter than
  /// 3 ms; std::errc::no_such_process if opts.on_behalf_of names no process.
  lease_mutex(Store& store, std::string key, lease_options opts = {})
      : store_(&store), key_(std::move(key)), opts_(std::move(opts)) {
    validate_key(key_, "dibs::lease_mutex");
    if (opts_.lease < std::chrono::milliseconds{3})
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::lease_mutex '{}': lease must be at least 3 ms", key_));
    if (opts_.on_behalf_of != 0) behalf_ = other_process(opts_.on_behalf_of);
  }
  lease_mutex(const lease_mutex&) = delete;
  lease_mutex& operator=(const lease_mutex&) = delete;
  /// Requires: no other thread uses `o` meanwhile.
  /// Effects: takes over `o`'s store, key, options and hold: a lock `o` held
  /// stays held, renewed from now on by this object (`o`'s renewal is
  /// stopped first, then this object's started). `o` is left empty: it
  /// holds nothing, its destructor does nothing, and it may only be
  /// destroyed or assigned to (a lock call on it throws
  /// std::errc::operation_not_permitted). Throws: std::bad_alloc.
  lease_mutex(lease_mutex&& o) { take(o); }
  /// Requires: as the move constructor. Effects: unlock() if this object
  /// holds the lock, then as the move constructor. Throws: as unlock() (then
  /// `o` is untouched and this object holds nothing).
  lease_mutex& operator=(lease_mutex&& o) {
    if (this != &o) {
      unlock();
      take(o);
    }
    return *this;
  }
  /// Effects: releases the lock if held (errors are swallowed: a destructor must not throw).
  ~lease_mutex() {
    if (held_.load()) {
      try {
        unlock();
      } catch (...) {
      }
    }
  }

  // lock(), lock(stop_token), try_lock_for(d[, stop_token]), try_lock_until(t):
  // from detail::timed_lockable, through acquire(). try_lock_for waits in
  // the store until its deadline at most, so a stopped process holding the
  // record makes it return in time too.
  /// Returns: true if this object now holds the lock. Waits for nothing but
  /// a record another process is changing at that moment (detail::try_wait):
  /// a record held by a stopped process reads as "busy", i.e. false.
  bool try_lock() { return try_once(true, clock::now() + detail::try_wait); }
  /// Effects: stops renewing and removes the record if it is still ours (a
  /// compare-and-set: a lock taken over is left to its new holder, and
  /// on_lost is called). If the record stays locked by another process (a
  /// stopped one) for a whole lease, it is left in place: it then expires
  /// like the lease of a holder that stopped renewing. In a forked child of
  /// the holder it only forgets the hold, which is the parent's.
  void unlock() {
    if (!held_.load()) return;
    if (holder_pid_.load() != detail::current_pid()) {  // a forked child's copy: the parent's hold
      held_ = false;
      return;
    }
    stop_renewal();
    bool newly_lost = false;
    {
      std::lock_guard g{m_};
      if (!held_) return;
      held_ = false;
      hold_.finish();
      try {
        if (!detail::store_erase(*store_, key_, version_, clock::now() + opts_.lease)) newly_lost = hold_.mark_lost();
      } catch (const std::system_error& e) {
        if (!detail::timed_out(e)) throw;
      }
      // The lock is free: its turn goes to the first queued waiter, woken
      // here, not to whoever asks next (this process asking again, say).
      if constexpr (detail::store_with_waiter_queue<Store>) {
        if (open_queue(false)) queue_.wake_first();
      }
    }
    notify_lost(newly_lost);
  }

  /// Returns: the fencing token of the current hold (0 if none). Lock-free.
  dibs::version token() const noexcept { return held_.load() ? token_.load() : 0; }
  /// Returns: true if the current (or last) hold was lost: taken over, or
  /// its lease ran out before a renewal was confirmed (the validity rule).
  /// Lock-free: cheap enough to check before every write the lock guards.
  bool lost() const noexcept { return hold_.lost(); }
  const std::string& key() const noexcept { return key_; }

  /// Effects: reads the lock's record; takes nothing, changes nothing.
  /// Returns: who holds the lock now (see lock_holder), or nothing if it is
  /// free; `gone` is this header's proof rule (a), the one a taker breaks
  /// the lock by at once. Throws: as the store's read (errc::timed_out if the record stays
  /// mid-write by another process for a second: it is stopped);
  /// errc::corrupt_record for a record that is not a dibs lease.
  std::optional<lock_holder> holder() const {
    check_not_moved_from();
    for (int attempt = 0;; ++attempt) {
      dibs::version before;
      {
        std::lock_guard g{m_};
        before = version_;
      }
      const auto r = detail::store_read(*store_, key_, clock::now() + std::chrono::seconds{1});
      if (!r) return std::nullopt;
      const auto owner = parse_lease(*r);
      lock_holder h = describe(*r, owner);
      std::lock_guard g{m_};
      if (held_ && holder_pid_.load() == detail::current_pid() && version_ == r->version) {
        h.mine = true;
        h.lease_left = std::chrono::duration_cast<std::chrono::milliseconds>(hold_.end() - clock::now());
      } else if (held_ && version_ != before && attempt < 5) {
        continue;  // renewed while the record was read: what was read is already old, read again
      }
      // Also for this object's own hold on behalf of a process that has ended.
      h.gone = detail::provably_dead(owner);
      return h;
    }
  }
  /// Effects: renews the lease now. Returns: false if it was lost (then
  /// on_lost has been called). In a forked child: false, touching nothing.
  bool renew() {
    bool newly_lost = false;
    {
      std::lock_guard g{m_};
      if (!held_ || hold_.marked_lost() || holder_pid_.load() != detail::current_pid()) return false;
      if (hold_.renew(opts_.lease, [&](dibs::time_limit end) {
            const auto v = detail::store_replace(*store_, key_, version_, value(since_ms_, token_.load()), end);
            if (v) version_ = *v;
            return v.has_value();
          }))
        return true;
      newly_lost = hold_.mark_lost();
    }
    notify_lost(newly_lost);
    return false;
  }

private:
  // The record: the owner, since when it holds (unix ms), and, once the
  // record's version no longer is the token (from the first renewal on),
  // the token.
  std::string value(std::int64_t since_ms, dibs::version token) const {
    detail::owner_id me = behalf_ ? *behalf_ : detail::this_process(opts_.lease);
    me.since_ms = since_ms;
    me.written_ms = detail::wall_ms();
    std::string v(detail::lease_magic);
    if (token != 0) v += fmt::format("token {}\n", token);
    return v + detail::format_owner(me) + detail::write_nonce();
  }

  // Throws: errc::corrupt_record if `r` is not a lease with an owner.
  detail::owner_id parse_lease(const record& r) const {
    if (std::string_view(r.value).substr(0, detail::lease_magic.size()) != detail::lease_magic)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::lease_mutex '{}': the record is not a dibs lease (it starts '{}'); "
                                          "was it left by another tool or an older format?",
                                          key_, r.value.substr(0, r.value.find('\n'))));
    auto owner = detail::parse_owner(r.value);
    if (!owner)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::lease_mutex '{}': the lease record lacks an owner field", key_));
    return *owner;
  }

  // What a record says of its holder (`mine` and an exact lease_left are
  // for holder() to add).
  static lock_holder describe(const record& r, const detail::owner_id& o) {
    lock_holder h;
    h.host = o.host;
    h.pid = o.pid;
    if (o.since_ms != 0) h.since = detail::from_wall_ms(o.since_ms);
    h.lease = o.lease;
    if (o.written_ms != 0) h.lease_left = std::chrono::milliseconds{o.written_ms + o.lease.count() - detail::wall_ms()};
    h.token = detail::number_field<dibs::version>(r.value, "token").value_or(r.version);
    return h;
  }

  // Returns: the identity of process `pid` as proof rule (a) reads it: this
  // host, boot and namespaces; its start time where this process's /proc is
  // its own PID namespace's (else 0: unknown, so only "no such pid" proves
  // it gone). Throws: std::errc::no_such_process if there is no such process.
  detail::owner_id other_process(detail::process_id pid) const {
    return detail::other_process(opts_.lease, pid, fmt::format("dibs::lease_mutex '{}'", key_));
  }

  void check_not_moved_from() const {
    if (!store_)
      throw std::system_error(std::make_error_code(std::errc::operation_not_permitted),
                              "dibs::lease_mutex: this object was moved from; assign a lock to it first");
  }

  // Requires: no other thread uses `o`; this object holds nothing.
  void take(lease_mutex& o) {
    o.stop_renewal();  // from here on no task of the keeper touches `o`
    std::lock_guard g{o.m_};
    store_ = std::exchange(o.store_, nullptr);
    key_ = std::move(o.key_);
    o.key_.clear();
    opts_ = std::move(o.opts_);
    behalf_ = std::exchange(o.behalf_, std::nullopt);
    held_ = o.held_.exchange(false);
    holder_pid_ = o.holder_pid_.exchange(0);
    hold_.assign(o.hold_);
    o.hold_.finish();
    version_ = std::exchange(o.version_, 0);
    token_ = o.token_.exchange(0);
    since_ms_ = std::exchange(o.since_ms_, 0);
    seen_version_ = std::exchange(o.seen_version_, std::nullopt);
    seen_since_ = o.seen_since_;
    last_seen_ = std::exchange(o.last_seen_, std::nullopt);
    queue_ = std::move(o.queue_);
    if (held_ && holder_pid_.load() == detail::current_pid() && !hold_.marked_lost()) start_renewal();
  }

  using clock = std::chrono::steady_clock;

  // One try. `free_first`: try to create the record before reading it,
  // which saves a read when the lock is free (the first try); later tries
  // of a waiter read first, so that they do not queue for the record's
  // write lock in front of the holder's unlock.
  // Returns: true if this object now holds the lock; false if not, also
  // when the store could not be had by `until` (the record is busy).
  bool try_once(bool free_first, dibs::time_limit until) {
    check_not_moved_from();
    std::lock_guard g{m_};
    if (held_ && holder_pid_.load() == detail::current_pid())
      throw std::system_error(make_error_code(std::errc::resource_deadlock_would_occur),
                              fmt::format("dibs::lease_mutex '{}': already held by this object", key_));
    try {
      return try_once_locked(free_first, until);
    } catch (const std::system_error& e) {
      if (detail::timed_out(e)) return false;
      throw;
    }
  }

  // Requires: m_ held.
  bool try_once_locked(bool free_first, dibs::time_limit until) {
    const auto start = clock::now();  // a hold is valid from before the call that makes it
    const auto since = detail::wall_ms();
    if (free_first) {
      if (auto v = detail::store_create(*store_, key_, value(since, 0), until)) return became_holder(*v, start, since);
    }
    std::optional<record> r;
    std::optional<std::chrono::milliseconds> age;  // by the store's own clock, where it has one
    if constexpr (store_with_clock<Store>) {
      if (auto a = detail::retry_transient(until, [&] { return store_->read_aged(key_, until); })) {
        r = std::move(a->record);
        age = a->age;
      }
    } else {
      r = detail::store_read(*store_, key_, until);
    }
    if (!r) {
      if (auto v = detail::store_create(*store_, key_, value(since, 0), until)) return became_holder(*v, start, since);
      return false;
    }
    const auto owner = parse_lease(*r);
    last_seen_ = describe(*r, owner);
    bool stale = detail::provably_dead(owner);
    const auto now = clock::now();
    if (!stale && age) {
      // One clock for every client: the record was last written (renewed)
      // `age` ago by the store's clock, after its holder began that renewal,
      // so the holder's own validity (from the renewal's start) ended first,
      // with a margin for clocks that run at different rates.
      stale = *age >= owner.lease + detail::clock_margin(owner.lease);
    } else if (!stale) {
      if (!seen_version_ || *seen_version_ != r->version) {
        seen_version_ = r->version;  // start watching this version on our own clock
        seen_since_ = now;
      } else if (now - seen_since_ >= owner.lease) {
        stale = true;  // unchanged for a whole lease: its holder stopped renewing
      }
    }
    if (!stale) return false;
    if (auto v = detail::store_replace(*store_, key_, r->version, value(since, 0), until))
      return became_holder(*v, start, since);
    return false;
  }

  // Throws: errc::cancelled, naming the holder last seen.
  [[noreturn]] void throw_cancelled() const {
    if (last_seen_)
      throw std::system_error(make_error_code(errc::cancelled),
                              fmt::format("dibs::lease_mutex '{}': wait for the lock cancelled (a stop was requested); "
                                          "it was held by {}",
                                          key_, *last_seen_));
    detail::throw_cancelled("dibs::lease_mutex", key_);
  }

  // Waiting: detail::wait_in_turn (in the turns of the store's waiter
  // queue where it has one, else unordered with backoff and the store's
  // change notification).
  bool acquire(dibs::time_limit until, const std::stop_token& st) {
    {
      std::lock_guard g{m_};
      last_seen_.reset();
    }
    auto change_wait = [&] {
      if constexpr (detail::store_with_change_wait<Store>)
        return [this](std::chrono::nanoseconds d) { return store_->wait_for_change(key_, d); };
      else
        return nullptr;
    }();
    return detail::wait_in_turn(
        queue_, [this](bool create) { return open_queue(create); },
        [this](bool free_first, dibs::time_limit limit) { return try_once(free_first, limit); }, change_wait,
        [this]() {
          std::lock_guard g{m_};
          throw_cancelled();
        },
        opts_.wait, false, until, st);
  }

  // Returns: true if the waiter queue is open in this process (opened now
  // if it was not, or opened again in a forked child); `create`: made if
  // there is none. Only for a store with a waiter queue.
  bool open_queue(bool create) {
    if constexpr (detail::store_with_waiter_queue<Store>) {
      if (!queue_) queue_ = store_->open_waiter_queue(key_, create);
      return static_cast<bool>(queue_);
    } else {
      (void)create;
      return false;
    }
  }

  // Requires: m_ held. `start`: when the call that made the hold began;
  // `since_ms`: the wall clock written into the record as its since_ms.
  bool became_holder(dibs::version v, clock::time_point start, std::int64_t since_ms) {
    held_ = true;
    version_ = v;
    token_ = v;
    since_ms_ = since_ms;
    holder_pid_ = detail::current_pid();
    hold_.begin(start, opts_.lease);
    seen_version_.reset();
    last_seen_.reset();
    start_renewal();
    return true;
  }

  // The keeper's hooks name this object: a move stops them first and
  // starts new ones for the object moved to.
  void start_renewal() {
    if (opts_.renew) {
      renewal_id_ = detail::renewal_keeper::instance().add(
          opts_.lease / 3, {[this] { return renew(); }, [this] { notify_lost(true); }, &hold_});
    }
  }

  void stop_renewal() {
    if (renewal_id_) detail::renewal_keeper::instance().remove(std::exchange(renewal_id_, 0));
  }

  // Called without m_, so on_lost may call unlock().
  void notify_lost(bool newly_lost) {
    if (newly_lost && opts_.on_lost) opts_.on_lost();
  }

  Store* store_ = nullptr;  // nullptr: moved from
  std::string key_;
  lease_options opts_;
  std::optional<detail::owner_id> behalf_;  // the process the records name, if not this one
  mutable std::mutex m_;
  std::atomic<bool> held_{false};
  std::atomic<detail::process_id> holder_pid_{0};   // the process that holds it (a forked child's copy is not it)
  detail::validity hold_;              // the validity rule of the current (or last) hold
  dibs::version version_ = 0;          // the record's current version (renewals move it)
  std::atomic<dibs::version> token_{0};  // the version at acquisition
  std::int64_t since_ms_ = 0;            // the hold's start on the wall clock (unix ms), as its record says
  std::optional<dibs::version> seen_version_;
  clock::time_point seen_since_{};
  std::optional<lock_holder> last_seen_;  // the holder a waiter last found (for its error messages)
  std::uint64_t renewal_id_ = 0;
  typename detail::waiter_queue_of<Store>::type queue_;  // opened when first needed
};

}  // namespace dibs

// lock_file (lease_mutex over a file_store) has a header of its own; 0.1's
// programs found it here. Kept for one release: include <dibs/lock_file.hpp>.
#include <dibs/lock_file.hpp>
