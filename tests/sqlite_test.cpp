#include <dibs/sqlite/connection.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using Catch::Contains;
namespace fs = std::filesystem;

using dibs_test::temp_dir;

namespace {

std::error_code sqlite_code(int rc) { return dibs::sqlite::make_error_code(rc); }

}  // namespace

TEST_CASE("SQLite BUSY and LOCKED, with every extended variant, are transient, other codes are not") {
  for (int rc : {SQLITE_BUSY, SQLITE_LOCKED, SQLITE_BUSY_SNAPSHOT, SQLITE_BUSY_RECOVERY, SQLITE_BUSY_TIMEOUT,
                 SQLITE_LOCKED_SHAREDCACHE}) {
    INFO(rc);
    CHECK(dibs::is_transient(sqlite_code(rc)));
  }
  for (int rc : {SQLITE_ERROR, SQLITE_CONSTRAINT, SQLITE_NOTADB, SQLITE_CORRUPT, SQLITE_READONLY, SQLITE_CANTOPEN,
                 SQLITE_FULL, SQLITE_IOERR, SQLITE_CONSTRAINT_UNIQUE}) {
    INFO(rc);
    CHECK_FALSE(dibs::is_transient(sqlite_code(rc)));
  }
  CHECK(sqlite_code(SQLITE_BUSY).message() == "database is locked");
  CHECK(std::string(sqlite_code(SQLITE_BUSY).category().name()) == "sqlite");
}

TEST_CASE("a connection runs statements and opens in WAL mode by default") {
  temp_dir dir;
  dibs::sqlite::connection db{dir.path / "a.db"};
  db.exec("CREATE TABLE t(k TEXT PRIMARY KEY, v INTEGER)");
  auto ins = db.prepare("INSERT INTO t VALUES (?1, ?2)");
  ins.bind(1, "x").bind(2, 41);
  CHECK_FALSE(ins.step());
  CHECK(db.changes() == 1);
  CHECK(db.query_int64("SELECT v + 1 FROM t WHERE k = 'x'") == 42);
  CHECK_FALSE(db.query_int64("SELECT v FROM t WHERE k = 'nope'"));
  auto mode = db.prepare("PRAGMA journal_mode");
  REQUIRE(mode.step());
  CHECK(mode.column_text(0) == "wal");
}

TEST_CASE("begin() is BEGIN IMMEDIATE: a second writer is refused at begin, with a transient error") {
  temp_dir dir;
  dibs::sqlite::connection a{dir.path / "b.db"};
  dibs::sqlite::connection b{dir.path / "b.db"};
  a.exec("CREATE TABLE t(v INTEGER)");
  a.begin();
  CHECK(a.in_transaction());
  try {
    b.begin();
    FAIL("second writer got the lock");
  } catch (const std::system_error& e) {
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("BEGIN IMMEDIATE") && Contains((dir.path / "b.db").string()));
  }
  CHECK_FALSE(b.in_transaction());
  b.rollback();  // nothing open: a no-op
  a.rollback();
  CHECK_FALSE(a.in_transaction());
  b.begin();  // the lock is free again
  b.commit();
}

TEST_CASE("transact retries a transaction that lost the lock, and commits it whole") {
  temp_dir dir;
  dibs::sqlite::connection holder{dir.path / "c.db"};
  dibs::sqlite::connection db{dir.path / "c.db"};
  holder.exec("CREATE TABLE t(v INTEGER); INSERT INTO t VALUES (0)");
  holder.begin();
  int bodies = 0, sleeps = 0;
  auto p = dibs::retry_policy{}.sleeper([&](std::chrono::nanoseconds, std::stop_token) {
    if (++sleeps == 3) holder.commit();  // the other writer lets go after three refusals
  });
  dibs::transact(p, db, [&] {
    ++bodies;
    db.exec("UPDATE t SET v = v + 1");
  });
  CHECK(sleeps == 3);
  CHECK(bodies == 1);  // the body ran once: the failures were all at BEGIN IMMEDIATE
  CHECK(db.query_int64("SELECT v FROM t") == 1);
}

TEST_CASE("errors name the statement, the database and SQLite's message") {
  temp_dir dir;
  dibs::sqlite::connection db{dir.path / "d.db"};
  try {
    db.exec("SELEKT 1");
    FAIL("no exception");
  } catch (const std::system_error& e) {
    CHECK(e.code().category() == dibs::sqlite::category());
    CHECK(e.code().value() == SQLITE_ERROR);
    CHECK_THAT(e.what(), Contains("SELEKT 1") && Contains("d.db") && Contains("syntax error"));
  }
  db.exec("CREATE TABLE u(k INTEGER PRIMARY KEY)");
  db.exec("INSERT INTO u VALUES (1)");
  try {
    db.exec("INSERT INTO u VALUES (1)");
    FAIL("no exception");
  } catch (const std::system_error& e) {
    CHECK((e.code().value() & 0xff) == SQLITE_CONSTRAINT);
    CHECK_FALSE(dibs::is_transient(e.code()));
  }
}

TEST_CASE("a database in a missing directory is refused at open, naming the path") {
  temp_dir dir;
  const auto path = dir.path / "no" / "such" / "dir" / "x.db";
  try {
    dibs::sqlite::connection db{path};
    FAIL("opened");
  } catch (const std::system_error& e) {
    CHECK((e.code().value() & 0xff) == SQLITE_CANTOPEN);
    CHECK_THAT(e.what(), Contains(path.string()) && Contains("does not exist"));
  }
  CHECK_FALSE(fs::exists(dir.path / "no"));
}

