// dibs/detail/shared_log/holder.hpp: what a shared_log writer does while it
// holds the log's lock: repair what a dead holder left, take every queued
// record (and its own, if it writes one itself) into one batch, write the
// batch with one writev, mark each record with its outcome and wake its
// writer, rotate when the log is full, and, after unlocking, look once more
// for records queued meanwhile. Also: who holds the lock, recorded for the
// message of a writer that times out. Separate from the writer's side
// (append.hpp): this is the combining, the one place records reach the file.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>

#include <fmt/format.h>

#include <dibs/detail/owner.hpp>
#include <dibs/detail/posix/file_ops.hpp>
#include <dibs/detail/posix/robust_mutex.hpp>
#include <dibs/detail/shared_log/log_file.hpp>
#include <dibs/detail/shared_log/recovery.hpp>
#include <dibs/detail/shared_log/rotation.hpp>
#include <dibs/detail/shared_log/shared_state.hpp>
#include <dibs/detail/units.hpp>

namespace dibs::detail {

// The held lock, recorded as this process's in the shared state while it
// is held (for the message of a writer that times out); unlocks on scope exit.
struct held_log_lock {
  log_shared_state* st;
  explicit held_log_lock(log_shared_state* state) : st(state) {
    const auto& me = this_process_base();
    st->holder_pid_ns.store(static_cast<std::uint32_t>(me.pid_ns), std::memory_order_relaxed);
    st->holder_start.store(me.start, std::memory_order_relaxed);
    st->holder_since_ms.store(wall_ms(), std::memory_order_relaxed);
    st->holder_pid.store(static_cast<std::int32_t>(me.pid), std::memory_order_relaxed);
  }
  held_log_lock(const held_log_lock&) = delete;
  held_log_lock& operator=(const held_log_lock&) = delete;
  ~held_log_lock() {
    st->holder_pid.store(0, std::memory_order_relaxed);
    st->mutex.unlock();
  }
};

// Returns: what a writer that timed out says of the holder it waited on.
inline std::string log_holder_hint(const log_shared_state& state) {
  const auto pid = state.holder_pid.load(std::memory_order_relaxed);
  if (pid == 0) return " (another writer held the lock for all of lock_timeout, and has let go of it since)";
  const auto since = std::chrono::system_clock::time_point{
      std::chrono::milliseconds{state.holder_since_ms.load(std::memory_order_relaxed)}};
  const auto held = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now() - since);
  const bool same_ns = state.holder_pid_ns.load(std::memory_order_relaxed) == this_process_base().pid_ns;
  return fmt::format(" (held by pid {}{} for {} now; is it stopped or stuck? `ps -o stat= -p {}` shows T for stopped)",
                     pid, same_ns ? "" : " of another PID namespace", human(held), pid);
}

// A record written by its own writer (not queued), and what became of it.
struct own_log_record {
  std::string_view text;
  bool newline;
  bool sync;
  int error = 0;
  log_failure failure = log_failure::none;
};

// What a holder does besides writing: rotate at rotate_size (0: never),
// keeping `keep` rotated files (0: all); `sync`: durability is not none.
struct log_holder_settings {
  std::uint64_t rotate_size;
  std::uint64_t keep;
  bool sync;
};

// One writer's side of holding the lock: the batches it writes to `log`
// through the lock file `state`.
class log_holder {
public:
  log_holder(log_file& log, log_shared_state& state, log_holder_settings settings) noexcept
      : log_(log), state_(state), settings_(settings) {}

  // Returns: whether the log has not been rotated since this writer's last
  // batch (so its descriptor is still the log).
  bool current() const noexcept { return generation_ == state_.generation; }

  // Requires: the lock is held (taken with result rc). Effects: repairs what
  // a dead holder left, writes the queued records and `own`, unlocks, and
  // then sees to records queued meanwhile.
  void write_queued(int rc, own_log_record* own) {
    write_locked(rc, own);
    after_unlock();
  }

private:
  using slot = log_slot;
  // Times a holder takes the lock again, after unlocking, for records queued
  // meanwhile, before it wakes their writers to do it instead.
  static constexpr int max_rounds = 4;
  // The batch starts where the previous one ended if that began less than
  // this long ago, else where lseek(SEEK_END) says.
  static constexpr std::int64_t fresh_ns = 1'000'000;

  // Requires: the lock is held (taken with result rc). Effects: repairs what
  // a dead holder left, writes the queued records and `own`, unlocks. If the
  // writing throws (out of memory), the records it took are left for the
  // next holder to queue again, as if this one had died.
  void write_locked(int rc, own_log_record* own) {
    held_log_lock guard{&state_};
    // A slot is taken only by a holder, which moves it on before it
    // unlocks: one found taken now was left by a holder that died, even if
    // the robust mutex's EOWNERDEAD did not reach this holder (its
    // repair is idempotent). Without this, a writer whose record sat in
    // such a slot took the free lock, found nothing to write and tried
    // again at once, for ever (a spinning `dibs log` under SIGKILLs in CI).
    if (rc == EOWNERDEAD || any_taken()) state_.needs_repair = 1;
    if (state_.needs_repair) repair_dead_holder(state_, log_.path());
    try {
      write_batch(own);
    } catch (...) {
      state_.needs_repair = 1;
      throw;
    }
  }

