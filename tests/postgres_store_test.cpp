#include <dibs/lease_mutex.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/postgres_store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>

#include "exactly_once.hpp"
#include "pg_support.hpp"
#include "support.hpp"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

using namespace std::chrono_literals;
using Catch::Contains;
namespace pg = dibs_test::pg;

namespace {

dibs::postgres_store pg_open(const std::string& table, const std::string& info = pg::conninfo()) {
  return dibs::postgres_store{info, {.table = table}};
}

}  // namespace

TEST_CASE("postgres_store passes the conformance suite, in one process and across 8") {
  const auto t = pg::fresh_table("conf");
  auto s = pg_open(t);
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-"));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 8, 100, "thr-"));
  REQUIRE_NOTHROW(dibs::testing::check_create_race_processes([&] { return pg_open(t); }, 8, "race-create"));
  REQUIRE_NOTHROW(dibs::testing::check_counter_race_processes([&] { return pg_open(t); }, 8, 200, "race-counter"));
}

TEST_CASE("records are rows a person can query, in a table dibs made and marked with its schema version") {
  const auto t = pg::fresh_table("rows");
  auto s = pg_open(t);
  REQUIRE(s.create("<m1/x@example.com>", "hello"));
  CHECK(pg::sql(fmt::format("SELECT convert_from(value, 'UTF8') FROM {} WHERE key = convert_to('<m1/x@example.com>', "
                            "'UTF8')",
                            t)) == "hello");
  CHECK(pg::sql(fmt::format("SELECT obj_description('{}'::regclass, 'pg_class')", t)) == "dibs-store 1");
  // A second store on the same table (another process's) checks and keeps it.
  auto again = pg_open(t);
  CHECK(again.read("<m1/x@example.com>")->value == "hello");
}

TEST_CASE("bad input: a wrong password, no server, a table of another shape, a read-only role") {
  const std::string server = fmt::format("127.0.0.1:{}/dibs", pg::port());
  // A wrong password: not transient, naming the server.
  std::string info = pg::conninfo();
  info.replace(info.find("password=") + 9, info.find(' ', info.find("password=")) - info.find("password=") - 9, "wrong");
  try {
    pg_open(pg::fresh_table("pw"), info);
    FAIL("a wrong password was accepted");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::postgres::make_error_code("28P01"));
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("cannot connect to " + server) && Contains("password"));
  }
  // No server there: transient (it may be restarting), naming where.
  try {
    pg_open("x", "host=127.0.0.1 port=1 user=dibs dbname=dibs connect_timeout=2");
    FAIL("connected to nothing");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::connection_lost);
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("cannot connect to 127.0.0.1:1/dibs"));
  }
  // A table of another shape under the name: refused, and left as it was.
  const auto other = pg::fresh_table("other");
  pg::sql(fmt::format("CREATE TABLE {} (key text PRIMARY KEY, value text)", other));
  try {
    pg_open(other);
    FAIL("a foreign table was taken");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::corrupt_record);
    CHECK_THAT(e.what(), Contains("table '" + other + "' on " + server) && Contains("not a dibs store table"));
  }
  CHECK(pg::sql(fmt::format("SELECT count(*) FROM information_schema.columns WHERE table_name = '{}'", other)) == "2");
  // A role that may only read: reads work; a write is refused, not
  // transient, naming the table; nothing is written.
  const auto t = pg::fresh_table("ro");
  auto s = pg_open(t);
  REQUIRE(s.create("k", "v"));
  const auto role = pg::fresh_table("reader");
  pg::sql(fmt::format("CREATE ROLE {} LOGIN PASSWORD 'pw'; GRANT SELECT ON {} TO {}", role, t, role));
  std::string ro_info = pg::conninfo();
  ro_info.replace(ro_info.find("user=dibs"), 9, "user=" + role);
  ro_info.replace(ro_info.find("password=") + 9,
                  ro_info.find(' ', ro_info.find("password=")) - ro_info.find("password=") - 9, "pw");
  auto ro = pg_open(t, ro_info);
  CHECK(ro.read("k")->value == "v");
  try {
    (void)ro.create("new", "v");
    FAIL("a read-only role wrote");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::postgres::make_error_code("42501"));
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("table '" + t + "'") && Contains("permission denied"));
  }
  CHECK_FALSE(s.read("new"));
  // A role that may not create the table: the error says so.
  CHECK_THROWS_WITH(pg_open(pg::fresh_table("nocreate"), ro_info), Contains("create the table") && Contains(server));
}

