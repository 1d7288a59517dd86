#include <dibs/retry.hpp>

#include <catch2/catch.hpp>

#ifndef _WIN32  // the fork test at the end
#include <sys/wait.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cerrno>
#include <chrono>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using ns = std::chrono::nanoseconds;
using Catch::Contains;

namespace {

std::system_error sys_error(int e) { return {std::error_code{e, std::generic_category()}, "test"}; }

// Time that moves only when the code under test sleeps (or an attempt says so).
struct fake_time {
  dibs::retry_clock::time_point now{};
  std::vector<ns> sleeps;

  dibs::retry_policy policy() {
    return dibs::retry_policy{}
        .clock([this] { return now; })
        .sleeper([this](ns d, std::stop_token) {
          sleeps.push_back(d);
          now += d;
        })
        .random([rng = std::mt19937_64{2024}]() mutable { return rng(); });
  }
};

const dibs::exponential_backoff fixed10{10ms, 2.0, 10s, dibs::jitter::none};

}  // namespace

TEST_CASE("a call that succeeds at once runs once and never sleeps") {
  fake_time t;
  int calls = 0;
  CHECK(dibs::retry(t.policy(), [&] { return ++calls * 7; }) == 7);
  CHECK(calls == 1);
  CHECK(t.sleeps.empty());
}

TEST_CASE("transient errors are retried until the call succeeds") {
  fake_time t;
  int calls = 0;
  const auto r = dibs::retry(t.policy().backoff(fixed10), [&] {
    if (++calls < 4) throw sys_error(EBUSY);
    return std::string("done");
  });
  CHECK(r == "done");
  CHECK(calls == 4);
  CHECK(t.sleeps == std::vector<ns>{10ms, 20ms, 40ms});
}

TEST_CASE("a permanent error is rethrown unchanged, at once") {
  fake_time t;
  int calls = 0;
  try {
    dibs::retry(t.policy(), [&] {
      ++calls;
      throw sys_error(EACCES);
    });
    FAIL("no exception");
  } catch (const dibs::retry_error&) {
    FAIL("a permanent error must not be reported as giving up");
  } catch (const std::system_error& e) {
    CHECK(e.code() == std::errc::permission_denied);
  }
  CHECK(calls == 1);
  CHECK(t.sleeps.empty());
}

TEST_CASE("exceptions that carry no error code are permanent unless a predicate says otherwise") {
  fake_time t;
  int calls = 0;
  auto flaky = [&] {
    if (++calls < 3) throw std::runtime_error("flaky");
    return calls;
  };
  CHECK_THROWS_WITH(dibs::retry(t.policy(), flaky), "flaky");
  CHECK(calls == 1);

  calls = 0;
  auto p = t.policy().retry_on_exception([](const std::exception& e) { return std::string(e.what()) == "flaky"; });
  CHECK(dibs::retry(p, flaky) == 3);

  // Not derived from std::exception: never retried, propagated as is.
  calls = 0;
  CHECK_THROWS_AS(dibs::retry(p, [&] {
                    ++calls;
                    throw 42;
                  }),
                  int);
  CHECK(calls == 1);
}

TEST_CASE("the error-code predicate replaces is_transient") {
  fake_time t;
  auto p = t.policy().backoff(fixed10).retry_on_error([](const std::error_code& ec) {
    return ec == std::errc::permission_denied;
  });
  int calls = 0;
  CHECK_THROWS_AS(dibs::retry(p,
                              [&] {
                                ++calls;
                                throw sys_error(EBUSY);  // transient, but not selected
                              }),
                  std::system_error);
  CHECK(calls == 1);
  calls = 0;
  dibs::retry(p, [&] {
    if (++calls < 2) throw sys_error(EACCES);
  });
  CHECK(calls == 2);
}

