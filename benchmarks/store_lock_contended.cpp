// N processes fight over one lock file; each does C rounds of
//   lock; read the stamp; read a plain counter file, add 1, write it back;
//   write the stamp; unlock.
// The stamp lives in a shared anonymous mmap page: the holder writes
// CLOCK_MONOTONIC ns and its own number there just before unlocking, and the
// next acquirer reads it right after acquiring. An acquisition whose stamp
// came from another process is a handoff; its latency is now - stamp.
// Acquisitions right after the same process's own unlock are counted apart.
// Each process asks again at once after its unlock.
//
// Fairness: every lock() call takes a request number and every acquisition
// an acquisition number (shared counters). An acquisition passed a request
// over if it was requested later and acquired earlier; "passed_over_max" is
// the most times any one request was passed over. "wait" is each
// acquisition's time from its lock() call to lock() returning.
//
//   store_lock_contended --impl <dibs|dibs-norenew|floor|liblockfile> --procs N --cycles C [--dir D]
//
// Prints one JSON object: wall time from the start barrier to the last exit,
// cycles/s, handoff count and p50/p90/p99/max, the counter's final value and
// whether it equals N*C, the share of acquisitions that are handoffs, the
// wait's p50/p90/p99/max, passed_over_max, and "lost": holds found broken at unlock (floor and
// liblockfile: the lock file was already gone, so someone else removed our
// lock; dibs: lost() was true). Exit status 1 if the counter is wrong, a hold
// was lost or a child failed.
//
// floor is the bare lock file: open(O_CREAT|O_EXCL|O_WRONLY) + close to lock,
// unlink to unlock. liblockfile is lockfile_create(path, 0, 0) (one try, no
// sleep of its own) and lockfile_remove; its own retry sleeps 5 s and more
// between tries. Both wait between tries by the same schedule as dibs's
// default lease_options::wait (500 us, x2, capped at 50 ms, full jitter).
#include <dibs/backoff.hpp>
#include <dibs/lease_mutex.hpp>
#include <dibs/lock_file.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if DIBS_BENCH_HAVE_LIBLOCKFILE
#include <lockfile.h>
#endif

#include "procs.hpp"

namespace {

using dibs_bench::mono_ns;

struct stamp_page {
  std::atomic<std::int64_t> released_ns;  // CLOCK_MONOTONIC just before the last unlock
  std::atomic<std::int32_t> holder;       // who unlocked last (-1: nobody yet)
  std::atomic<std::int64_t> lost;         // holds found broken at unlock
  std::atomic<std::uint32_t> requests;    // lock() calls so far
  std::atomic<std::uint32_t> acquired;    // acquisitions so far
};

// One entry per cycle of each process.
struct sample {
  std::int64_t wait_ns;     // now - released_ns at acquisition (-1 for the very first)
  std::int64_t request_ns;  // lock() returned - lock() called
  std::uint32_t request;    // this lock() call's request number
  std::uint32_t acquired;   // this acquisition's number
  std::int32_t handoff;     // 1: the stamp came from another process
  std::int32_t pad;
};

constexpr int counter_width = 24;

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::_Exit(3);
}

// The lock under test, as lock()/unlock() on one object per process.
class any_lock {
public:
  any_lock(std::string_view impl, const std::filesystem::path& path) : impl_(impl), path_(path) {
    if (impl == "dibs" || impl == "dibs-norenew") {
      dibs_.emplace(path, dibs::lease_options{.renew = impl == "dibs"});
    } else if (impl == "floor") {
      floor_ = true;
#if DIBS_BENCH_HAVE_LIBLOCKFILE
    } else if (impl == "liblockfile") {
#endif
    } else {
      std::fprintf(stderr, "unknown implementation '%.*s'\n", static_cast<int>(impl.size()), impl.data());
      std::exit(2);
    }
  }
  void lock() {
    if (dibs_) return dibs_->lock();
    thread_local std::mt19937_64 rng{std::random_device{}()};
    for (std::uint64_t n = 0;; ++n) {
      if (try_once()) return;
      std::this_thread::sleep_for(wait_.delay(n, {}, std::uniform_real_distribution<double>{0.0, 1.0}(rng)));
    }
  }
  // Returns: false if the hold turned out to be broken.
  bool unlock() {
    if (dibs_) {
      dibs_->unlock();
      return !dibs_->lost();
    }
    // lockfile_remove is this unlink with ENOENT ignored; here ENOENT is
    // counted: another process removed the file while we held it.
    if (::unlink(path_.c_str()) == 0) return true;
    if (errno != ENOENT) die("unlink lock");
    return false;
  }

private:
  bool try_once() {
    if (floor_) {
      const int fd = ::open(path_.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);
      if (fd >= 0) {
        ::close(fd);
        return true;
      }
      if (errno != EEXIST) die("open(O_EXCL) lock");
      return false;
    }
#if DIBS_BENCH_HAVE_LIBLOCKFILE
    const int rc = ::lockfile_create(path_.c_str(), 0, 0);
    if (rc == L_SUCCESS) return true;
    if (rc != L_MAXTRYS) {
      std::fprintf(stderr, "lockfile_create: %d\n", rc);
      std::_Exit(3);
    }
#endif
    return false;
  }

