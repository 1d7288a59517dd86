// dibs/detail/posix/file_watch.hpp: waiting until a file in a directory may
// have changed, on Linux (inotify). Separate so that file_store says what it
// waits for and a port to another system gives the wait a body of its own
// (detail/win32/: ReadDirectoryChangesW).
#pragma once

#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <thread>

#include <dibs/detail/posix/sys.hpp>

namespace dibs::detail {

/// Effects: blocks until the file `name` in `dir` (whose path is `file`) may
/// have changed: put in place by a create, rename or delete in `dir`, or
/// written in place; or until `timeout` passes. Where no watch can be set
/// up, sleeps for `timeout`. (Not on a close after writing: a writer that
/// opens a file to write and changes nothing would wake every waiter.)
/// Returns: true if a change was seen.
inline bool wait_for_file_change(const std::filesystem::path& dir, const std::filesystem::path& file,
                                 const std::string& name, std::chrono::nanoseconds timeout) {
  unique_fd fd{::inotify_init1(IN_CLOEXEC | IN_NONBLOCK)};
  const auto sleep_instead = [&] {
    std::this_thread::sleep_for(timeout);
    return false;
  };
  if (!fd) return sleep_instead();
  if (::inotify_add_watch(fd.get(), dir.c_str(), IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM) < 0)
    return sleep_instead();
  // Writes in place are watched on the file itself: IN_MODIFY on the
  // directory would also report every write to every other file there
  // (a lock file usually sits beside the log it guards).
  const int file_watch = ::inotify_add_watch(fd.get(), file.c_str(), IN_MODIFY);  // -1: no file yet
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
    pollfd p{fd.get(), POLLIN, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(0, left.count() + 1)));
    if (rc <= 0) return false;
    alignas(inotify_event) char buf[4096];
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    for (ssize_t off = 0; off < n;) {
      const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
      if ((ev->len > 0 && name == ev->name) || (file_watch >= 0 && ev->wd == file_watch)) return true;
      off += static_cast<ssize_t>(sizeof(inotify_event) + ev->len);
    }
    if (std::chrono::steady_clock::now() >= end) return false;
  }
}

}  // namespace dibs::detail
