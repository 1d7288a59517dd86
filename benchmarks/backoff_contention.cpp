// backoff_contention: the AWS "Exponential Backoff And Jitter" experiment,
// run on real SQLite instead of a simulated OCC store.
//
// For every N in the list, N processes are forked, each opens its own
// dibs::sqlite::connection to ONE shared database (busy timeout 0, WAL) and
// then waits at a barrier. The parent releases them all at once, and each
// commits K transactions through dibs::transact (BEGIN IMMEDIATE; read the
// counter row, write it + 1; COMMIT). A transaction that loses the lock gets
// SQLITE_BUSY at once and is retried whole, after the delay the schedule under
// test asks for. With --hold-us H, each transaction also does H microseconds
// of simulated work between the read and the write, while it holds the write
// lock (BEGIN IMMEDIATE takes it): a busy-wait on steady_clock by default, so
// the work needs a CPU as real computation would, or a sleep with
// --hold-mode sleep, which models waiting on something else (I/O, a remote
// call) while holding the lock. Per run the harness counts
//
//   attempts  every call of the transaction unit (K per process, plus one per
//             on_retry call), summed over all processes;
//   makespan  from the release to the last commit of any process;
//
// and at the end checks that the counter equals N * K exactly (it aborts
// loudly if it does not: that would be a lost or doubled update). Each
// configuration runs --reps times, interleaved with the others so that a noisy
// moment on the machine does not land on one schedule only, and the table
// shows medians.
//
//   backoff_contention [--n 10,25,50] [--k 20] [--reps 9] [--schedules LIST]
//                      [--hold-us H] [--hold-mode spin|sleep]
//                      [--deadline SECONDS] [--csv PATH] [--json PATH] [--dir PATH]
//
// Schedules (unlimited attempts, a deadline of --deadline per transaction):
//   none         retry at once (a custom schedule that returns 0)
//   linear       50 ms more per retry (50, 100, ...), at most 500 ms
//   exp100       100 ms doubling, cap 10 s, no jitter
//   exp[@B]      exponential, no jitter          } base B (default: dibs's
//   full[@B]     exponential, full jitter        } default, 10 ms), multiplier
//   equal[@B]    exponential, equal jitter       } and cap as dibs's default
//   decorr[@B]   decorrelated jitter             } (x2, 1 s). B: 1ms, 500us, ...
#include <dibs/backoff.hpp>
#include <dibs/retry.hpp>
#include <dibs/sqlite/connection.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "procs.hpp"

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using nanos = std::chrono::nanoseconds;

namespace {

// ---------------------------------------------------------------------------
// Schedules

enum class family { none, linear, backoff };

struct schedule_spec {
  std::string name;                   // as it appears in the table, e.g. "full@1ms"
  family kind = family::backoff;
  dibs::exponential_backoff backoff;  // for family::backoff
};

std::string pretty(nanos d) {
  if (d == nanos::zero()) return "0";
  if (d % 1s == nanos::zero()) return fmt::format("{} s", d / 1s);
  if (d % 1ms == nanos::zero()) return fmt::format("{} ms", d / 1ms);
  if (d % 1us == nanos::zero()) return fmt::format("{} us", d / 1us);
  return fmt::format("{} ns", d.count());
}

std::string compact(nanos d) {  // "10ms", "500us": the spelling used in names
  std::string s = pretty(d);
  s.erase(std::remove(s.begin(), s.end(), ' '), s.end());
  return s;
}

std::string describe(const schedule_spec& s) {
  switch (s.kind) {
    case family::none: return "retry at once, no delay";
    case family::linear: return "50 ms more per retry, max 500 ms";
    case family::backoff: {
      const auto& b = s.backoff;
      const std::string shape = fmt::format("{} x{:g}, cap {}", pretty(b.initial()), b.multiplier(), pretty(b.cap()));
      switch (b.jitter()) {
        case dibs::jitter::none: return shape + ", no jitter";
        case dibs::jitter::full: return shape + ", full jitter";
        case dibs::jitter::equal: return shape + ", equal jitter";
        case dibs::jitter::decorrelated: return shape + ", decorrelated";
      }
    }
  }
  return "?";
}

std::optional<nanos> parse_duration(std::string_view text) {
  std::size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0 || digits > 9) return std::nullopt;
  const std::int64_t value = std::stoll(std::string(text.substr(0, digits)));
  const std::string_view unit = text.substr(digits);
  if (unit == "us") return nanos{std::chrono::microseconds{value}};
  if (unit == "ms") return nanos{std::chrono::milliseconds{value}};
  if (unit == "s") return nanos{std::chrono::seconds{value}};
  return std::nullopt;
}

