// lock_file's waiters take turns (the waiter queue beside the lock file):
// first come, first served, a holder that asks again queues behind them,
// and no waiter waits on a dead or stopped one. Mutual exclusion under
// SIGKILL at any point: a journal written under the lock.
#include <dibs/lock_file.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using dibs_test::channel;
using dibs_test::child;
using dibs_test::slurp;
using dibs_test::spit;
using dibs_test::temp_dir;
namespace fs = std::filesystem;

namespace {

// The locks of these tests renew nothing (their holds last well under the
// lease): no process here starts a renewal thread, so that children forked
// from it may start none either (ThreadSanitizer refuses a thread started
// after a fork of a process with threads).
const dibs::lease_options quiet{.renew = false};

// Effects: appends `line` to the file at `p` in one write (O_APPEND).
void append(const fs::path& p, const std::string& line) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()));
  ::close(fd);
}

// Returns: how many live processes wait in the queue of the lock file `path`.
int queued(const fs::path& path) {
  const dibs::file_store files{path.parent_path(), {.suffix = "", .key_is_file_name = true}};
  const auto q = files.open_waiter_queue(path.filename().string(), false);
  return q ? q.queued() : 0;
}

// A child that locks `path` (with `opts`), says "<name> <steady ns>" on
// `out` once it holds it, appends `name` to `journal`, holds for `hold`, unlocks.
child taker(const fs::path& path, dibs::lease_options opts, char name, const fs::path& journal, const channel& out,
            std::chrono::milliseconds hold = 0ms) {
  return child{dibs_test::spawn([=, &out] {
    dibs::lock_file lock{path, opts};
    std::scoped_lock h{lock};
    out.send(fmt::format("{} {}", name, dibs_test::steady_ns()));
    append(journal, std::string(1, name));
    std::this_thread::sleep_for(hold);
    return 0;
  })};
}

}  // namespace

TEST_CASE("lock_file takes turns: waiters get the lock in the order they came, and a holder that asks again at once queues behind them") {
  temp_dir dir;
  const auto path = dir.path / "turns.lock";
  const auto journal = dir.path / "journal";
  channel got;
  dibs::lock_file a{path, quiet};
  a.lock();
  std::vector<child> waiters;
  int n = 0;
  for (const char name : {'B', 'C', 'D'}) {
    waiters.push_back(taker(path, quiet, name, journal, got));
    ++n;
    // Queued: the next one comes only after this one holds its place.
    REQUIRE(dibs_test::eventually([&] { return queued(path) == n; }, 30s));
  }
  CHECK(queued(path) == 3);
  a.unlock();
  a.lock();  // at once: before B has woken
  append(journal, "A");
  a.unlock();
  for (auto& w : waiters) CHECK(w.wait() == 0);
  CHECK(slurp(journal) == "BCDA");
  CHECK(queued(path) == 0);
}

TEST_CASE("lock_file: a waiter SIGKILLed while queued is passed over at once, and the unlock wakes the one behind it") {
  temp_dir dir;
  const auto path = dir.path / "dead.lock";
  const auto journal = dir.path / "journal";
  channel got;
  dibs::lock_file a{path, quiet};
  a.lock();
  child b = taker(path, quiet, 'B', journal, got);
  REQUIRE(dibs_test::eventually([&] { return queued(path) == 1; }, 30s));
  // C polls only every 20 s: it can have the lock sooner only by being woken
  // (or, at the earliest, once A's 10 s lease has run out).
  const dibs::lease_options slow{.renew = false, .wait = dibs::exponential_backoff{20s, 1.0, 20s, dibs::jitter::none}};
  child c = taker(path, slow, 'C', journal, got);
  REQUIRE(dibs_test::eventually([&] { return queued(path) == 2; }, 30s));
  b.kill();
  CHECK(queued(path) == 1);  // the dead one's slot is nobody's
  const auto unlocked = std::chrono::steady_clock::now();
  a.unlock();
  const auto line = got.receive(60s);
  REQUIRE(line);
  const auto w = dibs_test::words(*line);
  REQUIRE(w.size() == 2);
  CHECK(w[0] == "C");
  const auto after = dibs_test::from_steady_ns(std::stoll(w[1])) - unlocked;
  INFO("C had the lock " << std::chrono::duration_cast<std::chrono::milliseconds>(after).count()
                         << " ms after the unlock");
  CHECK(after < 5s);  // woken: a few ms (wide for a loaded machine), not its next poll
  CHECK(c.wait() == 0);
  CHECK(slurp(journal) == "C");
}