TEST_CASE("giving up after max_attempts is a retry_error that keeps the last error") {
  fake_time t;
  int calls = 0;
  try {
    dibs::retry(t.policy().max_attempts(4).backoff(fixed10), [&] {
      ++calls;
      throw sys_error(calls == 4 ? EAGAIN : EBUSY);
    });
    FAIL("no exception");
  } catch (const dibs::retry_error& e) {
    CHECK(e.code() == dibs::errc::retries_exhausted);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK(e.attempts() == 4);
    CHECK(e.last_code() == std::errc::resource_unavailable_try_again);
    CHECK_THAT(e.what(), Contains("attempts: 4") && Contains("test"));
    CHECK_THROWS_AS(std::rethrow_exception(e.last_error()), std::system_error);
  }
  CHECK(calls == 4);
  CHECK(t.sleeps.size() == 3);  // no sleep after the last attempt
}

TEST_CASE("the deadline stops the loop, and the last sleep is cut to the time left") {
  fake_time t;
  int calls = 0;
  auto out = dibs::try_retry(t.policy().unlimited_attempts().deadline(100ms).backoff(fixed10), [&] {
    ++calls;
    t.now += 1ms;  // each attempt takes 1 ms
    throw sys_error(EBUSY);
  });
  // t: attempt 1 ends at 1, sleep 10 -> 11, attempt 2 -> 12, sleep 20 -> 32, attempt 3 -> 33,
  // sleep 40 -> 73, attempt 4 -> 74, sleep cut from 80 to 26 -> 100, attempt 5 -> 101, stop.
  CHECK(out.status == dibs::retry_status::deadline_exceeded);
  CHECK(out.attempts == 5);
  CHECK(calls == 5);
  CHECK(t.sleeps == std::vector<ns>{10ms, 20ms, 40ms, 26ms});
  CHECK_THROWS_AS(std::move(out).get(), dibs::retry_error);
}

TEST_CASE("max_attempts and deadline: whichever comes first") {
  fake_time t;
  auto always_busy = [] { throw sys_error(EBUSY); };
  auto by_attempts = dibs::try_retry(t.policy().max_attempts(3).deadline(1h).backoff(fixed10), always_busy);
  CHECK(by_attempts.status == dibs::retry_status::attempts_exhausted);
  CHECK(by_attempts.attempts == 3);
  auto by_deadline = dibs::try_retry(t.policy().max_attempts(1000).deadline(35ms).backoff(fixed10), always_busy);
  CHECK(by_deadline.status == dibs::retry_status::deadline_exceeded);
  CHECK(by_deadline.attempts == 4);  // sleeps 10, 20, then 5 (cut), then time is up
}

TEST_CASE("a result predicate retries rejected values") {
  fake_time t;
  int calls = 0;
  auto p = t.policy().max_attempts(5).backoff(fixed10);
  CHECK(dibs::retry_while(p, [](int v) { return v < 0; }, [&] { return ++calls < 3 ? -1 : calls; }) == 3);
  CHECK(calls == 3);

  auto out = dibs::try_retry_while(p, [](int v) { return v < 0; }, [] { return -1; });
  CHECK(out.status == dibs::retry_status::attempts_exhausted);
  CHECK(out.attempts == 5);
  REQUIRE(out.value);
  CHECK(*out.value == -1);  // the last rejected value is kept
  try {
    dibs::retry_while(p, [](int v) { return v < 0; }, [] { return -1; });
    FAIL("no exception");
  } catch (const dibs::retry_error& e) {
    CHECK(e.last_error() == nullptr);
    CHECK(e.attempts() == 5);
  }
}

