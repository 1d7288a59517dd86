// P processes share N permits of a dibs::lease_semaphore, against the same
// P processes sharing one lock (issue 33's goal: with 8 processes and N = 4,
// the semaphore's throughput at least 2x lock_file's on the same store).
// Each process does C rounds of
//   acquire (one permit, or the lock); hold it H µs (a sleep: the export or
//   compile job the permit guards); release.
// Each process opens its own store and semaphore (or lock) after the fork,
// then waits at the start gate (benchmarks/procs.hpp).
//
// A shared anonymous mapping counts who is inside at once: a process counts
// itself in right after acquire() returns and out right before release()
// (so the count never exceeds the true number of holders). "max_inside" is
// the most seen; above the limit (1 for a lock, N for the semaphore) is a
// failure, as are two holders of one permit index at once. "mean_inside" is
// the summed hold time over the wall time: how many held on average, the
// parallelism the ratio comes from. "wait" is each acquire()'s time from its
// call to its return.
//
//   semaphore_contended --impl <lock_file|lease_mutex|semaphore> [--store file|sqlite]
//                       [--procs P] [--permits N] [--cycles C] [--hold-us H] [--dir D]
//
//   lock_file    dibs::lock_file, the file `bench.lock` (file store only)
//   lease_mutex  dibs::lease_mutex<Store>, key "bench"
//   semaphore    dibs::lease_semaphore<Store>, name "bench", N permits
// Stores: file (dibs::file_store on a fresh directory under --dir, $TMPDIR
// or /tmp; lock_file's file goes in such a directory too), sqlite
// (dibs::sqlite_store, records.db in that directory). Default lease_options
// (a renewal registered per hold; waiting by the store's default: the
// host's queue on file_store, backoff on sqlite_store).
//
// Prints one JSON object: impl, store, procs, permits (the limit: 1 for a
// lock), cycles, hold_us, seconds (gate to the last exit), ops_per_s,
// ideal_ops_per_s (limit / hold) and efficiency (their quotient),
// max_inside, mean_inside, reached_limit (max_inside == the limit),
// permits_used (distinct indices held), over_limit, permit_clashes,
// wait p50/p90/p99/max, hold p50/p99 (the sleep as it ran), lost holds, ok.
// Exit status 1 if over the limit, a clash, a lost hold or a worker failed.
#include <dibs/lease_mutex.hpp>
#include <dibs/lease_semaphore.hpp>
#include <dibs/lock_file.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/stores/sqlite_store.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include "procs.hpp"

