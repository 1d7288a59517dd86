#include <dibs/lease_mutex.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/stores/sqlite_store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>

#include "exactly_once.hpp"
#include "support.hpp"

#include <signal.h>
#include <sys/stat.h>

#include <atomic>
#include <string>
#include <thread>

using namespace std::chrono_literals;
using Catch::Contains;
using dibs_test::slurp;
using dibs_test::spit;
using dibs_test::temp_dir;

namespace {
bool has_code(const std::system_error& e, std::error_code ec) { return e.code() == ec; }
}  // namespace

TEST_CASE("sqlite_store passes the conformance suite, in one process and across 8", "[conformance]") {
  temp_dir dir;
  const auto db = dir.path / "store.db";
  {
    dibs::sqlite_store s{db};
    REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
    REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
    REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-"));
    REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 4, 500, "threads-"));
    REQUIRE_NOTHROW(dibs::testing::check_removed_by_hand(s, "hand-", [&](std::string_view key) {
      dibs::sqlite::connection by_hand{db};  // a person's sqlite3 shell, say
      auto del = by_hand.prepare("DELETE FROM dibs_records WHERE key = ?1");
      del.bind(1, key);
      (void)del.step();
      REQUIRE(by_hand.query_int64("SELECT changes()") == 1);
    }));
  }  // closed before forking: SQLite forbids a connection open across fork() to the same file
  auto open = [&] { return dibs::sqlite_store{db}; };
  REQUIRE_NOTHROW(dibs::testing::check_create_race_processes(open, 8, "raced"));
  REQUIRE_NOTHROW(dibs::testing::check_counter_race_processes(open, 8, 1000, "counter"));
}

TEST_CASE("the database is in WAL mode and the records are rows a person can query") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db", "claims"};
  REQUIRE(s.create("msg-1", "hello"));
  dibs::sqlite::connection db{dir.path / "q.db"};
  auto mode = db.prepare("PRAGMA journal_mode");
  REQUIRE(mode.step());
  CHECK(mode.column_text(0) == "wal");
  auto row = db.prepare("SELECT value, version FROM claims WHERE key = 'msg-1'");
  REQUIRE(row.step());
  CHECK(row.column_text(0) == "hello");
  CHECK(row.column_int64(1) == 1);
  row.reset();  // a statement left on a row keeps its read snapshot open
  mode.reset();
  CHECK(db.query_int64("SELECT count(*) FROM claims WHERE value LIKE 'hel%' AND typeof(value) = 'text'") == 1);
  std::string bytes = "a";
  bytes += '\0';
  REQUIRE(s.create("bin", bytes));
  CHECK(db.query_int64("SELECT count(*) FROM claims WHERE key = 'bin' AND typeof(value) = 'blob'") == 1);
  CHECK(s.read("bin")->value == bytes);
}

TEST_CASE("records can live on an application's own rows: a NULL value reads as absent, erase keeps the row") {
  temp_dir dir;
  const auto path = dir.path / "mail.db";
  {
    dibs::sqlite::connection db{path};
    db.exec("CREATE TABLE mailbox (key TEXT PRIMARY KEY NOT NULL, value BLOB, version INTEGER NOT NULL DEFAULT 0, "
            "body TEXT NOT NULL DEFAULT '', seq INTEGER)");
    db.exec("INSERT INTO mailbox (key, body, seq) VALUES ('m1', 'order 3 apples', 1)");
  }
  dibs::sqlite_store s{path, "mailbox"};
  CHECK_FALSE(s.read("m1"));
  const auto v1 = s.create("m1", "claimed");
  REQUIRE(v1);
  CHECK(*v1 == 1);
  CHECK_FALSE(s.create("m1", "again"));
  REQUIRE(s.erase("m1", *v1));
  CHECK_FALSE(s.read("m1"));
  const auto v2 = s.create("m1", "claimed again");
  REQUIRE(v2);
  CHECK(*v2 > *v1);
  auto body = s.connection().prepare("SELECT body, seq FROM mailbox WHERE key = 'm1'");
  REQUIRE(body.step());
  CHECK(body.column_text(0) == "order 3 apples");  // the application's columns are untouched
  CHECK(body.column_int64(1) == 1);
  REQUIRE(s.create("m2", "new row"));  // a key with no row gets one, other columns at their defaults
}

TEST_CASE("a store operation waits out another connection's write lock instead of failing") {
  temp_dir dir;
  const auto path = dir.path / "busy.db";
  dibs::sqlite_store s{path};
  REQUIRE(s.create("k", "0"));
  dibs::sqlite::connection other{path};
  other.begin();  // holds the write lock
  std::atomic<long long> committing_ns{0};
  std::jthread release([&] {
    std::this_thread::sleep_for(200ms);
    committing_ns = dibs_test::steady_ns();
    other.commit();
  });
  const auto r = s.read("k");
  REQUIRE(r);  // WAL: a reader is not blocked by the writer
  const auto v = s.replace("k", r->version, "1");
  const auto replaced_ns = dibs_test::steady_ns();
  CHECK(v);
  // It waited for the lock: it returned after the other connection began to
  // commit (an order, not a time that a late start of this thread shortens).
  CHECK(committing_ns.load() != 0);
  CHECK(replaced_ns >= committing_ns.load());
  release.join();

  // With a short budget the caller is told, by name, why it gave up.
  dibs::sqlite_store impatient{path, dibs::sqlite_store_options{
                                         .busy = dibs::retry_policy{}
                                                     .backoff({std::chrono::milliseconds{1}, 2.0, std::chrono::milliseconds{5}})
                                                     .deadline(50ms)
                                                     .unlimited_attempts()}};
  other.begin();
  try {
    (void)impatient.replace("k", *v, "2");
    FAIL("a replace behind a lock held for longer than the deadline succeeded");
  } catch (const dibs::retry_error& e) {
    CHECK_THAT(e.what(), Contains("locked") || Contains("busy"));
    CHECK_THAT(e.what(), Contains(path.string()));
  }
  other.rollback();
  CHECK(impatient.read("k")->value == "1");  // nothing was written
}

