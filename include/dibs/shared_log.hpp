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
// How: every byte goes into the file under one lock, a robust process-shared
// mutex in the lock file `.<name>.dibs-lock` beside the log (mapped by
// every writer; hidden, so that no glob of the log's files, `batch.log*`,
// matches it). Robust
// means: if its holder dies (SIGKILL included), the kernel hands the mutex to
// the next writer with EOWNERDEAD, and that writer cuts off whatever the dead
// one left half-written (the mapping records where its write began and how
// long it was) before anyone can append after it.
//   - Writes are combined. A record (up to slot_capacity bytes) is copied
//     into a free slot of the lock file and marked ready; then its writer
//     tries the lock. Whoever holds the lock writes every ready record in one
//     writev() and marks each done; the writers of those records, waiting on
//     their slot (a short spin, a few yields, then a futex sleep), return
//     with their record written and never take the lock themselves. With many writers, one system call carries many
//     records, and no record waits for a sleeping process to be scheduled
//     just to pass the lock on. Larger records, and records that find no free
//     slot, are written by their own writer under the lock, with the queued
//     ones.
//   - A holder that unlocks looks once more for ready records (and takes the
//     lock again for them): a record marked ready while the holder was
//     writing is never left waiting for a writer that has gone to sleep.
//   - A holder that dies mid-write: the next holder finds the batch's start
//     and length; all of it in the file means its records are marked done,
//     less means it is cut off and its records are queued again. Slots of
//     processes that died are freed once those are provably gone.
//   - A write cut short is completed; on a full disk the part written is cut
//     off again and every record of the batch fails: no partial record is
//     ever left behind.
//   - Rotation by size renames the file to `<path>.<n>` (n = 1, 2, ...) under
//     the same lock; the holder checks, under the lock, that its descriptor is
//     still the current file (a generation number in the lock file), so no
//     record goes to a rotated file after the rotation and none is written
//     twice.
// The lock file is set up (and, after a reboot, set up again) under a
// dibs::file_mutex (flock) on it, which the kernel releases if that process
// dies. It is never deleted. Same host only, and every writer of the log
// must go through shared_log: O_APPEND is not atomic over NFS, and a process
// that appends by itself bypasses the lock.
//
// One file, one lock: the path is resolved once, when a shared_log is made
// (symbolic links of every component, the last one too, `.` and `..`), and
// the lock file and the rotated files are named after the resolved path. So
// writers through `current.log -> app.log` and through `app.log` share one
// lock (a link repointed later is followed only by shared_logs made later).
// A log file with more than one hard link is refused: no name of it is more
// its own than another. The lock file gets the log's permission bits (and
// group, and owner where allowed) when it is created, so every user who may
// write the log may take its lock.
//
// On Windows (docs/windows.md): the same promises, by other means: every
// record is written by its own writer in one WriteFile (FILE_APPEND_DATA)
// under LockFileEx on one byte of the lock file, which Windows releases when
// a process ends however it ends; the record being written is noted in the
// lock file first, so the next holder cuts what a terminated one left
// half-written; rotation renames with MoveFileExW (every file is opened
// sharing deletes, so it works while other writers hold the log open) and
// writers open the log again when the generation in the lock file moved.
// Records are not combined; slot_capacity and `mode` do not apply there.
// detail/shared_log/locked_log.hpp is that policy; its Win32 calls are in
// detail/win32/log_file.hpp.
//
// The parts, in include/dibs/detail/shared_log/: shared_state.hpp (the lock
// file's layout), lock_file.hpp (setting it up and mapping it),
// log_file.hpp (the resolved path and the descriptor), append.hpp (a
// writer's slot and its wait), holder.hpp (the batch the lock holder
// writes), recovery.hpp (a dead holder's batch), rotation.hpp, log_names.hpp
// (the rotated files' and the lock file's names, on every platform); system
// calls in include/dibs/detail/posix/.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#ifdef _WIN32
#include <dibs/detail/shared_log/locked_log.hpp>
#include <dibs/detail/shared_log/log_names.hpp>
#else
#include <sys/types.h>

#include <dibs/detail/posix/sys.hpp>
#include <dibs/detail/shared_log/append.hpp>
#include <dibs/detail/shared_log/holder.hpp>
#include <dibs/detail/shared_log/lock_file.hpp>
#include <dibs/detail/shared_log/log_file.hpp>
#include <dibs/detail/shared_log/shared_state.hpp>
#include <dibs/file_mutex.hpp>
#endif
#include <dibs/error.hpp>

