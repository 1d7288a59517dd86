// dibs::sqlite::connection and dibs::sqlite_store on Windows, over the SQLite
// built from its amalgamation (cmake/sqlite-amalgamation.cmake), run under
// Wine: the build's options, the conformance kit's checks in one process,
// UTF-8 and wide paths, bad paths, and processes (this program started again
// in a helper role) racing on one database: transactions retried after
// "database is locked", and marker_claim with workers ended by
// TerminateProcess. `--sql-count` and `--sql-worker` are the helper roles.
#include "win_support.hpp"

#include <dibs/marker_claim.hpp>
#include <dibs/retry.hpp>
#include <dibs/sqlite/connection.hpp>
#include <dibs/stores/sqlite_store.hpp>
#include <dibs/testing/store_conformance.hpp>
// The paths of 0.1, which forward to the two above, build on Windows too.
#include <dibs/sqlite/connection.hpp>
#include <dibs/stores/sqlite_store.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace sqlite_win_test {
namespace {

using namespace win_test;
using claims_t = dibs::marker_claim<dibs::sqlite_store>;

// Whole transactions retried after "database is locked" (SQLITE_BUSY: the
// connections have no busy timeout, so a writer that meets another's lock
// fails at once) with jittered backoff.
dibs::retry_policy tx_policy() {
  return dibs::retry_policy{}
      .backoff({std::chrono::microseconds{200}, 2.0, std::chrono::milliseconds{20}})
      .deadline(60s)
      .unlimited_attempts();
}

std::int64_t count(dibs::sqlite::connection& db, const std::string& sql) { return db.query_int64(sql).value_or(-1); }

std::string item_key(int n) { return fmt::format("item-{:05}", n); }

// The counting role: `n` transactions, each reading the counter and writing
// it back plus one; then writes to `busy_file` how many attempts failed with
// SQLITE_BUSY ("database is locked") and were retried.
int sql_count(const fs::path& db_path, int n, const fs::path& busy_file, const fs::path& go) {
  dibs::sqlite::connection db{db_path};
  // All start together (under Wine each process takes a while to start,
  // and one that ran alone would meet no lock: the test would test nothing).
  if (!wait_for_file(go, 60s)) return 3;
  long busy = 0;
  const auto policy = tx_policy().on_retry([&](const dibs::retry_event& e) {
    if (e.code.category() == dibs::sqlite::category() && (e.code.value() & 0xff) == SQLITE_BUSY) ++busy;
  });
  for (int i = 0; i < n; ++i)
    dibs::transact(policy, db, [&] {
      const auto v = db.query_int64("SELECT v FROM counter");
      if (!v) throw std::runtime_error("the counter row is missing");
      std::this_thread::yield();  // widen the window a missing lock would leave
      db.prepare("UPDATE counter SET v = ?1").bind(1, *v + 1).step();
    });
  std::ofstream{busy_file} << busy << "\n";
  return 0;
}

// The worker role: claims the items (from `offset` on, so that workers meet
// on the way), works on each for a moment, and completes it in the
// transaction that writes its effect row, until every item is completed.
// A doubled completion shows as two effect rows of one item.
int sql_worker(const fs::path& db_path, int items, int offset) {
  dibs::sqlite_store store{db_path};
  auto& db = store.connection();
  claims_t claims{store, {.lease = 5s, .max_attempts = 1000}};
  const auto policy = tx_policy();
  const auto pid = static_cast<std::int64_t>(::GetCurrentProcessId());
  for (;;) {
    int claimed = 0;
    for (int i = 0; i < items; ++i) {
      const auto key = item_key((i + offset) % items);
      auto c = claims.try_claim(key);
      if (!c) continue;
      ++claimed;
      std::this_thread::sleep_for(2ms);  // the work: most kills land on a held claim
      dibs::transact(policy, db, [&] {
        db.prepare("INSERT INTO effects (item, token, pid) VALUES (?1, ?2, ?3)")
            .bind(1, key)
            .bind(2, static_cast<std::int64_t>(c->token()))
            .bind(3, pid)
            .step();
        c->complete();
      });
    }
    if (claimed == 0) {
      if (count(db, "SELECT count(*) FROM dibs_records_claims WHERE state = 'completed'") == items) return 0;
      std::this_thread::sleep_for(5ms);
    }
  }
}

const register_role count_role{"--sql-count", [](int argc, char** argv) {
  return argc == 4 ? guarded("--sql-count", [&] { return sql_count(argv[0], std::atoi(argv[1]), argv[2], argv[3]); }) : 2;
}};
const register_role worker_role{"--sql-worker", [](int argc, char** argv) {
  return argc == 3 ? guarded("--sql-worker",
                             [&] { return sql_worker(argv[0], std::atoi(argv[1]), std::atoi(argv[2])); })
                   : 2;
}};

// Returns: the message of the std::system_error that f() throws ("" if none).
template <class F>
std::string error_of(F&& f, std::error_code* code = nullptr) {
  try {
    f();
  } catch (const std::system_error& e) {
    if (code) *code = e.code();
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("Windows SQLite: built as Debian builds its libsqlite3 where it shows (serialized threads, URIs, secure delete, LIKE and BLOBs)") {
  CHECK(::sqlite3_threadsafe() == 1);
  temp_dir dir;
  dibs::sqlite::connection db{dir.path / "opts.db"};
  std::set<std::string> opts;
  for (auto s = db.prepare("PRAGMA compile_options"); s.step();) opts.insert(s.column_text(0));
  for (const char* o : {"THREADSAFE=1", "USE_URI", "SECURE_DELETE", "LIKE_DOESNT_MATCH_BLOBS", "MAX_SCHEMA_RETRY=25",
                        "MAX_VARIABLE_NUMBER=250000", "ENABLE_FTS5", "ENABLE_RTREE", "ENABLE_MATH_FUNCTIONS",
                        "ENABLE_UPDATE_DELETE_LIMIT", "MUTEX_W32"}) {
    INFO(o);
    CHECK(opts.count(o) == 1);
  }
  CHECK(count(db, "PRAGMA secure_delete") == 1);
  CHECK(count(db, "PRAGMA foreign_keys") == 0);        // better-sqlite3's own build turns them on
  CHECK(count(db, "SELECT x'61' LIKE 'a'") == 0);      // LIKE_DOESNT_MATCH_BLOBS
  CHECK(count(db, "SELECT \"no such column\" IS NULL") == 0);  // double-quoted strings allowed (DQS), as on Debian
}

TEST_CASE("Windows sqlite_store conformance: semantics, bad input, any keys and thread races, in one process") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "store.db"};
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-"));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 4, 250, "threads-"));
}

// On a database of their own: check_queue gives claim_next 400 ms before a
// scheduled item is due, and a WAL checkpoint (its flushes) left due by the
// checks above could take that on a loaded machine.
TEST_CASE("Windows sqlite_store queue conformance: priorities, schedules, backoffs, each item once across 4 threads") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "queue.db"};
  REQUIRE_NOTHROW(dibs::testing::check_queue(s, "queue-"));
  REQUIRE_NOTHROW(dibs::testing::check_queue_race_threads(s, 4, 200, "qrace-"));
}

