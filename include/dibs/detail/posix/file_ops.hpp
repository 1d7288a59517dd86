// dibs/detail/posix/file_ops.hpp: the file operations that a record write
// (file_store) and a log append (shared_log) are made of, on POSIX (Linux):
// whole writes that go on after a short one, data syncs, the end of a file,
// whole-file locks, and renames that never replace a file by accident.
// Separate so that the components say what they do to a file and a port to
// another system gives these names a body of its own (detail/win32/).
// Each returns 0 or the errno of what failed, and throws nothing: the caller
// knows which path and what step to name in its message.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <filesystem>

namespace dibs::detail {

/// What a file is opened as, and what a system call fails with.
using native_file = int;
using sys_error = int;

/// Effects: reads up to `size` bytes at `offset` into `buf` (pread).
/// Returns: the number read (0 at the end), or -1 with the errno in `e`.
inline std::int64_t read_at(int fd, char* buf, std::size_t size, std::uint64_t offset, int& e) noexcept {
  ssize_t n;
  do n = ::pread(fd, buf, size, static_cast<off_t>(offset));
  while (n < 0 && errno == EINTR);
  if (n < 0) e = errno;
  return n;
}

/// Effects: writes all of [data, data + size) at the descriptor's offset,
/// going on after a short write. Returns: 0, or the errno of the write that
/// failed (ENOSPC for one that wrote nothing).
inline int write_all(int fd, const char* data, std::size_t size) noexcept {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : ENOSPC;
    data += n;
    size -= static_cast<std::size_t>(n);
  }
  return 0;
}

/// Effects: writes all of iov[0, n) in as few system calls as it can (one,
/// unless the kernel writes less), going on after a short write; `iov` is
/// consumed. Returns: 0, or the errno of the write that failed (ENOSPC for
/// one that wrote nothing).
inline int write_all(int fd, iovec* iov, int n) noexcept {
  while (n > 0) {
    const ssize_t k = ::writev(fd, iov, std::min(n, IOV_MAX));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return k < 0 ? errno : ENOSPC;
    auto left = static_cast<std::size_t>(k);
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return 0;
}

/// Effects: writes [data, data + size) at `offset` in one system call (a
/// caller relies on it touching no other bytes, and on it being one write).
/// Returns: 0, or the errno of the failure (ENOSPC for a short write).
inline int write_at(int fd, const char* data, std::size_t size, std::uint64_t offset) noexcept {
  ssize_t n;
  do n = ::pwrite(fd, data, size, static_cast<off_t>(offset));
  while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(size)) return 0;
  return n < 0 ? errno : ENOSPC;
}

/// Effects: forces the file's data (and the metadata needed to read it) to
/// stable storage. Returns: 0 or errno.
inline int sync_data(int fd) noexcept { return ::fdatasync(fd) == 0 ? 0 : errno; }

/// Effects: forces the file, data and metadata, to stable storage. Returns: 0 or errno.
inline int sync_file(int fd) noexcept { return ::fsync(fd) == 0 ? 0 : errno; }

/// Returns: the size of the file open on `fd`, or -1 with errno set. (lseek,
/// not fstat: a stat marks the timestamps as seen, and the kernel then gives
/// the next write a fresh one, dirtying the inode on every write.)
inline std::int64_t end_of_file(int fd) noexcept { return ::lseek(fd, 0, SEEK_END); }

/// Effects: cuts the file open on `fd` (or at `path`) to `size` bytes.
/// Returns: 0 or errno.
inline int truncate_file(int fd, std::uint64_t size) noexcept {
  return ::ftruncate(fd, static_cast<off_t>(size)) == 0 ? 0 : errno;
}
inline int truncate_file(const std::filesystem::path& path, std::uint64_t size) noexcept {
  return ::truncate(path.c_str(), static_cast<off_t>(size)) == 0 ? 0 : errno;
}

enum class file_lock_kind { shared, exclusive };

/// Effects: takes the whole-file lock (flock) of `fd`, shared or exclusive;
/// without `wait` only if it is free. The kernel releases it when the last
/// descriptor of this open file is closed, also when its process dies.
/// Returns: 0, EWOULDBLOCK if it is held (no `wait`), or another errno.
inline int lock_whole_file(int fd, file_lock_kind kind, bool wait) noexcept {
  const int op = (kind == file_lock_kind::shared ? LOCK_SH : LOCK_EX) | (wait ? 0 : LOCK_NB);
  for (;;) {
    if (::flock(fd, op) == 0) return 0;
    if (errno != EINTR) return errno;
  }
}

/// Effects: renames `from` to `to` unless `to` exists (atomic: never replaces
/// a file). Returns: 0, EEXIST if `to` exists, or another errno.
inline int rename_no_replace(const std::filesystem::path& from, const std::filesystem::path& to) noexcept {
  return ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0 ? 0 : errno;
}

/// Effects: atomically swaps what `a` and `b` name. Returns: 0; EINVAL,
/// ENOSYS or ENOTSUP where the filesystem cannot (see exchange_unsupported);
/// or another errno.
inline int exchange_files(const std::filesystem::path& a, const std::filesystem::path& b) noexcept {
  return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0 ? 0 : errno;
}
/// Returns: true if exchange_files() failed with `e` because the filesystem
/// has no atomic exchange (rename_over() is then the way).
inline bool exchange_unsupported(int e) noexcept { return e == EINVAL || e == ENOSYS || e == ENOTSUP; }

/// Effects: atomically makes `to` name the file `from` names, replacing what
/// `to` named. Returns: 0 or errno.
inline int rename_over(const std::filesystem::path& from, const std::filesystem::path& to) noexcept {
  return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno;
}

}  // namespace dibs::detail