  bool any_taken() const noexcept {
    for (const slot& sl : state_.slots)
      if (slot_state(sl.word.load(std::memory_order_acquire)) == slot::taken) return true;
    return false;
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
      if (state_.ready_slots.fetch_or(0) == 0) return;
      const int rc = state_.mutex.try_lock();
      if (rc != 0 && rc != EOWNERDEAD) return;  // its holder looks after unlocking
      try {
        write_locked(rc, nullptr);
      } catch (...) {
        break;
      }
    }
    // Enough for others: wake the writers of what is still queued, to take
    // the lock themselves.
    for (std::uint64_t bits = state_.ready_slots.load(); bits != 0; bits &= bits - 1) {
      slot& s = state_.slots[std::countr_zero(bits)];
      const std::uint32_t w = s.word.load(std::memory_order_relaxed);
      if (slot_state(w) == slot::ready && (w & slot::waiting)) futex_wake(s.word);
    }
  }

  // Requires: the lock is held, nothing left to repair. Effects: writes every
  // queued record and `own` in one go, and marks each with its outcome.
  void write_batch(own_log_record* own) {
    std::array<unsigned, log_slot_count> batch;
    std::array<iovec, log_slot_count + 2> iov;
    std::size_t count = 0, parts = 0;
    std::int64_t total = 0;
    bool sync = false;
    for (std::uint64_t bits = state_.ready_slots.exchange(0); bits != 0; bits &= bits - 1) {
      const auto i = static_cast<unsigned>(std::countr_zero(bits));
      slot& s = state_.slots[i];
      std::uint32_t w = s.word.load(std::memory_order_relaxed);
      // Its owner may set its waiting flag meanwhile, or withdraw it.
      while (slot_state(w) == slot::ready &&
             !s.word.compare_exchange_weak(w, (w & ~slot::state_mask) | slot::taken, std::memory_order_acquire)) {
      }
      if (slot_state(w) != slot::ready) continue;
      batch[count++] = i;
      const std::size_t size = std::min<std::size_t>(s.size, sizeof s.data);
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
    auto failure = log_failure::none;
    std::int64_t start = -1;
    std::int64_t now_ns = 0;
    if (!current()) {  // rotated since this writer's last batch
      try {
        log_.open();
        generation_ = state_.generation;
      } catch (const std::system_error& e) {
        error = e.code().value();
        failure = log_failure::reopen;
      } catch (...) {
        error = ENOMEM;
        failure = log_failure::reopen;
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
      start = state_.file_end >= 0 && now_ns - state_.file_end_ns < fresh_ns ? state_.file_end
                                                                             : end_of_file(log_.fd());
      if (start < 0) {
        error = errno;
        failure = log_failure::seek;
      }
    }
    if (!error) {
      state_.pending_len = total;
      state_.pending_dev = log_.dev();
      state_.pending_ino = log_.ino();
      state_.pending_start = start;
      state_.file_end = -1;
      error = write_all(log_.fd(), iov.data(), static_cast<int>(parts));
      if (error) {
        failure = log_failure::write;
        // A full disk, a quota, an I/O error: take back what was written. If
        // even that fails, the next holder cuts it off (its records are failed
        // now, and will not be in the file).
        if (truncate_file(log_.fd(), static_cast<std::uint64_t>(start)) != 0) state_.needs_repair = 1;
      } else {
        state_.file_end = start + total;
        state_.file_end_ns = now_ns;
        if (sync) sync_error = sync_data(log_.fd());
      }
    }
    for (std::size_t k = 0; k < count; ++k) {
      slot& s = state_.slots[batch[k]];
      const auto [err, why] = log_outcome(error, failure, sync_error, s.sync != 0);
      s.error = err;
      s.failure = static_cast<std::uint32_t>(why);
      // Only this holder moves a taken slot on; its owner may set its waiting flag.
      std::uint32_t w = s.word.load(std::memory_order_relaxed);
      while (slot_state(w) == slot::taken &&
             !s.word.compare_exchange_weak(w, (w & ~(slot::state_mask | slot::waiting)) |
                                                  (error ? slot::failed : slot::done))) {
      }
      if (w & slot::waiting) futex_wake(s.word);
    }
    if (own) std::tie(own->error, own->failure) = log_outcome(error, failure, sync_error, own->sync);
    if (!state_.needs_repair) state_.pending_start = -1;
    if (!error && settings_.rotate_size > 0 && static_cast<std::uint64_t>(start + total) >= settings_.rotate_size) {
      // The records are in and are reported so: a failed rotation only means
      // a later batch tries again.
      try {
        rotate_log(log_, state_, settings_.keep, settings_.sync);
        generation_ = state_.generation;
      } catch (const std::exception&) {
      }
    }
  }

  log_file& log_;
  log_shared_state& state_;
  log_holder_settings settings_;
  // The generation of the log file log_ is open on. Not the lock file's at
  // first: the log was opened before the lock file was mapped, and may have
  // been rotated away in between. The first batch opens it again, under the lock.
  std::uint64_t generation_ = 0;
};

}  // namespace dibs::detail
