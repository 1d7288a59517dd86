// dibs/detail/win32/directory.hpp: listing a directory and making its
// entries durable, on Windows; the twin of detail/posix/directory.hpp.
#pragma once

#include <dibs/detail/win32/sys.hpp>

#include <filesystem>
#include <string>
#include <string_view>

namespace dibs::detail {

/// Effects: forces the directory's entries (a record's new name) to
/// stable storage: FlushFileBuffers on the directory, opened for writing
/// (NTFS flushes its metadata log then). Returns: 0 or the error.
inline DWORD sync_directory(const std::filesystem::path& dir) noexcept {
  const std::wstring w = win32_path(dir);
  const unique_handle h{::CreateFileW(w.c_str(), GENERIC_READ | GENERIC_WRITE,
                                      FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr, OPEN_EXISTING,
                                      FILE_FLAG_BACKUP_SEMANTICS, nullptr)};
  if (!h) return ::GetLastError();
  return ::FlushFileBuffers(h.get()) ? 0 : ::GetLastError();
}

/// Returns: nullptr: every Windows directory compares names without case,
/// and file_store escapes names there so that no two keys share one (see
/// detail/file_store/key_names.hpp); it never asks.
inline const char* case_folding(const std::filesystem::path&) noexcept { return nullptr; }

/// One entry of a directory being listed by for_each_entry.
struct directory_entry {
  std::string_view name;  // UTF-8
  bool is_directory;
  const std::filesystem::path* dir;
  /// Effects: removes this entry (a file). Returns: 0 or the error.
  DWORD remove() const noexcept {
    const std::wstring full = win32_path(*dir / std::filesystem::path{std::u8string(name.begin(), name.end())});
    return ::DeleteFileW(full.c_str()) ? 0 : ::GetLastError();
  }
};

/// Effects: calls f(entry) for every entry of `dir` ("." and ".." included).
/// Returns: 0, or the error of opening the directory.
template <class F>
DWORD for_each_entry(const std::filesystem::path& dir, F&& f) {
  const std::wstring pattern = win32_path(dir / L"*");
  WIN32_FIND_DATAW e{};
  const HANDLE h = ::FindFirstFileW(pattern.c_str(), &e);
  if (h == INVALID_HANDLE_VALUE) {
    const DWORD err = ::GetLastError();
    return err == ERROR_FILE_NOT_FOUND ? 0 : err;  // an empty directory has no entries at all
  }
  struct closer {
    HANDLE h;
    ~closer() { ::FindClose(h); }
  } close{h};
  do {
    const std::string name = to_utf8(e.cFileName);
    f(directory_entry{name, (e.dwFileAttributes & FILE_ATTRIBUTE_DIRECTORY) != 0, &dir});
  } while (::FindNextFileW(h, &e));
  return 0;
}

}  // namespace dibs::detail
