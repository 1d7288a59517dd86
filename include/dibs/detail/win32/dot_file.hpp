// dibs/detail/win32/dot_file.hpp: the file operations dibs::dot_lock is made
// of, on Windows; the twin of detail/posix/dot_file.hpp, with the same
// names and the same answers, so that dot_lock.hpp holds the policy once.
//
//   - Creating: CreateFileW(CREATE_NEW) (fails if any file is there, as a
//     batch file's `if exist` sees it), then the record written and
//     flushed (FlushFileBuffers). A reader can open the file while it is
//     written, so it may read it empty or cut short: dot_lock judges that
//     as it judges any content that is not a whole dibs record (a foreign
//     lock, held until its mtime is older than stale_after). A record cut
//     short cannot prove its holder gone: the identity lines come before
//     lease_ms, the last line the parser requires.
//   - Sharing: the holder's handle shares reads (waiters read the record)
//     and deletes (a breaker renames a stale file while a paused holder
//     still has it open), not writes: a batch file's `echo ... > job.lck`
//     racing a held lock fails with a sharing violation instead of
//     overwriting the record. Waiters open it sharing everything.
//   - One breaker at a time: LockFileEx on one byte far past the end of the
//     file (offset 2^63 - 1), so that the lock stops no one from reading
//     the record (Windows byte-range locks are mandatory).
//   - Moving a stale file away and back: MoveFileExW without
//     MOVEFILE_REPLACE_EXISTING, which fails if the target exists.
//   - Removing: if the path still names the holder's file, the holder marks
//     it for deletion through its own handle (FileDispositionInfo), so it
//     can only ever delete its own file: a lock that a breaker moved away
//     and another process created since is left alone, and no flock is
//     needed around the check as on POSIX. The name goes when the last
//     handle to the file closes (a waiter reading it delays that for a
//     moment; meanwhile the name cannot be created, which a waiter takes
//     as held).
//   - Touching: SetFileTime(last write time) on the holder's handle.
//
// Verified under Wine 8 (mingw-w64). Not verified under Wine: SMB shares,
// NTFS's own timing of last write times.
#pragma once

#include <dibs/detail/digits.hpp>
#include <dibs/detail/win32/sys.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

namespace dibs::detail::dot_file {

using handle = unique_handle;

/// A file as a waiter judged it: which file, its size and its last write time.
struct stamp {
  DWORD volume = 0;
  DWORD index_high = 0;
  DWORD index_low = 0;
  std::uint64_t size = 0;
  std::uint64_t mtime = 0;  // 100 ns since 1601

