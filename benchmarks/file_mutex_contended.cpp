// file_mutex_contended: P processes take turns at one lock. Each does N cycles
// of: lock; read a 64-bit counter from a file, add one, write it back; unlock.
//
// For each lock and each process count it reports:
//   - throughput: P*N cycles over the time from the starting gun (every
//     process has opened its lock and waits on a pipe) to the last process's
//     last unlock;
//   - handoff latency: the holder stores a CLOCK_MONOTONIC time stamp
//     (std::chrono::steady_clock) in a shared anonymous page just before it
//     unlocks, and the next acquirer reads it just after it has the lock. The
//     figure therefore includes the holder's unlock call. A handoff to another
//     process ("cross") and one back to the process that just unlocked
//     ("self": it unlocked and locked again before any waiter ran) are
//     counted apart; "all" is both. Neither flock(2) nor fcntl locks are fair.
// After every run the counter must equal P*N, or the program aborts.
//
//   file_mutex_contended [--procs 2,4,8] [--cycles N] [--repeat R]
//                        [--locks file_mutex,raw_flock,...] [--dir D]
//
// Locks (options spelled out, whatever the library's defaults):
//   file_mutex           flock family, write_owner = true (one pwrite per lock)
//   file_mutex_no_owner  flock family, write_owner = false (the default since 12f84a6)
//   file_mutex_posix     posix (OFD) family, write_owner = true
//   raw_flock, raw_ofd   the bare kernel calls on an open descriptor
//   boost_file_lock      boost::interprocess::file_lock (classic fcntl locks) Runs are
// interleaved (repeat, then process count, then lock) so drift on a noisy
// machine spreads over all of them; the summary gives medians over repeats.
// Files go to a fresh directory under D (default $DIBS_BENCH_DIR, else /var/tmp).
#include <dibs/file_mutex.hpp>

#include <boost/interprocess/sync/file_lock.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <new>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "procs.hpp"

namespace fs = std::filesystem;

