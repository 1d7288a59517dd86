// dibs/once.hpp: a scheduled job that every host runs (each host's cron,
// a timer in each replica) but that must run once per slot of its
// schedule: the nightly export, the hourly cleanup.
//
//   dibs::postgres_store store{"host=db1 dbname=jobs"};
//   dibs::once<dibs::postgres_store> nightly{store, "nightly-export", std::chrono::hours{24}};
//   nightly.run([](const auto& slot) { export_day(slot.id(), slot.token()); });
//
// Each slot is a claim of marker_claim (<dibs/marker_claim.hpp>) on a key of
// its own, so the claim's rules hold for it: exactly one process runs it at
// a time (the claim's compare-and-set), its run is renewed while it runs, a
// run whose process died is taken over only on proof (its pid gone on the
// same host; or its claim left unrenewed for a lease), every run has a
// fencing token larger than the slot's earlier runs', and a slot that was
// completed is never run again: the slot's record says so for as long as it
// is kept (options::keep), and a slot older than that is refused
// (outcome::too_late), whatever the clocks say.
//
// Slots. A periodic schedule (a period P) numbers time in slots of P from
// the Unix epoch, by the clock of options::clock: by default the store's
// own where it has one (store_with_wall_clock: postgres_store's is the
// server's, so hosts whose clocks differ agree), else this host's system
// clock. Slot k starts at k * P. A slot's id is its start, in UTC
// ("2026-12-06T15:00:00Z", with milliseconds if P is not whole seconds).
// run_slot(id, fn) runs a slot the caller names (a date, a batch) instead.
// By the hosts' own clocks, hosts whose clocks differ run a slot early or
// late by the difference, never twice: whoever reaches it first runs it,
// the others find it done.
//
// While another process runs the slot, run() stands by (options::standby,
// by default until the slot's end): if that run's process dies, this one
// takes the slot over and runs it again (attempt 2, the last error kept);
// if it completes, run() returns outcome::done. A slot whose run died after
// its end is finished by the first run() of the next slot (on proof that
// the run's process is gone) before that slot is run. A run whose fn throws gives
// the slot back with the exception's message as its error, and a process
// standing by runs it again, up to options::claims.max_attempts runs of the
// slot in all; then the slot is failed.
//
// Keys (what a store holds for the schedule NAME):
//   dibs-once:NAME          the schedule's record: its period, its first slot
//                           and the newest slot any process started
//   dibs-once:NAME/SLOT     slot SLOT: a marker_claim record (completed: the
//                           result names who ran it, when, how long)
// NAME may not contain '/' (so no NAME's slot keys are another's).
//
// Missed slots. A slot no process ran (every host down through it) has no
// record; recent() shows it as missed. options::catch_up says what run()
// does about the latest of them: nothing (skip, the default), or run it
// first (latest), marked caught_up, and then the current slot.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/detail/owner.hpp>
#include <dibs/error.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/store.hpp>

