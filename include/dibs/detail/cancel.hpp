// dibs/detail/cancel.hpp: waits that a std::stop_token ends at once.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stop_token>
#include <string_view>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include <dibs/error.hpp>

namespace dibs::detail {

/// Effects: sleeps for `d`, or until a stop is requested through `st`.
/// Returns: false if a stop was requested.
template <class Rep, class Period>
bool sleep_unless_stopped(std::chrono::duration<Rep, Period> d, const std::stop_token& st) {
  if (!st.stop_possible()) {
    std::this_thread::sleep_for(d);
    return true;
  }
  std::mutex m;
  std::condition_variable_any cv;
  std::unique_lock lock{m};
  return !cv.wait_for(lock, st, d, [] { return false; }) && !st.stop_requested();
}

/// Throws: std::system_error(errc::cancelled) saying which wait was cancelled.
[[noreturn]] inline void throw_cancelled(std::string_view who, std::string_view what) {
  throw std::system_error(make_error_code(errc::cancelled),
                          fmt::format("{} '{}': wait for the lock cancelled (a stop was requested)", who, what));
}

}  // namespace dibs::detail
