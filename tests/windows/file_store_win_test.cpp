// file_store, lock_file and marker_claim<file_store> on Windows, under
// Wine: every record rewritten in place under a lock past its data
// (detail/win32/record_file.hpp), keys escaped so that names that differ
// only in case never share a file, and processes (this program started
// again in a role) killed with TerminateProcess while they hold locks and
// claims.
#include "win_support.hpp"

#include "../fenced_effect.hpp"

#include <dibs/lock_file.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace file_store_win_test {
namespace {

using namespace win_test;

// Keys as a mailbox has them: Message-IDs, with '/', '%', '+', '<', '>' and
// upper-case letters (all escaped in Windows names).
std::string item_key(int i) { return fmt::format("<Item/{:04}+%{}@Mail.Example.com>", i, i % 7); }

// The claiming role: claims every item it can, writes its effect to the
// journal (fenced by the claim's token), completes it; exits 0 once every
// item is completed.
int claim_worker(const fs::path& items_dir, const fs::path& journal_dir, int items, unsigned seed) {
  dibs::file_store store{items_dir}, journal{journal_dir};
  dibs::marker_claim<dibs::file_store> claims{store, {.lease = 30s, .max_attempts = 10}};
  return dibs_test::claim_every_item(claims, journal, items, item_key, seed, 0ms, 5ms);
}

const register_role claim_role{"--claim-worker", [](int argc, char** argv) {
  return argc == 4 ? claim_worker(argv[0], argv[1], std::atoi(argv[2]), static_cast<unsigned>(std::atoi(argv[3]))) : 2;
}};

// The locking role: `rounds` times, under a lock_file, reads the number in
// `counter`, writes it back plus one, unlocks, then appends a line to `log`
// (an acknowledged increment).
int lock_counter(const fs::path& lock, const fs::path& counter, const fs::path& log, int rounds) {
  dibs::lock_file m{lock, {.lease = 30s}};
  for (int i = 0; i < rounds; ++i) {
    {
      std::lock_guard g{m};
      std::fstream f{counter, std::ios::in | std::ios::out | std::ios::binary};
      long long v = -1;
      f >> v;
      if (v < 0) return 5;
      std::this_thread::yield();  // widen the window a missing lock would leave
      f.clear();
      f.seekp(0);
      f << fmt::format("{:019}\n", v + 1) << std::flush;
      if (!f) return 4;
    }
    std::ofstream{log, std::ios::app} << "+\n";
  }
  return 0;
}

const register_role lock_role{"--lock-count", [](int argc, char** argv) {
  return argc == 4 ? lock_counter(argv[0], argv[1], argv[2], std::atoi(argv[3])) : 2;
}};

// The holding role: takes the lock_file, creates `ready`, sleeps until killed.
const register_role hold_role{"--lock-hold", [](int argc, char** argv) {
  if (argc != 2) return 2;
  dibs::lock_file m{argv[0], {.lease = 60s}};
  m.lock();
  std::ofstream{argv[1]} << "held\n";
  ::Sleep(120'000);
  return 0;
}};

}  // namespace

TEST_CASE("Windows file_store passes the conformance suite and its queue checks") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-", 100));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 4, 100, "race-"));
  REQUIRE_NOTHROW(dibs::testing::check_queue(s, "q-"));
  REQUIRE_NOTHROW(dibs::testing::check_queue_race_threads(s, 4, 100, "qrace-"));
}

TEST_CASE("Windows file_store: keys that differ only in case, device names and characters Windows forbids each get a file of their own") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  const std::vector<std::string> keys{"job", "Job", "JOB", "con", "CON.txt", "nul", "a:b", "a*b?", "x\\y", "\xc3\xa9t\xc3\xa9", "\xc3\x89t\xc3\xa9", "jobsummary", "jobsum~1"};
  for (const auto& k : keys) REQUIRE(s.create(k, "value of " + k));
  for (const auto& k : keys) {
    const auto r = s.read(k);
    REQUIRE(r);
    CHECK(r->value == "value of " + k);
  }
  auto listed = s.keys();
  std::sort(listed.begin(), listed.end());
  auto want = keys;
  std::sort(want.begin(), want.end());
  CHECK(listed == want);
  CHECK(s.path_of("Job").filename().string() == "%4Aob.rec");
  // No name dibs makes looks like an 8.3 short name (NTFS finds jobsummary.rec as JOBSUM~1.REC).
  CHECK(s.path_of("jobsum~1").filename().string() == "jobsum%7E1.rec");
  CHECK(s.path_of("con").filename().string() == "%63on.rec");
}

