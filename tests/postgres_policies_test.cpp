// lease_semaphore and once on a postgres_store: the checks the other stores
// run (lease_semaphore_checks.hpp, once_checks.hpp), and what only a store
// with a server's clock has: once numbers its slots by postgres_store::now().
#include <dibs/lease_semaphore.hpp>
#include <dibs/once.hpp>
#include <dibs/stores/postgres_store.hpp>

#include <catch2/catch.hpp>

#include "lease_semaphore_checks.hpp"
#include "once_checks.hpp"
#include "pg_support.hpp"
#include "support.hpp"

#include <chrono>
#include <cstdint>
#include <string>

using namespace std::chrono_literals;
namespace pg = dibs_test::pg;

namespace postgres_policies_tests {

using sys = std::chrono::system_clock;
namespace semaphore_checks = dibs_test::semaphore_checks;
namespace once_checks = dibs_test::once_checks;

dibs::postgres_store open_table(const std::string& table, const std::string& info = pg::conninfo()) {
  return dibs::postgres_store{info, {.table = table}};
}

// The store the semaphore checks run on: a fresh table, opened again by
// open() (in a forked child, as another process would).
struct pg_fixture {
  using store_type = dibs::postgres_store;
  std::string table = pg::fresh_table("sem");
  dibs::postgres_store store = open();
  dibs::postgres_store open() const { return open_table(table); }
};

// The server's clock as a session sees it (through `info`), read as
// postgres_store::now() reads it, on a connection of its own.
sys::time_point server_time(const std::string& info = pg::conninfo()) {
  const auto ms = pg::sql("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint", info);
  return sys::time_point{std::chrono::milliseconds{std::stoll(ms)}};
}

// Checks that `t` lies in [lo, hi]; says all three if not.
void check_between(sys::time_point lo, sys::time_point t, sys::time_point hi) {
  const auto ms = [](sys::time_point p) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(p.time_since_epoch()).count();
  };
  INFO("expected " << ms(lo) << " <= " << ms(t) << " <= " << ms(hi) << " (ms since the epoch)");
  CHECK(lo <= t);
  CHECK(t <= hi);
}

// Checks that `id` is the slot of a time in [lo, hi] (slot ids sort as times).
void check_slot_between(dibs::once<dibs::postgres_store>& job, sys::time_point lo, const std::string& id,
                        sys::time_point hi) {
  INFO("expected " << job.slot_id(lo) << " <= " << id << " <= " << job.slot_id(hi));
  CHECK(job.slot_id(lo) <= id);
  CHECK(id <= job.slot_id(hi));
}

}  // namespace postgres_policies_tests

using namespace postgres_policies_tests;

// What lease_semaphore does on every store (lease_semaphore_checks.hpp),
// each section on a fresh table.
TEST_CASE("lease_semaphore on a postgres_store: the checks every store passes") {
  pg_fixture f;
  SECTION("N=3 lets three hold, the fourth only after a release") { semaphore_checks::three_hold(f); }
  SECTION("another N, N=0, bad names: a clear error and nothing written") { semaphore_checks::bad_input(f); }
  SECTION("resize grows at once, shrinking leaves holders above N their permits") { semaphore_checks::resize(f); }
  SECTION("a wait ends with errc::cancelled at a stop request, holding nothing") {
    semaphore_checks::cancelled_wait(f);
  }
  SECTION("a SIGKILLed holder's permit comes back at once on proof") { semaphore_checks::killed_holder(f); }
}

TEST_CASE("lease_semaphore chaos: N=3 on a postgres_store, 8 processes x 300, 20 SIGKILLs, 2 SIGSTOPs", "[chaos]") {
  const auto t = pg::fresh_table("semchaos");
  semaphore_checks::chaos([&] { return open_table(t); });
}

TEST_CASE("once on a postgres_store: of 4 processes that run a slot one runs it, the others find it done") {
  const auto t = pg::fresh_table("once4");
  once_checks::one_of_many_runs([&] { return open_table(t); }, 4);
}

