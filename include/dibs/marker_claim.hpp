// dibs/marker_claim.hpp: claim a shared work item exactly once, by a marker
// on the item's own record in any dibs::shared_store.
//
//   dibs::file_store store{dir};
//   dibs::marker_claim<dibs::file_store> claims{store};
//   if (auto c = claims.try_claim("msg-1")) {
//     handle(msg, c->token());   // pass the token to what the work writes
//     c->complete();             // or leave scope: the item goes back
//   }
//
// States of an item (the record's value, readable text):
//   absent      never claimed
//   offered     put in the queue by offer(), for claim_next to find; never
//               claimed; maybe with a priority and a not_before time
//   processing  claimed: owner (host, boot, pid, start time), lease, attempts
//   released    given back (scope left without complete(), or an error);
//               attempts and priority kept; claimable again after a backoff
//               (release(error, retry_after), claim_options::retry_backoff)
//   completed   done; kept as proof
//   failed      given back max_attempts times; kept, with the last error
// Every change is one compare-and-set on the record's version, so two workers
// never both hold an item, and a worker whose claim was taken over (its
// version moved) can neither complete nor give back the item.
// A processing claim is recovered from its worker only on proof, by the rule
// lease_mutex uses (detail/owner.hpp): the worker ran on this host in this
// boot and in this PID namespace, and its pid is gone or reused (anything
// that cannot be read or compared counts as alive), or this process has
// watched the claim unchanged for its whole lease (a live worker on a long
// item calls renew()).
// try_claim and sweep wait for nothing: an item whose record another process
// holds (a stopped one, say) is "busy" and skipped, so one stopped worker
// never stalls the others. A claim object copied into a forked child stays
// the parent's: the child's copy never completes, gives back or renews it.
// Over a store that models create_before_read_store (sqlite_store),
// try_claim sends the create first while the items it meets are fresh (one
// statement for a fresh item), and reads first once it met a taken one (a
// taken item then costs a read, not the write lock that contending workers
// queue for); the create never changes a record that is there.
//
// Completing in the same transaction as the work's effects: over a store
// that models transaction_aware_store (sqlite_store), complete() or
// release() called by a thread that has a transaction open on the store
// (dibs::transact(policy, store.connection(), ...)) is part of that
// transaction. The claim keeps it pending until the transaction ends: if it
// commits, the claim is finished; if it is rolled back, the claim is held
// again at the version it had, renewals go on, and the body may complete it
// again (transact's retry does). Claim items before the transaction.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/detail/claim_record.hpp>
#include <dibs/detail/format.hpp>
#include <dibs/detail/owner.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/detail/renewal_keeper.hpp>
#include <dibs/detail/validity.hpp>
#include <dibs/detail/units.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct claim_options {
  /// How long a claim whose worker stops renewing is respected by others.
  std::chrono::milliseconds lease{60'000};
  /// Claims of an item before it is failed (the last error kept).
  std::uint32_t max_attempts = 5;
  /// Renew each claim about every third of the lease, from the renewal
  /// threads lease_mutex uses (no thread per claim), until it is completed or
  /// given back: a slow item never loses its claim to a second worker while
  /// its worker lives. Off: the worker calls claim::renew() itself.
  bool renew = true;
  /// Called once per claim, from a renewal thread, with the item's key, when
  /// the claim was taken over or its lease ran out unrenewed (claim::lost()
  /// is then true): stop working on that item.
  std::function<void(std::string_view key)> on_lost{};
  /// Called when try_claim or sweep meets an item whose record is damaged
  /// (the item is skipped, never treated as absent), with the key and what
  /// is wrong. Unset: one line on stderr, once per key and marker_claim.
  std::function<void(std::string_view key, std::string_view what)> on_damaged{};
  /// How long an item given back (release(), a claim left without
  /// complete()) waits before it is claimable again, by its attempt count:
  /// attempt n waits retry_backoff->delay(n - 1, ...). The default, as job
  /// queues do it (an item that just failed mostly fails again at once):
  /// 0.5-1 s after the first attempt, then 1-2 s, 2-4 s, ... up to 5-10 min
  /// (doubling, equal jitter, so a retry never comes at once). Unset
  /// (std::nullopt): claimable at once. release(error, retry_after) chooses
  /// the wait itself (0 ms: at once). An item recovered from a worker that
  /// is gone comes back at once either way.
  std::optional<exponential_backoff> retry_backoff =
      exponential_backoff{std::chrono::seconds{1}, 2.0, std::chrono::minutes{10}, jitter::equal};
};

/// How offer() puts an item in the queue.
struct offer_options {
  /// Not claimable before this time (by the clock of the machine that
  /// offers it; the epoch: at once). Scheduled items.
  std::chrono::system_clock::time_point not_before{};
  /// claim_next takes claimable items of a higher priority first (then in
  /// key order on postgres_store and sqlite_store, in random order
  /// elsewhere); a released
  /// item keeps its priority. Urgent items: above 0.
  std::int32_t priority = 0;
};

/// A store that can claim the next claimable items itself, each in one
/// atomic step, through an index of its claimable records (postgres_store,
/// sqlite_store, file_store): take_claimable(prefix, rest, n, t) picks up
/// to `n` records whose key starts with `prefix` and that are offered or
/// released claims (on postgres_store also rows with no record that were
/// never written: version 0) whose "not_before" time has come, the highest
/// "priority" first, skipping those another worker is taking, and replaces
/// each with detail::claim_record::taken_head(its attempts + 1, its
/// priority), then `rest`. Returns their keys and new records (none if no
/// item is claimable). processing_keys(prefix) returns the keys starting
/// with `prefix` whose record is a processing claim (the only ones a sweep
/// can recover).
template <class S>
concept claim_queue_store = requires(S& s, std::string_view prefix, std::string_view rest, std::uint32_t n,
                                     dibs::time_limit t) {
  { s.take_claimable(prefix, rest, n, t) } -> std::same_as<std::vector<std::pair<std::string, record>>>;
  { s.processing_keys(prefix) } -> std::same_as<std::vector<std::string>>;
};

/// Who holds a lease or a claim, as its record says (host, boot id, pid,
/// start time, PID and time namespaces, lease).
using owner_info = detail::owner_id;

