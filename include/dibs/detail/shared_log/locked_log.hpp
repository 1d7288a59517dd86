// dibs/detail/shared_log/locked_log.hpp: dibs::shared_log on Windows. Every
// record is written by its own writer under the log's lock (LockFileEx on
// one byte of the lock file `.<name>.dibs-lock`), after the writer has read
// the shared state (at the start of that file) and repaired what a dead
// holder left; no records are combined (the Linux queue is a shared
// mapping and futexes: not ported). The Win32 calls are in
// detail/win32/log_file.hpp.
//
// Why this is safe under TerminateProcess:
//   - Windows releases a process's byte-range locks when it ends, however
//     it ends, so a dead holder never keeps the lock.
//   - A holder writes where its record starts and how long it is into the
//     shared state before writing the record, and clears it after. The next
//     holder that finds it set knows its writer died there: all of the
//     record in the file means it is kept (whole, though perhaps never
//     acknowledged); less means the part written is cut off. So no torn
//     record stays before the next one.
//   - A record is one WriteFile on a handle opened with FILE_APPEND_DATA:
//     it goes to the end of the file, in one piece.
//   - Rotation bumps the generation in the shared state first, then renames
//     the log (MoveFileExW, never over a file). Every writer compares its
//     generation with the shared one under the lock and opens the log again
//     when they differ, so no record goes to a rotated file. Other writers
//     may hold the log open meanwhile: every file is opened sharing deletes,
//     which is what lets Windows rename it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include <dibs/detail/shared_log/log_names.hpp>
#include <dibs/detail/units.hpp>
#include <dibs/detail/win32/directory.hpp>
#include <dibs/detail/win32/log_file.hpp>
#include <dibs/detail/win32/sys.hpp>
#include <dibs/error.hpp>

namespace dibs::detail {

// The shared state, at the start of the lock file; read and written only
// by the lock's holder (except holder_pid, read for a message).
struct locked_log_state {
  static constexpr char magic_value[8] = {'d', 'i', 'b', 's', 'l', 'o', 'g', 'W'};
  char magic[8];
  std::uint64_t generation;      // bumped by every rotation
  std::int64_t pending_start;    // where the record being written began; -1: none
  std::int64_t pending_len;      // and its length
  std::uint64_t pending_volume;  // and the file it went to
  std::uint64_t pending_index;
  std::uint32_t holder_pid;      // for messages: who holds the lock (0: none recorded)
  std::uint32_t reserved;
  std::int64_t holder_since_ms;  // since when (Unix ms)
};
static_assert(sizeof(locked_log_state) == 64, "the lock file's layout is that of every dibs on Windows");

// What a failed record's writer reports.
enum class locked_log_failure { none, write, sync, reopen, seek, lock };

inline const char* describe_locked_log_failure(locked_log_failure f) noexcept {
  switch (f) {
    case locked_log_failure::sync: return "record appended, but FlushFileBuffers failed, for log";
    case locked_log_failure::reopen: return "cannot open the log file again after a rotation, for log";
    case locked_log_failure::seek: return "cannot find the end of log";
    case locked_log_failure::lock: return "cannot use the lock file of log";
    default: return "cannot append to log";
  }
}

inline constexpr const char* not_a_locked_log_lock_file =
    "dibs::shared_log: not a dibs shared_log lock file, or one of another version of dibs (remove it if no "
    "writer runs):";

class locked_log {
public:
  // rotate_size 0: never; keep 0: all; sync: durability is not none (the
  // directory is flushed after the log is created or renamed).
  struct settings {
    std::uint64_t rotate_size;
    std::uint64_t keep;
    bool sync;
    std::chrono::milliseconds lock_timeout;
  };

