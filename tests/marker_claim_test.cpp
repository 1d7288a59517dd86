#include <dibs/file_store.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/memory_store.hpp>

#include <catch2/catch.hpp>

#include "exactly_once.hpp"
#include "support.hpp"

#include <poll.h>
#include <signal.h>

#include <random>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using Catch::Contains;
using dibs_test::temp_dir;

TEST_CASE("claim, complete, and the item stays done") {
  temp_dir dir;
  dibs::file_store store{dir.path};
  dibs::marker_claim<dibs::file_store> claims{store};
  {
    auto c = claims.try_claim("msg-1");
    REQUIRE(c);
    CHECK(c->attempts() == 1);
    CHECK(c->token() > 0);
    CHECK_FALSE(claims.try_claim("msg-1"));  // held
    CHECK(claims.status("msg-1").state == dibs::claim_state::processing);
    c->complete("order 17");
  }
  const auto s = claims.status("msg-1");
  CHECK(s.state == dibs::claim_state::completed);
  CHECK(s.result == "order 17");
  CHECK_FALSE(claims.try_claim("msg-1"));
  CHECK(claims.status("never").state == dibs::claim_state::absent);
}

TEST_CASE("leaving scope gives the item back with its attempts, and after max_attempts it is failed with the last error") {
  dibs::memory_store store;
  dibs::marker_claim<dibs::memory_store> claims{store, {.max_attempts = 3}};
  for (std::uint32_t i = 1; i <= 2; ++i) {
    auto c = claims.try_claim("job");
    REQUIRE(c);
    CHECK(c->attempts() == i);
  }
  CHECK(claims.status("job").state == dibs::claim_state::released);
  CHECK(claims.status("job").attempts == 2);
  try {
    auto c = claims.try_claim("job");
    REQUIRE(c);
    CHECK(c->release("printer on fire"));
  } catch (...) {
    FAIL("release threw");
  }
  const auto s = claims.status("job");
  CHECK(s.state == dibs::claim_state::failed);
  CHECK(s.attempts == 3);
  CHECK(s.error == "printer on fire");
  CHECK_FALSE(claims.try_claim("job"));
}

TEST_CASE("a claim that stops renewing is taken over after its lease, and its late complete() is refused") {
  dibs::memory_store store;
  dibs::marker_claim<dibs::memory_store> a{store, {.lease = 200ms}}, b{store, {.lease = 200ms}};
  auto slow = a.try_claim("item");
  REQUIRE(slow);
  CHECK_FALSE(b.try_claim("item"));  // the worker is alive (this process): only the lease can end it
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(b.try_claim("item"));
  std::this_thread::sleep_for(150ms);
  auto fast = b.try_claim("item");
  REQUIRE(fast);
  CHECK(fast->token() > slow->token());
  CHECK_THROWS_MATCHES(slow->complete(), std::system_error,
                       Catch::Predicate<std::system_error>([](const std::system_error& e) {
                         return e.code() == dibs::errc::lease_lost;
                       }));
  fast->complete();
  CHECK(a.status("item").state == dibs::claim_state::completed);
  // A renewing worker keeps its claim past the lease.
  auto kept = a.try_claim("other");
  REQUIRE(kept);
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(80ms);
    CHECK(kept->renew());
    CHECK_FALSE(b.try_claim("other"));
  }
  kept->complete();
}

TEST_CASE("the claims of a killed worker are recovered at once, one by one or by a sweep") {
  temp_dir dir;
  dibs::file_store store{dir.path};
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t worker = dibs_test::spawn([&]() -> int {
    dibs::file_store s{dir.path};
    dibs::marker_claim<dibs::file_store> c{s};
    auto a = c.try_claim("a"), b = c.try_claim("b"), d = c.try_claim("d");
    if (!a || !b || !d) return 2;
    if (::write(ready[1], "r", 1) != 1) return 3;
    for (;;) ::pause();
  });
  char ch;
  REQUIRE(::read(ready[0], &ch, 1) == 1);
  dibs::marker_claim<dibs::file_store> claims{store, {.lease = 60s}};
  CHECK_FALSE(claims.try_claim("a"));
  ::kill(worker, SIGKILL);
  dibs_test::wait_exit(worker);
  auto a = claims.try_claim("a");  // proof of death: no need to wait 60 s
  REQUIRE(a);
  CHECK(a->attempts() == 2);
  a->complete();
  const std::vector<std::string> keys{"a", "b", "d", "never"};
  CHECK(claims.sweep(keys) == 2);
  CHECK(claims.status("b").state == dibs::claim_state::released);
  CHECK(claims.status("b").attempts == 1);
  CHECK(claims.sweep(keys) == 0);
}

TEST_CASE("a record that is not a claim is reported by key") {
  dibs::memory_store store;
  REQUIRE(store.create("x", "hello"));
  dibs::marker_claim<dibs::memory_store> claims{store};
  CHECK_THROWS_WITH(claims.try_claim("x"), Contains("'x'") && Contains("not a dibs claim"));
  CHECK_THROWS_WITH(claims.status("x"), Contains("not a dibs claim"));
  CHECK_THROWS_WITH(claims.try_claim("bad/key"), Contains("invalid key"));
}

TEST_CASE("exactly once under crashes: 8 workers, 5,000 items, 20 SIGKILLs") {
  temp_dir items_dir, journal_dir;
  dibs_test::check_exactly_once_under_crashes([&] { return dibs::file_store{items_dir.path}; },
                                              [&] { return dibs::file_store{journal_dir.path}; });
}
