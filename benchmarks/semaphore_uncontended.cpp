// Uncontended acquire+release of a dibs::lease_semaphore against lock+unlock
// of a dibs::lease_mutex on the same store, one process, one thread (issue
// 33's goal: the semaphore within 1.2x the lock). Both with their default
// options (a renewal registered per hold), each on a store of its own in a
// fresh directory under $TMPDIR (or /tmp):
//
//   BM_lease_mutex/file, BM_lease_mutex/sqlite          the lock
//   BM_lease_semaphore/file/N, BM_lease_semaphore/sqlite/N
//                                                       N permits, N = 1 and 4
//   BM_lock_file                                        dibs::lock_file (its own
//                                                       file, rewritten in place)
//
//   build/bench-sem/benchmarks/semaphore_uncontended
//       --benchmark_repetitions=10 --benchmark_report_aggregates_only=true
#include <dibs/lease_mutex.hpp>
#include <dibs/lease_semaphore.hpp>
#include <dibs/lock_file.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/stores/sqlite_store.hpp>

#include <benchmark/benchmark.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace {

// A fresh directory per benchmark, removed when it ends.
struct bench_dir {
  std::filesystem::path path;
  bench_dir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/dibs-sem-bench.XXXXXX";
    if (!::mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed for " + templ);
    path = templ;
  }
  ~bench_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

template <class Store>
Store open_store(const std::filesystem::path& dir) {
  if constexpr (std::is_same_v<Store, dibs::sqlite_store>)
    return dibs::sqlite_store{dir / "records.db"};
  else
    return dibs::file_store{dir};
}

template <class Store>
void BM_lease_mutex(benchmark::State& state) {
  bench_dir dir;
  auto store = open_store<Store>(dir.path);
  dibs::lease_mutex<Store> m{store, "bench"};
  for (auto _ : state) {
    m.lock();
    m.unlock();
  }
}
BENCHMARK(BM_lease_mutex<dibs::file_store>)->Name("BM_lease_mutex/file");
BENCHMARK(BM_lease_mutex<dibs::sqlite_store>)->Name("BM_lease_mutex/sqlite");

template <class Store>
void BM_lease_semaphore(benchmark::State& state) {
  bench_dir dir;
  auto store = open_store<Store>(dir.path);
  dibs::lease_semaphore<Store> sem{store, "bench", static_cast<std::uint32_t>(state.range(0))};
  for (auto _ : state) {
    auto p = sem.acquire();
    p.release();
  }
}
BENCHMARK(BM_lease_semaphore<dibs::file_store>)->Name("BM_lease_semaphore/file")->Arg(1)->Arg(4);
BENCHMARK(BM_lease_semaphore<dibs::sqlite_store>)->Name("BM_lease_semaphore/sqlite")->Arg(1)->Arg(4);

void BM_lock_file(benchmark::State& state) {
  bench_dir dir;
  dibs::lock_file lk{dir.path / "bench.lock"};
  for (auto _ : state) {
    lk.lock();
    lk.unlock();
  }
}
BENCHMARK(BM_lock_file);

}  // namespace

BENCHMARK_MAIN();