TEST_CASE("a store carried into a child by fork() refuses every call there, saying to open it after fork") {
  temp_dir dir;
  const auto path = dir.path / "forked.db";
  dibs::sqlite_store store{path};
  REQUIRE(store.create("job-1", "parent's"));
  const int code = dibs_test::wait_exit(dibs_test::spawn([&]() -> int {
    try {
      (void)store.read("job-1");
      return 10;  // SQLite forbids it: a use in the child must not run
    } catch (const std::system_error& e) {
      if (e.code() != std::errc::operation_not_permitted) return 11;
      const std::string what = e.what();
      if (what.find(path.string()) == std::string::npos || what.find("after fork") == std::string::npos) return 12;
    }
    try {
      (void)store.create("job-2", "child's");
      return 13;
    } catch (const std::system_error& e) {
      if (e.code() != std::errc::operation_not_permitted) return 14;
    }
    {
      dibs::sqlite_store own{path};  // opened in the child: a store of its own, which works
      if (!own.create("job-3", "child's own")) return 15;
    }
    // The inherited copy's destructor touches nothing of the parent's (the
    // child then ends with _exit: nothing destroys it again).
    store.~sqlite_store();
    return 0;
  }));
  CHECK(code == 0);
  // The parent's store is unharmed, and saw the child's own write only.
  const auto r = store.read("job-1");
  REQUIRE(r);
  CHECK(r->value == "parent's");
  CHECK_FALSE(store.read("job-2"));
  CHECK(store.read("job-3"));
}

TEST_CASE("bad input to sqlite_store: a clear error naming what and where, and nothing written") {
  temp_dir dir;
  SECTION("a database path in a missing directory") {
    const auto p = dir.path / "no-such-dir" / "x.db";
    CHECK_THROWS_WITH(dibs::sqlite_store{p}, Contains(p.string()) && Contains("directory"));
    CHECK_FALSE(std::filesystem::exists(p.parent_path()));
  }
  SECTION("a file that is not a database") {
    const auto p = dir.path / "notes.txt";
    const std::string text = std::string(4096, 'n') + " my notes, not a database\n";
    spit(p, text);
    CHECK_THROWS_WITH(dibs::sqlite_store{p}, Contains(p.string()) && Contains("not a database"));
    CHECK(slurp(p) == text);
    CHECK_FALSE(std::filesystem::exists(p.string() + "-wal"));
  }
  SECTION("a table of another shape") {
    const auto p = dir.path / "app.db";
    {
      dibs::sqlite::connection db{p, {.journal_mode = "DELETE"}};
      db.exec("CREATE TABLE jobs (id INTEGER PRIMARY KEY, payload TEXT)");
      db.exec("CREATE TABLE strict_extra (key TEXT PRIMARY KEY, value BLOB, version INTEGER NOT NULL, owner TEXT NOT NULL)");
    }
    const std::string before = slurp(p);
    CHECK_THROWS_WITH(dibs::sqlite_store(p, "jobs"), Contains("'jobs'") && Contains(p.string()) &&
                                                         Contains("key, value and version"));
    CHECK_THROWS_WITH(dibs::sqlite_store(p, "strict_extra"), Contains("'owner'") && Contains("NOT NULL"));
    CHECK(slurp(p) == before);  // not even the journal mode changed
  }
  SECTION("a path that names no shared file") {
    for (const std::filesystem::path& p : {std::filesystem::path{}, std::filesystem::path{":memory:"}, dir.path})
      CHECK_THROWS_WITH(dibs::sqlite_store{p}, Contains("invalid database path") && Contains("'" + p.string() + "'"));
  }
  SECTION("a bad table name") {
    for (const char* t : {"", "1abc", "a-b", "x\"; DROP TABLE y; --", "sqlite_master"})
      CHECK_THROWS_MATCHES(dibs::sqlite_store(dir.path / "t.db", t), std::system_error,
                           Catch::Predicate<std::system_error>([&](const std::system_error& e) {
                             return has_code(e, dibs::errc::invalid_argument) &&
                                    std::string(e.what()).find("invalid table name") != std::string::npos;
                           }));
    CHECK_FALSE(std::filesystem::exists(dir.path / "t.db"));
  }
  SECTION("a read-only database file (as an unprivileged user: root ignores permissions)") {
    const auto p = dir.path / "ro.db";
    {
      dibs::sqlite_store s{p};
      REQUIRE(s.create("k", "v"));
    }
    ::chmod(p.c_str(), 0444);
    ::chmod(dir.path.c_str(), 0755);
    const int code = dibs_test::run_unprivileged([&] {
      try {
        dibs::sqlite_store s{p};
        return 10;
      } catch (const std::system_error& e) {
        if (std::string(e.what()).find(p.string()) == std::string::npos) return 11;
        if (std::string(e.what()).find("read-only") == std::string::npos) return 12;
      }
      return 0;
    });
    INFO("child exit code " << code);
    if (code == 77) WARN("no unprivileged account: the read-only case was not run");
    CHECK((code == 0 || code == 77));
  }
}

