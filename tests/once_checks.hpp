// The checks of dibs::once that more than one store runs, and what they
// need: a clock the test sets, and a process stuck inside a run. Shared by
// once_test.cpp (file_store) and postgres_policies_test.cpp (PostgreSQL).
//
// A check takes `open`, which opens the store (the same medium each time):
// each forked child calls it for a store of its own, as another process
// would (a postgres_store's connection is never used across a fork).
#pragma once

#include <dibs/once.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace dibs_test::once_checks {

using namespace std::chrono_literals;
using Catch::Contains;

// A clock the test sets: slots by it, not by the machine's.
struct test_clock {
  std::shared_ptr<std::atomic<long long>> ms = std::make_shared<std::atomic<long long>>(1'800'000'000'000LL);
  std::function<std::chrono::system_clock::time_point()> fn() const {
    return [m = ms] { return std::chrono::system_clock::time_point{std::chrono::milliseconds{m->load()}}; };
  }
  void set(long long v) const { ms->store(v); }
  void add(std::chrono::milliseconds d) const { ms->fetch_add(d.count()); }
};

inline dibs::once_options with_clock(const test_clock& c, dibs::once_options o = {}) {
  o.clock = c.fn();
  return o;
}

// Options of a run in a forked child: slots by `clock`, a 60 s lease that
// outlasts the test, not renewed (no thread in a child forked from a
// process with threads).
inline dibs::once_options in_child(const test_clock& clock) {
  dibs::once_options o = with_clock(clock);
  o.claims.renew = false;
  o.claims.lease = 60s;
  return o;
}

// A process that runs the current slot of the schedule "sync" (1 h, by
// `clock`) in the store open() opens, says its token on `started` and
// stays inside the run until it is killed.
template <class Open>
child stuck_run(Open open, const test_clock& clock, const channel& started) {
  using Store = std::remove_cvref_t<decltype(open())>;
  return child{spawn([&]() -> int {
    auto mine = open();
    dibs::once<Store> job{mine, "sync", 1h, in_child(clock)};
    job.run([&](const auto& slot) {
      started.send(fmt::format("{}", slot.token()));
      for (;;) ::pause();
    });
    return 0;
  })};
}

/// `processes` processes run the same slot of "nightly" (1 h, by a clock
/// the test holds still) at once: exactly one runs it; the others stand by
/// while it runs (none returns before it ends: the standby lasts until the
/// slot's end, an hour away) and then find it done, with the runner's
/// token; the slot's record names the runner.
template <class Open>
void one_of_many_runs(Open open, int processes) {
  using Store = std::remove_cvref_t<decltype(open())>;
  test_clock clock;
  // inside: the runner's "PID TOKEN" from fn; finish: the test's word to
  // return (read by the runner alone); results: "PID TOKEN SLOT OUTCOME".
  channel inside, finish, results;
  std::vector<child> runs;
  for (int i = 0; i < processes; ++i)
    runs.emplace_back(spawn([&]() -> int {
      auto store = open();
      dibs::once<Store> job{store, "nightly", 1h, in_child(clock)};
      const auto r = job.run([&](const auto& slot) {
        inside.send(fmt::format("{} {}", ::getpid(), slot.token()));
        if (!finish.receive(120s)) throw std::runtime_error("no word to finish the run");
      });
      results.send(fmt::format("{} {} {} {}", ::getpid(), r.token, r.slot, dibs::to_string(r.outcome)));
      return 0;
    }));
  const auto in = inside.receive(120s);
  REQUIRE(in);
  const auto w = words(*in);
  REQUIRE(w.size() == 2);
  const long runner = std::stol(w[0]);
  const dibs::version token = std::stoull(w[1]);

  auto store = open();
  dibs::once<Store> job{store, "nightly", 1h, with_clock(clock)};
  const std::string slot = job.slot_id();
  const auto running = job.status_of(slot);
  CHECK(running.st == dibs::once_slot_status::state::running);
  REQUIRE(running.owner);
  CHECK(running.owner->pid == runner);
  CHECK(results.drain().empty());  // the others stand by: none has returned while it runs
  REQUIRE(finish.send("finish"));

  int ran = 0, done = 0;
  for (int i = 0; i < processes; ++i) {
    const auto line = results.receive(120s);
    REQUIRE(line);
    INFO(*line);
    const auto r = words(*line);
    REQUIRE(r.size() == 4);
    CHECK(std::stoull(r[1]) == token);
    CHECK(r[2] == slot);
    if (r[3] == "ran") {
      ++ran;
      CHECK(std::stol(r[0]) == runner);
    } else {
      ++done;
      CHECK(r[3] == "done");
    }
  }
  for (auto& r : runs) CHECK(r.wait() == 0);
  CHECK(ran == 1);
  CHECK(done == processes - 1);
  const auto st = job.status_of(slot);
  CHECK(st.st == dibs::once_slot_status::state::completed);
  CHECK(st.attempts == 1);
  CHECK(st.token == token);
  CHECK_THAT(st.result, Contains(fmt::format("pid {} on ", runner)) && Contains("took"));
  CHECK(job.list().size() == 1);
}

/// A run whose process was SIGKILLed is taken over by a process standing
/// by, at once on proof (its pid gone), not after the run's 60 s lease: the
/// run is attempt 2, with a larger token.
template <class Open>
void killed_run_taken_over(Open open) {
  using Store = std::remove_cvref_t<decltype(open())>;
  test_clock clock;
  channel started;
  child host = stuck_run(open, clock, started);
  const auto msg = started.receive();
  REQUIRE(msg);
  const auto their_token = std::stoull(*msg);
  auto store = open();
  dibs::once_options o = with_clock(clock);
  o.standby = 60s;
  dibs::once<Store> job{store, "sync", 1h, o};
  std::uint32_t attempt = 0;
  dibs::version token = 0;
  auto standing_by = std::async(std::launch::async, [&] {
    return job.run([&](const auto& slot) {
      attempt = slot.attempt();
      token = slot.token();
    });
  });
  // It stands by while the run's process lives (60 s lease, renewed or not).
  CHECK(standing_by.wait_for(300ms) == std::future_status::timeout);
  const auto t0 = std::chrono::steady_clock::now();
  host.kill();
  const auto r = standing_by.get();
  CHECK(std::chrono::steady_clock::now() - t0 < 20s);  // on proof, not after the 60 s lease
  CHECK(r.outcome == dibs::once_outcome::ran);
  CHECK(attempt == 2);
  CHECK(token > their_token);
}

}  // namespace dibs_test::once_checks