namespace dibs {

/// When appended records are forced to stable storage.
enum class durability {
  none,        ///< left to the kernel (the default): survives a crash of the process, not of the machine
  per_record,  ///< fdatasync() after every record, before append() returns
  per_batch,   ///< fdatasync() after every `batch_records` records, and by flush() and the destructor
};

inline const char* to_string(durability d) noexcept {
  switch (d) {
    case durability::none: return "none";
    case durability::per_record: return "per_record";
    case durability::per_batch: return "per_batch";
  }
  return "?";
}

struct shared_log_options {
  /// Rotate when the file reaches this size; 0: never.
  std::uint64_t rotate_size = 0;
  /// Rotated files to keep, `.1` (the newest) to `.keep`: each rotation
  /// deletes those it shifts beyond. 0: keep all (each rotation then renames
  /// every rotated file, as logrotate does: bound them for a busy log).
  std::uint64_t keep = 0;
  durability sync = durability::none;
  std::size_t batch_records = 64;
  /// How long append() waits for its record to be taken by a lock holder (its
  /// own writer included) before it gives up with errc::timed_out, the record
  /// withdrawn. A record taken into a batch is not withdrawn: its writer waits
  /// for the outcome (a holder that dies is found within 5 ms).
  std::chrono::milliseconds lock_timeout{10'000};
  /// Permissions of a log file that does not exist yet, less the umask of
  /// the process that creates it (as open(2) does): for a log that a group
  /// shares, use 0664 with umask 002, or create the log beforehand. The lock
  /// file follows whatever the log got, whatever its own creator's umask.
  /// Ignored on Windows: a new file gets the security its directory passes on.
  detail::file_mode mode = 0644;
};

/// An append-only log shared by many processes on one host.
/// One object may be used by many threads (appends are serialised per object).
class shared_log {
public:
#ifndef _WIN32
  /// Records up to this size (newline included) are queued in the lock file
  /// and may be written together with others; larger ones are written by
  /// their own writer under the lock. (On Windows every record is written by
  /// its own writer.)
  static constexpr std::size_t slot_capacity = sizeof(detail::log_slot::data);
  /// The size of the lock file (its queue of records), made at its full
  /// size when the log is first opened: room its filesystem must have.
  static constexpr std::size_t lock_file_size = sizeof(detail::log_shared_state);
#endif

  /// Effects: resolves `path` (see path()), opens (creating if needed) the
  /// log with `opts.mode` (less the umask) and its lock file lock_path(),
  /// created with the log's permission bits, owner and group where allowed.
  /// Throws: std::system_error naming the path (missing directory, a
  /// directory, no permission, a log file with more than one hard link, a
  /// lock file that is not a shared_log's); std::invalid_argument for a bad
  /// option.
#ifdef _WIN32
  explicit shared_log(std::filesystem::path path, shared_log_options opts = {})
      : opts_(checked(opts)),
        log_(path, {opts_.rotate_size, opts_.keep, opts_.sync != durability::none, opts_.lock_timeout}) {}
#else
  explicit shared_log(std::filesystem::path path, shared_log_options opts = {})
      : opts_(checked(opts)),
        log_(path, opts_.mode, opts_.sync != durability::none),
        state_(log_),
        holder_(log_, *state_, {opts_.rotate_size, opts_.keep, opts_.sync != durability::none}),
        queue_(*state_, holder_, opts_.lock_timeout) {}
#endif

  // Not movable: one object is meant to be shared by the threads of a
  // process (appends are serialised on its own mutex, which cannot move
  // while a thread waits on it), and a moved-from log would have to check
  // on every append that it still maps a lock file. Where a log must
  // change hands, hold it by std::unique_ptr (or std::shared_ptr for many
  // owners).
  shared_log(const shared_log&) = delete;
  shared_log& operator=(const shared_log&) = delete;
  shared_log(shared_log&&) = delete;
  shared_log& operator=(shared_log&&) = delete;

  /// Effects: flushes per durability::per_batch; a failure is reported on
  /// stderr, since a destructor must not throw.
  ~shared_log() {
    if (opts_.sync == durability::per_batch && unsynced_ > 0) {
      try {
        flush();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
      }
    }
  }

  /// Effects: appends `record`, and a newline if it does not end with one.
  /// Throws: std::system_error naming the log; the record is then not in the
  /// file, not even in part (except when only its fdatasync failed: the
  /// message says so).
  void append(std::string_view record) { append(record, std::stop_token{}); }

  /// Effects: as append(record), but a stop requested through `st` while it
  /// waits for the lock ends the wait (within about 5 ms) with
  /// errc::cancelled, and the record is then not in the file. A record
  /// that a lock holder has already taken into its write is not withdrawn:
  /// its outcome is awaited instead (it comes within microseconds).
  void append(std::string_view record, std::stop_token st) {
    const char* what = "cannot append to log";
    if (auto ec = append_record(record, what, st)) {
#ifdef _WIN32
      const std::string hint = ec == make_error_code(errc::timed_out) ? log_.holder_hint()
                               : ec.category() != std::system_category()
                                   ? std::string{}
                                   : std::string(detail::win32_hint(static_cast<DWORD>(ec.value())));
      throw std::system_error(ec, fmt::format("dibs::shared_log: {} '{}'{}", what, detail::path_text(log_.path()), hint));
#else
      const std::string hint = ec == make_error_code(errc::timed_out) ? detail::log_holder_hint(*state_)
                               : ec.category() != std::system_category() ? std::string{}
                               : ec.value() == EMLINK ? " (the log file was given a second name, a hard link: remove it)"
                                                      : std::string(detail::errno_hint(ec.value()));
      throw std::system_error(ec, fmt::format("dibs::shared_log: {} '{}'{}", what, log_.path().string(), hint));
#endif
    }
  }