TEST_CASE("lock_file: a waiter stopped (SIGSTOP) when its turn comes is passed after the queue's patience, and gets the lock once it runs again") {
  temp_dir dir;
  const auto path = dir.path / "stopped.lock";
  const auto journal = dir.path / "journal";
  channel got;
  dibs::lock_file a{path, quiet};
  a.lock();
  child b = taker(path, quiet, 'B', journal, got);
  REQUIRE(dibs_test::eventually([&] { return queued(path) == 1; }, 30s));
  child c = taker(path, quiet, 'C', journal, got, 100ms);
  REQUIRE(dibs_test::eventually([&] { return queued(path) == 2; }, 30s));
  REQUIRE(::kill(b.pid(), SIGSTOP) == 0);
  const auto unlocked = std::chrono::steady_clock::now();
  a.unlock();
  const auto first = got.receive(10s);
  REQUIRE(first);
  CHECK(dibs_test::words(*first)[0] == "C");
  const auto after = dibs_test::from_steady_ns(std::stoll(dibs_test::words(*first)[1])) - unlocked;
  INFO("C had the lock " << std::chrono::duration_cast<std::chrono::milliseconds>(after).count() << " ms after the unlock");
  CHECK(after < 5s);  // the patience (100 ms) and a backoff delay, not the 10 s lease; wide for a loaded machine
  REQUIRE(::kill(b.pid(), SIGCONT) == 0);
  CHECK(c.wait() == 0);
  CHECK(b.wait() == 0);
  CHECK(slurp(journal) == "CB");
}

TEST_CASE("lock_file: a waiter stopped at the head costs the queue's patience once, and the waiters behind it keep their order round after round") {
  temp_dir dir;
  const auto path = dir.path / "head.lock";
  const auto journal = dir.path / "journal";
  channel got;
  dibs::lock_file a{path, quiet};
  a.lock();
  child b = taker(path, quiet, 'B', journal, got);
  REQUIRE(dibs_test::eventually([&] { return queued(path) == 1; }, 30s));
  REQUIRE(::kill(b.pid(), SIGSTOP) == 0);
  // Three waiters behind it, each taking the lock three times: a holder
  // that asks again queues behind the others.
  std::vector<child> loops;
  int n = 1;
  for (const char name : {'C', 'D', 'E'}) {
    loops.push_back(child{dibs_test::spawn([=] {
      dibs::lock_file lock{path, quiet};
      for (int round = 0; round < 3; ++round) {
        std::scoped_lock h{lock};
        append(journal, std::string(1, name));
        std::this_thread::sleep_for(20ms);
      }
      return 0;
    })});
    ++n;
    REQUIRE(dibs_test::eventually([&] { return queued(path) == n; }, 30s));
  }
  a.unlock();
  for (auto& l : loops) CHECK(l.wait() == 0);
  const dibs::file_store files{dir.path, {.suffix = "", .key_is_file_name = true}};
  const auto q = files.open_waiter_queue("head.lock", false);
  REQUIRE(q);
  CHECK(q.passes() == 1);  // the stopped waiter was passed once, not once a round
  CHECK(slurp(journal) == "CDECDECDE");
  REQUIRE(::kill(b.pid(), SIGCONT) == 0);  // running again, it waits its turn and gets the lock
  CHECK(b.wait() == 0);
  CHECK(slurp(journal) == "CDECDECDEB");
}