// Throws std::invalid_argument for a name it does not know.
schedule_spec parse_schedule(const std::string& text) {
  const dibs::exponential_backoff defaults{};  // dibs's default shape: base, multiplier, cap
  if (text == "none") return {"none", family::none, defaults};
  if (text == "linear") return {"linear", family::linear, defaults};
  if (text == "exp100") return {"exp100", family::backoff, dibs::exponential_backoff{100ms, 2.0, 10s, dibs::jitter::none}};

  const std::size_t at = text.find('@');
  const std::string head = text.substr(0, at);
  nanos base = defaults.initial();
  if (at != std::string::npos) {
    const auto d = parse_duration(std::string_view(text).substr(at + 1));
    if (!d || *d <= nanos::zero())
      throw std::invalid_argument(fmt::format("bad base in schedule '{}' (write e.g. full@1ms or full@500us)", text));
    base = *d;
  }
  dibs::jitter j;
  if (head == "exp") j = dibs::jitter::none;
  else if (head == "full") j = dibs::jitter::full;
  else if (head == "equal") j = dibs::jitter::equal;
  else if (head == "decorr") j = dibs::jitter::decorrelated;
  else throw std::invalid_argument(fmt::format("unknown schedule '{}' (see --help)", text));
  // The constructor checks base <= cap and throws invalid_argument otherwise.
  return {fmt::format("{}@{}", head, compact(base)), family::backoff,
          dibs::exponential_backoff{base, defaults.multiplier(), defaults.cap(), j}};
}

dibs::retry_policy make_policy(const schedule_spec& s, std::chrono::seconds deadline) {
  dibs::retry_policy p;
  p.unlimited_attempts().deadline(deadline);
  switch (s.kind) {
    case family::none:
      p.schedule([](std::uint64_t, nanos, double) { return nanos::zero(); });
      break;
    case family::linear:
      p.schedule([](std::uint64_t n, nanos, double) {
        const auto steps = static_cast<int>(std::min<std::uint64_t>(n, 9) + 1);  // 1 .. 10
        return nanos{std::chrono::milliseconds{50} * steps};
      });
      break;
    case family::backoff: p.backoff(s.backoff); break;
  }
  return p;
}

// ---------------------------------------------------------------------------
// Command line

enum class hold_mode { spin, sleep };

const char* to_string(hold_mode m) { return m == hold_mode::spin ? "spin" : "sleep"; }

struct config {
  std::vector<int> ns{10, 25, 50};
  int k = 20;
  int reps = 9;
  std::vector<schedule_spec> schedules;
  std::chrono::microseconds hold{0};  // simulated work per transaction, lock held
  hold_mode mode = hold_mode::spin;
  std::chrono::seconds deadline{600};
  fs::path csv, json, dir;
};

const char* const default_schedules =
    "none,linear,exp100,exp,full,equal,decorr,exp@1ms,full@1ms,equal@1ms,decorr@1ms";

[[noreturn]] void usage(int code) {
  std::fprintf(code ? stderr : stdout,
               "usage: backoff_contention [--n LIST] [--k K] [--reps R] [--schedules LIST]\n"
               "                          [--hold-us H] [--hold-mode spin|sleep]\n"
               "                          [--deadline SECONDS] [--csv PATH] [--json PATH] [--dir PATH]\n"
               "\n"
               "  For each N in LIST (default 10,25,50) and each schedule, N processes commit K\n"
               "  transactions each (default 20) on one shared SQLite database, all released at\n"
               "  once; R runs per configuration (default 9, interleaved), medians reported.\n"
               "\n"
               "  --schedules   comma-separated, default:\n"
               "                %s\n"
               "                none      retry at once (delay 0)\n"
               "                linear    50 ms more per retry, at most 500 ms\n"
               "                exp100    100 ms doubling, cap 10 s, no jitter\n"
               "                exp[@B]   exponential, no jitter    } base B (default dibs's 10 ms),\n"
               "                full[@B]  full jitter               } x2, cap 1 s, as\n"
               "                equal[@B] equal jitter              } dibs::exponential_backoff{}\n"
               "                decorr[@B] decorrelated jitter      } B like 1ms or 500us\n"
               "  --hold-us H   in every transaction, between the read and the write, hold the\n"
               "                write lock for H microseconds of simulated work (default 0)\n"
               "  --hold-mode   spin (default): busy-wait on steady_clock, the work needs a CPU;\n"
               "                sleep: sleep_for(H), the work waits on something else\n"
               "  --deadline    retry deadline of each transaction, seconds (default 600)\n"
               "  --csv PATH    write one row per run\n"
               "  --json PATH   write the machine, the configuration, every run and the medians\n"
               "  --dir PATH    where to make the temporary directory (default: the system's)\n",
               default_schedules);
  std::exit(code);
}