/// Returns: "pid 4711 on build-7 (lease 60 s)".
inline std::string to_string(const owner_info& o) {
  return fmt::format("pid {} on {} (lease {})", o.pid, o.host, detail::human(o.lease));
}

/// What status() reports of an item.
struct claim_status {
  claim_state state = claim_state::absent;
  std::uint32_t attempts = 0;
  std::string error;              ///< the last error given back, if any; what is wrong, if damaged
  std::string result;             ///< what complete() recorded
  std::int32_t priority = 0;      ///< offer_options::priority, kept across attempts
  /// Offered or released: not claimable before this time (the epoch: at once).
  std::chrono::system_clock::time_point not_before{};
  dibs::version version = 0;      ///< the record's version (0 if absent)
  /// Completed, given back or failed: the fencing token of the claim that
  /// did it (0 otherwise), so a check of fenced effects can find the claim
  /// that completed an item.
  dibs::version token = 0;
  std::optional<owner_info> owner;  ///< the worker, while processing
  /// When the record last changed (claimed, renewed, given back, completed),
  /// by the clock of the machine that changed it; the epoch for a record
  /// written by dibs 0.1, which did not keep it.
  std::chrono::system_clock::time_point changed{};
};

/// One item of marker_claim::list().
struct claim_item {
  std::string key;
  claim_status status;
};

/// Returns: one line a person reads: "processing, attempt 2, by pid 4711 on
/// build-7 (lease 60 s)", "completed, attempt 1: order 17", "damaged: ...".
inline std::string to_string(const claim_status& s) {
  std::string out = to_string(s.state);
  if (s.state == claim_state::damaged) return out + ": " + s.error;
  if (s.state == claim_state::absent) return out;
  out += fmt::format(", attempt {}", s.attempts);
  if (s.owner) out += ", by " + to_string(*s.owner);
  if (!s.result.empty()) out += ": " + s.result;
  if (!s.error.empty()) out += " (last error: " + s.error + ")";
  return out;
}
inline std::ostream& operator<<(std::ostream& out, const claim_status& s) { return out << to_string(s); }

template <shared_store Store>
class marker_claim {
public:
  /// An item held by this worker: a movable handle. Leaving scope (or being
  /// assigned over) without complete() gives the item back (or fails it
  /// after max_attempts); errors there are swallowed. With
  /// claim_options::renew (the default) the claim renews itself in the
  /// background until it is finished, and lost() says when it can no longer
  /// be trusted (the validity rule of lease_mutex).
  class claim {
  public:
    claim(claim&& o) noexcept
        : owner_(std::exchange(o.owner_, nullptr)), key_(std::move(o.key_)), token_(o.token_), attempts_(o.attempts_),
          priority_(o.priority_), pid_(o.pid_), hold_(std::move(o.hold_)) {}
    /// Effects: gives back the item this claim holds (as its destructor
    /// would), then takes over what `o` holds.
    claim& operator=(claim&& o) noexcept {
      if (this != &o) {
        abandon();
        owner_ = std::exchange(o.owner_, nullptr);
        key_ = std::move(o.key_);
        token_ = o.token_;
        attempts_ = o.attempts_;
        priority_ = o.priority_;
        pid_ = o.pid_;
        hold_ = std::move(o.hold_);
      }
      return *this;
    }
    claim(const claim&) = delete;
    claim& operator=(const claim&) = delete;
    ~claim() { abandon(); }

    /// Effects: marks the item completed, keeping `result` as proof. Called by
    /// a thread with a transaction open on the store (transaction_aware_store),
    /// the completion is part of that transaction: the claim is finished when
    /// it commits, and held again, as before the call, if it is rolled back.
    /// Throws: std::system_error(errc::lease_lost) if the claim was taken
    /// over (the item is then someone else's: do not report it done);
    /// errc::timed_out if another process (a stopped one) kept the item's
    /// record locked until the claim's lease ran out (the item is then not
    /// completed, and is claimed again after the lease);
    /// std::errc::operation_not_permitted in a forked child of the worker.
    void complete(std::string_view result = {}) {
      check_owner_process("complete");
      settle();
      if (!owner_) throw std::logic_error(fmt::format("dibs::marker_claim '{}': complete on a finished claim", key_));
      if (pending())
        throw std::logic_error(fmt::format("dibs::marker_claim '{}': complete after complete() or release() in the same "
                                           "open transaction",
                                           key_));
      const std::string value = completed_value(result);
      bool done = false;
      try {
        done = in_store_transaction() ? finish_in_transaction(value) : finish(value);
      } catch (const std::system_error& e) {
        if (!detail::timed_out(e)) throw;
        throw std::system_error(e.code(),
                                fmt::format("dibs::marker_claim '{}': cannot complete: another process (a stopped "
                                            "one?) kept the item's record locked until the claim's lease ran out; "
                                            "the item is not marked completed and will be claimed again",
                                            key_));
      }
      if (!done)
        throw std::system_error(make_error_code(errc::lease_lost),
                                fmt::format("dibs::marker_claim '{}': cannot complete: the claim (token {}) was taken "
                                            "over by another worker (its lease ran out unrenewed, or its worker "
                                            "was judged gone)",
                                            key_, token_));
    }
    /// Effects: gives the item back with `error` recorded; it is failed if
    /// this was its last attempt. It is claimable again after
    /// claim_options::retry_backoff (by default 0.5-1 s after the first
    /// attempt, doubling; at once if that is unset).
    /// Returns: false if the claim was taken over.
    /// Throws: std::errc::operation_not_permitted in a forked child of the
    /// worker; errc::timed_out as complete().
    bool release(std::string_view error = "released") { return release_after(error, std::nullopt); }
    /// Effects: as release(error), but the item is claimable again only
    /// `retry_after` from now (by this machine's clock), whatever
    /// claim_options::retry_backoff says.
    /// Throws: errc::invalid_argument if `retry_after` is negative; as release().
    bool release(std::string_view error, std::chrono::milliseconds retry_after) {
      if (retry_after < std::chrono::milliseconds::zero())
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("dibs::marker_claim '{}': release: retry_after must not be negative (got "
                                            "{} ms)",
                                            key_, retry_after.count()));
      return release_after(error, retry_after);
    }
    /// Effects: gives the item back as if this claim had not been made: its
    /// attempt is not counted (so an item claimed on its last attempt is not
    /// failed for it), and it is claimable again at once. For an item claimed
    /// ahead and never started (worker_pool's prefetched items at a stop);
    /// `why` is kept as its last error.
    /// Returns: false if the claim was taken over.
    /// Throws: as release().
    bool give_back_unstarted(std::string_view why = "claimed ahead and never started") {
      check_owner_process("give back");
      settle();
      if (owner_ && pending())
        throw std::logic_error(fmt::format("dibs::marker_claim '{}': give back after complete() or release() in the "
                                           "same open transaction",
                                           key_));
      if (!owner_) return false;
      const std::string value =
          owner_->encode(claim_state::released, attempts_ > 0 ? attempts_ - 1 : 0, why, "", token_, priority_);
      return in_store_transaction() ? finish_in_transaction(value) : finish(value);
    }
    /// Effects: renews the lease now (with claim_options::renew this also
    /// happens by itself). Returns: false if the claim is lost.
    /// Throws: std::errc::operation_not_permitted in a forked child of the worker.
    bool renew() {
      if (!owner_) return false;
      check_owner_process("renew");
      settle();
      if (!owner_) return false;
      return renew_hold(*owner_, *hold_, key_, attempts_, token_, priority_);
    }
    /// Returns: true if the claim was taken over, or its lease ran out
    /// before a renewal was confirmed: stop working on the item. Lock-free.
    bool lost() const noexcept { return !hold_ || hold_->validity.lost(); }

