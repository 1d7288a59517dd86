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
#pragma once

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <stop_token>
#include <string_view>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include <dibs/detail/owner.hpp>
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
  mode_t mode = 0644;
};

namespace detail {

inline constexpr std::size_t log_slot_count = 64;

// One queued record in the lock file. `word` is the slot's state (low 3
// bits), a flag (bit 3) set while its owner may be asleep on the word, and a
// ticket (the other bits) that changes with every claim, so that a
// compare-and-set meant for one use of the slot cannot hit the next.
struct alignas(64) log_slot {
  enum : std::uint32_t {
    free = 0,     // nobody's
    filling = 1,  // its owner is copying its record in
    ready = 2,    // waiting to be written
    taken = 3,    // the lock holder is writing it
    done = 4,     // in the file (error != 0: but its fdatasync failed)
    failed = 5,   // not in the file, not in part either; error and failure say why
  };
  static constexpr std::uint32_t state_mask = 7, waiting = 8, ticket_unit = 16;

  std::atomic<std::uint32_t> word;
  std::uint32_t size;                // bytes of data, newline included
  std::atomic<std::int32_t> pid;     // the owner
  std::int32_t error;                // errno of a failure
  std::atomic<std::uint64_t> start;  // the owner's start time (with pid, its identity)
  std::atomic<std::uint64_t> pid_ns; // the owner's time namespace << 32 | its pid namespace
  std::uint32_t sync;                // 1: fdatasync before marking it done
  std::uint32_t failure;             // which step failed (log_failure)
  // The ticket of the claim that pid, start and pid_ns describe: stored after
  // them, so an owner is judged only by what its own claim wrote.
  std::atomic<std::uint32_t> owner_ticket;
  std::uint32_t reserved;
  char data[1024 - 48];
};
static_assert(sizeof(log_slot) == 1024);

// What a failed record's writer reports.
enum class log_failure : std::uint32_t { none, write, sync, reopen, seek };

// The lock file `.<log's name>.dibs-lock`, shared by every writer through mmap.
struct log_shared_state {
  static constexpr char magic_value[8] = {'d', 'i', 'b', 's', 'l', 'o', 'g', '3'};
  char magic[8];
  char boot_id[40];             // the boot that set the mutex up; after a reboot it is set up anew
  robust_mutex mutex;
  std::uint64_t generation;     // bumped by every rotation
  std::uint64_t unused;         // dibs 0.1.0: the n of the next `<log>.<n>` (rotated files counted up)
  std::int64_t pending_start;   // where the batch being written began; -1: none
  std::int64_t pending_len;     // and its length
  std::uint64_t pending_dev;    // and the file it went to
  std::uint64_t pending_ino;
  std::uint32_t needs_repair;   // a holder died; cleared when its leftovers are dealt with
  std::int64_t file_end;        // where the last batch ended; -1: unknown
  std::int64_t file_end_ns;     // when that batch began (CLOCK_MONOTONIC)
  // Who holds the mutex, for messages only: written by each holder after
  // taking it, cleared before it lets go, read without the lock by a writer
  // that timed out (in bytes that were padding in dibs 0.1, which ignores them).
  std::atomic<std::int32_t> holder_pid;         // 0: none recorded
  std::atomic<std::uint32_t> holder_pid_ns;     // its PID namespace (inode)
  std::atomic<std::int64_t> holder_since_ms;    // when it took the lock (unix ms)
  std::atomic<std::uint64_t> holder_start;      // its start time (ticks since boot)
  // Bit i: slot i may be ready (set by its owner after marking it ready,
  // cleared by the holder that takes the ready slots). A hint, so that a
  // holder reads one word rather than every slot; the slot's word decides.
  alignas(64) std::atomic<std::uint64_t> ready_slots;
  alignas(4096) log_slot slots[log_slot_count];
};

static_assert(offsetof(log_shared_state, ready_slots) == 192, "the shared state's layout is that of every dibs");

}  // namespace detail

/// An append-only log shared by many processes on one host.
/// One object may be used by many threads (appends are serialised per object).
class shared_log {
public:
  /// Records up to this size (newline included) are queued in the lock file
  /// and may be written together with others; larger ones are written by
  /// their own writer under the lock.
  static constexpr std::size_t slot_capacity = sizeof(detail::log_slot::data);

