// dibs/detail/file_store/record_io.hpp: opening, locking and reading a
// record file: never through a symbolic link, never anything but a regular
// file, the record's flock taken with or without a deadline, and a read
// without the lock that reads again under a shared flock when it catches a
// slot mid-write. Separate because these are the rules every operation of
// file_store follows to reach a record, and the errors that name its path.
#pragma once

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
#include <dibs/detail/record_file.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs::detail {

// Takes the record's flock. Without a deadline it blocks in the kernel; with
// one it polls, because flock(2) takes no timeout and a library must not
// take a signal from its program to interrupt it. Throws: errc::timed_out at `t`.
inline void lock_record(native_file fd, file_lock_kind kind, const std::filesystem::path& path, dibs::time_limit t) {
  const bool timed = t != dibs::time_limit::max();
  const exponential_backoff schedule{std::chrono::microseconds{20}, 2.0, std::chrono::milliseconds{1}, jitter::equal};
  thread_local std::minstd_rand rng{std::random_device{}()};
  for (std::uint64_t n = 0;; ++n) {
    const int e = lock_whole_file(fd, kind, !timed);
    if (e == 0) return;
    if (!timed || !lock_busy(e)) throw path_error(e, "dibs::file_store: cannot lock record", path);
    const auto left = t - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero())
      throw std::system_error(make_error_code(errc::timed_out),
                              fmt::format("dibs::file_store: record '{}' is held by another process that has not "
                                          "let go in the time given (is it stopped?)",
                                          path_text(path)));
    const double u = std::uniform_real_distribution<double>{0.0, 1.0}(rng);
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, schedule.delay(n, {}, u)));
  }
}

// Reads the whole file, from its start whatever the descriptor's offset
// (pread: a descriptor kept from an earlier operation needs no lseek). A
// read shorter than asked that brings the text to exactly the length its
// header declares (of the second slot's record, in a file with two) is the
// end of the file: no second read just to see it return 0.
inline std::string slurp_record(native_file fd, const std::filesystem::path& path) {
  std::string out;
  char buf[65536];
  for (;;) {
    sys_error e{};
    const std::int64_t n = read_at(fd, buf, sizeof buf, out.size(), e);
    if (n < 0) throw path_error(e, "dibs::file_store: cannot read record", path);
    if (n == 0) return out;
    out.append(buf, static_cast<std::size_t>(n));
    if (static_cast<std::size_t>(n) < sizeof buf && read_whole_file(out)) return out;
  }
}

// Requires: the record's flock (no writer is mid-write).
// `empty_is_free`: an empty file holds no record (file_store_options::
// empty_is_free): it reads as an erased record at version 0.
inline std::optional<stored_record> load_record(native_file fd, const std::filesystem::path& path,
                                                bool empty_is_free = false) {
  const auto text = slurp_record(fd, path);
  if (text.empty() && empty_is_free) return stored_record{};
  return decode_record_file(path, text, false);
}

// Reads a record without its lock. A slot rewritten in place may be caught
// half-copied: then the file is read again under a shared flock, which
// waits for the writer; only what is damaged then too is reported.
// Returns: the record, or nothing if there is no file.
inline std::optional<stored_record> load_record(const std::filesystem::path& path, dibs::time_limit t,
                                                bool empty_is_free = false) {
  const record_reader fd{path};
  if (!fd) {
    if (file_missing(fd.error())) return std::nullopt;
    throw record_open_error(fd.error(), path);
  }
  {
    const auto text = slurp_record(fd.get(), path);
    // Our writer fills an empty file in one pwrite under its flock: it reads
    // empty before, whole after, and anything between as a torn slot below.
    if (text.empty() && empty_is_free) return stored_record{};
    try {
      return decode_record_file(path, text, true);
    } catch (const std::system_error& e) {
      // Only a record of ours can be mid-write; a foreign file is reported
      // at once, not after waiting for whoever may hold a flock on it.
      // (A record being written into an empty file may show fewer bytes yet.)
      constexpr std::string_view magic = "dibs-record 1\n";
      if (e.code() != errc::corrupt_record || !(text.starts_with(magic) || magic.starts_with(text))) throw;
    }
  }
  lock_record(fd.get(), file_lock_kind::shared, path, t);
  return load_record(fd.get(), path, empty_is_free);
}

}  // namespace dibs::detail
