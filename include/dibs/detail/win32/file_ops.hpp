// dibs/detail/win32/file_ops.hpp: the file operations a record write
// (file_store) is made of, on Windows; the twin of detail/posix/file_ops.hpp.
// Each returns 0 or the GetLastError() code of what failed, and throws
// nothing: the caller knows which path and what step to name.
//
// Locks: Windows byte-range locks are mandatory (a locked range cannot be
// read or written by other handles), so a record file's lock is taken on
// one byte far past its data (record_lock_offset), where it orders writers
// and readers that ask for it without stopping anyone from reading the
// record. Locks belong to a handle and its process: two handles of one
// process exclude each other, as two flock descriptions do on Linux.
//
// Verified under Wine 8 (mingw-w64). Not verified under Wine: SMB shares.
#pragma once

#include <dibs/detail/win32/sys.hpp>

#include <cstddef>
#include <cstdint>

namespace dibs::detail {

/// What a file is opened as, and what a system call fails with.
using native_file = HANDLE;
using sys_error = DWORD;

enum class file_lock_kind { shared, exclusive };

/// The byte locked to lock a record file: far past any record's data.
inline constexpr std::uint64_t record_lock_offset = std::uint64_t{1} << 62;

inline OVERLAPPED overlapped_at(std::uint64_t offset) noexcept {
  OVERLAPPED o{};
  o.Offset = static_cast<DWORD>(offset & 0xffffffffu);
  o.OffsetHigh = static_cast<DWORD>(offset >> 32);
  return o;
}

/// Effects: writes all of [data, data + size) at the handle's position,
/// going on after a short write. Returns: 0 or the error.
inline sys_error write_all(native_file h, const char* data, std::size_t size) noexcept {
  while (size > 0) {
    const DWORD want = size > 0x40000000u ? 0x40000000u : static_cast<DWORD>(size);
    DWORD n = 0;
    if (!::WriteFile(h, data, want, &n, nullptr)) return ::GetLastError();
    if (n == 0) return ERROR_DISK_FULL;
    data += n;
    size -= n;
  }
  return 0;
}

/// Effects: writes [data, data + size) at `offset` in one WriteFile (a
/// caller relies on it touching no other bytes). Returns: 0 or the error
/// (ERROR_DISK_FULL for a short write).
inline sys_error write_at(native_file h, const char* data, std::size_t size, std::uint64_t offset) noexcept {
  OVERLAPPED o = overlapped_at(offset);
  DWORD n = 0;
  if (!::WriteFile(h, data, static_cast<DWORD>(size), &n, &o)) return ::GetLastError();
  return n == size ? 0 : ERROR_DISK_FULL;
}

/// Effects: reads up to `size` bytes at `offset` into `buf`.
/// Returns: the number read (0 at the end), or -1 with the error in `e`.
inline std::int64_t read_at(native_file h, char* buf, std::size_t size, std::uint64_t offset, sys_error& e) noexcept {
  OVERLAPPED o = overlapped_at(offset);
  DWORD n = 0;
  if (::ReadFile(h, buf, static_cast<DWORD>(size), &n, &o)) return n;
  e = ::GetLastError();
  if (e == ERROR_HANDLE_EOF) return 0;
  return -1;
}

/// Effects: forces the file's data and metadata to stable storage. Returns: 0 or the error.
inline sys_error sync_file(native_file h) noexcept { return ::FlushFileBuffers(h) ? 0 : ::GetLastError(); }
inline sys_error sync_data(native_file h) noexcept { return sync_file(h); }

/// Effects: takes the record lock (the byte at record_lock_offset), shared
/// or exclusive; without `wait` only if it is free. Windows releases it
/// when the handle is closed or its process ends, however it ends.
/// Returns: 0, ERROR_LOCK_VIOLATION if it is held (no `wait`), or another error.
inline sys_error lock_whole_file(native_file h, file_lock_kind kind, bool wait) noexcept {
  OVERLAPPED o = overlapped_at(record_lock_offset);
  DWORD flags = kind == file_lock_kind::exclusive ? LOCKFILE_EXCLUSIVE_LOCK : 0;
  if (!wait) flags |= LOCKFILE_FAIL_IMMEDIATELY;
  if (::LockFileEx(h, flags, 0, 1, 0, &o)) return 0;
  const DWORD e = ::GetLastError();
  return e == ERROR_IO_PENDING ? ERROR_LOCK_VIOLATION : e;
}

/// Effects: drops the record lock. Returns: true if it was dropped.
inline bool unlock_whole_file(native_file h) noexcept {
  OVERLAPPED o = overlapped_at(record_lock_offset);
  return ::UnlockFileEx(h, 0, 1, 0, &o) != 0;
}

/// Returns: true if `e` says a lock is held by another (try again later).
inline bool lock_busy(sys_error e) noexcept { return e == ERROR_LOCK_VIOLATION; }
/// Returns: true if `e` says the file (or a directory on its path) is not there.
inline bool file_missing(sys_error e) noexcept { return e == ERROR_FILE_NOT_FOUND || e == ERROR_PATH_NOT_FOUND; }
/// Returns: true if `e` says the file exists already.
inline bool file_exists(sys_error e) noexcept { return e == ERROR_ALREADY_EXISTS || e == ERROR_FILE_EXISTS; }
/// Returns: true if `e` says this user may not write the file.
inline bool write_denied(sys_error e) noexcept { return e == ERROR_ACCESS_DENIED || e == ERROR_WRITE_PROTECT; }

}  // namespace dibs::detail