TEST_CASE("Windows sqlite: a UTF-8 path is the file SQLite opens, and errors show it as UTF-8") {
  temp_dir dir;
  const fs::path name = dir.path / fs::path{u8"Zähler-名前.db"};
  {
    dibs::sqlite_store s{name};
    REQUIRE(s.create("k", "v"));
    CHECK(s.path() == name);
    CHECK(fs::exists(fs::path{name}.concat(L"-wal")));  // while open; the last connection's close removes it
  }
  CHECK(fs::is_regular_file(name));  // the wide name, not its ANSI mangling
  dibs::sqlite_store again{name};
  REQUIRE(again.read("k"));
  CHECK(again.read("k")->value == "v");
  CHECK(std::distance(fs::directory_iterator{dir.path}, fs::directory_iterator{}) == 3);  // the db, -wal, -shm

  const auto missing = error_of([&] { dibs::sqlite::connection c{dir.path / fs::path{u8"nicht-da-ü"} / "x.db"}; });
  CHECK_THAT(missing, Catch::Contains("nicht-da-\xc3\xbc"));
}

TEST_CASE("Windows sqlite: a database path over MAX_PATH works, as file_mutex's do") {
  temp_dir dir;
  // The directories are made through \\?\ (CreateDirectoryW stops at MAX_PATH without it).
  std::wstring deep = LR"(\\?\)" + fs::absolute(dir.path).wstring();
  fs::path long_dir = fs::absolute(dir.path);
  for (int i = 0; i < 6; ++i) {
    const std::wstring part(50, static_cast<wchar_t>(L'a' + i));
    deep += L"\\" + part;
    long_dir /= part;
    REQUIRE(::CreateDirectoryW(deep.c_str(), nullptr));
  }
  const auto db_path = long_dir / "deep.db";
  REQUIRE(db_path.wstring().size() > MAX_PATH);
  {
    dibs::sqlite_store s{db_path};
    REQUIRE(s.create("k", "v"));
  }
  CHECK(::GetFileAttributesW((deep + L"\\deep.db").c_str()) != INVALID_FILE_ATTRIBUTES);
  {
    dibs::sqlite_store again{db_path};
    REQUIRE(again.read("k"));
    CHECK(again.read("k")->value == "v");
  }
  // Removed through \\?\ here: temp_dir's remove_all does not reach this deep.
  ::DeleteFileW((deep + L"\\deep.db").c_str());
  for (int i = 0; i < 6; ++i) {
    ::RemoveDirectoryW(deep.c_str());
    deep.resize(deep.size() - 51);
  }
}

