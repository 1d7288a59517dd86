// dibs::dot_lock on Windows (CreateFileW(CREATE_NEW), stale locks broken on
// proof by MoveFileExW to a unique name), run under Wine in CI: processes
// killed while holding (TerminateProcess), waiters that break one dead
// holder's lock together, the proof rule's limits (a live holder, another
// computer), foreign and half-written lock files, a batch file run by
// cmd.exe locking the same file with `if exist` and `echo`, and bad paths.
// `--dot-hold`, `--dot-count` and `--dot-idle` are its helper roles.
#include "win_support.hpp"

#include <dibs/dot_lock.hpp>

#include <fmt/format.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace dot_lock_win_test {
namespace {

using namespace win_test;

dibs::dot_lock_options patient() {
  dibs::dot_lock_options o;
  o.stale_after = 60s;  // only proof breaks a lock within a test's time
  o.wait = dibs::exponential_backoff{std::chrono::microseconds{500}, 2.0, 5ms, dibs::jitter::full};
  return o;
}

// Returns: the contents of `p` ("" if it cannot be read), read sharing
// everything (std::ifstream does not share deletes, which would stop a
// breaker's rename while it is open).
std::string slurp(const fs::path& p) {
  dibs::detail::unique_handle h{::CreateFileW(p.c_str(), GENERIC_READ,
                                              FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
                                              OPEN_EXISTING, 0, nullptr)};
  if (!h) return {};
  char buf[4096];
  DWORD n = 0;
  if (!::ReadFile(h.get(), buf, sizeof buf, &n, nullptr)) return {};
  return std::string(buf, n);
}

// Effects: appends `line` in one write (FILE_APPEND_DATA: never over
// another writer's line). Returns: true if written.
bool append_line(const fs::path& p, const std::string& line) {
  dibs::detail::unique_handle h{::CreateFileW(p.c_str(), FILE_APPEND_DATA, FILE_SHARE_READ | FILE_SHARE_WRITE, nullptr,
                                              OPEN_ALWAYS, 0, nullptr)};
  DWORD n = 0;
  return h && ::WriteFile(h.get(), line.data(), static_cast<DWORD>(line.size()), &n, nullptr) && n == line.size();
}

// Effects: sets the last write time of `p` to `age` ago.
void age_file(const fs::path& p, std::chrono::seconds age) {
  dibs::detail::unique_handle h{::CreateFileW(p.c_str(), FILE_WRITE_ATTRIBUTES,
                                              FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
                                              OPEN_EXISTING, 0, nullptr)};
  REQUIRE(h);
  FILETIME now{};
  ::GetSystemTimeAsFileTime(&now);
  std::uint64_t t = (static_cast<std::uint64_t>(now.dwHighDateTime) << 32) | now.dwLowDateTime;
  t -= static_cast<std::uint64_t>(age.count()) * 10'000'000;
  const FILETIME then{static_cast<DWORD>(t), static_cast<DWORD>(t >> 32)};
  REQUIRE(::SetFileTime(h.get(), nullptr, nullptr, &then));
}

// The record a dot_lock of process `o` writes.
std::string record_of(const dibs::detail::owner_id& o) {
  return fmt::format("{}\n{}\n{}", o.pid, dibs::detail::dot_lock_magic, dibs::detail::format_owner(o));
}

// A process of this program that was terminated; its handle stays open,
// so its id is not reused while the test runs.
struct dead_process {
  child proc{{L"--dot-idle"}};
  dibs::detail::owner_id owner;
  dead_process() {
    owner = dibs::detail::this_process(60s);
    owner.pid = static_cast<long>(proc.pi.dwProcessId);
    owner.start = dibs::detail::process_start(owner.pid).value_or(0);
    REQUIRE(owner.start != 0);
    proc.kill();
  }
};

// Another process holding a dot_lock on `lock` from construction until
// release() (or until it is killed).
struct holder {
  fs::path ready, release_file;
  child proc;
  holder(const temp_dir& dir, const fs::path& lock)
      : ready(dir.path / "ready"),
        release_file(dir.path / "release"),
        proc({L"--dot-hold", lock.wstring(), ready.wstring(), release_file.wstring()}) {
    REQUIRE(wait_for_file(ready));
  }
  void release() { std::ofstream{release_file} << "go\n"; }
};

int dot_hold(const fs::path& lock, const fs::path& ready, const fs::path& release) {
  dibs::dot_lock l{lock, patient()};
  if (!l.try_lock_for(30s)) return 4;
  std::ofstream{ready} << "held\n";
  if (!wait_for_file(release, 120s)) return 3;
  l.unlock();
  return 0;
}

// Reads the number at the start of `p`, or -1.
long long read_number(const fs::path& p) {
  std::istringstream in{slurp(p)};
  long long v = -1;
  in >> v;
  return v;
}

// Writes `v` over the start of `p`, fixed width, in one write: a process
// killed here leaves the old number or the new one.
bool write_number(const fs::path& p, long long v) {
  dibs::detail::unique_handle h{::CreateFileW(p.c_str(), GENERIC_WRITE, FILE_SHARE_READ | FILE_SHARE_WRITE, nullptr,
                                              OPEN_EXISTING, 0, nullptr)};
  const std::string text = fmt::format("{:019}\r\n", v);
  DWORD n = 0;
  return h && ::WriteFile(h.get(), text.data(), static_cast<DWORD>(text.size()), &n, nullptr) && n == text.size();
}

// The counting role: `rounds` times, under the dot_lock, reads the counter
// N, writes N + 1, then appends "N+1 <pid>" to `journal`. Two holders at
// once read the same N: the journal shows a number twice.
int dot_count(const fs::path& lock, const fs::path& counter, const fs::path& journal, int rounds) {
  auto opts = patient();
  opts.stale_after = std::chrono::minutes{10};  // a dead holder's lock is broken on proof, or the test times out
  dibs::dot_lock l{lock, opts};
  for (int i = 0; i < rounds; ++i) {
    std::lock_guard g{l};
    const long long v = read_number(counter);
    if (v < 0) return 5;
    ::Sleep(2);  // widen the window a second holder would need, and let the test catch holders
    if (!write_number(counter, v + 1)) return 4;
    if (!append_line(journal, fmt::format("{} {}\n", v + 1, ::GetCurrentProcessId()))) return 6;
  }
  return 0;
}

// The numbers of `journal`, in order.
std::vector<long long> journal_numbers(const fs::path& journal) {
  std::istringstream in{slurp(journal)};
  std::vector<long long> out;
  long long v = 0, pid = 0;
  while (in >> v >> pid) out.push_back(v);
  return out;
}

// Runs `script` (a batch file) with `cmd.exe /c`, its arguments after it.
struct batch {
  PROCESS_INFORMATION pi{};
  batch(const fs::path& script, const std::vector<std::wstring>& args) {
    // cmd.exe strips the first and the last quote of what follows /c:
    // the whole line is quoted once more.
    std::wstring cmd = L"cmd.exe /c \"\"" + script.wstring() + L"\"";
    for (const auto& a : args) cmd += L" \"" + a + L"\"";
    cmd += L"\"";
    STARTUPINFOW si{};
    si.cb = sizeof si;
    REQUIRE(::CreateProcessW(nullptr, cmd.data(), nullptr, nullptr, FALSE, 0, nullptr, nullptr, &si, &pi));
  }
  batch(const batch&) = delete;
  batch& operator=(const batch&) = delete;
  ~batch() {
    ::TerminateProcess(pi.hProcess, 9);
    ::WaitForSingleObject(pi.hProcess, 10'000);
    ::CloseHandle(pi.hProcess);
    ::CloseHandle(pi.hThread);
  }
  std::optional<DWORD> wait(std::chrono::milliseconds limit = 60s) {
    if (::WaitForSingleObject(pi.hProcess, static_cast<DWORD>(limit.count())) != WAIT_OBJECT_0) return std::nullopt;
    DWORD code = 0;
    ::GetExitCodeProcess(pi.hProcess, &code);
    return code;
  }
};

void write_text(const fs::path& p, const std::string& text) { std::ofstream{p, std::ios::binary} << text; }

}  // namespace

const win_test::register_role dot_idle_role{"--dot-idle", [](int, char**) {
  ::Sleep(120'000);
  return 0;
}};
const win_test::register_role dot_hold_role{"--dot-hold", [](int argc, char** argv) {
  return argc == 3 ? dot_hold(argv[0], argv[1], argv[2]) : 2;
}};
const win_test::register_role dot_count_role{"--dot-count", [](int argc, char** argv) {
  return argc == 4 ? dot_count(argv[0], argv[1], argv[2], std::atoi(argv[3])) : 2;
}};

TEST_CASE("Windows dot_lock: a held lock is a file made with CREATE_NEW holding the record, try_lock fails while it is there, unlock removes it") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck";
  dibs::dot_lock a{lock, patient()}, b{lock, patient()};
  REQUIRE(a.try_lock());
  const auto text = slurp(lock);
  CHECK(text.rfind(fmt::format("{}\ndibs-dot-lock 1\nhost {}\n", ::GetCurrentProcessId(), dibs::detail::host_name()), 0) == 0);
  CHECK(dibs::detail::parse_dot_lock(text).has_value());
  CHECK_FALSE(b.try_lock());
  CHECK(a.still_held());
  a.unlock();
  CHECK_FALSE(fs::exists(lock));
  CHECK(b.try_lock());
  b.unlock();
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator{}) == 0);  // nothing left behind
}

