// dibs/detail/file_store/atomic_write.hpp: how a record file is written so
// that no reader ever sees half of it: whole, into a temporary file of the
// directory, then put in place by link() (a new key) or an atomic exchange
// with the old record; and the temporary files left by processes that died
// meanwhile, recognised by name and removed. Separate because these are the
// steps whose order makes every write atomic and every crash harmless.
#pragma once

#ifndef _WIN32
#include <sys/stat.h>
#include <unistd.h>
#endif

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/detail/owner.hpp>
#include <dibs/detail/record_file.hpp>
#include <dibs/detail/sys.hpp>

namespace dibs::detail {

inline constexpr std::string_view temporary_prefix = ".dibs-tmp.";

// The boot id as temporary names hold it: without its dashes.
inline std::string temporary_boot(const owner_id& me) {
  std::string boot;  // the boot id without its dashes (Linux: a UUID; Windows: MachineGuid-boot time)
  for (const char c : me.boot)
    if (c != '-') boot += c;
  return boot;
}

// The name of a temporary file of this process: everything the proof rule
// needs to judge its maker gone, and a random part. Returns: the name.
inline std::string temporary_name() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const owner_id& me = this_process_base();
  const std::string boot = temporary_boot(me);
  return fmt::format("{}{}.{}.{}.{}.{}.{}", temporary_prefix, boot.empty() ? "0" : boot, me.pid_ns, me.time_ns,
                     me.pid, me.start, hex_digits(rng(), 16));
}

// Returns: true if `name` is a temporary file of dibs whose maker is
// provably gone: exactly the form temporary_name() makes, from this boot,
// judged by the rule every policy uses. Any other file is never touched.
inline bool dead_temporary(std::string_view name) {
  if (name.substr(0, temporary_prefix.size()) != temporary_prefix) return false;
  name.remove_prefix(temporary_prefix.size());
  std::string_view parts[6];
  for (int i = 0; i < 6; ++i) {
    const auto dot = name.find('.');
    if ((dot == std::string_view::npos) != (i == 5)) return false;
    parts[i] = name.substr(0, dot);
    name.remove_prefix(dot == std::string_view::npos ? name.size() : dot + 1);
  }
  auto number = [](std::string_view f, auto& v, int base = 10) {
    const auto [p, ec] = std::from_chars(f.data(), f.data() + f.size(), v, base);
    return !f.empty() && ec == std::errc{} && p == f.data() + f.size();
  };
  process_identity p;
  std::uint64_t random = 0;
  if (!number(parts[1], p.pid_ns) || !number(parts[2], p.time_ns) || !number(parts[3], p.pid) ||
      !number(parts[4], p.start) || parts[5].size() != 16 || !number(parts[5], random, 16))
    return false;
  const std::string boot = temporary_boot(this_process_base());
  if (boot.empty() || parts[0] != boot) return false;  // another machine or boot: cannot judge
  return provably_gone(p);
}

// Effects: removes the temporary files in `dir` whose makers are provably gone.
inline void remove_dead_temporaries(const std::filesystem::path& dir) {
  (void)for_each_entry(dir, [](const directory_entry& e) {
    if (dead_temporary(e.name)) (void)e.remove();
  });
}

// Effects: with `sync`, forces `dir`'s entries to stable storage.
inline void sync_record_directory(const std::filesystem::path& dir, bool sync) {
  if (!sync) return;
  if (const auto e = sync_directory(dir)) throw path_error(e, "dibs::file_store: cannot fsync directory", dir);
}

inline std::filesystem::path write_temporary(const std::filesystem::path& dir, file_mode mode, bool sync,
                                             std::string_view data) {
  const auto tmp = dir / temporary_name();
  const char* what = "";
  if (const auto e = create_temporary_file(tmp, mode, sync, data, what)) throw path_error(e, what, dir);
  return tmp;
}

#ifndef _WIN32  // Windows rewrites every record in place (detail/win32/record_file.hpp)
inline std::system_error replace_error(int e, const std::filesystem::path& path, const struct ::stat& old) {
  struct ::stat dir {};
  const auto parent = path.has_parent_path() ? path.parent_path() : std::filesystem::path{"."};
  if ((e == EPERM || e == EACCES) && ::stat(parent.c_str(), &dir) == 0 && (dir.st_mode & S_ISVTX) &&
      old.st_uid != ::geteuid())
    return std::system_error(
        std::error_code{e, std::system_category()},
        fmt::format("dibs::file_store: cannot replace record '{}': it belongs to another user (uid {}, mode {}) "
                    "in a sticky directory, where only its owner may replace it; records shared by several users "
                    "need a mode that lets all of them write it in place (file_store_options::mode, lock_file's "
                    "mode: 0664 with a shared group, or 0666)",
                    path.string(), old.st_uid, fixed_digits(old.st_mode & 07777, 8, 4)));
  return path_error(e, "dibs::file_store: cannot replace record", path);
}

// Atomically makes `path` name the record in `tmp`; `old`: the record file
// it replaces. An exchange, then an unlink of the old record (now at
// `tmp`), rather than rename() over the path: ext4 flushes the data of a
// file renamed over another (auto_da_alloc), which made every replace ~10x
// slower here (see docs/BENCHMARKS.md). Readers see the old inode or the
// new one either way.
inline void put_in_place(const std::filesystem::path& tmp, const std::filesystem::path& path,
                         const struct ::stat& old) {
  int e = exchange_files(tmp, path);
  if (e == 0) {
    ::unlink(tmp.c_str());  // if we die before this, the next store to open the directory removes it
    return;
  }
  if (exchange_unsupported(e)) e = rename_over(tmp, path);  // a filesystem without RENAME_EXCHANGE
  if (e != 0) {
    ::unlink(tmp.c_str());
    throw replace_error(e, path, old);
  }
}

#endif

}  // namespace dibs::detail