TEST_CASE("rows deleted by hand: a lease or claim made again gets a larger token, the old holder's renewal finds its hold lost, also on an application's row") {
  temp_dir dir;
  const auto path = dir.path / "locks.db";
  dibs::sqlite_store s{path};
  dibs::lease_mutex<dibs::sqlite_store> a{s, "job", {.renew = false}};
  REQUIRE(a.try_lock());
  REQUIRE(a.renew());
  REQUIRE(a.renew());
  dibs::sqlite::connection by_hand{path};
  by_hand.exec("DELETE FROM dibs_records WHERE key = 'job'");
  dibs::lease_mutex<dibs::sqlite_store> b{s, "job", {.renew = false}};
  REQUIRE(b.try_lock());
  CHECK(b.token() > a.token() + 2);  // above the versions of a's two renewals too
  CHECK_FALSE(a.renew());
  CHECK(a.lost());
  CHECK(b.renew());
  CHECK_FALSE(b.lost());
  b.unlock();
  // An application's own row, deleted and inserted again without a record
  // (version 0): claimed with a token above the deleted row's.
  dibs::sqlite_store app{path, "mailbox"};
  dibs::marker_claim<dibs::sqlite_store> claims{app, {.renew = false}};
  by_hand.exec("INSERT INTO mailbox (key) VALUES ('m1')");
  auto first = claims.try_claim("m1");
  REQUIRE(first);
  const auto t1 = first->token();
  first->complete();
  by_hand.exec("DELETE FROM mailbox WHERE key = 'm1'; INSERT INTO mailbox (key) VALUES ('m1')");
  auto second = claims.try_claim("m1");
  REQUIRE(second);
  CHECK(second->token() > t1 + 1);
  second->complete();
}

TEST_CASE("lease_mutex over sqlite_store: a killed holder is recovered at once, tokens grow") {
  temp_dir dir;
  const auto path = dir.path / "locks.db";
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t holder = dibs_test::spawn([&]() -> int {
    dibs::sqlite_store s{path};
    dibs::lease_mutex<dibs::sqlite_store> m{s, "job"};
    m.lock();
    if (::write(ready[1], "r", 1) != 1) return 3;
    for (;;) ::pause();
  });
  char ch;
  REQUIRE(::read(ready[0], &ch, 1) == 1);
  dibs::sqlite_store s{path};
  dibs::lease_mutex<dibs::sqlite_store> m{s, "job"};
  CHECK_FALSE(m.try_lock());
  ::kill(holder, SIGKILL);
  dibs_test::wait_exit(holder);
  REQUIRE(m.try_lock_for(2s));
  const auto first = m.token();
  m.unlock();
  REQUIRE(m.try_lock());
  CHECK(m.token() > first);
  m.unlock();
}

TEST_CASE("exactly once under crashes on sqlite_store: 8 workers, 5,000 items, 20 SIGKILLs", "[chaos]") {
  temp_dir dir;
  dibs_test::check_exactly_once_under_crashes([&] { return dibs::sqlite_store{dir.path / "items.db"}; },
                                              [&] { return dibs::sqlite_store{dir.path / "journal.db"}; });
}

namespace {

using claims_t = dibs::marker_claim<dibs::sqlite_store>;

std::int64_t count(dibs::sqlite::connection& db, const std::string& sql) { return db.query_int64(sql).value_or(-1); }

// What a worker's transaction writes: one row per effect, so a doubled
// effect shows as a count of 2.
void create_effects(dibs::sqlite::connection& db) {
  db.exec("CREATE TABLE IF NOT EXISTS effects (item TEXT NOT NULL, token INTEGER NOT NULL, pid INTEGER NOT NULL)");
}
void write_effect(dibs::sqlite::connection& db, const std::string& item, dibs::version token) {
  auto s = db.prepare("INSERT INTO effects (item, token, pid) VALUES (?1, ?2, ?3)");
  s.bind(1, item).bind(2, token).bind(3, static_cast<std::int64_t>(::getpid())).step();
}

const auto tx_policy = dibs::retry_policy{}
                           .backoff({std::chrono::microseconds{200}, 2.0, std::chrono::milliseconds{20}})
                           .deadline(60s)
                           .unlimited_attempts();

struct forced_rollback : std::runtime_error {
  forced_rollback() : std::runtime_error("forced rollback") {}
};

}  // namespace

TEST_CASE("complete() inside a transaction on the store's connection commits with the work's effects") {
  temp_dir dir;
  dibs::sqlite_store store{dir.path / "q.db"};
  auto& db = store.connection();
  create_effects(db);
  claims_t claims{store};
  auto c = claims.try_claim("item-1");
  REQUIRE(c);
  const auto token = c->token();
  REQUIRE(store.read("item-1")->version == token);
  int runs = 0;
  dibs::transact(tx_policy, db, [&] {
    ++runs;
    CHECK(store.in_transaction());
    write_effect(db, "item-1", c->token());
    c->complete("effect written");
  });
  CHECK(runs == 1);
  CHECK_FALSE(store.in_transaction());
  CHECK(count(db, "SELECT count(*) FROM effects WHERE item = 'item-1'") == 1);
  const auto st = claims.status("item-1");
  CHECK(st.state == dibs::claim_state::completed);
  CHECK(st.result == "effect written");
  CHECK(st.version == token + 1);
  CHECK_THROWS_AS(c->complete(), std::logic_error);  // finished: the commit was taken in
  CHECK_FALSE(c->renew());
  c.reset();  // a finished claim gives nothing back
  CHECK(claims.status("item-1").state == dibs::claim_state::completed);
  CHECK(claims.status("item-1").version == token + 1);
}

