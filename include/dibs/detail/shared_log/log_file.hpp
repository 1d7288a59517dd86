// dibs/detail/shared_log/log_file.hpp: the log file a shared_log appends to:
// its path resolved once to the one name every writer keys the lock by, its
// descriptor (opened again after a rotation), and the identity, owner and
// permissions of the file it is open on. Separate from the appending: this
// is what makes two writers agree that they write one file, which the lock
// only protects if they do.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include <dibs/detail/posix/sys.hpp>
#include <dibs/detail/posix/directory.hpp>
#include <dibs/detail/posix/file_ops.hpp>
#include <dibs/detail/shared_log/log_names.hpp>

namespace dibs::detail {

class log_file {
public:
  // Effects: resolves `given` and opens the log (creating it with `mode`,
  // less the umask); `sync`: the log's directory is synced after every open.
  log_file(const std::filesystem::path& given, mode_t mode, bool sync) : mode_(mode), sync_(sync) {
    open_resolved(given);
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  int fd() const noexcept { return fd_.get(); }
  // Of the file fd() is open on.
  std::uint64_t dev() const noexcept { return dev_; }
  std::uint64_t ino() const noexcept { return ino_; }
  // Its permission bits, owner and group, which a lock file this writer
  // creates takes on.
  mode_t mode() const noexcept { return log_mode_; }
  uid_t uid() const noexcept { return uid_; }
  gid_t gid() const noexcept { return gid_; }

  // Opens the current log file (again, after a rotation).
  void open() {
    const int fd = open_retry(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, mode_);
    if (fd < 0) throw path_error(errno, "dibs::shared_log: cannot open log file", path_);
    struct ::stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      const int e = errno;
      ::close(fd);
      throw path_error(S_ISDIR(st.st_mode) ? EISDIR : e ? e : EINVAL, "dibs::shared_log: log is not a regular file:",
                       path_);
    }
    // The lock is keyed by one name of the file. Symbolic links are resolved
    // to it, but hard links are names of equal standing: writers through two
    // of them would take two locks, and lose and tear records.
    if (st.st_nlink > 1) {
      ::close(fd);
      throw std::system_error(
          std::error_code{EMLINK, std::system_category()},
          fmt::format("dibs::shared_log: log file '{}' has {} names (hard links): writers through different names "
                      "would not share one lock; remove the extra links or give every writer the same name",
                      path_.string(), static_cast<unsigned long>(st.st_nlink)));
    }
    fd_.reset(fd);
    dev_ = static_cast<std::uint64_t>(st.st_dev);
    ino_ = static_cast<std::uint64_t>(st.st_ino);
    log_mode_ = st.st_mode & 0666;
    uid_ = st.st_uid;
    gid_ = st.st_gid;
    // A record that must be on disk needs the file's name there too (it may
    // have just been created, or renamed by a rotation).
    if (sync_) sync_log_directory();
  }

  // Effects: forces the log file to stable storage: through this
  // descriptor if `current` (it is still the log: it was opened before any
  // write it must answer for failed, so its fdatasync reports that failure;
  // a descriptor opened later might not), else through one opened now.
  void sync(bool current) const {
    unique_fd other;
    int fd = fd_.get();
    if (!current) {
      other.reset(open_retry(path_.c_str(), O_WRONLY | O_CLOEXEC));
      if (!other) throw path_error(errno, "dibs::shared_log: cannot open log to fdatasync it", path_);
      fd = other.get();
    }
    if (const int e = sync_data(fd)) throw path_error(e, "dibs::shared_log: cannot fdatasync log", path_);
  }

  // Effects: forces the log's directory (its entries) to stable storage.
  void sync_log_directory() const {
    if (const int e = sync_directory(path_.parent_path()))
      throw path_error(e, "dibs::shared_log: cannot fsync the directory of log", path_);
  }

private:
  // Sets path_ to `given` resolved, and opens the log. Every writer must name
  // the lock file after the same name of the file: two names (a symbolic
  // link, `..`) would be two locks, and records lost and torn. Resolved
  // again after the open: a last component that is a dangling symbolic link
  // names a file only once the open has created it.
  void open_resolved(const std::filesystem::path& given) {
    std::error_code ec;
    const auto absolute = std::filesystem::absolute(given, ec);
    if (ec) throw path_error(ec.value(), "dibs::shared_log: cannot make the path of log absolute", given);
    for (int round = 0; round < 8; ++round) {
      auto resolved = std::filesystem::weakly_canonical(absolute, ec);
      // weakly_canonical looks whether the file exists, then resolves it: a
      // rotation renaming it in between says ENOENT. Look again.
      if (ec == std::errc::no_such_file_or_directory && round < 7) {
        std::this_thread::yield();
        continue;
      }
      if (ec) throw path_error(ec.value(), "dibs::shared_log: cannot resolve the path of log", absolute);
      if (fd_ && resolved == path_) return;
      path_ = std::move(resolved);
      open();
    }
    throw path_error(ELOOP, "dibs::shared_log: the symbolic links of log keep changing while it is opened:", absolute);
  }

  std::filesystem::path path_;
  mode_t mode_;  // of a log file this writer creates
  bool sync_;
  unique_fd fd_;
  std::uint64_t dev_ = 0, ino_ = 0;
  mode_t log_mode_ = 0;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
};

}  // namespace dibs::detail