    /// The fencing token of this claim: larger than that of every earlier claim of the item.
    dibs::version token() const noexcept { return token_; }
    std::uint32_t attempts() const noexcept { return attempts_; }
    /// The item's offer_options::priority.
    std::int32_t priority() const noexcept { return priority_; }
    const std::string& key() const noexcept { return key_; }

  private:
    friend class marker_claim;
    using clock = std::chrono::steady_clock;

    // What a claim shares with its renewals: on the heap, so that a claim
    // can move while a renewal runs.
    struct hold {
      std::mutex m;
      dibs::version version = 0;  // the record's current version (renewals move it)
      detail::validity validity;  // the validity rule
      std::uint64_t renewal_id = 0;
      // pending: completed or given back in a transaction still open (its
      // version stays the one before: a rollback brings it back); done: that
      // transaction committed.
      enum class phase : unsigned char { held, pending, done } phase = phase::held;
      std::uint64_t pending_id = 0;  // the store's after_transaction() callback while pending
    };

    claim(marker_claim* owner, std::string key, dibs::version v, std::uint32_t attempts, std::int32_t priority,
          clock::time_point start)
        : owner_(owner), key_(std::move(key)), token_(v), attempts_(attempts), priority_(priority),
          pid_(detail::current_pid()), hold_(std::make_unique<hold>()) {
      hold_->version = v;
      hold_->validity.begin(start, owner->opts_.lease);
      if (!owner->opts_.renew) return;
      hold* h = hold_.get();
      const std::string k = key_;
      const std::uint32_t a = attempts_;
      const dibs::version t = token_;
      const std::int32_t p = priority_;
      h->renewal_id = detail::renewal_keeper::instance().add(
          owner->opts_.lease / 3, {[owner, h, k, a, t, p] { return renew_hold(*owner, *h, k, a, t, p); },
                                   [owner, k] { owner->notify_lost(k); }, &h->validity});
    }

    bool in_owner_process() const noexcept { return pid_ == detail::current_pid(); }

    std::string completed_value(std::string_view result) const {
      return owner_->encode(claim_state::completed, attempts_, "", result, token_, priority_);
    }
    void check_owner_process(const char* what) const {
      if (owner_ && !in_owner_process())
        throw std::system_error(std::make_error_code(std::errc::operation_not_permitted),
                                fmt::format("dibs::marker_claim '{}': cannot {} in a forked child: the claim (token {}) "
                                            "belongs to process {}, which made it; only it may finish the item",
                                            key_, what, token_, pid_));
    }

    // Renews `h` (from a renewal thread or renew()). Returns: false if lost.
    static bool renew_hold(marker_claim& o, hold& h, const std::string& key, std::uint32_t attempts, dibs::version token,
                           std::int32_t priority) {
      {
        std::lock_guard g{h.m};
        if (h.validity.marked_lost() || h.phase == hold::phase::done) return false;
        // A transaction of this worker's holds the record: it decides.
        if (h.phase == hold::phase::pending) return !h.validity.lost();
        // Another failure of the store propagates: the renewal thread tries
        // again, and the lease's end decides.
        if (h.validity.renew(o.opts_.lease, [&](dibs::time_limit end) {
              const auto v = detail::store_replace(o.store_, key, h.version,
                                                   o.encode(claim_state::processing, attempts, "", "", token, priority),
                                                   end);
              if (v) h.version = *v;
              return v.has_value();
            }))
          return true;
        if (!h.validity.mark_lost()) return false;
      }
      o.notify_lost(key);
      return false;
    }

    void stop_renewal() {
      if (hold_ && hold_->renewal_id) detail::renewal_keeper::instance().remove(std::exchange(hold_->renewal_id, 0));
    }

    bool in_store_transaction() const {
      if constexpr (transaction_aware_store<Store>) return owner_->store_.in_transaction();
      else return false;
    }

    bool pending() const {
      std::lock_guard g{hold_->m};
      return hold_->phase == hold::phase::pending;
    }

    // Takes in what an ended transaction decided: a claim whose completion
    // or give-back committed is finished.
    void settle() {
      if (!owner_) return;
      {
        std::lock_guard g{hold_->m};
        if (hold_->phase != hold::phase::done) return;
      }
      owner_ = nullptr;
      stop_renewal();
    }

    // Effects: the last compare-and-set of this claim as part of the
    // caller's open transaction. Renewals go on (they leave a pending claim
    // alone) so that a rollback finds the claim as it was.
    // Returns: false if the claim was taken over.
    bool finish_in_transaction(const std::string& value) {
      if constexpr (transaction_aware_store<Store>) {
        std::optional<dibs::version> v;
        {
          std::lock_guard g{hold_->m};
          v = owner_->store_.replace(key_, hold_->version, value);
          if (v) {
            hold* h = hold_.get();
            h->phase = hold::phase::pending;
            h->pending_id = owner_->store_.after_transaction([h](bool committed) {
              std::lock_guard hg{h->m};
              h->pending_id = 0;
              h->phase = committed ? hold::phase::done : hold::phase::held;
              if (committed) h->validity.finish();
            });
          }
        }
        if (!v) {
          owner_ = nullptr;
          stop_renewal();
        }
        return v.has_value();
      } else {
        return finish(value);
      }
    }