TEST_CASE("the hook sees each failed attempt, its delay and its error, before the sleep") {
  fake_time t;
  std::vector<dibs::retry_event> events;
  std::vector<std::size_t> sleeps_before_hook;
  auto p = t.policy().max_attempts(4).backoff(fixed10).on_retry([&](const dibs::retry_event& e) {
    events.push_back(e);
    sleeps_before_hook.push_back(t.sleeps.size());
  });
  int calls = 0;
  CHECK_THROWS_AS(dibs::retry(p,
                              [&] {
                                ++calls;
                                throw sys_error(calls % 2 ? EBUSY : EINTR);
                              }),
                  dibs::retry_error);
  REQUIRE(events.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(events[i].attempt == i + 1);
    CHECK(events[i].delay == t.sleeps[i]);
    CHECK(sleeps_before_hook[i] == i);
    CHECK(events[i].error != nullptr);
  }
  CHECK(events[0].code == std::errc::device_or_resource_busy);
  CHECK(events[1].code == std::errc::interrupted);
}

TEST_CASE("a seeded random source makes a run reproducible, and full jitter stays under the ceiling") {
  auto run = [](std::uint64_t seed) {
    fake_time t;
    auto p = t.policy().max_attempts(12).random([rng = std::mt19937_64{seed}]() mutable { return rng(); });
    (void)dibs::try_retry(p, [] { throw sys_error(EBUSY); });
    return t.sleeps;
  };
  const auto a = run(99), b = run(99), c = run(100);
  CHECK(a == b);
  CHECK(a != c);
  REQUIRE(a.size() == 11);
  const dibs::exponential_backoff def;
  for (std::size_t n = 0; n < a.size(); ++n) {
    CHECK(a[n] >= 0ns);
    CHECK(a[n] < def.ceiling(n));
  }
}

TEST_CASE("the retry budget refuses when spent and refills with time") {
  fake_time t;
  auto budget = std::make_shared<dibs::retry_budget>(2.0, 1.0, [&t] { return t.now; });
  auto p = dibs::retry_policy{}
               .clock([&t] { return t.now; })
               .sleeper([](ns, std::stop_token) {})  // time stands still: no refill while retrying
               .unlimited_attempts()
               .budget(budget);
  auto out = dibs::try_retry(p, [] { throw sys_error(EBUSY); });
  CHECK(out.status == dibs::retry_status::budget_exhausted);
  CHECK(out.attempts == 3);  // 1 first attempt + 2 retries the budget paid for
  CHECK(budget->available() < 1.0);
  CHECK_THROWS_MATCHES(std::move(out).get(), dibs::retry_error,
                       Catch::Predicate<dibs::retry_error>([](const dibs::retry_error& e) {
                         return e.code() == dibs::errc::retry_budget_exhausted;
                       }));
  t.now += 1500ms;  // 1.5 tokens come back
  CHECK(budget->available() == Approx(1.5));
  auto again = dibs::try_retry(p, [] { throw sys_error(EBUSY); });
  CHECK(again.attempts == 2);
  t.now += 1h;
  CHECK(budget->available() == Approx(2.0));  // never above capacity
}

TEST_CASE("one budget shared by many threads pays for exactly its capacity of retries") {
  auto budget = std::make_shared<dibs::retry_budget>(50.0, 0.0);
  auto p = dibs::retry_policy{}.unlimited_attempts().sleeper([](ns, std::stop_token) {}).budget(budget);
  std::atomic<int> attempts{0};
  std::vector<std::thread> threads;
  std::vector<dibs::retry_status> statuses(4);  // Catch2 assertions are not thread-safe: check after join
  for (std::size_t i = 0; i < statuses.size(); ++i)
    threads.emplace_back([&, i] {
      statuses[i] = dibs::try_retry(p, [&] {
                      attempts.fetch_add(1);
                      throw sys_error(EBUSY);
                    }).status;
    });
  for (auto& th : threads) th.join();
  for (auto st : statuses) CHECK(st == dibs::retry_status::budget_exhausted);
  CHECK(attempts.load() == 4 + 50);
}

