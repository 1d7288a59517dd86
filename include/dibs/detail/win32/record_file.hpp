// dibs/detail/win32/record_file.hpp: reaching a file_store record file on
// Windows; the twin of detail/posix/record_file.hpp.
//
// Windows cannot rename a file over one another process has open (and Wine
// not over one this process has open), so a record is never replaced
// there: every record is rewritten in place, in the two slots of
// detail/file_store/two_slots.hpp, under the lock of
// detail/win32/file_ops.hpp (one byte past the data). A record is created
// whole by CreateHardLinkW from a temporary file (fails if the name exists:
// the twin of link(2)). Files are opened sharing reads, writes and
// deletes (a reader is never shut out by a writer, an antivirus scan never
// by dibs), not inherited by child processes, and never through a
// reparse point (a symbolic link or junction in a shared directory could
// point anywhere).
//
// Verified under Wine 8 (mingw-w64): the conformance kit, claims between
// processes with TerminateProcess kills. Not verified under Wine: SMB
// shares, and NTFS's own handling of hard links.
#pragma once

#include <dibs/detail/win32/file_ops.hpp>
#include <dibs/detail/win32/sys.hpp>

#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <fmt/format.h>

namespace dibs::detail {

inline constexpr bool records_always_in_place = true;

inline constexpr DWORD record_share = FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE;

inline std::system_error record_open_error(DWORD e, const std::filesystem::path& path) {
  return path_error(e, "dibs::file_store: cannot open record", path);
}

/// Returns: what names the file behind `h` on its volume, or false.
inline bool file_identity(HANDLE h, BY_HANDLE_FILE_INFORMATION& info) noexcept {
  return ::GetFileInformationByHandle(h, &info) != 0;
}

// A record file opened by an operation, with what identified it then.
class record_handle {
public:
  record_handle() = default;
  record_handle(record_handle&& o) noexcept
      : h_(std::move(o.h_)), info_(o.info_), writable_(o.writable_), directory_(std::exchange(o.directory_, false)),
        name_(std::move(o.name_)) {}
  record_handle& operator=(record_handle&& o) noexcept {
    if (this != &o) {
      close();
      h_ = std::move(o.h_);
      info_ = o.info_;
      writable_ = o.writable_;
      directory_ = std::exchange(o.directory_, false);
      name_ = std::move(o.name_);
    }
    return *this;
  }
  ~record_handle() { close(); }

  /// Effects: opens `path` (the file `name` of its directory), for reading
  /// and writing if `writable`, else for reading. Returns: 0 or the error.
  DWORD open(const std::filesystem::path& path, std::string_view name, bool writable) {
    close();
    const std::wstring w = win32_path(path);
    h_.reset(::CreateFileW(w.c_str(), GENERIC_READ | (writable ? GENERIC_WRITE : 0), record_share, nullptr,
                           OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL | FILE_FLAG_OPEN_REPARSE_POINT, nullptr));
    if (!h_) {
      const DWORD e = ::GetLastError();
      // A directory cannot be opened as a file: ERROR_ACCESS_DENIED. Say
      // what is there instead (check_regular reports it by name).
      const DWORD attrs = e == ERROR_ACCESS_DENIED ? ::GetFileAttributesW(w.c_str()) : INVALID_FILE_ATTRIBUTES;
      if (attrs != INVALID_FILE_ATTRIBUTES && (attrs & FILE_ATTRIBUTE_DIRECTORY)) {
        info_ = {};
        info_.dwFileAttributes = attrs;
        directory_ = true;
        writable_ = false;
        name_.assign(name);
        return 0;
      }
      return e;
    }
    if (!file_identity(h_.get(), info_)) {
      const DWORD e = ::GetLastError();
      close();
      return e;
    }
    writable_ = writable;
    name_.assign(name);
    return 0;
  }
  HANDLE get() const noexcept { return h_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(h_) || directory_; }
  bool writable() const noexcept { return writable_; }
  const std::string& name() const noexcept { return name_; }

  /// Throws: std::system_error naming `path` unless this is a regular file.
  void check_regular(const std::filesystem::path& path) const {
    const DWORD a = info_.dwFileAttributes;
    const char* what = directory_ || (a & FILE_ATTRIBUTE_DIRECTORY) ? "directory"
                       : (a & FILE_ATTRIBUTE_REPARSE_POINT)         ? "symbolic link or junction"
                       : (a & FILE_ATTRIBUTE_DEVICE)                ? "device"
                                                                    : nullptr;
    if (what)
      throw std::system_error(std::error_code{static_cast<int>(ERROR_INVALID_PARAMETER), std::system_category()},
                              fmt::format("dibs::file_store: record path '{}' is not a regular file (a {}): move it "
                                          "away",
                                          path_text(path), what));
  }