[[noreturn]] void bad_option(const std::string& what) {
  std::fprintf(stderr, "backoff_contention: %s\n", what.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const std::size_t comma = std::min(s.find(',', pos), s.size());
    if (comma > pos) out.push_back(s.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return out;
}

int to_int(const std::string& opt, const std::string& v, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || n < lo || n > hi)
    bad_option(fmt::format("{} needs a whole number from {} to {} (got '{}')", opt, lo, hi, v));
  return static_cast<int>(n);
}

config parse(int argc, char** argv) {
  config c;
  std::string schedules = default_schedules;
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) bad_option(fmt::format("{} needs a value", opt));
      return argv[++i];
    };
    if (opt == "--n") {
      c.ns.clear();
      for (const auto& v : split(value())) c.ns.push_back(to_int(opt, v, 1, 1000));
      if (c.ns.empty()) bad_option("--n needs at least one number");
    } else if (opt == "--k") c.k = to_int(opt, value(), 1, 1'000'000);
    else if (opt == "--reps") c.reps = to_int(opt, value(), 1, 1000);
    else if (opt == "--schedules") schedules = value();
    else if (opt == "--hold-us") c.hold = std::chrono::microseconds{to_int(opt, value(), 0, 10'000'000)};
    else if (opt == "--hold-mode") {
      const std::string m = value();
      if (m == "spin") c.mode = hold_mode::spin;
      else if (m == "sleep") c.mode = hold_mode::sleep;
      else bad_option(fmt::format("--hold-mode is spin or sleep (got '{}')", m));
    }
    else if (opt == "--deadline") c.deadline = std::chrono::seconds{to_int(opt, value(), 1, 86'400)};
    else if (opt == "--csv") c.csv = value();
    else if (opt == "--json") c.json = value();
    else if (opt == "--dir") c.dir = value();
    else if (opt == "--help" || opt == "-h") usage(0);
    else bad_option(fmt::format("unknown option '{}' (try --help)", opt));
  }
  try {
    for (const auto& name : split(schedules)) c.schedules.push_back(parse_schedule(name));
  } catch (const std::invalid_argument& e) {
    bad_option(e.what());
  }
  if (c.schedules.empty()) bad_option("--schedules needs at least one schedule");
  return c;
}

// ---------------------------------------------------------------------------
// One run

// What a child tells the parent, in memory they share.
struct child_report {
  std::int32_t id = -1;
  std::int32_t ok = 0;              // 1 if all K transactions committed
  std::uint64_t commits = 0;
  std::uint64_t attempts = 0;       // calls of the transaction unit
  std::uint64_t worst = 0;          // most attempts one transaction needed
  std::int64_t slept_ns = 0;        // sum of the delays the schedule asked for
};

// The simulated work of one transaction, done while it holds the write lock.
void hold_lock(const config& cfg) {
  if (cfg.hold <= std::chrono::microseconds::zero()) return;
  if (cfg.mode == hold_mode::sleep) {
    std::this_thread::sleep_for(cfg.hold);
    return;
  }
  // Wall time, not CPU time: a holder that the scheduler takes off the CPU
  // keeps the lock for longer, as a real one would.
  const auto until = std::chrono::steady_clock::now() + cfg.hold;
  while (std::chrono::steady_clock::now() < until) {
  }
}

