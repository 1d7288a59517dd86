// dibs::once on Windows, on a file_store, under Wine: processes (this
// program started again in a helper role) that run the same slot of a
// schedule at once, its slots numbered by a clock the test holds still
// (options.clock): exactly one runs it, the others stand by and find it done,
// or find it taken when they do not stand by; and a run whose process is
// ended by TerminateProcess inside it is taken over at once on proof, by
// another process standing by (attempt 2, a larger token).
// `--once-run` and `--once-stuck` are its helper roles.
#include "win_support.hpp"

#include <dibs/once.hpp>
#include <dibs/stores/file_store.hpp>

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <iterator>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace once_win_test {
namespace {

using namespace win_test;
using sys = std::chrono::system_clock;

// The test clock, held still: 2027-01-15T08:00:00Z, the start of a slot of
// an hour (so every process stands by, by default, an hour).
constexpr long long fixed_ms = 1'800'000'000'000LL;
constexpr const char* fixed_slot = "2027-01-15T08:00:00Z";

dibs::once_options fixed_clock(dibs::once_options o = {}) {
  o.clock = [] { return sys::time_point{std::chrono::milliseconds{fixed_ms}}; };
  return o;
}

// The files of `dir` whose names start with `prefix`.
std::vector<fs::path> files_starting(const fs::path& dir, const std::string& prefix) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator{dir}) {
    const auto n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0 && n.find(".tmp") == std::string::npos) out.push_back(e.path());
  }
  return out;
}

// The running role, in DIR (the store is DIR/store): opens the schedule
// "nightly" (1 h, by the fixed clock; a 60 s lease, renewed; standing by
// STANDBY ms, or by default with -1), creates DIR/ready-I, waits for
// DIR/go, and runs the slot. A run says "PID TOKEN ATTEMPT" in
// DIR/inside-PID and returns when DIR/finish appears. Then "PID TOKEN SLOT
// OUTCOME" in DIR/result-I.
int once_run(const fs::path& dir, int index, long standby) {
  dibs::file_store store{dir / "store"};
  dibs::once_options o = fixed_clock();
  o.claims.lease = 60s;
  if (standby >= 0) o.standby = std::chrono::milliseconds{standby};
  dibs::once<dibs::file_store> job{store, "nightly", 1h, o};
  put(dir / fmt::format("ready-{}", index), "ready\n");
  if (!wait_for_file(dir / "go", 60s)) return 3;
  const auto pid = ::GetCurrentProcessId();
  const auto r = job.run([&](const auto& slot) {
    put(dir / fmt::format("inside-{}", pid), fmt::format("{} {} {}\n", pid, slot.token(), slot.attempt()));
    if (!wait_for_file(dir / "finish", 120s)) throw std::runtime_error("no word to finish the run");
  });
  put(dir / fmt::format("result-{}", index), fmt::format("{} {} {} {}\n", pid, r.token, r.slot, dibs::to_string(r.outcome)));
  return 0;
}

// The stuck role: runs the slot of "nightly" (as above, without standing
// by), says "PID TOKEN ATTEMPT" in DIR/inside-PID and stays inside the run
// until it is killed.
int once_stuck(const fs::path& dir) {
  dibs::file_store store{dir / "store"};
  dibs::once_options o = fixed_clock();
  o.claims.lease = 60s;
  o.standby = 0ms;
  dibs::once<dibs::file_store> job{store, "nightly", 1h, o};
  const auto pid = ::GetCurrentProcessId();
  (void)job.run([&](const auto& slot) {
    put(dir / fmt::format("inside-{}", pid), fmt::format("{} {} {}\n", pid, slot.token(), slot.attempt()));
    for (;;) ::Sleep(120'000);
  });
  return 4;  // the slot was not ours to run
}

const register_role run_role{"--once-run", [](int argc, char** argv) {
  return argc == 3 ? guarded("--once-run", [&] { return once_run(argv[0], std::atoi(argv[1]), std::atol(argv[2])); })
                   : 2;
}};
const register_role stuck_role{"--once-stuck", [](int argc, char** argv) {
  return argc == 1 ? guarded("--once-stuck", [&] { return once_stuck(argv[0]); }) : 2;
}};

std::unique_ptr<child> start_run(const fs::path& dir, int index, long standby) {
  return std::make_unique<child>(
      std::vector<std::wstring>{L"--once-run", dir.wstring(), std::to_wstring(index), std::to_wstring(standby)});
}

}  // namespace