TEST_CASE("a rolled-back transaction undoes the effects and the completion, and the claim is still held") {
  temp_dir dir;
  const auto path = dir.path / "q.db";
  dibs::sqlite_store store{path};
  auto& db = store.connection();
  create_effects(db);
  claims_t claims{store, {.lease = 600ms}};
  auto c = claims.try_claim("item-1");
  REQUIRE(c);
  const auto token = c->token();

  // The body throws after complete(): transact rolls back and lets the
  // (permanent) error through.
  CHECK_THROWS_AS(dibs::transact(tx_policy, db,
                                 [&] {
                                   write_effect(db, "item-1", c->token());
                                   c->complete();
                                   throw forced_rollback{};
                                 }),
                  forced_rollback);
  CHECK(count(db, "SELECT count(*) FROM effects") == 0);
  auto st = claims.status("item-1");
  CHECK(st.state == dibs::claim_state::processing);
  CHECK(st.owner->pid == ::getpid());
  CHECK(st.version >= token);  // renewals may have moved it since; never a completion

  // Still this worker's: no one else may claim it, and its renewals go on
  // past several leases, so the claim is not lost.
  {
    dibs::sqlite_store other_store{path};
    claims_t others{other_store};
    CHECK_FALSE(others.try_claim("item-1"));
  }
  std::this_thread::sleep_for(1500ms);
  CHECK_FALSE(c->lost());
  st = claims.status("item-1");
  CHECK(st.state == dibs::claim_state::processing);
  CHECK(st.version > token + 1);  // renewed after the rollback (each renewal is one version)

  // A transient failure after complete(): transact rolls back and runs the
  // body again, and the second complete() is the one that commits.
  int runs = 0;
  dibs::transact(tx_policy, db, [&] {
    write_effect(db, "item-1", c->token());
    c->complete("done");
    if (++runs == 1) throw std::system_error(dibs::sqlite::make_error_code(SQLITE_BUSY), "forced transient failure");
  });
  CHECK(runs == 2);
  CHECK(count(db, "SELECT count(*) FROM effects WHERE item = 'item-1'") == 1);
  st = claims.status("item-1");
  CHECK(st.state == dibs::claim_state::completed);
  CHECK(st.attempts == 1);
  CHECK(st.result == "done");
  const auto done_version = st.version;
  std::this_thread::sleep_for(700ms);  // no renewal of a completed claim, no lost claim
  CHECK(claims.status("item-1").version == done_version);
  CHECK_THROWS_AS(c->complete(), std::logic_error);
}

TEST_CASE("release() inside a transaction is part of it too, and complete() twice in one transaction is refused") {
  temp_dir dir;
  dibs::sqlite_store store{dir.path / "q.db"};
  auto& db = store.connection();
  claims_t claims{store, {.retry_backoff = std::nullopt}};  // back at once, to be claimed again below
  auto c = claims.try_claim("item-1");
  REQUIRE(c);
  CHECK_THROWS_AS(dibs::transact(tx_policy, db,
                                 [&] {
                                   CHECK(c->release("cannot do it now"));
                                   CHECK_THROWS_AS(c->complete(), std::logic_error);
                                   throw forced_rollback{};
                                 }),
                  forced_rollback);
  CHECK(claims.status("item-1").state == dibs::claim_state::processing);
  dibs::transact(tx_policy, db, [&] { CHECK(c->release("cannot do it now")); });
  const auto st = claims.status("item-1");
  CHECK(st.state == dibs::claim_state::released);
  CHECK(st.error == "cannot do it now");
  CHECK_FALSE(c->release());  // finished
  auto again = claims.try_claim("item-1");
  REQUIRE(again);
  CHECK(again->attempts() == 2);
}

TEST_CASE("renewals from other threads never slip into a transaction open on the store's connection") {
  temp_dir dir;
  const auto path = dir.path / "q.db";
  dibs::sqlite_store store{path};
  auto& db = store.connection();
  create_effects(db);
  // Renewed every 500 ms; a transaction of 600 ms spans a renewal, which is
  // refused (tried again at the next one), and ends well within the lease
  // (margins wide enough for a loaded machine).
  claims_t claims{store, {.lease = 1500ms}};
  std::vector<claims_t::claim> held;
  for (int i = 0; i < 3; ++i) {
    auto c = claims.try_claim("item-" + std::to_string(i));
    REQUIRE(c);
    held.push_back(std::move(*c));
  }
  dibs::sqlite::connection observer{path};
  for (int round = 0; round < 3; ++round) {
    db.begin();
    const auto before = count(db, "SELECT sum(version) FROM dibs_records");  // no one else writes until it ends
    write_effect(db, "x", 0);
    std::this_thread::sleep_for(600ms);
    // A renewal that slipped in would be a write of this transaction, and
    // rolled back with it (the old bug: its claim then found its version
    // gone and was lost).
    CHECK(count(db, "SELECT sum(version) FROM dibs_records") == before);
    db.rollback();
    CHECK(count(observer, "SELECT sum(version) FROM dibs_records") == before);
    std::this_thread::sleep_for(1600ms);  // more than a lease: lost, unless the renewals went on after the rollback
    for (auto& c : held) CHECK_FALSE(c.lost());
    CHECK(count(observer, "SELECT sum(version) FROM dibs_records") > before);
  }
  CHECK(count(db, "SELECT count(*) FROM effects") == 0);
  for (auto& c : held) REQUIRE_NOTHROW(c.complete());
  CHECK(count(observer, "SELECT count(*) FROM dibs_records_claims WHERE state = 'completed'") == 3);
}

TEST_CASE("another thread's store operation waits for a transaction open on the store's connection") {
  temp_dir dir;
  dibs::sqlite_store store{dir.path / "q.db"};
  REQUIRE(store.create("k", "0"));
  auto& db = store.connection();
  db.begin();
  REQUIRE(store.replace("k", 1, "in the transaction"));  // this thread's: part of it
  std::atomic<bool> done{false};
  std::optional<dibs::record> seen;
  std::jthread reader([&] {
    seen = store.read("k");
    done = true;
  });
  std::this_thread::sleep_for(200ms);
  CHECK_FALSE(done.load());  // it did not read inside the transaction
  db.rollback();
  reader.join();
  REQUIRE(seen);
  CHECK(seen->value == "0");
  CHECK(seen->version == 1);
}

