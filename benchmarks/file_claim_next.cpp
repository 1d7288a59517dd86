// marker_claim<file_store>::claim_next + complete per item, one process, with
// N items queued of which half are already completed (the queue view's
// goal: the cost of a claim does not grow with the items done, nor much
// with the items waiting). N = 1,000, 10,000, 100,000.
//
//   file_claim_next --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// Each size's directory is made once (under $DIBS_BENCH_DIR, default
// /var/tmp, on disk): the records are written by file_store::create with
// the values marker_claim writes (an offered and a completed record, taken
// from a real claim), which keeps the queue view; the view is checked once
// before timing. Each repetition then claims and completes 200 items, and
// (untimed, after its loop) offers them again: every repetition starts
// with N/2 offered. The directories are removed at exit.
// Run each size in a process of its own (--benchmark_filter=/1000/ ...):
// on ext4, a directory of few files whose temporaries are made and removed
// at this rate spends most of a claim in the kernel's inode allocator
// (ext4_create -> recently_deleted, seen with perf), which is no cost of
// the queue view; DIBS_BENCH_DIR=/dev/shm (tmpfs) shows the view's own.
#include <dibs/marker_claim.hpp>
#include <dibs/stores/file_store.hpp>

#include <benchmark/benchmark.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace {

namespace fs = std::filesystem;
constexpr long per_repetition = 200;

fs::path bench_dir(long n) {
  const char* dir = std::getenv("DIBS_BENCH_DIR");
  return fs::path(dir ? dir : "/var/tmp") / fmt::format("dibs-bench-claim-next-{}-{}", ::getpid(), n);
}

struct queue_dir {
  fs::path path;
  std::string offered;
  // The worker's store, kept across repetitions as a worker keeps it: its
  // first claim lists the N/2 waiting entries, once per pass over them.
  std::unique_ptr<dibs::file_store> worker;
  explicit queue_dir(long n) : path(bench_dir(n)) {
    fs::remove_all(path);
    fs::create_directories(path);
    dibs::file_store store{path};
    dibs::marker_claim<dibs::file_store> claims{store, {.renew = false}};
    // The records marker_claim writes: offered, and completed.
    (void)claims.offer("model");
    offered = store.read("model").value().value;
    auto c = claims.claim_next();
    c->complete("done");
    const std::string completed = store.read("model").value().value;
    for (long i = 0; i < n; ++i)
      (void)store.create(fmt::format("item-{:06d}", i), i % 2 == 0 ? completed : offered);
    store.rebuild_queue_view();
    worker = std::make_unique<dibs::file_store>(path);
  }
  ~queue_dir() {
    worker.reset();
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

queue_dir& queue_of(long n) {
  static std::map<long, std::unique_ptr<queue_dir>> dirs;
  auto& d = dirs[n];
  if (!d) d = std::make_unique<queue_dir>(n);
  return *d;
}

void BM_file_store_claim_next_complete(benchmark::State& state) {
  const long n = state.range(0);
  auto& q = queue_of(n);
  auto& store = *q.worker;
  dibs::marker_claim<dibs::file_store> claims{store, {.renew = false}};
  long done = 0;
  std::vector<std::string> taken;
  taken.reserve(per_repetition);
  for (auto _ : state) {
    auto c = claims.claim_next();
    if (!c) {
      state.SkipWithError("the queue ran dry");
      break;
    }
    c->complete();
    taken.push_back(c->key());
    ++done;
  }
  // Offered again (not timed), for the next repetition.
  for (const auto& k : taken) (void)store.replace(k, store.read(k).value().version, q.offered);
  state.SetItemsProcessed(done);
  state.counters["queued"] = static_cast<double>(n);
}

BENCHMARK(BM_file_store_claim_next_complete)
    ->Arg(1'000)
    ->Arg(10'000)
    ->Arg(100'000)
    ->Iterations(per_repetition)
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
