// dibs/detail/posix/dot_file.hpp: the file operations dibs::dot_lock is made
// of, on POSIX (Linux): creating the lock file with its record (a temporary
// file link()ed to the lock's name, liblockfile's method), opening and
// reading a lock file to judge it, the flock that one breaker at a time
// takes, moving a stale file away and back, touching and removing. The
// policy (what is held, what is stale, the breaking protocol) is
// dot_lock.hpp's; the Win32 twin of this file is detail/win32/dot_file.hpp.
#pragma once

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/backoff.hpp>
#include <dibs/detail/posix/sys.hpp>

namespace dibs::detail::dot_file {

using handle = unique_fd;

/// A file as a waiter judged it: which file, its size and its mtime.
struct stamp {
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  struct ::timespec mtime {};

  /// Returns: the mtime on the wall clock.
  std::chrono::system_clock::time_point modified() const noexcept {
    return std::chrono::system_clock::time_point{std::chrono::duration_cast<std::chrono::system_clock::duration>(
        std::chrono::seconds{mtime.tv_sec} + std::chrono::nanoseconds{mtime.tv_nsec})};
  }
  /// Returns: true if `o` is the same file, unchanged (same size and mtime).
  bool unchanged(const stamp& o) const noexcept {
    return dev == o.dev && ino == o.ino && size == o.size && mtime.tv_sec == o.mtime.tv_sec &&
           mtime.tv_nsec == o.mtime.tv_nsec;
  }
  /// Returns: true if `o` is the same file, whatever its size and mtime.
  bool same_file(const stamp& o) const noexcept { return dev == o.dev && ino == o.ino; }
};

inline stamp stamp_of(const struct ::stat& st) noexcept { return {st.st_dev, st.st_ino, st.st_size, st.st_mtim}; }

// Errors that say the file at the path went away since we looked: ENOENT,
// and ESTALE (on NFS another client removed it, so our handle names
// nothing). The path is free, or names a newer file: look again.
inline bool file_gone(int e) noexcept { return e == ENOENT || e == ESTALE; }

// Errors that say a file is there that this user may not read or move (a
// mode 0600 lock of another user; a sticky directory): by the presence
// rule it is held. It is never broken by us: breaking needs proof from its
// record, or the file open for the flock and checks of the protocol, and
// an unreadable file gives neither. Only reached after create() made a
// file in the directory, so the directory itself is writable.
inline bool not_ours_to_read(int e) noexcept { return e == EACCES || e == EPERM; }

/// Throws: std::system_error naming the lock file `path` if its directory
/// `dir` is missing or not a directory.
inline void check_directory(const std::filesystem::path& dir, const std::filesystem::path& path) {
  struct ::stat st {};
  if (::stat(dir.c_str(), &st) != 0) throw path_error(errno, "dibs::dot_lock: cannot use lock file", path);
  if (!S_ISDIR(st.st_mode)) throw path_error(ENOTDIR, "dibs::dot_lock: cannot use lock file", path);
}

// The error for a file that cannot be made in the lock's directory: no
// lock can ever be taken there by this user, so waiting would not help.
inline std::system_error directory_error(int e, const std::filesystem::path& dir, const std::filesystem::path& path) {
  const bool denied = e == EACCES || e == EPERM;
  return std::system_error(
      std::error_code{e, std::system_category()},
      fmt::format("dibs::dot_lock: cannot create a file in directory '{}' (for lock file '{}'){}", dir.string(),
                  path.string(),
                  denied ? " (a dot_lock creates its lock file there: this user needs write and search permission on "
                           "the directory; share it by a group every locker is in, mode 2775, or make it mode 1777)"
                         : errno_hint(e)));
}

inline void check_regular(const struct ::stat& st, const std::filesystem::path& path) {
  if (!S_ISREG(st.st_mode))
    throw std::system_error(std::error_code{S_ISDIR(st.st_mode) ? EISDIR : EINVAL, std::system_category()},
                            fmt::format("dibs::dot_lock: lock file '{}' is not a regular file (a {}): move it away",
                                        path.string(), S_ISDIR(st.st_mode) ? "directory" : "device, FIFO or socket"));
}

/// Effects: creates the lock file `path` (in directory `dir`) holding
/// `text`, with exactly `mode`, all at once: the record is written to a
/// temporary file beside it, which is then link()ed to the lock's name
/// (link fails with EEXIST if any file is there), so no one ever sees a
/// half-written lock. Over NFS, a link() reported failed that succeeded is
/// told by the link count.
/// Returns: true with `out` open on the new lock file and `st` its stamp;
/// false if a file is at the path.
/// Throws: std::system_error naming the directory if no file can be made
/// there, or naming the path.
inline bool create(const std::filesystem::path& path, const std::filesystem::path& dir, std::string_view text,
                   file_mode mode, handle& out, stamp& st_out) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const auto tmp =
      dir / fmt::format(".{}.dibs-tmp.{}.{}", path.filename().string(), current_pid(), hex_digits(rng(), 16));
  unique_fd fd{open_retry(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode)};
  if (!fd) throw directory_error(errno, dir, path);
  const auto fail = [&](int e, const char* what) {
    ::unlink(tmp.c_str());
    return path_error(e, what, path);
  };
  // The mode exactly: a lock several users share must stay theirs to remove.
  if (::fchmod(fd.get(), mode) != 0) throw fail(errno, "dibs::dot_lock: cannot set the mode of lock file");
  for (std::size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw fail(n < 0 ? errno : ENOSPC, "dibs::dot_lock: cannot write lock file");
    done += static_cast<std::size_t>(n);
  }
  const int rc = ::link(tmp.c_str(), path.c_str());
  const int e = errno;
  struct ::stat st {};
  const bool linked = ::fstat(fd.get(), &st) == 0 && (rc == 0 || st.st_nlink == 2);
  ::unlink(tmp.c_str());
  if (!linked) {
    if (e == EEXIST) return false;
    throw path_error(e, "dibs::dot_lock: cannot create lock file", path);
  }
  out = std::move(fd);
  st_out = stamp_of(st);
  return true;
}

