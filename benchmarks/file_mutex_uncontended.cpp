// file_mutex_uncontended: what one uncontended exclusive lock + unlock costs,
// for dibs::file_mutex and for what it is built on or competes with.
//
//   raw_flock          flock(fd, LOCK_EX) + flock(fd, LOCK_UN) on an open fd: the floor
//   raw_flock_pwrite   the same plus one 128-byte pwrite at offset 0: the floor of
//                      file_mutex's default, which writes its owner line on each lock
//   raw_ofd            fcntl(F_OFD_SETLKW) lock + unlock: the floor of lock_family::posix
//   raw_fcntl          fcntl(F_SETLKW) lock + unlock: the floor of Boost's file_lock
//   file_mutex_...     dibs::file_mutex, both families; "_no_owner": write_owner = false,
//                      otherwise write_owner = true (both spelled out, whatever the default)
//   file_mutex_flock_scoped  std::scoped_lock over a file_mutex with default options
//   boost_file_lock    boost::interprocess::file_lock lock() + unlock()
//
// The lock files live in a fresh directory under $DIBS_BENCH_DIR (default
// /var/tmp, which is on disk where /tmp may be a tmpfs); its filesystem type is
// printed in the context block. Run with repetitions and random interleaving,
// as run_lock_benchmarks.sh does, and read the medians:
//
//   file_mutex_uncontended --benchmark_repetitions=10
//       --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
//   (one command line)
#include <dibs/file_mutex.hpp>

#include <benchmark/benchmark.h>
#include <boost/interprocess/sync/file_lock.hpp>

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace fs = std::filesystem;

namespace {

fs::path& lock_dir() {
  static fs::path dir;
  return dir;
}

// Returns: a lock file of its own for one benchmark, created empty.
fs::path fresh_file(const char* name) {
  const fs::path p = lock_dir() / name;
  std::error_code ec;
  fs::remove(p, ec);
  const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "cannot create " + p.string());
  ::close(fd);
  return p;
}

int open_rw(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "cannot open " + p.string());
  return fd;
}

std::string fs_type(const fs::path& p) {
  struct ::statfs s {};
  if (::statfs(p.c_str(), &s) != 0) return "unknown";
  switch (static_cast<unsigned long>(s.f_type)) {
    case EXT4_SUPER_MAGIC: return "ext4 (or ext2/3)";
    case TMPFS_MAGIC: return "tmpfs";
    case BTRFS_SUPER_MAGIC: return "btrfs";
    case XFS_SUPER_MAGIC: return "xfs";
    case OVERLAYFS_SUPER_MAGIC: return "overlayfs";
    default: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "0x%lx", static_cast<unsigned long>(s.f_type));
      return buf;
    }
  }
}

void check(bool ok, benchmark::State& state, const char* what) {
  if (!ok) state.SkipWithError(what);
}

void BM_raw_flock(benchmark::State& state) {
  const int fd = open_rw(fresh_file("raw_flock.lock"));
  for (auto _ : state) {
    int rc = ::flock(fd, LOCK_EX);
    rc |= ::flock(fd, LOCK_UN);
    benchmark::DoNotOptimize(rc);
    if (rc != 0) {
      check(false, state, "flock failed");
      break;
    }
  }
  ::close(fd);
}
BENCHMARK(BM_raw_flock);

void BM_raw_flock_pwrite(benchmark::State& state) {
  const int fd = open_rw(fresh_file("raw_flock_pwrite.lock"));
  std::string line(127, ' ');
  line += '\n';
  for (auto _ : state) {
    int rc = ::flock(fd, LOCK_EX);
    const ssize_t n = ::pwrite(fd, line.data(), line.size(), 0);
    rc |= ::flock(fd, LOCK_UN);
    benchmark::DoNotOptimize(rc);
    if (rc != 0 || n != static_cast<ssize_t>(line.size())) {
      check(false, state, "flock or pwrite failed");
      break;
    }
  }
  ::close(fd);
}
BENCHMARK(BM_raw_flock_pwrite);

int fcntl_whole(int fd, int cmd, short type) {
  struct ::flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  return ::fcntl(fd, cmd, &fl);
}

