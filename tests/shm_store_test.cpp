#include <dibs/lease_mutex.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/stores/shm_store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <signal.h>

#include <optional>
#include <random>
#include <string>
#include <vector>

using Catch::Contains;

namespace {
// A segment name of its own per test, removed at the end.
struct segment {
  std::string name = fmt::format("dibs-test-{}-{}", ::getpid(), std::random_device{}());
  segment() { dibs::shm_store::remove(name); }
  ~segment() { dibs::shm_store::remove(name); }
};
}  // namespace

TEST_CASE("shm_store passes the conformance suite, in one process and across 8", "[conformance]") {
  segment seg;
  dibs::shm_store s{seg.name};
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-"));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 4, 1000, "threads-"));
  auto open = [&] { return dibs::shm_store{seg.name}; };
  REQUIRE_NOTHROW(dibs::testing::check_create_race_processes(open, 8, "raced"));
  REQUIRE_NOTHROW(dibs::testing::check_counter_race_processes(open, 8, 1000, "counter"));
}

TEST_CASE("shm segment removed by hand while a lease is held: the new segment's tokens are larger, the old holder keeps only its own dead copy") {
  segment seg;
  std::optional<dibs::shm_store> old_store{std::in_place, seg.name};
  dibs::lease_mutex<dibs::shm_store> a{*old_store, "job", {.renew = false}};
  REQUIRE(a.try_lock());
  for (int i = 0; i < 100; ++i) REQUIRE(a.renew());
  REQUIRE(dibs::shm_store::remove(seg.name));  // what `rm /dev/shm/NAME` does
  dibs::shm_store fresh{seg.name};
  dibs::lease_mutex<dibs::shm_store> b{fresh, "job", {.renew = false}};
  REQUIRE(b.try_lock());
  CHECK(b.token() > a.token() + 100);  // above the old segment's renewals too
  b.unlock();
  a.unlock();
}

TEST_CASE("a process killed at any instant never wedges the others, nor leaves a half-written slot", "[chaos]") {
  segment seg;
  dibs::shm_store s{seg.name};
  REQUIRE(s.create("n", "0"));
  std::vector<pid_t> workers;
  auto worker = [&] {
    return dibs_test::spawn([&]() -> int {
      dibs::shm_store mine{seg.name};
      const std::string pad(3000, 'p');  // long values widen the window of a half-done copy
      for (;;) {
        auto r = mine.read("n");
        if (!r) return 2;
        const auto n = std::stoll(r->value.substr(0, r->value.find(' ')));
        (void)mine.replace("n", r->version, std::to_string(n + 1) + " " + pad);
      }
    });
  };
  for (int i = 0; i < 4; ++i) workers.push_back(worker());
  std::mt19937 rng(11);
  for (int k = 0; k < 40; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{1, 15}(rng)});
    const std::size_t v = std::uniform_int_distribution<std::size_t>{0, workers.size() - 1}(rng);
    ::kill(workers[v], SIGKILL);
    dibs_test::wait_exit(workers[v]);
    workers[v] = worker();
  }
  for (pid_t p : workers) {
    ::kill(p, SIGKILL);
    dibs_test::wait_exit(p);
  }
  const auto r = s.read("n");  // not wedged: the mutex of a dead holder is handed over
  REQUIRE(r);
  const auto space = r->value.find(' ');
  const auto n = std::stoll(r->value.substr(0, space));
  CHECK(n > 0);
  if (space != std::string::npos) CHECK(r->value.substr(space + 1) == std::string(3000, 'p'));  // whole, never half
  CHECK(s.replace("n", r->version, "done"));
}

TEST_CASE("shm_store: a full table, a bad name, a mismatched shape are clear errors") {
  segment seg;
  dibs::shm_store s{seg.name, {.capacity = 4, .max_value = 512}};
  for (int i = 0; i < 4; ++i) REQUIRE(s.create("k" + std::to_string(i), "v"));
  CHECK_THROWS_WITH(s.create("k9", "v"), Contains(seg.name) && Contains("full") && Contains("k9"));
  CHECK_THROWS_WITH(s.create("k0", std::string(513, 'x')), Contains("k0") && Contains("at most 512"));
  CHECK_THROWS_WITH((dibs::shm_store{seg.name, {.capacity = 8, .max_value = 512}}), Contains("capacity 4"));
  CHECK_THROWS_WITH(dibs::shm_store{"a/b"}, Contains("invalid segment name"));
  // Claims work on it too.
  dibs::marker_claim<dibs::shm_store> claims{s};
  auto v = s.read("k1");
  REQUIRE(s.erase("k1", v->version));
  auto c = claims.try_claim("k1");
  REQUIRE(c);
  c->complete();
  CHECK(claims.status("k1").state == dibs::claim_state::completed);
}

TEST_CASE("shm_store passes the queue checks: priorities, schedules, backoffs, claim_next_n, each item once across 4 processes", "[conformance]") {
  segment seg;
  dibs::shm_store s{seg.name};
  REQUIRE_NOTHROW(dibs::testing::check_queue(s, "q-"));
  REQUIRE_NOTHROW(dibs::testing::check_queue_race_processes([&] { return dibs::shm_store{seg.name}; }, 4, 150, "race-"));
}