  std::string impl_;
  bool floor_ = false;
  std::filesystem::path path_;
  std::optional<dibs::lock_file> dibs_;
  dibs::exponential_backoff wait_ = dibs::lease_options{}.wait;
};

void add_one(int fd) {
  char buf[counter_width + 1] = {};
  if (::pread(fd, buf, counter_width, 0) != counter_width) die("pread counter");
  const unsigned long long v = std::strtoull(buf, nullptr, 10) + 1;
  std::snprintf(buf, sizeof buf, "%0*llu\n", counter_width - 1, v);
  if (::pwrite(fd, buf, counter_width, 0) != counter_width) die("pwrite counter");
}

void child(int me, std::string_view impl, const std::filesystem::path& dir, long cycles, stamp_page* page,
           sample* out, dibs_bench::gate& g) {
  any_lock lock{impl, dir / "the.lock"};
  const int counter = ::open((dir / "counter").c_str(), O_RDWR | O_CLOEXEC);
  if (counter < 0) die("open counter");
  g.wait();  // every process has opened its lock and the counter
  for (long i = 0; i < cycles; ++i) {
    const std::uint32_t request = page->requests.fetch_add(1);
    const std::int64_t asked = mono_ns();
    lock.lock();
    const std::int64_t now = mono_ns();
    const std::uint32_t acquired = page->acquired.fetch_add(1);
    const std::int32_t last = page->holder.load(std::memory_order_acquire);
    const std::int64_t released = page->released_ns.load(std::memory_order_relaxed);
    out[i] = sample{last < 0 ? -1 : now - released, now - asked, request, acquired, last >= 0 && last != me ? 1 : 0, 0};
    add_one(counter);
    page->released_ns.store(mono_ns(), std::memory_order_relaxed);
    page->holder.store(me, std::memory_order_release);
    if (!lock.unlock()) page->lost.fetch_add(1);
  }
  ::close(counter);
}

// The p-th percentile (nearest rank); -1 if there are none.
double pct(const std::vector<std::int64_t>& v, double p) { return v.empty() ? -1 : dibs_bench::quantile(v, p / 100.0); }

}  // namespace

