// dibs/detail/file_store/record_io.hpp: opening, locking and reading a
// record file: never through a symbolic link, never anything but a regular
// file, the record's flock taken with or without a deadline, and a read
// without the lock that reads again under a shared flock when it catches a
// slot mid-write. Separate because these are the rules every operation of
// file_store follows to reach a record, and the errors that name its path.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/detail/file_store/record_format.hpp>
#include <dibs/detail/file_store/two_slots.hpp>
#include <dibs/detail/posix/fork_fds.hpp>
#include <dibs/detail/posix/sys.hpp>
#include <dibs/detail/posix/file_ops.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs::detail {

// Record files are opened without following a symbolic link, and without
// blocking on a FIFO someone put there (check_regular_record reports both).
inline constexpr int record_open_flags = O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY;

inline std::system_error record_open_error(int e, const std::filesystem::path& path) {
  struct ::stat st {};
  if (e == ELOOP && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    return std::system_error(std::error_code{e, std::system_category()},
                             fmt::format("dibs::file_store: record path '{}' is a symbolic link; dibs does not follow "
                                         "a link there (in a shared directory it could point anywhere): remove it",
                                         path.string()));
  return path_error(e, "dibs::file_store: cannot open record", path);
}

inline void check_regular_record(const struct ::stat& st, const std::filesystem::path& path) {
  if (!S_ISREG(st.st_mode))
    throw std::system_error(std::error_code{S_ISDIR(st.st_mode) ? EISDIR : EINVAL, std::system_category()},
                            fmt::format("dibs::file_store: record path '{}' is not a regular file (a {}): move it away",
                                        path.string(), S_ISDIR(st.st_mode) ? "directory" : "device, FIFO or socket"));
}

// Takes the record's flock. Without a deadline it blocks in the kernel; with
// one it polls, because flock(2) takes no timeout and a library must not
// take a signal from its program to interrupt it. Throws: errc::timed_out at `t`.
inline void lock_record(int fd, file_lock_kind kind, const std::filesystem::path& path, dibs::time_limit t) {
  const bool timed = t != dibs::time_limit::max();
  const exponential_backoff schedule{std::chrono::microseconds{20}, 2.0, std::chrono::milliseconds{1}, jitter::equal};
  thread_local std::minstd_rand rng{std::random_device{}()};
  for (std::uint64_t n = 0;; ++n) {
    const int e = lock_whole_file(fd, kind, !timed);
    if (e == 0) return;
    if (!timed || e != EWOULDBLOCK) throw path_error(e, "dibs::file_store: cannot lock record", path);
    const auto left = t - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero())
      throw std::system_error(make_error_code(errc::timed_out),
                              fmt::format("dibs::file_store: record '{}' is held by another process that has not "
                                          "let go in the time given (is it stopped?)",
                                          path.string()));
    const double u = std::uniform_real_distribution<double>{0.0, 1.0}(rng);
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, schedule.delay(n, {}, u)));
  }
}

// Reads the whole file, from its start whatever the descriptor's offset
// (pread: a descriptor kept from an earlier operation needs no lseek). A
// read shorter than asked that brings the text to exactly the length its
// header declares (of the second slot's record, in a file with two) is the
// end of the file: no second read just to see it return 0.
inline std::string slurp_record(int fd, const std::filesystem::path& path) {
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::pread(fd, buf, sizeof buf, static_cast<off_t>(out.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw path_error(errno, "dibs::file_store: cannot read record", path);
    if (n == 0) return out;
    out.append(buf, static_cast<std::size_t>(n));
    if (static_cast<std::size_t>(n) < sizeof buf && read_whole_file(out)) return out;
  }
}

// Requires: the record's flock (no writer is mid-write).
inline std::optional<stored_record> load_record(int fd, const std::filesystem::path& path) {
  return decode_record_file(path, slurp_record(fd, path), false);
}

// Reads a record without its lock. A slot rewritten in place may be caught
// half-copied: then the file is read again under a shared flock, which
// waits for the writer; only what is damaged then too is reported.
// Returns: the record, or nothing if there is no file.
inline std::optional<stored_record> load_record(const std::filesystem::path& path, dibs::time_limit t) {
  fork_closed_fd fd{path.c_str(), O_RDONLY | record_open_flags};
  if (!fd) {
    if (errno == ENOENT) return std::nullopt;
    throw record_open_error(errno, path);
  }
  {
    const auto text = slurp_record(fd.get(), path);
    try {
      return decode_record_file(path, text, true);
    } catch (const std::system_error& e) {
      // Only a record of ours can be mid-write; a foreign file is reported
      // at once, not after waiting for whoever may hold a flock on it.
      if (e.code() != errc::corrupt_record || text.substr(0, 14) != "dibs-record 1\n") throw;
    }
  }
  lock_record(fd.get(), file_lock_kind::shared, path, t);
  return load_record(fd.get(), path);
}

// Returns: true if the file at `path` begins as a record of dibs does.
inline bool starts_as_record(const std::filesystem::path& path) {
  unique_fd fd{open_retry(path.c_str(), O_RDONLY | record_open_flags)};
  char head[12] = {};
  return fd && ::read(fd.get(), head, sizeof head) == static_cast<ssize_t>(sizeof head) &&
         std::string_view(head, sizeof head) == "dibs-record ";
}

}  // namespace dibs::detail