namespace dibs {

/// What once::run does about missed slots (slots no process ran).
enum class catch_up {
  skip,    ///< nothing: a missed slot stays missed (recent() shows it)
  latest,  ///< the latest missed slot since the newest one run is run first, then the current one
};

struct once_options {
  /// The claims of the slots: the lease of a run (renewed while it runs),
  /// how many runs a slot gets in all (a run that threw, or whose process
  /// died, is one), and no backoff between them (a process standing by
  /// runs a given-back slot at once).
  claim_options claims = [] {
    claim_options c;
    c.max_attempts = 3;
    c.retry_backoff = std::nullopt;
    return c;
  }();
  /// How long run() stands by while another process runs the slot (to take
  /// it over if that process dies, or to learn its outcome). nullopt: until
  /// the slot's end (periodic), for as long as the run goes (run_slot).
  /// Zero: not at all (outcome::taken at once).
  std::optional<std::chrono::milliseconds> standby{};
  /// How many past slots' records are kept (periodic schedules): slots more
  /// than `keep` before the newest one run are forgotten, and run() refuses
  /// them (outcome::too_late). Also the most a host's clock may be behind
  /// the others' and still find its slots done rather than too late.
  std::uint32_t keep = 1000;
  /// What run() does about the latest missed slot.
  catch_up missed = catch_up::skip;
  /// The clock slots are numbered by. Unset: the store's (now(), one round
  /// trip a reading) if it is a store_with_wall_clock, else
  /// std::chrono::system_clock::now.
  std::function<std::chrono::system_clock::time_point()> clock{};
};

/// How a call of once::run or once::run_slot ended.
enum class once_outcome {
  ran,       ///< fn ran here and returned: the slot is completed
  done,      ///< another process completed the slot (before, or while this one stood by)
  taken,     ///< another process is running the slot, and the standby ended first
  failed,    ///< the slot failed for good: its runs ran out (here or elsewhere); error says why
  too_late,  ///< the slot is older than the records kept (options::keep): never run again
};

inline const char* to_string(once_outcome o) {
  switch (o) {
    case once_outcome::ran: return "ran";
    case once_outcome::done: return "done";
    case once_outcome::taken: return "taken";
    case once_outcome::failed: return "failed";
    case once_outcome::too_late: return "too late";
  }
  return "?";
}

struct once_result {
  once_outcome outcome = once_outcome::taken;
  std::string slot;              ///< the slot's id
  std::uint32_t attempt = 0;     ///< ran: which run of the slot this was (1: the first)
  dibs::version token = 0;       ///< ran: the run's fencing token
  std::string error;             ///< failed: the slot's last error
  bool caught_up = false;        ///< ran: a missed slot, run late (catch_up::latest)
};

/// One slot of a schedule as once::recent() shows it.
struct once_slot_status {
  enum class state {
    completed,  ///< ran to success: result says who ran it, when, how long
    failed,     ///< its runs ran out: error says the last one's error
    running,    ///< a process runs it now (owner)
    interrupted,  ///< its run's process is provably gone, and no run took the slot over (yet)
    retrying,   ///< given back after a run that threw or died; error says why
    missed,     ///< past, and no process ran it
    due,        ///< the current slot, not started yet
  };
  std::string slot;
  state st = state::missed;
  std::uint32_t attempts = 0;
  std::string result;
  std::string error;
  std::optional<owner_info> owner;  ///< running, interrupted: whose run
  dibs::version token = 0;          ///< completed, failed: the token of the run that ended it
};

inline const char* to_string(once_slot_status::state s) {
  using S = once_slot_status::state;
  switch (s) {
    case S::completed: return "completed";
    case S::failed: return "failed";
    case S::running: return "running";
    case S::interrupted: return "interrupted";
    case S::retrying: return "retrying";
    case S::missed: return "missed";
    case S::due: return "due";
  }
  return "?";
}

namespace detail {

inline constexpr std::string_view once_magic = "dibs-once 1\n";
inline constexpr std::string_view once_prefix = "dibs-once:";

struct once_config {
  std::int64_t period_ms = 0;
  std::int64_t first = 0;                // the first slot (when the schedule was made)
  std::optional<std::int64_t> newest{};  // the newest slot any process started
};

inline std::string format_once(const once_config& c) {
  return fmt::format("{}period {}\nfirst {}\nnewest {}\n", once_magic, c.period_ms, c.first,
                     c.newest ? std::to_string(*c.newest) : std::string{"-"});
}
inline std::optional<once_config> parse_once(std::string_view text) {
  if (text.substr(0, once_magic.size()) != once_magic) return std::nullopt;
  once_config c;
  const auto p = number_field<std::int64_t>(text, "period");
  const auto f = number_field<std::int64_t>(text, "first");
  const auto n = field(text, "newest");
  if (!p || !f || !n || *p < 0) return std::nullopt;
  c.period_ms = *p;
  c.first = *f;
  if (*n != "-") {
    const auto v = number_field<std::int64_t>(text, "newest");
    if (!v) return std::nullopt;
    c.newest = *v;
  }
  return c;
}

// "2026-12-06T15:00:00Z" (with ".123" before the Z if `ms`), UTC.
inline std::string utc_id(std::chrono::system_clock::time_point t, bool ms) {
  using namespace std::chrono;
  const auto total = duration_cast<milliseconds>(t.time_since_epoch()).count();
  const auto day = floor<days>(sys_time<milliseconds>{milliseconds{total}});
  const year_month_day ymd{day};
  auto in_day = milliseconds{total} - day.time_since_epoch();
  const auto h = duration_cast<hours>(in_day);
  in_day -= h;
  const auto m = duration_cast<minutes>(in_day);
  in_day -= m;
  const auto s = duration_cast<seconds>(in_day);
  in_day -= s;
  std::string out =
      fmt::format("{}-{}-{}T{}:{}:{}", detail::padded(int(ymd.year()), 4), detail::padded(unsigned(ymd.month()), 2),
                  detail::padded(unsigned(ymd.day()), 2), detail::padded(h.count(), 2), detail::padded(m.count(), 2),
                  detail::padded(s.count(), 2));
  if (ms) {
    out += '.';
    out += detail::padded(in_day.count(), 3);
  }
  return out + "Z";
}

}  // namespace detail

template <shared_store Store>
  requires listable_store<Store>
class once {
public:
  /// What fn is given: the slot it runs, and this run's claim.
  class slot {
  public:
    /// The slot's id: its start in UTC, or the caller's name (run_slot).
    const std::string& id() const noexcept { return id_; }
    /// Periodic schedules: when the slot starts (by options::clock).
    std::optional<std::chrono::system_clock::time_point> start() const noexcept { return start_; }
    /// Which run of the slot this is: 1 for the first; 2 and up after a
    /// run that threw or whose process died.
    std::uint32_t attempt() const noexcept { return claim_->attempts(); }
    /// This run's fencing token: larger than every earlier run's of the
    /// slot. Write it along with the job's effects, and refuse older ones.
    dibs::version token() const noexcept { return claim_->token(); }
    /// True once this run's claim was lost (its lease ran out unrenewed, or
    /// another process took the slot over): stop, the slot is not yours.
    bool lost() const noexcept { return claim_->lost(); }
    /// True for a missed slot run late (catch_up::latest).
    bool caught_up() const noexcept { return caught_up_; }