TEST_CASE("Windows dot_lock: a holder that was terminated is broken at once on proof, but not a live one nor one of another computer") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck";
  {
    holder other{dir, lock};
    dibs::dot_lock l{lock, patient()};
    CHECK_FALSE(l.try_lock());  // alive: no proof, and its file is fresh
    CHECK_FALSE(l.try_lock_for(300ms));
    CHECK(slurp(lock).rfind(fmt::format("{}\n", other.proc.pi.dwProcessId), 0) == 0);
    other.proc.kill();
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(l.try_lock());  // gone: broken at once, 60 s before its age would
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
    CHECK(slurp(lock).rfind(fmt::format("{}\n", ::GetCurrentProcessId()), 0) == 0);
    l.unlock();
  }
  dead_process dead;
  auto elsewhere = dead.owner;
  elsewhere.host = "OTHER-PC";  // the same id on another computer proves nothing here
  write_text(lock, record_of(elsewhere));
  dibs::dot_lock l{lock, patient()};
  CHECK_FALSE(l.try_lock());
  CHECK(slurp(lock) == record_of(elsewhere));
  auto other_boot = dead.owner;
  other_boot.boot = "boot-time 1";
  write_text(lock, record_of(other_boot));
  CHECK_FALSE(l.try_lock());
  write_text(lock, record_of(dead.owner));  // the same record of this computer and boot: proof
  CHECK(l.try_lock());
  l.unlock();
}

