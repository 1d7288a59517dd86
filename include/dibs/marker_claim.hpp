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
//   processing  claimed: owner (host, boot, pid, start time), lease, attempts
//   released    given back (scope left without complete(), or an error); attempts kept
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
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include <dibs/detail/owner.hpp>
#include <dibs/detail/posix.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct claim_options {
  /// How long a claim whose worker stops renewing is respected by others.
  std::chrono::milliseconds lease{60'000};
  /// Claims of an item before it is failed (the last error kept).
  std::uint32_t max_attempts = 5;
};

enum class claim_state { absent, processing, released, completed, failed };

inline const char* to_string(claim_state s) noexcept {
  switch (s) {
    case claim_state::absent: return "absent";
    case claim_state::processing: return "processing";
    case claim_state::released: return "released";
    case claim_state::completed: return "completed";
    case claim_state::failed: return "failed";
  }
  return "?";
}

/// What status() reports of an item.
struct claim_status {
  claim_state state = claim_state::absent;
  std::uint32_t attempts = 0;
  std::string error;              ///< the last error given back, if any
  std::string result;             ///< what complete() recorded
  dibs::version version = 0;      ///< the record's version (0 if absent)
  std::optional<detail::owner_id> owner;  ///< the worker, while processing
};

template <shared_store Store>
class marker_claim {
public:
  /// An item held by this worker. Leaving scope without complete() gives the
  /// item back (or fails it after max_attempts); errors there are swallowed.
  class claim {
  public:
    claim(claim&& o) noexcept
        : owner_(std::exchange(o.owner_, nullptr)), key_(std::move(o.key_)), version_(o.version_), token_(o.token_),
          attempts_(o.attempts_), pid_(o.pid_) {}
    claim& operator=(claim&&) = delete;
    claim(const claim&) = delete;
    ~claim() {
      if (!owner_ || !in_owner_process()) return;  // a forked child's copy: the parent's claim
      try {
        (void)give_back("abandoned: the claim left scope without complete()");
      } catch (...) {
      }
    }

    /// Effects: marks the item completed, keeping `result` as proof.
    /// Throws: std::system_error(errc::lease_lost) if the claim was taken
    /// over (the item is then someone else's: do not report it done);
    /// std::errc::operation_not_permitted in a forked child of the worker.
    void complete(std::string_view result = {}) {
      check_owner_process("complete");
      finish(owner_->encode(claim_state::completed, attempts_, "", result, token_), "complete");
    }
    /// Effects: gives the item back with `error` recorded; it is failed if
    /// this was its last attempt. Returns: false if the claim was taken over.
    /// Throws: std::errc::operation_not_permitted in a forked child of the worker.
    bool release(std::string_view error = "released") {
      check_owner_process("release");
      return give_back(error);
    }
    /// Effects: renews the lease. Returns: false if the claim was taken over.
    /// Throws: std::errc::operation_not_permitted in a forked child of the worker.
    bool renew() {
      if (!owner_) return false;
      check_owner_process("renew");
      auto v = owner_->store_.replace(key_, version_, owner_->encode(claim_state::processing, attempts_, "", "", token_));
      if (v) version_ = *v;
      return v.has_value();
    }

    /// The fencing token of this claim: larger than that of every earlier claim of the item.
    dibs::version token() const noexcept { return token_; }
    std::uint32_t attempts() const noexcept { return attempts_; }
    const std::string& key() const noexcept { return key_; }

  private:
    friend class marker_claim;
    claim(marker_claim* owner, std::string key, dibs::version v, std::uint32_t attempts)
        : owner_(owner), key_(std::move(key)), version_(v), token_(v), attempts_(attempts), pid_(detail::current_pid()) {}

    bool in_owner_process() const noexcept { return pid_ == detail::current_pid(); }
    void check_owner_process(const char* what) const {
      if (owner_ && !in_owner_process())
        throw std::system_error(std::make_error_code(std::errc::operation_not_permitted),
                                fmt::format("dibs::marker_claim '{}': cannot {} in a forked child: the claim (token {}) "
                                            "belongs to process {}, which made it; only it may finish the item",
                                            key_, what, token_, pid_));
    }

    bool give_back(std::string_view error) {
      if (!owner_) return false;
      const auto state = attempts_ >= owner_->opts_.max_attempts ? claim_state::failed : claim_state::released;
      auto* o = std::exchange(owner_, nullptr);
      return o->store_.replace(key_, version_, o->encode(state, attempts_, error, "", token_)).has_value();
    }
    void finish(const std::string& value, const char* what) {
      if (!owner_) throw std::logic_error(fmt::format("dibs::marker_claim '{}': {} on a finished claim", key_, what));
      auto* o = std::exchange(owner_, nullptr);
      if (!o->store_.replace(key_, version_, value))
        throw std::system_error(make_error_code(errc::lease_lost),
                                fmt::format("dibs::marker_claim '{}': cannot {}: the claim (token {}) was taken over",
                                            key_, what, token_));
    }

    marker_claim* owner_;
    std::string key_;
    dibs::version version_;
    dibs::version token_;
    std::uint32_t attempts_;
    pid_t pid_;  // the process that made the claim
  };