TEST_CASE("effects in one transaction: N processes complete M items in the transaction of their effects, some rolled back, each effect exactly once") {
  temp_dir dir;
  const auto path = dir.path / "work.db";
  constexpr int workers = 4, items = 240;
  {
    dibs::sqlite_store s{path};
    create_effects(s.connection());
  }  // closed before forking
  std::vector<dibs_test::child> kids;
  for (int w = 0; w < workers; ++w)
    kids.emplace_back(dibs_test::spawn([&, w]() -> int {
      dibs::sqlite_store store{path};
      auto& db = store.connection();
      claims_t claims{store, {.lease = 5s}};
      for (;;) {
        int claimed = 0;
        for (int i = 0; i < items; ++i) {
          // Each worker starts at another place, so they meet on the way.
          const int n = (i + w * items / workers) % items;
          const std::string key = "item-" + std::to_string(n);
          auto c = claims.try_claim(key);
          if (!c) continue;
          ++claimed;
          int runs = 0;
          try {
            dibs::transact(tx_policy, db, [&] {
              ++runs;
              write_effect(db, key, c->token());
              c->complete(fmt::format("by {}", ::getpid()));
              // Every third item's first transaction fails after complete()
              // with a transient error (transact rolls back and runs it
              // again); every fifth item's first claim fails for good (the
              // worker gives the item back and someone claims it again).
              if (n % 3 == 0 && runs == 1)
                throw std::system_error(dibs::sqlite::make_error_code(SQLITE_BUSY), "forced transient failure");
              if (n % 5 == 0 && c->attempts() == 1) throw forced_rollback{};
            });
          } catch (const forced_rollback&) {
            if (!c->release("forced rollback")) return 20;  // still held after the rollback
          }
          if (n % 3 == 0 && runs < 2) return 21;
        }
        if (claimed == 0) {
          auto left = db.prepare("SELECT count(*) FROM dibs_records_claims WHERE state = 'completed'");
          if (left.step() && left.column_int64(0) == items) return 0;
          std::this_thread::sleep_for(5ms);
        }
      }
    }));
  for (auto& k : kids) CHECK(k.wait() == 0);
  dibs::sqlite::connection db{path};
  CHECK(count(db, "SELECT count(*) FROM effects") == items);
  CHECK(count(db, "SELECT count(DISTINCT item) FROM effects") == items);
  CHECK(count(db, "SELECT count(*) FROM dibs_records_claims WHERE state = 'completed'") == items);
  CHECK(count(db, "SELECT count(*) FROM dibs_records_claims") == items);
  // The effect kept is the completing claim's: its token is the record's
  // version before completion.
  CHECK(count(db, "SELECT count(*) FROM effects e JOIN dibs_records_claims c ON c.key = e.item "
                  "WHERE c.token = e.token") == items);
  // Items given back once were claimed twice, the others once.
  CHECK(count(db, "SELECT count(*) FROM dibs_records_claims WHERE attempts = 2") == items / 5);
  CHECK(count(db, "SELECT count(*) FROM dibs_records_claims WHERE attempts = 1") == items - items / 5);
  CHECK(count(db, "SELECT count(DISTINCT pid) FROM effects") > 1);
}

TEST_CASE("the view <table>_claims shows each claim's state, attempts and owner as columns for plain SQL") {
  temp_dir dir;
  const auto path = dir.path / "mail.db";
  {
    dibs::sqlite::connection db{path};
    db.exec("CREATE TABLE mailbox (key TEXT PRIMARY KEY NOT NULL, value BLOB, version INTEGER NOT NULL DEFAULT 0, "
            "body TEXT)");
    db.exec("INSERT INTO mailbox (key, body) VALUES ('m-absent', 'not claimed yet')");
  }
  dibs::sqlite_store store{path, "mailbox"};
  CHECK(store.claims_view() == "mailbox_claims");
  claims_t claims{store, {.lease = 60s, .max_attempts = 1}};
  claims_t patient{store, {.lease = 60s, .max_attempts = 3}};
  auto processing = claims.try_claim("m-processing");
  REQUIRE(processing);
  {
    auto c = claims.try_claim("m-completed");
    REQUIRE(c);
    c->complete("order 17, pid 3");  // a result that looks like other fields
  }
  {
    auto c = patient.try_claim("m-released");
    REQUIRE(c);
    REQUIRE(c->release("printer jammed"));
  }
  {
    auto c = claims.try_claim("m-failed");
    REQUIRE(c);
    REQUIRE(c->release("bad address"));  // the last of 1 attempt: failed
  }
  REQUIRE(store.create("not-a-claim", "a lease or some other record"));

  auto& db = store.connection();
  auto rows = db.prepare("SELECT key, state, attempts, token, owner_host, owner_pid, lease_ms, error, result, version "
                         "FROM mailbox_claims ORDER BY key");
  struct row {
    std::string key, state;
    std::int64_t attempts;
    bool token_null, host_null;
    std::int64_t pid, lease_ms;
    std::string error, result;
    std::int64_t version;
  };
  std::vector<row> got;
  while (rows.step())
    got.push_back({rows.column_text(0), rows.column_text(1), rows.column_int64(2), rows.column_is_null(3),
                   rows.column_is_null(4), rows.column_int64(5), rows.column_int64(6), rows.column_text(7),
                   rows.column_text(8), rows.column_int64(9)});
  REQUIRE(got.size() == 5);  // "not-a-claim" is no claim
  CHECK(got[0].key == "m-absent");
  CHECK(got[0].state == "absent");
  CHECK(got[0].attempts == 0);
  CHECK(got[0].host_null);
  CHECK(got[0].version == 0);

  CHECK(got[1].key == "m-completed");
  CHECK(got[1].state == "completed");
  CHECK(got[1].attempts == 1);
  CHECK(got[1].result == "order 17, pid 3");
  CHECK(got[1].host_null);  // a finished claim names no owner
  CHECK(got[1].version == 2);

  CHECK(got[2].key == "m-failed");
  CHECK(got[2].state == "failed");
  CHECK(got[2].error == "bad address");

  CHECK(got[3].key == "m-processing");
  CHECK(got[3].state == "processing");
  CHECK(got[3].attempts == 1);
  CHECK_FALSE(got[3].host_null);
  CHECK(got[3].pid == ::getpid());
  CHECK(got[3].lease_ms == 60000);
  CHECK(got[3].version == static_cast<std::int64_t>(store.read("m-processing")->version));

  CHECK(got[4].key == "m-released");
  CHECK(got[4].state == "released");
  CHECK(got[4].attempts == 1);
  CHECK(got[4].error == "printer jammed");

  // The query a person writes, and the owner's pid as a number.
  CHECK(count(db, "SELECT count(*) FROM mailbox_claims WHERE state = 'processing' AND owner_pid = " +
                      std::to_string(::getpid())) == 1);
  CHECK(count(db, "SELECT count(*) FROM mailbox_claims WHERE state IN ('released', 'failed', 'absent')") == 3);
  // The view joins the application's own rows.
  CHECK(count(db, "SELECT count(*) FROM mailbox_claims c JOIN mailbox m USING (key) WHERE c.state = 'absent' "
                  "AND m.body = 'not claimed yet'") == 1);
  rows.reset();
  // A second store on the same file finds the view there, and a read-only one leaves the file as it is.
  dibs::sqlite_store again{path, "mailbox"};
  CHECK(count(again.connection(), "SELECT count(*) FROM sqlite_schema WHERE name = 'mailbox_claims'") == 1);
  CHECK(count(again.connection(), "SELECT count(*) FROM sqlite_schema WHERE sql LIKE '%dibs claims view 1%'") == 1);
}