// The body of one child process: its report in `r`. Throws if a
// transaction could not commit (the harness then fails the run).
void child_main(const config& cfg, const schedule_spec& spec, const fs::path& db_path, int id, dibs_bench::gate& g,
                child_report& r) {
  r.id = id;
  try {
    // Opened after fork(), as SQLite requires, and before the barrier, so
    // that opening is not part of the race.
    dibs::sqlite::connection db{db_path, {.busy_timeout = 0ms, .journal_mode = "WAL"}};
    auto read_counter = db.prepare("SELECT value FROM counter WHERE id = 1");
    auto write_counter = db.prepare("UPDATE counter SET value = ?1 WHERE id = 1");

    // Every child gets its own seeded engine. (The library's default source
    // reseeds itself in a forked child too; seeding here keeps the harness
    // independent of that.)
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), static_cast<unsigned>(::getpid()), static_cast<unsigned>(id)};
    std::mt19937_64 engine{seq};

    std::uint64_t this_tx = 1;
    const auto policy = make_policy(spec, cfg.deadline)
                            .random([&] { return engine(); })
                            .on_retry([&](const dibs::retry_event& e) {
                              ++r.attempts;  // the attempt that just failed
                              r.slept_ns += e.delay.count();
                              this_tx = e.attempt + 1;
                            });

    g.wait();

    for (int k = 0; k < cfg.k; ++k) {
      this_tx = 1;
      dibs::transact(policy, db, [&] {
        if (!read_counter.step()) throw std::runtime_error("the counter row is missing");
        const std::int64_t value = read_counter.column_int64(0);
        read_counter.reset();
        hold_lock(cfg);  // the work between the read and the write, lock held
        write_counter.bind(1, value + 1);
        write_counter.step();
      });
      ++r.commits;
      ++r.attempts;  // the attempt that succeeded
      r.worst = std::max(r.worst, this_tx);
    }
    g.end();  // the run's makespan ends at the last commit of any process
    r.ok = 1;
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("process {} ({}): {}", id, spec.name, e.what()));
  }
}

struct run_result {
  std::size_t schedule = 0;
  int n = 0;
  int rep = 0;
  std::uint64_t attempts = 0;
  std::uint64_t worst = 0;  // most attempts any single transaction needed
  double makespan_s = 0;
  double slept_s = 0;       // total asked-for sleep, all processes
};

[[noreturn]] void fatal(const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "\nbackoff_contention: FATAL: %s\n", what.c_str());
  std::abort();
}

