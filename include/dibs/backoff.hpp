// dibs/backoff.hpp: exponential backoff schedules with jitter.
//
// A schedule is a pure function: given the retry number n (0 for the first
// retry), the previous delay and a uniform number u in [0, 1), it returns the
// next delay. Randomness is passed in, so a test can check exact values and a
// seeded run is reproducible.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <dibs/detail/format.hpp>
#include <dibs/detail/units.hpp>

namespace dibs {

/// How a delay is spread around the exponential ceiling
/// c(n) = min(cap, initial * multiplier^n).
enum class jitter {
  none,          ///< exactly c(n): clients that failed together retry together
  full,          ///< uniform in [0, c(n)): the default (see docs/BENCHMARKS.md)
  equal,         ///< c(n)/2 + uniform in [0, c(n)/2)
  decorrelated,  ///< uniform in [initial, min(cap, 3 * previous)); no dependence on n
};

inline const char* to_string(jitter j) noexcept {
  switch (j) {
    case jitter::none: return "none";
    case jitter::full: return "full";
    case jitter::equal: return "equal";
    case jitter::decorrelated: return "decorrelated";
  }
  return "?";
}

/// An exponential schedule with a true cap and jitter.
///
/// Invariants (checked when built): 0 < initial <= cap, multiplier >= 1.
/// Therefore the ceiling c(n) lies in [initial, cap] for every n, including
/// n = 10'000 or 2^64 - 1: the exponent saturates at the cap instead of
/// overflowing, and no delay is ever negative or larger than the cap.
///
/// Jitter is applied below the cap, never clamped up to it afterwards:
/// clamping after jitter would pile every client onto the cap value again,
/// which is the synchronisation jitter is there to break. For the same reason
/// `decorrelated` draws from [initial, min(cap, 3 * previous)) rather than
/// AWS's min(cap, uniform(initial, 3 * previous)).
class exponential_backoff {
public:
  using duration = std::chrono::nanoseconds;

  /// Effects: the default schedule: 10 ms, doubling, capped at 1 s, full jitter.
  exponential_backoff() = default;

  /// Throws: std::invalid_argument naming the field if initial <= 0,
  /// multiplier < 1 (or not a number), or cap < initial.
  exponential_backoff(duration initial, double multiplier, duration cap, dibs::jitter j = jitter::full)
      : initial_(initial), multiplier_(multiplier), cap_(cap), jitter_(j) {
    if (initial <= duration::zero())
      throw std::invalid_argument(
          fmt::format("dibs::exponential_backoff: initial delay must be positive (got {})", detail::human(initial)));
    if (!(multiplier >= 1.0) || !std::isfinite(multiplier))
      throw std::invalid_argument(
          fmt::format("dibs::exponential_backoff: multiplier must be a finite number >= 1 (got {})", multiplier));
    if (cap < initial)
      throw std::invalid_argument(fmt::format(
          "dibs::exponential_backoff: cap must be at least the initial delay (cap {} < initial {})", detail::human(cap),
          detail::human(initial)));
  }

  duration initial() const noexcept { return initial_; }
  double multiplier() const noexcept { return multiplier_; }
  duration cap() const noexcept { return cap_; }
  dibs::jitter jitter() const noexcept { return jitter_; }

  /// Returns: min(cap, initial * multiplier^n), computed without overflow.
  duration ceiling(std::uint64_t n) const noexcept {
    // pow() saturates to +inf for a huge n; the comparison then picks the cap.
    const double c = static_cast<double>(initial_.count()) * std::pow(multiplier_, static_cast<double>(n));
    if (!(c < static_cast<double>(cap_.count()))) return cap_;
    return duration{static_cast<duration::rep>(c)};
  }

  /// Requires: 0 <= u < 1.
  /// Returns: the delay before retry n (0-based); `previous` is the delay this
  /// schedule returned before retry n - 1 (only `decorrelated` uses it; any
  /// value below `initial`, such as zero for the first retry, counts as `initial`).
  duration delay(std::uint64_t n, duration previous, double u) const noexcept {
    switch (jitter_) {
      case jitter::none: return ceiling(n);
      case jitter::full: return scale(ceiling(n), u);
      case jitter::equal: {
        const duration c = ceiling(n);
        const duration half = c / 2;
        return half + scale(c - half, u);
      }
      case jitter::decorrelated: {
        const duration prev = previous < initial_ ? initial_ : previous;
        // 3 * prev cannot overflow: prev <= cap when it came from this schedule,
        // and the comparison is done in double anyway.
        const double hi = std::min(static_cast<double>(cap_.count()), 3.0 * static_cast<double>(prev.count()));
        const double lo = static_cast<double>(initial_.count());
        return duration{static_cast<duration::rep>(lo + u * (hi - lo))};
      }
    }
    return ceiling(n);
  }

private:
  static duration scale(duration d, double u) noexcept {
    return duration{static_cast<duration::rep>(static_cast<double>(d.count()) * u)};
  }

  duration initial_ = std::chrono::milliseconds{10};
  double multiplier_ = 2.0;
  duration cap_ = std::chrono::seconds{1};
  dibs::jitter jitter_ = jitter::full;
};

}  // namespace dibs
