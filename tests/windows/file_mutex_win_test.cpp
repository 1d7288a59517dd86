// dibs::file_mutex on Windows (LockFileEx), run under Wine in CI: threads of
// one process, other processes (this program started again with
// CreateProcessW in a helper role), TerminateProcess as the SIGKILL
// analogue, and bad paths. `--hold` and `--count` are its helper roles
// (win_support.hpp).
#include "win_support.hpp"

#include <dibs/file_mutex.hpp>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

namespace file_mutex_win_test {
namespace {

using namespace win_test;

// Another process holding `lock` (exclusive, or shared with L"sh") from
// construction until release() (or until it is killed).
struct holder {
  fs::path ready, release_file;
  child proc;
  holder(const temp_dir& dir, const fs::path& lock, const wchar_t* mode)
      : ready(dir.path / "ready"),
        release_file(dir.path / "release"),
        proc({L"--hold", lock.wstring(), mode, ready.wstring(), release_file.wstring()}) {
    REQUIRE(wait_for_file(ready));
  }
  void release() { std::ofstream{release_file} << "go\n"; }
};

// The holder role: locks `path` (exclusive, or shared with "sh"), creates
// `ready`, and holds until `release` exists.
int hold(const fs::path& path, const std::string& mode, const fs::path& ready, const fs::path& release) {
  dibs::file_mutex m{path};
  if (mode == "sh") m.lock_shared();
  else m.lock();
  std::ofstream{ready} << "held\n";
  if (!wait_for_file(release, 120s)) return 3;
  if (mode == "sh") m.unlock_shared();
  else m.unlock();
  return 0;
}

// The counting role: `rounds` times, under the lock, reads the number in
// `counter`, writes it back plus one, unlocks, then appends a line to `log`
// (an acknowledged increment). Lost updates show as a counter below the
// acknowledged count.
int count(const fs::path& lock, const fs::path& counter, const fs::path& log, int rounds) {
  dibs::file_mutex m{lock};
  for (int i = 0; i < rounds; ++i) {
    {
      std::lock_guard g{m};
      // The number is rewritten in place, fixed width, in one write: a
      // process killed here leaves the old number or the new one, never an
      // empty file (a truncating rewrite would start the count again).
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

}  // namespace

const win_test::register_role hold_role{"--hold", [](int argc, char** argv) {
  return argc == 4 ? hold(argv[0], argv[1], argv[2], argv[3]) : 2;
}};
const win_test::register_role count_role{"--count", [](int argc, char** argv) {
  return argc == 4 ? count(argv[0], argv[1], argv[2], std::atoi(argv[3])) : 2;
}};

TEST_CASE("Windows file_mutex: 4 threads of one process exclude each other, 4 x 500 increments, none lost") {
  temp_dir dir;
  std::atomic<int> inside{0}, overlaps{0};
  long long counter = 0;  // not atomic: only the lock protects it
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      dibs::file_mutex m{dir.path / "threads.lock"};
      for (int i = 0; i < 500; ++i) {
        std::lock_guard g{m};
        if (inside.fetch_add(1) != 0) ++overlaps;
        ++counter;
        inside.fetch_sub(1);
      }
    });
  for (auto& t : threads) t.join();
  CHECK(overlaps == 0);
  CHECK(counter == 2000);
}

TEST_CASE("Windows file_mutex: another process's lock refuses try_lock, try_lock_for waits its time, and is free once the holder lets go") {
  temp_dir dir;
  const auto lock = dir.path / "a.lock";
  holder other{dir, lock, L"ex"};
  dibs::file_mutex m{lock};
  CHECK_FALSE(m.try_lock());
  CHECK_FALSE(m.try_lock_shared());
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(m.try_lock_for(300ms));
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(waited >= 300ms);
  CHECK(waited < 3s);
  other.release();
  CHECK(m.try_lock_for(20s));  // polls while the holder lets go
  m.unlock();
  CHECK(other.proc.wait() == DWORD{0});
}

TEST_CASE("Windows file_mutex: a holder ended by TerminateProcess leaves the lock free, and a blocking lock() gets it") {
  temp_dir dir;
  const auto lock = dir.path / "k.lock";
  holder other{dir, lock, L"ex"};  // never released: killed below
  dibs::file_mutex m{lock};
  REQUIRE_FALSE(m.try_lock());
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    m.lock();  // blocks in LockFileEx
    got = true;
  });
  std::this_thread::sleep_for(200ms);
  CHECK_FALSE(got.load());
  other.proc.kill();
  waiter.join();
  CHECK(got.load());
  m.unlock();
}

TEST_CASE("Windows file_mutex: shared holders in two processes together, an exclusive one waits for both") {
  temp_dir dir;
  const auto lock = dir.path / "s.lock";
  holder reader{dir, lock, L"sh"};
  dibs::file_mutex m{lock};
  REQUIRE(m.try_lock_shared());
  CHECK_FALSE(m.try_lock());  // this process's own shared hold is in the way too
  m.unlock_shared();
  CHECK_FALSE(m.try_lock());  // the other process still reads
  reader.release();
  CHECK(m.try_lock_for(20s));
  m.unlock();
  CHECK(reader.proc.wait() == DWORD{0});
}

TEST_CASE("Windows file_mutex: lock(stop_token) ends with errc::cancelled soon after a stop request, holding nothing") {
  temp_dir dir;
  const auto lock = dir.path / "c.lock";
  holder other{dir, lock, L"ex"};
  dibs::file_mutex m{lock};
  std::stop_source stop;
  std::jthread stopper([&] {
    std::this_thread::sleep_for(200ms);
    stop.request_stop();
  });
  const auto t0 = std::chrono::steady_clock::now();
  try {
    m.lock(stop.get_token());
    FAIL("lock() returned while another process held the lock");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::cancelled);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  other.release();
  CHECK(other.proc.wait() == DWORD{0});
  CHECK(m.try_lock_for(20s));  // nothing was left held by the cancelled wait
  m.unlock();
}