TEST_CASE("a full filesystem at a store's open is named as such, with the path and the table") {
  temp_dir dir;
  const auto mnt = dir.path / "full";
  const auto r = dibs_test::on_full_filesystem(mnt, [](const std::filesystem::path& d) -> std::string {
    try {
      dibs::sqlite_store s{d / "queue.db", "jobs"};
      return "opened: no error";
    } catch (const std::system_error& e) {
      return e.what();
    }
  });
  if (!r.ran) {
    WARN("could not mount a small tmpfs (" << r.what << "): the full-filesystem case was not run");
    return;
  }
  INFO(r.what);
  CHECK_THAT(r.what, Contains("'" + (mnt / "queue.db").string() + "'") && Contains("'jobs'") &&
                         Contains("the filesystem of '" + mnt.string() + "' is full") && !Contains("CREATE") &&
                         !Contains("SELECT") && !Contains("PRAGMA"));
}

TEST_CASE("sqlite_store passes the queue checks: priorities, schedules, backoffs, claim_next_n, each item once across 4 processes", "[conformance]") {
  temp_dir dir;
  const auto db = dir.path / "queue.db";
  {
    dibs::sqlite_store s{db};
    REQUIRE_NOTHROW(dibs::testing::check_queue(s, "q-"));
  }  // closed before forking
  REQUIRE_NOTHROW(dibs::testing::check_queue_race_processes([&] { return dibs::sqlite_store{db}; }, 4, 150, "race-"));
}

TEST_CASE("over sqlite_store, list() reads the table in one statement and lists a record that is not a claim as damaged, and claim_next never reads it") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  static_assert(dibs::snapshot_store<dibs::sqlite_store>);
  std::vector<std::string> damaged;
  dibs::marker_claim<dibs::sqlite_store> claims{
      s, {.renew = false, .on_damaged = [&](std::string_view k, std::string_view) { damaged.emplace_back(k); }}};
  REQUIRE(s.create("q-lock", "a lease or some other record"));
  REQUIRE(claims.offer("q-1", {.priority = 2}));
  REQUIRE(claims.offer("q-2"));
  const auto items = claims.list("q-");
  REQUIRE(items.size() == 3);
  CHECK(items[0].key == "q-1");
  CHECK(items[0].status.priority == 2);
  CHECK(items[2].key == "q-lock");
  CHECK(items[2].status.state == dibs::claim_state::damaged);
  auto c = claims.claim_next("q-");
  REQUIRE(c);
  CHECK(c->key() == "q-1");  // the higher priority
  // claim_next reads the queue index, which holds only claimable records.
  CHECK(damaged.empty());
  c->complete();
}

namespace {
// The statements a connection runs, by their first word, as SQLite itself
// reports them (sqlite3_trace_v2).
struct statement_log {
  std::vector<std::string> ran;
  explicit statement_log(dibs::sqlite::connection& db) {
    ::sqlite3_trace_v2(
        db.native_handle(), SQLITE_TRACE_STMT,
        [](unsigned, void* self, void* stmt, void*) -> int {
          const std::string sql = ::sqlite3_sql(static_cast<::sqlite3_stmt*>(stmt));
          static_cast<statement_log*>(self)->ran.push_back(sql.substr(0, sql.find(' ')));
          return 0;
        },
        this);
  }
  template <class F>
  std::vector<std::string> of(F f) {
    ran.clear();
    f();
    return ran;
  }
};
}  // namespace

TEST_CASE("over sqlite_store, try_claim takes a fresh item in one statement and a taken one costs a read, not a write") {
  using run = std::vector<std::string>;
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  statement_log log{s.connection()};
  dibs::marker_claim<dibs::sqlite_store> claims{s, {.renew = false}};
  std::optional<dibs::marker_claim<dibs::sqlite_store>::claim> a, b, c, d;

  // Fresh items while claims succeed: the create alone, no read before it.
  CHECK(log.of([&] { a = claims.try_claim("a"); }) == run{"INSERT"});
  REQUIRE(a);
  CHECK(log.of([&] { a->complete(); }) == run{"UPDATE"});
  CHECK(log.of([&] { b = claims.try_claim("b"); }) == run{"INSERT"});
  REQUIRE(b);

  // A taken item: the create changes nothing, the read says why, and from
  // then on taken items are read, not written (under contention the write
  // lock is what every process queues for).
  CHECK(log.of([&] { CHECK_FALSE(claims.try_claim("a")); }) == run{"INSERT", "SELECT"});
  CHECK(log.of([&] { CHECK_FALSE(claims.try_claim("a")); }) == run{"SELECT"});
  CHECK(log.of([&] { CHECK_FALSE(claims.try_claim("b")); }) == run{"SELECT"});  // b's holder is alive: never taken

  // A read that finds a fresh item turns back to creating first.
  CHECK(log.of([&] { c = claims.try_claim("c"); }) == run{"SELECT", "INSERT"});
  REQUIRE(c);
  CHECK(log.of([&] { d = claims.try_claim("d"); }) == run{"INSERT"});
  REQUIRE(d);

  // Another worker, creating first, finds the live claim on b and leaves it.
  dibs::marker_claim<dibs::sqlite_store> other{s, {.renew = false}};
  CHECK_FALSE(other.try_claim("b"));
  b->complete();  // throws lease_lost if b had been taken over
  c->complete();
  d->complete();
  for (const char* k : {"a", "b", "c", "d"}) {
    const auto st = claims.status(k);
    CHECK(st.state == dibs::claim_state::completed);
    CHECK(st.attempts == 1);
  }
}

