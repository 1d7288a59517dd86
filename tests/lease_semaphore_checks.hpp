// The checks of lease_semaphore that every store runs (its unit behaviour,
// and the chaos run: N=3 under SIGKILLs and SIGSTOPs with an independent
// tally), shared by lease_semaphore_test.cpp (memory, file, SQLite and
// shared-memory stores) and pg_schedules_test.cpp (PostgreSQL).
//
// A check takes a fixture: `f.store`, the store the test uses, and
// `f.open()`, which opens the same medium again (in a forked child, as
// another process would); `Fixture::store_type` is the store's type.
#pragma once

#include <dibs/file_mutex.hpp>
#include <dibs/lease_semaphore.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <future>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace dibs_test::semaphore_checks {

using namespace std::chrono_literals;
using Catch::Contains;

template <class Store>
using semaphore = dibs::lease_semaphore<Store>;

inline std::optional<dibs::record> read_key(auto& store, const std::string& key) { return store.read(key); }


/// N=3 lets three hold, the fourth only after a release, on the permit released, with a larger token.
template <class Fixture>
void three_hold(Fixture& f) {
  using Store = typename Fixture::store_type;
  semaphore<Store> sem{f.store, "exports", 3, {.lease = 30s}};
  CHECK(sem.permits() == 3);
  auto a = sem.acquire();
  auto b = sem.try_acquire();
  auto c = sem.try_acquire_for(1s);
  REQUIRE(a);
  REQUIRE(b);
  REQUIRE(c);
  CHECK(std::set<std::uint32_t>{a.index(), b.index(), c.index()} == std::set<std::uint32_t>{0, 1, 2});
  CHECK(a.token() > 0);
  CHECK_FALSE(a.lost());
  CHECK_FALSE(sem.try_acquire());
  CHECK_FALSE(sem.try_acquire_for(50ms));

  // holders(): who holds which permit, with the token each was given.
  const auto hs = sem.holders();
  REQUIRE(hs.size() == 3);
  for (const auto& h : hs) {
    CHECK(h.holder.pid == static_cast<long>(::getpid()));
    CHECK_FALSE(h.above_limit);
    CHECK_FALSE(h.holder.gone);
    CHECK(h.holder.since.has_value());
    const auto& p = h.permit == a.index() ? a : h.permit == b.index() ? b : c;
    CHECK(h.holder.token == p.token());
  }
  CHECK(a.holder()->mine);

  // A release lets the next one in, on the permit that was released, with a
  // larger token than that permit ever had.
  const auto b_index = b.index();
  auto b_token = b.token();
  b.release();
  CHECK_FALSE(b);
  auto d = sem.try_acquire();
  REQUIRE(d);
  CHECK(d.index() == b_index);
  CHECK(d.token() > b_token);
  // Tokens grow per permit, acquisition after acquisition.
  for (int i = 0; i < 5; ++i) {
    b_token = d.token();
    d.release();
    d = sem.acquire();
    CHECK(d.index() == b_index);
    CHECK(d.token() > b_token);
  }

  // A waiter in acquire() gets in when a permit is released; a moved permit
  // stays held and its new owner releases it.
  auto moved = std::move(a);
  CHECK_FALSE(a);
  CHECK(moved);
  auto waiter = std::async(std::launch::async, [&] { return sem.acquire(); });
  CHECK(waiter.wait_for(50ms) == std::future_status::timeout);
  const auto freed = moved.index();
  moved = {};
  REQUIRE(waiter.wait_for(20s) == std::future_status::ready);
  auto e = waiter.get();
  CHECK(e.index() == freed);
  e.release();
  c.release();
  d.release();
  CHECK(sem.holders().empty());
}

