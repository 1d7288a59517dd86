// marker_claim claim+complete throughput: P processes share M distinct items
// ("item-00000" ...). Process p walks all M keys once, starting at key
// p*M/P and wrapping around, and for each key does try_claim and, if it won,
// complete(). Items another process holds or has completed are skipped, so
// every process claims whatever it can and the run ends when all walks end.
//
//   store_marker_claim --store <file|file-inplace|shm> --procs P --items M [--dir D] [--check 0]
//
// file: a dibs::file_store in a fresh directory under --dir, $TMPDIR or /tmp.
// file-inplace: the same with file_store_options::in_place (records rewritten
//       inside their files, as dibs::lock_file does).
// shm:  a dibs::shm_store segment of its own (capacity 2*M, max_value 512),
//       removed at the end.
// Prints one JSON object: wall time from the start barrier to the last exit,
// completed items per second, the items each process won, and the check that
// the won counts add up to M and every item's state is "completed".
// Exit status 1 if the check fails. --check 0 leaves the state check out
// (for counting the walk's system calls alone).
#include <dibs/stores/file_store.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/stores/shm_store.hpp>

#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace {

std::int64_t mono_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::_Exit(3);
}

std::string key_of(long i) { return fmt::format("item-{:05d}", i); }

template <class Store>
long walk(Store& store, long items, long first) {
  dibs::marker_claim<Store> claims{store};
  long won = 0;
  for (long k = 0; k < items; ++k) {
    if (auto c = claims.try_claim(key_of((first + k) % items))) {
      c->complete();
      ++won;
    }
  }
  return won;
}

template <class Store>
long count_completed(Store& store, long items) {
  dibs::marker_claim<Store> claims{store};
  long n = 0;
  for (long i = 0; i < items; ++i) n += claims.status(key_of(i)).state == dibs::claim_state::completed;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  std::string kind = "file";
  int procs = 1;
  long items = 20'000;
  std::string dir_arg;
  bool check = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    if (a == "--check") check = std::atoi(argv[i + 1]) != 0;
    else if (a == "--store") kind = argv[i + 1];
    else if (a == "--procs") procs = std::atoi(argv[i + 1]);
    else if (a == "--items") items = std::atol(argv[i + 1]);
    else if (a == "--dir") dir_arg = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: %s --store <file|file-inplace|shm> --procs P --items M [--dir D] [--check 0]\n", argv[0]);
      return 2;
    }
  }
  const bool in_file = kind == "file" || kind == "file-inplace";
  if ((!in_file && kind != "shm") || procs < 1 || items < 1) return 2;

  std::filesystem::path dir;
  const std::string shm_name = fmt::format("dibs-bench-claims-{}", ::getpid());
  const dibs::shm_store_options shm_opts{.capacity = static_cast<std::uint32_t>(2 * items), .max_value = 512};
  if (in_file) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = (dir_arg.empty() ? std::string(tmp && *tmp ? tmp : "/tmp") : dir_arg) + "/dibs-claims.XXXXXX";
    if (!::mkdtemp(templ.data())) die("mkdtemp");
    dir = templ;
  } else {
    dibs::shm_store::remove(shm_name);
    dibs::shm_store setup{shm_name, shm_opts};  // set up once, before the clock starts
  }

  auto* won = static_cast<std::atomic<long>*>(
      ::mmap(nullptr, sizeof(std::atomic<long>) * static_cast<std::size_t>(procs), PROT_READ | PROT_WRITE,
             MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (won == MAP_FAILED) die("mmap");
  int start[2], ready[2];
  if (::pipe(start) != 0 || ::pipe(ready) != 0) die("pipe");
  std::vector<pid_t> kids;
  for (int p = 0; p < procs; ++p) {
    const pid_t pid = ::fork();
    if (pid < 0) die("fork");
    if (pid != 0) {
      kids.push_back(pid);
      continue;
    }
    ::close(start[1]);
    ::close(ready[0]);
    const long first = items * p / procs;
    auto run = [&](auto& store) {
      char c = 'r';
      if (::write(ready[1], &c, 1) != 1) die("write ready pipe");
      if (::read(start[0], &c, 1) < 0) die("read start pipe");
      won[p].store(walk(store, items, first));
    };
    try {
      if (in_file) {
        dibs::file_store store{dir, {.in_place = kind == "file-inplace"}};
        run(store);
      } else {
        dibs::shm_store store{shm_name, shm_opts};
        run(store);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "process %d: %s\n", p, e.what());
      std::_Exit(3);
    }
    std::_Exit(0);
  }
  ::close(start[0]);
  ::close(ready[1]);
  for (int p = 0; p < procs; ++p) {
    char c;
    if (::read(ready[0], &c, 1) != 1) die("read ready pipe");
  }
  const std::int64_t t0 = mono_ns();
  ::close(start[1]);
  bool kids_ok = true;
  for (const pid_t k : kids) {
    int st = 0;
    if (::waitpid(k, &st, 0) != k || !WIFEXITED(st) || WEXITSTATUS(st) != 0) kids_ok = false;
  }
  const std::int64_t t1 = mono_ns();

  long total = 0, lo = items, hi = 0;
  for (int p = 0; p < procs; ++p) {
    const long w = won[p].load();
    total += w;
    lo = std::min(lo, w);
    hi = std::max(hi, w);
  }
  long completed = check ? 0 : -1;
  if (in_file) {
    if (check) {
      dibs::file_store store{dir};
      completed = count_completed(store, items);
    }
    std::filesystem::remove_all(dir);
  } else {
    if (check) {
      dibs::shm_store store{shm_name, shm_opts};
      completed = count_completed(store, items);
    }
    dibs::shm_store::remove(shm_name);
  }
  const double seconds = static_cast<double>(t1 - t0) / 1e9;
  const bool ok = kids_ok && total == items && (!check || completed == items);
  std::printf(
      "{\"store\": \"%s\", \"procs\": %d, \"items\": %ld, \"seconds\": %.6f, \"claims_per_s\": %.1f, "
      "\"won_total\": %ld, \"won_min\": %ld, \"won_max\": %ld, \"completed\": %ld, \"ok\": %s}\n",
      kind.c_str(), procs, items, seconds, static_cast<double>(items) / seconds, total, lo, hi, completed,
      ok ? "true" : "false");
  return ok ? 0 : 1;
}