TEST_CASE("Windows dot_lock: foreign and half-written lock files are held until their last write time is older than stale_after") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck";
  dead_process dead;
  const std::string whole = record_of(dead.owner);
  const std::vector<std::string> contents{
      "",                                                // just made with CREATE_NEW, nothing written yet
      dibs::detail::host_name() + " \r\n",               // a batch file's `echo %COMPUTERNAME% > job.lck`
      whole.substr(0, whole.find("lease_ms")),           // a dead holder's record, cut before its last line
      whole.substr(0, whole.find("start") + 7),          // cut inside its start time
  };
  dibs::dot_lock l{lock, patient()};
  for (const auto& text : contents) {
    INFO("content: " << text);
    write_text(lock, text);
    CHECK_FALSE(l.try_lock());  // fresh: held, whatever it says
    CHECK(slurp(lock) == text);
    age_file(lock, 30s);
    CHECK_FALSE(l.try_lock());  // younger than stale_after
    age_file(lock, 61s);
    CHECK(l.try_lock());  // older: stale by age
    l.unlock();
  }
}

TEST_CASE("Windows dot_lock: a live holder touches its file, so age never breaks it") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck";
  dibs::dot_lock_options quick = patient();
  quick.stale_after = 300ms;
  dibs::dot_lock a{lock, quick}, b{lock, quick};
  REQUIRE(a.try_lock());
  CHECK_FALSE(b.try_lock_for(1500ms));  // five times stale_after: touched every 100 ms
  CHECK(a.still_held());
  a.unlock();
}

