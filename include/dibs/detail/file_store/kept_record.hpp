// dibs/detail/file_store/kept_record.hpp: the descriptor of a record file
// rewritten in place, kept open (without its flock) from one operation to
// the next on the same record, and the handle an operation holds the record
// through. A lock_file's lock and unlock each cost an open, an fstat and a
// close less (docs/BENCHMARKS.md, "Fair handoff"): the file's identity is
// known from when it was opened, and the operation still checks under the
// flock, with one lstat, that the path names that file. Separate because
// whether a kept descriptor may be used (same record, same process, same
// file) is a rule of its own, which the compare-and-set relies on.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <cerrno>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <dibs/detail/posix/fork_fds.hpp>
#include <dibs/detail/posix/sys.hpp>

namespace dibs::detail {

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

  /// Effects: opens `path` (the file `name` of its directory) with `flags`.
  /// Returns: false with errno set if it cannot be opened or fstat'ed.
  bool open(const char* path, std::string_view name, int flags) {
    close();
    fd_ = fork_fds::open(path, flags);
    if (fd_ < 0) return false;
    if (::fstat(fd_, &st_) != 0) {
      const int e = errno;
      close();
      errno = e;
      return false;
    }
    writable_ = (flags & O_ACCMODE) == O_RDWR;
    name_.assign(name);
    return true;
  }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Returns: the file's stat when it was opened (its identity and type do not change).
  const struct ::stat& stat() const noexcept { return st_; }
  bool writable() const noexcept { return writable_; }
  const std::string& name() const noexcept { return name_; }
  /// Returns: true if `now` (an lstat of the record's path) is this file.
  bool same_file(const struct ::stat& now) const noexcept { return now.st_ino == st_.st_ino && now.st_dev == st_.st_dev; }

  /// Effects: drops the descriptor's flock. Returns: false if that failed
  /// (then the descriptor must be closed, not kept).
  bool unlock() const noexcept { return ::flock(fd_, LOCK_UN) == 0; }

private:
  friend class kept_record;
  void close() noexcept {
    if (fd_ >= 0) fork_fds::close(std::exchange(fd_, -1));
  }

  int fd_ = -1;
  struct ::stat st_ {};
  bool writable_ = false;
  std::string name_;  // the record's file name in its directory
};

// The one record descriptor a file_store keeps between operations (of the
// last record it rewrote in place). Shared by the store's threads: an
// operation takes it out and puts it back, so two never use it at once.
// Copying a store does not copy it.
class kept_record {
public:
  kept_record() = default;
  kept_record(const kept_record&) noexcept {}
  kept_record& operator=(const kept_record& o) noexcept {
    if (this != &o) drop();
    return *this;
  }
  kept_record(kept_record&& o) noexcept {
    std::lock_guard g{o.m_};
    h_ = std::move(o.h_);
    pid_ = std::exchange(o.pid_, 0);
  }
  kept_record& operator=(kept_record&& o) noexcept {
    if (this != &o) {
      record_handle h;
      pid_t pid;
      {
        std::lock_guard g{o.m_};
        h = std::move(o.h_);
        pid = std::exchange(o.pid_, 0);
      }
      drop();
      std::lock_guard g{m_};
      h_ = std::move(h);
      pid_ = pid;
    }
    return *this;
  }
  ~kept_record() { drop(); }

  /// Returns: the kept descriptor if it is of the record file `name` and was
  /// opened by this process (in a child made by fork() it was closed at the
  /// fork, and its number may name another file now: forgotten, not
  /// closed); else an empty handle. Another record's descriptor is closed.
  record_handle take(std::string_view name) noexcept {
    record_handle h;
    {
      std::lock_guard g{m_};
      if (!h_) return h;
      if (pid_ != current_pid()) {
        h_.fd_ = -1;
        return h;
      }
      h = std::move(h_);
    }
    if (h.name() != name) h.close();
    return h;
  }

  /// Requires: `h` is writable, holds no flock, and its path named it under
  /// the flock a moment ago. Effects: keeps it for the next operation
  /// (closing the one kept before, if another thread put one back meanwhile).
  void keep(record_handle&& h) noexcept {
    record_handle old;
    std::lock_guard g{m_};
    if (pid_ == current_pid()) old = std::move(h_);
    else h_.fd_ = -1;
    h_ = std::move(h);
    pid_ = current_pid();
  }

private:
  void drop() noexcept {
    std::lock_guard g{m_};
    if (pid_ != current_pid()) h_.fd_ = -1;
    h_.close();
    pid_ = 0;
  }

  std::mutex m_;
  record_handle h_;
  pid_t pid_ = 0;
};

}  // namespace dibs::detail
