// dibs/text.hpp: keys and durations written for people, exactly as dibs's
// own messages write them, for a program's messages that sit beside dibs's
// (the dibs command's are made with these).
//
//   fmt::print("{}: retried after {}\n", dibs::show_key(key), dibs::show_duration(waited));
//   // mail/4711: retried after 1.5 s
//
// Times of day are in <dibs/lock_holder.hpp> (show_time), with the holders
// they are shown for.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>

namespace dibs {

/// Returns: `key` as a person can read it in a message: printable ASCII and
/// other bytes of UTF-8 text as they are, control bytes and backslashes as
/// \xNN, cut after 80 bytes (then its size is said).
inline std::string show_key(std::string_view key) {
  std::string shown;
  for (const char ch : key.substr(0, 80)) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f || c == '\\') {
      shown += "\\x";
      shown += detail::hex_digits(c, 2);
    } else {
      shown += ch;
    }
  }
  if (key.size() > 80) shown += fmt::format("... ({} bytes)", key.size());
  return shown;
}

/// Returns: `d` in the largest of h, min, s, ms, µs, ns in which it is at
/// least 1, with up to 3 significant decimals ("1.5 s", "100 ms", "-2 ms").
template <class Rep, class Period>
std::string show_duration(std::chrono::duration<Rep, Period> d) {
  const double ns = std::chrono::duration<double, std::nano>(d).count();
  const double mag = ns < 0 ? -ns : ns;
  struct unit {
    double ns;
    const char* name;
  };
  static constexpr unit units[] = {{3600e9, "h"}, {60e9, "min"}, {1e9, "s"}, {1e6, "ms"}, {1e3, "µs"}, {1, "ns"}};
  for (const auto& u : units)
    if (mag >= u.ns || u.ns == 1) return fmt::format("{} {}", detail::short_decimal(ns / u.ns), u.name);
  return "0 ns";
}

}  // namespace dibs