int main(int argc, char** argv) {
  std::string impl = "dibs";
  int procs = 2;
  long cycles = 10'000;
  std::string dir_arg;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    if (a == "--impl") impl = argv[i + 1];
    else if (a == "--procs") procs = std::atoi(argv[i + 1]);
    else if (a == "--cycles") cycles = std::atol(argv[i + 1]);
    else if (a == "--dir") dir_arg = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: %s --impl <dibs|dibs-norenew|floor|liblockfile> --procs N --cycles C [--dir D]\n", argv[0]);
      return 2;
    }
  }
  if (procs < 1 || cycles < 1) return 2;

  // A fresh directory (under --dir, $TMPDIR or /tmp) for the lock and the counter.
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = (dir_arg.empty() ? std::string(tmp && *tmp ? tmp : "/tmp") : dir_arg) + "/dibs-contended.XXXXXX";
  if (!::mkdtemp(templ.data())) die("mkdtemp");
  const std::filesystem::path dir = templ;
  {
    const int fd = ::open((dir / "counter").c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) die("create counter");
    char buf[counter_width + 1];
    std::snprintf(buf, sizeof buf, "%0*d\n", counter_width - 1, 0);
    if (::write(fd, buf, counter_width) != counter_width) die("write counter");
    ::close(fd);
  }

  const std::size_t n_samples = static_cast<std::size_t>(procs) * static_cast<std::size_t>(cycles);
  const std::size_t bytes = 4096 + n_samples * sizeof(sample);
  void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) die("mmap");
  auto* page = new (mem) stamp_page{};
  page->holder.store(-1);
  page->lost.store(0);
  auto* samples = reinterpret_cast<sample*>(static_cast<char*>(mem) + 4096);

  bool kids_ok = true;
  double seconds = 0;
  try {
    seconds = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
      child(p, impl, dir, cycles, page, samples + static_cast<std::size_t>(p) * static_cast<std::size_t>(cycles), g);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store_lock_contended: %s\n", e.what());
    kids_ok = false;
  }

  unsigned long long counter = 0;
  {
    const int fd = ::open((dir / "counter").c_str(), O_RDONLY | O_CLOEXEC);
    char buf[counter_width + 1] = {};
    if (fd < 0 || ::read(fd, buf, counter_width) != counter_width) die("read counter");
    ::close(fd);
    counter = std::strtoull(buf, nullptr, 10);
  }
  std::vector<std::int64_t> handoff, self, waits;
  for (std::size_t i = 0; i < n_samples; ++i) {
    waits.push_back(samples[i].request_ns);
    if (samples[i].wait_ns < 0) continue;
    (samples[i].handoff ? handoff : self).push_back(samples[i].wait_ns);
  }
  // Passed over: in acquisition order, how many earlier acquisitions were
  // requested after this one (a Fenwick tree over request numbers).
  std::vector<std::uint32_t> request_of(n_samples);
  for (std::size_t i = 0; i < n_samples; ++i) request_of[samples[i].acquired] = samples[i].request;
  std::vector<std::uint32_t> tree(n_samples + 1, 0);
  std::uint64_t passed_max = 0, passed_over_8 = 0;
  for (std::size_t a = 0; a < n_samples; ++a) {
    std::uint64_t not_later = 0;  // earlier acquisitions requested no later than this one
    for (std::size_t k = request_of[a] + 1; k > 0; k -= k & (~k + 1)) not_later += tree[k];
    const std::uint64_t passed = a - not_later;
    passed_max = std::max(passed_max, passed);
    passed_over_8 += passed > 8;
    for (std::size_t k = request_of[a] + 1; k <= n_samples; k += k & (~k + 1)) ++tree[k];
  }
  const unsigned long long expected = n_samples;
  const long long lost = page->lost.load();
  const bool ok = kids_ok && counter == expected && lost == 0;
  std::printf(
      "{\"impl\": \"%s\", \"procs\": %d, \"cycles\": %ld, \"seconds\": %.6f, \"cycles_per_s\": %.1f, "
      "\"handoffs\": %zu, \"handoff_p50_ns\": %.0f, \"handoff_p90_ns\": %.0f, \"handoff_p99_ns\": %.0f, "
      "\"handoff_max_ns\": %.0f, \"self_reacquires\": %zu, \"self_p50_ns\": %.0f, \"handoff_share\": %.3f, "
      "\"wait_p50_ns\": %.0f, \"wait_p90_ns\": %.0f, \"wait_p99_ns\": %.0f, \"wait_max_ns\": %.0f, "
      "\"passed_over_max\": %llu, \"passed_over_more_than_8\": %llu, "
      "\"counter\": %llu, \"expected\": %llu, \"lost\": %lld, \"children_ok\": %s, \"ok\": %s}\n",
      impl.c_str(), procs, cycles, seconds, static_cast<double>(expected) / seconds, handoff.size(), pct(handoff, 50),
      pct(handoff, 90), pct(handoff, 99), pct(handoff, 100), self.size(), pct(self, 50),
      static_cast<double>(handoff.size()) / static_cast<double>(handoff.size() + self.size()), pct(waits, 50),
      pct(waits, 90), pct(waits, 99), pct(waits, 100), static_cast<unsigned long long>(passed_max),
      static_cast<unsigned long long>(passed_over_8), counter, expected,
      lost, kids_ok ? "true" : "false", ok ? "true" : "false");
  std::filesystem::remove_all(dir);
  return ok ? 0 : 1;
}