  private:
    friend class once;
    slot(std::string id, std::optional<std::chrono::system_clock::time_point> start,
         const typename marker_claim<Store>::claim* c, bool caught_up)
        : id_(std::move(id)), start_(start), claim_(c), caught_up_(caught_up) {}
    std::string id_;
    std::optional<std::chrono::system_clock::time_point> start_;
    const typename marker_claim<Store>::claim* claim_;
    bool caught_up_;
  };

  /// The longest name: a slot's key adds the prefix, '/' and the slot.
  static constexpr std::size_t max_name_size = 512;
  static constexpr std::size_t max_slot_size = 256;

  /// Requires: `store` outlives this object.
  /// Effects: opens the schedule `name` of `store` with slots of `period`,
  /// making its record if it has none.
  /// Throws: errc::invalid_argument, writing nothing, for an empty name, one
  /// with '/' or longer than max_name_size, a period under 1 ms, keep 0,
  /// and if the schedule exists with another period (the message says
  /// which); errc::corrupt_record if its key holds something else; as the
  /// store's read and create.
  once(Store& store, std::string name, std::chrono::milliseconds period, once_options opts = {})
      : once(store, std::move(name), period, std::move(opts), true) {}

  /// Effects: opens the schedule `name` of `store` for slots the caller
  /// names only (run_slot; no period: run() and recent() are refused).
  /// Throws: as the constructor above; errc::invalid_argument if the
  /// schedule exists with a period.
  once(Store& store, std::string name, once_options opts = {})
      : once(store, std::move(name), std::chrono::milliseconds{0}, std::move(opts), false) {}

private:
  once(Store& store, std::string name, std::chrono::milliseconds period, once_options opts, bool periodic)
      : claims_(store, opts.claims), name_(std::move(name)), period_(period), opts_(std::move(opts)) {
    if (name_.empty() || name_.find('/') != std::string::npos || name_.size() > max_name_size)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::once: invalid name '{}': a schedule's name is 1 to {} bytes, without "
                                          "'/'",
                                          detail::show_key(name_), max_name_size));
    if (periodic && period_.count() < 1)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::once '{}': the period must be at least 1 ms (it is {} ms)",
                                          detail::show_key(name_), period_.count()));
    if (opts_.keep == 0)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::once '{}': keep must be at least 1 slot", detail::show_key(name_)));
    if (!opts_.clock) {
      if constexpr (store_with_wall_clock<Store>)
        opts_.clock = [&store] { return store.now(dibs::time_limit::max()); };
      else
        opts_.clock = [] { return std::chrono::system_clock::now(); };
    }
    key_ = std::string(detail::once_prefix) + name_;
    for (;;) {
      if (const auto r = detail::store_read(store, key_, dibs::time_limit::max())) {
        const auto c = parse(*r);
        if (c.period_ms != period_.count()) {
          const auto said = [](std::int64_t ms) {
            return ms == 0 ? std::string{"no period (named slots only)"} : fmt::format("a period of {} ms", ms);
          };
          throw std::system_error(
              make_error_code(errc::invalid_argument),
              fmt::format("dibs::once '{}': opened with {}, but the schedule has {} (its record '{}' says so): "
                          "every process of a schedule gives the same period; for another, use another name",
                          detail::show_key(name_), said(period_.count()), said(c.period_ms), detail::show_key(key_)));
        }
        break;
      }
      const detail::once_config c{period_.count(), periodic ? number_of(opts_.clock()) : 0, std::nullopt};
      if (detail::store_create(store, key_, detail::format_once(c), dibs::time_limit::max())) break;
    }
  }