  /// Effects: resolves `path` (see path()), opens (creating if needed) the
  /// log with `opts.mode` (less the umask) and its lock file lock_path(),
  /// created with the log's permission bits, owner and group where allowed.
  /// Throws: std::system_error naming the path (missing directory, a
  /// directory, no permission, a log file with more than one hard link, a
  /// lock file that is not a shared_log's); std::invalid_argument for a bad
  /// option.
  explicit shared_log(std::filesystem::path path, shared_log_options opts = {}) : opts_(opts) {
    if (opts_.sync == durability::per_batch && opts_.batch_records == 0)
      throw std::invalid_argument("dibs::shared_log: batch_records must be positive");
    if (opts_.lock_timeout < std::chrono::milliseconds::zero())
      throw std::invalid_argument("dibs::shared_log: lock_timeout must not be negative");
    open_resolved(path);
    map_state();
  }

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
    if (state_) ::munmap(state_, sizeof(detail::log_shared_state));
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
      const std::string hint = ec == make_error_code(errc::timed_out) ? holder_hint()
                               : ec.category() != std::system_category() ? std::string{}
                               : ec.value() == EMLINK ? " (the log file was given a second name, a hard link: remove it)"
                                                      : std::string(detail::errno_hint(ec.value()));
      throw std::system_error(ec, fmt::format("dibs::shared_log: {} '{}'{}", what, path_.string(), hint));
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
    // This object's descriptor if it is still the log: it was opened before
    // any write it must answer for failed, so its fdatasync reports that
    // failure (a descriptor opened later might not).
    detail::unique_fd other;
    int fd = fd_.get();
    if (generation_ != state_->generation) {
      other.reset(detail::open_retry(path_.c_str(), O_WRONLY | O_CLOEXEC));
      if (!other) throw detail::path_error(errno, "dibs::shared_log: cannot open log to fdatasync it", path_);
      fd = other.get();
    }
    if (::fdatasync(fd) != 0) throw detail::path_error(errno, "dibs::shared_log: cannot fdatasync log", path_);
    unsynced_ = 0;
  }

  /// Returns: the log's path as resolved when this object was made: absolute,
  /// with every symbolic link (the last component's too), `.` and `..`
  /// resolved. The lock file and the rotated files are named after it.
  const std::filesystem::path& path() const noexcept { return path_; }
  /// Returns: the path of rotated file n, `path() + "." + n`. As with
  /// logrotate, 1 is the newest: every rotation renames the log to `.1`
  /// after renaming `.1` to `.2`, `.2` to `.3`, and so on.
  std::filesystem::path rotated_path(std::uint64_t n) const { return path_.string() + "." + std::to_string(n); }
  /// Returns: the path of the lock file, `.<name>.dibs-lock` beside the log
  /// (for `/var/log/batch.log`: `/var/log/.batch.log.dibs-lock`): hidden, and
  /// matched by no glob of the log's files such as `batch.log*`. dibs 0.1.0
  /// used `<path>.lock`, which new writers ignore (docs/guide-shared-log.md).
  std::filesystem::path lock_path() const {
    // Appended piece by piece: `"." + std::string&&` trips GCC 12's bogus
    // -Wrestrict at -O3 (GCC bug 105651) in programs built with -Werror.
    std::string name = ".";
    name += path_.filename().native();
    name += ".dibs-lock";
    return path_.parent_path() / name;
  }