enum class look { opened, gone, unreadable };

/// Effects: opens the file at `path` for judging (into `fd`, its stamp into
/// `st`), never following a symbolic link.
/// Returns: opened; gone (no file there now: look again); unreadable (a file
/// this user may not read: held).
/// Throws: std::system_error naming the path for a symbolic link, a
/// directory or another non-file, or another error.
inline look open_judged(const std::filesystem::path& path, handle& fd, stamp& st_out) {
  fd.reset(open_retry(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  if (!fd) {
    const int e = errno;
    if (file_gone(e)) return look::gone;
    struct ::stat l {};
    if (e == ELOOP && ::lstat(path.c_str(), &l) == 0 && S_ISLNK(l.st_mode))
      throw std::system_error(std::error_code{e, std::system_category()},
                              fmt::format("dibs::dot_lock: lock file '{}' is a symbolic link; dibs does not follow a "
                                          "link there (in a shared directory it could point anywhere): remove it",
                                          path.string()));
    if (not_ours_to_read(e)) {
      // lstat needs no read permission: a directory there is still an error.
      if (::lstat(path.c_str(), &l) == 0) {
        check_regular(l, path);
        return look::unreadable;
      }
      return file_gone(errno) ? look::gone : look::unreadable;
    }
    throw path_error(e, "dibs::dot_lock: cannot open lock file", path);
  }
  struct ::stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    if (file_gone(errno)) return look::gone;
    throw path_error(errno, "dibs::dot_lock: cannot stat lock file", path);
  }
  check_regular(st, path);
  st_out = stamp_of(st);
  return look::opened;
}

/// Effects: reads up to `size` bytes from the start of the file `fd` into
/// `buf`, their number into `n`.
/// Returns: opened (read), gone or unreadable (NFS checks permission on
/// each read, not only at open). Throws: std::system_error naming the path.
inline look read_head(const handle& fd, char* buf, std::size_t size, std::size_t& n,
                      const std::filesystem::path& path) {
  ssize_t r;
  do r = ::pread(fd.get(), buf, size, 0);
  while (r < 0 && errno == EINTR);
  if (r < 0) {
    const int e = errno;
    if (file_gone(e)) return look::gone;
    if (not_ours_to_read(e)) return look::unreadable;
    throw path_error(e, "dibs::dot_lock: cannot read lock file", path);
  }
  n = static_cast<std::size_t>(r);
  return look::opened;
}

/// Effects: takes, without waiting, the lock that one breaker at a time
/// holds on the judged file (a flock; a dibs holder's unlock takes it too).
/// Returns: true if taken (it is released when `fd` is closed).
inline bool try_break_lock(const handle& fd) noexcept { return ::flock(fd.get(), LOCK_EX | LOCK_NB) == 0; }

/// Returns: true if `path` names the file of `judged`, unchanged.
inline bool path_unchanged(const std::filesystem::path& path, const stamp& judged) noexcept {
  struct ::stat now {};
  return ::lstat(path.c_str(), &now) == 0 && stamp_of(now).unchanged(judged);
}

/// Returns: true if the file open as `fd` is `judged`, unchanged (not touched).
inline bool handle_unchanged(const handle& fd, const stamp& judged) noexcept {
  struct ::stat now {};
  return ::fstat(fd.get(), &now) == 0 && stamp_of(now).unchanged(judged);
}

/// Returns: a name in the lock's directory for a stale lock moved away.
inline std::filesystem::path broken_name(const std::filesystem::path& path) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{}.broken.{}.{}", path.string(), current_pid(), hex_digits(rng(), 16));
}

