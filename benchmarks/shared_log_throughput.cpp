// shared_log_throughput: P processes append R records of 100 bytes each
// (newline included) to one log at once, four ways:
//
//   shared_log     dibs::shared_log::append
//   raw_append     one write() per record on an O_APPEND descriptor, no lock:
//                  the ceiling (and safe only for small records on a local disk)
//   flock_append   flock(LOCK_EX), write() on O_APPEND, flock(LOCK_UN): what a
//                  kernel-locked appender costs, for comparison
//   fstat_append   fstat() then write() on O_APPEND, no lock: isolates what
//                  shared_log's fstat before each record costs (not run by default)
//   lseek_append   lseek(SEEK_END) then write(), no lock: the same with a call
//                  that does not look at the file's timestamps (not run by default)
//   seed_lockfile  the lock-file idiom of examples/batch_log.cpp: create
//                  "<log>.lck" with O_EXCL (sleep 50 ms and retry while it
//                  exists), open the log for append, write, close, delete the
//                  lock file. It never gives up here, so every record lands.
//                  Far slower: it gets its own record count (--seed-records).
//
// Throughput is the records of all processes over the time from the starting
// gun (every process has opened its log and waits on a pipe) to the last
// process's last append. After every run the file must hold exactly P*R
// whole records, each (process, sequence) once, or the program aborts.
//
//   shared_log_throughput [--procs 8] [--records 100000] [--seed-records 200]
//                         [--repeat 3] [--ways shared_log,raw_append,...] [--dir D]
//   (default ways: shared_log, raw_append, flock_append, seed_lockfile)
//
// Runs are interleaved (repeat, then way); the summary gives medians.
// Files go to a fresh directory under D (default $DIBS_BENCH_DIR, else /var/tmp).
#include <dibs/shared_log.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
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
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "procs.hpp"

namespace fs = std::filesystem;