TEST_CASE("values are stored as TEXT exactly when they are UTF-8 without a NUL, wherever the NUL or a bad byte sits") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  auto type_of = [&](const std::string& key) {
    auto q = s.connection().prepare("SELECT typeof(value) FROM dibs_records WHERE key = ?1");
    q.bind(1, key);
    REQUIRE(q.step());
    return q.column_text(0);
  };
  int n = 0;
  for (std::size_t size : {9u, 16u, 17u, 40u}) {
    for (std::size_t at = 0; at < size; ++at) {
      const std::string plain(size, 'x');
      std::string nul = plain, bad = plain, two = plain;
      nul[at] = '\0';
      bad[at] = '\xff';
      if (at + 1 < size) two.replace(at, 2, "\xc3\xa9");  // é: a character of two bytes
      for (const auto& [value, type] : {std::pair{nul, "blob"}, std::pair{bad, "blob"}, std::pair{two, "text"}}) {
        const std::string key = "v" + std::to_string(n++);
        REQUIRE(s.create(key, value));
        CHECK(type_of(key) == type);
        CHECK(s.read(key)->value == value);
      }
    }
  }
  CHECK(n == 3 * (9 + 16 + 17 + 40));
}

namespace {
// A client of a dibs without the queue index: the same table through the
// shared_store operations alone, so marker_claim finds work by reading
// every record (its scan path), as such a process does.
struct scanning_client {
  dibs::sqlite_store s;
  explicit scanning_client(const std::filesystem::path& db) : s(db) {}
  std::optional<dibs::record> read(std::string_view k) { return s.read(k); }
  std::optional<dibs::version> create(std::string_view k, std::string_view v) { return s.create(k, v); }
  std::optional<dibs::version> replace(std::string_view k, dibs::version e, std::string_view v) {
    return s.replace(k, e, v);
  }
  bool erase(std::string_view k, dibs::version e) { return s.erase(k, e); }
  std::vector<std::string> keys(std::string_view p) { return s.keys(p); }
  std::vector<std::pair<std::string, dibs::record>> records(std::string_view p) { return s.records(p); }
};
static_assert(!dibs::claim_queue_store<scanning_client>);
static_assert(dibs::claim_queue_store<dibs::sqlite_store>);

// What SQLite did to run the statements of claim_next that read the queue:
// rows stepped through by full scans, sorts, and virtual machine steps
// (sqlite3_stmt_status), summed over the statements the connection
// finished while it was watched.
struct queue_reads {
  long long fullscan = 0, sorts = 0, vm_steps = 0;
  explicit queue_reads(dibs::sqlite::connection& db) {
    ::sqlite3_trace_v2(
        db.native_handle(), SQLITE_TRACE_PROFILE,
        [](unsigned, void* self, void* p, void*) -> int {
          auto* stmt = static_cast<::sqlite3_stmt*>(p);
          if (!std::string_view(::sqlite3_sql(stmt)).starts_with("SELECT key, value, version")) return 0;
          auto& r = *static_cast<queue_reads*>(self);
          r.fullscan += ::sqlite3_stmt_status(stmt, SQLITE_STMTSTATUS_FULLSCAN_STEP, 1);
          r.sorts += ::sqlite3_stmt_status(stmt, SQLITE_STMTSTATUS_SORT, 1);
          r.vm_steps += ::sqlite3_stmt_status(stmt, SQLITE_STMTSTATUS_VM_STEP, 1);
          return 0;
        },
        this);
  }
};

// Effects: writes `done` completed and `waiting` offered claim records with
// keys "<prefix>done-N" and "<prefix>item-N", in one transaction.
void fill_queue(dibs::sqlite_store& s, int done, int waiting, const std::string& prefix = "") {
  dibs::marker_claim<dibs::sqlite_store> claims{s, {.renew = false}};
  s.connection().begin();
  for (int i = 0; i < done; ++i) {
    auto c = claims.try_claim(fmt::format("{}done-{:05}", prefix, i));
    REQUIRE(c);
    c->complete();
  }
  for (int i = 0; i < waiting; ++i) REQUIRE(claims.offer(fmt::format("{}item-{:05}", prefix, i)));
  s.connection().commit();
}
}  // namespace

