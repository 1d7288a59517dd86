// dibs/retry.hpp: retry with exponential backoff, a shared retry budget,
// cancellation, and whole-transaction retry.
//
//   dibs::retry_policy policy;                       // 10 attempts, 10 ms .. 1 s, full jitter
//   auto n = dibs::retry(policy, [&] { return fetch(); });
//
// What is retried (by default): exceptions derived from std::system_error
// whose code is dibs::is_transient. Everything else is a permanent error and
// is rethrown unchanged at once. When retry gives up on a retryable error it
// throws dibs::retry_error, whose code says why (attempts, deadline, budget,
// cancellation) and which keeps the last underlying error. retry_error's own
// codes are not transient, so nested retries do not multiply.
#pragma once

#include <chrono>
#include <condition_variable>
#include <concepts>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>

#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/detail/cancel.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/detail/units.hpp>
#include <dibs/error.hpp>

namespace dibs {

using retry_clock = std::chrono::steady_clock;

/// A token bucket that many callers, in many threads, share so that together
/// they cannot multiply the load on a struggling medium: every retry (never a
/// first attempt) takes one token; tokens come back at a fixed rate up to the
/// capacity. It starts full. Thread-safe.
class retry_budget {
public:
  /// Throws: std::invalid_argument if capacity < 1 or refill_per_second < 0.
  explicit retry_budget(double capacity, double refill_per_second,
                        std::function<retry_clock::time_point()> clock = &retry_clock::now)
      : capacity_(capacity), rate_(refill_per_second), clock_(std::move(clock)), tokens_(capacity) {
    if (!(capacity >= 1.0))
      throw std::invalid_argument(fmt::format("dibs::retry_budget: capacity must be at least 1 (got {})", capacity));
    if (!(refill_per_second >= 0.0))
      throw std::invalid_argument(
          fmt::format("dibs::retry_budget: refill_per_second must not be negative (got {})", refill_per_second));
    if (!clock_) throw std::invalid_argument("dibs::retry_budget: clock must not be empty");
    last_ = clock_();
  }

  /// Effects: takes one token if one is there.
  /// Returns: true if a token was taken (the caller may retry).
  bool try_acquire() {
    std::lock_guard lock{mutex_};
    refill();
    if (tokens_ < 1.0) return false;
    tokens_ -= 1.0;
    return true;
  }

  /// Returns: the tokens available now.
  double available() {
    std::lock_guard lock{mutex_};
    refill();
    return tokens_;
  }

private:
  void refill() {
    const auto now = clock_();
    if (now > last_) {
      const double elapsed = std::chrono::duration<double>(now - last_).count();
      tokens_ = std::min(capacity_, tokens_ + elapsed * rate_);
      last_ = now;
    }
  }

  const double capacity_;
  const double rate_;
  const std::function<retry_clock::time_point()> clock_;
  std::mutex mutex_;
  double tokens_;
  retry_clock::time_point last_;
};

/// What the on_retry hook is told before each sleep.
struct retry_event {
  std::uint64_t attempt;             ///< the attempt that just failed, from 1
  std::chrono::nanoseconds delay;    ///< the sleep about to start
  std::error_code code;              ///< its error code (empty if not a std::system_error, or a rejected result)
  std::exception_ptr error;          ///< its exception (null for a rejected result)
};

/// Why a retry loop ended.
enum class retry_status {
  succeeded,          ///< an attempt succeeded
  permanent_error,    ///< an attempt failed with an error that is not retried
  attempts_exhausted, ///< the last allowed attempt failed with a retryable error
  deadline_exceeded,  ///< the deadline passed after a retryable failure
  budget_exhausted,   ///< the shared retry budget refused a retry
  cancelled,          ///< a stop was requested
};

/// How many times to try, how long to wait in between, and what to retry.
/// A value type: copy it freely. Every setter checks its argument and throws
/// std::invalid_argument naming the field, so a bad policy never gets built.
class retry_policy {
public:
  using duration = std::chrono::nanoseconds;
  using schedule_fn = std::function<duration(std::uint64_t retry, duration previous, double u)>;

