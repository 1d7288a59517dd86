// dibs/detail/shared_log/lock_file.hpp: setting up and mapping shared_log's
// lock file (`.<name>.dibs-lock` beside the log): created with the log's
// permissions, owner and group, its blocks allocated, its mutex and queue
// set up when it is new or left by an earlier boot, and checked to be a
// lock file of this version of dibs. Separate from the appending: this runs
// once per shared_log, under a file_mutex of its own, and is where users
// with different umasks and a crash of the machine are dealt with.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include <dibs/detail/posix/sys.hpp>
#include <dibs/detail/posix/shared_mapping.hpp>
#include <dibs/detail/posix/robust_mutex.hpp>
#include <dibs/detail/shared_log/log_file.hpp>
#include <dibs/detail/shared_log/shared_state.hpp>
#include <dibs/file_mutex.hpp>

namespace dibs::detail {

inline constexpr const char* not_a_log_lock_file =
    "dibs::shared_log: not a dibs shared_log lock file, or one of another version of dibs (remove it if no "
    "writer runs):";

// Effects: maps the lock file `lp` of `log`, setting it up if it is new or
// from an earlier boot. Returns: the mapping (unmap_shared() it).
inline log_shared_state* set_up_and_map(const std::filesystem::path& lp, const log_file& log) {
  file_mutex setup{lp, {.family = lock_family::flock, .write_owner = false, .mode = log.mode()}};
  std::lock_guard hold{setup};
  unique_fd fd{open_retry(lp.c_str(), O_RDWR | O_CLOEXEC)};
  if (!fd) throw path_error(errno, "dibs::shared_log: cannot open lock file", lp);
  struct ::stat st {};
  if (::fstat(fd.get(), &st) != 0) throw path_error(errno, "dibs::shared_log: cannot stat lock file", lp);
  if (st.st_size != 0 && static_cast<std::size_t>(st.st_size) != sizeof(log_shared_state))
    throw path_error(EINVAL, not_a_log_lock_file, lp);
  // Whoever may write the log must be able to write its lock, which every
  // append takes. So a lock file this writer has just created (empty, and
  // its own) gets the log's permission bits whatever this process's umask
  // took from them, and the log's owner and group where this user may give
  // them (root may; others may choose a group of their own). Best effort:
  // what cannot be done shows later as another user's "permission denied"
  // naming the lock file.
  if (st.st_size == 0 && st.st_uid == ::geteuid()) {
    if (::fchown(fd.get(), log.uid(), log.gid()) != 0) (void)::fchown(fd.get(), static_cast<uid_t>(-1), log.gid());
    (void)::fchmod(fd.get(), log.mode());
  }
  // Its blocks are allocated before it is mapped: a page of a sparse file
  // that cannot be allocated later (a full disk) would kill the writer
  // touching it (SIGBUS).
  if (st.st_size == 0) {
    if (const int rc = allocate_file(fd.get(), sizeof(log_shared_state)); rc != 0) {
      (void)truncate_file(fd.get(), 0);  // left empty, it is set up by the next writer
      throw path_error(rc, "dibs::shared_log: cannot allocate lock file", lp);
    }
  }
  void* p = map_shared(fd.get(), sizeof(log_shared_state));
  if (!p) throw path_error(errno, "dibs::shared_log: cannot map lock file", lp);
  auto* state = static_cast<log_shared_state*>(p);
  struct unmap_unless_kept {
    log_shared_state* p;
    ~unmap_unless_kept() {
      if (p) unmap_shared(p, sizeof *p);
    }
  } unmap{state};
  // New: empty, or all zeros (its creator died before writing the magic, last).
  static constexpr char no_magic[8] = {};
  const bool fresh = std::memcmp(state->magic, no_magic, 8) == 0;
  if (!fresh && std::memcmp(state->magic, log_shared_state::magic_value, 8) != 0)
    throw path_error(EINVAL, not_a_log_lock_file, lp);
  if (fresh && st.st_size != 0) {
    if (const int rc = allocate_file(fd.get(), sizeof(log_shared_state)); rc != 0)
      throw path_error(rc, "dibs::shared_log: cannot allocate lock file", lp);
  }
  const std::string boot = boot_id();
  if (fresh || std::strncmp(state->boot_id, boot.c_str(), sizeof state->boot_id) != 0) {
    // New, or left by an earlier boot: no process of this boot can hold the
    // mutex or a slot (or it would have set the file up itself), so set them
    // up anew. A batch cut short by a crash of the machine is cut off if
    // the file it went to is still the log (and ends inside the batch).
    if (const int rc = state->mutex.init(); rc != 0)
      throw path_error(rc, "dibs::shared_log: cannot set up the lock in", lp);
    state->file_end = -1;
    if (fresh) {
      state->generation = 1;
      state->pending_start = -1;
    }
    state->needs_repair = state->pending_start >= 0 ? 1 : 0;
    std::memset(static_cast<void*>(state->slots), 0, sizeof state->slots);
    state->ready_slots.store(0);
    std::memset(state->boot_id, 0, sizeof state->boot_id);
    std::memcpy(state->boot_id, boot.data(), std::min(boot.size(), sizeof state->boot_id - 1));
    flush_shared(state, sizeof(log_shared_state));
    std::memcpy(state->magic, log_shared_state::magic_value, 8);
    flush_shared(state, sizeof(log_shared_state));
  }
  unmap.p = nullptr;
  return state;
}

// The lock file of a log, mapped for as long as this object lives.
class mapped_log_state {
public:
  // Effects: maps the lock file of `log` (log_lock_path), setting it up if
  // it is new or from an earlier boot.
  explicit mapped_log_state(const log_file& log) {
    const auto lp = log_lock_path(log.path());
    // A lock file that another user has just created, and not yet set up,
    // may still have the permissions its creator's umask left, narrower than
    // the log's: it widens them under the set-up lock. Wait for that, rather
    // than fail the first writers of several users that start together.
    // A lock file found set up (not empty) after a refusal may have been
    // widened and set up between this open and the look: it is tried once
    // more, and only a refusal of a file already seen set up is final.
    bool seen_set_up = false;
    for (int waited_ms = 0;; ++waited_ms) {
      try {
        state_ = set_up_and_map(lp, log);
        return;
      } catch (const std::system_error& e) {
        struct ::stat st {};
        if (e.code() != std::errc::permission_denied || waited_ms >= 1000 || seen_set_up ||
            ::stat(lp.c_str(), &st) != 0 || st.st_uid == ::geteuid())
          throw;
        if (st.st_size != 0) {
          seen_set_up = true;
          continue;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{1});
    }
  }
  mapped_log_state(const mapped_log_state&) = delete;
  mapped_log_state& operator=(const mapped_log_state&) = delete;
  ~mapped_log_state() { unmap_shared(state_, sizeof(log_shared_state)); }

  log_shared_state& operator*() const noexcept { return *state_; }
  log_shared_state* operator->() const noexcept { return state_; }

private:
  log_shared_state* state_ = nullptr;
};

}  // namespace dibs::detail
