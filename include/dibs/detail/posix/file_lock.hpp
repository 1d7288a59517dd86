// dibs/detail/posix/file_lock.hpp: the kernel's side of dibs::file_mutex on
// POSIX: opening the lock file, flock(2) and POSIX record locks, the owner
// line, and the fork handler. The policy (threads of one process, timed and
// cancellable waits, fork) is file_mutex.hpp's; the Win32 twin of this file
// is detail/win32/file_lock.hpp.
#pragma once

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <utility>

#include <fmt/format.h>

#include <dibs/detail/posix/sys.hpp>

namespace dibs::detail::file_lock {

/// What identifies a file, whatever name it was opened by.
struct identity {
  dev_t dev;
  ino_t ino;
  auto operator<=>(const identity&) const = default;
};

using handle = unique_fd;
using native_type = int;
inline native_type native(const handle& h) noexcept { return h.get(); }
inline native_type no_native() noexcept { return -1; }

struct opened {
  handle h;
  identity id;
  bool writable;
};

/// Effects: opens (creating with `mode` if missing) the lock file at `path`,
/// close-on-exec. With `read_only_ok`, an existing file this user may only
/// read is opened read-only (flock locks still work on it).
/// Throws: std::system_error naming the path; EINVAL if it is not a regular file.
inline opened open(const std::filesystem::path& path, mode_t mode, bool read_only_ok) {
  bool writable = true;
  int fd = open_retry(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOCTTY, mode);
  if (fd < 0 && (errno == EACCES || errno == EROFS) && read_only_ok) {
    // If there is no file to open read-only, the error to report is the first one.
    const int first = errno;
    writable = false;
    fd = open_retry(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) errno = first;
  }
  if (fd < 0) throw path_error(errno, "dibs::file_mutex: cannot open lock file", path);
  unique_fd owned{fd};
  struct ::stat st {};
  if (::fstat(fd, &st) != 0) throw path_error(errno, "dibs::file_mutex: cannot stat lock file", path);
  if (!S_ISREG(st.st_mode)) throw path_error(EINVAL, "dibs::file_mutex: lock file is not a regular file:", path);
  return {std::move(owned), identity{st.st_dev, st.st_ino}, writable};
}

inline std::atomic<bool>& ofd_unsupported() {
  static std::atomic<bool> v{false};
  return v;
}
inline int posix_cmd(bool block) noexcept {
#ifdef F_OFD_SETLK
  if (!ofd_unsupported().load(std::memory_order_relaxed)) return block ? F_OFD_SETLKW : F_OFD_SETLK;
#endif
  return block ? F_SETLKW : F_SETLK;
}

/// Effects: one kernel call (repeated on EINTR): flock(2) or, with
/// `record_lock`, a POSIX record lock on the whole file (OFD where the kernel
/// has it), exclusive or shared; `block` waits in the kernel.
/// Returns: true if acquired, false if held elsewhere (only without `block`).
/// Throws: std::system_error naming the path if the kernel refuses.
inline bool try_lock(const handle& h, bool record_lock, bool exclusive, bool block, const std::filesystem::path& path) {
  for (;;) {
    int rc;
    if (!record_lock) {
      rc = ::flock(h.get(), (exclusive ? LOCK_EX : LOCK_SH) | (block ? 0 : LOCK_NB));
    } else {
      struct ::flock fl {};
      fl.l_type = static_cast<short>(exclusive ? F_WRLCK : F_RDLCK);
      fl.l_whence = SEEK_SET;
      rc = ::fcntl(h.get(), posix_cmd(block), &fl);
#ifdef F_OFD_SETLK
      if (rc != 0 && errno == EINVAL && !ofd_unsupported().load(std::memory_order_relaxed)) {
        ofd_unsupported().store(true);  // kernel before 3.15: classic process-owned locks
        continue;
      }
#endif
    }
    if (rc == 0) return true;
    if (errno == EINTR) continue;
    if (!block && (errno == EWOULDBLOCK || errno == EAGAIN || errno == EACCES)) return false;
    throw path_error(errno, exclusive ? "dibs::file_mutex: cannot lock" : "dibs::file_mutex: cannot lock shared", path);
  }
}

/// Effects: releases this descriptor's lock of that kind.
inline void unlock(const handle& h, bool record_lock) noexcept {
  int rc;
  if (!record_lock) {
    do rc = ::flock(h.get(), LOCK_UN);
    while (rc != 0 && errno == EINTR);
  } else {
    struct ::flock fl {};
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    do rc = ::fcntl(h.get(), posix_cmd(false), &fl);
    while (rc != 0 && errno == EINTR);
  }
  // Unlocking a lock we hold cannot fail on Linux; if it ever does, closing
  // the descriptor at exit releases it, so there is nothing better to do here.
  (void)rc;
}

/// Effects: writes `line` at the start of the file, best effort.
inline void write_owner(const handle& h, const std::string& line) noexcept {
  (void)!::pwrite(h.get(), line.data(), line.size(), 0);
}

/// Returns: "pid <pid> host <host>".
inline std::string owner_text() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return fmt::format("pid {} host {}", ::getpid(), host);
}

/// Effects: registers fork handlers (pthread_atfork).
inline void at_fork(void (*prepare)(), void (*parent)(), void (*child)()) { ::pthread_atfork(prepare, parent, child); }

}  // namespace dibs::detail::file_lock