/// Another N, N=0, bad names: a clear error and nothing written.
template <class Fixture>
void bad_input(Fixture& f) {
  using Store = typename Fixture::store_type;
  auto invalid = [](auto&& make, const std::string& says) {
    try {
      make();
      FAIL("no error");
    } catch (const std::system_error& e) {
      CHECK(e.code() == dibs::errc::invalid_argument);
      CHECK_THAT(e.what(), Contains(says));
    }
  };
  invalid([&] { semaphore<Store>{f.store, "jobs", 0}; }, "0 permits: a semaphore has 1 to 10000 permits");
  invalid([&] { semaphore<Store>{f.store, "jobs", 10'001}; }, "10001 permits");
  invalid([&] { semaphore<Store>{f.store, "", 3}; }, "invalid name '': a semaphore's name must not be empty");
  invalid([&] { semaphore<Store>{f.store, std::string(998, 'n'), 3}; }, "must be at most 997 bytes (it has 998)");
  invalid([&] { semaphore<Store>{f.store, "jobs", 3, {.lease = 1ms}}; }, "lease must be at least 3 ms");
  invalid([&] { semaphore<Store>::resize(f.store, "jobs", 3); }, "there is no semaphore 'jobs'");
  CHECK(f.store.keys().empty());  // nothing written by any of them

  // A name of 997 bytes (whose permit keys are as long as a key may be),
  // and any bytes, are names.
  semaphore<Store> long_one{f.store, std::string(997, 'n'), 10'000};
  CHECK(long_one.try_acquire());
  semaphore<Store> odd_one{f.store, std::string("a/b\0c%.", 7), 2};
  CHECK(odd_one.try_acquire());

  semaphore<Store> sem{f.store, "jobs", 3};
  auto p = sem.acquire();
  const auto before = read_key(f.store, "dibs-semaphore:jobs");
  REQUIRE(before);
  CHECK(before->value == "dibs-semaphore 1\npermits 3\nhighest 3\n");
  CHECK(read_key(f.store, "dibs-semaphore-permit-" + std::to_string(p.index()) + ":jobs"));
  invalid([&] { semaphore<Store>{f.store, "jobs", 4}; },
          "opened with 4 permits, but the semaphore has 3 (its record 'dibs-semaphore:jobs' says so)");
  invalid([&] { semaphore<Store>::resize(f.store, "jobs", 0); }, "0 permits");
  CHECK(read_key(f.store, "dibs-semaphore:jobs") == before);  // unchanged
  semaphore<Store> same{f.store, "jobs", 3};                  // the same N opens it
  CHECK(same.holders().size() == 1);

  // A key that holds something else is reported, not taken for a semaphore.
  REQUIRE(f.store.create("dibs-semaphore:other", "a user's value"));
  try {
    semaphore<Store> other{f.store, "other", 2};
    FAIL("no error");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::corrupt_record);
    CHECK_THAT(e.what(), Contains("is not a dibs semaphore's"));
  }

  // The semaphore's record removed by hand: an acquisition says so, rather
  // than guess how many permits there are.
  const auto rec = f.store.read("dibs-semaphore:jobs");
  REQUIRE(rec);
  REQUIRE(f.store.erase("dibs-semaphore:jobs", rec->version));
  try {
    (void)same.try_acquire();
    FAIL("no error");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::corrupt_record);
    CHECK_THAT(e.what(), Contains("is gone"));
  }
}

/// resize grows at once; shrinking leaves holders above N their permits.
template <class Fixture>
void resize(Fixture& f) {
  using Store = typename Fixture::store_type;
  semaphore<Store> sem{f.store, "builds", 3, {.lease = 30s}};
  std::vector<typename semaphore<Store>::permit> held(3);
  for (auto& p : held) p = sem.acquire();
  auto at = [&](std::uint32_t i) -> typename semaphore<Store>::permit& {
    return *std::find_if(held.begin(), held.end(), [&](auto& p) { return p.index() == i; });
  };

  CHECK(semaphore<Store>::resize(f.store, "builds", 2) == 3);
  CHECK(read_key(f.store, "dibs-semaphore:builds")->value == "dibs-semaphore 1\npermits 2\nhighest 3\n");
  // Permit 2's holder keeps it, marked above the limit.
  auto hs = sem.holders();
  REQUIRE(hs.size() == 3);
  CHECK(hs[2].permit == 2);
  CHECK(hs[2].above_limit);
  CHECK_FALSE(hs[0].above_limit);
  CHECK_FALSE(at(2).lost());
  CHECK_FALSE(sem.try_acquire());
  // Released, permit 2 is not handed out again; permit 0 is.
  at(2).release();
  CHECK_FALSE(sem.try_acquire());
  CHECK_FALSE(sem.try_acquire_for(30ms));
  at(0).release();
  auto again = sem.try_acquire();
  REQUIRE(again);
  CHECK(again.index() == 0);
  CHECK(sem.permits() == 2);
  // New objects open it with the new N only.
  CHECK_THROWS_AS((semaphore<Store>{f.store, "builds", 3}), std::system_error);
  semaphore<Store> other{f.store, "builds", 2};
  CHECK_FALSE(other.try_acquire());

  // Growing: the new permits can be taken at once, also by a waiter that
  // waits already (it reads N again each time it looks).
  auto waiter = std::async(std::launch::async, [&] { return other.acquire(); });
  CHECK(waiter.wait_for(50ms) == std::future_status::timeout);
  CHECK(semaphore<Store>::resize(f.store, "builds", 4) == 2);
  REQUIRE(waiter.wait_for(20s) == std::future_status::ready);
  auto w = waiter.get();
  auto x = sem.try_acquire();
  REQUIRE(x);
  CHECK(std::set<std::uint32_t>{w.index(), x.index()} == std::set<std::uint32_t>{2, 3});
  CHECK_FALSE(sem.try_acquire());
  CHECK(read_key(f.store, "dibs-semaphore:builds")->value == "dibs-semaphore 1\npermits 4\nhighest 4\n");
  CHECK(sem.holders().size() == 4);
}

/// A wait ends with errc::cancelled at a stop request, holding nothing.
template <class Fixture>
void cancelled_wait(Fixture& f) {
  using Store = typename Fixture::store_type;
  semaphore<Store> sem{f.store, "one", 1, {.lease = 30s}};
  auto p = sem.acquire();
  SECTION("acquire(stop_token)") {
    const auto r = dibs_test::cancel_after(200ms, [&](std::stop_token st) { (void)sem.acquire(st); });
    CHECK(r.code == dibs::errc::cancelled);
    CHECK(r.waited >= 200ms);
    CHECK(r.waited < 200ms + 1500ms);  // at the stop, not never; wide for a loaded machine
  }
  SECTION("try_acquire_for(4s, stop_token)") {
    const auto r = dibs_test::cancel_after(200ms, [&](std::stop_token st) { (void)sem.try_acquire_for(4s, st); });
    CHECK(r.code == dibs::errc::cancelled);
    CHECK(r.waited < 200ms + 1500ms);
  }
  CHECK(sem.holders().size() == 1);
  p.release();
  std::stop_source done;
  done.request_stop();
  CHECK_THROWS_AS(sem.acquire(done.get_token()), std::system_error);  // a stop already requested: not even a free permit
  CHECK(sem.holders().empty());
}

/// A SIGKILLed holder's permit comes back at once on proof (needs f.open()).
template <class Fixture>
void killed_holder(Fixture& f) {
  using Store = typename Fixture::store_type;
  semaphore<Store> sem{f.store, "jobs", 2, {.lease = 60s}};
  channel held;
  dibs_test::child holder{dibs_test::spawn([&]() -> int {
    auto store = f.open();
    // renew off: the lease outlasts the test, and no thread is started in a
    // child forked from a process with threads.
    semaphore<Store> mine{store, "jobs", 2, {.lease = 60s, .renew = false}};
    auto p = mine.acquire();
    held.send(fmt::format("held {} {}", p.index(), p.token()));
    for (;;) ::pause();
  })};
  const auto msg = held.receive();
  REQUIRE(msg);
  const auto w = words(*msg);
  REQUIRE(w.size() == 3);
  const auto child_index = static_cast<std::uint32_t>(std::stoul(w[1]));
  const auto child_token = std::stoull(w[2]);

  auto mine = sem.acquire();
  CHECK(mine.index() != child_index);
  CHECK_FALSE(sem.try_acquire());  // the child is alive: its permit is respected
  auto hs = sem.holders();
  REQUIRE(hs.size() == 2);
  const auto& theirs = hs[0].permit == child_index ? hs[0] : hs[1];
  CHECK(theirs.holder.pid == holder.pid());
  CHECK(theirs.holder.token == child_token);
  CHECK_FALSE(theirs.holder.gone);

  holder.kill();
  CHECK(sem.holders()[child_index].holder.gone);
  const auto t0 = std::chrono::steady_clock::now();
  auto back = sem.try_acquire_for(20s);
  REQUIRE(back);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);  // at once (ms), far below the 60 s lease; wide for a loaded machine
  CHECK(back.index() == child_index);
  CHECK(back.token() > child_token);
}

// ---- the chaos run ----------------------------------------------------------

// What the workers of the chaos test share: mapped before the fork.
struct chaos_shared {
  std::atomic<long> acked;          // acquisitions done and released
  std::atomic<int> inside[8];       // the pid of the worker of this place while it is inside its held section
  std::atomic<int> doomed[64];      // pids the test kills or stops (an eviction of any other holder is a violation)
  std::atomic<int> doomed_count;
  std::atomic<bool> kills_over;     // until then, workers go on past their cycles (so that every kill lands)
};

// The independent count of holders: a tally file, changed only under a
// kernel lock (file_mutex: released if its holder is killed) and replaced
// whole (a killed writer leaves the old tally or the new one). Per permit:
// the largest token seen (a fence) and the pid inside with it (0: none).
struct tally {
  static constexpr int permits = 3;
  unsigned long long fence[permits] = {};
  long occupant[permits] = {};
  long enters = 0, exits = 0, lost_exits = 0, evicted_dead = 0, evicted_stopped = 0, violations = 0, most_inside = 0;
  std::string why;  // the first violation

  static tally load(const fs::path& p) {
    tally t;
    std::ifstream in(p);
    for (int i = 0; i < permits; ++i) in >> t.fence[i] >> t.occupant[i];
    in >> t.enters >> t.exits >> t.lost_exits >> t.evicted_dead >> t.evicted_stopped >> t.violations >> t.most_inside;
    std::getline(in >> std::ws, t.why);
    return t;
  }
  void save(const fs::path& p) const {
    std::ostringstream out;
    for (int i = 0; i < permits; ++i) out << fence[i] << ' ' << occupant[i] << '\n';
    out << enters << ' ' << exits << ' ' << lost_exits << ' ' << evicted_dead << ' ' << evicted_stopped << ' '
        << violations << ' ' << most_inside << '\n'
        << why << '\n';
    dibs_test::spit(p.string() + ".tmp", out.str());
    fs::rename(p.string() + ".tmp", p);
  }
  void violation(std::string what) {
    if (violations++ == 0) why = std::move(what);
  }
};

inline bool is_dead_or_stopped(const chaos_shared& s, long pid, bool& stopped) {
  const int n = s.doomed_count.load();
  for (int i = 0; i < n && i < 64; ++i) {
    const int d = s.doomed[i].load();
    if (d == pid) return stopped = false, true;
    if (d == -pid) return stopped = true, true;
  }
  return false;
}

// N=3, 8 processes x 300 acquisitions (at least: each goes on until the
// kills are over, so that every kill finds its victim running), 20 SIGKILLs (at least half of them of
// holders inside their held section) and 2 SIGSTOPs of holders past the
// lease, on the store that open() opens in each process (each worker opens
// its own after the fork: no connection or handle is shared across one).
template <class Open>
void chaos(Open open) {
  using Store = std::remove_cvref_t<decltype(open())>;
  constexpr int workers = 8, cycles = 300, kills = 20, permits = 3;
  constexpr auto lease = 2s;
  temp_dir dir;
  const auto tally_path = dir.path / "tally";
  tally{}.save(tally_path);
  const auto tally_lock = dir.path / "tally.lock";
  auto* shared = static_cast<chaos_shared*>(
      ::mmap(nullptr, sizeof(chaos_shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  REQUIRE(shared != MAP_FAILED);
  new (shared) chaos_shared{};
  {
    auto store = open();
    semaphore<Store> make{store, "chaos", permits};
  }

  auto start_worker = [&](int place) {
    return dibs_test::spawn([&, place]() -> int {
      auto store = open();
      semaphore<Store> sem{store, "chaos", permits, {.lease = lease}};
      dibs::file_mutex guard{tally_lock};
      const long me = static_cast<long>(::getpid());
      for (int k = 0; k < cycles || !shared->kills_over.load(); ++k) {
        auto p = sem.acquire();
        const auto i = p.index();
        const auto token = p.token();
        {
          std::scoped_lock g{guard};
          auto t = tally::load(tally_path);
          ++t.enters;
          if (i >= permits) {
            t.violation(fmt::format("permit {} of {} handed out", i, permits));
          } else {
            if (token <= t.fence[i])
              t.violation(fmt::format("permit {}: token {} after token {}", i, token, t.fence[i]));
            if (t.occupant[i] != 0) {
              bool stopped = false;
              if (!is_dead_or_stopped(*shared, t.occupant[i], stopped))
                t.violation(fmt::format("permit {}: pid {} took it from pid {}, which runs", i, me, t.occupant[i]));
              ++(stopped ? t.evicted_stopped : t.evicted_dead);
            }
            t.fence[i] = token;
            t.occupant[i] = me;
            const long now = std::count_if(std::begin(t.occupant), std::end(t.occupant), [](long o) { return o != 0; });
            t.most_inside = std::max(t.most_inside, now);
          }
          t.save(tally_path);
        }
        shared->inside[place] = static_cast<int>(me);
        std::this_thread::sleep_for(1ms);  // the work the permit guards
        shared->inside[place] = 0;
        const bool lost = p.lost();
        {
          std::scoped_lock g{guard};
          auto t = tally::load(tally_path);
          if (t.fence[i] == token && t.occupant[i] == me) {
            if (lost) t.violation(fmt::format("pid {} lost permit {} that no one took", me, i));
            ++t.exits;
            t.occupant[i] = 0;
          } else {
            // Taken over while this holder stood still: its write is refused
            // by the fence, and it knows it lost the permit.
            if (!lost) t.violation(fmt::format("pid {}: permit {} taken over, lost() false", me, i));
            ++t.lost_exits;
          }
          t.save(tally_path);
        }
        p.release();
        ++shared->acked;
      }
      return 0;
    });
  };
  std::vector<dibs_test::child> pids;
  for (int w = 0; w < workers; ++w) pids.emplace_back(start_worker(w));
  auto read_tally = [&] {
    dibs::file_mutex guard{tally_lock};
    std::scoped_lock g{guard};
    return tally::load(tally_path);
  };
  // Returns: the place of a worker that is stopped (SIGSTOP, confirmed)
  // inside its held section, marked doomed as `mark` (pid or -pid) first.
  auto stop_one_inside = [&](bool for_kill) -> int {
    for (const auto end = std::chrono::steady_clock::now() + 60s; std::chrono::steady_clock::now() < end;) {
      for (int w = 0; w < workers; ++w) {
        const int pid = shared->inside[w].load();
        if (pid == 0 || pid != pids[static_cast<std::size_t>(w)].pid()) continue;
        const int slot = shared->doomed_count.load();
        shared->doomed[slot] = for_kill ? pid : -pid;
        ++shared->doomed_count;
        ::kill(pid, SIGSTOP);
        int status = 0;
        REQUIRE(::waitpid(pid, &status, WUNTRACED) == pid);
        REQUIRE(WIFSTOPPED(status));
        if (shared->inside[w].load() == pid) return w;
        shared->doomed[slot] = 0;  // it left before the stop landed
        --shared->doomed_count;
        ::kill(pid, SIGCONT);
      }
      std::this_thread::yield();
    }
    FAIL("no worker was found inside its held section for 60 s");
    return -1;
  };
  auto progress_since = [&](long acked) {
    return dibs_test::eventually([&] { return shared->acked.load() >= acked + 20; }, 60s);
  };
  std::mt19937 rng(33);
  int stops = 0;
  for (int k = 0; k < kills; ++k) {
    REQUIRE(progress_since(shared->acked.load()));
    if (k == 5 || k == 12) {
      // A holder stopped past its lease: its permit is taken over (by proof
      // (b): unchanged for a lease), then it runs on and finds it lost.
      const int w = stop_one_inside(false);
      const long pid = pids[static_cast<std::size_t>(w)].pid();
      ++stops;
      tally seen;
      CHECK(dibs_test::eventually([&] { return (seen = read_tally()).evicted_stopped >= stops || seen.violations; }, 60s));
      INFO("first violation: " << seen.why);
      REQUIRE(seen.violations == 0);
      ::kill(static_cast<pid_t>(pid), SIGCONT);
      CHECK(dibs_test::eventually([&] { return (seen = read_tally()).lost_exits >= stops || seen.violations; }, 60s));
      REQUIRE(seen.violations == 0);
      REQUIRE(seen.lost_exits >= stops);
      shared->doomed[shared->doomed_count.load() - 1] = 0;  // running again: no one may take its permits now
    }
    // Half the kills land inside a held section; the others anywhere.
    int w;
    if (k % 2 == 0) {
      w = stop_one_inside(true);
    } else {
      w = std::uniform_int_distribution<int>{0, workers - 1}(rng);
      const int slot = shared->doomed_count.load();
      shared->doomed[slot] = pids[static_cast<std::size_t>(w)].pid();
      ++shared->doomed_count;
    }
    shared->inside[w] = 0;
    CHECK(pids[static_cast<std::size_t>(w)].kill() == 128 + SIGKILL);
    pids[static_cast<std::size_t>(w)] = dibs_test::child{start_worker(w)};  // the replacement does a whole run
  }
  shared->kills_over = true;
  int failed = 0;
  for (auto& p : pids) failed += p.wait() != 0;
  const auto t = read_tally();
  INFO("enters " << t.enters << ", exits " << t.exits << ", lost exits " << t.lost_exits << ", evicted dead "
                 << t.evicted_dead << ", evicted stopped " << t.evicted_stopped << ", most inside " << t.most_inside
                 << ", acked " << shared->acked.load() << ", first violation: " << t.why);
  CHECK(failed == 0);
  CHECK(t.violations == 0);
  CHECK(t.most_inside <= permits);
  CHECK(t.evicted_stopped == 2);
  CHECK(t.lost_exits == 2);
  CHECK(shared->acked.load() >= workers * cycles);
  // Every entry left by an exit, or was taken over (from a killed holder, or
  // a stopped one, which then exited lost), or is a killed holder's still.
  const long left = std::count_if(std::begin(t.occupant), std::end(t.occupant), [](long o) { return o != 0; });
  CHECK(t.enters == t.exits + t.evicted_dead + t.evicted_stopped + left);
  CHECK(t.evicted_dead + left >= kills / 2);  // the kills inside a held section, at least
  // Every acknowledged acquisition was counted in; at most one more per kill.
  CHECK(t.enters >= shared->acked.load());
  CHECK(t.enters <= shared->acked.load() + kills + 2);
  // The permits of killed holders left in place come back on proof, at once.
  auto store = open();
  semaphore<Store> sem{store, "chaos", permits, {.lease = 60s}};
  std::vector<typename semaphore<Store>::permit> all;
  for (int i = 0; i < permits; ++i) {
    all.push_back(sem.try_acquire_for(20s));
    CHECK(all.back());
  }
  for (const auto& h : sem.holders()) CHECK(h.holder.pid == static_cast<long>(::getpid()));
  ::munmap(shared, sizeof(chaos_shared));
}

}  // namespace dibs_test::semaphore_checks
