// dibs/detail/posix/record_file.hpp: reaching a file_store record file on
// POSIX: opening it (never through a symbolic link, never anything but a
// regular file, never blocking on a FIFO), the handle an operation holds it
// through (closed in a child made by fork(), so a child never keeps a flock
// its parent took for a moment), whether its path still names it, creating
// a record by link(), and the store's directory. The twin of
// detail/win32/record_file.hpp; the policy is stores/file_store.hpp.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include <dibs/detail/posix/file_ops.hpp>
#include <dibs/detail/posix/fork_fds.hpp>
#include <dibs/detail/posix/sys.hpp>

namespace dibs::detail {

/// Records are rewritten in place only where the store asks (in_place, a
/// sticky directory); else by a new file exchanged in (put_in_place).
inline constexpr bool records_always_in_place = false;

// Record files are opened without following a symbolic link, and without
// blocking on a FIFO someone put there (check_regular_record reports both).
inline constexpr int record_open_flags = O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY;

inline std::system_error record_open_error(int e, const std::filesystem::path& path) {
  struct ::stat st {};
  if (e == ELOOP && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    return std::system_error(std::error_code{e, std::system_category()},
                             fmt::format("dibs::file_store: record path '{}' is a symbolic link; dibs does not follow "
                                         "a link there (in a shared directory it could point anywhere): remove it",
                                         path.string()));
  return path_error(e, "dibs::file_store: cannot open record", path);
}

inline void check_regular_record(const struct ::stat& st, const std::filesystem::path& path) {
  if (!S_ISREG(st.st_mode))
    throw std::system_error(std::error_code{S_ISDIR(st.st_mode) ? EISDIR : EINVAL, std::system_category()},
                            fmt::format("dibs::file_store: record path '{}' is not a regular file (a {}): move it away",
                                        path.string(), S_ISDIR(st.st_mode) ? "directory" : "device, FIFO or socket"));
}

// A record file opened through fork_fds (so a child made by fork() never
// keeps a flock taken on it), with the stat it had when it was opened.
class record_handle {
public:
  record_handle() = default;
  record_handle(const record_handle&) = delete;
  record_handle& operator=(const record_handle&) = delete;
  record_handle(record_handle&& o) noexcept
      : fd_(std::exchange(o.fd_, -1)), st_(o.st_), writable_(o.writable_), name_(std::move(o.name_)) {}
  record_handle& operator=(record_handle&& o) noexcept {
    if (this != &o) {
      close();
      fd_ = std::exchange(o.fd_, -1);
      st_ = o.st_;
      writable_ = o.writable_;
      name_ = std::move(o.name_);
    }
    return *this;
  }
  /// Effects: closes the descriptor, which drops its flock.
  ~record_handle() { close(); }

  /// Effects: opens `path` (the file `name` of its directory), for reading
  /// and writing if `writable`, else for reading.
  /// Returns: 0, or the errno of the open or the fstat.
  int open(const std::filesystem::path& path, std::string_view name, bool writable) {
    close();
    fd_ = fork_fds::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | record_open_flags);
    if (fd_ < 0) return errno;
    if (::fstat(fd_, &st_) != 0) {
      const int e = errno;
      close();
      return e;
    }
    writable_ = writable;
    name_.assign(name);
    return 0;
  }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Returns: the file's stat when it was opened (its identity and type do not change).
  const struct ::stat& stat() const noexcept { return st_; }
  bool writable() const noexcept { return writable_; }
  const std::string& name() const noexcept { return name_; }

  /// Throws: std::system_error naming `path` unless this is a regular file.
  void check_regular(const std::filesystem::path& path) const { check_regular_record(st_, path); }

  /// Effects: lstat of `path` (under the record's flock: whether a writer
  /// replaced the file while this one waited, or since it was kept).
  /// Returns: 0 with `same` saying whether `path` names this file, or the
  /// errno of the lstat (ENOENT: nothing is there now).
  int names_this(const std::filesystem::path& path, bool& same) const noexcept {
    struct ::stat now {};
    if (::lstat(path.c_str(), &now) != 0) return errno;
    same = now.st_ino == st_.st_ino && now.st_dev == st_.st_dev;
    return 0;
  }

  /// Effects: drops the descriptor's flock. Returns: false if that failed
  /// (then the descriptor must be closed, not kept).
  bool unlock() const noexcept { return ::flock(fd_, LOCK_UN) == 0; }

  /// Effects: forgets the descriptor without closing it (in a child made by
  /// fork() it was closed at the fork, and its number may name another file).
  void forget() noexcept { fd_ = -1; }

  void close() noexcept {
    if (fd_ >= 0) fork_fds::close(std::exchange(fd_, -1));
  }

private:
  int fd_ = -1;
  struct ::stat st_ {};
  bool writable_ = false;
  std::string name_;  // the record's file name in its directory
};

// A record file opened for reading only, for a read without the store's
// lock (closed in a child made by fork(), as above).
class record_reader {
public:
  explicit record_reader(const std::filesystem::path& path)
      : fd_(path.c_str(), O_RDONLY | record_open_flags), error_(fd_ ? 0 : errno) {}
  int get() const noexcept { return fd_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(fd_); }
  /// Returns: the errno of the open, if it failed.
  int error() const noexcept { return error_; }

private:
  fork_closed_fd fd_;
  int error_;
};

/// Effects: makes `path` name the file `tmp` names, unless `path` exists
/// (link(2): atomic, never replaces). Returns: 0, or the errno (EEXIST if
/// `path` exists).
inline int link_new_record(const std::filesystem::path& tmp, const std::filesystem::path& path) noexcept {
  return ::link(tmp.c_str(), path.c_str()) == 0 ? 0 : errno;
}

/// Effects: writes `data` to the new file `tmp` (created with exactly
/// `mode`, whatever the umask: a record other users share must stay
/// writable by them), fsync'd with `sync`. On failure nothing is left.
/// Returns: 0, or the errno with `what` saying which step failed.
inline int create_temporary_file(const std::filesystem::path& tmp, mode_t mode, bool sync, std::string_view data,
                                 const char*& what) {
  unique_fd fd{open_retry(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode)};
  if (!fd) {
    what = "dibs::file_store: cannot create a temporary file in";
    return errno;
  }
  int e = 0;
  if (::fchmod(fd.get(), mode) != 0) {
    e = errno;
    what = "dibs::file_store: cannot set the permissions of a temporary file in";
  } else if ((e = write_all(fd.get(), data.data(), data.size())) != 0) {
    what = "dibs::file_store: cannot write a record into";
  } else if (sync && (e = sync_file(fd.get())) != 0) {
    what = "dibs::file_store: cannot fsync a record in";
  }
  if (e != 0) ::unlink(tmp.c_str());
  return e;
}

/// Effects: creates the empty file `path` with exactly `mode` if there is
/// none (an entry of file_store's queue view: its name is all it says).
/// Returns: 0 (also if it existed), or the errno (ENOENT: no directory).
inline int create_empty_file(const std::filesystem::path& path, mode_t mode) noexcept {
  unique_fd fd{open_retry(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, mode)};
  if (!fd) return errno;
  (void)::fchmod(fd.get(), mode);  // whatever the umask; a failure leaves it readable as made, which is enough
  return 0;
}

/// Effects: removes the file `path`. Returns: 0 or errno.
inline int remove_file(const std::filesystem::path& path) noexcept {
  return ::unlink(path.c_str()) == 0 ? 0 : errno;
}

/// Returns: true if `e` says a file or directory on the path is not there.
inline bool file_missing(int e) noexcept { return e == ENOENT; }
/// Returns: true if `e` says the file exists already.
inline bool file_exists(int e) noexcept { return e == EEXIST; }
/// Returns: true if `e` says this user may not write the file.
inline bool write_denied(int e) noexcept { return e == EACCES || e == EPERM || e == EROFS; }
/// Returns: true if `e` says a lock is held by another (try again later).
inline bool lock_busy(int e) noexcept { return e == EWOULDBLOCK; }

/// Effects: checks that `dir` is a directory this user may create files in.
/// Returns: true if it is sticky (/tmp: only a file's owner may replace it).
/// Throws: std::system_error naming the directory.
inline bool check_record_directory(const std::filesystem::path& dir) {
  struct ::stat st {};
  if (::stat(dir.c_str(), &st) != 0) throw path_error(errno, "dibs::file_store: cannot open directory", dir);
  if (!S_ISDIR(st.st_mode)) throw path_error(ENOTDIR, "dibs::file_store: not a directory:", dir);
  if (::access(dir.c_str(), W_OK | X_OK) != 0) throw path_error(errno, "dibs::file_store: cannot write to directory", dir);
  return (st.st_mode & S_ISVTX) != 0;
}

}  // namespace dibs::detail