TEST_CASE("a write whose reply was lost is outcome_unknown, never a lost race, and reading back resolves it") {
  const auto t = pg::fresh_table("lost");
  pg::proxy net;
  auto s = pg_open(t, net.conninfo());
  const auto v1 = s.create("k", "one");
  REQUIRE(v1);

  // Applied, reply lost: the store says it does not know.
  net.lose_reply();
  try {
    (void)s.replace("k", *v1, "two");
    FAIL("a write whose reply was lost returned");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::outcome_unknown);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("may or may not have been applied"));
  }
  CHECK(net.lost() == 1);
  // The next operation reconnects, ends the old session (still open behind
  // the proxy) and reads what is final: the write was applied, once.
  const auto r = s.read("k");
  REQUIRE(r);
  CHECK(r->value == "two");
  CHECK(r->version == *v1 + 1);

  // The policies' path resolves it: applied, by its own value.
  net.lose_reply();
  CHECK(dibs::detail::store_replace(s, "k", *v1 + 1, "three", dibs::time_limit::max()) == *v1 + 2);
  // Not applied (the request was lost): made again, exactly once.
  net.lose_request();
  CHECK(dibs::detail::store_replace(s, "k", *v1 + 2, "four", dibs::time_limit::max()) == *v1 + 3);
  net.lose_request();
  CHECK(dibs::detail::store_create(s, "fresh", "mine", dibs::time_limit::max()) == dibs::version{1});
  CHECK(net.lost() == 4);
  CHECK(s.read("k") == dibs::record{"four", *v1 + 3});
  // No session of ours is left behind the proxy.
  CHECK(pg::sql("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'dibs' AND state = 'idle' "
                "AND backend_start < now() - interval '1 hour'") == "0");
}

TEST_CASE("a lock taken through a lost reply is held, with the token the record has") {
  const auto t = pg::fresh_table("lostlock");
  pg::proxy net;
  auto s = pg_open(t, net.conninfo());
  dibs::lease_mutex<dibs::postgres_store> lock{s, "job", {.lease = 5s}};
  net.lose_reply();
  lock.lock();
  CHECK(net.lost() == 1);
  auto other_store = pg_open(t);
  dibs::lease_mutex<dibs::postgres_store> other{other_store, "job", {.lease = 5s}};
  CHECK_FALSE(other.try_lock());
  CHECK(lock.token() == other_store.read("job")->version);
  lock.unlock();
  CHECK(other.try_lock());
  other.unlock();
}

TEST_CASE("a timed operation gives up at its deadline with nothing changed while another session holds the row") {
  const auto t = pg::fresh_table("timed");
  auto s = pg_open(t);
  const auto v = s.create("k", "v");
  // Another session holds the row's lock in an open transaction.
  std::unique_ptr<PGconn, decltype(&::PQfinish)> c{::PQconnectdb(pg::conninfo().c_str()), ::PQfinish};
  REQUIRE(::PQstatus(c.get()) == CONNECTION_OK);
  ::PQclear(::PQexec(c.get(), "BEGIN"));
  ::PQclear(::PQexec(c.get(), fmt::format("SELECT 1 FROM {} FOR UPDATE", t).c_str()));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)s.replace("k", *v, "mine", std::chrono::steady_clock::now() + 300ms);
    FAIL("the replace did not give up");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::timed_out);
    CHECK_THAT(e.what(), Contains("cancelled (nothing changed)"));
  }
  CHECK(dibs_test::ms_since(t0) < 3000);
  ::PQclear(::PQexec(c.get(), "COMMIT"));
  CHECK(s.read("k") == dibs::record{"v", *v});
  CHECK(s.replace("k", *v, "mine") == *v + 1);
}

TEST_CASE("exactly once on PostgreSQL: 8 workers, 5,000 items, 20 SIGKILLs") {
  const auto items = pg::fresh_table("items"), journal = pg::fresh_table("journal");
  dibs_test::check_exactly_once_under_crashes([&] { return pg_open(items); }, [&] { return pg_open(journal); });
}

TEST_CASE("exactly once while the server is killed with SIGKILL twice and restarted on the same data") {
  const auto items = pg::fresh_table("crash_items"), journal = pg::fresh_table("crash_journal");
  std::atomic<int> crashes{0};
  dibs_test::check_exactly_once_under_crashes(
      [&] { return pg_open(items); }, [&] { return pg_open(journal); }, 8, 5000, 10, [&](const std::function<bool()>& done) {
        for (int i = 0; i < 2 && !done(); ++i) {
          std::this_thread::sleep_for(700ms);
          if (done()) break;
          pg::script("kill");
          pg::script("restart");
          ++crashes;
        }
      });
  INFO("server crashes during the run: " << crashes.load());
  CHECK(crashes.load() == 2);
}

