// dibs/detail/posix/directory.hpp: what file_store and shared_log do to a
// directory, on POSIX (Linux): sync its entries, list them (and remove one),
// and find out whether it compares names without case. Separate so that a port
// to another system gives these names a body of its own (detail/win32/).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string_view>

#include <dibs/detail/posix/sys.hpp>

namespace dibs::detail {

/// Effects: forces the directory's entries (files created, renamed, removed
/// in it) to stable storage. Returns: 0 or errno.
inline int sync_directory(const std::filesystem::path& dir) noexcept {
  unique_fd fd{open_retry(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (!fd || ::fsync(fd.get()) != 0) return errno;
  return 0;
}

/// One entry of a directory being listed by for_each_entry.
struct directory_entry {
  std::string_view name;  // of d_name: NUL-terminated
  bool is_directory;  // false also where the filesystem does not say
  int dir_fd;
  /// Effects: removes this entry (a file) from the directory it was listed
  /// in (by the open directory: the same one even if renamed meanwhile).
  /// Returns: 0 or errno.
  int remove() const noexcept { return ::unlinkat(dir_fd, name.data(), 0) == 0 ? 0 : errno; }
};

/// Effects: calls f(entry) with a directory_entry for every entry of `dir`
/// ("." and ".." included). Returns: 0, or the errno of opening the directory.
template <class F>
int for_each_entry(const std::filesystem::path& dir, F&& f) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return errno;
  struct closer {
    DIR* d;
    ~closer() { ::closedir(d); }
  } close{d};
  while (const dirent* e = ::readdir(d)) f(directory_entry{e->d_name, e->d_type == DT_DIR, ::dirfd(d)});
  return 0;
}

/// Returns: why names in `dir` are compared without case (a case-folding
/// ext4 directory, chattr +F; vfat, exFAT, SMB), or nullptr if they are
/// not, or it cannot be told.
inline const char* case_folding(const std::filesystem::path& dir) noexcept {
  struct ::statfs fs {};
  if (::statfs(dir.c_str(), &fs) == 0) {
    const auto type = static_cast<unsigned long>(fs.f_type);
    if (type == MSDOS_SUPER_MAGIC) return "a vfat filesystem";
    if (type == EXFAT_SUPER_MAGIC) return "an exFAT filesystem";
    if (type == CIFS_SUPER_MAGIC || type == SMB2_SUPER_MAGIC) return "an SMB share";
  }
  unique_fd d{open_retry(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  long flags = 0;
  if (d && ::ioctl(d.get(), FS_IOC_GETFLAGS, &flags) == 0 && (flags & FS_CASEFOLD_FL)) return "case-folding (chattr +F)";
  return nullptr;
}

}  // namespace dibs::detail