  /// Effects: 10 attempts, exponential_backoff{} (10 ms doubling to 1 s, full
  /// jitter), no deadline, retry only is_transient error codes, no budget.
  retry_policy() = default;

  /// Throws: std::invalid_argument if n == 0.
  retry_policy& max_attempts(std::uint64_t n) {
    if (n == 0) throw std::invalid_argument("dibs::retry_policy: max_attempts must be at least 1 (got 0)");
    max_attempts_ = n;
    return *this;
  }
  retry_policy& unlimited_attempts() noexcept {
    max_attempts_ = std::numeric_limits<std::uint64_t>::max();
    return *this;
  }
  /// Effects: no attempt starts later than `d` after the call began; the last
  /// sleep is cut to the time left. Throws: std::invalid_argument if d <= 0.
  retry_policy& deadline(duration d) {
    if (d <= duration::zero())
      throw std::invalid_argument(fmt::format("dibs::retry_policy: deadline must be positive (got {})", detail::human(d)));
    deadline_ = d;
    return *this;
  }
  retry_policy& backoff(const exponential_backoff& b) noexcept {
    backoff_ = b;
    schedule_ = nullptr;
    return *this;
  }
  /// A schedule of your own (linear, constant, none): f(n, previous, u) is the
  /// delay before retry n (from 0), given the previous delay and u in [0, 1).
  /// Throws: std::invalid_argument if f is empty.
  retry_policy& schedule(schedule_fn f) {
    if (!f) throw std::invalid_argument("dibs::retry_policy: schedule must not be empty");
    schedule_ = std::move(f);
    return *this;
  }
  /// Which error codes (of exceptions derived from std::system_error) are retried.
  retry_policy& retry_on_error(std::function<bool(const std::error_code&)> pred) {
    if (!pred) throw std::invalid_argument("dibs::retry_policy: retry_on_error predicate must not be empty");
    error_pred_ = std::move(pred);
    return *this;
  }
  /// Exceptions for which `pred` is true are retried too, whatever their type
  /// (in addition to those retry_on_error selects).
  retry_policy& retry_on_exception(std::function<bool(const std::exception&)> pred) {
    if (!pred) throw std::invalid_argument("dibs::retry_policy: retry_on_exception predicate must not be empty");
    exception_pred_ = std::move(pred);
    return *this;
  }
  /// Called before each sleep. An exception from the hook ends the retry loop
  /// and propagates.
  retry_policy& on_retry(std::function<void(const retry_event&)> hook) {
    hook_ = std::move(hook);
    return *this;
  }
  retry_policy& budget(std::shared_ptr<retry_budget> b) noexcept {
    budget_ = std::move(b);
    return *this;
  }
  /// Test seams: the clock used for the deadline, the sleep (it must return
  /// early when the token is stopped), and the random source (a seeded engine
  /// makes a run reproducible). Throws: std::invalid_argument if empty.
  retry_policy& clock(std::function<retry_clock::time_point()> now) {
    if (!now) throw std::invalid_argument("dibs::retry_policy: clock must not be empty");
    clock_ = std::move(now);
    return *this;
  }
  retry_policy& sleeper(std::function<void(duration, std::stop_token)> sleep) {
    if (!sleep) throw std::invalid_argument("dibs::retry_policy: sleeper must not be empty");
    sleep_ = std::move(sleep);
    return *this;
  }
  retry_policy& random(std::function<std::uint64_t()> bits) {
    if (!bits) throw std::invalid_argument("dibs::retry_policy: random source must not be empty");
    random_ = std::move(bits);
    return *this;
  }

  std::uint64_t max_attempts() const noexcept { return max_attempts_; }
  std::optional<duration> deadline() const noexcept {
    return deadline_ > duration::zero() ? std::optional{deadline_} : std::nullopt;
  }
  /// Returns: the deadline, or zero if there is none (for the hot path, where
  /// building a std::optional measurably costs; see docs/BENCHMARKS.md).
  duration deadline_or_zero() const noexcept { return deadline_; }
  const exponential_backoff& backoff() const noexcept { return backoff_; }