TEST_CASE("lock_file turns under SIGKILL: with waiters, holders and unlockers killed, one holder at a time, no lost turn, nobody waits on the dead", "[chaos]") {
  constexpr int workers = 6, kills = 40;
  temp_dir dir;
  const auto path = dir.path / "storm.lock";
  const auto journal = dir.path / "journal";
  const auto counter = dir.path / "counter";
  spit(counter, "0\n");
  // Each turn: "in <token> <pid> <steady ns>", the counter incremented
  // (a new file renamed over it), "out <token> <pid>".
  auto start_worker = [&] {
    return dibs_test::spawn([&] {
      dibs::lock_file lock{path, {.lease = 10s, .renew = false}};
      for (;;) {
        std::scoped_lock hold{lock};
        append(journal, fmt::format("in {} {} {}\n", lock.token(), ::getpid(), dibs_test::steady_ns()));
        long value = -1;
        std::ifstream(counter) >> value;
        spit(counter.string() + ".tmp", fmt::format("{}\n", value + 1));
        fs::rename(counter.string() + ".tmp", counter);
        append(journal, fmt::format("out {} {}\n", lock.token(), ::getpid()));
      }
      return 0;
    });
  };
  std::vector<pid_t> pids;
  for (int i = 0; i < workers; ++i) pids.push_back(start_worker());
  // Every other kill aims at the process of the journal's last line: the
  // holder, or the one handing the lock off (its "out" is written); the
  // rest are random, mostly queued waiters.
  auto last_writer = [&]() -> std::optional<std::size_t> {
    const std::string text = slurp(journal);
    const auto start = text.rfind('\n', text.size() >= 2 ? text.size() - 2 : 0);
    const auto w = dibs_test::words(text.substr(start == std::string::npos ? 0 : start + 1));
    if (w.size() < 3) return std::nullopt;
    const auto it = std::find(pids.begin(), pids.end(), static_cast<pid_t>(std::stol(w[2])));
    if (it == pids.end()) return std::nullopt;
    return static_cast<std::size_t>(it - pids.begin());
  };
  std::mt19937 rng(21);
  for (int k = 0; k < kills; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{5, 60}(rng)});
    std::optional<std::size_t> aimed;
    if (k % 2 == 0) aimed = last_writer();
    const std::size_t victim = aimed ? *aimed : std::uniform_int_distribution<std::size_t>{0, pids.size() - 1}(rng);
    ::kill(pids[victim], SIGKILL);
    dibs_test::wait_exit(pids[victim]);
    pids[victim] = start_worker();
  }
  // Work went on after the last kill (and enough of it was done to judge
  // the journal by): seen in the journal, not assumed after 100 ms.
  auto outs_so_far = [&] {
    const std::string text = slurp(journal);
    long n = 0;
    for (std::size_t at = 0; (at = text.find("out ", at)) != std::string::npos; at += 4) n += at == 0 || text[at - 1] == '\n';
    return n;
  };
  const long outs_at_last_kill = outs_so_far();
  REQUIRE(dibs_test::eventually([&] { return outs_so_far() > std::max(100L, outs_at_last_kill + 5); }, 60s));
  for (const pid_t p : pids) {
    ::kill(p, SIGKILL);
    dibs_test::wait_exit(p);
  }
  // The journal: every "out" follows the "in" of the same hold, nothing
  // between them; tokens grow; the counter was incremented once per "out"
  // and at most once more per hold cut short by a kill.
  std::istringstream lines(slurp(journal));
  std::string word;
  unsigned long long token = 0, last_token = 0;
  long pid = 0, open_pid = 0;
  long long ns = 0, last_in_ns = 0, longest_gap_ns = 0;
  long ins = 0, outs = 0, misplaced = 0, shrinking = 0;
  bool open = false;
  while (lines >> word) {
    if (word == "in") {
      lines >> token >> pid >> ns;
      ++ins;
      if (token <= last_token) ++shrinking;
      if (last_in_ns != 0) longest_gap_ns = std::max(longest_gap_ns, ns - last_in_ns);
      last_token = token;
      last_in_ns = ns;
      open_pid = pid;
      open = true;  // an earlier open hold was cut short by a kill
    } else {
      lines >> token >> pid;
      ++outs;
      if (!open || token != last_token || pid != open_pid) ++misplaced;
      open = false;
    }
  }
  long value = -1;
  std::ifstream(counter) >> value;
  INFO("turns " << ins << ", completed " << outs << ", counter " << value << ", longest gap between turns "
                << longest_gap_ns / 1'000'000 << " ms");
  CHECK(misplaced == 0);
  CHECK(shrinking == 0);
  CHECK(outs > 100);
  CHECK(value >= outs);
  CHECK(value <= ins);
  // A dead holder is broken on proof at the next waiter's try; a dead
  // waiter is no waiter. Nobody waits for the 10 s lease.
  CHECK(longest_gap_ns < 5'000'000'000);  // a few ms at most on an idle machine; half the lease
}

TEST_CASE("lock_file: more waiters than the queue has slots (63): the rest wait unordered, and every one gets the lock once") {
  constexpr int waiters = 66;
  temp_dir dir;
  const auto path = dir.path / "crowd.lock";
  const auto counter = dir.path / "counter";
  spit(counter, "0\n");
  dibs::lock_file a{path, quiet};
  a.lock();
  std::vector<child> kids;
  for (int i = 0; i < waiters; ++i) {
    kids.push_back(child{dibs_test::spawn([&] {
      dibs::lock_file lock{path, quiet};
      std::scoped_lock hold{lock};
      long value = -1;
      std::ifstream(counter) >> value;
      spit(counter.string() + ".tmp", fmt::format("{}\n", value + 1));
      fs::rename(counter.string() + ".tmp", counter);
      return 0;
    })});
  }
  CHECK(dibs_test::eventually([&] { return queued(path) == 63; }, 20s));
  a.unlock();
  int failed = 0;
  for (auto& k : kids) failed += k.wait() != 0;
  CHECK(failed == 0);
  long value = -1;
  std::ifstream(counter) >> value;
  CHECK(value == waiters);
  CHECK(queued(path) == 0);
}
