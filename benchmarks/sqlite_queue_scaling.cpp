// claim_next + complete per item on sqlite_store with 1,000, 10,000 and
// 100,000 items queued (half of them already completed), against a
// hand-written indexed SQLite queue of the same size: a jobs table with a
// partial index over the waiting rows by priority, one UPDATE ... RETURNING
// that takes the first, one UPDATE that completes it (autocommit each, WAL,
// synchronous=NORMAL, as sqlite_store opens its file); and the same writing
// records as long as dibs's (the floor).
//
//   sqlite_queue_scaling --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// Each repetition claims and completes 400 items of a queue made before it
// (not timed). The database goes to $DIBS_BENCH_DIR (default /var/tmp, on disk).
#include <dibs/marker_claim.hpp>
#include <dibs/stores/sqlite_store.hpp>

#include <benchmark/benchmark.h>

#include <unistd.h>

#include <cstdlib>

#include "sqlite_claim_common.hpp"

namespace {

constexpr long per_run = 400;

std::filesystem::path db_path(std::string_view what) {
  const char* dir = std::getenv("DIBS_BENCH_DIR");
  return std::filesystem::path(dir ? dir : "/var/tmp") / fmt::format("dibs-bench-queue-{}-{}.db", what, ::getpid());
}

// A queue of `queued` items, the first half completed, the rest offered,
// written as marker_claim writes them (records made once, then copied row by
// row in one transaction: a claim per completed item would take minutes).
void make_dibs_queue(const std::filesystem::path& path, long queued) {
  bench::remove_database(path);
  std::string completed, offered;
  {
    dibs::sqlite_store s{path};
    dibs::marker_claim<dibs::sqlite_store> claims{s, {.renew = false}};
    auto c = claims.try_claim("proto-done");
    c->complete("ok");
    completed = s.read("proto-done")->value;
    claims.offer("proto-offered");
    offered = s.read("proto-offered")->value;
    s.connection().exec("DELETE FROM dibs_records");
  }
  dibs::sqlite::connection db{path};
  db.begin();
  auto ins = db.prepare("INSERT INTO dibs_records (key, value, version) VALUES (?1, ?2, 1)");
  for (long i = 0; i < queued; ++i) {
    ins.bind(1, bench::key_of(i)).bind(2, i < queued / 2 ? completed : offered);
    (void)ins.step();
  }
  db.commit();
}

void BM_marker_claim_sqlite_store(benchmark::State& state) {
  const long queued = state.range(0);
  const auto path = db_path("dibs");
  const bench::removed_at_exit cleanup{path};
  make_dibs_queue(path, queued);
  dibs::sqlite_store store{path};
  dibs::marker_claim<dibs::sqlite_store> claims{store};
  long done = 0;
  for (auto _ : state) {
    auto c = claims.claim_next();
    if (!c) {
      state.SkipWithError("the queue ran dry");
      break;
    }
    c->complete();
    ++done;
  }
  state.SetItemsProcessed(done);
}

// The hand-written indexed queue.
void make_jobs(const std::filesystem::path& path, long queued) {
  bench::remove_database(path);
  dibs::sqlite::connection db{path};
  db.exec("CREATE TABLE jobs (id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, state INTEGER NOT NULL DEFAULT 0, "
          "priority INTEGER NOT NULL DEFAULT 0, run_at INTEGER NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0, "
          "locked_by TEXT, locked_at INTEGER, record TEXT); "
          "CREATE INDEX jobs_waiting ON jobs (priority DESC, id) WHERE state = 0");
  db.begin();
  auto ins = db.prepare("INSERT INTO jobs (key, state) VALUES (?1, ?2)");
  for (long i = 0; i < queued; ++i) {
    ins.bind(1, bench::key_of(i)).bind(2, i < queued / 2 ? 2 : 0);
    (void)ins.step();
  }
  db.commit();
}

// The hand-written queue's loop; `claimed` and `done` are what its claim
// and completion write into the row's `record` column (empty: nothing).
void hand_loop(benchmark::State& state, const std::string& claimed, const std::string& done_value) {
  const long queued = state.range(0);
  const auto path = db_path("hand");
  const bench::removed_at_exit cleanup{path};
  make_jobs(path, queued);
  dibs::sqlite::connection db{path};
  auto take = db.prepare(
      "UPDATE jobs SET state = 1, attempts = attempts + 1, locked_by = ?1, locked_at = ?2, record = ?3 WHERE id = "
      "(SELECT id FROM jobs WHERE state = 0 AND run_at <= ?2 ORDER BY priority DESC, id LIMIT 1) RETURNING id");
  auto complete = db.prepare("UPDATE jobs SET state = 2, record = ?3 WHERE id = ?1 AND state = 1 AND locked_by = ?2");
  const std::string me = fmt::format("worker {}", ::getpid());
  const auto busy = dibs::retry_policy{}.deadline(std::chrono::seconds{30}).unlimited_attempts();
  auto bind_record = [](dibs::sqlite::statement& s, const std::string& r) {
    if (r.empty()) s.bind(3, nullptr);
    else s.bind(3, std::string_view{r});
  };
  long done = 0;
  for (auto _ : state) {
    const auto id = dibs::retry(busy, [&]() -> std::int64_t {
      take.bind(1, me).bind(2, static_cast<std::int64_t>(std::time(nullptr)));
      bind_record(take, claimed);
      if (!take.step()) return 0;
      const auto got = take.column_int64(0);
      while (take.step()) {
      }
      return got;
    });
    if (id == 0) {
      state.SkipWithError("the queue ran dry");
      break;
    }
    dibs::retry(busy, [&] {
      complete.bind(1, id).bind(2, me);
      bind_record(complete, done_value);
      (void)complete.step();
    });
    ++done;
  }
  state.SetItemsProcessed(done);
}

void BM_hand_written_indexed_queue(benchmark::State& state) { hand_loop(state, "", ""); }

// The floor: the hand-written queue also writing, at the claim and at the
// completion, records as long as marker_claim's (the owner that proves a
// worker gone, the nonce, the token): what is left between it and dibs is
// dibs's own work.
void BM_hand_written_dibs_records(benchmark::State& state) {
  std::string processing, completed;
  {
    const auto scratch = db_path("records");
    const bench::removed_at_exit cleanup{scratch};
    dibs::sqlite_store s{scratch};
    dibs::marker_claim<dibs::sqlite_store> claims{s, {.renew = false}};
    claims.offer("k");
    auto c = claims.claim_next();
    processing = s.read("k")->value;
    c->complete();
    completed = s.read("k")->value;
  }
  hand_loop(state, processing, completed);
}

}  // namespace

BENCHMARK(BM_hand_written_indexed_queue)->Arg(1'000)->Arg(10'000)->Arg(100'000)->Iterations(per_run)
    ->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_hand_written_dibs_records)->Arg(1'000)->Arg(10'000)->Arg(100'000)->Iterations(per_run)
    ->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_marker_claim_sqlite_store)->Arg(1'000)->Arg(10'000)->Arg(100'000)->Iterations(per_run)
    ->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK_MAIN();
