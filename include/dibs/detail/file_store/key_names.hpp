// dibs/detail/file_store/key_names.hpp: which file holds a key's record. A
// key is any bytes; its file is named by the key itself where a file name
// can be the key, with the bytes it cannot hold or that would make names
// ambiguous written %XX, cut with a hash where it would be too long (the
// record then holds its key); and a file name read back into its key.
// Separate because it is a mapping other versions of dibs and people rely
// on: the same key must name the same file in every version.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/detail/file_store/record_format.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs::detail {

// The file of a key: its name, and the `key` line its record carries when
// the name does not spell the key (empty when it does).
struct record_file_name {
  std::string name;
  std::string key_line;
};
inline constexpr std::size_t record_name_max = 255;  // NAME_MAX of Linux's filesystems
inline constexpr std::string_view record_cut_mark = "%~";

// Returns: true if `key` names a device on Windows, whatever follows its
// first '.' ("con", "nul.txt", "com1.rec": CON, PRN, AUX, NUL, COM0-9,
// LPT0-9, CONIN$, CONOUT$, in any case, trailing spaces ignored).
inline bool windows_device_name(std::string_view key) noexcept {
  std::string base(key.substr(0, key.find('.')));
  while (!base.empty() && base.back() == ' ') base.pop_back();
  for (char& c : base)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  if (base == "con" || base == "prn" || base == "aux" || base == "nul" || base == "conin$" || base == "conout$")
    return true;
  return base.size() == 4 && (base.starts_with("com") || base.starts_with("lpt")) && base[3] >= '0' && base[3] <= '9';
}

// On Windows, file names compare without case (NTFS folds every letter,
// not only ASCII's), and \ : * ? " < > | are not allowed in them, nor
// device names: there every upper-case ASCII letter and every byte from
// 0x80 is written %XX too, and those characters, and the first byte of a
// device name. Two keys then never share a file, and a name reads back
// into its key.
#ifdef _WIN32
inline constexpr bool key_names_for_windows = true;
#else
inline constexpr bool key_names_for_windows = false;
#endif

// Returns: `key` with the bytes a file name cannot hold, or that would make
// names ambiguous, written %XX (see the top of stores/file_store.hpp).
inline std::string escape_key(std::string_view key) {
  const bool hide_dot = key == "." || key == ".." || key.starts_with(".dibs-");
  const bool device = key_names_for_windows && windows_device_name(key);
  std::string out;
  out.reserve(key.size());
  for (std::size_t i = 0; i < key.size(); ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    const bool windows = key_names_for_windows && ((c >= 'A' && c <= 'Z') || c >= 0x80 ||
                                                   std::string_view{"\\:*?\"<>|~"}.find(key[i]) != std::string_view::npos ||
                                                   (i == 0 && device));
    if (c == '/' || c == '%' || c < 0x20 || c == 0x7f || (i == 0 && hide_dot) || windows) {
      out += '%';
      out += hex_digits(c, 2, true);
    } else {
      out += key[i];
    }
  }
  return out;
}

// Returns: the key `escaped` spells, if escape_key() makes exactly it.
inline std::optional<std::string> unescape_key(std::string_view escaped) {
  std::string out;
  for (std::size_t i = 0; i < escaped.size(); ++i) {
    if (escaped[i] != '%') {
      out += escaped[i];
      continue;
    }
    unsigned v = 0;
    const auto* first = escaped.data() + i + 1;
    if (i + 3 > escaped.size() || std::from_chars(first, first + 2, v, 16).ptr != first + 2) return std::nullopt;
    out += static_cast<char>(v);
    i += 2;
  }
  if (out.empty() || escape_key(out) != escaped) return std::nullopt;
  return out;
}