TEST_CASE("cancellation stops a real sleep promptly") {
  std::stop_source stop;
  auto p = dibs::retry_policy{}.unlimited_attempts().schedule([](std::uint64_t, ns, double) -> ns { return 30s; });
  std::atomic<int> calls{0};
  // The stop comes after the first attempt (so: in the sleep after it), not
  // after 50 ms that a late start of this thread could make "before it".
  std::jthread canceller([&] {
    for (const auto end = std::chrono::steady_clock::now() + 60s; calls.load() == 0 && std::chrono::steady_clock::now() < end;)
      std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(50ms);
    stop.request_stop();
  });
  const auto start = std::chrono::steady_clock::now();
  auto out = dibs::try_retry(
      p,
      [&] {
        ++calls;
        throw sys_error(EBUSY);
      },
      stop.get_token());
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(out.status == dibs::retry_status::cancelled);
  CHECK(calls == 1);
  CHECK(took < 5s);  // far below the 30 s sleep it was in
  CHECK_THROWS_MATCHES(std::move(out).get(), dibs::retry_error,
                       Catch::Predicate<dibs::retry_error>(
                           [](const dibs::retry_error& e) { return e.code() == dibs::errc::cancelled; }));
}

TEST_CASE("a stop requested before the first failure ends the loop without sleeping") {
  fake_time t;
  std::stop_source stop;
  stop.request_stop();
  int calls = 0;
  auto out = dibs::try_retry(
      t.policy(),
      [&] {
        ++calls;
        throw sys_error(EBUSY);
      },
      stop.get_token());
  CHECK(out.status == dibs::retry_status::cancelled);
  CHECK(calls == 1);
  CHECK(t.sleeps.empty());
}

TEST_CASE("a retry_error is permanent: nested retries do not multiply") {
  fake_time t;
  int calls = 0;
  auto inner = t.policy().max_attempts(3).backoff(fixed10);
  auto outer = t.policy().max_attempts(3).backoff(fixed10);
  CHECK_THROWS_AS(dibs::retry(outer,
                              [&] {
                                dibs::retry(inner, [&] {
                                  ++calls;
                                  throw sys_error(EBUSY);
                                });
                              }),
                  dibs::retry_error);
  CHECK(calls == 3);
}

namespace {
struct fake_tx {
  std::vector<std::string>* log;
  int fail_body = 0;    // how many bodies fail with EBUSY
  int fail_commit = 0;  // how many commits fail with EBUSY
  bool rollback_throws = false;
  void begin() { log->push_back("begin"); }
  void commit() {
    log->push_back("commit");
    if (fail_commit > 0) {
      --fail_commit;
      throw sys_error(EBUSY);
    }
  }
  void rollback() {
    log->push_back("rollback");
    if (rollback_throws) throw std::runtime_error("disk gone");
  }
};
static_assert(dibs::transactional<fake_tx>);
struct not_tx {
  void begin();
  void commit();
};
static_assert(!dibs::transactional<not_tx>);
}  // namespace

TEST_CASE("transact retries the whole unit and rolls back before every sleep") {
  std::vector<std::string> log;
  auto p = dibs::retry_policy{}.backoff(fixed10).sleeper([&](ns, std::stop_token) { log.push_back("sleep"); });
  fake_tx tx{&log, 2, 1};
  const int r = dibs::transact(p, tx, [&](fake_tx& x) {
    log.push_back("body");
    if (x.fail_body > 0) {
      --x.fail_body;
      throw sys_error(EBUSY);
    }
    return 5;
  });
  CHECK(r == 5);
  CHECK(log == std::vector<std::string>{"begin", "body", "rollback", "sleep",             // body busy
                                        "begin", "body", "rollback", "sleep",             // body busy
                                        "begin", "body", "commit", "rollback", "sleep",   // commit busy
                                        "begin", "body", "commit"});
}