  /// Returns: 0 with `same` saying whether `path` names this file now, or
  /// the error of opening it (ERROR_FILE_NOT_FOUND: nothing is there).
  DWORD names_this(const std::filesystem::path& path, bool& same) const noexcept {
    const std::wstring w = win32_path(path);
    const unique_handle now{::CreateFileW(w.c_str(), 0, record_share, nullptr, OPEN_EXISTING,
                                          FILE_FLAG_OPEN_REPARSE_POINT | FILE_FLAG_BACKUP_SEMANTICS, nullptr)};
    if (!now) return ::GetLastError();
    BY_HANDLE_FILE_INFORMATION info{};
    if (!file_identity(now.get(), info)) return ::GetLastError();
    same = info.dwVolumeSerialNumber == info_.dwVolumeSerialNumber && info.nFileIndexHigh == info_.nFileIndexHigh &&
           info.nFileIndexLow == info_.nFileIndexLow;
    return 0;
  }

  /// Effects: drops the record lock. Returns: false if that failed (then
  /// the handle must be closed, not kept).
  bool unlock() const noexcept { return unlock_whole_file(h_.get()); }

  /// Effects: nothing to forget: Windows has no fork.
  void forget() noexcept {}

  /// Effects: drops the record lock, if held (Windows frees the locks of a
  /// closed handle only "when resources allow"), and closes the handle.
  void close() noexcept {
    if (h_) (void)unlock_whole_file(h_.get());
    h_.reset();
    directory_ = false;
  }

private:
  unique_handle h_;
  BY_HANDLE_FILE_INFORMATION info_{};
  bool writable_ = false;
  bool directory_ = false;
  std::string name_;
};

// A record file opened for reading only, for a read without the store's lock.
class record_reader {
public:
  explicit record_reader(const std::filesystem::path& path) {
    error_ = h_.open(path, {}, false);
    if (error_ == 0) h_.check_regular(path);
  }
  HANDLE get() const noexcept { return h_.get(); }
  explicit operator bool() const noexcept { return error_ == 0; }
  DWORD error() const noexcept { return error_; }

private:
  record_handle h_;
  DWORD error_ = 0;
};

/// Effects: makes `path` name the file `tmp` names, unless `path` exists
/// (CreateHardLinkW: atomic, never replaces). Returns: 0 or the error
/// (ERROR_ALREADY_EXISTS if `path` exists).
inline DWORD link_new_record(const std::filesystem::path& tmp, const std::filesystem::path& path) noexcept {
  const std::wstring from = win32_path(tmp), to = win32_path(path);
  return ::CreateHardLinkW(to.c_str(), from.c_str(), nullptr) ? 0 : ::GetLastError();
}

/// Effects: writes `data` to the new file `tmp` (CREATE_NEW), flushed with
/// `sync`; `mode` is ignored (a new file gets the security its directory
/// passes on). On failure nothing is left.
/// Returns: 0, or the error with `what` saying which step failed.
inline DWORD create_temporary_file(const std::filesystem::path& tmp, file_mode, bool sync, std::string_view data,
                                   const char*& what) {
  const std::wstring w = win32_path(tmp);
  unique_handle h{::CreateFileW(w.c_str(), GENERIC_WRITE, record_share, nullptr, CREATE_NEW, FILE_ATTRIBUTE_NORMAL,
                                nullptr)};
  if (!h) {
    what = "dibs::file_store: cannot create a temporary file in";
    return ::GetLastError();
  }
  DWORD e = write_all(h.get(), data.data(), data.size());
  if (e != 0) what = "dibs::file_store: cannot write a record into";
  else if (sync && (e = sync_file(h.get())) != 0) what = "dibs::file_store: cannot flush a record in";
  h.reset();
  if (e != 0) ::DeleteFileW(w.c_str());
  return e;
}

/// Effects: creates the empty file `path` if there is none (an entry of
/// file_store's queue view: its name is all it says).
/// Returns: 0 (also if it existed), or the error (ERROR_PATH_NOT_FOUND: no directory).
inline DWORD create_empty_file(const std::filesystem::path& path, file_mode) noexcept {
  const std::wstring w = win32_path(path);
  const unique_handle h{::CreateFileW(w.c_str(), GENERIC_WRITE, record_share, nullptr, OPEN_ALWAYS,
                                      FILE_ATTRIBUTE_NORMAL, nullptr)};
  return h ? 0 : ::GetLastError();
}

/// Effects: removes the file `path`. Returns: 0 or the error.
inline DWORD remove_file(const std::filesystem::path& path) noexcept {
  const std::wstring w = win32_path(path);
  return ::DeleteFileW(w.c_str()) ? 0 : ::GetLastError();
}

/// Effects: checks that `dir` is a directory. Returns: false (Windows has
/// no sticky directories). Throws: std::system_error naming the directory.
inline bool check_record_directory(const std::filesystem::path& dir) {
  const std::wstring w = win32_path(dir);
  const DWORD attrs = ::GetFileAttributesW(w.c_str());
  if (attrs == INVALID_FILE_ATTRIBUTES) {
    const DWORD e = ::GetLastError();  // the directory itself missing is "file not found": say "path"
    throw path_error(e == ERROR_FILE_NOT_FOUND ? ERROR_PATH_NOT_FOUND : e, "dibs::file_store: cannot open directory", dir);
  }
  if (!(attrs & FILE_ATTRIBUTE_DIRECTORY)) throw path_error(ERROR_DIRECTORY, "dibs::file_store: not a directory:", dir);
  return false;
}

}  // namespace dibs::detail