TEST_CASE("Windows once: of 4 processes that run one slot at once one runs it, 2 not standing by find it taken, the rest done") {
  temp_dir dir;
  fs::create_directories(dir.path / "store");
  constexpr int racers = 4, peekers = 2;
  std::vector<std::unique_ptr<child>> kids;
  for (int i = 0; i < racers; ++i) kids.push_back(start_run(dir.path, i, -1));
  for (int i = 0; i < racers; ++i) REQUIRE(wait_for_file(dir.path / fmt::format("ready-{}", i), 60s));
  put(dir.path / "go", "go\n");  // all four run the slot together

  // One is inside the run.
  std::vector<fs::path> inside;
  for (const auto until = std::chrono::steady_clock::now() + 60s;
       (inside = files_starting(dir.path, "inside-")).empty() && std::chrono::steady_clock::now() < until;)
    std::this_thread::sleep_for(5ms);
  REQUIRE(inside.size() == 1);
  const auto w = words(get(inside[0]));
  REQUIRE(w.size() == 3);
  const long runner = std::stol(w[0]);
  const dibs::version token = std::stoull(w[1]);
  CHECK(w[2] == "1");

  dibs::file_store store{dir.path / "store"};
  dibs::once_options now_only = fixed_clock();
  now_only.standby = 0ms;
  dibs::once<dibs::file_store> peek{store, "nightly", 1h, now_only};
  CHECK(peek.slot_id() == fixed_slot);
  const auto running = peek.status_of(fixed_slot);
  CHECK(running.st == dibs::once_slot_status::state::running);
  REQUIRE(running.owner);
  CHECK(running.owner->pid == runner);

  // Processes that do not stand by find it taken while it runs, and so does this one.
  for (int i = racers; i < racers + peekers; ++i) kids.push_back(start_run(dir.path, i, 0));
  for (int i = racers; i < racers + peekers; ++i) {
    const auto result = dir.path / fmt::format("result-{}", i);
    REQUIRE(wait_for_file(result, 60s));
    const auto r = words(get(result));
    INFO(get(result));
    REQUIRE(r.size() == 4);
    CHECK(std::stol(r[0]) != runner);
    CHECK(r[2] == fixed_slot);
    CHECK(r[3] == "taken");
  }
  int ran_here = 0;
  const auto t = peek.run([&](const auto&) { ++ran_here; });
  CHECK(t.outcome == dibs::once_outcome::taken);
  CHECK(ran_here == 0);
  // The racers stand by (an hour, by the fixed clock): none has returned while the run goes on.
  CHECK(files_starting(dir.path, "result-").size() == peekers);

  put(dir.path / "finish", "finish\n");
  for (auto& k : kids) CHECK(k->wait(120s) == DWORD{0});
  int ran = 0, done = 0;
  for (int i = 0; i < racers; ++i) {
    const auto text = get(dir.path / fmt::format("result-{}", i));
    INFO("racer " << i << ": " << text);
    const auto r = words(text);
    REQUIRE(r.size() == 4);
    CHECK(std::stoull(r[1]) == token);
    CHECK(r[2] == fixed_slot);
    if (r[3] == "ran") {
      ++ran;
      CHECK(std::stol(r[0]) == runner);
    } else {
      ++done;
      CHECK(r[3] == "done");
    }
  }
  CHECK(ran == 1);
  CHECK(done == racers - 1);
  CHECK(files_starting(dir.path, "inside-").size() == 1);  // fn ran in one process only

  const auto st = peek.status_of(fixed_slot);
  CHECK(st.st == dibs::once_slot_status::state::completed);
  CHECK(st.attempts == 1);
  CHECK(st.token == token);
  CHECK_THAT(st.result, Catch::Contains(fmt::format("pid {} on ", runner)) && Catch::Contains("took"));
  const auto again = peek.run([&](const auto&) { ++ran_here; });
  CHECK(again.outcome == dibs::once_outcome::done);
  CHECK(again.token == token);
  CHECK(ran_here == 0);
  CHECK(peek.list().size() == 1);
}

TEST_CASE("Windows once: a run whose process was ended by TerminateProcess is taken over at once on proof (attempt 2, a larger token)") {
  temp_dir dir;
  fs::create_directories(dir.path / "store");
  child stuck{{L"--once-stuck", dir.path.wstring()}};
  std::vector<fs::path> inside;
  for (const auto until = std::chrono::steady_clock::now() + 60s;
       (inside = files_starting(dir.path, "inside-")).empty() && std::chrono::steady_clock::now() < until;)
    std::this_thread::sleep_for(5ms);
  REQUIRE(inside.size() == 1);
  const auto w = words(get(inside[0]));
  REQUIRE(w.size() == 3);
  CHECK(std::stol(w[0]) == static_cast<long>(stuck.pi.dwProcessId));
  const dibs::version their_token = std::stoull(w[1]);

  dibs::file_store store{dir.path / "store"};
  dibs::once_options o = fixed_clock();
  o.standby = 60s;
  dibs::once<dibs::file_store> job{store, "nightly", 1h, o};
  auto st = job.status_of(fixed_slot);
  CHECK(st.st == dibs::once_slot_status::state::running);
  REQUIRE(st.owner);
  CHECK(st.owner->pid == static_cast<long>(stuck.pi.dwProcessId));

  std::uint32_t attempt = 0;
  dibs::version token = 0;
  auto standing_by = std::async(std::launch::async, [&] {
    return job.run([&](const auto& slot) {
      attempt = slot.attempt();
      token = slot.token();
    });
  });
  // It stands by while the run's process lives (a 60 s lease, renewed).
  CHECK(standing_by.wait_for(500ms) == std::future_status::timeout);

  stuck.kill();  // its handle stays open here: the process object lives on, exited
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(standing_by.wait_for(90s) == std::future_status::ready);  // its standby ends by 60 s in any case
  const auto took = std::chrono::steady_clock::now() - t0;
  const auto r = standing_by.get();
  INFO("taken over after " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
  CHECK(took < 20s);  // on proof, not after the 60 s lease
  CHECK(r.outcome == dibs::once_outcome::ran);
  CHECK(r.slot == fixed_slot);
  CHECK(r.attempt == 2);
  CHECK(attempt == 2);
  CHECK(token > their_token);
  CHECK(r.token == token);
  st = job.status_of(fixed_slot);
  CHECK(st.st == dibs::once_slot_status::state::completed);
  CHECK(st.attempts == 2);
  CHECK_THAT(st.result, Catch::Contains(fmt::format("pid {} on ", ::GetCurrentProcessId())));
}

}  // namespace once_win_test
