// dibs/detail/units.hpp: durations in messages, in the unit a person reads
// ("100 ms", "1.5 s", "250 µs"), not in nanoseconds: dibs::show_duration
// (<dibs/text.hpp>), under the short name the headers use.
#pragma once

#include <chrono>
#include <string>

#include <dibs/text.hpp>

namespace dibs::detail {

template <class Rep, class Period>
std::string human(std::chrono::duration<Rep, Period> d) {
  return show_duration(d);
}

}  // namespace dibs::detail
