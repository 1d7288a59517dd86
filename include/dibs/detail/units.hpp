// dibs/detail/units.hpp: durations in messages, in the unit a person reads
// ("100 ms", "1.5 s", "250 µs"), not in nanoseconds.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>

namespace dibs::detail {

/// Returns: `d` in the largest of h, min, s, ms, µs, ns in which it is at
/// least 1, with up to 3 significant decimals ("1.5 s", "100 ms", "-2 ms").
template <class Rep, class Period>
std::string human(std::chrono::duration<Rep, Period> d) {
  const double ns = std::chrono::duration<double, std::nano>(d).count();
  const double mag = ns < 0 ? -ns : ns;
  struct unit {
    double ns;
    const char* name;
  };
  static constexpr unit units[] = {{3600e9, "h"}, {60e9, "min"}, {1e9, "s"}, {1e6, "ms"}, {1e3, "µs"}, {1, "ns"}};
  for (const auto& u : units)
    if (mag >= u.ns || u.ns == 1) return fmt::format("{} {}", short_decimal(ns / u.ns), u.name);
  return "0 ns";
}

}  // namespace dibs::detail