TEST_CASE("claim_next on sqlite_store reads the queue index alone: its cost does not grow with completed items") {
  temp_dir dir;
  // The same queue of 5 offered items, beside 20 and beside 2,000 completed
  // ones: claiming all 5 takes as many steps of SQLite's machine either way,
  // with no full scan and no sort.
  auto cost = [&](int done) {
    dibs::sqlite_store s{dir.path / fmt::format("q{}.db", done)};
    fill_queue(s, done, 5);
    dibs::marker_claim<dibs::sqlite_store> claims{s, {.renew = false}};
    queue_reads reads{s.connection()};
    for (int i = 0; i < 5; ++i) {
      auto c = claims.claim_next();
      REQUIRE(c);
      CHECK(c->key() == fmt::format("item-{:05}", i));  // one priority: in key order
      c->complete();
    }
    CHECK_FALSE(claims.claim_next());
    CHECK(reads.fullscan == 0);
    CHECK(reads.sorts == 0);
    return reads.vm_steps;
  };
  const auto few = cost(20), many = cost(2'000);
  INFO("machine steps beside 20 completed items: " << few << ", beside 2,000: " << many);
  CHECK(many == few);
}

TEST_CASE("sqlite_store's queue index agrees with the record codec, and take_claimable honours priority, not_before, prefix and n") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  dibs::marker_claim<dibs::sqlite_store> claims{s, {.renew = false, .retry_backoff = std::nullopt}};
  const auto later = std::chrono::system_clock::now() + 1h;
  REQUIRE(claims.offer("a-low", {.priority = -3}));
  REQUIRE(claims.offer("a-mid"));
  REQUIRE(claims.offer("a-high", {.priority = 7}));
  REQUIRE(claims.offer("a-later", {.not_before = later, .priority = 9}));
  REQUIRE(claims.offer("b-other", {.priority = 100}));
  REQUIRE(s.create("a-foreign", "not a claim"));
  // Released with a priority and an attempt: comes back with both.
  {
    auto c = claims.try_claim("a-again");
    REQUIRE(c);
    REQUIRE(c->release("try again"));
  }
  // Damaged by hand: claimable on line 2, no attempt count on line 3 (the
  // codec reads it as damaged): the index may hold it, the take leaves it.
  REQUIRE(s.create("a-damaged", "dibs-claim 1\nstate offered\nnot an attempt count\n"));

  // Every record, read by the codec and by the index's SQL: the same facts.
  auto q = s.connection().prepare(
      "SELECT key, value, key IN (SELECT key FROM dibs_records INDEXED BY dibs_records_queue WHERE " +
      std::string("(CAST(substr(value, 1, 27) AS BLOB) = X'646962732d636c61696d20310a7374617465206f6666657265640a' OR "
                  "CAST(substr(value, 1, 28) AS BLOB) = X'646962732d636c61696d20310a73746174652072656c65617365640a')") +
      ") FROM dibs_records WHERE value IS NOT NULL");
  int rows = 0;
  while (q.step()) {
    ++rows;
    const auto key = q.column_blob(0);
    const auto head = dibs::detail::claim_record::parse_head(q.column_blob(1));
    INFO(key);
    CHECK((q.column_int64(2) != 0) == (head && head->waiting()));
  }
  CHECK(rows == 8);

  // The take: prefix "a-", by priority, the one scheduled later and the
  // damaged one left alone.
  const auto got = s.take_claimable("a-", "rest\n", 10);
  std::vector<std::string> keys;
  for (const auto& [k, r] : got) keys.push_back(k);
  CHECK(keys == std::vector<std::string>{"a-high", "a-again", "a-mid", "a-low"});
  REQUIRE(got.size() == 4);
  CHECK(got[0].second.value == "dibs-claim 1\nstate processing\nattempts 1\npriority 7\nrest\n");
  CHECK(got[1].second.value == "dibs-claim 1\nstate processing\nattempts 2\nrest\n");
  CHECK(got[0].second == *s.read("a-high"));
  CHECK(s.take_claimable("a-", "rest\n", 10).empty());
  // n: one of the two left under "b-" and "" (b-other, then nothing else).
  const auto one = s.take_claimable("", "rest\n", 1);
  REQUIRE(one.size() == 1);
  CHECK(one[0].first == "b-other");
  CHECK(claims.status("a-later").state == dibs::claim_state::offered);
  CHECK(claims.status("a-damaged").state == dibs::claim_state::damaged);
  CHECK(s.processing_keys("a-").size() == 4);
  CHECK(s.processing_keys().size() == 5);
}

TEST_CASE("a sqlite_store table of a dibs without the queue index gets it when opened, with every claimable item in it") {
  temp_dir dir;
  const auto db = dir.path / "old.db";
  {
    dibs::sqlite_store s{db};
    fill_queue(s, 30, 20);
    s.connection().exec("DROP INDEX dibs_records_queue");
  }
  dibs::sqlite_store s{db};
  CHECK(s.connection().query_int64("SELECT count(*) FROM sqlite_schema WHERE type = 'index' AND name = "
                                   "'dibs_records_queue'") == 1);
  dibs::marker_claim<dibs::sqlite_store> claims{s, {.renew = false}};
  int taken = 0;
  while (auto c = claims.claim_next()) {
    CHECK(c->key().starts_with("item-"));
    c->complete();
    ++taken;
  }
  CHECK(taken == 20);
}

#ifndef _WIN32
TEST_CASE("indexed and scanning processes on one SQLite queue: each item handed out once (the scanning ones as a dibs without the index)") {
  temp_dir dir;
  const auto db = dir.path / "mixed.db";
  constexpr int items = 300;
  {
    dibs::sqlite_store s{db};
    fill_queue(s, 200, items);
  }
  const std::size_t bytes = sizeof(std::atomic<int>) * items;
  void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  auto* taken = static_cast<std::atomic<int>*>(mem);
  for (int i = 0; i < items; ++i) new (&taken[i]) std::atomic<int>{0};
  auto work = [&](auto& s) {
    dibs::marker_claim<std::remove_cvref_t<decltype(s)>> claims{s, {.renew = false}};
    while (auto c = claims.claim_next("item-")) {
      ++taken[std::stoi(c->key().substr(5))];
      c->complete();
    }
    return 0;
  };
  const auto codes = dibs::testing::detail::race_processes(4, [&](int i) {
    if (i % 2 == 0) {
      dibs::sqlite_store s{db};
      return work(s);
    }
    scanning_client s{db};
    return work(s);
  });
  int once = 0;
  for (int i = 0; i < items; ++i) once += taken[i] == 1;
  ::munmap(mem, bytes);
  CHECK(codes == std::vector<int>{0, 0, 0, 0});
  CHECK(once == items);
  dibs::sqlite_store s{db};
  CHECK(s.connection().query_int64("SELECT count(*) FROM dibs_records_claims WHERE state = 'completed'") ==
        items + 200);
}
#endif
