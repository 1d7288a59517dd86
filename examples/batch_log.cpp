// batch_log: N batch jobs start at the same instant and each appends its
// lines to one shared log file, three ways:
//
//   naive      open, seek to the end, write, close: what many scripts do
//   lock file  the usual fix: create "<log>.lck" with O_EXCL, sleep 50 ms and
//              retry while it exists, give up after a timeout (50 ms) and print the
//              line to stderr instead; remove the lock file when done. One job
//              crashes while it holds the lock (--crash), as jobs do.
//   dibs       dibs::shared_log
//
// and then counts the lines that reached the file.
//
//   batch_log [--jobs N] [--lines K] [--timeout-ms T] [--no-crash]
#include <dibs/shared_log.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

struct options {
  int jobs = 8;
  int lines = 200;
  int timeout_ms = 50;
  bool crash = true;
};

std::string line_of(int job, int n) { return fmt::format("job {:02} line {:05} {}", job, n, std::string(40, 'x')); }

void naive_append(const fs::path& log, const std::string& line) {
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT, 0644);
  if (fd < 0) return;
  ::lseek(fd, 0, SEEK_END);  // another job may write between this and the write below
  const std::string l = line + "\n";
  (void)!::write(fd, l.data(), l.size());
  ::close(fd);
}

// Returns: false if the line was dropped (printed to stderr) after the timeout.
bool lockfile_append(const fs::path& log, const std::string& line, int timeout_ms, bool crash_holding) {
  const auto lock = log.string() + ".lck";
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds{timeout_ms};
  for (;;) {
    const int fd = ::open(lock.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd >= 0) {
      ::close(fd);
      if (crash_holding) ::kill(::getpid(), SIGKILL);  // the crash: the lock file stays behind
      const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      const std::string l = line + "\n";
      (void)!::write(out, l.data(), l.size());
      ::close(out);
      ::unlink(lock.c_str());
      return true;
    }
    if (std::chrono::steady_clock::now() >= end) {
      std::fprintf(stderr, "%s\n", line.c_str());  // "logged" to stderr: lost from the log
      return false;
    }
    std::this_thread::sleep_for(50ms);
  }
}

struct result {
  long written = 0;  // lines the jobs believe they wrote
  long dropped = 0;  // lines the jobs knew they could not write
  long found = 0;    // distinct, whole lines in the file
  long torn = 0;     // lines in the file that are not a whole line of a job
};

template <class Append>
result run(const fs::path& log, const options& o, Append append) {
  int go[2], report[2];
  if (::pipe(go) != 0 || ::pipe(report) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
  std::vector<pid_t> pids;
  for (int j = 0; j < o.jobs; ++j) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(go[1]);
      char c;
      if (::read(go[0], &c, 1) != 0) ::_exit(2);  // all jobs wait here, then start at once
      long ok = 0, dropped = 0;
      for (int n = 0; n < o.lines; ++n) (append(j, n) ? ok : dropped)++;
      const std::string r = fmt::format("{} {}\n", ok, dropped);
      (void)!::write(report[1], r.data(), r.size());
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  ::close(go[0]);
  ::close(report[1]);
  ::close(go[1]);  // the starting gun
  result res;
  char buf[64];
  FILE* in = ::fdopen(report[0], "r");
  long ok, dropped;
  while (in && std::fgets(buf, sizeof buf, in) && std::sscanf(buf, "%ld %ld", &ok, &dropped) == 2) {
    res.written += ok;
    res.dropped += dropped;
  }
  if (in) std::fclose(in);
  for (pid_t p : pids) ::waitpid(p, nullptr, 0);

  std::set<std::string> expected, seen;
  for (int j = 0; j < o.jobs; ++j)
    for (int n = 0; n < o.lines; ++n) expected.insert(line_of(j, n));
  std::ifstream file(log);
  for (std::string l; std::getline(file, l);) {
    if (expected.count(l)) seen.insert(l);
    else ++res.torn;
  }
  res.found = static_cast<long>(seen.size());
  return res;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto num = [&] { return i + 1 < argc ? std::atoi(argv[++i]) : 0; };
    if (a == "--jobs") o.jobs = num();
    else if (a == "--lines") o.lines = num();
    else if (a == "--timeout-ms") o.timeout_ms = num();
    else if (a == "--no-crash") o.crash = false;
    else {
      std::printf("usage: batch_log [--jobs N] [--lines K] [--timeout-ms T] [--no-crash]\n");
      std::exit(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  if (o.jobs < 1 || o.lines < 1 || o.timeout_ms < 0) {
    std::fprintf(stderr, "batch_log: --jobs and --lines must be at least 1, --timeout-ms not negative\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  std::string tmpl = (fs::temp_directory_path() / "dibs-batch-XXXXXX").string();
  if (!::mkdtemp(tmpl.data())) return 1;
  const fs::path dir = tmpl;
  const long total = static_cast<long>(o.jobs) * o.lines;

  fmt::print("batch_log: {} jobs start at the same instant, {} lines each, into one log\n\n", o.jobs, o.lines);
  fmt::print("  {:<10} {:>8} {:>8} {:>8} {:>8} {:>8}\n", "method", "lines", "found", "lost", "torn", "dropped");
  auto row = [&](const char* name, const result& r) {
    fmt::print("  {:<10} {:>8} {:>8} {:>8} {:>8} {:>8}\n", name, total, r.found, total - r.found, r.torn, r.dropped);
  };

  // stderr of the lock-file jobs is where their dropped lines go: keep it off the terminal.
  const int saved = ::dup(2);
  const int devnull = ::open("/dev/null", O_WRONLY);
  ::dup2(devnull, 2);
  const result naive = run(dir / "naive.log", o, [&](int j, int n) {
    naive_append(dir / "naive.log", line_of(j, n));
    return true;
  });
  const result lockfile = run(dir / "lockfile.log", o, [&](int j, int n) {
    // With --crash, job 0 dies holding the lock near the end of its run; every
    // line any job writes after that waits out the timeout and is dropped.
    return lockfile_append(dir / "lockfile.log", line_of(j, n), o.timeout_ms, o.crash && j == 0 && n == o.lines * 9 / 10);
  });
  ::dup2(saved, 2);
  int rc = 0;
  result with_dibs;
  try {
    dibs::shared_log log{dir / "dibs.log"};
    with_dibs = run(dir / "dibs.log", o, [&](int j, int n) {
      log.append(line_of(j, n));
      return true;
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "batch_log: %s\n", e.what());
    rc = 1;
  }
  row("naive", naive);
  row("lock file", lockfile);
  row("dibs", with_dibs);
  fmt::print("\n  (lost: lines missing from the file; dropped: lines the job printed to stderr instead)\n");
  if (with_dibs.found == total && with_dibs.torn == 0) {
    fmt::print("  dibs::shared_log: all {} lines present, none torn\n", total);
  } else {
    fmt::print("  dibs::shared_log: BROKEN\n");
    rc = 1;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return rc;
}
