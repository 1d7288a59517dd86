// dibs.exe (tools/dibs.cpp, tools/platform/win32.hpp) under Wine: exit
// codes as on Linux, the locks excluding processes (exact counts), claim,
// retry, status, and COMMAND's arguments arriving as given. dibs.exe is
// started with CreateProcessW; its COMMAND is this test program in a role.
#include "win_support.hpp"

#include <dibs/dot_lock.hpp>
#include <dibs/file_mutex.hpp>
#include <dibs/lock_file.hpp>

#include <shellapi.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <sstream>

namespace dibs_exe_win_test {
namespace {

using win_test::temp_dir;

std::wstring widen(const std::string& s) {
  const int n = ::MultiByteToWideChar(CP_UTF8, 0, s.data(), static_cast<int>(s.size()), nullptr, 0);
  std::wstring w(static_cast<std::size_t>(n), L'\0');
  ::MultiByteToWideChar(CP_UTF8, 0, s.data(), static_cast<int>(s.size()), w.data(), n);
  return w;
}

std::string narrow(const std::wstring& w) {
  const int n = ::WideCharToMultiByte(CP_UTF8, 0, w.data(), static_cast<int>(w.size()), nullptr, 0, nullptr, nullptr);
  std::string s(static_cast<std::size_t>(n), '\0');
  ::WideCharToMultiByte(CP_UTF8, 0, w.data(), static_cast<int>(w.size()), s.data(), n, nullptr, nullptr);
  return s;
}

// The quoting of the C runtime's parser, written here from its rules
// (backslashes count only before a quote), not taken from dibs.
std::wstring quote(const std::wstring& a) {
  if (!a.empty() && a.find_first_of(L" \t\"") == std::wstring::npos) return a;
  std::wstring out = L"\"";
  std::size_t slashes = 0;
  for (const wchar_t c : a) {
    if (c == L'\\') {
      ++slashes;
      continue;
    }
    out.append(c == L'"' ? slashes * 2 + 1 : slashes, L'\\');
    slashes = 0;
    out += c;
  }
  out.append(slashes * 2, L'\\');
  return out + L"\"";
}

fs::path self_path() {
  wchar_t buf[MAX_PATH * 4];
  const DWORD n = ::GetModuleFileNameW(nullptr, buf, static_cast<DWORD>(std::size(buf)));
  return fs::path{std::wstring(buf, n)};
}

// dibs.exe: DIBS_EXE, or where the build puts it (build/windows/tools).
fs::path dibs_exe() {
  if (const wchar_t* e = ::_wgetenv(L"DIBS_EXE"); e && *e) return e;
  return self_path().parent_path().parent_path().parent_path() / "tools" / "dibs.exe";
}

std::string u8(const fs::path& p) {
  const auto s = p.u8string();
  return {s.begin(), s.end()};
}

// dibs.exe started with `args`, its standard output and error in files.
struct dibs_run {
  PROCESS_INFORMATION pi{};
  fs::path out, err;
  // `in`: a file for its standard input (else this program's).
  dibs_run(const std::vector<std::string>& args, const fs::path& dir, const fs::path& in = {}) {
    static int n = 0;
    const int k = ++n;
    out = dir / ("out" + std::to_string(k) + ".txt");
    err = dir / ("err" + std::to_string(k) + ".txt");
    std::wstring line = L"\"" + dibs_exe().wstring() + L"\"";
    for (const auto& a : args) line += L" " + quote(widen(a));
    SECURITY_ATTRIBUTES sa{sizeof sa, nullptr, TRUE};
    const HANDLE o = ::CreateFileW(out.c_str(), GENERIC_WRITE, FILE_SHARE_READ, &sa, CREATE_ALWAYS, 0, nullptr);
    const HANDLE e = ::CreateFileW(err.c_str(), GENERIC_WRITE, FILE_SHARE_READ, &sa, CREATE_ALWAYS, 0, nullptr);
    const HANDLE i = in.empty() ? nullptr
                                : ::CreateFileW(in.c_str(), GENERIC_READ, FILE_SHARE_READ, &sa, OPEN_EXISTING, 0, nullptr);
    REQUIRE(o != INVALID_HANDLE_VALUE);
    REQUIRE(e != INVALID_HANDLE_VALUE);
    REQUIRE(i != INVALID_HANDLE_VALUE);
    STARTUPINFOW si{};
    si.cb = sizeof si;
    si.dwFlags = STARTF_USESTDHANDLES;
    si.hStdInput = i ? i : ::GetStdHandle(STD_INPUT_HANDLE);
    si.hStdOutput = o;
    si.hStdError = e;
    const BOOL ok = ::CreateProcessW(nullptr, line.data(), nullptr, nullptr, TRUE, 0, nullptr, nullptr, &si, &pi);
    ::CloseHandle(o);
    ::CloseHandle(e);
    if (i) ::CloseHandle(i);
    REQUIRE(ok);
  }
  dibs_run(const dibs_run&) = delete;
  dibs_run& operator=(const dibs_run&) = delete;
  ~dibs_run() {
    ::TerminateProcess(pi.hProcess, 9);
    ::WaitForSingleObject(pi.hProcess, 10'000);
    ::CloseHandle(pi.hProcess);
    ::CloseHandle(pi.hThread);
  }
  // Returns: the exit code (REQUIREs an end within `limit`).
  int wait(std::chrono::milliseconds limit = 30s) {
    REQUIRE(::WaitForSingleObject(pi.hProcess, static_cast<DWORD>(limit.count())) == WAIT_OBJECT_0);
    DWORD code = 0;
    ::GetExitCodeProcess(pi.hProcess, &code);
    return static_cast<int>(code);
  }
  static std::string text(const fs::path& p) {
    std::ifstream in{p, std::ios::binary};
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  std::string out_text() const { return text(out); }
  std::string err_text() const { return text(err); }
};

// Runs dibs.exe to its end. Returns: its exit code; `*out`, `*err` what it printed.
int run_dibs(const std::vector<std::string>& args, const fs::path& dir, std::string* out = nullptr, std::string* err = nullptr) {
  dibs_run r{args, dir};
  const int code = r.wait();
  if (out) *out = r.out_text();
  if (err) *err = r.err_text();
  INFO(r.err_text());
  return code;
}

// COMMAND: this test program in a role.
std::vector<std::string> self(std::vector<std::string> role_args) {
  role_args.insert(role_args.begin(), u8(self_path()));
  return role_args;
}

std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

long read_number(const fs::path& p) {
  std::ifstream in{p};
  long n = 0;
  in >> n;
  return n;
}

// Roles. --dibs-exit CODE: exits CODE.
const win_test::register_role exit_role{"--dibs-exit", [](int, char** argv) { return std::atoi(argv[0]); }};

// --dibs-argv FILE ARGS...: writes the arguments it got, as the C runtime
// parses its command line, one a line, and DIBS_TOKEN on the last.
const win_test::register_role argv_role{"--dibs-argv", [](int, char**) {
  int n = 0;
  wchar_t** w = ::CommandLineToArgvW(::GetCommandLineW(), &n);
  std::ofstream out{fs::path{w[2]}, std::ios::binary};
  for (int i = 3; i < n; ++i) out << narrow(w[i]) << '\n';
  const wchar_t* token = ::_wgetenv(L"DIBS_TOKEN");
  out << "token=" << (token ? narrow(token) : std::string{"none"}) << '\n';
  return 0;
}};

// --dibs-count FILE N: adds 1 to the number in FILE N times, each a read,
// a pause and a write: two at once lose increments.
const win_test::register_role count_role{"--dibs-count", [](int, char** argv) {
  const fs::path file{argv[0]};
  const int times = std::atoi(argv[1]);
  for (int i = 0; i < times; ++i) {
    const long v = read_number(file);
    std::this_thread::sleep_for(1ms);
    std::ofstream{file, std::ios::trunc} << v + 1;
  }
  return 0;
}};

// --dibs-claimed FILE: appends a line to FILE, then stays 1.5 s (so that a
// rival claim meets the item held).
const win_test::register_role claimed_role{"--dibs-claimed", [](int, char** argv) {
  std::ofstream{fs::path{argv[0]}, std::ios::app} << "ran\n";
  std::this_thread::sleep_for(1500ms);
  return 0;
}};

// --dibs-fail-until FILE N CODE: counts its runs in FILE; exits CODE until
// run N, then 0.
const win_test::register_role fail_until_role{"--dibs-fail-until", [](int, char** argv) {
  const fs::path file{argv[0]};
  const long runs = read_number(file) + 1;
  std::ofstream{file, std::ios::trunc} << runs;
  return runs >= std::atol(argv[1]) ? 0 : std::atoi(argv[2]);
}};

// --dibs-hold PIDFILE: writes its pid, then waits 60 s.
const win_test::register_role hold_role{"--dibs-hold", [](int, char** argv) {
  std::ofstream{fs::path{argv[0]}} << ::GetCurrentProcessId();
  std::this_thread::sleep_for(60s);
  return 0;
}};

}  // namespace

TEST_CASE("dibs.exe lock: exit codes as on Linux (COMMAND's own and conflict and usage and not found)", "[dibs_exe]") {
  temp_dir d;
  const std::string lk = u8(d.path / "a.lock");
  CHECK(run_dibs(cat({"lock", lk, "--"}, self({"--dibs-exit", "7"})), d.path) == 7);
  CHECK(run_dibs(cat({"lock", lk, "--"}, self({"--dibs-exit", "0"})), d.path) == 0);
  CHECK(run_dibs(cat({"lock", "--kernel", lk, "--"}, self({"--dibs-exit", "42"})), d.path) == 42);
  CHECK(run_dibs(cat({"lock", "--dot", u8(d.path / "d.lock"), "--"}, self({"--dibs-exit", "3"})), d.path) == 3);
  std::string err;
  CHECK(run_dibs({"lock", lk, "--", "no-such-program-dibs"}, d.path, nullptr, &err) == 127);
  CHECK(err.find("no-such-program-dibs") != std::string::npos);
  CHECK(run_dibs({"lock", lk}, d.path, nullptr, &err) == 64);
  CHECK(err.find("no COMMAND") != std::string::npos);
  CHECK(run_dibs({"lock", "--bogus", lk, "--", "x"}, d.path) == 64);
  CHECK(run_dibs({"lock", "--kernel", "9"}, d.path, nullptr, &err) == 64);  // the descriptor form: no meaning on Windows
  CHECK(err.find("descriptor") != std::string::npos);
  CHECK(run_dibs({"lock", "--kernel", "-F", lk, "--", "x"}, d.path) == 64);

  // Held by this process: -n, -w and -E as on Linux, COMMAND not run.
  const fs::path ran = d.path / "ran";
  {
    dibs::lock_file held{d.path / "a.lock"};
    REQUIRE(held.try_lock());
    // Silent on a conflict, as flock(1) (cron mails whatever a skipped run
    // prints); --verbose names the holder.
    CHECK(run_dibs(cat({"lock", "-n", lk, "--"}, self({"--dibs-count", u8(ran), "1"})), d.path, nullptr, &err) == 1);
    CHECK(err.empty());
    CHECK(run_dibs(cat({"lock", "--verbose", "-n", lk, "--"}, self({"--dibs-count", u8(ran), "1"})), d.path, nullptr,
                   &err) == 1);
    CHECK(err.find("is held") != std::string::npos);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(run_dibs(cat({"lock", "-w", "700ms", "-E", "9", lk, "--"}, self({"--dibs-count", u8(ran), "1"})), d.path) == 9);
    CHECK(std::chrono::steady_clock::now() - t0 >= 700ms);
    held.unlock();
  }
  {
    dibs::file_mutex held{d.path / "k.lock"};
    REQUIRE(held.try_lock());
    CHECK(run_dibs(cat({"lock", "--kernel", "-w", "300ms", u8(d.path / "k.lock"), "--"}, self({"--dibs-count", u8(ran), "1"})),
               d.path) == 1);
    held.unlock();
  }
  {
    dibs::dot_lock held{d.path / "d.lock"};
    REQUIRE(held.try_lock());
    CHECK(run_dibs(cat({"lock", "--dot", "-r", "1", "-i", "100ms", u8(d.path / "d.lock"), "--"},
                   self({"--dibs-count", u8(ran), "1"})),
               d.path) == 1);
    held.unlock();
  }
  CHECK(!fs::exists(ran));
}

TEST_CASE("dibs.exe lock: COMMAND's arguments arrive as given (spaces and quotes and backslashes) with DIBS_TOKEN",
          "[dibs_exe]") {
  temp_dir d;
  const fs::path got = d.path / "argv.txt";
  const std::vector<std::string> args{"plain",       "two words",   "",          "q\"uote",  "\"",          "back\\slash",
                                      "trail\\",     "trail two\\", "\\\\server\\share", "a\\\"b", "a\\\\\"b c", "tab\there",
                                      "ends\\\\",    "{}",          "%PATH%",    "&|<>^",    "caf\xc3\xa9"};
  REQUIRE(run_dibs(cat({"lock", u8(d.path / "a.lock"), "--"}, self(cat({"--dibs-argv", u8(got)}, args))), d.path) == 0);
  std::ifstream in{got, std::ios::binary};
  std::vector<std::string> back;
  for (std::string l; std::getline(in, l);) back.push_back(l);
  REQUIRE(back.size() == args.size() + 1);
  for (std::size_t i = 0; i < args.size(); ++i) CHECK(back[i] == args[i]);
  CHECK(back.back().rfind("token=", 0) == 0);
  CHECK(back.back() != "token=none");  // the lease lock's fencing token

  // The kernel lock has no token: a DIBS_TOKEN of dibs's own caller is not passed on.
  ::SetEnvironmentVariableW(L"DIBS_TOKEN", L"999");
  REQUIRE(run_dibs(cat({"lock", "--kernel", u8(d.path / "k.lock"), "--"}, self({"--dibs-argv", u8(got), "x y"})), d.path) == 0);
  ::SetEnvironmentVariableW(L"DIBS_TOKEN", nullptr);
  std::ifstream in2{got, std::ios::binary};
  std::string a, t;
  std::getline(in2, a);
  std::getline(in2, t);
  CHECK(a == "x y");
  CHECK(t == "token=none");

  // -c STRING: run by cmd.exe as written.
  std::string out;
  CHECK(run_dibs({"lock", u8(d.path / "a.lock"), "-c", "echo one  two& exit 5"}, d.path, &out) == 5);
  CHECK(out.find("one  two") != std::string::npos);
}

namespace {

// 4 dibs.exe at once, each running a COMMAND that counts 40 times in one
// file under `lock_opts`. Returns: the count.
long count_under(const std::vector<std::string>& lock_opts, const temp_dir& d, const fs::path& lock) {
  const fs::path counter = d.path / "counter";
  std::ofstream{counter} << 0;
  std::vector<std::unique_ptr<dibs_run>> runs;
  for (int i = 0; i < 4; ++i)
    runs.push_back(std::make_unique<dibs_run>(
        cat(cat(cat({"lock"}, lock_opts), {u8(lock), "--"}), self({"--dibs-count", u8(counter), "40"})), d.path));
  for (auto& r : runs) {
    INFO(r->err_text());
    CHECK(r->wait(60s) == 0);
  }
  return read_number(counter);
}

}  // namespace

TEST_CASE("dibs.exe lock: 4 processes counting under each lock lose no increment", "[dibs_exe]") {
  temp_dir d;
  CHECK(count_under({"--kernel"}, d, d.path / "k.lock") == 160);
  CHECK(count_under({"--kernel", "-w", "60s"}, d, d.path / "k.lock") == 160);
  CHECK(count_under({}, d, d.path / "lease.lock") == 160);
  CHECK(count_under({"--dot", "-i", "20ms"}, d, d.path / "dot.lock") == 160);
}

TEST_CASE("dibs.exe lock: COMMAND ends when dibs is killed and the lock is free again", "[dibs_exe]") {
  temp_dir d;
  const fs::path pid_file = d.path / "pid";
  const std::string lk = u8(d.path / "a.lock");
  for (const bool kernel : {false, true}) {
    fs::remove(pid_file);
    auto opts = kernel ? std::vector<std::string>{"lock", "--kernel", lk, "--"} : std::vector<std::string>{"lock", lk, "--"};
    dibs_run holder{cat(opts, self({"--dibs-hold", u8(pid_file)})), d.path};
    REQUIRE(win_test::wait_for_file(pid_file));
    std::this_thread::sleep_for(100ms);
    const DWORD pid = static_cast<DWORD>(read_number(pid_file));
    REQUIRE(pid != 0);
    const HANDLE command = ::OpenProcess(SYNCHRONIZE, FALSE, pid);
    REQUIRE(command);
    CHECK(run_dibs(cat(cat({"lock", "-n"}, kernel ? std::vector<std::string>{"--kernel"} : std::vector<std::string>{}),
                   {lk, "--", "cmd", "/c", "exit 0"}),
               d.path) == 1);
    ::TerminateProcess(holder.pi.hProcess, 9);
    // The kill-on-close job ends COMMAND with dibs.
    CHECK(::WaitForSingleObject(command, 10'000) == WAIT_OBJECT_0);
    ::CloseHandle(command);
    CHECK(run_dibs(cat(cat({"lock", "-n"}, kernel ? std::vector<std::string>{"--kernel"} : std::vector<std::string>{}),
                   cat({lk, "--"}, self({"--dibs-exit", "0"}))),
               d.path) == 0);  // its holder is gone: taken at once
  }
}

TEST_CASE("dibs.exe claim: two processes claim one key and exactly one runs (exit codes as on Linux)", "[dibs_exe]") {
  temp_dir d;
  const std::string store = "dir:" + u8(d.path);
  fs::create_directories(d.path / "runs");
  const fs::path ran = d.path / "runs" / "ran";
  dibs_run a{cat({"claim", store, "job-1", "--"}, self({"--dibs-claimed", u8(ran)})), d.path};
  dibs_run b{cat({"claim", store, "job-1", "--"}, self({"--dibs-claimed", u8(ran)})), d.path};
  const int ca = a.wait(), cb = b.wait();
  CHECK(std::multiset<int>{ca, cb} == std::multiset<int>{0, 11});
  CHECK(win_test::lines(ran) == 1);
  std::string err;
  CHECK(run_dibs(cat({"claim", store, "job-1", "--"}, self({"--dibs-claimed", u8(ran)})), d.path, nullptr, &err) == 10);
  CHECK(err.find("already completed") != std::string::npos);
  CHECK(win_test::lines(ran) == 1);
  // A failing COMMAND: its code, then failed for good (12) after --max-attempts.
  CHECK(run_dibs(cat({"claim", "--max-attempts", "1", store, "job-2", "--"}, self({"--dibs-exit", "4"})), d.path) == 4);
  CHECK(run_dibs(cat({"claim", store, "job-2", "--"}, self({"--dibs-exit", "0"})), d.path) == 12);
  CHECK(run_dibs(cat({"claim", "--exit-base", "200", store, "job-1", "--"}, self({"--dibs-exit", "0"})), d.path) == 200);
  CHECK(run_dibs(cat({"claim", "--next", "none/", store, "--"}, self({"--dibs-exit", "0"})), d.path) == 14);
  CHECK(run_dibs({"claim", "nosuch:x", "k", "--", "cmd"}, d.path) == 64);
  CHECK(run_dibs({"claim", "dir:" + u8(d.path / "missing"), "k", "--", "cmd"}, d.path) == 66);

  std::string out;
  REQUIRE(run_dibs({"status", store}, d.path, &out) == 0);
  CHECK(out.find("job-1") != std::string::npos);
  CHECK(out.find("2 item(s): 1 completed, 1 failed") != std::string::npos);
  REQUIRE(run_dibs({"status", "--json", store}, d.path, &out) == 0);
  CHECK(out.find("\"key\": \"job-2\", \"state\": \"failed\"") != std::string::npos);
}

TEST_CASE("dibs.exe retry: a COMMAND failing twice then succeeding (exit codes)", "[dibs_exe]") {
  temp_dir d;
  const fs::path runs = d.path / "runs";
  CHECK(run_dibs(cat({"retry", "--initial", "10ms", "--"}, self({"--dibs-fail-until", u8(runs), "3", "75"})), d.path) == 0);
  CHECK(read_number(runs) == 3);
  fs::remove(runs);
  CHECK(run_dibs(cat({"retry", "-a", "2", "--initial", "10ms", "--"}, self({"--dibs-fail-until", u8(runs), "3", "75"})), d.path) == 75);
  CHECK(read_number(runs) == 2);
  fs::remove(runs);
  CHECK(run_dibs(cat({"retry", "--initial", "10ms", "--"}, self({"--dibs-fail-until", u8(runs), "3", "5"})), d.path) == 5);
  CHECK(read_number(runs) == 1);  // 5 is not transient: no retry
  fs::remove(runs);
  CHECK(run_dibs(cat({"retry", "--on", "5,75", "--initial", "10ms", "--"}, self({"--dibs-fail-until", u8(runs), "2", "5"})), d.path) == 0);
  CHECK(read_number(runs) == 2);
  CHECK(run_dibs({"retry", "--", "no-such-program-dibs"}, d.path) == 127);
  CHECK(run_dibs({"retry", "-a", "0", "--", "x"}, d.path) == 64);
}

TEST_CASE("dibs.exe status: a lock's holder (held: exit 0, free: 1) and a presence lock", "[dibs_exe]") {
  temp_dir d;
  const fs::path lk = d.path / "a.lock";
  std::string out, err;
  CHECK(run_dibs({"status", u8(lk)}, d.path, &out, &err) == 66);
  {
    dibs::lock_file held{lk};
    REQUIRE(held.try_lock());
    REQUIRE(run_dibs({"status", u8(lk)}, d.path, &out) == 0);
    CHECK(out.find("HOST") != std::string::npos);
    CHECK(out.find(" " + std::to_string(::GetCurrentProcessId()) + " ") != std::string::npos);
    CHECK(out.find("held") != std::string::npos);
    REQUIRE(run_dibs({"status", "--json", u8(lk)}, d.path, &out) == 0);
    CHECK(out.find("\"state\": \"held\"") != std::string::npos);
    CHECK(out.find("\"pid\": " + std::to_string(::GetCurrentProcessId())) != std::string::npos);
    held.unlock();
  }
  REQUIRE(run_dibs({"status", u8(lk)}, d.path, &out) == 1);  // free: exit 1 (held 0, expired 2)
  CHECK(out.find(": free") != std::string::npos);
  {
    dibs::dot_lock held{d.path / "d.lock"};
    REQUIRE(held.try_lock());
    const int code = run_dibs({"status", u8(d.path / "d.lock")}, d.path, &out, &err);
    INFO(err);
    REQUIRE(code == 0);
    CHECK(out.find("held: a presence lock (dibs lock --dot) of pid " + std::to_string(::GetCurrentProcessId())) !=
          std::string::npos);
    held.unlock();
  }
}

TEST_CASE("dibs.exe log: words joined and standard input line by line, 4 processes at once with every line once and whole, rotation, bad paths", "[dibs_exe]") {
  temp_dir d;
  const fs::path log = d.path / "a.log";
  CHECK(run_dibs({"log", u8(log), "hello", "wide world"}, d.path) == 0);
  CHECK(dibs_run::text(log) == "hello wide world\n");

  // 4 dibs.exe at once, each appending 300 lines of its standard input
  // (some over 4 KiB), started at once.
  constexpr int writers = 4, lines = 300;
  auto line_of = [](int w, int i) {
    return fmt::format("writer {} line {} {}", w, i, std::string(i % 50 == 0 ? 5000 : 40, static_cast<char>('a' + w)));
  };
  for (int w = 0; w < writers; ++w) {
    std::ofstream in{d.path / fmt::format("in{}.txt", w), std::ios::binary};
    for (int i = 0; i < lines; ++i) in << line_of(w, i) << "\n";
  }
  {
    std::vector<std::unique_ptr<dibs_run>> runs;
    for (int w = 0; w < writers; ++w)
      runs.push_back(std::make_unique<dibs_run>(std::vector<std::string>{"log", u8(d.path / "b.log")}, d.path,
                                                d.path / fmt::format("in{}.txt", w)));
    for (auto& r : runs) CHECK(r->wait(60s) == 0);
  }
  std::istringstream all{dibs_run::text(d.path / "b.log")};
  std::map<std::string, int> seen;
  std::vector<int> next(writers, 0);
  int bad = 0, out_of_order = 0;
  for (std::string l; std::getline(all, l);) {
    int w = -1, i = -1;
    if (std::sscanf(l.c_str(), "writer %d line %d", &w, &i) != 2 || w < 0 || w >= writers || i < 0 || i >= lines ||
        l != line_of(w, i)) {
      ++bad;  // torn, or two interleaved
      continue;
    }
    ++seen[l];
    if (i != next[static_cast<std::size_t>(w)]++) ++out_of_order;
  }
  CHECK(bad == 0);
  CHECK(out_of_order == 0);
  CHECK(seen.size() == static_cast<std::size_t>(writers * lines));
  CHECK(std::all_of(seen.begin(), seen.end(), [](const auto& e) { return e.second == 1; }));

  // Rotation by size, as on Linux: 40 runs of 30-byte lines at 100 bytes a file, 2 kept.
  for (int i = 1; i <= 40; ++i)
    REQUIRE(run_dibs({"log", "--rotate-size", "100", "--keep", "2", u8(d.path / "r.log"), fmt::format("line {:02} of the log", i)},
                     d.path) == 0);
  CHECK(fs::exists(d.path / "r.log.1"));
  CHECK(fs::exists(d.path / "r.log.2"));
  CHECK_FALSE(fs::exists(d.path / "r.log.3"));
  CHECK(dibs_run::text(d.path / "r.log").find("line 40 of the log") != std::string::npos);

  // A missing directory: 66, naming it, nothing made.
  std::string err;
  CHECK(run_dibs({"log", u8(d.path / "missing" / "x.log"), "text"}, d.path, nullptr, &err) == 66);
  CHECK(err.find("missing") != std::string::npos);
  CHECK_FALSE(fs::exists(d.path / "missing"));
}

}  // namespace dibs_exe_win_test
