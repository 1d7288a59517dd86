// dibs/detail/digits.hpp: fixed-width digits (hexadecimal, octal, decimal) and
// short decimals, for the names, checksums, dates and messages dibs writes.
// Not fmt's "{:016x}" or "{:.4g}": the names are made on every record write,
// and dibs's headers keep fmt's run-time parsing of format specs out of
// users' programs (with fmt 9, GCC 12 at -O3 reports false overflows inside
// it, which break builds with -Werror: detail/format.hpp).
#pragma once

#include <charconv>
#include <cstdint>
#include <string>

namespace dibs::detail {

/// Returns: `v` in `base` (8, 10 or 16) as at least `width` digits,
/// zero-padded (lower-case hexadecimal unless `upper`). Hexadecimal and
/// octal keep only the low `width` digits, as a fixed-width field.
inline std::string fixed_digits(std::uint64_t v, unsigned base, int width, bool upper = false) {
  const auto w = static_cast<std::size_t>(width);
  if (base == 10) {
    std::string out = std::to_string(v);
    if (out.size() < w) out.insert(0, w - out.size(), '0');
    return out;
  }
  const char* digits = upper ? "0123456789ABCDEF" : "0123456789abcdef";
  std::string out(w, '0');
  for (std::size_t i = w; i-- > 0; v /= base) out[i] = digits[v % base];
  return out;
}

/// Returns: `v` as `width` hexadecimal digits, zero-padded.
inline std::string hex_digits(std::uint64_t v, int width, bool upper = false) {
  return fixed_digits(v, 16, width, upper);
}

/// Returns: `v` as at least `width` decimal digits, zero-padded.
inline std::string padded(std::int64_t v, int width) {
  if (v >= 0) return fixed_digits(static_cast<std::uint64_t>(v), 10, width);
  std::string out(1, '-');
  out += fixed_digits(static_cast<std::uint64_t>(-(v + 1)) + 1, 10, width);
  return out;
}

/// Returns: `v` with up to 4 significant digits, as "{:.4g}" would.
inline std::string short_decimal(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general, 4);
  return std::string(buf, r.ptr);
}

}  // namespace dibs::detail