  /// Returns: the last write time on the wall clock.
  std::chrono::system_clock::time_point modified() const noexcept {
    constexpr std::int64_t unix_epoch = 116'444'736'000'000'000;  // 1970 in 100 ns since 1601
    const auto since = std::chrono::duration<std::int64_t, std::ratio<1, 10'000'000>>{
        static_cast<std::int64_t>(mtime) - unix_epoch};
    return std::chrono::system_clock::time_point{std::chrono::duration_cast<std::chrono::system_clock::duration>(since)};
  }
  /// Returns: true if `o` is the same file, unchanged (same size and time).
  bool unchanged(const stamp& o) const noexcept { return same_file(o) && size == o.size && mtime == o.mtime; }
  /// Returns: true if `o` is the same file, whatever its size and time.
  bool same_file(const stamp& o) const noexcept {
    return volume == o.volume && index_high == o.index_high && index_low == o.index_low;
  }
};

/// Returns: the stamp of the file open as `h`, or false.
inline bool stamp_of(HANDLE h, stamp& out) noexcept {
  BY_HANDLE_FILE_INFORMATION info{};
  if (!::GetFileInformationByHandle(h, &info)) return false;
  out.volume = info.dwVolumeSerialNumber;
  out.index_high = info.nFileIndexHigh;
  out.index_low = info.nFileIndexLow;
  out.size = (static_cast<std::uint64_t>(info.nFileSizeHigh) << 32) | info.nFileSizeLow;
  out.mtime = (static_cast<std::uint64_t>(info.ftLastWriteTime.dwHighDateTime) << 32) |
              info.ftLastWriteTime.dwLowDateTime;
  return true;
}

/// Returns: the stamp of the file `path` names now (not following a
/// link), or false. Asks for its attributes only, which no sharing mode
/// refuses.
inline bool stamp_at(const std::filesystem::path& path, stamp& out) {
  const unique_handle h{::CreateFileW(win32_path(path).c_str(), FILE_READ_ATTRIBUTES,
                                      FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr, OPEN_EXISTING,
                                      FILE_FLAG_OPEN_REPARSE_POINT, nullptr)};
  return h && stamp_of(h.get(), out);
}

/// Throws: std::system_error naming the lock file `path` if its directory
/// `dir` is missing or not a directory.
inline void check_directory(const std::filesystem::path& dir, const std::filesystem::path& path) {
  const DWORD attrs = ::GetFileAttributesW(win32_path(dir).c_str());
  if (attrs == INVALID_FILE_ATTRIBUTES) {
    const DWORD e = ::GetLastError();
    // The directory is what is missing, whichever part of its path.
    throw path_error(e == ERROR_FILE_NOT_FOUND ? ERROR_PATH_NOT_FOUND : e, "dibs::dot_lock: cannot use lock file",
                     path);
  }
  if (!(attrs & FILE_ATTRIBUTE_DIRECTORY))
    throw std::system_error(std::error_code{ERROR_DIRECTORY, std::system_category()},
                            fmt::format("dibs::dot_lock: cannot use lock file '{}' ('{}' is a file, not a directory)",
                                        path_text(path), path_text(dir)));
}

// The error for a file that cannot be made in the lock's directory: no
// lock can ever be taken there by this user, so waiting would not help.
inline std::system_error directory_error(DWORD e, const std::filesystem::path& dir, const std::filesystem::path& path) {
  return std::system_error(
      std::error_code{static_cast<int>(e), std::system_category()},
      fmt::format("dibs::dot_lock: cannot create a file in directory '{}' (for lock file '{}'){}", path_text(dir),
                  path_text(path),
                  e == ERROR_ACCESS_DENIED ? " (a dot_lock creates its lock file there: this user needs the right to "
                                             "create files in the directory; check its security)"
                                           : win32_hint(e)));
}

inline std::system_error not_regular(const std::filesystem::path& path, bool directory) {
  return std::system_error(
      directory ? std::make_error_code(std::errc::is_a_directory) : std::make_error_code(std::errc::invalid_argument),
      fmt::format("dibs::dot_lock: lock file '{}' is not a regular file (a {}): move it away", path_text(path),
                  directory ? "directory" : "device or pipe"));
}

// Errors that say the file at the path went away since we looked (or its
// directory did: creating will say so).
inline bool file_gone(DWORD e) noexcept { return e == ERROR_FILE_NOT_FOUND || e == ERROR_PATH_NOT_FOUND; }

/// Effects: marks the file open as `h` for deletion (it goes when its last
/// handle closes). Returns: true if done.
inline bool delete_by_handle(HANDLE h) noexcept {
  FILE_DISPOSITION_INFO d{};
  d.DeleteFile = TRUE;
  return ::SetFileInformationByHandle(h, FileDispositionInfo, &d, sizeof d) != 0;
}

/// Effects: creates the lock file `path` (in directory `dir`) with
/// CreateFileW(CREATE_NEW), writes `text` to it and flushes it.
/// Returns: true with `out` open on the new lock file and `st` its stamp;
/// false if a file is at the path (or one deleted a moment ago whose name
/// is not free yet).
/// Throws: std::system_error naming the directory if no file can be made
/// there, or naming the path (the file is then removed again).
inline bool create(const std::filesystem::path& path, const std::filesystem::path& dir, std::string_view text,
                   file_mode, handle& out, stamp& st_out) {
  const std::wstring w = win32_path(path);
  unique_handle h{::CreateFileW(w.c_str(), GENERIC_READ | GENERIC_WRITE | DELETE, FILE_SHARE_READ | FILE_SHARE_DELETE,
                                nullptr, CREATE_NEW, FILE_ATTRIBUTE_NORMAL, nullptr)};
  if (!h) {
    const DWORD e = ::GetLastError();
    if (e == ERROR_FILE_EXISTS || e == ERROR_ALREADY_EXISTS) return false;
    if (e == ERROR_ACCESS_DENIED) {
      // Refused for a name that is taken (a directory, a file being
      // deleted) or for the directory's security: only the second is an
      // error here; the first is judged like any file at the path.
      const DWORD attrs = ::GetFileAttributesW(w.c_str());
      if (attrs != INVALID_FILE_ATTRIBUTES || ::GetLastError() == ERROR_ACCESS_DENIED) return false;
      throw directory_error(e, dir, path);
    }
    if (e == ERROR_PATH_NOT_FOUND) throw directory_error(e, dir, path);
    throw path_error(e, "dibs::dot_lock: cannot create lock file", path);
  }
  const auto fail = [&](DWORD e, const char* what) {
    (void)delete_by_handle(h.get());
    return path_error(e, what, path);
  };
  for (std::size_t done = 0; done < text.size();) {
    DWORD n = 0;
    if (!::WriteFile(h.get(), text.data() + done, static_cast<DWORD>(text.size() - done), &n, nullptr))
      throw fail(::GetLastError(), "dibs::dot_lock: cannot write lock file");
    if (n == 0) throw fail(ERROR_DISK_FULL, "dibs::dot_lock: cannot write lock file");
    done += n;
  }
  if (!::FlushFileBuffers(h.get())) throw fail(::GetLastError(), "dibs::dot_lock: cannot write lock file");
  if (!stamp_of(h.get(), st_out)) throw fail(::GetLastError(), "dibs::dot_lock: cannot read the file information of lock file");
  out = std::move(h);
  return true;
}

enum class look { opened, gone, unreadable };

/// Effects: opens the file at `path` for judging (into `h`, its stamp into
/// `st`), sharing everything, never following a symbolic link or junction.
/// Returns: opened; gone (no file there now: look again); unreadable (a
/// file this user may not read, one being deleted, or one another process
/// has open without sharing it: held).
/// Throws: std::system_error naming the path for a link, a directory or a
/// device, or another error.
inline look open_judged(const std::filesystem::path& path, handle& h, stamp& st_out) {
  const std::wstring w = win32_path(path);
  h.reset(::CreateFileW(w.c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
                        OPEN_EXISTING, FILE_FLAG_OPEN_REPARSE_POINT, nullptr));
  if (!h) {
    const DWORD e = ::GetLastError();
    if (file_gone(e)) return look::gone;
    if (e == ERROR_SHARING_VIOLATION) return look::unreadable;
    if (e == ERROR_ACCESS_DENIED) {
      const DWORD attrs = ::GetFileAttributesW(w.c_str());
      if (attrs != INVALID_FILE_ATTRIBUTES && (attrs & FILE_ATTRIBUTE_DIRECTORY)) throw not_regular(path, true);
      if (attrs == INVALID_FILE_ATTRIBUTES && file_gone(::GetLastError())) return look::gone;
      return look::unreadable;
    }
    throw path_error(e, "dibs::dot_lock: cannot open lock file", path);
  }
  if (::GetFileType(h.get()) != FILE_TYPE_DISK) throw not_regular(path, false);
  BY_HANDLE_FILE_INFORMATION info{};
  if (!::GetFileInformationByHandle(h.get(), &info))
    throw path_error(::GetLastError(), "dibs::dot_lock: cannot read the file information of lock file", path);
  if (info.dwFileAttributes & FILE_ATTRIBUTE_DIRECTORY) throw not_regular(path, true);
  if (info.dwFileAttributes & FILE_ATTRIBUTE_REPARSE_POINT)
    throw std::system_error(std::make_error_code(std::errc::too_many_symbolic_link_levels),
                            fmt::format("dibs::dot_lock: lock file '{}' is a symbolic link or junction; dibs does not "
                                        "follow a link there (in a shared directory it could point anywhere): remove it",
                                        path_text(path)));
  (void)stamp_of(h.get(), st_out);
  return look::opened;
}

/// Effects: reads up to `size` bytes from the start of the file `h` into
/// `buf`, their number into `n`.
/// Returns: opened (read), or unreadable (a byte-range lock of another
/// program on them). Throws: std::system_error naming the path.
inline look read_head(const handle& h, char* buf, std::size_t size, std::size_t& n,
                      const std::filesystem::path& path) {
  OVERLAPPED at{};  // offset 0
  DWORD got = 0;
  if (!::ReadFile(h.get(), buf, static_cast<DWORD>(size), &got, &at)) {
    const DWORD e = ::GetLastError();
    if (e == ERROR_HANDLE_EOF) got = 0;
    else if (e == ERROR_LOCK_VIOLATION || e == ERROR_ACCESS_DENIED) return look::unreadable;
    else throw path_error(e, "dibs::dot_lock: cannot read lock file", path);
  }
  n = got;
  return look::opened;
}

/// Effects: takes, without waiting, the lock that one breaker at a time
/// holds on the judged file: LockFileEx on the byte at 2^63 - 1, which no
/// reader reads. Returns: true if taken (released when `h` is closed).
inline bool try_break_lock(const handle& h) noexcept {
  OVERLAPPED at{};
  at.Offset = 0xffffffff;
  at.OffsetHigh = 0x7fffffff;
  return ::LockFileEx(h.get(), LOCKFILE_EXCLUSIVE_LOCK | LOCKFILE_FAIL_IMMEDIATELY, 0, 1, 0, &at) != 0;
}

/// Returns: true if `path` names the file of `judged`, unchanged.
inline bool path_unchanged(const std::filesystem::path& path, const stamp& judged) {
  stamp now;
  return stamp_at(path, now) && now.unchanged(judged);
}

/// Returns: true if the file open as `h` is `judged`, unchanged (not touched).
inline bool handle_unchanged(const handle& h, const stamp& judged) noexcept {
  stamp now;
  return stamp_of(h.get(), now) && now.unchanged(judged);
}

/// Returns: a name in the lock's directory for a stale lock moved away.
inline std::filesystem::path broken_name(const std::filesystem::path& path) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::filesystem::path out = path;
  out += fmt::format(".broken.{}.{}", current_pid(), hex_digits(rng(), 16));
  return out;
}