  /// Returns: whether an exception thrown by an attempt is retried.
  bool is_retryable(const std::exception& e) const {
    if (exception_pred_ && exception_pred_(e)) return true;
    if (const auto* se = dynamic_cast<const std::system_error*>(&e)) return is_retryable(se->code());
    return false;
  }
  bool is_retryable(const std::error_code& ec) const {
    return error_pred_ ? error_pred_(ec) : dibs::is_transient(ec);
  }

  /// Returns: the delay before retry n, drawing from the random source.
  duration next_delay(std::uint64_t n, duration previous) const {
    const double u = unit(random_ ? random_() : default_bits());
    return schedule_ ? schedule_(n, previous, u) : backoff_.delay(n, previous, u);
  }

  retry_clock::time_point now() const { return clock_ ? clock_() : retry_clock::now(); }

  void sleep(duration d, std::stop_token st) const {
    if (sleep_) return sleep_(d, std::move(st));
    (void)detail::sleep_unless_stopped(d, st);
  }

  void notify(const retry_event& e) const {
    if (hook_) hook_(e);
  }
  retry_budget* budget() const noexcept { return budget_.get(); }

private:
  static double unit(std::uint64_t bits) noexcept {
    return static_cast<double>(bits >> 11) * 0x1.0p-53;  // 53 random bits -> [0, 1)
  }
  static std::uint64_t default_bits() {
    // Seeded per thread and again in a forked child: children forked from
    // one parent must not draw the same "random" delays, or they retry in
    // lock-step, which is what jitter is there to prevent.
    thread_local decltype(detail::current_pid()) owner = 0;
    thread_local std::mt19937_64 engine;
    if (const auto self = detail::current_pid(); self != owner) {
      std::random_device device;
      engine.seed((static_cast<std::uint64_t>(device()) << 32) ^ device() ^ static_cast<std::uint64_t>(self));
      owner = self;
    }
    return engine();
  }

  std::uint64_t max_attempts_ = 10;
  duration deadline_ = duration::zero();
  exponential_backoff backoff_;
  schedule_fn schedule_;
  std::function<bool(const std::error_code&)> error_pred_;
  std::function<bool(const std::exception&)> exception_pred_;
  std::function<void(const retry_event&)> hook_;
  std::shared_ptr<retry_budget> budget_;
  std::function<retry_clock::time_point()> clock_;
  std::function<void(duration, std::stop_token)> sleep_;
  std::function<std::uint64_t()> random_;
};

/// Thrown by dibs::retry when it gives up on a retryable error. code() is one
/// of errc::retries_exhausted, deadline_exceeded, retry_budget_exhausted or
/// cancelled (none of them transient); last_error() is what the last attempt
/// threw (null if it returned a rejected result).
class retry_error : public std::system_error {
public:
  retry_error(std::error_code why, std::uint64_t attempts, std::exception_ptr last, std::error_code last_code)
      : std::system_error(why), attempts_(attempts), last_(std::move(last)), last_code_(last_code) {
    std::string cause = "a rejected result";
    if (last_) {
      try {
        std::rethrow_exception(last_);
      } catch (const std::exception& e) {
        cause = e.what();
      } catch (...) {
        cause = "an exception not derived from std::exception";
      }
    }
    what_ = fmt::format("dibs::retry: {} (attempts: {}); last error: {}", why.message(), attempts, cause);
  }

  const char* what() const noexcept override { return what_.c_str(); }
  std::uint64_t attempts() const noexcept { return attempts_; }
  const std::exception_ptr& last_error() const noexcept { return last_; }
  const std::error_code& last_code() const noexcept { return last_code_; }

private:
  std::uint64_t attempts_;
  std::exception_ptr last_;
  std::error_code last_code_;
  std::string what_;
};

namespace detail {
template <class T>
using stored_t = std::conditional_t<std::is_void_v<T>, std::monostate, std::remove_cvref_t<T>>;
}  // namespace detail

/// The whole story of a retry loop, for callers who want no exception.
template <class T>
struct retry_outcome {
  retry_status status = retry_status::succeeded;
  std::uint64_t attempts = 0;
  std::optional<detail::stored_t<T>> value;  ///< on success, and the last result rejected by a result predicate
  std::exception_ptr error;                  ///< what the last failed attempt threw
  std::error_code code;                      ///< its code, if it was a std::system_error