    // Effects: lets go of a claim whose completion or give-back is pending
    // in an open transaction (it is being destroyed): that transaction
    // decides what the record says.
    void detach() noexcept {
      if constexpr (transaction_aware_store<Store>) {
        std::uint64_t id = 0;
        {
          std::lock_guard g{hold_->m};
          id = std::exchange(hold_->pending_id, 0);
        }
        if (id) owner_->store_.forget_after_transaction(id);
      }
      owner_ = nullptr;
      stop_renewal();
    }

    // Effects: the last compare-and-set of this claim, after its renewals
    // have stopped. It waits for the record at most until the claim's lease
    // ends (others may take the item then anyway), so a stopped process
    // that holds the record cannot hold this worker up for longer.
    // Returns: false if the claim was taken over. Throws: errc::timed_out.
    bool finish(const std::string& value) {
      auto* o = std::exchange(owner_, nullptr);
      stop_renewal();
      std::lock_guard g{hold_->m};
      const auto end = std::max(hold_->validity.end(), clock::now() + detail::try_wait);
      return detail::store_replace(o->store_, key_, hold_->version, value, end).has_value();
    }

    bool release_after(std::string_view error, std::optional<std::chrono::milliseconds> retry_after) {
      check_owner_process("release");
      settle();
      if (owner_ && pending())
        throw std::logic_error(fmt::format("dibs::marker_claim '{}': release after complete() or release() in the same "
                                           "open transaction",
                                           key_));
      return give_back(error, retry_after);
    }

    // `retry_after`: unset, claim_options::retry_backoff decides.
    bool give_back(std::string_view error, std::optional<std::chrono::milliseconds> retry_after = std::nullopt) {
      if (!owner_) return false;
      const auto state = attempts_ >= owner_->opts_.max_attempts ? claim_state::failed : claim_state::released;
      std::chrono::system_clock::time_point not_before{};
      if (state == claim_state::released) {
        if (!retry_after && owner_->opts_.retry_backoff) {
          thread_local std::mt19937_64 rng{std::random_device{}()};
          const double u = std::uniform_real_distribution<double>{0.0, 1.0}(rng);
          retry_after = std::chrono::ceil<std::chrono::milliseconds>(
              owner_->opts_.retry_backoff->delay(attempts_ == 0 ? 0 : attempts_ - 1, {}, u));
        }
        if (retry_after && retry_after->count() > 0) not_before = std::chrono::system_clock::now() + *retry_after;
      }
      const std::string value = owner_->encode(state, attempts_, error, "", token_, priority_, not_before);
      return in_store_transaction() ? finish_in_transaction(value) : finish(value);
    }

    // Gives the item back, unless it is finished or this is a forked child's
    // copy (the parent's claim: its renewals do not run here, and its hold
    // may be locked by a thread that is not here, so it is left alone).
    void abandon() noexcept {
      if (!owner_) return;
      if (!in_owner_process()) {
        owner_ = nullptr;
        (void)hold_.release();
        return;
      }
      // Inside an open transaction the give-back is part of it; if that
      // transaction is rolled back, the item stays claimed by this (live)
      // process, unrenewed, until its lease runs out and another takes it.
      try {
        settle();
        if (owner_ && !pending()) (void)give_back("abandoned: the claim left scope without complete()");
      } catch (...) {
      }
      if (owner_) detach();
    }

