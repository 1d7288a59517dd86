// dibs/lock_file.hpp: dibs::lock_file, the lock file: a lease_mutex whose
// record is the lock file itself (a file_store record you can `cat`).
//
//   dibs::lock_file lock{"/var/log/batch.log.lock"};
//   std::scoped_lock hold{lock};   // waits; breaks a dead holder's lock on proof
//   write_log_with(lock.token());
//
// Waiters on this host take turns, first come, first served, through the
// hidden file `.dibs-queue.<name>` beside the lock file; an unlock wakes the
// next one (docs/file-locks.md, "Waiting in turn").
// Everything about holding, renewing, breaking and fencing is lease_mutex's
// (<dibs/lease_mutex.hpp>); this header binds it to one file. It is apart
// from lease_mutex.hpp because a policy never includes a store.
#pragma once


#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include <dibs/error.hpp>
#include <dibs/lease_mutex.hpp>
#include <dibs/stores/file_store.hpp>

namespace dibs {

namespace detail {
// The store of a lock_file lives on the heap, so that it stays where its
// lease_mutex (and a renewal running on another thread) points when the
// lock_file moves.
struct lock_file_store {
  std::unique_ptr<file_store> store;
};
// Returns: the directory of the lock file `p`. Throws: errc::invalid_argument,
// speaking of the path, if `p` cannot name a lock file.
inline std::filesystem::path lock_dir(const std::filesystem::path& p) {
  const std::string name = detail::path_text(p.filename());
  const char* rule = p.empty()                                    ? "the path is empty"
                     : name.empty()                               ? "it ends in '/', so it names a directory"
                     : name == "." || name == ".."                ? "it names a directory"
                     : name.find('\0') != std::string::npos      ? "it holds a NUL byte"
                     : name.size() > 255                          ? "a file name has at most 255 bytes"
                                                                  : nullptr;
  if (rule)
    throw std::system_error(make_error_code(errc::invalid_argument),
                            fmt::format("dibs::lock_file: cannot lock '{}': {}; give the path of the lock file "
                                        "itself, e.g. '/run/lock/app.lock'",
                                        detail::show_key(detail::path_text(p)), rule));
  return p.has_parent_path() ? p.parent_path() : std::filesystem::path{"."};
}
}  // namespace detail

/// A lock file: lease_mutex over the file at `path` itself (a dibs record
/// you can `cat`). `mode`: the lock file's permissions, exactly (the umask
/// does not narrow them); several users share a lock file with 0664 and a
/// common group, or 0666 (in a sticky directory such as /tmp too).
/// Throws: as file_store for a missing or unwritable directory;
/// errc::invalid_argument for a bad file name.
class lock_file : private detail::lock_file_store, public lease_mutex<file_store> {
public:
  explicit lock_file(const std::filesystem::path& path, lease_options opts = {}, detail::file_mode mode = 0644)
      : detail::lock_file_store{std::make_unique<file_store>(
            detail::lock_dir(path),
            file_store_options{
                .mode = mode, .suffix = "", .key_is_file_name = true, .in_place = true, .empty_is_free = true})},
        lease_mutex<file_store>(*store, detail::path_text(path.filename()), std::move(opts)),
        path_(path) {}
  /// Effects, Requires: as lease_mutex's move constructor; path() moves too.
  lock_file(lock_file&& o)
      : detail::lock_file_store{std::move(o.store)},
        lease_mutex<file_store>(static_cast<lease_mutex<file_store>&&>(o)),
        path_(std::move(o.path_)) {}
  /// Effects, Requires, Throws: as lease_mutex's move assignment (this
  /// object's lock is released first, through its own store).
  lock_file& operator=(lock_file&& o) {
    if (this != &o) {
      lease_mutex<file_store>::operator=(static_cast<lease_mutex<file_store>&&>(o));
      store = std::move(o.store);  // only now: our old store served the unlock above
      path_ = std::move(o.path_);
    }
    return *this;
  }
  const std::filesystem::path& path() const noexcept { return path_; }

private:
  std::filesystem::path path_;
};

}  // namespace dibs