namespace {

constexpr std::size_t record_size = 100;
constexpr int max_procs = 64;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "shared_log_throughput: FATAL: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

std::system_error sys_error(const std::string& what) { return {errno, std::generic_category(), what}; }

struct shared_page {
  std::atomic<std::int64_t> failed_tries[max_procs];  // seed_lockfile: O_EXCL tries that found the lock taken
};

// "p03 r0001234 xxxx...x\n": 100 bytes.
void make_record(char* out, int proc, long seq) {
  const int n = std::snprintf(out, record_size, "p%02d r%07ld ", proc, seq);
  std::memset(out + n, 'x', record_size - 1 - static_cast<std::size_t>(n));
  out[record_size - 1] = '\n';
}

void write_record(int fd, const char* rec) {
  for (;;) {
    const ssize_t n = ::write(fd, rec, record_size);
    if (n == static_cast<ssize_t>(record_size)) return;
    if (n < 0 && errno == EINTR) continue;
    throw sys_error("write (short or failed)");
  }
}

// The ways under test: constructed in the child, after fork().
struct raw_append {
  int fd;
  explicit raw_append(const fs::path& log) : fd(::open(log.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd < 0) throw sys_error("open " + log.string());
  }
  ~raw_append() { ::close(fd); }
  void append(const char* rec, int) { write_record(fd, rec); }
};

struct fstat_append : raw_append {
  using raw_append::raw_append;
  void append(const char* rec, int id) {
    struct ::stat st {};
    if (::fstat(fd, &st) != 0) throw sys_error("fstat");
    raw_append::append(rec, id);
  }
};

struct lseek_append : raw_append {
  using raw_append::raw_append;
  void append(const char* rec, int id) {
    if (::lseek(fd, 0, SEEK_END) < 0) throw sys_error("lseek");
    raw_append::append(rec, id);
  }
};

struct flock_append {
  int fd, lock_fd;
  explicit flock_append(const fs::path& log)
      : fd(::open(log.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644)),
        lock_fd(::open((log.string() + ".flock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd < 0 || lock_fd < 0) throw sys_error("open " + log.string());
  }
  ~flock_append() {
    ::close(fd);
    ::close(lock_fd);
  }
  void append(const char* rec, int) {
    while (::flock(lock_fd, LOCK_EX) != 0)
      if (errno != EINTR) throw sys_error("flock");
    write_record(fd, rec);
    ::flock(lock_fd, LOCK_UN);
  }
};

struct dibs_append {
  dibs::shared_log log;
  explicit dibs_append(const fs::path& p) : log(p) {}
  void append(const char* rec, int) { log.append(std::string_view{rec, record_size}); }
};

struct seed_lockfile {
  fs::path log;
  std::string lock;
  shared_page* page = nullptr;
  explicit seed_lockfile(const fs::path& p) : log(p), lock(p.string() + ".lck") {}
  void append(const char* rec, int id) {
    for (;;) {
      const int l = ::open(lock.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (l >= 0) {
        ::close(l);
        const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (out < 0) throw sys_error("open " + log.string());
        write_record(out, rec);
        ::close(out);
        if (::unlink(lock.c_str()) != 0) throw sys_error("unlink " + lock);
        return;
      }
      if (errno != EEXIST && errno != EINTR) throw sys_error("open " + lock);
      page->failed_tries[id].fetch_add(1, std::memory_order_relaxed);
      std::this_thread::sleep_for(std::chrono::milliseconds{50});
    }
  }
};

template <class Way>
void child(int id, const fs::path& log, long records, shared_page* page, dibs_bench::gate& g) {
  {
    Way w{log};
    if constexpr (std::is_same_v<Way, seed_lockfile>) w.page = page;
    char rec[record_size];
    g.wait();
    for (long n = 0; n < records; ++n) {
      make_record(rec, id, n);
      w.append(rec, id);
    }
    g.end();
  }
}

using child_fn = void (*)(int, const fs::path&, long, shared_page*, dibs_bench::gate&);

const std::vector<std::pair<std::string, child_fn>>& all_ways() {
  static const std::vector<std::pair<std::string, child_fn>> v = {
      {"shared_log", &child<dibs_append>},
      {"raw_append", &child<raw_append>},
      {"flock_append", &child<flock_append>},
      {"seed_lockfile", &child<seed_lockfile>},
      {"fstat_append", &child<fstat_append>},
      {"lseek_append", &child<lseek_append>},
  };
  return v;
}

// Aborts unless `log` holds exactly procs*records whole records, each once.
void verify(const fs::path& log, const std::string& name, int procs, long records) {
  const auto expected = static_cast<std::size_t>(procs) * static_cast<std::size_t>(records);
  std::vector<char> data;
  {
    FILE* f = std::fopen(log.c_str(), "rb");
    if (!f) die("cannot open " + log.string() + " to verify it");
    struct ::stat st {};
    ::fstat(::fileno(f), &st);
    data.resize(static_cast<std::size_t>(st.st_size));
    if (!data.empty() && std::fread(data.data(), 1, data.size(), f) != data.size()) die("short read of log");
    std::fclose(f);
  }
  if (data.size() != expected * record_size)
    die(fmt::format("{}: log has {} bytes, expected {} ({} records of {})", name, data.size(), expected * record_size,
                    expected, record_size));
  std::vector<bool> seen(expected, false);
  char want[record_size];
  for (std::size_t i = 0; i < expected; ++i) {
    const char* r = data.data() + i * record_size;
    // sscanf on a NUL-terminated copy of the head: on the buffer itself it would strlen() all the rest.
    char head[16] = {};
    std::memcpy(head, r, 13);
    int p = -1;
    long s = -1;
    if (std::sscanf(head, "p%2d r%7ld ", &p, &s) != 2 || p < 0 || p >= procs || s < 0 || s >= records)
      die(fmt::format("{}: record {} is torn or foreign: '{}'", name, i, std::string(r, 20)));
    make_record(want, p, s);
    if (std::memcmp(r, want, record_size) != 0) die(fmt::format("{}: record {} is torn", name, i));
    const std::size_t k = static_cast<std::size_t>(p) * static_cast<std::size_t>(records) + static_cast<std::size_t>(s);
    if (seen[k]) die(fmt::format("{}: record p{} r{} is in the log twice", name, p, s));
    seen[k] = true;
  }
}

struct result {
  double records_per_s = 0;
  double seconds = 0;
  long failed_tries = 0;
};

result run_once(const std::string& name, child_fn fn, int procs, long records, const fs::path& base) {
  const fs::path dir = base / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path log = dir / "test.log";
  auto* page = dibs_bench::shared_new<shared_page>();
  result r;
  try {
    r.seconds = dibs_bench::run_procs(procs, [&](int i, dibs_bench::gate& g) { fn(i, log, records, page, g); });
  } catch (const std::exception& e) {
    die(name + ": " + e.what());
  }
  for (int i = 0; i < procs; ++i) r.failed_tries += page->failed_tries[i].load();
  verify(log, name, procs, records);
  fs::remove_all(dir);
  r.records_per_s = static_cast<double>(procs) * static_cast<double>(records) / r.seconds;
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
  int procs = 8;
  long records = 100'000, seed_records = 200;
  int repeat = 3;
  std::vector<std::string> ways;
  for (const auto& w : all_ways())
    if (w.first != "fstat_append" && w.first != "lseek_append") ways.push_back(w.first);
  const char* env_dir = std::getenv("DIBS_BENCH_DIR");
  std::string base = env_dir && *env_dir ? env_dir : "/var/tmp";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--procs") procs = std::stoi(value());
    else if (a == "--records") records = std::stol(value());
    else if (a == "--seed-records") seed_records = std::stol(value());
    else if (a == "--repeat") repeat = std::stoi(value());
    else if (a == "--ways") ways = split(value());
    else if (a == "--dir") base = value();
    else die("unknown argument " + a + " (see the comment at the top of shared_log_throughput.cpp)");
  }
  if (procs < 1 || procs > max_procs) die("process count out of range");
  std::map<std::string, child_fn> by_name(all_ways().begin(), all_ways().end());
  for (const auto& w : ways)
    if (!by_name.count(w)) die("unknown way " + w);

  std::string tmpl = base + "/dibs-log-bench-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) die("cannot make a directory under " + base);
  const fs::path dir = tmpl;
  fmt::print("# shared_log_throughput: {} processes, {} records each ({} for seed_lockfile), {} bytes, {} repeats, "
             "files in {}\n",
             procs, records, seed_records, record_size, repeat, dir.string());
  fmt::print("# run way procs records_per_proc seconds records_per_s failed_tries\n");
  std::fflush(stdout);
  std::map<std::string, std::vector<result>> results;
  for (int r = 0; r < repeat; ++r)
    for (const auto& w : ways) {
      const long n = w == "seed_lockfile" ? seed_records : records;
      const result x = run_once(w, by_name[w], procs, n, dir);
      results[w].push_back(x);
      fmt::print("run {} {} {} {} {:.3f} {:.0f} {}\n", r, w, procs, n, x.seconds, x.records_per_s, x.failed_tries);
      std::fflush(stdout);
    }
  fs::remove_all(dir);

  std::vector<double> raw;
  for (const auto& x : results["raw_append"]) raw.push_back(x.records_per_s);
  const double raw_med = dibs_bench::median(raw);
  fmt::print("\n# medians over {} repeats (record count and content verified after every run)\n", repeat);
  fmt::print("| way | procs x records | records/s | vs raw_append | failed O_EXCL tries |\n");
  fmt::print("|---|---:|---:|---:|---:|\n");
  for (const auto& w : ways) {
    std::vector<double> rs, ft;
    for (const auto& x : results[w]) {
      rs.push_back(x.records_per_s);
      ft.push_back(static_cast<double>(x.failed_tries));
    }
    const double m = dibs_bench::median(rs);
    fmt::print("| {} | {} x {} | {:.0f} | {} | {} |\n", w, procs, w == "seed_lockfile" ? seed_records : records, m,
               raw_med > 0 ? fmt::format("{:.3f}x", m / raw_med) : std::string("-"),
               w == "seed_lockfile" ? fmt::format("{:.0f}", dibs_bench::median(ft)) : std::string("-"));
  }
  return 0;
}