void BM_raw_ofd(benchmark::State& state) {
  const int fd = open_rw(fresh_file("raw_ofd.lock"));
  for (auto _ : state) {
    int rc = fcntl_whole(fd, F_OFD_SETLKW, F_WRLCK);
    rc |= fcntl_whole(fd, F_OFD_SETLK, F_UNLCK);
    benchmark::DoNotOptimize(rc);
    if (rc != 0) {
      check(false, state, "F_OFD_SETLKW failed");
      break;
    }
  }
  ::close(fd);
}
BENCHMARK(BM_raw_ofd);

void BM_raw_fcntl(benchmark::State& state) {
  const int fd = open_rw(fresh_file("raw_fcntl.lock"));
  for (auto _ : state) {
    int rc = fcntl_whole(fd, F_SETLKW, F_WRLCK);
    rc |= fcntl_whole(fd, F_SETLK, F_UNLCK);
    benchmark::DoNotOptimize(rc);
    if (rc != 0) {
      check(false, state, "F_SETLKW failed");
      break;
    }
  }
  ::close(fd);
}
BENCHMARK(BM_raw_fcntl);

void run_file_mutex(benchmark::State& state, const char* file, dibs::file_mutex_options opts) {
  dibs::file_mutex m{fresh_file(file), opts};
  for (auto _ : state) {
    m.lock();
    m.unlock();
  }
  benchmark::DoNotOptimize(m.native_handle());
}

void BM_file_mutex_flock(benchmark::State& state) {
  run_file_mutex(state, "fm_flock.lock", {.family = dibs::lock_family::flock, .write_owner = true});
}
void BM_file_mutex_flock_no_owner(benchmark::State& state) {
  run_file_mutex(state, "fm_flock_no_owner.lock", {.family = dibs::lock_family::flock, .write_owner = false});
}
void BM_file_mutex_posix(benchmark::State& state) {
  run_file_mutex(state, "fm_posix.lock", {.family = dibs::lock_family::posix, .write_owner = true});
}
void BM_file_mutex_posix_no_owner(benchmark::State& state) {
  run_file_mutex(state, "fm_posix_no_owner.lock", {.family = dibs::lock_family::posix, .write_owner = false});
}
BENCHMARK(BM_file_mutex_flock);
BENCHMARK(BM_file_mutex_flock_no_owner);
BENCHMARK(BM_file_mutex_posix);
BENCHMARK(BM_file_mutex_posix_no_owner);

// Default options through std::scoped_lock, as a user would write it. The
// default has been write_owner = false since 12f84a6 (it was true before).
void BM_file_mutex_flock_scoped(benchmark::State& state) {
  dibs::file_mutex m{fresh_file("fm_flock_scoped.lock")};
  for (auto _ : state) {
    std::scoped_lock hold{m};
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_file_mutex_flock_scoped);

void BM_boost_file_lock(benchmark::State& state) {
  const fs::path p = fresh_file("boost.lock");
  boost::interprocess::file_lock l{p.c_str()};
  for (auto _ : state) {
    l.lock();
    l.unlock();
  }
}
BENCHMARK(BM_boost_file_lock);

}  // namespace

int main(int argc, char** argv) {
  const char* base = std::getenv("DIBS_BENCH_DIR");
  std::string tmpl = std::string(base && *base ? base : "/var/tmp") + "/dibs-fm-bench-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    std::fprintf(stderr, "file_mutex_uncontended: cannot make a directory from '%s': %s\n", tmpl.c_str(),
                 std::strerror(errno));
    return 1;
  }
  lock_dir() = tmpl;
  benchmark::AddCustomContext("lock_dir", tmpl);
  benchmark::AddCustomContext("lock_dir_fs", fs_type(tmpl));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  int rc = 0;
  try {
    benchmark::RunSpecifiedBenchmarks();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "file_mutex_uncontended: %s\n", e.what());
    rc = 1;
  }
  benchmark::Shutdown();
  std::error_code ec;
  fs::remove_all(lock_dir(), ec);
  return rc;
}
