// The multi-process benchmark harness: P forked workers that each set up
// (open their store, connect, prepare), then wait behind one start gate, so
// the clock measures the work and not the set-up; wait; medians.
//
//   auto* sh = dibs_bench::shared_new<shared>();   // results, seen by all
//   double secs = dibs_bench::run_procs(8, [&](int p, dibs_bench::gate& g) {
//     worker w{...};      // set-up, not timed
//     g.wait();           // ready; returns when every worker is
//     sh->won[p] = w.run();
//   });
//
// The time is from the gate's opening to the last worker's exit, or, where
// workers call g.end(), to the latest end() (for workers that must stay
// alive after their last item: see procs_options::stay_until_all_done).
// A worker that throws prints why and makes run_procs throw once all have
// exited; one that fails before the gate is noticed and does not hang it.
#pragma once

#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace dibs_bench {

inline std::int64_t mono_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

/// Returns: a value-initialised T in memory that forked processes share
/// (an anonymous shared mapping; never freed: a benchmark makes few).
/// T must be usable across processes: atomics and plain data only.
template <class T>
T* shared_new() {
  void* mem = ::mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap of the shared results");
  return new (mem) T{};
}

struct procs_options {
  /// No worker exits before all are done: for claim benchmarks, where a
  /// claim whose process is gone is fair game and a worker still racing
  /// would recover it.
  bool stay_until_all_done = false;
};

class gate;
template <class Body>
double run_procs(int procs, Body body, procs_options opts = {});

/// The start gate and end marks of one run_procs.
class gate {
public:
  /// Effects: says this worker is ready; returns once every worker is and
  /// the clock has started. Call it once, after the worker's set-up.
  void wait() {
    ready_.fetch_add(1);
    // Blocked, not spinning: on a machine with fewer cores than workers, a
    // spinning worker would take the CPU from the others' set-up.
    char c;
    while (::read(go_fd_, &c, 1) < 0 && errno == EINTR) {
    }
  }

  /// Effects: marks that this worker's timed work ended now (the run's time
  /// ends at the latest mark, if any worker marks).
  void end() {
    const auto now = mono_ns();
    auto seen = last_end_ns_.load();
    while (seen < now && !last_end_ns_.compare_exchange_weak(seen, now)) {
    }
  }

private:
  template <class Body>
  friend double run_procs(int, Body, procs_options);

  std::atomic<int> ready_{0};
  std::atomic<int> go_{0};
  int go_fd_ = -1;  // the read end of a pipe whose write end run_procs closes at the start
  std::atomic<int> finished_{0};
  std::atomic<std::int64_t> last_end_ns_{0};
};

/// Effects: forks `procs` workers, runs body(p, gate&) in worker p (0-based),
/// opens the gate once all are ready, waits for all to exit.
/// Returns: seconds from the gate's opening to the last exit or end() mark.
/// Throws: std::runtime_error if a worker threw or exited other than 0.
template <class Body>
double run_procs(int procs, Body body, procs_options opts) {
  gate* g = shared_new<gate>();
  int go[2];
  if (::pipe(go) != 0) throw std::system_error(errno, std::generic_category(), "pipe of the start gate");
  g->go_fd_ = go[0];
  auto open_gate = [&] {
    if (go[1] >= 0) ::close(go[1]);
    go[1] = -1;
    g->go_.store(1);
  };
  std::vector<pid_t> pids;
  auto reap_all = [&] {
    int failed = 0;
    for (pid_t pid : pids) {
      int st = 0;
      while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
      failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    return failed;
  };
  for (int p = 0; p < procs; ++p) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      open_gate();
      reap_all();
      ::close(go[0]);
      throw std::system_error(err, std::generic_category(), "fork of benchmark worker " + std::to_string(p));
    }
    if (pid == 0) {
      ::close(go[1]);
      int code = 0;
      try {
        body(p, *g);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "worker %d: %s\n", p, e.what());
        code = 1;
      }
      g->finished_.fetch_add(1);
      if (opts.stay_until_all_done)
        while (g->go_.load() && g->finished_.load() < procs) ::usleep(1000);
      std::fflush(nullptr);
      std::_Exit(code);  // no destructors: the parent's objects are not the worker's to tidy
    }
    pids.push_back(pid);
  }
  while (g->ready_.load() < procs) {
    int st = 0;
    if (const pid_t gone = ::waitpid(-1, &st, WNOHANG); gone > 0) {
      std::erase(pids, gone);
      open_gate();
      reap_all();
      ::close(go[0]);
      throw std::runtime_error("a benchmark worker exited before the start gate");
    }
    ::usleep(200);
  }
  const auto t0 = mono_ns();
  open_gate();
  ::close(go[0]);
  const int failed = reap_all();
  const auto t1 = g->last_end_ns_.load() != 0 ? g->last_end_ns_.load() : mono_ns();
  if (failed) throw std::runtime_error(std::to_string(failed) + " benchmark worker(s) failed");
  return static_cast<double>(t1 - t0) / 1e9;
}

/// Returns: the q-quantile (0 ≤ q ≤ 1) of v, nearest rank; 0 if v is empty.
template <class T>
double quantile(std::vector<T> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return static_cast<double>(v[std::min(i, v.size() - 1)]);
}

/// Returns: the median of v (the mean of the middle two if even); 0 if empty.
template <class T>
double median(std::vector<T> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? static_cast<double>(v[n / 2]) : (static_cast<double>(v[n / 2 - 1]) + static_cast<double>(v[n / 2])) / 2;
}

}  // namespace dibs_bench