TEST_CASE("Windows sqlite: a database in a missing directory, or a directory as the database, is refused naming the path") {
  temp_dir dir;
  const auto in_missing = dir.path / "no-such-dir" / "q.db";
  std::error_code code;
  auto m = error_of([&] { dibs::sqlite_store s{in_missing}; }, &code);
  CHECK(code.category() == dibs::sqlite::category());
  CHECK((code.value() & 0xff) == SQLITE_CANTOPEN);
  CHECK_THAT(m, Catch::Contains(dibs::detail::path_text(in_missing)));
  CHECK_THAT(m, Catch::Contains("does not exist"));
  CHECK_FALSE(fs::exists(dir.path / "no-such-dir"));

  m = error_of([&] { dibs::sqlite::connection c{in_missing}; }, &code);
  CHECK(code.category() == dibs::sqlite::category());
  CHECK((code.value() & 0xff) == SQLITE_CANTOPEN);
  CHECK_THAT(m, Catch::Contains(dibs::detail::path_text(in_missing)));
  CHECK_THAT(m, Catch::Contains("does not exist"));

  const auto adir = dir.path / "adir";
  fs::create_directories(adir);
  m = error_of([&] { dibs::sqlite_store s{adir}; }, &code);
  CHECK(code == dibs::errc::invalid_argument);
  CHECK_THAT(m, Catch::Contains(dibs::detail::path_text(adir)));
  CHECK_THAT(m, Catch::Contains("it is a directory"));

  m = error_of([&] { dibs::sqlite::connection c{adir}; }, &code);
  CHECK(code.category() == dibs::sqlite::category());
  CHECK_THAT(m, Catch::Contains(dibs::detail::path_text(adir)));
  CHECK_THAT(m, Catch::Contains("it is a directory"));
  CHECK(fs::is_empty(adir));
}

