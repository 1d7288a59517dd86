// Uncontended lock+unlock of one lock file, one process, one thread:
//
//   BM_floor_open_excl_unlink  open(O_CREAT|O_EXCL|O_WRONLY) + close + unlink: the
//                              least a lock that is a file's existence can cost
//   BM_liblockfile             lockfile_create(path, 0, 0) + lockfile_remove
//                              (only when built with liblockfile)
//   BM_lock_file               dibs::lock_file, default options (renewal thread on)
//   BM_lock_file_norenew       dibs::lock_file with lease_options{.renew = false}
//   BM_lock_file_norenew_unlinked
//                              diagnostic: as above, and the "erased" record the
//                              unlock leaves is unlinked after each round, so every
//                              lock takes the path of a key that was never there
//   BM_jthread_start_join      diagnostic: start and join an idle std::jthread,
//                              what the renewal thread costs per hold at least
//
// The files live in a fresh directory under $TMPDIR (or /tmp); its filesystem
// is reported in the context block.
//
//   build/bench-store/benchmarks/store_lock_uncontended
//       --benchmark_repetitions=10 --benchmark_report_aggregates_only=true
#include <dibs/lease_mutex.hpp>
#include <dibs/lock_file.hpp>

#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>

#if DIBS_BENCH_HAVE_LIBLOCKFILE
#include <lockfile.h>
#endif

namespace {

std::string fs_name(const std::filesystem::path& p) {
  struct ::statfs s {};
  if (::statfs(p.c_str(), &s) != 0) return "unknown";
  switch (static_cast<unsigned long>(s.f_type)) {
    case 0xEF53: return "ext4 (or ext2/3)";
    case 0x01021994: return "tmpfs";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x794C7630: return "overlayfs";
    default: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "f_type 0x%lx", static_cast<unsigned long>(s.f_type));
      return buf;
    }
  }
}

// A fresh directory for the whole run, removed at exit (never destroyed
// itself, so the exit handler can still use it).
const std::filesystem::path& bench_dir() {
  static const std::filesystem::path* const dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/dibs-store-bench.XXXXXX";
    if (!::mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed for " + templ);
    auto* d = new std::filesystem::path(templ);
    benchmark::AddCustomContext("lock_dir", d->string());
    benchmark::AddCustomContext("lock_dir_fs", fs_name(*d));
    return d;
  }();
  static const bool cleanup = std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(*dir, ec);
  }) == 0;
  (void)cleanup;
  return *dir;
}

void BM_floor_open_excl_unlink(benchmark::State& state) {
  const std::string path = (bench_dir() / "floor.lock").string();
  for (auto _ : state) {
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);
    if (fd < 0) {
      state.SkipWithError("open(O_EXCL) failed");
      break;
    }
    ::close(fd);
    ::unlink(path.c_str());
  }
}
BENCHMARK(BM_floor_open_excl_unlink);

#if DIBS_BENCH_HAVE_LIBLOCKFILE
void BM_liblockfile(benchmark::State& state) {
  const std::string path = (bench_dir() / "liblockfile.lock").string();
  for (auto _ : state) {
    if (::lockfile_create(path.c_str(), 0, 0) != L_SUCCESS) {
      state.SkipWithError("lockfile_create failed");
      break;
    }
    ::lockfile_remove(path.c_str());
  }
}
BENCHMARK(BM_liblockfile);
#endif

void lock_file_loop(benchmark::State& state, dibs::lease_options opts, bool unlink_after) {
  const auto path = bench_dir() / (unlink_after ? "dibs-unlinked.lock" : opts.renew ? "dibs.lock" : "dibs-norenew.lock");
  dibs::lock_file lock{path, std::move(opts)};
  for (auto _ : state) {
    lock.lock();
    lock.unlock();
    if (unlink_after) ::unlink(path.c_str());
  }
}

void BM_lock_file(benchmark::State& state) { lock_file_loop(state, {}, false); }
BENCHMARK(BM_lock_file);

void BM_lock_file_norenew(benchmark::State& state) { lock_file_loop(state, {.renew = false}, false); }
BENCHMARK(BM_lock_file_norenew);

void BM_lock_file_norenew_unlinked(benchmark::State& state) { lock_file_loop(state, {.renew = false}, true); }
BENCHMARK(BM_lock_file_norenew_unlinked);

void BM_jthread_start_join(benchmark::State& state) {
  for (auto _ : state) {
    std::jthread t([](std::stop_token) {});
    t.join();
  }
}
BENCHMARK(BM_jthread_start_join);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  (void)bench_dir();  // before the run, so the context block names the directory
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