TEST_CASE("a lease on PostgreSQL is judged by the server's clock: a new waiter takes a lease run out at once") {
  const auto t = pg::fresh_table("clock");
  // A holder that stops renewing (renewal off, never unlocks), in a process
  // that lives on: no proof of death, only the lease.
  dibs_test::channel ch;
  const pid_t holder = dibs_test::spawn([&] {
    auto s = pg_open(t);
    dibs::lease_mutex<dibs::postgres_store> lock{s, "job", {.lease = 600ms, .renew = false}};
    lock.lock();
    ch.send("held");
    std::this_thread::sleep_for(60s);  // alive until killed
    return 0;
  });
  REQUIRE(ch.receive() == "held");
  auto s = pg_open(t);
  dibs::lease_mutex<dibs::postgres_store> waiter{s, "job", {.lease = 600ms}};
  CHECK_FALSE(waiter.try_lock());  // the lease still runs
  std::this_thread::sleep_for(700ms);
  // A waiter that has never seen the record before: the server says it is
  // older than its lease, so one try takes it (watching would need a lease more).
  dibs::lease_mutex<dibs::postgres_store> newcomer{s, "job", {.lease = 600ms}};
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(newcomer.try_lock());
  CHECK(dibs_test::ms_since(t0) < 300);
  newcomer.unlock();
  ::kill(holder, SIGKILL);
  dibs_test::wait_exit(holder);
}

TEST_CASE("a waiter on PostgreSQL wakes on the holder's unlock (NOTIFY), not on its next poll") {
  const auto t = pg::fresh_table("notify");
  auto s = pg_open(t);
  dibs::lease_mutex<dibs::postgres_store> holder{s, "job", {.lease = 30s}};
  holder.lock();
  std::atomic<long long> woke_ns{0};
  long long unlocked_ns = 0;
  std::thread waiter([&] {
    auto ws = pg_open(t);
    // Polling alone would take up to 2 s here.
    dibs::lease_mutex<dibs::postgres_store> w{
        ws, "job", {.lease = 30s, .wait = dibs::exponential_backoff{1ms, 2.0, 2s, dibs::jitter::none}}};
    w.lock();
    woke_ns = dibs_test::steady_ns();
    w.unlock();
  });
  std::this_thread::sleep_for(1500ms);  // the waiter's polls have backed off to their longest
  unlocked_ns = dibs_test::steady_ns();
  holder.unlock();
  waiter.join();
  const auto handoff_ms = (woke_ns.load() - unlocked_ns) / 1'000'000;
  INFO("handoff after unlock: " << handoff_ms << " ms");
  CHECK(handoff_ms < 100);
}

TEST_CASE("claim_next on PostgreSQL: 8 workers take 3,000 offered items without knowing their keys, 10 SIGKILLs, each done once") {
  const auto items = pg::fresh_table("queue"), journal = pg::fresh_table("queue_journal");
  dibs_test::check_claim_next_exactly_once([&] { return pg_open(items); }, [&] { return pg_open(journal); }, 8, 3000, 10,
                                           1500ms);
}

TEST_CASE("claim_next takes rows an application inserted with value NULL, and never a purged one") {
  const auto t = pg::fresh_table("rowsq");
  auto s = pg_open(t);
  pg::sql(fmt::format("INSERT INTO {} (key) VALUES ('\\x6d31'::bytea), ('\\x6d32'::bytea)", t));  // m1, m2
  dibs::marker_claim<dibs::postgres_store> claims{s, {.renew = false}};
  auto a = claims.claim_next("m");
  REQUIRE(a);
  CHECK(a->key() == "m1");
  CHECK(a->attempts() == 1);
  a->complete();
  CHECK(claims.purge(0ms, [](std::string_view) { return true; }) == 1);
  auto b = claims.claim_next("m");
  REQUIRE(b);
  CHECK(b->key() == "m2");
  CHECK_FALSE(claims.claim_next("m"));  // m1 was purged: not offered again
  b->release("try later");
  auto c = claims.claim_next("m");
  REQUIRE(c);
  CHECK(c->key() == "m2");
  CHECK(c->attempts() == 2);
  CHECK(c->token() > b->token());
  c->complete();
}