private:
  using slot = detail::log_slot;
  static constexpr std::uint32_t state_of(std::uint32_t w) noexcept { return w & slot::state_mask; }
  static constexpr std::uint32_t ticket_of(std::uint32_t w) noexcept { return w & ~(slot::state_mask | slot::waiting); }
  // How long a writer whose record is queued sleeps before it looks again
  // whether the lock holder died (nobody would wake it then).
  static constexpr std::chrono::milliseconds holder_check{5};
  // Times a holder takes the lock again, after unlocking, for records queued
  // meanwhile, before it wakes their writers to do it instead.
  static constexpr int max_rounds = 4;
  // A writer whose record is queued while another holds the lock watches
  // its slot for spin_rounds x 50 pauses (the holder is most likely running
  // and about to write it), then gives its processor away yield_rounds times
  // (so that other writers can queue theirs into the same batch), then
  // sleeps. Measured with 8 writers on 2 cores (docs/BENCHMARKS.md):
  // sleeping at once ran at 0.2x of bare appends, spinning only at 0.6x.
  static constexpr int spin_rounds = 4, yield_rounds = 16, pauses_per_round = 50;
  // The batch starts where the previous one ended if that began less than
  // this long ago, else where lseek(SEEK_END) says.
  static constexpr std::int64_t fresh_ns = 1'000'000;

  static constexpr const char* not_ours =
      "dibs::shared_log: not a dibs shared_log lock file, or one of another version of dibs (remove it if no "
      "writer runs):";

  // Sets path_ to `given` resolved, and opens the log. Every writer must name
  // the lock file after the same name of the file: two names (a symbolic
  // link, `..`) would be two locks, and records lost and torn. Resolved
  // again after the open: a last component that is a dangling symbolic link
  // names a file only once the open has created it.
  void open_resolved(const std::filesystem::path& given) {
    std::error_code ec;
    const auto absolute = std::filesystem::absolute(given, ec);
    if (ec) throw detail::path_error(ec.value(), "dibs::shared_log: cannot make the path of log absolute", given);
    for (int round = 0; round < 8; ++round) {
      auto resolved = std::filesystem::weakly_canonical(absolute, ec);
      // weakly_canonical looks whether the file exists, then resolves it: a
      // rotation renaming it in between says ENOENT. Look again.
      if (ec == std::errc::no_such_file_or_directory && round < 7) {
        std::this_thread::yield();
        continue;
      }
      if (ec) throw detail::path_error(ec.value(), "dibs::shared_log: cannot resolve the path of log", absolute);
      if (fd_ && resolved == path_) return;
      path_ = std::move(resolved);
      open_log();
    }
    throw detail::path_error(ELOOP, "dibs::shared_log: the symbolic links of log keep changing while it is opened:",
                             absolute);
  }

  // Maps the lock file, setting it up if it is new or from an earlier boot.
  void map_state() {
    const auto lp = lock_path();
    // A lock file that another user has just created, and not yet set up,
    // may still have the permissions its creator's umask left, narrower than
    // the log's: it widens them under the set-up lock. Wait for that, rather
    // than fail the first writers of several users that start together.
    for (int waited_ms = 0;; ++waited_ms) {
      try {
        set_up_and_map(lp);
        return;
      } catch (const std::system_error& e) {
        struct ::stat st {};
        if (e.code() != std::errc::permission_denied || waited_ms >= 1000 || ::stat(lp.c_str(), &st) != 0 ||
            st.st_size != 0 || st.st_uid == ::geteuid())
          throw;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{1});
    }
  }

  void set_up_and_map(const std::filesystem::path& lp) {
    file_mutex setup{lp, {.family = lock_family::flock, .write_owner = false, .mode = log_mode_}};
    std::lock_guard hold{setup};
    detail::unique_fd fd{detail::open_retry(lp.c_str(), O_RDWR | O_CLOEXEC)};
    if (!fd) throw detail::path_error(errno, "dibs::shared_log: cannot open lock file", lp);
    struct ::stat st {};
    if (::fstat(fd.get(), &st) != 0) throw detail::path_error(errno, "dibs::shared_log: cannot stat lock file", lp);
    if (st.st_size != 0 && static_cast<std::size_t>(st.st_size) != sizeof(detail::log_shared_state))
      throw detail::path_error(EINVAL, not_ours, lp);
    // Whoever may write the log must be able to write its lock, which every
    // append takes. So a lock file this writer has just created (empty, and
    // its own) gets the log's permission bits whatever this process's umask
    // took from them, and the log's owner and group where this user may give
    // them (root may; others may choose a group of their own). Best effort:
    // what cannot be done shows later as another user's "permission denied"
    // naming the lock file.
    if (st.st_size == 0 && st.st_uid == ::geteuid()) {
      if (::fchown(fd.get(), log_uid_, log_gid_) != 0) (void)::fchown(fd.get(), static_cast<uid_t>(-1), log_gid_);
      (void)::fchmod(fd.get(), log_mode_);
    }
    // Its blocks are allocated before it is mapped: a page of a sparse file
    // that cannot be allocated later (a full disk) would kill the writer
    // touching it (SIGBUS).
    if (st.st_size == 0) {
      if (const int rc = ::posix_fallocate(fd.get(), 0, sizeof(detail::log_shared_state)); rc != 0) {
        ::ftruncate(fd.get(), 0);  // left empty, it is set up by the next writer
        throw detail::path_error(rc, "dibs::shared_log: cannot allocate lock file", lp);
      }
    }
    void* p = ::mmap(nullptr, sizeof(detail::log_shared_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) throw detail::path_error(errno, "dibs::shared_log: cannot map lock file", lp);
    auto* state = static_cast<detail::log_shared_state*>(p);
    struct unmap_unless_kept {
      detail::log_shared_state* p;
      ~unmap_unless_kept() {
        if (p) ::munmap(p, sizeof *p);
      }
    } unmap{state};
    // New: empty, or all zeros (its creator died before writing the magic, last).
    static constexpr char no_magic[8] = {};
    const bool fresh = std::memcmp(state->magic, no_magic, 8) == 0;
    if (!fresh && std::memcmp(state->magic, detail::log_shared_state::magic_value, 8) != 0)
      throw detail::path_error(EINVAL, not_ours, lp);
    if (fresh && st.st_size != 0) {
      if (const int rc = ::posix_fallocate(fd.get(), 0, sizeof(detail::log_shared_state)); rc != 0)
        throw detail::path_error(rc, "dibs::shared_log: cannot allocate lock file", lp);
    }
    const std::string boot = detail::boot_id();
    if (fresh || std::strncmp(state->boot_id, boot.c_str(), sizeof state->boot_id) != 0) {
      // New, or left by an earlier boot: no process of this boot can hold the
      // mutex or a slot (or it would have set the file up itself), so set them
      // up anew. A batch cut short by a crash of the machine is cut off if
      // the file it went to is still the log (and ends inside the batch).
      if (const int rc = state->mutex.init(); rc != 0)
        throw detail::path_error(rc, "dibs::shared_log: cannot set up the lock in", lp);
      state_ = state;
      state_->file_end = -1;
      if (fresh) {
        state_->generation = 1;
        state_->pending_start = -1;
      }
      state_->needs_repair = state_->pending_start >= 0 ? 1 : 0;
      std::memset(static_cast<void*>(state_->slots), 0, sizeof state_->slots);
      state_->ready_slots.store(0);
      std::memset(state_->boot_id, 0, sizeof state_->boot_id);
      std::memcpy(state_->boot_id, boot.data(), std::min(boot.size(), sizeof state_->boot_id - 1));
      ::msync(state_, sizeof(detail::log_shared_state), MS_SYNC);
      std::memcpy(state_->magic, detail::log_shared_state::magic_value, 8);
      ::msync(state_, sizeof(detail::log_shared_state), MS_SYNC);
    }
    state_ = state;
    unmap.p = nullptr;
    // Not the generation now: the log was opened before the lock file was
    // mapped, and may have been rotated away in between. The first batch
    // opens it again, under the lock.
    generation_ = 0;
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
    log_dev_ = static_cast<std::uint64_t>(st.st_dev);
    log_ino_ = static_cast<std::uint64_t>(st.st_ino);
    log_mode_ = st.st_mode & 0666;
    log_uid_ = st.st_uid;
    log_gid_ = st.st_gid;
    // A record that must be on disk needs the file's name there too (it may
    // have just been created, or renamed by a rotation).
    if (opts_.sync != durability::none) sync_directory();
  }

  // Effects: forces the log's directory (its entries) to stable storage.
  void sync_directory() const {
    const auto dir = path_.parent_path();
    detail::unique_fd fd{detail::open_retry(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
    if (!fd || ::fsync(fd.get()) != 0)
      throw detail::path_error(errno, "dibs::shared_log: cannot fsync the directory of log", path_);
  }

  // A record written by its own writer (not queued), and what became of it.
  struct own_record {
    std::string_view text;
    bool newline;
    bool sync;
    int error = 0;
    detail::log_failure failure = detail::log_failure::none;
  };

  // The outcome of one record of a batch: the batch's failure, else its
  // fdatasync's if the record asked for one, else success.
  static std::pair<int, detail::log_failure> outcome(int error, detail::log_failure failure, int sync_error,
                                                     bool wants_sync) noexcept {
    if (error) return {error, failure};
    if (wants_sync && sync_error) return {sync_error, detail::log_failure::sync};
    return {0, detail::log_failure::none};
  }

  static const char* describe(detail::log_failure f) noexcept {
    switch (f) {
      case detail::log_failure::sync: return "record appended, but fdatasync failed, for log";
      case detail::log_failure::reopen: return "cannot open the log file again after a rotation, for log";
      case detail::log_failure::seek: return "cannot find the end of log";
      default: return "cannot append to log";
    }
  }

  std::error_code append_record(std::string_view record, const char*& what, const std::stop_token& stop) {
    const bool newline = record.empty() || record.back() != '\n';
    const std::size_t total = record.size() + (newline ? 1 : 0);
    std::lock_guard self{self_};
    const bool sync = opts_.sync == durability::per_record ||
                      (opts_.sync == durability::per_batch && unsynced_ + 1 >= opts_.batch_records);
    std::error_code ec;
    std::optional<unsigned> i;
    if (total <= slot_capacity) i = claim_slot();
    ec = i ? append_queued(*i, record, newline, sync, what, stop) : append_own(record, newline, sync, what, stop);
    if (!ec)
      unsynced_ = sync ? 0 : unsynced_ + 1;
    else if (what == describe(detail::log_failure::sync))  // in the file, not yet on disk
      ++unsynced_;
    return ec;
  }

  // A slot's pid_ns field holds both namespaces its owner is judged in: the
  // time namespace's inode above the PID namespace's (each is 32 bits). A
  // slot of an older dibs holds the PID namespace alone, so its time
  // namespace reads as none, which matches only a kernel without time
  // namespaces: elsewhere its start time is not compared, and only a pid
  // that no longer exists frees it (safe: such a slot is kept, never taken).
  static constexpr std::uint64_t pack_namespaces(std::uint32_t pid_ns, std::uint32_t time_ns) noexcept {
    return std::uint64_t{time_ns} << 32 | pid_ns;
  }

  // Effects: takes a free slot. Returns: its index, or nullopt if none is free.
  std::optional<unsigned> claim_slot() {
    const auto& me = detail::this_process_base();  // before a claim: it may throw
    for (int pass = 0; pass < 2; ++pass) {
      for (unsigned k = 0; k < detail::log_slot_count; ++k) {
        const unsigned i = (hint_ + k) % detail::log_slot_count;
        slot& s = state_->slots[i];
        std::uint32_t w = s.word.load(std::memory_order_relaxed);
        if (state_of(w) != slot::free) continue;
        const std::uint32_t ticket = ticket_of(w) + slot::ticket_unit;
        if (!s.word.compare_exchange_strong(w, ticket + slot::filling, std::memory_order_acquire)) continue;
        s.start.store(me.start, std::memory_order_relaxed);
        s.pid_ns.store(pack_namespaces(me.pid_ns, me.time_ns), std::memory_order_relaxed);
        s.pid.store(static_cast<std::int32_t>(me.pid), std::memory_order_relaxed);
        s.owner_ticket.store(ticket, std::memory_order_release);
        hint_ = i;
        return i;
      }
      if (pass == 0 && !reclaim_dead_slots()) break;
    }
    return std::nullopt;
  }

  // Effects: frees slots whose owner died while filling them or before it
  // saw its record's outcome. Returns: whether any was freed.
  bool reclaim_dead_slots() {
    bool any = false;
    for (slot& s : state_->slots) {
      std::uint32_t w = s.word.load(std::memory_order_acquire);
      const std::uint32_t st = state_of(w);
      if (st != slot::filling && st != slot::done && st != slot::failed) continue;
      // Who claimed it, as that claim wrote it (if it got that far; else keep it).
      if (s.owner_ticket.load(std::memory_order_acquire) != ticket_of(w)) continue;
      const std::uint64_t ns = s.pid_ns.load(std::memory_order_relaxed);
      const detail::process_identity owner{s.pid.load(std::memory_order_relaxed),
                                           s.start.load(std::memory_order_relaxed),
                                           static_cast<std::uint32_t>(ns), static_cast<std::uint32_t>(ns >> 32)};
      // (Same host and boot: the lock file is set up anew after a reboot.)
      if (!detail::provably_gone(owner)) continue;  // alive, or cannot tell: keep it
      // Fails if the slot moved on meanwhile (then pid may not be its owner's).
      if (s.word.compare_exchange_strong(w, ticket_of(w) + slot::free)) any = true;
    }
    return any;
  }

  // Effects: queues the record in slot i and waits until it is written
  // (by whoever holds the lock, this writer included) or it fails.
  std::error_code append_queued(unsigned i, std::string_view record, bool newline, bool sync, const char*& what,
                                const std::stop_token& stop) {
    slot& s = state_->slots[i];
    std::memcpy(s.data, record.data(), record.size());
    if (newline) s.data[record.size()] = '\n';
    s.size = static_cast<std::uint32_t>(record.size() + (newline ? 1 : 0));
    s.sync = sync ? 1 : 0;
    s.error = 0;
    s.failure = 0;
    const std::uint32_t ticket = ticket_of(s.word.load(std::memory_order_relaxed));
    s.word.store(ticket + slot::ready, std::memory_order_seq_cst);
    state_->ready_slots.fetch_or(std::uint64_t{1} << i, std::memory_order_seq_cst);
    const auto deadline = std::chrono::steady_clock::now() + opts_.lock_timeout;
    int rounds = 0;
    for (;;) {
      std::uint32_t w = s.word.load(std::memory_order_acquire);
      const std::uint32_t st = state_of(w);
      if (st == slot::done || st == slot::failed) {
        const int err = s.error;
        const auto failure = static_cast<detail::log_failure>(s.failure);
        s.word.store(ticket + slot::free, std::memory_order_release);
        if (err == 0) return {};
        what = describe(failure);
        return {err, std::system_category()};
      }
      // Ready or taken: try to be the one who writes it.
      const int rc = state_->mutex.try_lock();
      if (rc == 0 || rc == EOWNERDEAD) {
        // Flag it again: a holder that died may have cleared the flag.
        state_->ready_slots.fetch_or(std::uint64_t{1} << i);
        try {
          write_queued(rc, nullptr);
        } catch (...) {
          // The repair of a dead holder's batch failed. A record queued
          // again (a batch cut short) is not in the file: withdraw it. One
          // still taken is in a batch whose size could not be checked; it is
          // never withdrawn (a later holder may be writing it): wait for a
          // repair that can.
          w = s.word.load(std::memory_order_acquire);
          if (state_of(w) == slot::ready && s.word.compare_exchange_strong(w, ticket + slot::free)) throw;
          detail::futex_wait(s.word, w, holder_check);
          continue;
        }
        continue;
      }
      if (rc != EBUSY) {
        if (state_of(w) == slot::ready && s.word.compare_exchange_strong(w, ticket + slot::free)) {
            what = "cannot take the lock of log";
          return {rc, std::system_category()};
        }
        detail::futex_wait(s.word, w, holder_check);  // taken: a holder is writing it
        continue;
      }
      // Someone holds the lock: it writes this record, or looks for it after
      // unlocking. It is likely running and about to: watch for a while
      // before sleeping (a sleep costs the holder a wake-up call).
      if (rounds < spin_rounds + yield_rounds) {
        if (rounds++ < spin_rounds) {
          for (int k = 0; k < pauses_per_round && s.word.load(std::memory_order_relaxed) == w; ++k) detail::cpu_relax();
        } else {
          ::sched_yield();
        }
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      auto wait = std::chrono::nanoseconds(holder_check);
      if (const bool stopped = stop.stop_requested(); stopped || now >= deadline) {
        if (st == slot::ready && s.word.compare_exchange_strong(w, ticket + slot::free)) {
          what = stopped ? "cancelled waiting for the lock of log" : "timed out waiting for the lock of log";
          return stopped ? errc::cancelled : errc::timed_out;
        }
        // Taken: being written. Its outcome comes soon, or the holder died
        // and the next one (perhaps this writer) deals with the batch.
      } else {
        wait = std::min(wait, std::chrono::nanoseconds(deadline - now));
      }
      if (!(w & slot::waiting)) {
        // Say so before sleeping, then try the lock once more: a holder that
        // unlocked before seeing the flag has left the lock free.
        s.word.compare_exchange_strong(w, w | slot::waiting);
        continue;
      }
      detail::futex_wait(s.word, w, wait);
    }
  }

  // Effects: writes a record that is not queued (too large, or no free slot)
  // under the lock, with whatever is queued.
  std::error_code append_own(std::string_view record, bool newline, bool sync, const char*& what,
                             const std::stop_token& stop) {
    int rc;
    if (!stop.stop_possible()) {
      rc = state_->mutex.lock_for(opts_.lock_timeout);
    } else {  // in slices, looking at the stop token between them
      const auto deadline = std::chrono::steady_clock::now() + opts_.lock_timeout;
      for (;;) {
        if (stop.stop_requested()) {
          what = "cancelled waiting for the lock of log";
          return errc::cancelled;
        }
        const auto left = deadline - std::chrono::steady_clock::now();
        rc = state_->mutex.lock_for(std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::clamp<std::chrono::steady_clock::duration>(left, std::chrono::steady_clock::duration::zero(),
                                                            holder_check)));
        if (rc != ETIMEDOUT || left <= std::chrono::steady_clock::duration::zero()) break;
      }
    }
    if (rc == ETIMEDOUT) {
      what = "timed out waiting for the lock of log";
      return errc::timed_out;
    }
    if (rc != 0 && rc != EOWNERDEAD) {
      what = "cannot take the lock of log";
      return {rc, std::system_category()};
    }
    own_record own{record, newline, sync};
    write_queued(rc, &own);
    if (own.error == 0) return {};
    what = describe(own.failure);
    return {own.error, std::system_category()};
  }

  // The held lock, recorded as this process's in the shared state while it
  // is held (for the message of a writer that times out); unlocks on scope exit.
  struct held_lock {
    detail::log_shared_state* st;
    explicit held_lock(detail::log_shared_state* state) : st(state) {
      const auto& me = detail::this_process_base();
      st->holder_pid_ns.store(static_cast<std::uint32_t>(me.pid_ns), std::memory_order_relaxed);
      st->holder_start.store(me.start, std::memory_order_relaxed);
      st->holder_since_ms.store(detail::wall_ms(), std::memory_order_relaxed);
      st->holder_pid.store(static_cast<std::int32_t>(me.pid), std::memory_order_relaxed);
    }
    ~held_lock() {
      st->holder_pid.store(0, std::memory_order_relaxed);
      st->mutex.unlock();
    }
  };

  // Returns: what a writer that timed out says of the holder it waited on.
  std::string holder_hint() const {
    const auto pid = state_->holder_pid.load(std::memory_order_relaxed);
    if (pid == 0)
      return " (another writer held the lock for all of lock_timeout, and has let go of it since)";
    const auto since = std::chrono::system_clock::time_point{
        std::chrono::milliseconds{state_->holder_since_ms.load(std::memory_order_relaxed)}};
    const auto held = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now() - since);
    const bool same_ns = state_->holder_pid_ns.load(std::memory_order_relaxed) == detail::this_process_base().pid_ns;
    return fmt::format(" (held by pid {}{} for {} now; is it stopped or stuck? `ps -o stat= -p {}` shows T for stopped)",
                       pid, same_ns ? "" : " of another PID namespace", detail::human(held), pid);
  }

  // Requires: the lock is held (taken with result rc). Effects: repairs what
  // a dead holder left, writes the queued records and `own`, unlocks, and
  // then sees to records queued meanwhile.
  void write_queued(int rc, own_record* own) {
    write_locked(rc, own);
    after_unlock();
  }

  // Requires: the lock is held (taken with result rc). Effects: repairs what
  // a dead holder left, writes the queued records and `own`, unlocks. If the
  // writing throws (out of memory), the records it took are left for the
  // next holder to queue again, as if this one had died.
  void write_locked(int rc, own_record* own) {
    held_lock guard{state_};
    if (rc == EOWNERDEAD) state_->needs_repair = 1;
    if (state_->needs_repair) repair();
    try {
      write_batch(own);
    } catch (...) {
      state_->needs_repair = 1;
      throw;
    }
  }

  // A record marked ready after the holder's last look, by a writer whose
  // try of the lock failed because the holder still had it: that writer may
  // now sleep, so the holder (the last one to unlock) looks again. The writer
  // flags its slot, then tries the lock; the holder unlocks, then reads the
  // flags, with a read-modify-write (no fence: ThreadSanitizer cannot check
  // those): its read comes after the writer's in the flags' order, or the
  // writer's comes after it and the writer's try finds the lock free.
  void after_unlock() noexcept {
    for (int round = 0; round < max_rounds; ++round) {
      if (state_->ready_slots.fetch_or(0) == 0) return;
      const int rc = state_->mutex.try_lock();
      if (rc != 0 && rc != EOWNERDEAD) return;  // its holder looks after unlocking
      try {
        write_locked(rc, nullptr);
      } catch (...) {
        break;
      }
    }
    // Enough for others: wake the writers of what is still queued, to take
    // the lock themselves.
    for (std::uint64_t bits = state_->ready_slots.load(); bits != 0; bits &= bits - 1) {
      slot& s = state_->slots[std::countr_zero(bits)];
      const std::uint32_t w = s.word.load(std::memory_order_relaxed);
      if (state_of(w) == slot::ready && (w & slot::waiting)) detail::futex_wake(s.word);
    }
  }

  // Requires: the lock is held and needs_repair is set (a holder died, or a
  // repair failed). Effects: deals with the batch a dead holder was writing:
  // all of it in the file: its records are done; less: its records are
  // queued again and the part written is cut off.
  void repair() {
    bool complete = false, cut = false;
    if (state_->pending_start >= 0) {
      struct ::stat st {};
      if (::stat(path_.c_str(), &st) == 0) {
        // Only if the batch went to this file (not to one renamed since,
        // say by a rotation after a crash of the machine).
        if (st.st_ino == state_->pending_ino && st.st_dev == state_->pending_dev) {
          complete = state_->pending_len > 0 && st.st_size >= state_->pending_start + state_->pending_len;
          cut = !complete && st.st_size > state_->pending_start;
        }
      } else if (errno != ENOENT) {
        throw detail::path_error(errno, "dibs::shared_log: cannot stat log to repair it", path_);
      }
    }
    // Records of a whole batch that asked to be on disk before done: the
    // dead holder may not have got to its fdatasync.
    int sync_error = 0;
    if (complete) {
      bool sync = false;
      for (slot& s : state_->slots) sync = sync || (state_of(s.word.load()) == slot::taken && s.sync);
      if (sync) {
        detail::unique_fd fd{detail::open_retry(path_.c_str(), O_WRONLY | O_CLOEXEC)};
        if (!fd || ::fdatasync(fd.get()) != 0) sync_error = errno;
      }
    }
    std::uint64_t queued = 0;
    for (unsigned i = 0; i < detail::log_slot_count; ++i) {
      slot& s = state_->slots[i];
      std::uint32_t w = s.word.load(std::memory_order_acquire);
      if (state_of(w) == slot::taken) {
        if (complete) {
          const auto [err, why] = outcome(0, detail::log_failure::none, sync_error, s.sync != 0);
          s.error = err;
          s.failure = static_cast<std::uint32_t>(why);
        }
        const std::uint32_t next = complete ? slot::done : slot::ready;
        // (Its owner may be setting its waiting flag meanwhile.)
        while (state_of(w) == slot::taken && !s.word.compare_exchange_weak(w, (w & ~slot::state_mask) | next)) {
        }
        if (complete && (w & slot::waiting)) detail::futex_wake(s.word);
        w = (w & ~slot::state_mask) | next;
      }
      // Ready: also those whose flag the dead holder had cleared but not yet taken.
      if (state_of(w) == slot::ready) queued |= std::uint64_t{1} << i;
    }
    state_->ready_slots.fetch_or(queued);
    // Queued again before the cut: if the cut fails, their writers may
    // withdraw them (they are not in the file once it is cut), and no batch
    // is written before a repair succeeds.
    if (cut && ::truncate(path_.c_str(), static_cast<off_t>(state_->pending_start)) != 0)
      throw detail::path_error(errno, "dibs::shared_log: cannot cut a torn record from", path_);
    state_->pending_start = -1;
    state_->file_end = -1;
    state_->needs_repair = 0;
  }

  // Requires: the lock is held, nothing left to repair. Effects: writes every
  // queued record and `own` in one go, and marks each with its outcome.
  void write_batch(own_record* own) {
    std::array<unsigned, detail::log_slot_count> batch;
    std::array<iovec, detail::log_slot_count + 2> iov;
    std::size_t count = 0, parts = 0;
    std::int64_t total = 0;
    bool sync = false;
    for (std::uint64_t bits = state_->ready_slots.exchange(0); bits != 0; bits &= bits - 1) {
      const auto i = static_cast<unsigned>(std::countr_zero(bits));
      slot& s = state_->slots[i];
      std::uint32_t w = s.word.load(std::memory_order_relaxed);
      // Its owner may set its waiting flag meanwhile, or withdraw it.
      while (state_of(w) == slot::ready &&
             !s.word.compare_exchange_weak(w, (w & ~slot::state_mask) | slot::taken, std::memory_order_acquire)) {
      }
      if (state_of(w) != slot::ready) continue;
      batch[count++] = i;
      const std::size_t size = std::min<std::size_t>(s.size, slot_capacity);
      iov[parts++] = {s.data, size};
      total += static_cast<std::int64_t>(size);
      sync = sync || s.sync != 0;
    }
    if (own) {
      iov[parts++] = {const_cast<char*>(own->text.data()), own->text.size()};
      if (own->newline) iov[parts++] = {const_cast<char*>("\n"), 1};
      total += static_cast<std::int64_t>(own->text.size() + (own->newline ? 1 : 0));
      sync = sync || own->sync;
    }
    if (count == 0 && !own) return;

    int error = 0, sync_error = 0;
    auto failure = detail::log_failure::none;
    off_t start = -1;
    std::int64_t now_ns = 0;
    if (generation_ != state_->generation) {  // rotated since this writer's last batch
      try {
        open_log();
        generation_ = state_->generation;
      } catch (const std::system_error& e) {
        error = e.code().value();
        failure = detail::log_failure::reopen;
      } catch (...) {
        error = ENOMEM;
        failure = detail::log_failure::reopen;
      }
    }
    if (!error) {
      // Where the batch starts (kept for a repair after a crash): the end of
      // the previous batch, if that began less than fresh_ns ago. Every
      // writer goes through this lock, so it is exact; a program appending
      // to (or truncating) the log by itself could only mislead a repair in
      // that short window, as it could during any holder's write. Else the
      // size of the file: lseek and not fstat, since a stat marks the
      // timestamps as seen, and the kernel (multigrain timestamps) then
      // gives the next write a fresh one, which dirties the inode on every
      // write (measured: 8 writers at 0.48x of bare appends with an fstat
      // per write, 1.06x with an lseek). Skipping the lseek under load:
      // docs/BENCHMARKS.md.
      timespec ts{};
      ::clock_gettime(CLOCK_MONOTONIC, &ts);
      now_ns = std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
      start = state_->file_end >= 0 && now_ns - state_->file_end_ns < fresh_ns ? state_->file_end
                                                                               : ::lseek(fd_.get(), 0, SEEK_END);
      if (start < 0) {
        error = errno;
        failure = detail::log_failure::seek;
      }
    }
    if (!error) {
      state_->pending_len = total;
      state_->pending_dev = log_dev_;
      state_->pending_ino = log_ino_;
      state_->pending_start = start;
      state_->file_end = -1;
      error = write_all(iov.data(), static_cast<int>(parts));
      if (error) {
        failure = detail::log_failure::write;
        // A full disk, a quota, an I/O error: take back what was written. If
        // even that fails, the next holder cuts it off (its records are failed
        // now, and will not be in the file).
        if (::ftruncate(fd_.get(), start) != 0) state_->needs_repair = 1;
      } else {
        state_->file_end = start + total;
        state_->file_end_ns = now_ns;
        if (sync && ::fdatasync(fd_.get()) != 0) sync_error = errno;
      }
    }
    for (std::size_t k = 0; k < count; ++k) {
      slot& s = state_->slots[batch[k]];
      const auto [err, why] = outcome(error, failure, sync_error, s.sync != 0);
      s.error = err;
      s.failure = static_cast<std::uint32_t>(why);
      // Only this holder moves a taken slot on; its owner may set its waiting flag.
      std::uint32_t w = s.word.load(std::memory_order_relaxed);
      while (state_of(w) == slot::taken &&
             !s.word.compare_exchange_weak(w, (w & ~(slot::state_mask | slot::waiting)) |
                                                  (error ? slot::failed : slot::done))) {
      }
      if (w & slot::waiting) detail::futex_wake(s.word);
    }
    if (own) std::tie(own->error, own->failure) = outcome(error, failure, sync_error, own->sync);
    if (!state_->needs_repair) state_->pending_start = -1;
    if (!error && opts_.rotate_size > 0 && static_cast<std::uint64_t>(start + total) >= opts_.rotate_size) {
      // The records are in and are reported so: a failed rotation only means
      // a later batch tries again.
      try {
        rotate();
      } catch (const std::exception&) {
      }
    }
  }

  // Effects: writes all of iov[0, n) to the log, going on after a short write.
  // Returns: 0, or the errno of the write that failed (ENOSPC for none written).
  int write_all(iovec* iov, int n) noexcept {
    while (n > 0) {
      const ssize_t k = ::writev(fd_.get(), iov, std::min(n, IOV_MAX));
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

  // Requires: the lock is held and our descriptor is the current file.
  // Effects: renames the log to `<path>.1` after shifting the rotated files
  // up by one (`.1` to `.2`, ...), as logrotate does, and deletes those
  // beyond opts_.keep.
  //
  // Crash safety: every step is one rename (never over an existing file:
  // RENAME_NOREPLACE) or the deletion of a file beyond `keep`, so a rotator
  // killed at any point loses no record. It may leave a shift half done: a
  // gap in `.1 .2 ...` (`.1 .3 .4` after `.3 -> .4` and `.2 -> .3`), or no
  // `.1` at all. The next rotation finishes it: it shifts only the files
  // below the first gap, which is exactly what the dead rotator had left to
  // shift, and a missing `.1` needs no shift. Then it renames the log, which
  // still holds every record written since (the generation was bumped first,
  // so writers reopen the same file until the rename happens).
  void rotate() {
    if (opts_.sync != durability::none) ::fdatasync(fd_.get());
    // First: every writer opens the log again before its next batch. A
    // rotator that dies before its rename leaves them the same file; one that
    // dies after it leaves them the new one, never the renamed one.
    ++state_->generation;
    state_->file_end = -1;
    auto exists = [](const std::filesystem::path& p) {
      struct ::stat st {};
      if (::lstat(p.c_str(), &st) == 0) return true;
      if (errno != ENOENT) throw detail::path_error(errno, "dibs::shared_log: cannot stat rotated log", p);
      return false;
    };
    for (int attempt = 0;; ++attempt) {
      // The first gap: `.1 ... .(gap-1)` exist, `.gap` does not.
      std::uint64_t gap = 1;
      while (exists(rotated_path(gap))) ++gap;
      // Shift the newest-first run up by one, oldest first, so that no rename
      // has to replace a file.
      for (std::uint64_t n = gap - 1; n >= 1; --n) {
        const auto from = rotated_path(n), to = rotated_path(n + 1);
        if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) != 0 && errno != ENOENT)
          throw detail::path_error(errno, "dibs::shared_log: cannot shift rotated log", from);
      }
      const auto newest = rotated_path(1);
      if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, newest.c_str(), RENAME_NOREPLACE) == 0) break;
      if (errno == ENOENT) break;  // a rotator died after its rename: finish its rotation
      // `.1` appeared meanwhile (not through shared_log, which rotates under
      // the lock): shift again, a few times at most.
      if (errno != EEXIST || attempt >= 3) throw detail::path_error(errno, "dibs::shared_log: cannot rotate log", path_);
    }
    if (opts_.keep > 0) {
      // Beyond `keep`: normally only `.keep+1`, just shifted there; more if
      // `keep` was lowered since the last rotation.
      for (std::uint64_t n = opts_.keep + 1; ::unlink(rotated_path(n).c_str()) == 0; ++n) {
      }
    }
    open_log();  // (and, with durability, syncs the directory: the renames and the new file)
    generation_ = state_->generation;
  }

  std::filesystem::path path_;
  shared_log_options opts_;
  detail::unique_fd fd_;
  detail::log_shared_state* state_ = nullptr;
  std::uint64_t generation_ = 0;
  std::uint64_t log_dev_ = 0, log_ino_ = 0;  // of the file fd_ is open on
  // Its permission bits, owner and group, which a lock file this writer
  // creates takes on.
  mode_t log_mode_ = 0;
  uid_t log_uid_ = 0;
  gid_t log_gid_ = 0;
  unsigned hint_ = 0;
  std::size_t unsynced_ = 0;
  std::mutex self_;
};

}  // namespace dibs
