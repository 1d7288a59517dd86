// The shared_inbox demo's processes: this program started again in a role,
// asked to stop, or killed the way a crash kills (SIGKILL on POSIX,
// TerminateProcess on Windows). The demo's logic uses these and nothing of
// either system; each system's calls are below, once.
#pragma once

#ifdef _WIN32
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>

#include <io.h>
#include <process.h>
#else
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;
#endif

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace demo {

// How a worker is killed, as a crash would.
#ifdef _WIN32
inline constexpr const char* kill_name = "TerminateProcess";
#else
inline constexpr const char* kill_name = "SIGKILL";
#endif

// Set when the parent asks this process to stop (stop_signal::raise).
inline std::atomic<bool> stop_requested{false};

inline long current_process_id() {
#ifdef _WIN32
  return static_cast<long>(::GetCurrentProcessId());
#else
  return static_cast<long>(::getpid());
#endif
}

inline bool stdout_is_terminal() {
#ifdef _WIN32
  return ::_isatty(::_fileno(stdout)) != 0;
#else
  return ::isatty(STDOUT_FILENO) == 1;
#endif
}

// Returns: a new, empty directory under the system's temporary directory.
inline std::filesystem::path make_temp_directory(const std::string& prefix) {
  std::mt19937_64 rng(std::random_device{}());
  const auto base = std::filesystem::temp_directory_path();
  for (int attempt = 0; attempt < 100; ++attempt) {
    auto dir = base / fmt::format("{}{}-{:x}", prefix, current_process_id(), rng() & 0xffffff);
    if (std::filesystem::create_directory(dir)) return dir;  // throws with the path if it cannot
  }
  throw std::runtime_error(fmt::format("shared_inbox: no free directory name under '{}'", base.string()));
}

#ifdef _WIN32
namespace detail {
// Returns: `arg` quoted for CommandLineToArgvW and the C runtime: a backslash
// is literal unless a run of them precedes a quote, so such runs are doubled.
inline std::wstring quote(const std::wstring& arg) {
  if (!arg.empty() && arg.find_first_of(L" \t\n\v\"") == std::wstring::npos) return arg;
  std::wstring out = L"\"";
  for (std::size_t i = 0;; ++i) {
    std::size_t backslashes = 0;
    while (i < arg.size() && arg[i] == L'\\') ++i, ++backslashes;
    if (i == arg.size()) {
      out.append(backslashes * 2, L'\\');
      break;
    }
    if (arg[i] == L'"') out.append(backslashes * 2 + 1, L'\\');
    else out.append(backslashes, L'\\');
    out.push_back(arg[i]);
  }
  return out + L"\"";
}

inline std::wstring this_program() {
  std::wstring path(32'768, L'\0');
  const DWORD n = ::GetModuleFileNameW(nullptr, path.data(), static_cast<DWORD>(path.size()));
  if (n == 0 || n == path.size())
    throw std::system_error(static_cast<int>(::GetLastError()), std::system_category(),
                            "shared_inbox: cannot find this program's own path");
  path.resize(n);
  return path;
}

inline std::wstring stop_event_name(const std::string& run) {
  return std::filesystem::path("Local\\dibs-shared-inbox-" + run + "-stop").wstring();
}
}  // namespace detail

// A process of the demo, started by this program.
class process {
public:
  // Effects: starts this program again with `argv` (argv[0] is its name).
  explicit process(const std::vector<std::string>& argv) {
    std::wstring cmd = detail::quote(detail::this_program());
    for (std::size_t i = 1; i < argv.size(); ++i)
      cmd += L" " + detail::quote(std::filesystem::path(argv[i]).wstring());
    STARTUPINFOW si{};
    si.cb = sizeof si;
    PROCESS_INFORMATION pi{};
    std::fflush(nullptr);
    if (!::CreateProcessW(nullptr, cmd.data(), nullptr, nullptr, FALSE, 0, nullptr, nullptr, &si, &pi))
      throw std::system_error(static_cast<int>(::GetLastError()), std::system_category(),
                              "shared_inbox: cannot start a process");
    ::CloseHandle(pi.hThread);
    handle_ = pi.hProcess;
  }
  process(process&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  process& operator=(process&& o) noexcept {
    std::swap(handle_, o.handle_);
    return *this;
  }
  ~process() {
    if (handle_) ::CloseHandle(handle_);
  }

  // Returns: its exit code if it has ended.
  std::optional<int> try_wait() { return ended(0); }
  // Returns: its exit code, once it has ended.
  int wait() { return *ended(INFINITE); }
  // Effects: ends it at once, as a crash would, and waits for the end.
  void kill() {
    ::TerminateProcess(handle_, 137);
    wait();
  }

private:
  std::optional<int> ended(DWORD ms) {
    if (::WaitForSingleObject(handle_, ms) != WAIT_OBJECT_0) return std::nullopt;
    DWORD code = 0;
    ::GetExitCodeProcess(handle_, &code);
    return static_cast<int>(code);
  }
  HANDLE handle_ = nullptr;
};

// The parent's request to stop, which workers watch: a named event of the run.
class stop_signal {
public:
  explicit stop_signal(const std::string& run)
      : event_(::CreateEventW(nullptr, TRUE, FALSE, detail::stop_event_name(run).c_str())) {
    if (!event_)
      throw std::system_error(static_cast<int>(::GetLastError()), std::system_category(),
                              "shared_inbox: cannot create the stop event");
  }
  stop_signal(const stop_signal&) = delete;
  stop_signal& operator=(const stop_signal&) = delete;
  ~stop_signal() { ::CloseHandle(event_); }
  void raise(std::vector<process>&) { ::SetEvent(event_); }

private:
  HANDLE event_;
};

// Effects: sets stop_requested when the parent of run `run` raises its stop_signal.
inline void watch_for_stop(const std::string& run) {
  HANDLE event = ::OpenEventW(SYNCHRONIZE, FALSE, detail::stop_event_name(run).c_str());
  if (!event)
    throw std::system_error(static_cast<int>(::GetLastError()), std::system_category(),
                            "shared_inbox: cannot open the parent's stop event");
  std::thread([event] {
    ::WaitForSingleObject(event, INFINITE);
    stop_requested = true;
  }).detach();
}
#else
// A process of the demo, started by this program.
class process {
public:
  // Effects: starts this program again with `argv` (argv[0] is its name), by
  // exec: a database connection is never carried across fork().
  explicit process(const std::vector<std::string>& argv) {
    std::vector<char*> av;
    for (const auto& a : argv) av.push_back(const_cast<char*>(a.c_str()));
    av.push_back(nullptr);
    std::fflush(nullptr);
    const int rc = ::posix_spawn(&pid_, "/proc/self/exe", nullptr, nullptr, av.data(), environ);
    if (rc != 0) throw std::system_error(rc, std::generic_category(), "shared_inbox: cannot start a process");
  }
  process(process&& o) noexcept : pid_(std::exchange(o.pid_, 0)) {}
  process& operator=(process&& o) noexcept {
    std::swap(pid_, o.pid_);
    return *this;
  }
  ~process() = default;  // the parent waits for every process it started

  std::optional<int> try_wait() { return ended(WNOHANG); }
  int wait() { return *ended(0); }
  void kill() {
    ::kill(pid_, SIGKILL);
    wait();
  }
  void terminate() { ::kill(pid_, SIGTERM); }

private:
  std::optional<int> ended(int flags) {
    int status = 0;
    pid_t r;
    while ((r = ::waitpid(pid_, &status, flags)) < 0 && errno == EINTR) {
    }
    if (r != pid_) return std::nullopt;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  pid_t pid_ = 0;
};

// The parent's request to stop: SIGTERM to each worker.
class stop_signal {
public:
  explicit stop_signal(const std::string&) {}
  void raise(std::vector<process>& workers) {
    for (auto& w : workers) w.terminate();
  }
};

extern "C" {
inline void demo_on_term(int) { stop_requested = true; }
}

// Effects: sets stop_requested on SIGTERM.
inline void watch_for_stop(const std::string&) { std::signal(SIGTERM, demo_on_term); }
#endif

}  // namespace demo