TEST_CASE("Windows dot_lock: 8 waiters break one dead holder's lock together, and exactly one of them holds it, in each of 20 rounds") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck";
  dead_process dead;
  constexpr int waiters = 8, rounds = 20;
  std::vector<std::unique_ptr<dibs::dot_lock>> locks;
  for (int i = 0; i < waiters; ++i) locks.push_back(std::make_unique<dibs::dot_lock>(lock, patient()));
  int exactly_one = 0;
  for (int r = 0; r < rounds; ++r) {
    write_text(lock, record_of(dead.owner));
    std::atomic<int> holders{0};
    std::barrier start{waiters};
    std::vector<std::thread> threads;
    for (int i = 0; i < waiters; ++i)
      threads.emplace_back([&, i] {
        start.arrive_and_wait();
        if (locks[static_cast<std::size_t>(i)]->try_lock()) ++holders;
      });
    for (auto& t : threads) t.join();
    exactly_one += holders == 1;
    for (auto& l : locks) l->unlock();  // only the holder's removes a file
    CHECK_FALSE(fs::exists(lock));
  }
  CHECK(exactly_one == rounds);
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator{}) == 0);  // no .broken. file left
}

TEST_CASE("Windows dot_lock: 4 processes count under the lock while holders are terminated, every dead holder's lock is broken on proof, no increment lost or doubled", "[chaos]") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck", counter = dir.path / "counter", journal = dir.path / "journal";
  write_text(counter, fmt::format("{:019}\r\n", 0));
  constexpr int workers = 4, holder_kills = 20, rounds = 30;
  std::vector<std::unique_ptr<child>> running(workers);
  auto start = [&](int slot) {
    running[static_cast<std::size_t>(slot)] = std::make_unique<child>(std::vector<std::wstring>{
        L"--dot-count", lock.wstring(), counter.wstring(), journal.wstring(), std::to_wstring(rounds)});
  };
  for (int w = 0; w < workers; ++w) start(w);
  std::mt19937 rng{std::random_device{}()};
  int killed = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (killed < holder_kills && std::chrono::steady_clock::now() - t0 < 90s) {
    std::this_thread::sleep_for(std::chrono::milliseconds{5 + rng() % 30});
    // The holder named in the lock file, if it is one of ours: killed holding.
    long pid = 0;
    std::istringstream{slurp(lock)} >> pid;
    for (int w = 0; w < workers; ++w) {
      auto& c = running[static_cast<std::size_t>(w)];
      if (pid == 0 || static_cast<long>(c->pi.dwProcessId) != pid) continue;
      c->kill();
      ++killed;
      start(w);
      break;
    }
  }
  for (auto& c : running) CHECK(c->wait(120s) == DWORD{0});
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  const auto numbers = journal_numbers(journal);
  const long long value = read_number(counter);
  std::set<long long> distinct(numbers.begin(), numbers.end());
  bool increasing = true;
  for (std::size_t i = 1; i < numbers.size(); ++i) increasing = increasing && numbers[i] > numbers[i - 1];
  INFO("journal " << numbers.size() << " lines, counter " << value << ", holders killed " << killed << ", "
                  << std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count() << " ms");
  CHECK(killed == holder_kills);
  CHECK(distinct.size() == numbers.size());  // no number written twice: never two holders
  CHECK(increasing);
  CHECK(numbers.size() >= static_cast<std::size_t>(workers * rounds));  // the last 4 workers ran to the end
  REQUIRE_FALSE(numbers.empty());
  CHECK(value == numbers.back());  // the last increment is in the journal
  // A holder killed after writing the counter and before its journal line
  // leaves one number out: at most one per kill.
  CHECK(value - static_cast<long long>(numbers.size()) >= 0);
  CHECK(value - static_cast<long long>(numbers.size()) <= killed);
  // Each dead holder's lock broken on proof: one break that waited for
  // stale_after (10 minutes) would alone take longer than this whole run.
  CHECK(elapsed < std::chrono::minutes{10});
}

