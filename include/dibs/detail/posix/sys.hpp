// dibs/detail/posix/sys.hpp: small helpers for POSIX calls: errors that name the
// path and say what to check, and EINTR-safe wrappers.
#pragma once

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <ctime>
#include <cerrno>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <fmt/format.h>

namespace dibs::detail {

/// Permissions given to new files (the umask applies).
using file_mode = mode_t;

/// A process id.
using process_id = pid_t;

/// Returns: the path as text, for messages.
inline std::string path_text(const std::filesystem::path& p) { return p.string(); }

/// Returns: the path of the file `name` (UTF-8, as dibs keeps names) in `dir`.
inline std::filesystem::path child_path(const std::filesystem::path& dir, std::string_view name) { return dir / name; }

/// Effects: `out` = the local time of `t`. Returns: false if it cannot be told.
inline bool local_time(std::time_t t, std::tm& out) noexcept { return ::localtime_r(&t, &out) != nullptr; }

/// Returns: what a person should check for errno value `e`, or "".
inline const char* errno_hint(int e) noexcept {
  switch (e) {
    case ENOENT: return " (does the directory exist?)";
    case EACCES:
    case EPERM: return " (may this user write there? check the file's and the directory's permissions)";
    case EISDIR: return " (the path names a directory, not a file)";
    case ENOTDIR: return " (a part of the path is not a directory)";
    case ENOSPC:
    case EDQUOT: return " (the filesystem is full)";
    case EROFS: return " (the filesystem is mounted read-only)";
    case ENAMETOOLONG: return " (the path is too long)";
    case ELOOP: return " (too many symbolic links)";
    case EMFILE:
    case ENFILE: return " (too many open files)";
    default: return "";
  }
}

/// Returns: a std::system_error for errno value `e` whose message reads
/// "<what> '<path>': <strerror>< hint>".
inline std::system_error path_error(int e, std::string_view what, const std::filesystem::path& path) {
  return std::system_error(std::error_code{e, std::system_category()},
                           fmt::format("{} '{}'{}", what, path.string(), errno_hint(e)));
}

/// A file descriptor that closes itself.
class unique_fd {
public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  ~unique_fd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept {
    // close() is not retried on EINTR: on Linux the descriptor is gone either way.
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

private:
  int fd_ = -1;
};

/// Effects: open(2), retried on EINTR. Returns: the descriptor, or -1 with errno set.
inline int open_retry(const char* path, int flags, mode_t mode = 0) noexcept {
  int fd;
  do fd = ::open(path, flags, mode);
  while (fd < 0 && errno == EINTR);
  return fd;
}

/// Returns: this process's pid, without a system call after the first
/// (glibc no longer caches getpid). A child made by fork() finds the cache
/// cleared by an atfork handler and asks again.
inline process_id current_pid() noexcept {
  static std::atomic<process_id> cached{0};
  process_id p = cached.load(std::memory_order_relaxed);
  if (p != 0) return p;
  static const bool registered = [] {
    ::pthread_atfork(nullptr, nullptr, [] { cached.store(0, std::memory_order_relaxed); });
    return true;
  }();
  (void)registered;
  p = ::getpid();
  cached.store(p, std::memory_order_relaxed);
  return p;
}

}  // namespace dibs::detail