namespace {

using dibs_bench::mono_ns;

// The most permits whose holders are counted one by one.
constexpr int max_tracked = 64;

struct shared_page {
  std::atomic<int> inside;
  std::atomic<int> max_inside;
  std::atomic<std::int64_t> over_limit;      // acquisitions that made inside exceed the limit
  std::atomic<std::int64_t> permit_clashes;  // acquisitions of a permit index someone was inside
  std::atomic<std::int64_t> lost;            // holds found lost at release
  std::atomic<int> permit_inside[max_tracked];
  std::atomic<std::int64_t> permit_uses[max_tracked];
};

// One per round of each process.
struct sample {
  std::int64_t wait_ns;  // acquire() returned - acquire() called
  std::int64_t hold_ns;  // counted out - counted in
};

struct config {
  std::string impl = "semaphore";
  std::string store = "file";
  int procs = 8;
  int permits = 4;
  long cycles = 100;
  long hold_us = 2000;
  std::filesystem::path dir;  // the run's fresh directory
  int limit() const { return impl == "semaphore" ? permits : 1; }
};

// `lock()` returns the index of what was taken (0 for a lock); `unlock()`
// returns true if the hold turned out to be lost.
template <class Lock, class Unlock>
void rounds(const config& c, shared_page* sh, sample* out, Lock lock, Unlock unlock) {
  const int limit = c.limit();
  const auto hold = std::chrono::microseconds{c.hold_us};
  for (long i = 0; i < c.cycles; ++i) {
    const std::int64_t asked = mono_ns();
    const int index = lock();
    const std::int64_t in = mono_ns();
    const int now_inside = sh->inside.fetch_add(1) + 1;
    int seen = sh->max_inside.load();
    while (seen < now_inside && !sh->max_inside.compare_exchange_weak(seen, now_inside)) {
    }
    if (now_inside > limit) sh->over_limit.fetch_add(1);
    const bool tracked = index >= 0 && index < max_tracked;
    if (tracked) {
      if (sh->permit_inside[index].fetch_add(1) != 0) sh->permit_clashes.fetch_add(1);
      sh->permit_uses[index].fetch_add(1);
    }
    std::this_thread::sleep_for(hold);  // the work the permit guards
    if (tracked) sh->permit_inside[index].fetch_sub(1);
    sh->inside.fetch_sub(1);
    const std::int64_t left = mono_ns();
    if (unlock()) sh->lost.fetch_add(1);
    out[i] = sample{in - asked, left - in};
  }
}

template <class Store>
Store open_store(const std::filesystem::path& dir) {
  if constexpr (std::is_same_v<Store, dibs::sqlite_store>)
    return dibs::sqlite_store{dir / "records.db"};
  else
    return dibs::file_store{dir};
}

// One process's part: open, wait at the gate (if any), run the rounds.
template <class Store>
void worker(const config& c, shared_page* sh, sample* out, dibs_bench::gate* g) {
  auto store = open_store<Store>(c.dir);
  if (c.impl == "semaphore") {
    dibs::lease_semaphore<Store> sem{store, "bench", static_cast<std::uint32_t>(c.permits)};
    if (!g) return;
    g->wait();
    typename dibs::lease_semaphore<Store>::permit p;
    rounds(
        c, sh, out,
        [&] {
          p = sem.acquire();
          return static_cast<int>(p.index());
        },
        [&] {
          p.release();
          return p.lost();
        });
  } else {
    dibs::lease_mutex<Store> m{store, "bench"};
    if (!g) return;
    g->wait();
    rounds(
        c, sh, out,
        [&] {
          m.lock();
          return 0;
        },
        [&] {
          m.unlock();
          return m.lost();
        });
  }
}

void lock_file_worker(const config& c, shared_page* sh, sample* out, dibs_bench::gate* g) {
  dibs::lock_file lk{c.dir / "bench.lock"};
  if (!g) return;
  g->wait();
  rounds(
      c, sh, out,
      [&] {
        lk.lock();
        return 0;
      },
      [&] {
        lk.unlock();
        return lk.lost();
      });
}

// g == nullptr: only open (the set-up that makes the store's schema and
// the semaphore's record, in a process of its own before the timed ones).
void run_worker(const config& c, shared_page* sh, sample* out, dibs_bench::gate* g) {
  if (c.impl == "lock_file") return lock_file_worker(c, sh, out, g);
  if (c.store == "sqlite") return worker<dibs::sqlite_store>(c, sh, out, g);
  worker<dibs::file_store>(c, sh, out, g);
}

double pct(const std::vector<std::int64_t>& v, double p) { return dibs_bench::quantile(v, p / 100.0); }

[[noreturn]] void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s --impl <lock_file|lease_mutex|semaphore> [--store file|sqlite] [--procs P] [--permits N] "
               "[--cycles C] [--hold-us H] [--dir D]\n",
               argv0);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  config c;
  std::string dir_arg;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) usage(argv[0]);
    if (a == "--impl") c.impl = argv[i + 1];
    else if (a == "--store") c.store = argv[i + 1];
    else if (a == "--procs") c.procs = std::atoi(argv[i + 1]);
    else if (a == "--permits") c.permits = std::atoi(argv[i + 1]);
    else if (a == "--cycles") c.cycles = std::atol(argv[i + 1]);
    else if (a == "--hold-us") c.hold_us = std::atol(argv[i + 1]);
    else if (a == "--dir") dir_arg = argv[i + 1];
    else usage(argv[0]);
  }
  if ((c.impl != "lock_file" && c.impl != "lease_mutex" && c.impl != "semaphore") ||
      (c.store != "file" && c.store != "sqlite") || (c.impl == "lock_file" && c.store != "file") || c.procs < 1 ||
      c.permits < 1 || c.permits > max_tracked || c.cycles < 1 || c.hold_us < 0)
    usage(argv[0]);

  const char* tmp = std::getenv("TMPDIR");
  std::string templ =
      (dir_arg.empty() ? std::string(tmp && *tmp ? tmp : "/tmp") : dir_arg) + "/dibs-sem-contended.XXXXXX";
  if (!::mkdtemp(templ.data())) {
    std::perror("mkdtemp");
    return 3;
  }
  c.dir = templ;

  auto* sh = dibs_bench::shared_new<shared_page>();
  const std::size_t n_samples = static_cast<std::size_t>(c.procs) * static_cast<std::size_t>(c.cycles);
  void* mem = ::mmap(nullptr, n_samples * sizeof(sample), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("mmap");
    return 3;
  }
  auto* samples = static_cast<sample*>(mem);

  bool kids_ok = true;
  double seconds = 0;
  try {
    // The set-up in a process of its own: this one starts no dibs thread
    // and holds no store across the forks.
    dibs_bench::run_procs(1, [&](int, dibs_bench::gate& g) {
      run_worker(c, sh, samples, nullptr);
      g.wait();
    });
    seconds = dibs_bench::run_procs(c.procs, [&](int p, dibs_bench::gate& g) {
      run_worker(c, sh, samples + static_cast<std::size_t>(p) * static_cast<std::size_t>(c.cycles), &g);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "semaphore_contended: %s\n", e.what());
    kids_ok = false;
  }

  std::vector<std::int64_t> waits, holds;
  std::int64_t hold_total = 0;
  for (std::size_t i = 0; i < n_samples; ++i) {
    waits.push_back(samples[i].wait_ns);
    holds.push_back(samples[i].hold_ns);
    hold_total += samples[i].hold_ns;
  }
  int used = 0;
  for (const auto& u : sh->permit_uses) used += u.load() > 0;
  const int limit = c.limit();
  const int max_inside = sh->max_inside.load();
  const long long over = sh->over_limit.load(), clashes = sh->permit_clashes.load(), lost = sh->lost.load();
  const bool ok = kids_ok && over == 0 && clashes == 0 && lost == 0 && max_inside <= limit;
  const double ops = seconds > 0 ? static_cast<double>(n_samples) / seconds : 0;
  const double ideal = c.hold_us > 0 ? limit * 1e6 / static_cast<double>(c.hold_us) : 0;
  std::printf(
      "{\"impl\": \"%s\", \"store\": \"%s\", \"procs\": %d, \"permits\": %d, \"cycles\": %ld, \"hold_us\": %ld, "
      "\"seconds\": %.6f, \"ops_per_s\": %.1f, \"ideal_ops_per_s\": %.1f, \"efficiency\": %.3f, "
      "\"max_inside\": %d, \"mean_inside\": %.3f, \"reached_limit\": %s, \"permits_used\": %d, "
      "\"over_limit\": %lld, \"permit_clashes\": %lld, "
      "\"wait_p50_us\": %.1f, \"wait_p90_us\": %.1f, \"wait_p99_us\": %.1f, \"wait_max_us\": %.1f, "
      "\"hold_p50_us\": %.1f, \"hold_p99_us\": %.1f, \"lost\": %lld, \"children_ok\": %s, \"ok\": %s}\n",
      c.impl.c_str(), c.store.c_str(), c.procs, limit, c.cycles, c.hold_us, seconds, ops, ideal,
      ideal > 0 ? ops / ideal : 0, max_inside, seconds > 0 ? static_cast<double>(hold_total) / (seconds * 1e9) : 0,
      max_inside == limit ? "true" : "false", used, over, clashes, pct(waits, 50) / 1e3, pct(waits, 90) / 1e3,
      pct(waits, 99) / 1e3, pct(waits, 100) / 1e3, pct(holds, 50) / 1e3, pct(holds, 99) / 1e3, lost,
      kids_ok ? "true" : "false", ok ? "true" : "false");
  std::error_code ec;
  std::filesystem::remove_all(c.dir, ec);
  return ok ? 0 : 1;
}