  // Effects: opens (creating) the log at `given` and its lock file.
  // Throws: std::system_error naming the path.
  locked_log(const std::filesystem::path& given, settings s) : settings_(s) {
    std::error_code ec;
    const auto absolute = std::filesystem::absolute(given, ec);
    if (ec) throw path_error(static_cast<DWORD>(ec.value()), "dibs::shared_log: cannot make the path of log absolute", given);
    path_ = absolute.lexically_normal();
    open_log();
    // One file, one lock: named after the name Windows knows the file by,
    // whatever link, junction or spelling the caller used.
    path_ = win32_log::final_path(log_.get(), path_);
    lock_path_ = log_lock_path(path_);
    lock_ = win32_log::open_lock_file(lock_path_);
    DWORD e = 0;
    locked_log_state st{};
    if (win32_log::read_state(lock_.get(), &st, sizeof st, e) < 0)
      throw path_error(e, "dibs::shared_log: cannot read lock file", lock_path_);
    if (!fresh(st) && std::memcmp(st.magic, locked_log_state::magic_value, 8) != 0)
      throw path_error(ERROR_INVALID_DATA, not_a_locked_log_lock_file, lock_path_);
    if (s.sync) sync_directory_of_log();
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  const std::filesystem::path& lock_path() const noexcept { return lock_path_; }

  // Effects: appends `record` (and a newline if `newline`) under the lock,
  // repairing first what a dead holder left; FlushFileBuffers after it if
  // `sync`. Returns: the failure, with `what` saying what failed.
  std::error_code append(std::string_view record, bool newline, bool sync, const char*& what,
                         const std::stop_token& stop) {
    line_.assign(record);
    if (newline) line_ += '\n';
    if (auto ec = lock(what, stop)) return ec;
    struct unlock_at_end {
      HANDLE h;
      ~unlock_at_end() { win32_log::unlock(h); }
    } unlock{lock_.get()};
    auto fail = [&](DWORD e, locked_log_failure f) {
      what = describe_locked_log_failure(f);
      return std::error_code{static_cast<int>(e), std::system_category()};
    };
    locked_log_state st{};
    DWORD e = 0;
    if (win32_log::read_state(lock_.get(), &st, sizeof st, e) < 0) return fail(e, locked_log_failure::lock);
    if (fresh(st)) {
      std::memcpy(st.magic, locked_log_state::magic_value, 8);
      st.generation = 1;
      st.pending_start = -1;
    } else if (std::memcmp(st.magic, locked_log_state::magic_value, 8) != 0) {
      return fail(ERROR_INVALID_DATA, locked_log_failure::lock);
    }
    if (st.pending_start >= 0) {
      if (const DWORD r = repair(st)) return fail(r, locked_log_failure::lock);
    }
    if (generation_ != st.generation) {  // rotated since this writer's last record (or its first)
      try {
        open_log();
      } catch (const std::system_error& x) {
        return fail(static_cast<DWORD>(x.code().value()), locked_log_failure::reopen);
      }
      generation_ = st.generation;
    }
    const std::int64_t start = win32_log::size_of(log_.get());
    if (start < 0) return fail(::GetLastError(), locked_log_failure::seek);
    const auto len = static_cast<std::int64_t>(line_.size());
    st.pending_start = start;
    st.pending_len = len;
    st.pending_volume = id_.volume;
    st.pending_index = id_.index;
    st.holder_pid = current_pid();
    st.holder_since_ms = win32_log::wall_ms();
    if (const DWORD w = win32_log::write_state(lock_.get(), &st, sizeof st)) return fail(w, locked_log_failure::lock);
    DWORD error = win32_log::append(log_.get(), line_.data(), line_.size());
    auto failure = error ? locked_log_failure::write : locked_log_failure::none;
    // A full disk, a quota, an I/O error: take back what was written. If
    // even that fails, the state keeps the record pending and the next
    // holder cuts it off.
    const bool cut = error == 0 || win32_log::cut(path_, id_, start) == 0;
    if (error == 0 && sync) {
      error = win32_log::flush(log_.get());
      if (error) failure = locked_log_failure::sync;
    }
    if (cut) {
      st.pending_start = -1;
      st.holder_pid = 0;
      // If this fails, the next holder finds the record pending and whole,
      // and keeps it.
      (void)win32_log::write_state(lock_.get(), &st, sizeof st);
    }
    if (error) return fail(error, failure);
    if (settings_.rotate_size > 0 && static_cast<std::uint64_t>(start + len) >= settings_.rotate_size) {
      // The record is in and is reported so: a failed rotation only means
      // a later record tries again.
      try {
        rotate(st);
      } catch (const std::exception&) {
      }
    }
    return {};
  }

  // Effects: forces the log file to stable storage: through this writer's
  // handle if the log has not been rotated since its last record, else
  // through one opened now. Throws: std::system_error naming the log.
  void sync() {
    locked_log_state st{};
    DWORD e = 0;
    const bool current = win32_log::read_state(lock_.get(), &st, sizeof st, e) == sizeof st && st.generation == generation_;
    const DWORD f = current && generation_ != 0 ? win32_log::flush(log_.get()) : win32_log::flush_path(path_);
    if (f) throw path_error(f, "dibs::shared_log: cannot flush log", path_);
  }

  // Returns: what a writer that timed out says of the holder it waited on
  // (read without the lock: its byte is far past the state).
  std::string holder_hint() const {
    locked_log_state st{};
    DWORD e = 0;
    if (win32_log::read_state(lock_.get(), &st, sizeof st, e) != sizeof st || st.holder_pid == 0)
      return " (another writer held the lock for all of lock_timeout, and has let go of it since)";
    const auto held = std::chrono::milliseconds{std::max<std::int64_t>(0, win32_log::wall_ms() - st.holder_since_ms)};
    return fmt::format(" (held by pid {} for {} now; is it stuck? `tasklist /fi \"PID eq {}\"` shows it)",
                       st.holder_pid, human(held), st.holder_pid);
  }

private:
  static bool fresh(const locked_log_state& st) noexcept {
    static constexpr char none[8] = {};
    return std::memcmp(st.magic, none, 8) == 0;
  }

  // Effects: opens the log at path_ (again), and checks it has one name.
  void open_log() {
    unique_handle h = win32_log::open_append(path_);
    win32_log::file_info info;
    if (!win32_log::info_of(h.get(), info))
      throw path_error(::GetLastError(), "dibs::shared_log: cannot read the file information of log", path_);
    // The lock is keyed by one name of the file: writers through two hard
    // links would take two locks, and lose and tear records.
    if (info.links > 1)
      throw std::system_error(
          std::error_code{ERROR_TOO_MANY_LINKS, std::system_category()},
          fmt::format("dibs::shared_log: log file '{}' has {} names (hard links): writers through different names "
                      "would not share one lock; remove the extra links or give every writer the same name",
                      path_text(path_), info.links));
    log_ = std::move(h);
    id_ = info.id;
  }

  void sync_directory_of_log() const {
    if (const DWORD e = sync_directory(path_.parent_path()))
      throw path_error(e, "dibs::shared_log: cannot flush the directory of log", path_);
  }

  // Effects: takes the lock, trying again after a jittered sleep of up to
  // 2 ms (LockFileEx has no timeout), until lock_timeout or a stop.
  std::error_code lock(const char*& what, const std::stop_token& stop) {
    const auto deadline = std::chrono::steady_clock::now() + settings_.lock_timeout;
    std::minstd_rand jitter{static_cast<unsigned>(current_pid()) ^
                            static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count())};
    for (int round = 0;; ++round) {
      const DWORD e = win32_log::try_lock(lock_.get());
      if (e == 0) return {};
      if (e != ERROR_LOCK_VIOLATION) {
        what = "cannot take the lock of log";
        return {static_cast<int>(e), std::system_category()};
      }
      if (stop.stop_requested()) {
        what = "cancelled waiting for the lock of log";
        return errc::cancelled;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        what = "timed out waiting for the lock of log";
        return errc::timed_out;
      }
      if (round < 8) {
        std::this_thread::yield();
        continue;
      }
      const auto nap = std::chrono::microseconds{500 + jitter() % 1500};
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(nap, deadline - now));
    }
  }