public:
  /// Returns: the period of the schedule `name` of `store` (zero for one of
  /// named slots only), or nothing if `store` has no schedule of that name:
  /// what a program that shows schedules (dibs status --once) opens one
  /// with. Reads only.
  /// Throws: errc::corrupt_record if the schedule's key holds something
  /// else; as the store's read.
  static std::optional<std::chrono::milliseconds> period_of(Store& store, std::string_view name) {
    const std::string key = std::string(detail::once_prefix) + std::string(name);
    const auto r = detail::store_read(store, key, dibs::time_limit::max());
    if (!r) return std::nullopt;
    return std::chrono::milliseconds{parse_record(name, key, *r).period_ms};
  }

  /// Returns: the names of the schedules `store` holds, sorted (what a
  /// status tool lists; period_of() says how to open each). Reads only.
  static std::vector<std::string> names(Store& store)
    requires listable_store<Store>
  {
    std::vector<std::string> out;
    for (auto& k : store.keys(detail::once_prefix))
      if (k.find('/', detail::once_prefix.size()) == std::string::npos) out.push_back(k.substr(detail::once_prefix.size()));
    std::sort(out.begin(), out.end());
    return out;
  }

  const std::string& name() const noexcept { return name_; }
  /// Zero for a schedule of named slots only.
  std::chrono::milliseconds period() const noexcept { return period_; }

  /// Returns: the id of the slot `t` falls in (by default: now, by options::clock).
  std::string slot_id(std::optional<std::chrono::system_clock::time_point> t = std::nullopt) const {
    check_periodic("slot_id");
    return id_of(number_of(t ? *t : opts_.clock()));
  }

  /// Effects: runs fn(slot) for the slot now falls in (options::clock),
  /// unless a process ran it or runs it: then stands by as the top of this
  /// header says. First, the slot before it if that one was left
  /// unfinished by a run whose process is provably gone (its standbys had
  /// gone on), and with catch_up::latest the latest missed slot.
  /// fn may return void or a std::string, kept in the slot's result.
  /// Returns: how it ended (of the current slot).
  /// Throws: what fn throws (the slot given back with its message as the
  /// error, for another run); errc::lease_lost if fn returned after the run
  /// was taken over (lost()); errc::corrupt_record if the slot's record is
  /// damaged; as the store's operations.
  template <class F>
  once_result run(F&& fn) {
    check_periodic("run");
    const std::int64_t k = number_of(opts_.clock());
    const auto c = config();
    if (const std::int64_t prev = k - 1; prev >= c.first) {
      const std::string id = id_of(prev);
      const claim_state st = claims_.status(slot_key(id)).state;
      if (st == claim_state::processing || st == claim_state::released || st == claim_state::offered) {
        // Left unfinished: its run died after its standbys had gone on to
        // this slot, or threw at its end. Taken over now if that run's
        // process is provably gone (one try, no standing by).
        (void)run_key(id, prev, start_of(prev), std::chrono::steady_clock::now(), false, fn);
      } else if (st == claim_state::absent && opts_.missed == catch_up::latest && (!c.newest || *c.newest < prev)) {
        (void)run_number(prev, c, true, fn);
      }
    }
    return run_number(k, c, false, fn);
  }

  /// Effects, Returns, Throws: as run(), for the slot the caller names
  /// (`id`: 1 to max_slot_size bytes, such as "2026-12-06"); no slot of a
  /// periodic schedule is affected, and options::keep does not apply.
  template <class F>
  once_result run_slot(std::string_view id, F&& fn) {
    if (id.empty() || id.size() > max_slot_size)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::once '{}': invalid slot '{}': a slot's name is 1 to {} bytes",
                                          detail::show_key(name_), detail::show_key(id), max_slot_size));
    const dibs::time_limit limit =
        opts_.standby ? std::chrono::steady_clock::now() + *opts_.standby : dibs::time_limit::max();
    return run_key(std::string(id), std::nullopt, std::nullopt, limit, false, fn);
  }

  /// Returns: the last `n` slots of the schedule up to the current one,
  /// newest first, each as its record says; a past slot with no record
  /// (since the schedule was made) is missed, the current one without a
  /// record due. Reads only.
  std::vector<once_slot_status> recent(std::size_t n) {
    check_periodic("recent");
    const auto c = config();
    const std::int64_t k = number_of(opts_.clock());
    std::vector<once_slot_status> out;
    for (std::int64_t i = k; i > k - static_cast<std::int64_t>(n) && i >= c.first; --i) {
      once_slot_status s = status_of(id_of(i));
      if (s.st == once_slot_status::state::missed && i == k) s.st = once_slot_status::state::due;
      out.push_back(std::move(s));
    }
    return out;
  }

  /// Returns: every slot of the schedule that has a record (periodic and
  /// named ones), in key order. Reads only.
  std::vector<once_slot_status> list() {
    std::vector<once_slot_status> out;
    const std::string prefix = key_ + "/";
    for (auto& item : claims_.list(prefix)) out.push_back(from_claim(item.key.substr(prefix.size()), item.status));
    return out;
  }

  /// Returns: the slot `id` as its record says (missed if it has none).
  once_slot_status status_of(const std::string& id) { return from_claim(id, claims_.status(slot_key(id))); }