  /// Requires: `store` outlives this object and its claims.
  explicit marker_claim(Store& store, claim_options opts = {}) : store_(store), opts_(opts) {
    if (opts_.max_attempts == 0)
      throw std::system_error(make_error_code(errc::invalid_argument), "dibs::marker_claim: max_attempts must be at least 1");
    if (opts_.lease <= std::chrono::milliseconds::zero())
      throw std::system_error(make_error_code(errc::invalid_argument), "dibs::marker_claim: lease must be positive");
  }

  /// Effects: claims `key` if it is absent, released, or held by a worker
  /// that is provably gone (see the top of this header).
  /// Returns: the claim, or nothing if the item is taken, done or failed,
  /// another worker won the race, or its record is busy (held by another
  /// process for longer than detail::try_wait: a stopped one, say).
  std::optional<claim> try_claim(std::string_view key) {
    try {
      return try_claim_until(key, std::chrono::steady_clock::now() + detail::try_wait);
    } catch (const std::system_error& e) {
      if (detail::timed_out(e)) return std::nullopt;
      throw;
    }
  }

  /// Returns: the state of `key`. Throws: errc::corrupt_record if its record
  /// is not a claim.
  claim_status status(std::string_view key) {
    const auto r = store_.read(key);
    if (!r) return {};
    return parse(key, *r);
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
                                  encode(next, s.attempts, "recovered from a worker that is gone", "", 0), until))
          ++recovered;
      } catch (const std::system_error& e) {
        if (!detail::timed_out(e)) throw;  // busy: its holder is active, or stopped; not provably gone
      }
    }
    return recovered;
  }

private:
  std::optional<claim> try_claim_until(std::string_view key, dibs::time_limit until) {
    const auto r = detail::store_read(store_, key, until);
    if (!r) {
      if (auto v = detail::store_create(store_, key, encode(claim_state::processing, 1, "", "", 0), until))
        return claim{this, std::string(key), *v, 1};
      return std::nullopt;
    }
    const claim_status s = parse(key, *r);
    switch (s.state) {
      case claim_state::completed:
      case claim_state::failed:
      case claim_state::absent:
        return std::nullopt;
      case claim_state::released:
        return take(key, s, until);
      case claim_state::processing:
        if (!stale(key, s)) return std::nullopt;
        if (s.attempts >= opts_.max_attempts) {
          (void)detail::store_replace(store_, key, s.version,
                                      encode(claim_state::failed, s.attempts, "its worker died on the last attempt", "", 0),
                                      until);
          return std::nullopt;
        }
        return take(key, s, until);
    }
    return std::nullopt;
  }

  std::optional<claim> take(std::string_view key, const claim_status& s, dibs::time_limit until) {
    const std::uint32_t attempts = s.attempts + 1;
    if (auto v = detail::store_replace(store_, key, s.version, encode(claim_state::processing, attempts, "", "", 0), until)) {
      std::lock_guard g{m_};
      seen_.erase(std::string(key));
      return claim{this, std::string(key), *v, attempts};
    }
    return std::nullopt;
  }

  bool stale(std::string_view key, const claim_status& s) {
    if (s.owner && detail::provably_dead(*s.owner)) return true;
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

  std::string encode(claim_state s, std::uint32_t attempts, std::string_view error, std::string_view result,
                     dibs::version token) const {
    std::string v = fmt::format("dibs-claim 1\nstate {}\nattempts {}\n", to_string(s), attempts);
    if (token) v += fmt::format("token {}\n", token);
    if (!error.empty()) v += fmt::format("error {}\n", one_line(error));
    if (!result.empty()) v += fmt::format("result {}\n", one_line(result));
    if (s == claim_state::processing) v += detail::format_owner(detail::this_process(opts_.lease));
    return v;
  }

  static claim_status parse(std::string_view key, const record& r) {
    auto bad = [&](std::string_view why) {
      return std::system_error(make_error_code(errc::corrupt_record),
                               fmt::format("dibs::marker_claim '{}': the record is not a dibs claim ({})", key, why));
    };
    if (std::string_view(r.value).substr(0, 13) != "dibs-claim 1\n") throw bad("it does not start 'dibs-claim 1'");
    claim_status s;
    s.version = r.version;
    const auto state = detail::field(r.value, "state");
    if (!state) throw bad("no state");
    if (*state == "processing") s.state = claim_state::processing;
    else if (*state == "released") s.state = claim_state::released;
    else if (*state == "completed") s.state = claim_state::completed;
    else if (*state == "failed") s.state = claim_state::failed;
    else throw bad(fmt::format("unknown state '{}'", *state));
    const auto attempts = detail::number_field<std::uint32_t>(r.value, "attempts");
    if (!attempts) throw bad("no attempt count");
    s.attempts = *attempts;
    if (auto e = detail::field(r.value, "error")) s.error = std::string(*e);
    if (auto res = detail::field(r.value, "result")) s.result = std::string(*res);
    if (s.state == claim_state::processing) s.owner = detail::parse_owner(r.value);
    return s;
  }

  Store& store_;
  claim_options opts_;
  std::mutex m_;
  std::map<std::string, std::pair<dibs::version, std::chrono::steady_clock::time_point>, std::less<>> seen_;
};

}  // namespace dibs
