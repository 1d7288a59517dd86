// dibs/detail/file_store/record_format.hpp: the text of one file_store
// record (`dibs-record 1`, version, state, size, key, crc32, a blank line,
// the value), written and parsed, and the error for a file that is not one.
// Separate because it is a file format that other versions of dibs and
// people read: it changes only on purpose, whatever changes in how records
// are put in place.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include <boost/crc.hpp>
#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/error.hpp>
#include <dibs/store.hpp>

namespace dibs::detail {

// One record as read from its file.
struct stored_record {
  dibs::version version = 0;
  bool live = false;
  std::string value;
  std::size_t offset = 0;  // where the record starts in its file: 0, or record_slot_size
  std::size_t end = 0;     // where it ends
  std::size_t file_size = 0;
  std::optional<std::string> key;  // its `key` line (escaped), if it has one
  // The other slot is not whole (a write cut short): the least version
  // the next write may use so that none seen before is reused.
  dibs::version next_after_torn = 0;
};

inline std::uint32_t record_crc(std::string_view header, std::string_view value) noexcept {
  boost::crc_32_type c;
  c.process_bytes(header.data(), header.size());
  c.process_bytes(value.data(), value.size());
  return c.checksum();
}

// Returns: the text of a record. `key_line`: the escaped key, for a record
// whose name does not spell it.
inline std::string encode_record(dibs::version v, bool live, std::string_view value, std::string_view key_line) {
  std::string header =
      fmt::format("dibs-record 1\nversion {}\nstate {}\nsize {}\n", v, live ? "live" : "erased", value.size());
  if (!key_line.empty()) header += fmt::format("key {}\n", key_line);
  std::string out = header + fmt::format("crc32 {}\n\n", hex_digits(record_crc(header, value), 8));
  out.append(value);
  return out;
}

[[noreturn]] inline void corrupt_record(const std::filesystem::path& path, std::string_view why) {
  throw std::system_error(make_error_code(errc::corrupt_record),
                          fmt::format("dibs::file_store: record file '{}' is damaged or not a dibs record ({}); "
                                      "do not delete or move it away (for a claim, the item would be handled "
                                      "again): restore it from a backup, or find out the key's state and write "
                                      "the record again",
                                      path_text(path), why));
}

// Parses the record at the start of `text`, which may go on past it.
// Returns: the record (its `end` relative to `text`), or nothing with
// `why` saying what is wrong.
inline std::optional<stored_record> parse_record(std::string_view text, std::string& why) {
  const std::string_view all = text;
  std::string_view field;
  auto line = [&](std::string_view prefix) {
    if (text.substr(0, prefix.size()) != prefix) {
      why = fmt::format("expected '{}'", prefix);
      return false;
    }
    const auto nl = text.find('\n');
    if (nl == std::string_view::npos) {
      why = "header cut short";
      return false;
    }
    field = text.substr(prefix.size(), nl - prefix.size());
    text.remove_prefix(nl + 1);
    return true;
  };
  auto number = [&](int base, std::uint64_t& n) {
    const auto [p, ec] = std::from_chars(field.data(), field.data() + field.size(), n, base);
    if (ec == std::errc{} && p == field.data() + field.size()) return true;
    why = fmt::format("bad number '{}'", field);
    return false;
  };
  if (text.substr(0, 12) == "dibs-record " && text.substr(0, 14) != "dibs-record 1\n") {
    why = "a record format this version of dibs does not read";
    return std::nullopt;
  }
  stored_record s;
  std::uint64_t size = 0, sum = 0;
  if (!line("dibs-record 1") || !line("version ") || !number(10, s.version) || !line("state ")) return std::nullopt;
  if (field != "live" && field != "erased") {
    why = fmt::format("unknown state '{}'", field);
    return std::nullopt;
  }
  s.live = field == "live";
  if (!line("size ") || !number(10, size)) return std::nullopt;
  if (text.starts_with("key ")) {
    if (!line("key ")) return std::nullopt;
    s.key = std::string(field);
  }
  const std::string_view header = all.substr(0, all.size() - text.size());
  if (!line("crc32 ") || !number(16, sum) || !line("")) return std::nullopt;
  if (!field.empty()) {
    why = "no blank line after the header";
    return std::nullopt;
  }
  if (text.size() < size) {
    why = fmt::format("value has {} bytes, header says {}", text.size(), size);
    return std::nullopt;
  }
  const std::string_view value = text.substr(0, size);
  if (record_crc(header, value) != sum) {
    why = "checksum mismatch";
    return std::nullopt;
  }
  s.value = std::string(value);
  s.end = all.size() - text.size() + size;
  return s;
}

// Returns: the version a record's header names, if its first two lines are whole.
inline std::optional<dibs::version> record_header_version(std::string_view text) {
  constexpr std::string_view start = "dibs-record 1\nversion ";
  if (text.substr(0, start.size()) != start) return std::nullopt;
  text.remove_prefix(start.size());
  dibs::version v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || p == text.data() + text.size() || *p != '\n') return std::nullopt;
  return v;
}

// Returns: the length a record claims in its header (header + value), or
// 0 if the text does not yet hold a whole header.
inline std::size_t record_declared_length(std::string_view text) noexcept {
  const auto at = text.find("\nsize ");
  if (at == std::string_view::npos) return 0;
  std::uint64_t size = 0;
  const char* first = text.data() + at + 6;
  const auto [p, ec] = std::from_chars(first, text.data() + text.size(), size);
  if (ec != std::errc{}) return 0;
  const auto end = text.find("\n\n", static_cast<std::size_t>(p - text.data()));
  if (end == std::string_view::npos) return 0;
  return end + 2 + static_cast<std::size_t>(size);
}

}  // namespace dibs::detail