// The batch loop of the tests: takes job.lck with `if exist` + `echo
// %COMPUTERNAME% > job.lck`, as batch jobs do, then reads it back: the echo
// fails (sharing violation) while a dot_lock holds the file, and then the
// file does not say this computer's name. Under the lock it increments the
// counter (its `ping` keeps it inside for a while); `%2` rounds. With
// `%3` = plain it does not read back: the common form, which enters even
// when its echo failed.
constexpr const char* batch_loop = R"(@echo off
set D=%~1
set N=0
:next
if %N% geq %~2 goto end
:wait
if exist "%D%\job.lck" goto wait
echo %COMPUTERNAME% > "%D%\job.lck"
if "%~3"=="plain" goto held
set who=
set /p who=<"%D%\job.lck"
set who=%who: =%
if /i not "%who%"=="%COMPUTERNAME%" goto wait
:held
if exist "%D%\inside" echo overlap>> "%D%\overlaps"
echo batch> "%D%\inside"
ping -n 1 127.0.0.1 > nul
set v=0
set /p v=<"%D%\counter"
set /a v=v+1
>"%D%\counter" echo %v%
del "%D%\inside"
del "%D%\job.lck"
set /a N=N+1
goto next
:end
)";

TEST_CASE("Windows dot_lock: a batch file's `if exist` + `echo %COMPUTERNAME% > job.lck` lock is never broken while fresh, and the batch waits while dot_lock holds") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck", script = dir.path / "hold.bat";
  // A batch that takes the lock, says so, and holds until told to let go.
  write_text(script, "@echo off\r\n"
                     ":wait\r\nif exist \"%~1\\job.lck\" goto wait\r\n"
                     "echo %COMPUTERNAME% > \"%~1\\job.lck\"\r\n"
                     "echo in> \"%~1\\entered\"\r\n"
                     ":hold\r\nif not exist \"%~1\\release\" goto hold\r\n"
                     "del \"%~1\\job.lck\"\r\n");
  dibs::dot_lock l{lock, patient()};
  {
    batch b{script, {dir.path.wstring()}};
    REQUIRE(wait_for_file(dir.path / "entered"));
    const auto theirs = slurp(lock);
    CHECK(theirs.find(dibs::detail::host_name()) == 0);
    CHECK_FALSE(l.try_lock_for(500ms));  // a foreign lock, fresh: held
    CHECK(slurp(lock) == theirs);
    write_text(dir.path / "release", "go\r\n");
    CHECK(b.wait() == DWORD{0});
    CHECK(l.try_lock_for(5s));
  }
  // Now dot_lock holds: the batch waits in `if exist` until it lets go.
  fs::remove(dir.path / "entered");
  fs::remove(dir.path / "release");
  batch b{script, {dir.path.wstring()}};
  std::this_thread::sleep_for(1s);
  CHECK_FALSE(fs::exists(dir.path / "entered"));
  CHECK(l.still_held());
  l.unlock();
  CHECK(wait_for_file(dir.path / "entered"));
  write_text(dir.path / "release", "go\r\n");
  CHECK(b.wait() == DWORD{0});
}