TEST_CASE("Windows file_store: a value larger than a slot is refused by name, a missing directory and a file as directory are named") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  CHECK(s.create("small", std::string(dibs::file_store::max_value_size(), 'v')));
  try {
    (void)s.create("big", std::string(dibs::file_store::max_value_size() + 1, 'v'));
    FAIL("no error");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::invalid_argument);
    CHECK_THAT(e.what(), Catch::Contains("value for key 'big'") && Catch::Contains("at most 12288"));
  }
  CHECK_FALSE(s.read("big"));
  CHECK_THROWS_WITH(dibs::file_store{dir.path / "missing"},
                    Catch::Contains("cannot open directory") && Catch::Contains("missing") &&
                        Catch::Contains("does the directory exist?"));
  std::ofstream{dir.path / "plain"} << "x";
  CHECK_THROWS_WITH(dibs::file_store{dir.path / "plain"}, Catch::Contains("not a directory") && Catch::Contains("plain"));
  CHECK_THROWS_WITH(dibs::lock_file{dir.path / "con"}.try_lock(), Catch::Contains("it names a device on Windows"));
  CHECK_THROWS_WITH(dibs::lock_file{dir.path / "a?b"}.try_lock(), Catch::Contains("Windows does not allow"));
  fs::create_directory(dir.path / "sub.lock");
  CHECK_THROWS_WITH(dibs::lock_file{dir.path / "sub.lock"}.try_lock(),
                    Catch::Contains("not a regular file (a directory)") && Catch::Contains("sub.lock"));
}

TEST_CASE("Windows lock_file: a holder ended by TerminateProcess is broken at once on proof, long before its 60 s lease") {
  temp_dir dir;
  const auto lock = dir.path / "job.lock", ready = dir.path / "ready";
  child holder{{L"--lock-hold", lock.wstring(), ready.wstring()}};
  REQUIRE(wait_for_file(ready));
  dibs::lock_file m{lock, {.lease = 60s}};
  CHECK_FALSE(m.try_lock());
  const auto h = m.holder();
  REQUIRE(h);
  CHECK(h->pid == static_cast<long>(holder.pi.dwProcessId));
  holder.kill();
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(m.try_lock_for(10s));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  // The lock file is a record a person can read.
  std::ifstream in{lock};
  const std::string text{std::istreambuf_iterator<char>{in}, {}};
  CHECK_THAT(text, Catch::Contains("dibs-record 1\n") && Catch::Contains(fmt::format("pid {}\n", ::GetCurrentProcessId())));
  m.unlock();
}

TEST_CASE("Windows lock_file: 4 processes, 24 TerminateProcess kills, no increment lost under the lock", "[chaos]") {
  temp_dir dir;
  const auto lock = dir.path / "count.lock", counter = dir.path / "counter";
  std::ofstream{counter} << fmt::format("{:019}\n", 0);
  int started = 0;
  auto start = [&] {
    return std::make_unique<child>(std::vector<std::wstring>{
        L"--lock-count", lock.wstring(), counter.wstring(), (dir.path / ("log-" + std::to_string(started++))).wstring(),
        L"200"});
  };
  std::vector<std::unique_ptr<child>> procs;
  for (int i = 0; i < 4; ++i) procs.push_back(start());
  std::mt19937 rng(7);
  for (int k = 0; k < 24; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{20, 120}(rng)});
    auto& victim = procs[std::uniform_int_distribution<std::size_t>{0, procs.size() - 1}(rng)];
    victim->kill();
    victim = start();
  }
  for (auto& p : procs) CHECK(p->wait(120s) == DWORD{0});
  std::size_t acked = 0;
  for (int i = 0; i < started; ++i) acked += lines(dir.path / ("log-" + std::to_string(i)));
  std::ifstream in{counter};
  long long value = -1;
  in >> value;
  INFO("acknowledged " << acked << ", counter " << value);
  // Every acknowledged increment is in the counter; at most one more per
  // kill (a process killed after its write, before its acknowledgement).
  CHECK(value >= static_cast<long long>(acked));
  CHECK(value <= static_cast<long long>(acked) + 24);
  CHECK(acked >= 4 * 200);  // the 4 last processes each finished their 200
}

TEST_CASE("Windows marker_claim<file_store>: 4 worker processes, 2,000 items, 20 TerminateProcess kills, each item completed once with its effect", "[chaos]") {
  temp_dir dir;
  const auto items_dir = dir.path / "items", journal_dir = dir.path / "journal";
  fs::create_directories(items_dir);
  fs::create_directories(journal_dir);
  constexpr int items = 2000;
  int seed = 0;
  auto start = [&] {
    return std::make_unique<child>(std::vector<std::wstring>{L"--claim-worker", items_dir.wstring(), journal_dir.wstring(),
                                                             std::to_wstring(items), std::to_wstring(seed++)});
  };
  std::vector<std::unique_ptr<child>> procs;
  for (int i = 0; i < 4; ++i) procs.push_back(start());
  std::mt19937 rng(99);
  for (int k = 0; k < 20; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{20, 150}(rng)});
    auto& victim = procs[std::uniform_int_distribution<std::size_t>{0, procs.size() - 1}(rng)];
    victim->kill();
    victim = start();
  }
  for (auto& p : procs) CHECK(p->wait(240s) == DWORD{0});

  dibs::file_store store{items_dir}, journal{journal_dir};
  dibs::marker_claim<dibs::file_store> claims{store};
  int completed = 0, effects_match = 0, retried = 0;
  for (int i = 0; i < items; ++i) {
    const auto s = claims.status(item_key(i));
    completed += s.state == dibs::claim_state::completed;
    retried += s.attempts > 1;
    const auto e = journal.read(item_key(i));
    effects_match += e && e->value == s.result;
  }
  INFO("items retried after a kill: " << retried);
  CHECK(completed == items);
  CHECK(effects_match == items);  // each item's effect is in the journal once, from the claim that completed it
}

}  // namespace file_store_win_test
