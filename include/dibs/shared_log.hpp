// dibs/shared_log.hpp: one log file that many processes append to at once.
//
//   dibs::shared_log log{"/var/log/batch.log"};
//   log.append("job 17 done");          // a newline is added if missing
//
// Guarantees: every record whose append() returned is in the log once and
// whole; no record is torn or interleaved with another; when a record cannot
// be written (lock timeout, full disk, permission) append() throws (or
// returns the error) and nothing of the record is left in the file: the
// record is still in the caller's hands, never dropped to stderr.
//
// How: every record is written under one lock, a robust process-shared
// mutex in the first page of the lock file `<path>.lock` (mapped by every
// writer). Taking it costs two atomic operations when nobody else holds it,
// and a writer that waits sleeps in the kernel (futex) with a real timeout,
// instead of polling. Robust means: if its holder dies (SIGKILL included),
// the kernel hands the mutex to the next writer with EOWNERDEAD, and that
// writer cuts off whatever the dead one left half-written (the page records
// where its record began) before anyone can append after it.
//   - A record is appended with writev() on an O_APPEND descriptor; a write
//     cut short is completed (large records), or, on a full disk, the part
//     written is cut off again: no partial record is ever left behind.
//   - Rotation by size renames the file to `<path>.<n>` (n = 1, 2, ...) under
//     the same lock; every writer checks, under the lock, that its descriptor
//     is still the current file (a generation number in the shared page), so
//     no record goes to a rotated file after the rotation and none is written
//     twice.
// The lock file is set up (and, after a reboot, set up again) under a
// dibs::file_mutex (flock) on it, which the kernel releases if that process
// dies. It is never deleted. Same host only, and every writer of the log
// must go through shared_log: O_APPEND is not atomic over NFS, and a process
// that appends by itself bypasses the lock.
#pragma once

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include <dibs/detail/posix.hpp>
#include <dibs/detail/robust_mutex.hpp>
#include <dibs/error.hpp>
#include <dibs/file_mutex.hpp>

namespace dibs {

/// When appended records are forced to stable storage.
enum class durability {
  none,        ///< left to the kernel (the default): survives a crash of the process, not of the machine
  per_record,  ///< fdatasync() after every record, before append() returns
  per_batch,   ///< fdatasync() after every `batch_records` records, and by flush() and the destructor
};

struct shared_log_options {
  /// Rotate when the file reaches this size; 0: never.
  std::uint64_t rotate_size = 0;
  /// Rotated files to keep (the oldest beyond it are deleted); 0: keep all.
  std::uint64_t keep = 0;
  durability sync = durability::none;
  std::size_t batch_records = 64;
  /// How long append() waits for the lock before it gives up with errc::timed_out.
  std::chrono::milliseconds lock_timeout{10'000};
  mode_t mode = 0644;
};

namespace detail {

// The first page of `<log>.lock`, shared by every writer through mmap.
struct log_shared_state {
  static constexpr char magic_value[8] = {'d', 'i', 'b', 's', 'l', 'o', 'g', '2'};
  char magic[8];
  char boot_id[40];           // the boot that set the mutex up; after a reboot it is set up anew
  robust_mutex mutex;
  std::uint64_t generation;   // bumped by every rotation
  std::uint64_t next_rotation;  // n of the next `<log>.<n>`
  std::int64_t pending_start;   // where the record being written began; -1: none
};

}  // namespace detail

/// An append-only log shared by many processes on one host.
/// One object may be used by many threads (appends are serialised per object).
class shared_log {
public:
  /// Effects: opens (creating if needed) the log and its lock file `<path>.lock`.
  /// Throws: std::system_error naming the path (missing directory, a
  /// directory, no permission, a lock file that is not a shared_log's);
  /// std::invalid_argument for a bad option.
  explicit shared_log(std::filesystem::path path, shared_log_options opts = {})
      : path_(std::move(path)), opts_(opts) {
    if (opts_.sync == durability::per_batch && opts_.batch_records == 0)
      throw std::invalid_argument("dibs::shared_log: batch_records must be positive");
    if (opts_.lock_timeout < std::chrono::milliseconds::zero())
      throw std::invalid_argument("dibs::shared_log: lock_timeout must not be negative");
    open_log();
    map_state();
  }

  shared_log(const shared_log&) = delete;
  shared_log& operator=(const shared_log&) = delete;

  /// Effects: flushes per durability::per_batch; a failure is reported on
  /// stderr, since a destructor must not throw.
  ~shared_log() {
    if (opts_.sync == durability::per_batch && unsynced_ > 0 && ::fdatasync(fd_.get()) != 0)
      std::fprintf(stderr, "dibs::shared_log: fdatasync of '%s' failed: %s\n", path_.c_str(), std::strerror(errno));
    if (state_) ::munmap(state_, sizeof(detail::log_shared_state));
  }