TEST_CASE("Windows file_mutex: 4 processes, 25 TerminateProcess kills, no increment lost under the lock", "[chaos]") {
  temp_dir dir;
  const auto lock = dir.path / "n.lock", counter = dir.path / "counter";
  std::ofstream{counter, std::ios::binary} << fmt::format("{:019}\n", 0);
  constexpr int workers = 4, kills = 25, rounds = 200;
  std::vector<std::unique_ptr<child>> running;
  int started = 0;
  auto start = [&](int slot) {
    running[static_cast<std::size_t>(slot)] = std::make_unique<child>(std::vector<std::wstring>{
        L"--count", lock.wstring(), counter.wstring(), (dir.path / ("log-" + std::to_string(started++))).wstring(),
        std::to_wstring(rounds)});
  };
  running.resize(workers);
  for (int w = 0; w < workers; ++w) start(w);
  std::mt19937 rng{std::random_device{}()};
  int killed = 0;
  for (int k = 0; k < kills; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds{20 + rng() % 60});
    const int slot = static_cast<int>(rng() % workers);
    running[static_cast<std::size_t>(slot)]->kill();
    ++killed;
    start(slot);
  }
  for (auto& c : running) CHECK(c->wait(120s) == DWORD{0});
  std::size_t acknowledged = 0;
  for (int i = 0; i < started; ++i) acknowledged += lines(dir.path / ("log-" + std::to_string(i)));
  long long value = -1;
  std::ifstream{counter} >> value;
  INFO("acknowledged " << acknowledged << ", counter " << value << ", killed " << killed);
  CHECK(killed == kills);
  CHECK(acknowledged >= static_cast<std::size_t>(workers * rounds));  // the 4 last workers ran to the end
  // Under the lock no increment is lost: the counter holds every acknowledged
  // one, plus at most one per kill (killed after its write, before its log line).
  CHECK(value >= static_cast<long long>(acknowledged));
  CHECK(value <= static_cast<long long>(acknowledged) + kills);
}

TEST_CASE("Windows file_mutex: bad paths name the path and say what to check") {
  temp_dir dir;
  auto message_of = [](const fs::path& p) -> std::string {
    try {
      dibs::file_mutex m{p};
    } catch (const std::system_error& e) {
      return e.what();
    }
    return "";
  };
  const auto missing = dir.path / "no-such-dir" / "x.lock";
  auto m1 = message_of(missing);
  CHECK(m1.find("no-such-dir") != std::string::npos);
  CHECK(m1.find("does the directory exist?") != std::string::npos);
  fs::create_directories(dir.path / "adir");
  auto m2 = message_of(dir.path / "adir");
  CHECK(m2.find("not a regular file") != std::string::npos);
  CHECK(m2.find("adir") != std::string::npos);
  // A missing drive: the drive letter least likely to be mapped.
  auto m3 = message_of(fs::path{L"Q:\\dibs\\x.lock"});
  CHECK(m3.find("Q:") != std::string::npos);
  CHECK_FALSE(m3.empty());
}

TEST_CASE("Windows file_mutex: a read-only lock file still locks (opened for reading), a path over MAX_PATH works, a UTF-8 name round-trips") {
  temp_dir dir;
  const auto ro = dir.path / "ro.lock";
  std::ofstream{ro} << "\n";
  REQUIRE(::SetFileAttributesW(ro.c_str(), FILE_ATTRIBUTE_READONLY));
  {
    dibs::file_mutex m{ro};
    CHECK(m.try_lock());
    m.unlock();
  }
  ::SetFileAttributesW(ro.c_str(), FILE_ATTRIBUTE_NORMAL);

  // Over MAX_PATH (260): the directories are made through \\?\ too.
  std::wstring deep = LR"(\\?\)" + fs::absolute(dir.path).wstring();
  for (int i = 0; i < 6; ++i) {
    deep += L"\\" + std::wstring(50, static_cast<wchar_t>(L'a' + i));
    REQUIRE(::CreateDirectoryW(deep.c_str(), nullptr));
  }
  const fs::path long_path = fs::absolute(dir.path) / std::wstring(50, L'a') / std::wstring(50, L'b') /
                             std::wstring(50, L'c') / std::wstring(50, L'd') / std::wstring(50, L'e') /
                             std::wstring(50, L'f') / "deep.lock";
  REQUIRE(long_path.wstring().size() > MAX_PATH);
  {
    dibs::file_mutex m{long_path};
    CHECK(m.try_lock());
    m.unlock();
  }
  CHECK(::GetFileAttributesW((deep + L"\\deep.lock").c_str()) != INVALID_FILE_ATTRIBUTES);

  const fs::path utf8 = dir.path / fs::path{u8"Zähler-名前.lock"};
  dibs::file_mutex u{utf8};
  CHECK(u.try_lock());
  u.unlock();
  CHECK(fs::exists(utf8));
  try {
    dibs::file_mutex bad{dir.path / fs::path{u8"nicht-da-ü"} / "x.lock"};
    FAIL("opened a lock file in a missing directory");
  } catch (const std::system_error& e) {
    CHECK(std::string{e.what()}.find("nicht-da-\xc3\xbc") != std::string::npos);  // as UTF-8
  }
}

}  // namespace file_mutex_win_test