enum class moved { done, gone, refused };

/// Effects: MoveFileExW(path, to) without replacing, atomically.
/// Returns: done; gone (nothing at the path); refused (a process has it open
/// without sharing deletes, or this user may not move it: held for now).
/// Throws: std::system_error naming the path for another error.
inline moved move_away(const std::filesystem::path& path, const std::filesystem::path& to) {
  if (::MoveFileExW(win32_path(path).c_str(), win32_path(to).c_str(), 0)) return moved::done;
  const DWORD e = ::GetLastError();
  if (file_gone(e)) return moved::gone;
  if (e == ERROR_ACCESS_DENIED || e == ERROR_SHARING_VIOLATION || e == ERROR_ALREADY_EXISTS || e == ERROR_FILE_EXISTS)
    return moved::refused;
  throw path_error(e, "dibs::dot_lock: cannot move away the stale lock file", path);
}

/// Effects: removes the file `name` (a moved-away stale lock), best effort.
inline void remove_moved(const std::filesystem::path& name) noexcept {
  try {
    (void)::DeleteFileW(win32_path(name).c_str());
  } catch (...) {  // win32_path may allocate
  }
}

/// Effects: moves `from` back to `path` unless a file is there (never
/// clobbers); where it cannot, `from` stays.
inline void move_back(const std::filesystem::path& from, const std::filesystem::path& path) noexcept {
  try {
    (void)::MoveFileExW(win32_path(from).c_str(), win32_path(path).c_str(), 0);
  } catch (...) {
  }
}