    marker_claim* owner_;
    std::string key_;
    dibs::version token_;
    std::uint32_t attempts_;
    std::int32_t priority_;
    detail::process_id pid_;  // the process that made the claim
    std::unique_ptr<hold> hold_;
  };

  /// Requires: `store` outlives this object and its claims.
  explicit marker_claim(Store& store, claim_options opts = {}) : store_(store), opts_(opts) {
    if (opts_.max_attempts == 0)
      throw std::system_error(make_error_code(errc::invalid_argument), "dibs::marker_claim: max_attempts must be at least 1");
    if (opts_.lease <= std::chrono::milliseconds::zero())
      throw std::system_error(make_error_code(errc::invalid_argument), "dibs::marker_claim: lease must be positive");
  }

  /// The store the claims are kept in.
  Store& store() const noexcept { return store_; }

  /// Effects: claims `key` if it is absent, released, or held by a worker
  /// that is provably gone (see the top of this header).
  /// Returns: the claim, or nothing if the item is taken, done or failed,
  /// another worker won the race, or its record is busy (held by another
  /// process for longer than detail::try_wait: a stopped one, say).
  /// A damaged record costs its item only: try_claim returns nothing for it
  /// and reports it through claim_options::on_damaged.
  /// On a create_or_read_store (postgres_store) a fresh key is claimed in
  /// one round trip, and a key with a record costs one too (what it has
  /// comes back with the refused create); elsewhere the record is read
  /// first, then created if absent.
  std::optional<claim> try_claim(std::string_view key) {
    validate_key(key, "dibs::marker_claim::try_claim");
    try {
      return try_claim_until(key, std::chrono::steady_clock::now() + detail::try_wait);
    } catch (const std::system_error& e) {
      if (detail::timed_out(e)) return std::nullopt;
      if (e.code() != make_error_code(errc::corrupt_record)) throw;
      report_damaged(key, e.what());
      return std::nullopt;
    }
  }

  /// Returns: the state of `key`; claim_state::damaged, with `error` saying
  /// what is wrong, if its record cannot be read as a claim.
  claim_status status(std::string_view key) {
    validate_key(key, "dibs::marker_claim::status");
    try {
      const auto r = store_.read(key);
      if (!r) return {};
      return parse(key, *r);
    } catch (const std::system_error& e) {
      if (e.code() != make_error_code(errc::corrupt_record)) throw;
      claim_status s;
      s.state = claim_state::damaged;
      s.error = e.what();
      return s;
    }
  }

  /// Effects: gives back every processing claim among `keys` whose worker is
  /// provably gone (or fails it, if that was its last attempt).
  /// Returns: how many were recovered.
  template <class Keys>
  std::size_t sweep(const Keys& keys) {
    std::size_t recovered = 0;
    for (const auto& k : keys) {
      const std::string_view key = k;
      try {
        const auto until = std::chrono::steady_clock::now() + detail::try_wait;
        const auto r = detail::store_read(store_, key, until);
        if (!r) continue;
        const claim_status s = parse(key, *r);
        if (s.state != claim_state::processing || !stale(key, s)) continue;
        const auto next = s.attempts >= opts_.max_attempts ? claim_state::failed : claim_state::released;
        if (detail::store_replace(store_, key, s.version,
                                  encode(next, s.attempts, "recovered from a worker that is gone", "", 0, s.priority),
                                  until))
          ++recovered;
      } catch (const std::system_error& e) {
        if (e.code() == make_error_code(errc::corrupt_record)) report_damaged(key, e.what());
        else if (!detail::timed_out(e)) throw;  // busy: its holder is active, or stopped; not provably gone
      }
    }
    return recovered;
  }

  /// Effects: puts `key` in the queue: creates its record in state
  /// "offered" (claimable, never claimed) if it has none, for claim_next to
  /// find: not before `o.not_before`, and before items of a lower
  /// `o.priority`. Returns: false if the key already has a record (offered,
  /// claimed, done: nothing changes).
  bool offer(std::string_view key, offer_options o = {}) {
    validate_key(key, "dibs::marker_claim::offer");
    // Bounded: a producer hears of a store that is away (after a lease).
    return detail::store_create(store_, key, encode(claim_state::offered, 0, "", "", 0, o.priority, o.not_before),
                                std::chrono::steady_clock::now() + opts_.lease)
        .has_value();
  }

  /// Effects: offers every key of `keys` (a range of strings or
  /// string_views) as offer(key, o) would: in one statement or one
  /// transaction where the store has batches (dibs::batch_store:
  /// sqlite_store, postgres_store), else key by key.
  /// Returns: how many were new (a key that already has a record is left as
  /// it is).
  /// Throws: errc::invalid_argument, before anything is written, if `keys`
  /// is empty or holds more than max_batch keys, an invalid key, or a key
  /// twice.
  template <class Keys>
  std::size_t offer_n(const Keys& keys, offer_options o = {}) {
    std::vector<std::string_view> ks;
    for (const auto& k : keys) ks.emplace_back(k);
    check_batch_size(ks.size(), "dibs::marker_claim::offer_n");
    std::vector<std::string> values;
    values.reserve(ks.size());
    for (std::size_t i = 0; i < ks.size(); ++i)
      values.push_back(encode(claim_state::offered, 0, "", "", 0, o.priority, o.not_before));
    std::vector<key_value> items;
    items.reserve(ks.size());
    for (std::size_t i = 0; i < ks.size(); ++i) items.push_back({ks[i], values[i]});
    detail::check_batch(std::span<const key_value>(items), "dibs::marker_claim::offer_n");
    const auto got = detail::store_create_n(store_, std::span<const key_value>(items),
                                            std::chrono::steady_clock::now() + opts_.lease);
    return static_cast<std::size_t>(std::count_if(got.begin(), got.end(), [](const auto& v) { return v.has_value(); }));
  }

  /// Effects: completes each of `claims` (claims of this marker_claim) as
  /// claim::complete(result) would, in one statement or one transaction
  /// where the store has batches (dibs::batch_store), each checked against
  /// its own version as its own complete() would be: a claim that was taken
  /// over is never completed, and said so. Called by a thread with a
  /// transaction open on the store (transaction_aware_store), each is
  /// completed in it, as complete() does.
  /// Returns: per claim, true if it was completed, false if it had been
  /// taken over (the item is someone else's now: do not report it done).
  /// Every claim is finished when this returns or throws; if it throws (the
  /// store failed), none was completed by it for sure, and an item that was
  /// not comes back after its lease.
  /// Throws: std::logic_error if a claim is finished already, appears twice
  /// or belongs to another marker_claim; errc::invalid_argument if there are
  /// more than max_batch; std::errc::operation_not_permitted in a forked
  /// child of the worker; a failure of the store.
  std::vector<bool> complete_n(std::span<claim> claims, std::string_view result = {}) {
    if (claims.empty()) return {};
    check_batch_size(claims.size(), "dibs::marker_claim::complete_n");
    for (auto& c : claims) {
      c.check_owner_process("complete");
      c.settle();
      if (c.owner_ != this)
        throw std::logic_error(fmt::format("dibs::marker_claim::complete_n: the claim of '{}' is {}", c.key_,
                                           c.owner_ ? "of another marker_claim" : "finished already"));
      if (c.pending())
        throw std::logic_error(fmt::format("dibs::marker_claim '{}': complete after complete() or release() in the "
                                           "same open transaction",
                                           c.key_));
    }
    std::vector<bool> done(claims.size(), false);
    if constexpr (transaction_aware_store<Store>) {
      if (store_.in_transaction()) {
        // Part of the caller's transaction, claim by claim (their effects
        // are pending until it ends).
        for (std::size_t i = 0; i < claims.size(); ++i)
          done[i] = claims[i].finish_in_transaction(claims[i].completed_value(result));
        return done;
      }
    }
    // As finish() does for one: renewals stopped, then each claim's hold
    // locked (in address order: a renewal locks one at a time) while its
    // version is written on.
    std::vector<typename claim::hold*> holds;
    for (auto& c : claims) {
      c.stop_renewal();
      holds.push_back(c.hold_.get());
    }
    std::vector<std::string> values;
    values.reserve(claims.size());
    for (auto& c : claims) values.push_back(c.completed_value(result));
    for (auto& c : claims) c.owner_ = nullptr;
    auto order = holds;
    std::sort(order.begin(), order.end());
    if (std::adjacent_find(order.begin(), order.end()) != order.end())
      throw std::logic_error("dibs::marker_claim::complete_n: a claim is given twice");
    std::vector<std::unique_lock<std::mutex>> locks;
    locks.reserve(order.size());
    for (auto* h : order) locks.emplace_back(h->m);
    auto end = std::chrono::steady_clock::time_point::max();
    std::vector<replace_item> items;
    items.reserve(claims.size());
    for (std::size_t i = 0; i < claims.size(); ++i) {
      end = std::min(end, holds[i]->validity.end());
      items.push_back({claims[i].key_, holds[i]->version, values[i]});
    }
    end = std::max(end, std::chrono::steady_clock::now() + detail::try_wait);
    const auto got = detail::store_replace_n(store_, std::span<const replace_item>(items), end);
    for (std::size_t i = 0; i < claims.size(); ++i) done[i] = got[i].has_value();
    return done;
  }

  /// The most items offer_n and complete_n take at once.
  static constexpr std::size_t max_batch = 100'000;

  /// Returns: a claim on some claimable item whose key starts with `prefix`
  /// (offered or released, its not_before time come, or held by a worker
  /// that is gone), one of the highest priority, with the guarantees of
  /// try_claim; nothing if there is none.
  /// On a claim_queue_store the store finds and claims the next items itself
  /// through an index of the claimable records, so a claim costs the same
  /// whatever the number of completed items: postgres_store in one
  /// statement (by priority, then key; FOR UPDATE SKIP LOCKED over a partial
  /// index), sqlite_store in one write transaction (by priority, then key;
  /// a partial index of expressions over the record), file_store through
  /// its queue view (a directory of entries; by priority, in random order
  /// within one). Items of workers that are gone are recovered by a sweep
  /// of the processing items (which the store lists) at most every third of
  /// a lease when none is claimable.
  /// Elsewhere (shm_store, imap_store, memory_store, an adapter of your own)
  /// it reads the records of the store's keys, and tries the claimable
  /// ones, highest priority first, in random order within one: its cost
  /// grows with the number of records.
  std::optional<claim> claim_next(std::string_view prefix = {})
    requires listable_store<Store>
  {
    auto got = claim_next_n(1, prefix);
    if (got.empty()) return std::nullopt;
    return std::move(got.front());
  }

  /// Returns: claims on up to `n` distinct claimable items whose key starts
  /// with `prefix`, as claim_next would pick them (on postgres_store, all in
  /// one statement); fewer (none) if fewer are claimable. Each is a claim of
  /// its own: complete or give back each.
  /// Throws: errc::invalid_argument if `n` is 0 or above 10,000.
  std::vector<claim> claim_next_n(std::size_t n, std::string_view prefix = {})
    requires listable_store<Store>
  {
    if (n == 0 || n > 10'000)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::marker_claim::claim_next_n: n must be 1 to 10,000 (got {})", n));
    std::vector<claim> out;
    if constexpr (claim_queue_store<Store>) {
      for (int round = 0; round < 2; ++round) {
        // The statement waits for no other worker (it skips what they are
        // taking); the deadline is for a server that stopped answering.
        const auto start = std::chrono::steady_clock::now();
        const auto until = start + opts_.lease / 3;
        auto got = detail::retry_transient(until, [&] {
          return store_.take_claimable(prefix, rest_of_claim(), static_cast<std::uint32_t>(n), until);
        });
        if (!got.empty()) {
          out.reserve(got.size());
          for (auto& [k, r] : got) {
            const claim_status st = parse(k, r);
            out.push_back(claim{this, std::move(k), r.version, st.attempts, st.priority, start});
          }
          return out;
        }
        // Only processing claims can be recovered: the store lists them, so
        // an idle queue costs one statement, not a read of every item.
        if (round == 0 && !sweep_due()) break;
        if (round == 0 && sweep(store_.processing_keys(prefix)) == 0) break;
      }
      return out;
    } else {
      // The candidates, read once: claimable now (or processing, which
      // try_claim judges), highest priority first, shuffled within one.
      thread_local std::mt19937_64 rng{std::random_device{}()};
      std::vector<std::pair<std::string, record>> recs;
      if constexpr (snapshot_store<Store>) {
        recs = store_.records(prefix);
      } else {
        for (auto& k : store_.keys(prefix)) {
          try {
            if (auto r = detail::store_read(store_, k, std::chrono::steady_clock::now() + detail::try_wait))
              recs.emplace_back(std::move(k), std::move(*r));
          } catch (const std::system_error& e) {
            if (!detail::timed_out(e)) throw;  // busy: skipped, as try_claim would
          }
        }
      }
      std::shuffle(recs.begin(), recs.end(), rng);
      std::vector<std::pair<std::int32_t, std::string>> order;
      const auto now = std::chrono::system_clock::now();
      for (auto& [k, r] : recs) {
        claim_status st;
        try {
          st = parse(k, r);
        } catch (const std::system_error& e) {
          if (e.code() != make_error_code(errc::corrupt_record)) throw;
          report_damaged(k, e.what());
          continue;
        }
        const bool waiting = st.state == claim_state::offered || st.state == claim_state::released;
        if ((waiting && st.not_before <= now) || st.state == claim_state::processing)
          order.emplace_back(st.priority, std::move(k));
      }
      std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      for (const auto& [p, k] : order) {
        if (auto c = try_claim(k)) out.push_back(std::move(*c));
        if (out.size() == n) break;
      }
      return out;
    }
  }

  /// Returns: a claim on one of `keys` (any range of strings or
  /// string_views), tried in random order so that workers given the same set
  /// spread over it, with the guarantees of try_claim; nothing if none of
  /// them can be claimed now. For a queue whose keys are not known, see
  /// claim_next.
  template <class Keys>
  std::optional<claim> claim_any(const Keys& keys) {
    std::vector<std::string_view> order;
    for (const auto& k : keys) order.emplace_back(k);
    thread_local std::mt19937_64 rng{std::random_device{}()};
    std::shuffle(order.begin(), order.end(), rng);
    for (const auto k : order)
      if (auto c = try_claim(k)) return c;
    return std::nullopt;
  }

  /// Effects: sweep() over every key that starts with `prefix`.
  /// Returns: how many claims were recovered.
  std::size_t sweep_all(std::string_view prefix = {})
    requires listable_store<Store>
  {
    return sweep(store_.keys(prefix));
  }

  /// Returns: every item whose key starts with `prefix` and that has a
  /// record, with its status (owner, attempts, when it last changed; a
  /// damaged one as claim_state::damaged), in key order. It reads each
  /// record once, without locking anything: a snapshot item by item.
  std::vector<claim_item> list(std::string_view prefix = {})
    requires listable_store<Store>
  {
    std::vector<claim_item> out;
    if constexpr (snapshot_store<Store>) {
      // All at once; a key the snapshot left out because its record is
      // damaged is read by itself, to be listed as damaged.
      std::set<std::string> have;
      for (auto& [k, r] : store_.records(prefix)) {
        have.insert(k);
        try {
          out.push_back({k, parse(k, r)});
        } catch (const std::system_error& e) {
          // A record that is not a claim (a store may hand those out too).
          if (e.code() != make_error_code(errc::corrupt_record)) throw;
          claim_status st;
          st.state = claim_state::damaged;
          st.error = e.what();
          out.push_back({k, std::move(st)});
        }
      }
      for (auto& k : store_.keys(prefix))
        if (!have.count(k))
          if (auto st = status(k); st.state != claim_state::absent) out.push_back({std::move(k), std::move(st)});
      std::sort(out.begin(), out.end(), [](const claim_item& a, const claim_item& b) { return a.key < b.key; });
      return out;
    }
    auto keys = store_.keys(prefix);
    std::sort(keys.begin(), keys.end());
    out.reserve(keys.size());
    for (auto& k : keys) {
      claim_status st = status(k);
      if (st.state != claim_state::absent) out.push_back({std::move(k), std::move(st)});
    }
    return out;
  }

  /// Effects: forgets every completed or failed item whose key starts with
  /// `prefix`, that last changed more than `age` ago, and for which
  /// `source_gone(key)` returns true, by erasing its record (a compare-and-set:
  /// an item that changed meanwhile is kept).
  /// A purged key reads as absent, so it is claimable again: the store keeps
  /// no proof that it was done. `source_gone` is where the caller vouches that
  /// the item can never come again (its message expunged from the mailbox,
  /// its job row deleted); return false to keep the record. The store keeps
  /// the key's version, so the fencing tokens of a later claim of the same
  /// key still grow. What a purge frees depends on the store: the record's
  /// value everywhere, its slot in shm_store and memory_store; file_store
  /// keeps a small erased file per key, sqlite_store a row with value NULL.
  /// A record written by dibs 0.1 says not when it changed: never purged.
  /// Returns: how many items were forgotten.
  template <class SourceGone>
  std::size_t purge(std::chrono::milliseconds age, SourceGone source_gone, std::string_view prefix = {})
    requires listable_store<Store> && std::is_invocable_r_v<bool, SourceGone&, std::string_view>
  {
    const auto cutoff = std::chrono::system_clock::now() - age;
    std::size_t purged = 0;
    for (const auto& k : store_.keys(prefix)) {
      try {
        const auto until = std::chrono::steady_clock::now() + detail::try_wait;
        const auto r = detail::store_read(store_, k, until);
        if (!r) continue;
        const claim_status st = parse(k, *r);
        if (st.state != claim_state::completed && st.state != claim_state::failed) continue;
        if (st.changed == std::chrono::system_clock::time_point{} || st.changed > cutoff) continue;
        if (!source_gone(std::string_view(k))) continue;
        if (detail::store_erase(store_, k, st.version, until)) ++purged;
      } catch (const std::system_error& e) {
        if (e.code() == make_error_code(errc::corrupt_record)) report_damaged(k, e.what());
        else if (!detail::timed_out(e)) throw;  // busy: kept, for the next purge
      }
    }
    return purged;
  }

private:
  static void check_batch_size(std::size_t n, std::string_view call) {
    if (n == 0 || n > max_batch)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("{}: a batch holds 1 to {} items (got {})", call, max_batch, n));
  }

  // Returns: true at most every third of a lease (claim_next's sweeps).
  bool sweep_due() {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard g{m_};
    if (now - last_sweep_ < opts_.lease / 3) return false;
    last_sweep_ = now;
    return true;
  }

  void notify_lost(std::string_view key) const {
    if (opts_.on_lost) opts_.on_lost(key);
  }

  void report_damaged(std::string_view key, std::string_view what) {
    if (opts_.on_damaged) return opts_.on_damaged(key, what);
    {
      std::lock_guard g{m_};
      if (!damaged_reported_.emplace(key).second) return;
    }
    fmt::print(stderr, "dibs::marker_claim: skipping item '{}', whose record is damaged: {}\n", key, what);
  }

  std::optional<claim> try_claim_until(std::string_view key, dibs::time_limit until) {
    std::optional<record> r;
    if constexpr (create_or_read_store<Store>) {
      // One round trip for a fresh key, and one for a key with a record
      // (postgres_store): the create is tried first, and what the key has
      // comes back if it has something.
      const auto start = std::chrono::steady_clock::now();  // a claim is valid from before the call that makes it
      auto got = detail::store_create_or_read(store_, key, encode(claim_state::processing, 1, "", "", 0), until);
      if (got.created) return claim{this, std::string(key), *got.created, 1, 0, start};
      if (!got.existing) return std::nullopt;  // another worker created it just now
      r = std::move(got.existing);
    } else {
      if constexpr (create_before_read_store<Store>) {
        // The create alone claims a fresh item, and never changes a record
        // that is there. It is tried while the last item met was fresh; a
        // failed one costs what the claim of a taken item must not cost under
        // contention (sqlite_store: the write lock that every writer queues
        // for), so after it the items are read first until a read finds one
        // fresh again.
        if (create_first_.load(std::memory_order_relaxed)) {
          const auto start = std::chrono::steady_clock::now();
          if (auto v = detail::store_create(store_, key, encode(claim_state::processing, 1, "", "", 0), until))
            return claim{this, std::string(key), *v, 1, 0, start};
          create_first_.store(false, std::memory_order_relaxed);
        }
      }
      r = detail::store_read(store_, key, until);
      if (!r) {
        if constexpr (create_before_read_store<Store>) create_first_.store(true, std::memory_order_relaxed);
        const auto start = std::chrono::steady_clock::now();  // a claim is valid from before the call that makes it
        if (auto v = detail::store_create(store_, key, encode(claim_state::processing, 1, "", "", 0), until))
          return claim{this, std::string(key), *v, 1, 0, start};
        return std::nullopt;
      }
    }
    const claim_status s = parse(key, *r);
    switch (s.state) {
      case claim_state::completed:
      case claim_state::failed:
      case claim_state::absent:
      case claim_state::damaged:
        return std::nullopt;
      case claim_state::offered:
      case claim_state::released:
        if (s.not_before > std::chrono::system_clock::now()) return std::nullopt;  // backing off, or scheduled
        return take(key, s, until);
      case claim_state::processing:
        if (!stale(key, s)) return std::nullopt;
        if (s.attempts >= opts_.max_attempts) {
          (void)detail::store_replace(store_, key, s.version,
                                      encode(claim_state::failed, s.attempts, "its worker died on the last attempt", "", 0,
                                             s.priority),
                                      until);
          return std::nullopt;
        }
        return take(key, s, until);
    }
    return std::nullopt;
  }

  std::optional<claim> take(std::string_view key, const claim_status& s, dibs::time_limit until) {
    const std::uint32_t attempts = s.attempts + 1;
    const auto start = std::chrono::steady_clock::now();
    if (auto v = detail::store_replace(store_, key, s.version,
                                       encode(claim_state::processing, attempts, "", "", 0, s.priority), until)) {
      {
        std::lock_guard g{m_};
        seen_.erase(std::string(key));
      }
      return claim{this, std::string(key), *v, attempts, s.priority, start};
    }
    return std::nullopt;
  }

  bool stale(std::string_view key, const claim_status& s) {
    if (s.owner && detail::provably_dead(*s.owner)) return true;
    if constexpr (store_with_clock<Store>) {
      // The store's one clock: last written (renewed) at least a lease ago,
      // and a quarter more for clocks that run at different rates.
      const auto until = std::chrono::steady_clock::now() + detail::try_wait;
      const auto a = detail::retry_transient(until, [&] { return store_.read_aged(key, until); });
      const auto lease = s.owner ? s.owner->lease : opts_.lease;
      return a && a->record.version == s.version && a->age >= lease + detail::clock_margin(lease);
    }
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard g{m_};
    auto [it, fresh] = seen_.try_emplace(std::string(key), s.version, now);
    if (fresh || it->second.first != s.version) {
      it->second = {s.version, now};
      return false;
    }
    return now - it->second.second >= (s.owner ? s.owner->lease : opts_.lease);
  }

  static std::string one_line(std::string_view text) {
    std::string out;
    for (char c : text) out += c == '\n' || c == '\r' ? ' ' : c;
    return out;
  }

  // The record: its head by the codec (detail/claim_record.hpp, which the
  // stores' queue indexes read too), then the rest (append_rest).
  // Appended piece by piece into one string: every claim and completion
  // makes one, and fmt's parsing and the temporaries were a tenth of a
  // claim's instructions over sqlite_store.
  std::string encode(claim_state s, std::uint32_t attempts, std::string_view error, std::string_view result,
                     dibs::version token, std::int32_t priority = 0,
                     std::chrono::system_clock::time_point not_before = {}) const {
    std::string v;
    v.reserve(s == claim_state::processing ? 384 : 128 + error.size() + result.size());
    std::optional<std::int64_t> nb;
    // Rounded up: never claimable before the time asked for.
    if (not_before != std::chrono::system_clock::time_point{})
      nb = std::chrono::ceil<std::chrono::milliseconds>(not_before.time_since_epoch()).count();
    detail::claim_record::append_head(v, s, attempts, priority, nb);
    append_rest(v, s, error, result, token);
    return v;
  }
  // What claim_next's statement on a claim_queue_store writes after the
  // lines it writes itself (the attempt counted, the priority kept).
  std::string rest_of_claim() const {
    std::string v;
    append_rest(v, claim_state::processing, "", "", 0);
    return v;
  }
  // Appends what follows the attempts, priority and not_before lines.
  void append_rest(std::string& v, claim_state s, std::string_view error, std::string_view result,
                   dibs::version token) const {
    v += "changed ";
    detail::append_number(v, detail::wall_ms());
    v += '\n';
    detail::append_nonce(v);
    if (token) {
      v += "token ";
      detail::append_number(v, token);
      v += '\n';
    }
    if (!error.empty()) v += "error " + one_line(error) + '\n';
    if (!result.empty()) v += "result " + one_line(result) + '\n';
    if (s == claim_state::processing) v += detail::this_process_lines(opts_.lease);
  }

  static claim_status parse(std::string_view key, const record& r) {
    auto bad = [&](std::string_view why) {
      return std::system_error(make_error_code(errc::corrupt_record),
                               fmt::format("dibs::marker_claim '{}': the record is not a dibs claim ({})", key, why));
    };
    const auto head = detail::claim_record::parse_head(r.value);
    if (!head) throw bad("it does not start 'dibs-claim 1'");
    claim_status s;
    s.version = r.version;
    if (head->state_word.empty()) throw bad("no state on its second line");
    if (head->state == claim_state::damaged) throw bad(fmt::format("unknown state '{}'", head->state_word));
    s.state = head->state;
    if (!head->attempts) throw bad("no attempt count on its third line");
    s.attempts = *head->attempts;
    if (head->priority >= INT32_MIN && head->priority <= INT32_MAX)
      s.priority = static_cast<std::int32_t>(head->priority);
    if (head->not_before_ms)
      s.not_before = std::chrono::system_clock::time_point{std::chrono::milliseconds{*head->not_before_ms}};
    if (auto ms = detail::number_field<std::int64_t>(r.value, "changed"))
      s.changed = std::chrono::system_clock::time_point{std::chrono::milliseconds{*ms}};
    if (auto e = detail::field(r.value, "error")) s.error = std::string(*e);
    if (auto res = detail::field(r.value, "result")) s.result = std::string(*res);
    if (auto t = detail::number_field<dibs::version>(r.value, "token")) s.token = *t;
    if (s.state == claim_state::processing) s.owner = detail::parse_owner(r.value);
    return s;
  }

  Store& store_;
  claim_options opts_;
  std::mutex m_;
  // try_claim's order over a create_before_read_store: create first (true)
  // or read first. A guess from the last item met; either order is correct.
  std::atomic<bool> create_first_{true};
  std::map<std::string, std::pair<dibs::version, std::chrono::steady_clock::time_point>, std::less<>> seen_;
  std::set<std::string, std::less<>> damaged_reported_;
  std::chrono::steady_clock::time_point last_sweep_{};
};

}  // namespace dibs

template <>
struct fmt::formatter<dibs::claim_status, char> : dibs::detail::name_formatter {
  template <class Context>
  auto format(const dibs::claim_status& s, Context& ctx) const {
    return write(dibs::to_string(s), ctx);
  }
};