TEST_CASE("transact rolls back before a permanent error propagates, and does not retry it") {
  std::vector<std::string> log;
  auto p = dibs::retry_policy{}.sleeper([&](ns, std::stop_token) { log.push_back("sleep"); });
  fake_tx tx{&log};
  CHECK_THROWS_AS(dibs::transact(p, tx,
                                 [&] {
                                   log.push_back("body");
                                   throw sys_error(EACCES);
                                 }),
                  std::system_error);
  CHECK(log == std::vector<std::string>{"begin", "body", "rollback"});
}

TEST_CASE("a failed rollback ends transact with rollback_failed and no retry") {
  std::vector<std::string> log;
  auto p = dibs::retry_policy{}.sleeper([&](ns, std::stop_token) { log.push_back("sleep"); });
  fake_tx tx{&log};
  tx.rollback_throws = true;
  try {
    dibs::transact(p, tx, [&] { throw sys_error(EBUSY); });
    FAIL("no exception");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::rollback_failed);
    CHECK_THAT(e.what(), Contains("disk gone") && Contains("test"));
  }
  CHECK(log == std::vector<std::string>{"begin", "rollback"});
}

TEST_CASE("invalid policies are rejected when built, naming the field") {
  dibs::retry_policy p;
  CHECK_THROWS_WITH(p.max_attempts(0), Contains("max_attempts"));
  CHECK_THROWS_WITH(p.deadline(0ms), Contains("deadline"));
  CHECK_THROWS_WITH(p.deadline(-1s), Contains("deadline"));
  CHECK_THROWS_WITH(p.schedule(nullptr), Contains("schedule"));
  CHECK_THROWS_WITH(p.retry_on_error(nullptr), Contains("retry_on_error"));
  CHECK_THROWS_WITH(p.retry_on_exception(nullptr), Contains("retry_on_exception"));
  CHECK_THROWS_WITH(p.clock(nullptr), Contains("clock"));
  CHECK_THROWS_WITH(p.sleeper(nullptr), Contains("sleeper"));
  CHECK_THROWS_WITH(p.random(nullptr), Contains("random"));
  CHECK_THROWS_WITH(p.backoff({10ms, 2.0, 1ms}), Contains("cap"));
  CHECK_THROWS_WITH(dibs::retry_budget(0.5, 1.0), Contains("capacity"));
  CHECK_THROWS_WITH(dibs::retry_budget(1.0, -1.0), Contains("refill_per_second"));
  CHECK_THROWS_AS(p.max_attempts(0), std::invalid_argument);
  // The policy is unchanged by a rejected setting.
  CHECK(p.max_attempts() == 10);
  CHECK_FALSE(p.deadline());
}

TEST_CASE("the default policy: 10 attempts, only transient codes") {
  int calls = 0;
  auto p = dibs::retry_policy{}.sleeper([](ns, std::stop_token) {});
  auto out = dibs::try_retry(p, [&] {
    ++calls;
    throw std::system_error(dibs::errc::contended);
  });
  CHECK(out.status == dibs::retry_status::attempts_exhausted);
  CHECK(calls == 10);
}

#ifndef _WIN32  // Windows has no fork(): each process seeds its own engine
TEST_CASE("forked children draw different delays from the default random source") {
  // The parent draws first, so a per-thread engine would be copied into every child.
  const dibs::retry_policy p;
  (void)p.next_delay(5, {});
  auto child_draws = [&] {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      std::int64_t d[4];
      for (auto& x : d) x = p.next_delay(5, {}).count();
      (void)!::write(fds[1], d, sizeof d);
      ::_exit(0);
    }
    ::close(fds[1]);
    std::vector<std::int64_t> d(4);
    REQUIRE(::read(fds[0], d.data(), sizeof(std::int64_t) * d.size()) == static_cast<ssize_t>(sizeof(std::int64_t) * d.size()));
    ::close(fds[0]);
    int status;
    ::waitpid(pid, &status, 0);
    return d;
  };
  const auto a = child_draws();
  const auto b = child_draws();
  CHECK(a != b);
}
#endif
