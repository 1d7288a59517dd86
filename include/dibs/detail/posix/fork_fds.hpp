// dibs/detail/posix/fork_fds.hpp: descriptors that carry a kernel lock for one
// operation of this process, closed in a child made by fork().
//
// A flock belongs to the open file description, and fork() gives the child a
// copy of every descriptor. A thread of the parent that holds a record's
// flock for a moment would otherwise leave the child holding it for as long
// as the child lives, after the parent is killed too: "the kernel releases
// it when the holder dies" would be false. In the child the threads that own
// these descriptors do not exist, so nothing else will close them.
#pragma once

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include <dibs/detail/posix/sys.hpp>

namespace dibs::detail {

class fork_fds {
public:
  /// Effects: opens `path` (open_retry) and registers the descriptor, both
  /// under the registry's lock, which fork() waits for: a fork between the
  /// open and the registration would leave the child an unregistered copy.
  /// Returns: the descriptor, or -1 with errno set.
  static int open(const char* path, int flags, mode_t mode = 0) {
    auto& r = instance();
    std::lock_guard g{r.m_};
    r.fds_.reserve(r.fds_.size() + 1);  // may throw before the open, not after
    const int fd = open_retry(path, flags, mode);
    if (fd >= 0) r.fds_.push_back(fd);
    return fd;
  }
  /// Effects: unregisters and closes `fd`, under the same lock (a fork
  /// between the two would leave the child an unregistered copy).
  static void close(int fd) noexcept {
    auto& r = instance();
    std::lock_guard g{r.m_};
    if (const auto it = std::find(r.fds_.begin(), r.fds_.end(), fd); it != r.fds_.end()) {
      *it = r.fds_.back();
      r.fds_.pop_back();
    }
    ::close(fd);
  }

private:
  static fork_fds& instance() {
    // Leaked: a descriptor may be registered while static destructors run.
    static fork_fds* r = [] {
      auto* p = new fork_fds;
      p->fds_.reserve(16);
      ::pthread_atfork([] { instance().m_.lock(); }, [] { instance().m_.unlock(); },
                       [] {
                         auto& self = instance();
                         for (const int fd : self.fds_) ::close(fd);
                         self.fds_.clear();
                         self.m_.unlock();
                       });
      return p;
    }();
    return *r;
  }

  std::mutex m_;
  std::vector<int> fds_;
};

/// A descriptor opened through fork_fds::open, registered while it lives
/// and closed at its end.
class fork_closed_fd {
public:
  fork_closed_fd(const char* path, int flags) : fd_(fork_fds::open(path, flags)) {}
  fork_closed_fd(const fork_closed_fd&) = delete;
  fork_closed_fd& operator=(const fork_closed_fd&) = delete;
  ~fork_closed_fd() {
    if (fd_ >= 0) fork_fds::close(fd_);
  }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }

private:
  int fd_;
};

}  // namespace dibs::detail