TEST_CASE("Windows sqlite: 4 processes x 150 read-modify-write transactions, retried after database is locked (SQLITE_BUSY): the counter ends at exactly 600", "[chaos]") {
  temp_dir dir;
  const auto db_path = dir.path / "counter.db";
  {
    dibs::sqlite::connection db{db_path};
    db.exec("CREATE TABLE counter (v INTEGER NOT NULL); INSERT INTO counter VALUES (0)");
  }
  constexpr int procs = 4, rounds = 150;
  const auto go = dir.path / "go";
  std::vector<std::unique_ptr<child>> kids;
  for (int p = 0; p < procs; ++p)
    kids.push_back(std::make_unique<child>(std::vector<std::wstring>{
        L"--sql-count", db_path.wstring(), std::to_wstring(rounds), (dir.path / fmt::format("busy-{}", p)).wstring(),
        go.wstring()}));
  std::this_thread::sleep_for(500ms);  // let them open their connections
  std::ofstream{go} << "go\n";
  for (auto& k : kids) CHECK(k->wait(60s) == DWORD{0});
  long busy = 0;
  for (int p = 0; p < procs; ++p) {
    long b = -1;
    std::ifstream{dir.path / fmt::format("busy-{}", p)} >> b;
    CHECK(b >= 0);
    busy += b;
  }
  dibs::sqlite::connection db{db_path};
  INFO("attempts retried after SQLITE_BUSY: " << busy);
  CHECK(count(db, "SELECT v FROM counter") == procs * rounds);
  CHECK(busy > 0);  // the processes did meet each other's lock
}

TEST_CASE("Windows marker_claim<sqlite_store>: 4 worker processes, 2,000 items, 20 TerminateProcess kills: every item completed exactly once", "[chaos]") {
  temp_dir dir;
  const auto db_path = dir.path / "work.db";
  constexpr int workers = 4, items = 2000, kills = 20;
  dibs::sqlite_store store{db_path};
  auto& db = store.connection();
  db.exec("CREATE TABLE effects (item TEXT NOT NULL, token INTEGER NOT NULL, pid INTEGER NOT NULL)");

  std::vector<std::unique_ptr<child>> running(workers);
  int started = 0;
  auto start = [&](int slot) {
    running[static_cast<std::size_t>(slot)] = std::make_unique<child>(std::vector<std::wstring>{
        L"--sql-worker", db_path.wstring(), std::to_wstring(items), std::to_wstring(slot * items / workers)});
    ++started;
  };
  for (int w = 0; w < workers; ++w) start(w);
  std::mt19937 rng{std::random_device{}()};
  int killed = 0, killed_mid_work = 0;
  while (killed < kills) {
    std::this_thread::sleep_for(std::chrono::milliseconds{40 + rng() % 80});
    const int slot = static_cast<int>(rng() % workers);
    // A kill counts as landing mid-work if items were left when it came.
    const bool work_left =
        count(db, "SELECT count(*) FROM dibs_records_claims WHERE state = 'completed'") < items;
    running[static_cast<std::size_t>(slot)]->kill();
    ++killed;
    killed_mid_work += work_left;
    start(slot);
  }
  // The last workers finish the rest: all within a minute.
  const auto until = std::chrono::steady_clock::now() + 60s;
  for (auto& c : running)
    CHECK(c->wait(std::max(std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()),
                           0ms)) == DWORD{0});

  const auto completed = count(db, "SELECT count(*) FROM dibs_records_claims WHERE state = 'completed'");
  const auto retaken = count(db, "SELECT count(*) FROM dibs_records_claims WHERE attempts > 1");
  INFO("killed " << killed << " (" << killed_mid_work << " with items left), started " << started
                 << ", items claimed again after a kill " << retaken);
  CHECK(killed_mid_work == kills);
  CHECK(completed == items);
  CHECK(count(db, "SELECT count(*) FROM dibs_records_claims") == items);
  CHECK(count(db, "SELECT count(*) FROM effects") == items);  // a doubled completion would be a second row
  CHECK(count(db, "SELECT count(DISTINCT item) FROM effects") == items);
  // The effect kept is the completing claim's: its token is the record's
  // version before the completion.
  CHECK(count(db, "SELECT count(*) FROM effects e JOIN dibs_records_claims c ON c.key = e.item "
                  "WHERE c.token = e.token") == items);
  CHECK(retaken > 0);  // items of killed workers came back, and were done by others
  CHECK(count(db, "SELECT count(DISTINCT pid) FROM effects") > workers);
}

}  // namespace sqlite_win_test
