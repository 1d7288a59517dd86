// The Windows tests' support: a temporary directory, this test program
// started again in a helper role (CreateProcessW; TerminateProcess is the
// SIGKILL analogue), and the registry of those roles, which main.cpp reads
// before Catch2 sees the arguments.
#pragma once

#include <catch2/catch.hpp>

#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace win_test {

/// A helper role: called with the arguments after its name.
using role_fn = int (*)(int argc, char** argv);

inline std::map<std::string, role_fn>& roles() {
  static std::map<std::string, role_fn> r;
  return r;
}

/// Registers a role at static initialization: `const register_role r{"--name", fn};`
struct register_role {
  register_role(const char* name, role_fn f) { roles()[name] = f; }
};

// A fresh directory under the temp directory, removed at the end.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("dibs-win-" + std::to_string(::GetCurrentProcessId()) + "-" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

inline bool wait_for_file(const fs::path& p, std::chrono::milliseconds limit = 20s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!fs::exists(p)) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// This program, started again in a helper role (its arguments are paths
// without quotes in them).
struct child {
  PROCESS_INFORMATION pi{};
  explicit child(const std::vector<std::wstring>& args) {
    wchar_t self[MAX_PATH * 4];
    const DWORD n = ::GetModuleFileNameW(nullptr, self, static_cast<DWORD>(std::size(self)));
    REQUIRE(n > 0);
    std::wstring cmd = L"\"" + std::wstring(self, n) + L"\"";
    for (const auto& a : args) cmd += L" \"" + a + L"\"";
    STARTUPINFOW si{};
    si.cb = sizeof si;
    REQUIRE(::CreateProcessW(nullptr, cmd.data(), nullptr, nullptr, FALSE, 0, nullptr, nullptr, &si, &pi));
  }
  child(const child&) = delete;
  child& operator=(const child&) = delete;
  ~child() {
    if (pi.hProcess) {
      ::TerminateProcess(pi.hProcess, 9);
      ::WaitForSingleObject(pi.hProcess, 10'000);
      ::CloseHandle(pi.hProcess);
      ::CloseHandle(pi.hThread);
    }
  }
  void kill() {
    ::TerminateProcess(pi.hProcess, 9);
    ::WaitForSingleObject(pi.hProcess, 10'000);
  }
  // Returns: the exit code, or nullopt if it runs on after `limit`.
  std::optional<DWORD> wait(std::chrono::milliseconds limit = 60s) {
    if (::WaitForSingleObject(pi.hProcess, static_cast<DWORD>(limit.count())) != WAIT_OBJECT_0) return std::nullopt;
    DWORD code = 0;
    ::GetExitCodeProcess(pi.hProcess, &code);
    return code;
  }
};

// Returns: a process id no process has now (ids are multiples of 4; one
// near the top of the range is free), or 0 if none was found.
inline long free_process_id() {
  for (long id = 0x3ffffffc; id > 0x3fff0000; id -= 4) {
    const HANDLE h = ::OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, static_cast<DWORD>(id));
    if (!h && ::GetLastError() == ERROR_INVALID_PARAMETER) return id;
    if (h) ::CloseHandle(h);
  }
  return 0;
}

// Returns: the number of non-empty lines of `p`.
inline std::size_t lines(const fs::path& p) {
  std::ifstream in{p};
  std::size_t n = 0;
  for (std::string l; std::getline(in, l);) n += !l.empty();
  return n;
}

// Runs a helper role's body; what it throws is printed and is exit code 99.
template <class F>
int guarded(const char* role, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", role, e.what());
    return 99;
  }
}

// Effects: `p` appears with `text` whole (written beside it, then renamed),
// so that a test or helper waiting for it never reads half of it.
inline void put(const fs::path& p, const std::string& text) {
  const auto tmp = fs::path{p}.concat(L".tmp");
  {
    std::ofstream out{tmp, std::ios::binary};
    out << text;
  }
  fs::rename(tmp, p);
}

// The text of `p`. Just after put() renames a file into place, Wine (and a
// scanner on Windows) can still hold the renamed file open with DELETE
// access for a moment, and an open for reading fails with a sharing
// violation: a file that exists but does not open yet is tried again (up to
// 30 s), never read as empty.
inline std::string get(const fs::path& p) {
  const auto until = std::chrono::steady_clock::now() + 30s;
  for (;;) {
    std::ifstream in{p, std::ios::binary};
    if (in.is_open()) return {std::istreambuf_iterator<char>{in}, {}};
    if (!fs::exists(p) || std::chrono::steady_clock::now() > until) return {};
    std::this_thread::sleep_for(5ms);
  }
}

inline std::vector<std::string> words(const std::string& s) {
  std::istringstream in{s};
  return {std::istream_iterator<std::string>{in}, {}};
}

}  // namespace win_test