  bool ok() const noexcept { return status == retry_status::succeeded; }

  /// Returns: the value on success. Throws: the permanent error unchanged, or
  /// dibs::retry_error when the loop gave up.
  T get() && {
    switch (status) {
      case retry_status::succeeded:
        if constexpr (std::is_void_v<T>) return;
        else return std::move(*value);
      case retry_status::permanent_error: std::rethrow_exception(error);
      case retry_status::attempts_exhausted: throw retry_error(errc::retries_exhausted, attempts, error, code);
      case retry_status::deadline_exceeded: throw retry_error(errc::deadline_exceeded, attempts, error, code);
      case retry_status::budget_exhausted: throw retry_error(errc::retry_budget_exhausted, attempts, error, code);
      case retry_status::cancelled: throw retry_error(errc::cancelled, attempts, error, code);
    }
    std::terminate();  // unreachable: every status is handled above
  }
};

namespace detail {

struct accept_any {
  template <class V>
  constexpr bool operator()(const V&) const noexcept { return false; }
};

template <class F>
using result_t = std::remove_cvref_t<std::invoke_result_t<F&>>;

// Records a failed attempt in `out`. Returns: true if it may be retried.
template <class T>
bool absorb_failure(const retry_policy& p, retry_outcome<T>& out, std::exception_ptr error) {
  out.value.reset();
  out.error = error;
  out.code = {};
  try {
    std::rethrow_exception(std::move(error));
  } catch (const std::exception& e) {
    if (const auto* se = dynamic_cast<const std::system_error*>(&e)) out.code = se->code();
    if (p.is_retryable(e)) return true;
  } catch (...) {
  }
  out.status = retry_status::permanent_error;
  return false;
}

// The one retry loop; every public spelling calls it. `first`, if set, is
// what attempt 1 already threw (retry()'s fast path makes attempt 1 itself).
template <class F, class Reject>
retry_outcome<result_t<F>> run(const retry_policy& p, F& fn, Reject& reject, std::stop_token st,
                               std::exception_ptr first = nullptr) {
  using T = result_t<F>;
  retry_outcome<T> out;
  // The clock is read only when a deadline is set, so the default policy adds
  // no clock read to a call that succeeds at once.
  const auto deadline = p.deadline_or_zero();
  const bool has_deadline = deadline > std::chrono::nanoseconds::zero();
  const auto end = has_deadline ? p.now() + deadline : retry_clock::time_point::max();
  std::chrono::nanoseconds previous{0};

  for (std::uint64_t attempt = 1;; ++attempt) {
    out.attempts = attempt;
    std::exception_ptr failed = attempt == 1 ? std::move(first) : nullptr;
    if (!failed) {
      try {
        if constexpr (std::is_void_v<T>) {
          std::invoke(fn);
          out.value.emplace();
        } else {
          out.value.emplace(std::invoke(fn));
        }
        out.error = nullptr;
        out.code = {};
        if (!reject(*out.value)) {
          out.status = retry_status::succeeded;
          return out;
        }
      } catch (...) {
        failed = std::current_exception();
      }
    }
    if (failed && !absorb_failure(p, out, std::move(failed))) return out;

    if (attempt >= p.max_attempts()) {
      out.status = retry_status::attempts_exhausted;
      return out;
    }
    if (st.stop_requested()) {
      out.status = retry_status::cancelled;
      return out;
    }
    const auto planned = p.next_delay(attempt - 1, previous);
    auto delay = planned;
    if (has_deadline) {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(end - p.now());
      if (left <= std::chrono::nanoseconds::zero()) {
        out.status = retry_status::deadline_exceeded;
        return out;
      }
      delay = std::min(delay, left);
    }
    if (auto* b = p.budget(); b && !b->try_acquire()) {
      out.status = retry_status::budget_exhausted;
      return out;
    }
    p.notify(retry_event{attempt, delay, out.code, out.error});
    // The schedule's own value feeds the recurrence; a cut last sleep must not
    // shrink it.
    previous = planned;
    p.sleep(delay, st);
    if (st.stop_requested()) {
      out.status = retry_status::cancelled;
      return out;
    }
  }
}

}  // namespace detail

/// Effects: calls fn() until it succeeds, fails permanently, or the policy
/// gives up; sleeps between attempts as the policy's schedule says.
/// Returns: a retry_outcome; never throws for what fn throws (only for a
/// throwing hook, clock or sleeper).
template <class F>
  requires std::invocable<F&>
auto try_retry(const retry_policy& policy, F&& fn, std::stop_token st = {}) {
  detail::accept_any accept;
  return detail::run(policy, fn, accept, std::move(st));
}

/// As try_retry, and a returned value for which retry_if(value) is true
/// counts as a retryable failure too (such as "no row yet").
template <class F, class Pred>
  requires std::invocable<F&> && std::predicate<Pred&, const detail::result_t<F>&>
auto try_retry_while(const retry_policy& policy, Pred&& retry_if, F&& fn, std::stop_token st = {}) {
  return detail::run(policy, fn, retry_if, std::move(st));
}

/// Effects: as try_retry.
/// Returns: what fn() returned (by value).
/// Throws: a permanent error of fn unchanged; dibs::retry_error (with the last
/// error inside) when the policy gives up.
template <class F>
  requires std::invocable<F&>
auto retry(const retry_policy& policy, F&& fn, std::stop_token st = {}) -> detail::result_t<F> {
  detail::accept_any accept;
  if (policy.deadline_or_zero() > std::chrono::nanoseconds::zero())
    return detail::run(policy, fn, accept, std::move(st)).get();
  // Without a deadline nothing needs to happen before attempt 1, so make it
  // here, with no bookkeeping: a call that succeeds at once costs the call.
  std::exception_ptr first;
  try {
    return std::invoke(fn);
  } catch (...) {
    first = std::current_exception();
  }
  return detail::run(policy, fn, accept, std::move(st), std::move(first)).get();
}

/// As retry, with try_retry_while's result predicate. When the policy gives up
/// on a rejected result, retry_error::last_error() is null.
template <class F, class Pred>
  requires std::invocable<F&> && std::predicate<Pred&, const detail::result_t<F>&>
auto retry_while(const retry_policy& policy, Pred&& retry_if, F&& fn, std::stop_token st = {})
    -> detail::result_t<F> {
  return try_retry_while(policy, retry_if, fn, std::move(st)).get();
}

/// A unit of work that can be begun, committed and rolled back, such as a
/// database connection. Requires: rollback() is allowed after a failed
/// commit() (a no-op if the medium already rolled back).
template <class T>
concept transactional = requires(T& t) {
  t.begin();
  t.commit();
  t.rollback();
};

/// Effects: runs begin(), body, commit() as one unit under `policy`. When the
/// body or the commit throws, rolls back before anything else happens (before
/// the sleep, and before a permanent error propagates), then retries the whole
/// unit; a statement inside an aborted transaction is never retried alone.
/// body is called as body(tx) if it takes the transaction, else as body().
/// Returns: what body returned. Throws: as retry; a failed rollback ends the
/// loop with std::system_error(errc::rollback_failed), because the unit can
/// no longer be trusted.
template <transactional Tx, class F>
auto transact(const retry_policy& policy, Tx& tx, F&& body, std::stop_token st = {}) {
  auto call = [&]() -> decltype(auto) {
    if constexpr (std::invocable<F&, Tx&>) return std::invoke(body, tx);
    else return std::invoke(body);
  };
  auto unit = [&]() -> decltype(auto) {
    tx.begin();
    try {
      if constexpr (std::is_void_v<decltype(call())>) {
        call();
        tx.commit();
      } else {
        auto result = call();
        tx.commit();
        return result;
      }
    } catch (...) {
      std::exception_ptr original = std::current_exception();
      try {
        tx.rollback();
      } catch (const std::exception& e) {
        std::string why = "unknown error";
        try {
          std::rethrow_exception(original);
        } catch (const std::exception& o) {
          why = o.what();
        } catch (...) {
        }
        throw std::system_error(make_error_code(errc::rollback_failed),
                                fmt::format("rollback failed ({}) after: {}", e.what(), why));
      }
      throw;
    }
  };
  return retry(policy, unit, std::move(st));
}

}  // namespace dibs