private:
  using claim_type = typename marker_claim<Store>::claim;

  void check_periodic(std::string_view call) const {
    if (period_.count() == 0)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::once::{} '{}': the schedule has no period (named slots only): use "
                                          "run_slot, list and status_of",
                                          call, detail::show_key(name_)));
  }

  std::int64_t number_of(std::chrono::system_clock::time_point t) const {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
    return ms >= 0 ? ms / period_.count() : -((-ms + period_.count() - 1) / period_.count());
  }
  std::chrono::system_clock::time_point start_of(std::int64_t k) const {
    return std::chrono::system_clock::time_point{std::chrono::milliseconds{k * period_.count()}};
  }
  std::string id_of(std::int64_t k) const { return detail::utc_id(start_of(k), period_.count() % 1000 != 0); }
  std::string slot_key(const std::string& id) const { return key_ + "/" + id; }

  detail::once_config parse(const record& r) const { return parse_record(name_, key_, r); }
  static detail::once_config parse_record(std::string_view name, std::string_view key, const record& r) {
    const auto c = detail::parse_once(r.value);
    if (!c)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::once '{}': the record '{}' is not a dibs schedule's (it starts "
                                          "'{}'); is the key used by another program?",
                                          detail::show_key(name), detail::show_key(key),
                                          detail::show_key(r.value.substr(0, r.value.find('\n')))));
    return *c;
  }
  detail::once_config config() {
    const auto r = detail::store_read(claims_.store(), key_, dibs::time_limit::max());
    if (!r)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::once '{}': its record '{}' is gone (removed by hand?); open the "
                                          "schedule again to make it",
                                          detail::show_key(name_), detail::show_key(key_)));
    return parse(*r);
  }
  // Effects: the schedule's newest slot is at least k (a compare-and-set).
  // Returns: the configuration as written (or as found, if it was newer).
  detail::once_config note_newest(std::int64_t k) {
    for (;;) {
      const auto r = detail::store_read(claims_.store(), key_, dibs::time_limit::max());
      if (!r) return config();  // throws: gone
      auto c = parse(*r);
      if (c.newest && *c.newest >= k) return c;
      c.newest = k;
      if (detail::store_replace(claims_.store(), key_, r->version, detail::format_once(c), dibs::time_limit::max()))
        return c;
    }
  }

  template <class F>
  // `c`: the schedule's record as run() just read it.
  once_result run_number(std::int64_t k, const detail::once_config& c, bool caught_up, F& fn) {
    const std::string id = id_of(k);
    if (c.newest && k + static_cast<std::int64_t>(opts_.keep) < *c.newest)
      return {once_outcome::too_late, id, 0, 0, fmt::format("older than the {} slots kept", opts_.keep), caught_up};
    // Standing by ends with the slot (by this process's clock, measured on
    // its steady clock from now), or after options::standby.
    const auto left = start_of(k + 1) - opts_.clock();
    const auto until_end = std::chrono::steady_clock::now() +
                           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                               std::max(left, std::chrono::system_clock::duration::zero()));
    const auto limit =
        opts_.standby ? std::chrono::steady_clock::now() + *opts_.standby : until_end;
    return run_key(id, k, start_of(k), limit, caught_up, fn);
  }

  template <class F>
  once_result run_key(const std::string& id, std::optional<std::int64_t> k,
                      std::optional<std::chrono::system_clock::time_point> start,
                      dibs::time_limit limit, bool caught_up, F& fn) {
    const std::string key = slot_key(id);
    auto pause = std::chrono::milliseconds{20};
    for (;;) {
      if (auto cl = claims_.try_claim(key)) {
        if (k) {
          (void)note_newest(*k);
          forget_old(*k);
        }
        return run_claimed(*cl, id, start, caught_up, fn);
      }
      const claim_status st = claims_.status(key);
      switch (st.state) {
        case claim_state::completed: return {once_outcome::done, id, st.attempts, st.token, {}, caught_up};
        case claim_state::failed: return {once_outcome::failed, id, st.attempts, st.token, st.error, caught_up};
        case claim_state::damaged:
          throw std::system_error(make_error_code(errc::corrupt_record),
                                  fmt::format("dibs::once '{}': slot '{}': {}", detail::show_key(name_),
                                              detail::show_key(id), st.error));
        default: break;  // running elsewhere, given back, or a race: stand by
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= limit) return {once_outcome::taken, id, st.attempts, 0, st.error, caught_up};
      auto nap = pause;
      if (limit != dibs::time_limit::max())
        nap = std::min(nap, std::chrono::duration_cast<std::chrono::milliseconds>(limit - now) +
                                std::chrono::milliseconds{1});
      std::this_thread::sleep_for(nap);
      pause = std::min(pause * 2, std::chrono::milliseconds{250});
    }
  }

  template <class F>
  once_result run_claimed(claim_type& cl, const std::string& id,
                          std::optional<std::chrono::system_clock::time_point> start, bool caught_up, F& fn) {
    const auto& me = detail::this_process_info_cached().id;
    const auto began = std::chrono::system_clock::now();
    const auto steady_began = std::chrono::steady_clock::now();
    const slot s{id, start, &cl, caught_up};
    std::string detail_text;
    try {
      if constexpr (std::is_convertible_v<std::invoke_result_t<F&, const slot&>, std::string>)
        detail_text = fn(s);
      else
        fn(s);
    } catch (const std::exception& e) {
      (void)cl.release(fmt::format("pid {} on {}: {}", me.pid, me.host, e.what()), std::chrono::milliseconds{0});
      throw;
    } catch (...) {
      (void)cl.release(fmt::format("pid {} on {}: an exception that is not a std::exception", me.pid, me.host),
                       std::chrono::milliseconds{0});
      throw;
    }
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                            steady_began);
    const once_result out{once_outcome::ran, id, cl.attempts(), cl.token(), {}, caught_up};
    cl.complete(fmt::format("pid {} on {}, started {}, took {} ms{}{}{}", me.pid, me.host,
                            detail::utc_id(began, true), took.count(), caught_up ? ", caught up" : "",
                            detail_text.empty() ? "" : ": ", detail_text));
    return out;
  }

  // Forgets the records of slots more than options::keep before `k`
  // (completed or failed ones; a compare-and-set each), once in a while:
  // when k is a multiple of keep / 4 (or every slot for a small keep).
  void forget_old(std::int64_t k) {
    const std::int64_t every = std::max<std::int64_t>(1, opts_.keep / 4);
    if (k % every != 0) return;
    const std::string prefix = key_ + "/";
    const std::string oldest_kept = id_of(k - static_cast<std::int64_t>(opts_.keep));
    const bool ms = period_.count() % 1000 != 0;
    try {
      (void)claims_.purge(
          std::chrono::milliseconds{0},
          [&](std::string_view key) {
            const auto id = key.substr(prefix.size());
            // Only this schedule's own slot ids (a named slot is never
            // forgotten here), compared as text: the ids sort as times.
            return id.size() == oldest_kept.size() && id < oldest_kept && id.back() == 'Z' &&
                   (id.find('.') != std::string_view::npos) == ms;
          },
          prefix);
    } catch (const std::system_error&) {
      // Kept for the next time: forgetting is housekeeping, never the run's failure.
    }
  }

  static once_slot_status from_claim(std::string id, const claim_status& st) {
    using S = once_slot_status::state;
    once_slot_status s;
    s.slot = std::move(id);
    s.attempts = st.attempts;
    s.result = st.result;
    s.error = st.error;
    s.owner = st.owner;
    s.token = st.token;
    switch (st.state) {
      case claim_state::completed: s.st = S::completed; break;
      case claim_state::failed: s.st = S::failed; break;
      case claim_state::processing:
        s.st = st.owner && detail::provably_dead(*st.owner) ? S::interrupted : S::running;
        break;
      case claim_state::offered:
      case claim_state::released: s.st = S::retrying; break;
      case claim_state::damaged: s.st = S::failed; break;
      case claim_state::absent: s.st = S::missed; break;
    }
    return s;
  }

  marker_claim<Store> claims_;
  std::string name_;
  std::chrono::milliseconds period_;
  once_options opts_;
  std::string key_;
};

}  // namespace dibs
