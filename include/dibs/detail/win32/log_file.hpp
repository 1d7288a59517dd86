// dibs/detail/win32/log_file.hpp: the Win32 calls of dibs::shared_log on
// Windows (the policy is detail/shared_log/locked_log.hpp): the log opened
// for appending (FILE_APPEND_DATA: every write goes to the end of the file),
// its lock file (the shared state, read and written under LockFileEx on one
// byte far past it), the cut of a dead holder's torn tail, and the renames
// of a rotation. Each call throws nothing unless it says so: the policy
// knows which path and what step to name.
//
// Every file is opened sharing reads, writes and deletes: Windows refuses
// to rename a file that another process has open without FILE_SHARE_DELETE,
// and a rotation renames the log while other writers hold it open. Handles
// are not inherited by child processes.
//
// Verified under Wine 8 (mingw-w64): appends of 4 processes with
// TerminateProcess kills, rotation while other writers hold the log open.
// Not verified: SMB shares, Windows itself.
#pragma once

#include <dibs/detail/win32/file_ops.hpp>
#include <dibs/detail/win32/sys.hpp>

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>

#include <fmt/format.h>

namespace dibs::detail::win32_log {

inline constexpr DWORD share_all = FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE;

/// What identifies a file on its volume, whatever name it has now.
struct file_id {
  std::uint64_t volume = 0;
  std::uint64_t index = 0;
  bool operator==(const file_id&) const = default;
};

struct file_info {
  file_id id;
  DWORD links = 0;
};

/// Returns: what identifies the file behind `h`, and its number of names;
/// false if Windows cannot say (GetLastError() tells why).
inline bool info_of(HANDLE h, file_info& out) noexcept {
  BY_HANDLE_FILE_INFORMATION i{};
  if (!::GetFileInformationByHandle(h, &i)) return false;
  out.id = {i.dwVolumeSerialNumber, std::uint64_t{i.nFileIndexHigh} << 32 | i.nFileIndexLow};
  out.links = i.nNumberOfLinks;
  return true;
}

/// Throws: std::system_error naming `path` if a CreateFileW of it failed
/// with `e`: a directory is "not a regular file" (Windows says only
/// "access denied" for it).
[[noreturn]] inline void throw_open_error(DWORD e, const char* what, const std::filesystem::path& path) {
  if (e == ERROR_ACCESS_DENIED) {
    const DWORD attrs = ::GetFileAttributesW(win32_path(path).c_str());
    if (attrs != INVALID_FILE_ATTRIBUTES && (attrs & FILE_ATTRIBUTE_DIRECTORY))
      throw std::system_error(std::make_error_code(std::errc::is_a_directory),
                              fmt::format("dibs::shared_log: {} '{}': not a regular file (the path names a "
                                          "directory; give the path of a file in it)",
                                          what, path_text(path)));
    if (attrs != INVALID_FILE_ATTRIBUTES && (attrs & FILE_ATTRIBUTE_READONLY))
      throw std::system_error(std::error_code{static_cast<int>(e), std::system_category()},
                              fmt::format("dibs::shared_log: {} '{}': the file is read-only (clear its read-only "
                                          "attribute, `attrib -r`, or give another path)",
                                          what, path_text(path)));
  }
  throw path_error(e, fmt::format("dibs::shared_log: {}", what), path);
}

/// Effects: opens (creating if missing) the log at `path` for appending
/// only (FILE_APPEND_DATA: a write cannot land anywhere but at the end).
/// Throws: std::system_error naming the path; a directory, a device or a
/// pipe is refused as not a regular file.
inline unique_handle open_append(const std::filesystem::path& path) {
  unique_handle h{::CreateFileW(win32_path(path).c_str(), FILE_APPEND_DATA | FILE_READ_ATTRIBUTES | SYNCHRONIZE,
                                share_all, nullptr, OPEN_ALWAYS, FILE_ATTRIBUTE_NORMAL, nullptr)};
  if (!h) throw_open_error(::GetLastError(), "cannot open log file", path);
  // Windows refuses to open a read-only file for writing; Wine running as
  // root opens it. Refused alike everywhere: the attribute says "do not
  // write", and a log is not appended to against it.
  FILE_BASIC_INFO basic{};
  if (::GetFileInformationByHandleEx(h.get(), FileBasicInfo, &basic, sizeof basic) &&
      (basic.FileAttributes & FILE_ATTRIBUTE_READONLY))
    throw_open_error(ERROR_ACCESS_DENIED, "cannot open log file", path);
  if (::GetFileType(h.get()) != FILE_TYPE_DISK)
    throw std::system_error(std::make_error_code(std::errc::invalid_argument),
                            fmt::format("dibs::shared_log: log is not a regular file: '{}' (a device or a pipe)",
                                        path_text(path)));
  return h;
}

/// Effects: opens (creating if missing) the lock file at `path` for reading
/// and writing. Throws: std::system_error naming the path.
inline unique_handle open_lock_file(const std::filesystem::path& path) {
  unique_handle h{::CreateFileW(win32_path(path).c_str(), GENERIC_READ | GENERIC_WRITE, share_all, nullptr,
                                OPEN_ALWAYS, FILE_ATTRIBUTE_NORMAL, nullptr)};
  if (!h) throw_open_error(::GetLastError(), "cannot open lock file", path);
  return h;
}

/// Returns: the path Windows knows the open file `h` by: every symbolic
/// link and junction resolved, each name as the directory spells it (so
/// `C:\LOGS\App.log` and `c:\logs\app.log` give one path); `fallback` if
/// it cannot tell.
inline std::filesystem::path final_path(HANDLE h, const std::filesystem::path& fallback) {
  std::wstring buf(512, L'\0');
  for (int round = 0; round < 2; ++round) {
    const DWORD n = ::GetFinalPathNameByHandleW(h, buf.data(), static_cast<DWORD>(buf.size()),
                                                FILE_NAME_NORMALIZED | VOLUME_NAME_DOS);
    if (n == 0) return fallback;
    if (n < buf.size()) {
      buf.resize(n);
      // `\\?\C:\...` or `\\?\UNC\server\share\...`: shown and kept without
      // the prefix where the path is short enough (win32_path adds it back).
      if (buf.rfind(LR"(\\?\UNC\)", 0) == 0) buf = LR"(\\)" + buf.substr(8);
      else if (buf.rfind(LR"(\\?\)", 0) == 0) buf = buf.substr(4);
      return std::filesystem::path{buf};
    }
    buf.assign(n + 1, L'\0');
  }
  return fallback;
}

/// Returns: the size of the file behind `h`, or -1 (GetLastError() says why).
inline std::int64_t size_of(HANDLE h) noexcept {
  LARGE_INTEGER s{};
  if (!::GetFileSizeEx(h, &s)) return -1;
  return s.QuadPart;
}

/// Effects: writes all of [data, data + size) at the end of the log (the
/// handle is open for appending only). Returns: 0 or the error.
inline DWORD append(HANDLE h, const char* data, std::size_t size) noexcept { return write_all(h, data, size); }

/// Effects: forces the file behind `h` to stable storage. Returns: 0 or the error.
inline DWORD flush(HANDLE h) noexcept { return ::FlushFileBuffers(h) ? 0 : ::GetLastError(); }

/// Effects: forces the file now at `path` to stable storage, through a
/// handle opened for it. Returns: 0 or the error.
inline DWORD flush_path(const std::filesystem::path& path) noexcept {
  unique_handle h{::CreateFileW(win32_path(path).c_str(), GENERIC_WRITE, share_all, nullptr, OPEN_EXISTING,
                                FILE_ATTRIBUTE_NORMAL, nullptr)};
  if (!h) return ::GetLastError();
  return flush(h.get());
}

/// Effects: cuts the file at `path` to `size` bytes, if it is still the
/// file `id` and longer than that. Returns: 0 (also if it is another file
/// now, or gone), or the error.
inline DWORD cut(const std::filesystem::path& path, const file_id& id, std::int64_t size) noexcept {
  unique_handle h{::CreateFileW(win32_path(path).c_str(), GENERIC_WRITE | FILE_READ_ATTRIBUTES, share_all, nullptr,
                                OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr)};
  if (!h) {
    const DWORD e = ::GetLastError();
    return e == ERROR_FILE_NOT_FOUND ? 0 : e;
  }
  file_info info;
  if (!info_of(h.get(), info)) return ::GetLastError();
  if (!(info.id == id)) return 0;
  const std::int64_t now = size_of(h.get());
  if (now < 0) return ::GetLastError();
  if (now <= size) return 0;
  LARGE_INTEGER at{};
  at.QuadPart = size;
  if (!::SetFilePointerEx(h.get(), at, nullptr, FILE_BEGIN) || !::SetEndOfFile(h.get())) return ::GetLastError();
  return 0;
}

/// Returns: the size of the file at `path` if it is the file `id`; -1 if
/// it is gone or another file; -2 with `e` set if it cannot be told.
inline std::int64_t size_if_same(const std::filesystem::path& path, const file_id& id, DWORD& e) noexcept {
  unique_handle h{::CreateFileW(win32_path(path).c_str(), FILE_READ_ATTRIBUTES, share_all, nullptr, OPEN_EXISTING,
                                FILE_ATTRIBUTE_NORMAL, nullptr)};
  if (!h) {
    e = ::GetLastError();
    return e == ERROR_FILE_NOT_FOUND ? -1 : -2;
  }
  file_info info;
  if (!info_of(h.get(), info)) {
    e = ::GetLastError();
    return -2;
  }
  if (!(info.id == id)) return -1;
  const std::int64_t s = size_of(h.get());
  if (s < 0) e = ::GetLastError();
  return s < 0 ? -2 : s;
}

/// Returns: whether a file (or anything) is at `path`; throws if Windows
/// cannot tell.
inline bool exists(const std::filesystem::path& path) {
  if (::GetFileAttributesW(win32_path(path).c_str()) != INVALID_FILE_ATTRIBUTES) return true;
  const DWORD e = ::GetLastError();
  if (e == ERROR_FILE_NOT_FOUND || e == ERROR_PATH_NOT_FOUND) return false;
  throw path_error(e, "dibs::shared_log: cannot look for rotated log", path);
}

/// Effects: renames `from` to `to`, never over an existing file (fails
/// with ERROR_ALREADY_EXISTS then). Works while other processes hold
/// `from` open sharing deletes. Returns: 0 or the error.
inline DWORD rename_no_replace(const std::filesystem::path& from, const std::filesystem::path& to) noexcept {
  return ::MoveFileExW(win32_path(from).c_str(), win32_path(to).c_str(), 0) ? 0 : ::GetLastError();
}

/// Effects: removes the file at `path`. A file that a writer still holds
/// open would keep its name until that writer closes it (and a later
/// rotation could not rename onto it), so it is first moved out of the way
/// to `<path>.deleted.<pid>.<random>` and deleted under that name.
/// Returns: 0, ERROR_FILE_NOT_FOUND if there is none, or another error.
inline DWORD remove(const std::filesystem::path& path) noexcept {
  std::random_device rd;
  const std::filesystem::path aside = path.native() + L".deleted." + std::to_wstring(current_pid()) + L"." +
                                      std::to_wstring(rd());
  if (const DWORD e = rename_no_replace(path, aside)) return e == ERROR_PATH_NOT_FOUND ? ERROR_FILE_NOT_FOUND : e;
  return ::DeleteFileW(win32_path(aside).c_str()) ? 0 : ::GetLastError();
}

/// Effects: takes the lock of the log (LockFileEx on one byte far past the
/// lock file's data, so that the shared state stays readable), without
/// waiting. Windows releases it when the handle closes or the process ends,
/// however it ends (TerminateProcess included).
/// Returns: 0, ERROR_LOCK_VIOLATION if another holds it, or another error.
inline DWORD try_lock(HANDLE lock_file) noexcept { return lock_whole_file(lock_file, file_lock_kind::exclusive, false); }
inline void unlock(HANDLE lock_file) noexcept { (void)unlock_whole_file(lock_file); }

/// Effects: reads the shared state, [buf, buf + size) from offset 0.
/// Returns: the bytes read (fewer: a new lock file), or -1 with `e` set.
inline std::int64_t read_state(HANDLE lock_file, void* buf, std::size_t size, DWORD& e) noexcept {
  return read_at(lock_file, static_cast<char*>(buf), size, 0, e);
}

/// Effects: writes the shared state at offset 0 in one WriteFile (a
/// holder terminated there leaves the old state or the new one: the system
/// copies a write into its cache before the process can be ended).
/// Returns: 0 or the error.
inline DWORD write_state(HANDLE lock_file, const void* data, std::size_t size) noexcept {
  return write_at(lock_file, static_cast<const char*>(data), size, 0);
}

/// Returns: milliseconds since the Unix epoch (for messages).
inline std::int64_t wall_ms() noexcept {
  FILETIME ft{};
  ::GetSystemTimeAsFileTime(&ft);
  const std::uint64_t t = std::uint64_t{ft.dwHighDateTime} << 32 | ft.dwLowDateTime;  // 100 ns since 1601
  return static_cast<std::int64_t>(t / 10'000) - 11'644'473'600'000;
}

}  // namespace dibs::detail::win32_log