// Returns: the key a file name's stem spells, if it spells one (a cut name
// does not: its key is in its record). A name with '%' that escape_key()
// does not make is a key of dibs 0.1, spelled as it is.
inline std::optional<std::string> key_of_stem(std::string_view stem) {
  if (stem.find(record_cut_mark) != std::string_view::npos) return std::nullopt;
  if (stem.find('%') == std::string_view::npos) return std::string(stem);
  if (auto k = unescape_key(stem)) return k;
  return std::string(stem);
}

// Returns: the 64-bit FNV-1a hash of `s`, which ends a cut file name.
inline std::uint64_t name_hash(std::string_view s) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// Returns: the file of `key` in `dir`, its name ending in `suffix`; with
// `key_is_file_name`, the key itself. Throws: errc::invalid_argument naming
// `call` for a key no store takes, or, with key_is_file_name, one that is
// no file name.
inline record_file_name record_name_of(std::string_view key, std::string_view call, const std::filesystem::path& dir,
                                       std::string_view suffix, bool key_is_file_name) {
  validate_key(key, call);
  if (key_is_file_name) {
    const char* rule = key.find('/') != std::string_view::npos           ? "it holds '/'"
                       : key.find('\0') != std::string_view::npos        ? "it holds a NUL byte"
                       : key == "." || key == ".."                        ? "'.' and '..' name directories"
                       : key.size() + suffix.size() > record_name_max     ? "a file name has at most 255 bytes"
                       : key_names_for_windows && key.find_first_of("\\:*?\"<>|") != std::string_view::npos
                           ? "Windows does not allow \\ : * ? \" < > | in a file name"
                       : key_names_for_windows && windows_device_name(key) ? "it names a device on Windows"
                                                                          : nullptr;
    if (rule)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("{}: '{}' in '{}' cannot be a file name: {}", call, show_key(key),
                                          path_text(dir), rule));
    return {std::string(key) + std::string(suffix), {}};
  }
  std::string stem = escape_key(key);
  bool spelled = stem == key;
  if (stem.size() + suffix.size() > record_name_max) {
    spelled = false;
    // Cut where no %XX or UTF-8 character is split, then the mark and a
    // 64-bit FNV-1a hash of the key; the record keeps the whole key.
    std::size_t n = record_name_max - suffix.size() - record_cut_mark.size() - 16;
    while (n > 0 && (stem[n - 1] == '%' || (n > 1 && stem[n - 2] == '%') ||
                     (static_cast<unsigned char>(stem[n]) & 0xc0) == 0x80))
      --n;
    stem = fmt::format("{}{}{}", stem.substr(0, n), record_cut_mark, hex_digits(name_hash(key), 16));
  }
  return {stem + std::string(suffix), spelled ? std::string{} : escape_key(key)};
}

// Throws: errc::corrupt_record naming the file at `path` unless `s` is the
// record of `key`, whose file is `name` (names end in `suffix`): not a
// record of another key, nor one of dibs 0.1 at an escaped name.
inline void check_record_key(const stored_record& s, std::string_view key, const record_file_name& name,
                             const std::filesystem::path& path, std::string_view suffix) {
  const std::string_view want = name.key_line.empty() ? key : std::string_view(name.key_line);
  if (s.key ? *s.key == want : name.key_line.empty()) return;
  throw std::system_error(
      make_error_code(errc::corrupt_record),
      s.key ? fmt::format("dibs::file_store: '{}' holds the record of key '{}', not of '{}' (two keys whose names "
                          "were cut alike); keep the file, and key one of them otherwise",
                          path_text(path), show_key(unescape_key(*s.key).value_or(*s.key)), show_key(key))
            : fmt::format("dibs::file_store: '{}' holds a record of dibs 0.1 for the key '{}', not one for '{}': "
                          "keep the file (the key it belongs to may be done); the key '{}' cannot be used in this "
                          "directory while it is there",
                          path_text(path), show_key(name.name.substr(0, name.name.size() - suffix.size())),
                          show_key(key), show_key(key)));
}

}  // namespace dibs::detail