run_result run_once(const config& cfg, std::size_t si, int n, int rep, const fs::path& dir, int serial) {
  const schedule_spec& spec = cfg.schedules[si];
  const fs::path db_path = dir / fmt::format("run-{}.db", serial);
  {
    dibs::sqlite::connection db{db_path, {.busy_timeout = 0ms, .journal_mode = "WAL"}};
    db.exec("CREATE TABLE counter(id INTEGER PRIMARY KEY, value INTEGER NOT NULL);"
            "INSERT INTO counter VALUES (1, 0);");
  }  // closed before fork(): no connection may cross it

  // The processes' reports, in memory they share with this one.
  auto* reports = static_cast<child_report*>(::mmap(nullptr, sizeof(child_report) * static_cast<std::size_t>(n),
                                                    PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (reports == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap of the reports");
  for (int id = 0; id < n; ++id) new (&reports[id]) child_report{};
  std::string failure;
  double makespan = 0;
  try {
    makespan = dibs_bench::run_procs(n, [&](int id, dibs_bench::gate& g) {
      child_main(cfg, spec, db_path, id, g, reports[id]);
    });
  } catch (const std::exception& e) {
    failure = e.what();
  }

  run_result res;
  res.schedule = si;
  res.n = n;
  res.rep = rep;
  std::uint64_t commits = 0;
  int failed = 0;
  for (int id = 0; id < n; ++id) {
    const child_report& r = reports[id];
    if (!r.ok) ++failed;
    commits += r.commits;
    res.attempts += r.attempts;
    res.worst = std::max(res.worst, r.worst);
    res.slept_s += static_cast<double>(r.slept_ns) * 1e-9;
  }
  ::munmap(reports, sizeof(child_report) * static_cast<std::size_t>(n));
  res.makespan_s = makespan;

  const std::int64_t expected = static_cast<std::int64_t>(n) * cfg.k;
  std::int64_t counter = -1;
  {
    dibs::sqlite::connection db{db_path};
    counter = db.query_int64("SELECT value FROM counter WHERE id = 1").value_or(-1);
  }
  if (counter != expected || static_cast<std::int64_t>(commits) != expected || failed != 0 || !failure.empty())
    fatal(fmt::format("{} with N={} (run {}): counter = {}, expected N*K = {}; commits reported {}; "
                      "{} of {} processes failed{}{}. Database kept at {}",
                      spec.name, n, rep + 1, counter, expected, commits, failed, n, failure.empty() ? "" : ": ",
                      failure, db_path.string()));

  std::error_code ec;
  for (const char* suffix : {"", "-wal", "-shm", "-journal"}) fs::remove(db_path.string() + suffix, ec);
  return res;
}

// ---------------------------------------------------------------------------
// Summary and output

#if defined(__clang__)
const char* const compiler = "clang++ " __clang_version__;
#elif defined(__GNUC__)
const char* const compiler = "g++ " __VERSION__;
#else
const char* const compiler = "unknown compiler";
#endif

using dibs_bench::median;

struct summary {
  double attempts = 0;  // median
  double makespan = 0;  // median, seconds
  double makespan_min = 0, makespan_max = 0;
  double attempts_min = 0, attempts_max = 0;
  double worst = 0;     // median of the per-run worst transaction
};

using summary_map = std::map<std::pair<int, std::size_t>, summary>;  // (n, schedule) -> summary

summary_map summarise(const config& cfg, const std::vector<run_result>& runs) {
  summary_map out;
  for (int n : cfg.ns) {
    for (std::size_t si = 0; si < cfg.schedules.size(); ++si) {
      std::vector<double> at, ms, worst;
      for (const auto& r : runs)
        if (r.n == n && r.schedule == si) {
          at.push_back(static_cast<double>(r.attempts));
          ms.push_back(r.makespan_s);
          worst.push_back(static_cast<double>(r.worst));
        }
      if (at.empty()) continue;
      summary s;
      s.attempts = median(at);
      s.makespan = median(ms);
      s.worst = median(worst);
      s.attempts_min = *std::min_element(at.begin(), at.end());
      s.attempts_max = *std::max_element(at.begin(), at.end());
      s.makespan_min = *std::min_element(ms.begin(), ms.end());
      s.makespan_max = *std::max_element(ms.begin(), ms.end());
      out[{n, si}] = s;
    }
  }
  return out;
}

std::optional<std::size_t> find_schedule(const config& cfg, const std::string& name) {
  for (std::size_t i = 0; i < cfg.schedules.size(); ++i)
    if (cfg.schedules[i].name == name) return i;
  return std::nullopt;
}

void print_table(const config& cfg, const summary_map& sums) {
  const std::string base = compact(dibs::exponential_backoff{}.initial());
  for (int n : cfg.ns) {
    double best_time = 1e300, fewest = 1e300;
    std::size_t best_i = 0;
    for (std::size_t si = 0; si < cfg.schedules.size(); ++si) {
      const auto& s = sums.at({n, si});
      if (s.makespan < best_time) best_time = s.makespan, best_i = si;
      fewest = std::min(fewest, s.attempts);
    }
    const long total = static_cast<long>(n) * cfg.k;
    fmt::print("\nN = {} processes x K = {} transactions = {} commits, hold {} us ({}); median of {} runs\n", n,
               cfg.k, total, cfg.hold.count(), to_string(cfg.mode), cfg.reps);
    fmt::print("  {:<12} {:<38} {:>9} {:>8} {:>7} {:>6} {:>9} {:>7} {:>17} {:>8}\n", "schedule", "", "attempts",
               "retries", "per tx", "worst", "makespan", "x best", "makespan min-max", "x fewest");
    for (std::size_t si = 0; si < cfg.schedules.size(); ++si) {
      const auto& s = sums.at({n, si});
      const std::string range = fmt::format("{:.3f}-{:.3f}s", s.makespan_min, s.makespan_max);
      fmt::print("  {:<12} {:<38} {:>9.0f} {:>8.0f} {:>7.3f} {:>6.0f} {:>8.3f}s {:>6.2f}x {:>17} {:>7.2f}x\n",
                 cfg.schedules[si].name, describe(cfg.schedules[si]), s.attempts,
                 s.attempts - static_cast<double>(total), s.attempts / static_cast<double>(total), s.worst,
                 s.makespan, s.makespan / best_time, range, s.attempts / fewest);
    }
    fmt::print("  fastest: {}\n", cfg.schedules[best_i].name);

    // Full jitter against exponential without jitter of the same shape, and
    // each jitter with a 1 ms base against the same with dibs's default base.
    std::vector<std::string> bases{base};
    if (base != "1ms") bases.push_back("1ms");
    for (const std::string& b : bases) {
      const auto e = find_schedule(cfg, "exp@" + b), f = find_schedule(cfg, "full@" + b);
      if (!e || !f) continue;
      const auto &se = sums.at({n, *e}), &sf = sums.at({n, *f});
      const double t = static_cast<double>(total);
      fmt::print(
          "  full@{} vs exp@{}: attempts {:.2f}x (retries {:.2f}x), makespan {:.2f}x; full@{} makespan vs fastest: "
          "{:.2f}x\n",
          b, b, sf.attempts / se.attempts, (sf.attempts - t) / (se.attempts - t), sf.makespan / se.makespan, b,
          sf.makespan / best_time);
      if (n == 50 && b == base)
        fmt::print("  goal B (N = 50, dibs's default shape): full jitter makes {:.2f}x the attempts of exponential "
                   "without jitter (goal <= 0.50: {}), makespan {:.2f}x the fastest (goal <= 1.20: {})\n",
                   sf.attempts / se.attempts, sf.attempts <= 0.5 * se.attempts ? "met" : "NOT met",
                   sf.makespan / best_time, sf.makespan <= 1.2 * best_time ? "met" : "NOT met");
    }
    if (base != "1ms")
      for (const char* j : {"exp", "full", "equal", "decorr"}) {
        const auto hi = find_schedule(cfg, fmt::format("{}@{}", j, base));
        const auto lo = find_schedule(cfg, fmt::format("{}@1ms", j));
        if (!hi || !lo) continue;
        const auto &sh = sums.at({n, *hi}), &sl = sums.at({n, *lo});
        const double t = static_cast<double>(total);
        fmt::print("  {}@1ms vs {}@{}: attempts {:.2f}x (retries {:.2f}x), makespan {:.2f}x\n", j, j, base,
                   sl.attempts / sh.attempts, (sl.attempts - t) / (sh.attempts - t), sl.makespan / sh.makespan);
      }
  }
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", static_cast<int>(c));
    else out += c;
  }
  return out + "\"";
}

void write_csv(const config& cfg, const std::vector<run_result>& runs) {
  std::ofstream f{cfg.csv};
  f << "n,k,hold_us,hold_mode,schedule,description,rep,attempts,retries,attempts_per_tx,worst_tx_attempts,makespan_s,"
       "slept_s\n";
  for (const auto& r : runs) {
    const auto& s = cfg.schedules[r.schedule];
    const auto commits = static_cast<std::uint64_t>(r.n) * static_cast<std::uint64_t>(cfg.k);
    f << fmt::format("{},{},{},{},{},\"{}\",{},{},{},{:.4f},{},{:.6f},{:.6f}\n", r.n, cfg.k, cfg.hold.count(),
                     to_string(cfg.mode), s.name, describe(s), r.rep + 1, r.attempts, r.attempts - commits,
                     static_cast<double>(r.attempts) / static_cast<double>(commits), r.worst, r.makespan_s, r.slept_s);
  }
  if (!f) fatal(fmt::format("cannot write {}", cfg.csv.string()));
}

void write_json(const config& cfg, const std::vector<run_result>& runs, const summary_map& sums) {
  std::ofstream f{cfg.json};
  f << "{\n";
  f << fmt::format("  \"machine\": {{\"nproc\": {}, \"compiler\": {}, \"sqlite\": {}}},\n",
                   ::sysconf(_SC_NPROCESSORS_ONLN), json_string(compiler), json_string(::sqlite3_libversion()));
  std::string ns;
  for (int n : cfg.ns) ns += (ns.empty() ? "" : ", ") + std::to_string(n);
  f << fmt::format("  \"config\": {{\"n\": [{}], \"k\": {}, \"reps\": {}, \"hold_us\": {}, \"hold_mode\": {}, "
                   "\"deadline_s\": {}}},\n",
                   ns, cfg.k, cfg.reps, cfg.hold.count(), json_string(to_string(cfg.mode)), cfg.deadline.count());
  f << "  \"medians\": [\n";
  bool first = true;
  for (const auto& [key, s] : sums) {
    const auto& spec = cfg.schedules[key.second];
    f << fmt::format(
        "{}    {{\"n\": {}, \"k\": {}, \"schedule\": {}, \"description\": {}, \"attempts\": {}, \"attempts_min\": {}, "
        "\"attempts_max\": {}, \"makespan_s\": {:.6f}, \"makespan_min_s\": {:.6f}, \"makespan_max_s\": {:.6f}, "
        "\"worst_tx_attempts\": {}}}",
        first ? "" : ",\n", key.first, cfg.k, json_string(spec.name), json_string(describe(spec)), s.attempts,
        s.attempts_min, s.attempts_max, s.makespan, s.makespan_min, s.makespan_max, s.worst);
    first = false;
  }
  f << "\n  ],\n  \"runs\": [\n";
  first = true;
  for (const auto& r : runs) {
    f << fmt::format(
        "{}    {{\"n\": {}, \"schedule\": {}, \"rep\": {}, \"attempts\": {}, \"retries\": {}, "
        "\"worst_tx_attempts\": {}, \"makespan_s\": {:.6f}, \"slept_s\": {:.6f}}}",
        first ? "" : ",\n", r.n, json_string(cfg.schedules[r.schedule].name), r.rep + 1, r.attempts,
        r.attempts - static_cast<std::uint64_t>(r.n) * static_cast<std::uint64_t>(cfg.k), r.worst, r.makespan_s,
        r.slept_s);
    first = false;
  }
  f << "\n  ]\n}\n";
  if (!f) fatal(fmt::format("cannot write {}", cfg.json.string()));
}

}  // namespace

int main(int argc, char** argv) {
  const config cfg = parse(argc, argv);

  fs::path dir;
  try {
    std::string tmpl = ((cfg.dir.empty() ? fs::temp_directory_path() : cfg.dir) / "dibs-contention-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::system_error(errno, std::generic_category(), "mkdtemp " + tmpl);
    dir = tmpl;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "backoff_contention: %s\n", e.what());
    return 1;
  }

  fmt::print("backoff_contention: {} CPUs, {}, SQLite {}\n", ::sysconf(_SC_NPROCESSORS_ONLN), compiler,
             ::sqlite3_libversion());
  fmt::print("  one shared database in {}; busy timeout 0, WAL, BEGIN IMMEDIATE; read counter, {}write +1\n",
             dir.string(),
             cfg.hold.count() > 0 ? fmt::format("hold the lock {} us ({}), ", cfg.hold.count(), to_string(cfg.mode))
                                  : std::string{});
  fmt::print("  unlimited attempts, deadline {} s per transaction; K = {}; {} runs per configuration\n",
             cfg.deadline.count(), cfg.k, cfg.reps);
  std::fflush(stdout);

  std::vector<run_result> runs;
  const int total_runs = cfg.reps * static_cast<int>(cfg.ns.size() * cfg.schedules.size());
  int serial = 0;
  const auto started = std::chrono::steady_clock::now();
  try {
    // Repetitions outermost: every configuration's runs are spread over the
    // whole session rather than bunched together.
    for (int rep = 0; rep < cfg.reps; ++rep)
      for (int n : cfg.ns)
        for (std::size_t si = 0; si < cfg.schedules.size(); ++si) {
          ++serial;
          const run_result r = run_once(cfg, si, n, rep, dir, serial);
          runs.push_back(r);
          const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
          std::fprintf(stderr, "[%3d/%d %6.0fs] N=%-3d %-12s run %d: %9llu attempts, makespan %8.3f s\n", serial,
                       total_runs, elapsed, n, cfg.schedules[si].name.c_str(), rep + 1,
                       static_cast<unsigned long long>(r.attempts), r.makespan_s);
        }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "backoff_contention: %s\n", e.what());
    return 1;
  }

  const summary_map sums = summarise(cfg, runs);
  print_table(cfg, sums);
  if (!cfg.csv.empty()) write_csv(cfg, runs);
  if (!cfg.json.empty()) write_json(cfg, runs, sums);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  fmt::print("\n  every run: counter == N * K checked; total wall time {:.0f} s\n", wall);

  std::error_code ec;
  fs::remove_all(dir, ec);
  return 0;
}
