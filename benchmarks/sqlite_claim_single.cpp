// marker_claim<sqlite_store> claim+complete, one process, against the same work
// written by hand (bench::hand_claims: two autocommit statements per item).
// Each repetition claims and completes 20,000 fresh rows of a new mailbox.
//
//   sqlite_claim_single --benchmark_repetitions=10 --benchmark_report_aggregates_only=true
//
// The database goes to $DIBS_BENCH_DIR (default /var/tmp, on disk).
#include <dibs/marker_claim.hpp>

#include <benchmark/benchmark.h>

#include <cstdlib>

#include "sqlite_claim_common.hpp"

namespace {

constexpr long items = 20'000;

std::filesystem::path db_path() {
  const char* dir = std::getenv("DIBS_BENCH_DIR");
  return std::filesystem::path(dir ? dir : "/var/tmp") / fmt::format("dibs-bench-claim-{}.db", ::getpid());
}

void BM_marker_claim_sqlite_store(benchmark::State& state) {
  const auto path = db_path();
  const bench::removed_at_exit cleanup{path};
  bench::make_mailbox(path, items);
  dibs::sqlite_store store{path, "mailbox"};
  dibs::marker_claim<dibs::sqlite_store> claims{store};
  long i = 0, done = 0;
  for (auto _ : state) {
    if (auto c = claims.try_claim(bench::key_of(i++))) {
      c->complete();
      ++done;
    }
  }
  if (done != items) state.SkipWithError("not every item was claimed and completed");
  state.SetItemsProcessed(done);
}

void BM_hand_written_loop(benchmark::State& state) {
  const auto path = db_path();
  const bench::removed_at_exit cleanup{path};
  bench::make_mailbox(path, items);
  bench::hand_claims claims{path};
  long i = 0, done = 0;
  for (auto _ : state) done += claims.claim_and_complete(bench::key_of(i++));
  if (done != items) state.SkipWithError("not every item was claimed and completed");
  state.SetItemsProcessed(done);
}

// The floor: the hand-written loop writing the very records marker_claim
// writes (a processing record with its owner, then the completed record), so
// what is left between it and marker_claim is marker_claim's own work.
void BM_hand_written_loop_dibs_records(benchmark::State& state) {
  std::string processing, completed;
  {
    const auto scratch = db_path().string() + "-records";
    const bench::removed_at_exit cleanup{scratch};
    bench::make_mailbox(scratch, 1);
    dibs::sqlite_store store{scratch, "mailbox"};
    dibs::marker_claim<dibs::sqlite_store> claims{store};
    auto c = claims.try_claim(bench::key_of(0));
    processing = store.read(bench::key_of(0)).value().value;
    c->complete();
    completed = store.read(bench::key_of(0)).value().value;
  }
  const auto path = db_path();
  const bench::removed_at_exit cleanup{path};
  bench::make_mailbox(path, items);
  bench::hand_claims claims{path, processing, completed};
  long i = 0, done = 0;
  for (auto _ : state) done += claims.claim_and_complete(bench::key_of(i++));
  if (done != items) state.SkipWithError("not every item was claimed and completed");
  state.SetItemsProcessed(done);
}

BENCHMARK(BM_hand_written_loop)->Iterations(items)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_hand_written_loop_dibs_records)->Iterations(items)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_marker_claim_sqlite_store)->Iterations(items)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
