// The floor of a handoff between processes on this machine: N processes
// pass a turn round-robin through futex words in a shared page, each
// waking the next and then sleeping until its own turn comes back, as
// lease_mutex's queued waiters do, but with no lock record to write.
// A handoff's latency is from the stamp taken just before the wake to the
// woken process running again.
//
//   handoff_floor --procs N --rounds R
//
// Prints one JSON object: the handoffs' p50/p90/p99/max in ns.
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace {

std::int64_t mono_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

struct alignas(64) turn_word {
  std::atomic<std::uint32_t> word;
};

struct page {
  std::atomic<std::int64_t> stamp;
  turn_word turn[64];
};

void wait_word(std::atomic<std::uint32_t>& w, std::uint32_t seen) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&w), FUTEX_WAIT, seen, nullptr, nullptr, 0);
}
void wake_word(std::atomic<std::uint32_t>& w) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&w), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

double pct(std::vector<std::int64_t>& v, double p) {
  const auto k = static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return static_cast<double>(v[k]);
}

}  // namespace

int main(int argc, char** argv) {
  int procs = 8;
  long rounds = 2000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    if (a == "--procs") procs = std::atoi(argv[i + 1]);
    else if (a == "--rounds") rounds = std::atol(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s --procs N --rounds R\n", argv[0]);
      return 2;
    }
  }
  if (procs < 2 || procs > 64 || rounds < 1) return 2;
  const std::size_t n = static_cast<std::size_t>(procs) * static_cast<std::size_t>(rounds);
  void* mem = ::mmap(nullptr, sizeof(page) + n * sizeof(std::int64_t), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 3;
  auto* p = new (mem) page{};
  auto* lat = reinterpret_cast<std::int64_t*>(static_cast<char*>(mem) + sizeof(page));
  std::vector<pid_t> kids;
  for (int me = 0; me < procs; ++me) {
    const pid_t pid = ::fork();
    if (pid < 0) return 3;
    if (pid == 0) {
      auto& mine = p->turn[me].word;
      auto& next = p->turn[(me + 1) % procs].word;
      for (long r = 0; r < rounds; ++r) {
        // Our turn is the (r * procs + me)th; word counts turns given to us.
        while (mine.load() == static_cast<std::uint32_t>(r)) wait_word(mine, static_cast<std::uint32_t>(r));
        lat[static_cast<std::size_t>(me) * static_cast<std::size_t>(rounds) + static_cast<std::size_t>(r)] =
            (me == 0 && r == 0) ? -1 : mono_ns() - p->stamp.load();
        p->stamp.store(mono_ns());
        next.fetch_add(1);
        wake_word(next);
      }
      std::_Exit(0);
    }
    kids.push_back(pid);
  }
  p->stamp.store(mono_ns());
  p->turn[0].word.fetch_add(1);
  wake_word(p->turn[0].word);
  for (const pid_t k : kids) ::waitpid(k, nullptr, 0);
  std::vector<std::int64_t> v;
  for (std::size_t i = 0; i < n; ++i)
    if (lat[i] >= 0) v.push_back(lat[i]);
  std::printf("{\"procs\": %d, \"rounds\": %ld, \"handoffs\": %zu, \"p50_ns\": %.0f, \"p90_ns\": %.0f, \"p99_ns\": %.0f, "
              "\"max_ns\": %.0f}\n",
              procs, rounds, v.size(), pct(v, 50), pct(v, 90), pct(v, 99), pct(v, 100));
  return 0;
}