TEST_CASE("once on a postgres_store: a run whose process was SIGKILLed is taken over by one standing by") {
  const auto t = pg::fresh_table("oncekill");
  once_checks::killed_run_taken_over([&] { return open_table(t); });
}

TEST_CASE("once on a postgres_store: now() is the server's clock, slots go by it unless options.clock is given") {
  auto s = open_table(pg::fresh_table("onceclock"));
  // now(): between two readings of the server's clock on other sessions.
  const auto before = server_time();
  const auto now = s.now();
  const auto after = server_time();
  check_between(before, now, after);

  // No options.clock: slot_id() and run() number slots by the server's clock.
  dibs::once<dibs::postgres_store> job{s, "tick", 1s};
  const auto b1 = server_time();
  const auto id = job.slot_id();
  const auto a1 = server_time();
  check_slot_between(job, b1, id, a1);
  sys::time_point start{};
  const auto b2 = server_time();
  const auto r = job.run([&](const auto& slot) { start = *slot.start(); });
  const auto a2 = server_time();
  CHECK(r.outcome == dibs::once_outcome::ran);
  check_slot_between(job, b2, r.slot, a2);
  CHECK(r.slot == job.slot_id(start));

  // options.clock, given, wins: this host's clock an hour ahead (the host
  // and the server share a clock here, to within the server's rounding to
  // the millisecond: hence the 1 ms either side).
  dibs::once_options o;
  o.clock = [] { return sys::now() + 1h; };
  dibs::once<dibs::postgres_store> ahead{s, "tick", 1s, o};
  const auto b3 = server_time();
  const auto id3 = ahead.slot_id();
  const auto a3 = server_time();
  check_slot_between(job, b3 + 1h - 1ms, id3, a3 + 1h + 1ms);
}

TEST_CASE("once on a postgres_store: a server clock an hour ahead of the host's, slots go by the server's") {
  // The server's clock an hour ahead, for the store's sessions only: a
  // clock_timestamp() of their own, found before pg_catalog's by their
  // search_path (pg_catalog named last), so that what follows the server's
  // clock and what follows the host's differ by an hour.
  const auto schema = pg::fresh_table("skew");
  pg::sql(fmt::format("CREATE SCHEMA {0}; CREATE FUNCTION {0}.clock_timestamp() RETURNS timestamptz LANGUAGE sql "
                      "VOLATILE AS 'SELECT pg_catalog.clock_timestamp() + interval ''1 hour'''",
                      schema));
  const auto ahead_info = pg::conninfo() + fmt::format(" options='-c search_path=public,{},pg_catalog'", schema);
  {
    const auto before = server_time();
    const auto skewed = server_time(ahead_info);
    const auto after = server_time();
    INFO("the search_path's clock_timestamp() is not the one the sessions use");
    check_between(before + 1h, skewed, after + 1h);
  }

  auto s = open_table(pg::fresh_table("onceskew"), ahead_info);
  const auto before = server_time();
  const auto now = s.now();
  const auto after = server_time();
  check_between(before + 1h, now, after + 1h);

  dibs::once<dibs::postgres_store> job{s, "tick", 1s};
  const auto b1 = server_time();
  const auto id = job.slot_id();
  const auto a1 = server_time();
  check_slot_between(job, b1 + 1h, id, a1 + 1h);
  const auto b2 = server_time();
  const auto r = job.run([](const auto&) {});
  const auto a2 = server_time();
  CHECK(r.outcome == dibs::once_outcome::ran);
  check_slot_between(job, b2 + 1h, r.slot, a2 + 1h);
  CHECK(job.status_of(r.slot).st == dibs::once_slot_status::state::completed);

  // This host's clock, given: an hour behind the server's (1 ms: the
  // server's rounding, as above).
  dibs::once_options o;
  o.clock = [] { return sys::now(); };
  dibs::once<dibs::postgres_store> host{s, "tick", 1s, o};
  const auto b3 = server_time();
  const auto id3 = host.slot_id();
  const auto a3 = server_time();
  check_slot_between(job, b3 - 1ms, id3, a3 + 1ms);
}