  /// Effects: appends `record`, and a newline if it does not end with one.
  /// Throws: std::system_error naming the log; the record is then not in the
  /// file, not even in part.
  void append(std::string_view record) {
    const char* what = "cannot append to log";
    if (auto ec = append_record(record, what))
      throw std::system_error(ec, fmt::format("dibs::shared_log: {} '{}'{}", what, path_.string(),
                                              ec.category() == std::system_category() ? detail::errno_hint(ec.value())
                                                                                      : ""));
  }

  /// Effects: as append(record), reporting a failure through `ec` instead.
  /// Returns: true if the record was appended.
  bool append(std::string_view record, std::error_code& ec) noexcept {
    const char* what = "";
    try {
      ec = append_record(record, what);
    } catch (const std::system_error& e) {
      ec = e.code();
    } catch (...) {
      ec = std::make_error_code(std::errc::not_enough_memory);
    }
    return !ec;
  }

  /// Effects: forces every record appended through this object to stable storage.
  void flush() {
    std::lock_guard self{self_};
    if (::fdatasync(fd_.get()) != 0) throw detail::path_error(errno, "dibs::shared_log: cannot fdatasync log", path_);
    unsynced_ = 0;
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  /// Returns: the path of rotated file n (1 is the oldest).
  std::filesystem::path rotated_path(std::uint64_t n) const { return path_.string() + "." + std::to_string(n); }
  std::filesystem::path lock_path() const { return path_.string() + ".lock"; }

private:
  // Maps the lock file's first page, setting it up if it is new or from an earlier boot.
  void map_state() {
    const auto lp = lock_path();
    file_mutex setup{lp, {.family = lock_family::flock, .write_owner = false}};
    std::lock_guard hold{setup};
    detail::unique_fd fd{detail::open_retry(lp.c_str(), O_RDWR | O_CLOEXEC)};
    if (!fd) throw detail::path_error(errno, "dibs::shared_log: cannot open lock file", lp);
    struct ::stat st {};
    if (::fstat(fd.get(), &st) != 0) throw detail::path_error(errno, "dibs::shared_log: cannot stat lock file", lp);
    const bool fresh = st.st_size == 0;
    if (!fresh && static_cast<std::size_t>(st.st_size) != sizeof(detail::log_shared_state))
      throw detail::path_error(EINVAL, "dibs::shared_log: not a dibs shared_log lock file (remove it if no writer runs):",
                               lp);
    if (fresh && ::ftruncate(fd.get(), sizeof(detail::log_shared_state)) != 0)
      throw detail::path_error(errno, "dibs::shared_log: cannot size lock file", lp);
    void* p = ::mmap(nullptr, sizeof(detail::log_shared_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) throw detail::path_error(errno, "dibs::shared_log: cannot map lock file", lp);
    state_ = static_cast<detail::log_shared_state*>(p);
    if (!fresh && std::memcmp(state_->magic, detail::log_shared_state::magic_value, 8) != 0)
      throw detail::path_error(EINVAL, "dibs::shared_log: not a dibs shared_log lock file (remove it if no writer runs):",
                               lp);
    const std::string boot = detail::boot_id();
    if (fresh || std::strncmp(state_->boot_id, boot.c_str(), sizeof state_->boot_id) != 0) {
      // New, or left by an earlier boot: no process of this boot can hold the
      // mutex (or it would have set the page up itself), so set it up anew.
      if (const int rc = state_->mutex.init(); rc != 0)
        throw detail::path_error(rc, "dibs::shared_log: cannot set up the lock in", lp);
      if (fresh) {
        state_->generation = 1;
        state_->next_rotation = 1;
        state_->pending_start = -1;
      }
      std::memset(state_->boot_id, 0, sizeof state_->boot_id);
      std::memcpy(state_->boot_id, boot.data(), std::min(boot.size(), sizeof state_->boot_id - 1));
      std::memcpy(state_->magic, detail::log_shared_state::magic_value, 8);
      ::msync(state_, sizeof(detail::log_shared_state), MS_SYNC);
    }
    generation_ = state_->generation;
  }

  // Opens the current log file (again, after a rotation).
  void open_log() {
    const int fd = detail::open_retry(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, opts_.mode);
    if (fd < 0) throw detail::path_error(errno, "dibs::shared_log: cannot open log file", path_);
    struct ::stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      const int e = errno;
      ::close(fd);
      throw detail::path_error(S_ISDIR(st.st_mode) ? EISDIR : e ? e : EINVAL,
                               "dibs::shared_log: log is not a regular file:", path_);
    }
    fd_.reset(fd);
  }

  // The held lock; unlocks on scope exit.
  struct held_lock {
    detail::robust_mutex* m;
    ~held_lock() { m->unlock(); }
  };

  // Effects: takes the shared mutex within the lock timeout, repairing what a
  // dead holder left behind. Returns: an error, or {} with the mutex held.
  std::error_code lock_state(const char*& what) {
    const int rc = state_->mutex.lock_for(opts_.lock_timeout);
    if (rc == ETIMEDOUT) {
      what = "timed out waiting for the lock of log";
      return errc::timed_out;
    }
    if (rc != 0 && rc != EOWNERDEAD) {
      what = "cannot take the lock of log";
      return {rc, std::system_category()};
    }
    // Cut off what a dead holder left half-written (pending_start survives
    // until this succeeds, so a failed repair is tried again by the next holder).
    try {
      repair();
    } catch (...) {
      state_->mutex.unlock();
      throw;
    }
    return {};
  }

  // Requires: the mutex is held. Removes a record left half-written.
  void repair() {
    if (state_->pending_start < 0) return;
    detail::unique_fd fd{detail::open_retry(path_.c_str(), O_WRONLY | O_CLOEXEC)};
    if (!fd) throw detail::path_error(errno, "dibs::shared_log: cannot open log file to repair it", path_);
    struct ::stat st {};
    if (::fstat(fd.get(), &st) != 0) throw detail::path_error(errno, "dibs::shared_log: cannot stat log", path_);
    if (st.st_size > state_->pending_start && ::ftruncate(fd.get(), static_cast<off_t>(state_->pending_start)) != 0)
      throw detail::path_error(errno, "dibs::shared_log: cannot cut a torn record from", path_);
    state_->pending_start = -1;
  }

  std::error_code append_record(std::string_view record, const char*& what) {
    const bool newline = record.empty() || record.back() != '\n';
    const std::size_t total = record.size() + (newline ? 1 : 0);
    std::lock_guard self{self_};
    if (auto ec = lock_state(what)) return ec;
    std::error_code ec;
    {
      held_lock guard{&state_->mutex};
      if (generation_ != state_->generation) {  // rotated since our last record
        open_log();
        generation_ = state_->generation;
      }
      // Where the record will start: the size of the file, under the mutex.
      // lseek and not fstat: a stat marks the timestamps as seen, and the
      // kernel (multigrain timestamps) then gives the next write a fresh one,
      // which dirties the inode on every record (measured: 8 writers at 0.48x
      // of bare appends with an fstat per write, 1.06x with an lseek).
      const off_t start = ::lseek(fd_.get(), 0, SEEK_END);
      if (start < 0) throw detail::path_error(errno, "dibs::shared_log: cannot find the end of log", path_);
      state_->pending_start = start;
      std::size_t done = 0;
      while (done < total) {
        iovec iov[2];
        int parts = 0;
        if (done < record.size()) iov[parts++] = {const_cast<char*>(record.data() + done), record.size() - done};
        if (newline) iov[parts++] = {const_cast<char*>("\n"), 1};
        const ssize_t n = ::writev(fd_.get(), iov, parts);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          // A full disk, a quota, an I/O error: take back what was written.
          ec = {n < 0 ? errno : ENOSPC, std::system_category()};
          what = "cannot append to log";
          repair();
          return ec;
        }
        done += static_cast<std::size_t>(n);
      }
      state_->pending_start = -1;
      if (opts_.rotate_size > 0 && static_cast<std::uint64_t>(start) + total >= opts_.rotate_size) {
        // The record is in and must be reported so: a failed rotation only
        // means the next append tries again.
        try {
          rotate();
        } catch (const std::exception&) {
        }
      }
    }
    if (opts_.sync == durability::per_record ||
        (opts_.sync == durability::per_batch && ++unsynced_ >= opts_.batch_records)) {
      if (::fdatasync(fd_.get()) != 0) {
        what = "record appended, but fdatasync failed, for log";
        return {errno, std::system_category()};
      }
      unsynced_ = 0;
    }
    return {};
  }

  // Requires: the mutex is held and our descriptor is the current file.
  void rotate() {
    for (;;) {
      const std::uint64_t n = state_->next_rotation++;
      const auto target = rotated_path(n);
      // Never overwrite an older rotated file (say, of a lock file that was reset).
      if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE) == 0) {
        if (opts_.keep > 0 && n > opts_.keep) ::unlink(rotated_path(n - opts_.keep).c_str());
        break;
      }
      if (errno == ENOENT) break;  // a rotator died after its rename: finish its rotation
      if (errno != EEXIST) throw detail::path_error(errno, "dibs::shared_log: cannot rotate log", path_);
    }
    ++state_->generation;
    open_log();
    generation_ = state_->generation;
  }

  std::filesystem::path path_;
  shared_log_options opts_;
  detail::unique_fd fd_;
  detail::log_shared_state* state_ = nullptr;
  std::uint64_t generation_ = 0;
  std::size_t unsynced_ = 0;
  std::mutex self_;
};

}  // namespace dibs
