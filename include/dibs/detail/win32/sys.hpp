// dibs/detail/win32/sys.hpp: small helpers for Win32 calls, the twin of
// detail/posix/sys.hpp: errors that name the path and say what to check, a
// HANDLE that closes itself, long paths, this process's id and host name.
//
// Standard C++20 and the Win32 API only (no compiler extensions), so that
// MSVC builds it too; verified with mingw-w64 (g++ 12) under Wine 8.
#pragma once

#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>

#include <cstdint>
#include <ctime>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <fmt/format.h>

namespace dibs::detail {

/// Returns: the path as UTF-8, for messages (path::string() would go
/// through the ANSI code page, and throw on a name it cannot show).
inline std::string path_text(const std::filesystem::path& p) {
  const std::u8string u = p.u8string();
  return std::string(u.begin(), u.end());
}

/// Returns: the path of the file `name` (UTF-8, as dibs keeps names) in
/// `dir` (a std::string would be read in the ANSI code page).
inline std::filesystem::path child_path(const std::filesystem::path& dir, std::string_view name) {
  return dir / std::filesystem::path{std::u8string(name.begin(), name.end())};
}

/// Effects: `out` = the local time of `t`. Returns: false if it cannot be told.
inline bool local_time(std::time_t t, std::tm& out) noexcept { return ::localtime_s(&out, &t) == 0; }

/// Returns: what a person should check for GetLastError() value `e`, or "".
inline const char* win32_hint(DWORD e) noexcept {
  switch (e) {
    case ERROR_PATH_NOT_FOUND: return " (does the directory exist?)";
    case ERROR_INVALID_DRIVE:
    case ERROR_NOT_READY: return " (is the drive there, and the share connected?)";
    case ERROR_ACCESS_DENIED: return " (may this user write there? check the file's security and its read-only attribute; a directory cannot be opened as a file)";
    case ERROR_SHARING_VIOLATION: return " (another process has the file open without sharing it; an antivirus scan or an indexer lets go in a moment)";
    case ERROR_LOCK_VIOLATION: return " (another process holds a byte-range lock on it)";
    case ERROR_DISK_FULL:
    case ERROR_HANDLE_DISK_FULL: return " (the disk is full)";
    case ERROR_WRITE_PROTECT: return " (the medium is write-protected)";
    case ERROR_FILENAME_EXCED_RANGE: return " (the path is too long)";
    case ERROR_TOO_MANY_OPEN_FILES: return " (too many open files)";
    default: return "";
  }
}

/// Returns: a std::system_error for GetLastError() value `e` (in
/// std::system_category(), as on Windows the standard library wants it),
/// reading "<what> '<path>'< hint>: <the system's message>".
inline std::system_error path_error(DWORD e, std::string_view what, const std::filesystem::path& path) {
  return std::system_error(std::error_code{static_cast<int>(e), std::system_category()},
                           fmt::format("{} '{}'{}", what, path_text(path), win32_hint(e)));
}

/// Returns: `p` as Win32 wants it: absolute paths of MAX_PATH or more get the
/// \\?\ prefix (so that long paths work without the registry's opt-in).
inline std::wstring win32_path(const std::filesystem::path& p) {
  std::wstring w = p.native();
  if (w.size() < MAX_PATH - 12 || w.rfind(LR"(\\?\)", 0) == 0) return w;
  std::error_code ec;
  std::wstring abs = std::filesystem::absolute(p, ec).make_preferred().native();
  if (ec) return w;
  if (abs.rfind(LR"(\\)", 0) == 0) return LR"(\\?\UNC\)" + abs.substr(2);  // \\server\share\...
  return LR"(\\?\)" + abs;
}

/// A HANDLE that closes itself (INVALID_HANDLE_VALUE or null: none).
class unique_handle {
public:
  unique_handle() = default;
  explicit unique_handle(HANDLE h) noexcept : h_(h) {}
  unique_handle(unique_handle&& o) noexcept : h_(std::exchange(o.h_, INVALID_HANDLE_VALUE)) {}
  unique_handle& operator=(unique_handle&& o) noexcept {
    if (this != &o) reset(std::exchange(o.h_, INVALID_HANDLE_VALUE));
    return *this;
  }
  ~unique_handle() { reset(); }
  HANDLE get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != INVALID_HANDLE_VALUE && h_ != nullptr; }
  HANDLE release() noexcept { return std::exchange(h_, INVALID_HANDLE_VALUE); }
  void reset(HANDLE h = INVALID_HANDLE_VALUE) noexcept {
    if (h_ != INVALID_HANDLE_VALUE && h_ != nullptr) ::CloseHandle(h_);
    h_ = h;
  }

private:
  HANDLE h_ = INVALID_HANDLE_VALUE;
};

/// Returns: UTF-8 of a UTF-16 string.
inline std::string to_utf8(std::wstring_view w) {
  if (w.empty()) return {};
  const int n = ::WideCharToMultiByte(CP_UTF8, 0, w.data(), static_cast<int>(w.size()), nullptr, 0, nullptr, nullptr);
  std::string out(static_cast<std::size_t>(n > 0 ? n : 0), '\0');
  if (n > 0) ::WideCharToMultiByte(CP_UTF8, 0, w.data(), static_cast<int>(w.size()), out.data(), n, nullptr, nullptr);
  return out;
}

/// A process id.
using process_id = DWORD;

/// Returns: this process's id.
inline process_id current_pid() noexcept { return ::GetCurrentProcessId(); }

/// Returns: this computer's NetBIOS name (%COMPUTERNAME%), as UTF-8.
inline std::string host_name() {
  wchar_t buf[MAX_COMPUTERNAME_LENGTH + 1] = {};
  DWORD n = MAX_COMPUTERNAME_LENGTH + 1;
  if (!::GetComputerNameW(buf, &n)) return {};
  return to_utf8(std::wstring_view{buf, n});
}

}  // namespace dibs::detail

namespace dibs::detail {
/// Permissions given to new files: on Windows ignored (a new file gets the
/// security its directory passes on), kept so that options compile alike.
using file_mode = unsigned;
}  // namespace dibs::detail