  // Requires: the lock is held and st.pending_start >= 0: the holder that
  // wrote it died while writing its record. Effects: all of the record in
  // its file: kept; less: the part written cut off. Clears the pending
  // record in `st` (written back with the next record's state).
  // Returns: 0 or the error (the record stays pending).
  DWORD repair(locked_log_state& st) {
    const win32_log::file_id id{st.pending_volume, st.pending_index};
    DWORD e = 0;
    // Only if it went to the log at path_ (a file renamed since holds none
    // of a record written after the rename).
    const std::int64_t size = win32_log::size_if_same(path_, id, e);
    if (size == -2) return e;
    if (size > st.pending_start && size < st.pending_start + st.pending_len) {
      if (const DWORD c = win32_log::cut(path_, id, st.pending_start)) return c;
    }
    st.pending_start = -1;
    return 0;
  }

  // Requires: the lock is held, `st` is the state just written. Effects:
  // renames the log to `<path>.1` after shifting the rotated files up by
  // one (`.1` to `.2`, ...), deletes those beyond `keep`, opens the new log.
  // Crash safety as on Linux (detail/shared_log/rotation.hpp): every step
  // is one rename, never over a file, and the next rotation finishes what
  // a killed one left.
  void rotate(locked_log_state& st) {
    if (settings_.sync) (void)win32_log::flush(log_.get());
    // First: every writer opens the log again before its next record.
    ++st.generation;
    if (const DWORD e = win32_log::write_state(lock_.get(), &st, sizeof st))
      throw path_error(e, "dibs::shared_log: cannot write lock file", lock_path_);
    const auto rotated = [&](std::uint64_t n) { return rotated_log_path(path_, n); };
    for (int attempt = 0;; ++attempt) {
      std::uint64_t gap = 1;
      while (win32_log::exists(rotated(gap))) ++gap;
      for (std::uint64_t n = gap - 1; n >= 1; --n) {
        const auto from = rotated(n);
        if (const DWORD e = win32_log::rename_no_replace(from, rotated(n + 1)); e != 0 && e != ERROR_FILE_NOT_FOUND)
          throw path_error(e, "dibs::shared_log: cannot shift rotated log", from);
      }
      const DWORD e = win32_log::rename_no_replace(path_, rotated(1));
      if (e == 0 || e == ERROR_FILE_NOT_FOUND) break;  // (not found: a rotator died after its rename)
      if ((e != ERROR_ALREADY_EXISTS && e != ERROR_FILE_EXISTS) || attempt >= 3)
        throw path_error(e, "dibs::shared_log: cannot rotate log", path_);
    }
    if (settings_.keep > 0) {
      for (std::uint64_t n = settings_.keep + 1; win32_log::remove(rotated(n)) == 0; ++n) {
      }
    }
    open_log();
    generation_ = st.generation;
    if (settings_.sync) sync_directory_of_log();
  }

  settings settings_;
  std::filesystem::path path_, lock_path_;
  unique_handle log_;  // the log, opened for appending
  win32_log::file_id id_;
  unique_handle lock_;  // the lock file
  // The generation of the file log_ is open on; 0 at first (the log may
  // have been rotated between the open and the first lock): the first
  // record opens it again.
  std::uint64_t generation_ = 0;
  std::string line_;  // the record being written, with its newline
};

}  // namespace dibs::detail
