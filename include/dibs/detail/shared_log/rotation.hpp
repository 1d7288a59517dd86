// dibs/detail/shared_log/rotation.hpp: rotation of a shared log by size:
// the log renamed to `<path>.1` after the rotated files are shifted up by
// one, as logrotate does, and those beyond `keep` deleted. Separate because
// its crash safety is an argument of its own (below): any step may be the
// last one a killed rotator made, and the next rotation finishes its work.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>

#include <dibs/detail/posix/sys.hpp>
#include <dibs/detail/posix/file_ops.hpp>
#include <dibs/detail/shared_log/log_file.hpp>
#include <dibs/detail/shared_log/shared_state.hpp>

namespace dibs::detail {

// Requires: the lock is held and `log` is open on the current file.
// Effects: renames the log to `<path>.1` after shifting the rotated files
// up by one (`.1` to `.2`, ...), as logrotate does, deletes those beyond
// `keep` (0: none), and opens the new log. `sync`: the log is synced before
// it is renamed (and log.open() syncs the directory).
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
inline void rotate_log(log_file& log, log_shared_state& state, std::uint64_t keep, bool sync) {
  if (sync) (void)sync_data(log.fd());
  // First: every writer opens the log again before its next batch. A
  // rotator that dies before its rename leaves them the same file; one that
  // dies after it leaves them the new one, never the renamed one.
  ++state.generation;
  state.file_end = -1;
  auto exists = [](const std::filesystem::path& p) {
    struct ::stat st {};
    if (::lstat(p.c_str(), &st) == 0) return true;
    if (errno != ENOENT) throw path_error(errno, "dibs::shared_log: cannot stat rotated log", p);
    return false;
  };
  const auto rotated = [&](std::uint64_t n) { return rotated_log_path(log.path(), n); };
  for (int attempt = 0;; ++attempt) {
    // The first gap: `.1 ... .(gap-1)` exist, `.gap` does not.
    std::uint64_t gap = 1;
    while (exists(rotated(gap))) ++gap;
    // Shift the newest-first run up by one, oldest first, so that no rename
    // has to replace a file.
    for (std::uint64_t n = gap - 1; n >= 1; --n) {
      const auto from = rotated(n);
      if (const int e = rename_no_replace(from, rotated(n + 1)); e != 0 && e != ENOENT)
        throw path_error(e, "dibs::shared_log: cannot shift rotated log", from);
    }
    const int e = rename_no_replace(log.path(), rotated(1));
    if (e == 0) break;
    if (e == ENOENT) break;  // a rotator died after its rename: finish its rotation
    // `.1` appeared meanwhile (not through shared_log, which rotates under
    // the lock): shift again, a few times at most.
    if (e != EEXIST || attempt >= 3) throw path_error(e, "dibs::shared_log: cannot rotate log", log.path());
  }
  if (keep > 0) {
    // Beyond `keep`: normally only `.keep+1`, just shifted there; more if
    // `keep` was lowered since the last rotation.
    for (std::uint64_t n = keep + 1; ::unlink(rotated(n).c_str()) == 0; ++n) {
    }
  }
  log.open();  // (and, with durability, syncs the directory: the renames and the new file)
}

}  // namespace dibs::detail