TEST_CASE("Windows dot_lock: a batch loop that reads its lock back and dot_lock processes exclude each other, no increment lost") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck", counter = dir.path / "counter", script = dir.path / "loop.bat";
  write_text(script, batch_loop);
  write_text(counter, "0\r\n");
  constexpr int batch_rounds = 40, dibs_rounds = 40;
  batch b{script, {dir.path.wstring(), std::to_wstring(batch_rounds), L"checked"}};
  // The dot_lock side: the same critical section, in this process's threads.
  std::atomic<int> dibs_overlaps{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&] {
      dibs::dot_lock l{lock, patient()};
      for (int i = 0; i < dibs_rounds; ++i) {
        std::lock_guard g{l};
        const auto inside = dir.path / "inside";
        dibs::detail::unique_handle m{::CreateFileW(inside.c_str(), GENERIC_WRITE, FILE_SHARE_READ | FILE_SHARE_DELETE,
                                                    nullptr, CREATE_NEW, 0, nullptr)};
        if (!m) ++dibs_overlaps;
        long long v = 0;
        std::istringstream{slurp(counter)} >> v;
        ::Sleep(2);
        write_text(counter, fmt::format("{}\r\n", v + 1));
        ::DeleteFileW(inside.c_str());
        m.reset();
        std::this_thread::sleep_for(std::chrono::milliseconds{i % 3});  // let the batch in between
      }
    });
  for (auto& t : threads) t.join();
  CHECK(b.wait(120s) == DWORD{0});
  long long value = 0;
  std::istringstream{slurp(counter)} >> value;
  CHECK(dibs_overlaps == 0);
  CHECK_FALSE(fs::exists(dir.path / "overlaps"));
  CHECK(value == batch_rounds + 2 * dibs_rounds);
}

TEST_CASE("Windows dot_lock: a batch file's `echo > job.lck` over a held lock fails and leaves the record whole") {
  // What the common batch form cannot give: it enters even when its echo
  // failed; what dot_lock keeps: its record (no write sharing), so waiters
  // still judge its holder by proof.
  temp_dir dir;
  const auto lock = dir.path / "job.lck", script = dir.path / "clobber.bat";
  write_text(script, "@echo off\r\necho %COMPUTERNAME% > \"%~1\\job.lck\"\r\necho done> \"%~1\\done\"\r\n");
  dibs::dot_lock l{lock, patient()};
  REQUIRE(l.try_lock());
  const auto mine = slurp(lock);
  batch b{script, {dir.path.wstring()}};
  CHECK(b.wait() == DWORD{0});
  CHECK(fs::exists(dir.path / "done"));  // it ran on past the failed echo
  CHECK(slurp(lock) == mine);
  CHECK(l.still_held());
  l.unlock();
}

TEST_CASE("Windows dot_lock: a missing directory, a directory as lock file and a file as directory are errors that name the path") {
  temp_dir dir;
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const std::system_error& e) {
      return e.what();
    }
    return "";
  };
  const auto missing = dir.path / "no-such-dir" / "job.lck";
  const auto m1 = message([&] { dibs::dot_lock l{missing}; });
  CHECK(m1.find(dibs::detail::path_text(missing)) != std::string::npos);
  CHECK(m1.find("does the directory exist?") != std::string::npos);

  fs::create_directories(dir.path / "adir");
  dibs::dot_lock d{dir.path / "adir", patient()};
  const auto m2 = message([&] { (void)d.try_lock(); });
  CHECK(m2.find(dibs::detail::path_text(dir.path / "adir")) != std::string::npos);
  CHECK(m2.find("not a regular file (a directory)") != std::string::npos);
  CHECK(fs::is_directory(dir.path / "adir"));

  write_text(dir.path / "afile", "x");
  const auto m3 = message([&] { dibs::dot_lock l{dir.path / "afile" / "job.lck"}; });
  CHECK(m3.find(dibs::detail::path_text(dir.path / "afile" / "job.lck")) != std::string::npos);
  CHECK(m3.find("is a file, not a directory") != std::string::npos);
}

TEST_CASE("Windows dot_lock: unlock leaves a lock that is not its own: its own file moved away, and a lock made since at the path") {
  temp_dir dir;
  const auto lock = dir.path / "job.lck", moved = dir.path / "job.lck.moved";
  dibs::dot_lock l{lock, patient()};
  REQUIRE(l.try_lock());
  // What a breaker does to a stale lock, and another process after it.
  REQUIRE(::MoveFileExW(lock.c_str(), moved.c_str(), 0));
  write_text(lock, "4242\r\n");
  CHECK_FALSE(l.still_held());
  l.unlock();
  CHECK(slurp(lock) == "4242\r\n");
  CHECK(fs::exists(moved));  // a breaker's to remove (or a person's, see dot_lock.hpp)
}

}  // namespace dot_lock_win_test
