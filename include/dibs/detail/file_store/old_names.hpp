// dibs/detail/file_store/old_names.hpp: records that dibs 0.1 kept under the
// key itself, for keys this version escapes (a key with '%', or starting
// ".dibs-"): found and reported on every use of the key, so that an item
// done before an upgrade is never taken for absent, and moved to the key's
// new name on request. Separate because it concerns only directories
// written by dibs 0.1, and should be easy to drop once none is left.
#pragma once

#ifndef _WIN32
#include <fcntl.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include <dibs/detail/file_store/atomic_write.hpp>
#include <dibs/detail/file_store/key_names.hpp>
#include <dibs/detail/file_store/record_format.hpp>
#include <dibs/detail/file_store/record_io.hpp>
#include <dibs/detail/record_file.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs::detail {

#ifdef _WIN32
// dibs 0.1 never ran on Windows: no directory there has its records.
inline void refuse_old_record(std::string_view, const record_file_name&, std::string_view,
                              const std::filesystem::path&, std::string_view) {}
inline bool adopt_old_record(std::string_view, const record_file_name&, const std::filesystem::path&, std::string_view,
                             file_mode, bool) {
  return false;
}
#else
// Returns: true if the file at `path` begins as a record of dibs does.
inline bool starts_as_record(const std::filesystem::path& path) {
  unique_fd fd{open_retry(path.c_str(), O_RDONLY | record_open_flags)};
  char head[12] = {};
  return fd && ::read(fd.get(), head, sizeof head) == static_cast<ssize_t>(sizeof head) &&
         std::string_view(head, sizeof head) == "dibs-record ";
}

// Throws: errc::corrupt_record naming both files if a record of dibs 0.1
// holds `key` (whose file is now `name` in `dir`) under the name it had
// then: the key itself (dibs 0.1 took keys without '/' and control bytes,
// of at most 200 bytes), which would make an item done before the upgrade
// look absent. `call`: what the user called.
inline void refuse_old_record(std::string_view key, const record_file_name& name, std::string_view call,
                              const std::filesystem::path& dir, std::string_view suffix) {
  const bool old_key = key.size() <= 200 && key != "." && key != ".." &&
                       std::none_of(key.begin(), key.end(), [](char ch) {
                         const auto c = static_cast<unsigned char>(ch);
                         return c == '/' || c < 0x20 || c == 0x7f;
                       });
  if (name.key_line.empty() || !old_key) return;
  const auto old_path = dir / (std::string(key) + std::string(suffix));
  std::optional<stored_record> old;
  try {
    old = load_record(old_path, dibs::time_limit::max());
  } catch (const std::system_error& e) {
    // A file there that is no dibs record is not the key's. Anything else
    // (a damaged record of ours, a file that cannot be read now) may be
    // the key's old record: reported, never taken for "none".
    if (e.code() != errc::corrupt_record || starts_as_record(old_path)) throw;
    return;
  }
  if (old && !old->key)
    throw std::system_error(
        make_error_code(errc::corrupt_record),
        fmt::format("{}: the record of key '{}' is in '{}', the name dibs 0.1 gave it; this version keeps it in "
                    "'{}'. Once no process of dibs 0.1 uses the directory, move it there with "
                    "file_store::adopt_old_record(key) (not with mv: the record must learn its key)",
                    call, show_key(key), old_path.string(), (dir / name.name).string()));
}

// Effects: moves the record dibs 0.1 kept for `key` under the key itself to
// its file `name` in `dir` (file names end in `suffix`), with its version,
// state and value, written as file_store writes (`mode`, `sync`).
// Returns: true if a record was moved.
// Throws: errc::corrupt_record if the key has a record at both names.
inline bool adopt_old_record(std::string_view key, const record_file_name& name, const std::filesystem::path& dir,
                             std::string_view suffix, mode_t mode, bool sync) {
  if (name.key_line.empty() || key.size() > 200) return false;  // its name is what it was
  const auto old_path = dir / (std::string(key) + std::string(suffix)), new_path = dir / name.name;
  fork_closed_fd fd{old_path.c_str(), O_RDONLY | record_open_flags};
  if (!fd) {
    if (errno == ENOENT) return false;
    throw record_open_error(errno, old_path);
  }
  lock_record(fd.get(), file_lock_kind::exclusive, old_path, dibs::time_limit::max());
  const auto old = load_record(fd.get(), old_path);
  if (!old || old->key) return false;  // a record of this version: another key's
  const auto tmp = write_temporary(dir, mode, sync, encode_record(old->version, old->live, old->value, name.key_line));
  if (::link(tmp.c_str(), new_path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    if (e == EEXIST)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::file_store::adopt_old_record: key '{}' has a record at its old name "
                                          "'{}' and at its new one '{}': keep both, and find out which is right",
                                          show_key(key), old_path.string(), new_path.string()));
    throw path_error(e, "dibs::file_store: cannot create record", new_path);
  }
  ::unlink(tmp.c_str());
  if (::unlink(old_path.c_str()) != 0) throw path_error(errno, "dibs::file_store: cannot remove", old_path);
  sync_record_directory(dir, sync);
  return true;
}

#endif

}  // namespace dibs::detail
