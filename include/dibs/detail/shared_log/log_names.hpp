// dibs/detail/shared_log/log_names.hpp: the names of a shared log's files,
// the rotated ones and the lock file, on every platform. Separate because
// every writer of a log, on Linux or Windows, must derive the same names
// from the log's resolved path: they are how writers find one another.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace dibs::detail {

// Returns: the path of rotated file n of the log at `log`, `log + "." + n`.
inline std::filesystem::path rotated_log_path(const std::filesystem::path& log, std::uint64_t n) {
  // Appended piece by piece, as below (GCC bug 105651).
  std::filesystem::path p = log;
  p += ".";
  p += std::to_string(n);
  return p;
}

// Returns: the path of the lock file of the log at `log`, `.<name>.dibs-lock` beside it.
inline std::filesystem::path log_lock_path(const std::filesystem::path& log) {
  // Appended piece by piece: `"." + std::string&&` trips GCC 12's bogus
  // -Wrestrict at -O3 (GCC bug 105651) in programs built with -Werror.
  std::filesystem::path name = ".";
  name += log.filename().native();
  name += ".dibs-lock";
  return log.parent_path() / name;
}

}  // namespace dibs::detail