TEST_CASE("a file that is not a database is refused at open, naming it, and left untouched") {
  temp_dir dir;
  const auto path = dir.path / "notes.txt";
  const std::string text(4096, 'z');
  std::ofstream(path) << text;
  try {
    dibs::sqlite::connection db{path};
    FAIL("opened");
  } catch (const std::system_error& e) {
    CHECK(e.code().value() == SQLITE_NOTADB);
    CHECK_THAT(e.what(), Contains(path.string()) && Contains("not a database"));
  }
  std::ifstream in(path);
  std::string after((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(after == text);
  CHECK_FALSE(fs::exists(dir.path / "notes.txt-wal"));
}

TEST_CASE("a read-only connection refuses writes with a clear error") {
  temp_dir dir;
  { dibs::sqlite::connection{dir.path / "r.db"}.exec("CREATE TABLE t(v INTEGER)"); }
  dibs::sqlite::connection ro{dir.path / "r.db", {.read_only = true}};
  try {
    ro.exec("INSERT INTO t VALUES (1)");
    FAIL("wrote");
  } catch (const std::system_error& e) {
    CHECK((e.code().value() & 0xff) == SQLITE_READONLY);
    CHECK_THAT(e.what(), Contains("r.db") && Contains("read-only"));
  }
}

// The foundation issue's multi-process test: 8 real processes x 200
// read-modify-write transactions on one counter, busy timeout 0, so every
// collision surfaces as SQLITE_BUSY and only the retry makes it through.
TEST_CASE("8 processes x 200 read-modify-write transactions: the counter ends at exactly 1600") {
  constexpr int processes = 8, transactions = 200;
  temp_dir dir;
  const auto path = dir.path / "counter.db";
  {
    dibs::sqlite::connection db{path};
    db.exec("CREATE TABLE counter(id INTEGER PRIMARY KEY, v INTEGER NOT NULL); INSERT INTO counter VALUES (1, 0)");
  }
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  std::vector<pid_t> children;
  for (int i = 0; i < processes; ++i) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(pipefd[0]);
      int code = 0;
      long retries = 0;
      try {
        dibs::sqlite::connection db{path, {.busy_timeout = 0ms}};
        auto policy = dibs::retry_policy{}
                          .unlimited_attempts()
                          .deadline(120s)
                          .backoff({100us, 2.0, 20ms})
                          .on_retry([&](const dibs::retry_event&) { ++retries; });
        for (int t = 0; t < transactions; ++t) {
          dibs::transact(policy, db, [&] {
            const auto v = db.query_int64("SELECT v FROM counter WHERE id = 1").value();
            auto up = db.prepare("UPDATE counter SET v = ?1 WHERE id = 1");
            up.bind(1, v + 1);
            up.step();
          });
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "worker %d: %s\n", i, e.what());
        code = 1;
      }
      const std::string line = std::to_string(retries) + "\n";
      (void)!::write(pipefd[1], line.data(), line.size());
      ::_exit(code);
    }
    children.push_back(pid);
  }
  ::close(pipefd[1]);
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::string report;
  char buf[256];
  for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;) report.append(buf, static_cast<std::size_t>(n));
  ::close(pipefd[0]);
  long retries = 0;
  for (std::size_t pos = 0, next; pos < report.size(); pos = next + 1) {
    next = report.find('\n', pos);
    retries += std::stol(report.substr(pos, next - pos));
  }
  INFO("retries across all workers: " << retries);
  CHECK(failed == 0);
  dibs::sqlite::connection db{path};
  CHECK(db.query_int64("SELECT v FROM counter WHERE id = 1") == processes * transactions);
}

TEST_CASE("open errors say what about the path is wrong, and never name a statement the caller did not write") {
  temp_dir dir;
  SECTION("a directory") {
    CHECK_THROWS_WITH(dibs::sqlite::connection{dir.path},
                      Contains(dir.path.string()) && Contains("is a directory") &&
                          !Contains("does the directory exist") && !Contains("SELECT"));
  }
  SECTION("a missing directory") {
    const auto path = dir.path / "nope" / "x.db";
    CHECK_THROWS_WITH(dibs::sqlite::connection{path},
                      Contains(path.string()) && Contains("'" + (dir.path / "nope").string() + "' does not exist"));
  }
  SECTION("a file that is not a database") {
    const auto path = dir.path / "text.db";
    dibs_test::spit(path, std::string(4096, 'x'));
    CHECK_THROWS_WITH(dibs::sqlite::connection{path}, Contains("cannot open database '" + path.string() + "'") &&
                                                          !Contains("SELECT count"));
  }
}

TEST_CASE("the busy hint does not tell a caller inside dibs::transact to use dibs::transact") {
  CHECK_THAT(std::string(dibs::sqlite::detail::hint(SQLITE_BUSY)), !Contains("with dibs::transact") && Contains("transient"));
}

TEST_CASE("a full filesystem at open is named as such, with the path, not as a statement of dibs's own") {
  temp_dir dir;
  const auto mnt = dir.path / "full";
  const auto r = dibs_test::on_full_filesystem(mnt, [](const fs::path& d) -> std::string {
    const auto db = d / "new.db";
    try {
      dibs::sqlite::connection c{db};
      c.exec("CREATE TABLE t (x)");
      return "opened and wrote: no error";
    } catch (const std::system_error& e) {
      return e.what();
    }
  });
  if (!r.ran) {
    WARN("could not mount a small tmpfs (" << r.what << "): the full-filesystem case was not run");
    return;
  }
  INFO(r.what);
  CHECK_THAT(r.what, Contains("cannot open database '" + (mnt / "new.db").string() + "'") &&
                         Contains("the filesystem of '" + mnt.string() + "' is full") && Contains("free space") &&
                         !Contains("SELECT") && !Contains("PRAGMA"));
}