enum class moved { done, gone, refused };

/// Effects: rename()s `path` to `to`, atomically.
/// Returns: done; gone (nothing at the path); refused (not ours to move:
/// another user's, in a sticky directory). Throws: std::system_error
/// naming the path for another error.
inline moved move_away(const std::filesystem::path& path, const std::filesystem::path& to) {
  if (::rename(path.c_str(), to.c_str()) == 0) return moved::done;
  if (file_gone(errno)) return moved::gone;
  if (not_ours_to_read(errno)) return moved::refused;
  throw path_error(errno, "dibs::dot_lock: cannot move away the stale lock file", path);
}

/// Effects: removes the file `name` (a moved-away stale lock), best effort.
inline void remove_moved(const std::filesystem::path& name) noexcept { ::unlink(name.c_str()); }

/// Effects: moves `from` back to `path` unless a file is there (never
/// clobbers); where it cannot, `from` stays.
inline void move_back(const std::filesystem::path& from, const std::filesystem::path& path) noexcept {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) != 0 &&
      (errno == EINVAL || errno == ENOSYS) && ::link(from.c_str(), path.c_str()) == 0)
    ::unlink(from.c_str());  // a filesystem without RENAME_NOREPLACE: link never clobbers either
}

/// Returns: true if `path` names the file `own` (whatever its size and mtime).
inline bool path_names(const std::filesystem::path& path, const stamp& own) noexcept {
  struct ::stat st {};
  return ::lstat(path.c_str(), &st) == 0 && st.st_dev == own.dev && st.st_ino == own.ino;
}

/// Effects: sets the mtime of the file `fd` to now. Returns: true if done.
inline bool touch(const handle& fd) noexcept { return ::futimens(fd.get(), nullptr) == 0; }

enum class removal { removed, left, busy };

/// Effects: removes the lock file `path` if it still names `own` (open as
/// `fd`), checked under the flock breakers take, which it waits a second
/// for at most (a breaker holds it for a few system calls).
/// Returns: removed; left (the path names another file, or none); busy (the
/// flock stayed taken: a breaker stopped mid-break; the file is left).
/// Throws: std::system_error naming the path if the file cannot be removed.
inline removal remove_own(const handle& fd, const std::filesystem::path& path, const stamp& own) {
  const exponential_backoff schedule{std::chrono::microseconds{50}, 2.0, std::chrono::milliseconds{5}, jitter::equal};
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds{1};
  for (std::uint64_t n = 0;; ++n) {
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) == 0) break;
    if (errno != EWOULDBLOCK && errno != EINTR) break;  // no flock here (some NFS): judge by inode alone
    if (std::chrono::steady_clock::now() >= end) return removal::busy;
    std::this_thread::sleep_for(schedule.delay(n, {}, 0.5));
  }
  if (!fd || !path_names(path, own)) return removal::left;
  if (::unlink(path.c_str()) != 0) {
    if (file_gone(errno)) return removal::left;
    throw path_error(errno, "dibs::dot_lock: cannot remove lock file", path);
  }
  return removal::removed;
}

}  // namespace dibs::detail::dot_file
