// retry_transaction: several worker processes place orders in one shared
// SQLite file at the same time. SQLite's busy timeout is 0, so every time two
// writers collide one of them gets "database is locked" at once; dibs::transact
// rolls back, waits a jittered, growing delay and retries the whole
// transaction. At the end the program checks that no order was lost and
// prints how many transactions needed how many attempts.
//
//   retry_transaction [--workers N] [--orders K] [--db PATH]
#include <dibs/retry.hpp>
#include <dibs/sqlite/connection.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

struct args {
  int workers = 6;
  int orders = 200;  // per worker
  fs::path db;
};

[[noreturn]] void usage(int code) {
  std::fputs(
      "usage: retry_transaction [--workers N] [--orders K] [--db PATH]\n"
      "  N worker processes each place K orders in one SQLite database at once\n"
      "  (default 6 x 200, in a temporary directory), with SQLite's busy timeout at 0,\n"
      "  retrying each transaction that lost the lock with dibs::transact.\n",
      code ? stderr : stdout);
  std::exit(code);
}

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(2);
      return argv[++i];
    };
    auto number = [&](int lo, int hi) {
      const std::string v = value();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < lo || n > hi) {
        std::fprintf(stderr, "retry_transaction: %s must be a number from %d to %d (got '%s')\n", opt.c_str(), lo,
                     hi, v.c_str());
        std::exit(2);
      }
      return static_cast<int>(n);
    };
    if (opt == "--workers") a.workers = number(1, 256);
    else if (opt == "--orders") a.orders = number(1, 1'000'000);
    else if (opt == "--db") a.db = value();
    else if (opt == "--help" || opt == "-h") usage(0);
    else {
      std::fprintf(stderr, "retry_transaction: unknown option '%s'\n", opt.c_str());
      usage(2);
    }
  }
  return a;
}

// One worker: K orders, each one transaction that reads the stock, takes one
// item and records the order. Writes "attempts count" lines to `out`.
int worker(const fs::path& path, int id, int orders, int out) {
  try {
    dibs::sqlite::connection db{path, {.busy_timeout = 0ms}};
    std::uint64_t attempts = 1;
    const auto policy = dibs::retry_policy{}
                            .unlimited_attempts()
                            .deadline(5min)
                            .backoff({200us, 2.0, 50ms, dibs::jitter::full})
                            .on_retry([&](const dibs::retry_event& e) { attempts = e.attempt + 1; });
    std::map<std::uint64_t, int> histogram;
    for (int k = 0; k < orders; ++k) {
      attempts = 1;
      dibs::transact(policy, db, [&] {
        const auto stock = db.query_int64("SELECT stock FROM products WHERE id = 1").value();
        db.prepare("UPDATE products SET stock = ?1 WHERE id = 1").bind(1, stock - 1).step();
        db.prepare("INSERT INTO orders(worker, seq) VALUES (?1, ?2)").bind(1, id).bind(2, k).step();
      });
      ++histogram[attempts];
    }
    std::string report;
    for (auto [a, n] : histogram) report += fmt::format("{} {}\n", a, n);
    if (::write(out, report.data(), report.size()) != static_cast<ssize_t>(report.size())) return 3;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker %d: %s\n", id, e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  args a = parse(argc, argv);
  fs::path tmp;
  if (a.db.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "dibs-retry-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) {
      std::perror("retry_transaction: mkdtemp");
      return 1;
    }
    tmp = tmpl;
    a.db = tmp / "orders.db";
  }
  const long total = static_cast<long>(a.workers) * a.orders;
  int rc = 0;
  try {
    {
      dibs::sqlite::connection db{a.db};
      db.exec(
          "DROP TABLE IF EXISTS orders; DROP TABLE IF EXISTS products;"
          "CREATE TABLE products(id INTEGER PRIMARY KEY, stock INTEGER NOT NULL);"
          "CREATE TABLE orders(id INTEGER PRIMARY KEY, worker INTEGER NOT NULL, seq INTEGER NOT NULL,"
          "                    UNIQUE(worker, seq));");
      db.prepare("INSERT INTO products VALUES (1, ?1)").bind(1, total).step();
    }
    fmt::print("retry_transaction: {} worker processes x {} orders into {}\n", a.workers, a.orders, a.db.string());
    fmt::print("  SQLite busy timeout 0, BEGIN IMMEDIATE, dibs::transact with full-jitter backoff\n\n");
    std::fflush(stdout);

    int pipefd[2];
    if (::pipe(pipefd) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
    const auto start = std::chrono::steady_clock::now();
    std::vector<pid_t> children;
    for (int i = 0; i < a.workers; ++i) {
      const pid_t pid = ::fork();
      if (pid < 0) throw std::system_error(errno, std::generic_category(), "fork");
      if (pid == 0) {
        ::close(pipefd[0]);
        ::_exit(worker(a.db, i, a.orders, pipefd[1]));
      }
      children.push_back(pid);
    }
    ::close(pipefd[1]);
    std::string report;
    char buf[4096];
    for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;) report.append(buf, static_cast<std::size_t>(n));
    ::close(pipefd[0]);
    int failed = 0;
    for (pid_t pid : children) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    std::map<std::uint64_t, long> histogram;
    long reported = 0, attempts = 0;
    for (std::size_t pos = 0; pos < report.size();) {
      const std::size_t nl = report.find('\n', pos);
      unsigned long long at = 0;
      long n = 0;
      if (std::sscanf(report.c_str() + pos, "%llu %ld", &at, &n) == 2) {
        histogram[at] += n;
        reported += n;
        attempts += static_cast<long>(at) * n;
      }
      pos = nl == std::string::npos ? report.size() : nl + 1;
    }
    fmt::print("  {:>8}  {:>12}\n", "attempts", "transactions");
    for (auto [at, n] : histogram) fmt::print("  {:>8}  {:>12}\n", at, n);
    fmt::print("\n  {} transactions committed in {} attempts, {:.2f} s ({:.0f} per second)\n", reported, attempts,
               secs, static_cast<double>(reported) / secs);

    dibs::sqlite::connection db{a.db};
    const auto orders = db.query_int64("SELECT count(*) FROM orders").value();
    const auto stock = db.query_int64("SELECT stock FROM products WHERE id = 1").value();
    fmt::print("  orders in the table: {} of {}; stock left: {} (expected 0); failed workers: {}\n", orders, total,
               stock, failed);
    if (orders == total && stock == 0 && failed == 0 && reported == total) {
      fmt::print("  OK: every order committed exactly once, no lost update\n");
    } else {
      fmt::print("  BROKEN: orders were lost or doubled\n");
      rc = 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "retry_transaction: %s\n", e.what());
    rc = 1;
  }
  if (!tmp.empty()) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
  }
  return rc;
}