/// Returns: true if `path` names the file `own` (whatever its size and time).
inline bool path_names(const std::filesystem::path& path, const stamp& own) {
  stamp now;
  return stamp_at(path, now) && now.same_file(own);
}

/// Effects: sets the last write time of the file `h` to now. Returns: true if done.
inline bool touch(const handle& h) noexcept {
  FILETIME now{};
  ::GetSystemTimeAsFileTime(&now);
  return ::SetFileTime(h.get(), nullptr, nullptr, &now) != 0;
}

enum class removal { removed, left, busy };

/// Effects: removes the lock file `path` if it still names `own` (open as
/// `h`), through the handle, so that what is deleted is `own` whatever name
/// it has by then: a breaker that renames it between the check and the
/// delete finds it gone, and no other file is ever deleted.
/// Returns: removed; left (the path names another file, or none).
/// Throws: std::system_error naming the path if it cannot be removed.
inline removal remove_own(const handle& h, const std::filesystem::path& path, const stamp& own) {
  if (!h || !path_names(path, own)) return removal::left;
  if (delete_by_handle(h.get())) return removal::removed;
  const DWORD e = ::GetLastError();
  if (!path_names(path, own)) return removal::left;
  throw path_error(e, "dibs::dot_lock: cannot remove lock file", path);
}

}  // namespace dibs::detail::dot_file
