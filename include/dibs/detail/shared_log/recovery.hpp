// dibs/detail/shared_log/recovery.hpp: what the next lock holder does about
// the batch a holder was writing when it died (the robust mutex's
// EOWNERDEAD, or a repair that failed before): all of the batch in the file
// means its records are done; less means they are queued again and the
// part written is cut off, so no torn record stays in the log. Separate
// because it runs only after a crash, and must be right for a holder killed
// at any point of its write.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>

#include <dibs/detail/posix/sys.hpp>
#include <dibs/detail/posix/file_ops.hpp>
#include <dibs/detail/posix/robust_mutex.hpp>
#include <dibs/detail/shared_log/shared_state.hpp>

namespace dibs::detail {

// Requires: the lock is held and state.needs_repair is set (a holder died,
// or a repair failed). Effects: deals with the batch a dead holder was
// writing to the log at `path`: all of it in the file: its records are
// done; less: its records are queued again and the part written is cut off.
inline void repair_dead_holder(log_shared_state& state, const std::filesystem::path& path) {
  using slot = log_slot;
  bool complete = false, cut = false;
  if (state.pending_start >= 0) {
    struct ::stat st {};
    if (::stat(path.c_str(), &st) == 0) {
      // Only if the batch went to this file (not to one renamed since,
      // say by a rotation after a crash of the machine).
      if (st.st_ino == state.pending_ino && st.st_dev == state.pending_dev) {
        complete = state.pending_len > 0 && st.st_size >= state.pending_start + state.pending_len;
        cut = !complete && st.st_size > state.pending_start;
      }
    } else if (errno != ENOENT) {
      throw path_error(errno, "dibs::shared_log: cannot stat log to repair it", path);
    }
  }
  // Records of a whole batch that asked to be on disk before done: the
  // dead holder may not have got to its fdatasync.
  int sync_error = 0;
  if (complete) {
    bool sync = false;
    for (slot& s : state.slots) sync = sync || (slot_state(s.word.load()) == slot::taken && s.sync);
    if (sync) {
      unique_fd fd{open_retry(path.c_str(), O_WRONLY | O_CLOEXEC)};
      sync_error = fd ? sync_data(fd.get()) : errno;
    }
  }
  std::uint64_t queued = 0;
  for (unsigned i = 0; i < log_slot_count; ++i) {
    slot& s = state.slots[i];
    std::uint32_t w = s.word.load(std::memory_order_acquire);
    if (slot_state(w) == slot::taken) {
      if (complete) {
        const auto [err, why] = log_outcome(0, log_failure::none, sync_error, s.sync != 0);
        s.error = err;
        s.failure = static_cast<std::uint32_t>(why);
      }
      const std::uint32_t next = complete ? slot::done : slot::ready;
      // (Its owner may be setting its waiting flag meanwhile.)
      while (slot_state(w) == slot::taken && !s.word.compare_exchange_weak(w, (w & ~slot::state_mask) | next)) {
      }
      if (complete && (w & slot::waiting)) futex_wake(s.word);
      w = (w & ~slot::state_mask) | next;
    }
    // Ready: also those whose flag the dead holder had cleared but not yet taken.
    if (slot_state(w) == slot::ready) queued |= std::uint64_t{1} << i;
  }
  state.ready_slots.fetch_or(queued);
  // Queued again before the cut: if the cut fails, their writers may
  // withdraw them (they are not in the file once it is cut), and no batch
  // is written before a repair succeeds.
  if (cut) {
    if (const int e = truncate_file(path, static_cast<std::uint64_t>(state.pending_start)))
      throw path_error(e, "dibs::shared_log: cannot cut a torn record from", path);
  }
  state.pending_start = -1;
  state.file_end = -1;
  state.needs_repair = 0;
}

}  // namespace dibs::detail