  /// Effects: as append(record), reporting a failure through `ec` instead.
  /// Returns: true if the record was appended.
  bool append(std::string_view record, std::error_code& ec) noexcept {
    const char* what = "";
    try {
      ec = append_record(record, what, {});
    } catch (const std::system_error& e) {
      ec = e.code();
    } catch (...) {
      ec = std::make_error_code(std::errc::not_enough_memory);
    }
    return !ec;
  }

  /// Effects: forces the log file to stable storage (every record appended
  /// through this object since the last rotation; a rotation forces the
  /// rotated file first when the rotating writer's durability is not none).
  void flush() {
    std::lock_guard self{self_};
#ifdef _WIN32
    log_.sync();
#else
    log_.sync(holder_.current());
#endif
    unsynced_ = 0;
  }

  /// Returns: the log's path as resolved when this object was made: absolute,
  /// with every symbolic link (the last component's too), `.` and `..`
  /// resolved. The lock file and the rotated files are named after it.
  const std::filesystem::path& path() const noexcept { return log_.path(); }
  /// Returns: the path of rotated file n, `path() + "." + n`. As with
  /// logrotate, 1 is the newest: every rotation renames the log to `.1`
  /// after renaming `.1` to `.2`, `.2` to `.3`, and so on.
  std::filesystem::path rotated_path(std::uint64_t n) const { return detail::rotated_log_path(log_.path(), n); }
  /// Returns: the path of the lock file, `.<name>.dibs-lock` beside the log
  /// (for `/var/log/batch.log`: `/var/log/.batch.log.dibs-lock`): hidden, and
  /// matched by no glob of the log's files such as `batch.log*`. dibs 0.1.0
  /// used `<path>.lock`, which new writers ignore (docs/guide-shared-log.md).
  /// On Windows the dot does not hide it (Windows hides files by an
  /// attribute); it is still matched by no `batch.log*`.
  std::filesystem::path lock_path() const { return detail::log_lock_path(log_.path()); }

private:
  static const shared_log_options& checked(const shared_log_options& opts) {
    if (opts.sync == durability::per_batch && opts.batch_records == 0)
      throw std::invalid_argument("dibs::shared_log: batch_records must be positive");
    if (opts.lock_timeout < std::chrono::milliseconds::zero())
      throw std::invalid_argument("dibs::shared_log: lock_timeout must not be negative");
    return opts;
  }

  // Requires: self_ is not held. Effects: appends `record` (queued in a slot
  // where it fits and one is free, else written by this writer itself under
  // the lock), and counts it for durability::per_batch.
  std::error_code append_record(std::string_view record, const char*& what, const std::stop_token& stop) {
    const bool newline = record.empty() || record.back() != '\n';
    const std::size_t total = record.size() + (newline ? 1 : 0);
    std::lock_guard self{self_};
    const bool sync = opts_.sync == durability::per_record ||
                      (opts_.sync == durability::per_batch && unsynced_ + 1 >= opts_.batch_records);
    std::error_code ec;
#ifdef _WIN32
    (void)total;
    ec = log_.append(record, newline, sync, what, stop);
    const char* in_file_not_on_disk = detail::describe_locked_log_failure(detail::locked_log_failure::sync);
#else
    std::optional<unsigned> i;
    if (total <= slot_capacity) i = queue_.claim_slot();
    ec = i ? queue_.append_queued(*i, record, newline, sync, what, stop)
           : queue_.append_own(record, newline, sync, what, stop);
    const char* in_file_not_on_disk = detail::describe_log_failure(detail::log_failure::sync);
#endif
    if (!ec)
      unsynced_ = sync ? 0 : unsynced_ + 1;
    else if (what == in_file_not_on_disk)  // in the file, not yet on disk
      ++unsynced_;
    return ec;
  }

  shared_log_options opts_;
#ifdef _WIN32
  detail::locked_log log_;          // the log, its lock file, and the writing under the lock
#else
  detail::log_file log_;            // the log file, and this writer's descriptor of it
  detail::mapped_log_state state_;  // the lock file: mutex, queued records, the batch being written
  detail::log_holder holder_;       // what this writer does while it holds the lock
  detail::log_queue queue_;         // this writer's records queued in the lock file, and the wait for them
#endif
  std::size_t unsynced_ = 0;        // records appended since the last fdatasync (durability::per_batch)
  std::mutex self_;                 // serialises the appends of this object's threads
};

}  // namespace dibs