namespace {

using dibs_bench::mono_ns;  // CLOCK_MONOTONIC, steady_clock's clock

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "file_mutex_contended: FATAL: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

std::system_error sys_error(const std::string& what) { return {errno, std::generic_category(), what}; }

constexpr int max_procs = 64;

struct shared_page {
  std::atomic<std::int64_t> last_unlock_ns{0};
  std::atomic<std::int32_t> last_holder{-1};
};

// The locks under test: constructed in the child, after fork().
struct raw_flock_lock {
  int fd;
  explicit raw_flock_lock(const fs::path& p) : fd(::open(p.c_str(), O_RDWR | O_CLOEXEC)) {
    if (fd < 0) throw sys_error("open " + p.string());
  }
  ~raw_flock_lock() { ::close(fd); }
  void lock() {
    while (::flock(fd, LOCK_EX) != 0)
      if (errno != EINTR) throw sys_error("flock");
  }
  void unlock() { ::flock(fd, LOCK_UN); }
};

struct raw_ofd_lock {
  int fd;
  explicit raw_ofd_lock(const fs::path& p) : fd(::open(p.c_str(), O_RDWR | O_CLOEXEC)) {
    if (fd < 0) throw sys_error("open " + p.string());
  }
  ~raw_ofd_lock() { ::close(fd); }
  int set(int cmd, short type) {
    struct ::flock fl {};
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    return ::fcntl(fd, cmd, &fl);
  }
  void lock() {
    while (set(F_OFD_SETLKW, F_WRLCK) != 0)
      if (errno != EINTR) throw sys_error("F_OFD_SETLKW");
  }
  void unlock() { set(F_OFD_SETLK, F_UNLCK); }
};

struct boost_lock {
  boost::interprocess::file_lock l;
  explicit boost_lock(const fs::path& p) : l(p.c_str()) {}
  void lock() { l.lock(); }
  void unlock() { l.unlock(); }
};

template <dibs::lock_family F, bool Owner>
struct dibs_lock {
  dibs::file_mutex m;
  explicit dibs_lock(const fs::path& p) : m(p, {.family = F, .write_owner = Owner}) {}
  void lock() { m.lock(); }
  void unlock() { m.unlock(); }
};

struct spec {
  fs::path lock_path, counter_path, out_path;
  long cycles;
};

void write_all(int fd, const void* data, std::size_t size, const char* what) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw sys_error(what);
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

template <class Lock>
void child(int id, const spec& s, shared_page* page, dibs_bench::gate& g) {
  {
    Lock l{s.lock_path};
    const int cfd = ::open(s.counter_path.c_str(), O_RDWR | O_CLOEXEC);
    if (cfd < 0) throw sys_error("open counter");
    std::vector<std::int64_t> cross, self;
    cross.reserve(static_cast<std::size_t>(s.cycles));
    self.reserve(static_cast<std::size_t>(s.cycles));
    g.wait();
    for (long n = 0; n < s.cycles; ++n) {
      l.lock();
      const std::int64_t t = mono_ns();
      const std::int64_t last = page->last_unlock_ns.load(std::memory_order_acquire);
      const std::int32_t who = page->last_holder.load(std::memory_order_relaxed);
      if (last != 0) (who == id ? self : cross).push_back(t - last);
      std::uint64_t v = 0;
      if (::pread(cfd, &v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) throw sys_error("pread counter");
      ++v;
      if (::pwrite(cfd, &v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) throw sys_error("pwrite counter");
      page->last_holder.store(id, std::memory_order_relaxed);
      page->last_unlock_ns.store(mono_ns(), std::memory_order_release);
      l.unlock();
    }
    g.end();
    ::close(cfd);
    const int out = ::open(s.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) throw sys_error("open " + s.out_path.string());
    const std::uint64_t counts[2] = {cross.size(), self.size()};
    write_all(out, counts, sizeof counts, "write latencies");
    write_all(out, cross.data(), cross.size() * sizeof(std::int64_t), "write latencies");
    write_all(out, self.data(), self.size() * sizeof(std::int64_t), "write latencies");
    ::close(out);
  }
}

using child_fn = void (*)(int, const spec&, shared_page*, dibs_bench::gate&);

const std::vector<std::pair<std::string, child_fn>>& all_locks() {
  static const std::vector<std::pair<std::string, child_fn>> v = {
      {"file_mutex", &child<dibs_lock<dibs::lock_family::flock, true>>},
      {"file_mutex_no_owner", &child<dibs_lock<dibs::lock_family::flock, false>>},
      {"file_mutex_posix", &child<dibs_lock<dibs::lock_family::posix, true>>},
      {"raw_flock", &child<raw_flock_lock>},
      {"raw_ofd", &child<raw_ofd_lock>},
      {"boost_file_lock", &child<boost_lock>},
  };
  return v;
}

struct result {
  double cycles_per_s = 0;
  double p50_all = 0, p99_all = 0, p50_cross = 0, p99_cross = 0, cross_share = 0;
};

result run_once(const std::string& name, child_fn fn, int procs, long cycles, const fs::path& base) {
  const fs::path dir = base / fmt::format("{}-{}", name, procs);
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path lock_path = dir / "lock", counter_path = dir / "counter";
  {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) die("cannot create " + lock_path.string());
    ::close(fd);
    const int c = ::open(counter_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    const std::uint64_t zero = 0;
    if (c < 0 || ::pwrite(c, &zero, sizeof zero, 0) != static_cast<ssize_t>(sizeof zero))
      die("cannot create " + counter_path.string());
    ::close(c);
  }
  auto* page = dibs_bench::shared_new<shared_page>();
  double secs = 0;
  try {
    secs = dibs_bench::run_procs(procs, [&](int i, dibs_bench::gate& g) {
      fn(i, spec{lock_path, counter_path, dir / fmt::format("lat-{}", i), cycles}, page, g);
    });
  } catch (const std::exception& e) {
    die(fmt::format("{} with {} processes: {}", name, procs, e.what()));
  }
  std::uint64_t total = 0;
  {
    const int c = ::open(counter_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (c < 0 || ::pread(c, &total, sizeof total, 0) != static_cast<ssize_t>(sizeof total)) die("cannot read counter");
    ::close(c);
  }
  const auto expected = static_cast<std::uint64_t>(procs) * static_cast<std::uint64_t>(cycles);
  if (total != expected)
    die(fmt::format("{} with {} processes: counter is {}, expected {}: the lock did not exclude", name, procs, total,
                    expected));

  std::vector<std::int64_t> cross, all;
  for (int i = 0; i < procs; ++i) {
    const fs::path p = dir / fmt::format("lat-{}", i);
    FILE* f = std::fopen(p.c_str(), "rb");
    std::uint64_t counts[2];
    if (!f || std::fread(counts, sizeof counts, 1, f) != 1) die("cannot read " + p.string());
    std::vector<std::int64_t> c(counts[0]), s(counts[1]);
    if ((counts[0] && std::fread(c.data(), sizeof(std::int64_t), c.size(), f) != c.size()) ||
        (counts[1] && std::fread(s.data(), sizeof(std::int64_t), s.size(), f) != s.size()))
      die("short " + p.string());
    std::fclose(f);
    cross.insert(cross.end(), c.begin(), c.end());
    all.insert(all.end(), c.begin(), c.end());
    all.insert(all.end(), s.begin(), s.end());
  }
  fs::remove_all(dir);

  result r;
  r.cycles_per_s = static_cast<double>(expected) / secs;
  r.cross_share = all.empty() ? 0 : static_cast<double>(cross.size()) / static_cast<double>(all.size());
  r.p50_all = dibs_bench::quantile(all, 0.50);
  r.p99_all = dibs_bench::quantile(all, 0.99);
  r.p50_cross = dibs_bench::quantile(cross, 0.50);
  r.p99_cross = dibs_bench::quantile(cross, 0.99);
  return r;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> procs = {2, 4, 8};
  long cycles = 20000;
  int repeat = 3;
  std::vector<std::string> locks;
  for (const auto& l : all_locks()) locks.push_back(l.first);
  const char* env_dir = std::getenv("DIBS_BENCH_DIR");
  std::string base = env_dir && *env_dir ? env_dir : "/var/tmp";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--procs") {
      procs.clear();
      for (const auto& p : split(value())) procs.push_back(std::stoi(p));
    } else if (a == "--cycles") cycles = std::stol(value());
    else if (a == "--repeat") repeat = std::stoi(value());
    else if (a == "--locks") locks = split(value());
    else if (a == "--dir") base = value();
    else die("unknown argument " + a + " (see the comment at the top of file_mutex_contended.cpp)");
  }
  for (int p : procs)
    if (p < 1 || p > max_procs) die("process count out of range");
  std::map<std::string, child_fn> by_name(all_locks().begin(), all_locks().end());
  for (const auto& l : locks)
    if (!by_name.count(l)) die("unknown lock " + l);

  std::string tmpl = base + "/dibs-fm-contended-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) die("cannot make a directory under " + base);
  const fs::path dir = tmpl;
  fmt::print("# file_mutex_contended: {} cycles per process, {} repeats, files in {}\n", cycles, repeat, dir.string());
  fmt::print("# run lock procs cycles_per_s p50_all_ns p99_all_ns p50_cross_ns p99_cross_ns cross_share\n");
  std::fflush(stdout);

  std::map<std::pair<std::string, int>, std::vector<result>> results;
  for (int r = 0; r < repeat; ++r)
    for (int p : procs)
      for (const auto& l : locks) {
        const result x = run_once(l, by_name[l], p, cycles, dir);
        results[{l, p}].push_back(x);
        fmt::print("run {} {} {} {:.0f} {:.0f} {:.0f} {:.0f} {:.0f} {:.3f}\n", r, l, p, x.cycles_per_s, x.p50_all,
                   x.p99_all, x.p50_cross, x.p99_cross, x.cross_share);
        std::fflush(stdout);
      }
  fs::remove_all(dir);

  fmt::print("\n# medians over {} repeats (latencies in microseconds; counter verified after every run)\n", repeat);
  fmt::print("| lock | procs | cycles/s | handoff p50 all | p99 all | p50 cross | p99 cross | cross share |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int p : procs)
    for (const auto& l : locks) {
      const auto& v = results[{l, p}];
      const auto med = [&](double result::*m) {
        std::vector<double> xs;
        for (const auto& x : v) xs.push_back(x.*m);
        return dibs_bench::median(xs);
      };
      fmt::print("| {} | {} | {:.0f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.3f} |\n", l, p, med(&result::cycles_per_s),
                 med(&result::p50_all) / 1e3, med(&result::p99_all) / 1e3, med(&result::p50_cross) / 1e3,
                 med(&result::p99_cross) / 1e3, med(&result::cross_share));
    }
  return 0;
}
