// dibs/detail/win32/file_lock.hpp: the kernel's side of dibs::file_mutex on
// Windows, the twin of detail/posix/file_lock.hpp: LockFileEx/UnlockFileEx
// over the whole file (offset 0, length 2^64 - 1), as Boost.Interprocess's
// file_lock locks on Windows; py-filelock's msvcrt.locking (byte 0) meets it
// too. Windows byte-range locks are mandatory: while a process holds the
// lock, other processes cannot read or write the file's bytes, so the owner
// line (file_mutex_options::write_owner) can be read only while the file is
// unlocked. Both lock families are the same LockFileEx lock here.
//
// Verified under Wine 8 (mingw-w64): exclusive and shared locks between
// processes, a lock released when its process is terminated, the
// fail-immediately form. Not verified under Wine: locks over SMB shares.
#pragma once

#include <dibs/detail/win32/sys.hpp>

#include <compare>
#include <filesystem>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace dibs::detail::file_lock {

/// What identifies a file, whatever name it was opened by.
struct identity {
  DWORD volume;
  DWORD index_high;
  DWORD index_low;
  auto operator<=>(const identity&) const = default;
};

using handle = unique_handle;
using native_type = HANDLE;
inline native_type native(const handle& h) noexcept { return h.get(); }
inline native_type no_native() noexcept { return INVALID_HANDLE_VALUE; }

struct opened {
  handle h;
  identity id;
  bool writable;
};

/// Effects: opens (creating if missing) the lock file at `path`, sharing
/// reads, writes and deletes, not inherited by child processes. With
/// `read_only_ok`, an existing file this user may only read is opened
/// for reading (LockFileEx works on it).
/// Throws: std::system_error naming the path; a directory or a device is
/// refused as not a regular file.
inline opened open(const std::filesystem::path& path, file_mode, bool read_only_ok) {
  const std::wstring w = win32_path(path);
  constexpr DWORD share = FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE;
  bool writable = true;
  HANDLE h = ::CreateFileW(w.c_str(), GENERIC_READ | GENERIC_WRITE, share, nullptr, OPEN_ALWAYS, FILE_ATTRIBUTE_NORMAL,
                           nullptr);
  DWORD err = h == INVALID_HANDLE_VALUE ? ::GetLastError() : ERROR_SUCCESS;
  if (h == INVALID_HANDLE_VALUE && err == ERROR_ACCESS_DENIED) {
    const DWORD attrs = ::GetFileAttributesW(w.c_str());
    if (attrs != INVALID_FILE_ATTRIBUTES && (attrs & FILE_ATTRIBUTE_DIRECTORY))
      throw std::system_error(std::make_error_code(std::errc::is_a_directory),
                              fmt::format("dibs::file_mutex: lock file is not a regular file: '{}' (the path names a "
                                          "directory, not a file)",
                                          path_text(path)));
    if (read_only_ok) {
      writable = false;
      h = ::CreateFileW(w.c_str(), GENERIC_READ, share, nullptr, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr);
    }
  }
  if (h == INVALID_HANDLE_VALUE) throw path_error(err, "dibs::file_mutex: cannot open lock file", path);
  unique_handle owned{h};
  if (::GetFileType(h) != FILE_TYPE_DISK)
    throw std::system_error(std::make_error_code(std::errc::invalid_argument),
                            fmt::format("dibs::file_mutex: lock file is not a regular file: '{}' (a device or a pipe)",
                                        path_text(path)));
  BY_HANDLE_FILE_INFORMATION info{};
  if (!::GetFileInformationByHandle(h, &info))
    throw path_error(::GetLastError(), "dibs::file_mutex: cannot read the file information of lock file", path);
  return {std::move(owned), identity{info.dwVolumeSerialNumber, info.nFileIndexHigh, info.nFileIndexLow}, writable};
}

/// Effects: one LockFileEx call, exclusive or shared; `block` waits in the
/// kernel (record_lock: the same lock on Windows).
/// Returns: true if acquired, false if held elsewhere (only without `block`).
/// Throws: std::system_error naming the path if Windows refuses.
inline bool try_lock(const handle& h, bool /*record_lock*/, bool exclusive, bool block,
                     const std::filesystem::path& path) {
  OVERLAPPED at{};  // offset 0
  const DWORD flags = (exclusive ? LOCKFILE_EXCLUSIVE_LOCK : 0) | (block ? 0 : LOCKFILE_FAIL_IMMEDIATELY);
  if (::LockFileEx(h.get(), flags, 0, MAXDWORD, MAXDWORD, &at)) return true;
  const DWORD e = ::GetLastError();
  if (!block && (e == ERROR_LOCK_VIOLATION || e == ERROR_IO_PENDING)) return false;
  throw path_error(e, exclusive ? "dibs::file_mutex: cannot lock" : "dibs::file_mutex: cannot lock shared", path);
}

/// Effects: releases this handle's lock.
inline void unlock(const handle& h, bool /*record_lock*/) noexcept {
  OVERLAPPED at{};
  // Unlocking a lock we hold does not fail; if it ever did, closing the
  // handle (at the latest when the process ends) releases it.
  (void)::UnlockFileEx(h.get(), 0, MAXDWORD, MAXDWORD, &at);
}

/// Effects: writes `line` at the start of the file, best effort.
inline void write_owner(const handle& h, const std::string& line) noexcept {
  OVERLAPPED at{};
  DWORD written = 0;
  (void)::WriteFile(h.get(), line.data(), static_cast<DWORD>(line.size()), &written, &at);
}

/// Returns: "pid <pid> host <computer name>".
inline std::string owner_text() { return fmt::format("pid {} host {}", current_pid(), host_name()); }

/// Effects: none: Windows has no fork().
inline void at_fork(void (*)(), void (*)(), void (*)()) noexcept {}

}  // namespace dibs::detail::file_lock
