#include <dibs/backoff.hpp>
#include <dibs/text.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <limits>
#include <random>

using namespace std::chrono_literals;
using ns = std::chrono::nanoseconds;

namespace {
double uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }
}  // namespace

TEST_CASE("the ceiling grows by the multiplier and stops at the cap") {
  const dibs::exponential_backoff b{10ms, 2.0, 1s, dibs::jitter::none};
  CHECK(b.ceiling(0) == 10ms);
  CHECK(b.ceiling(1) == 20ms);
  CHECK(b.ceiling(2) == 40ms);
  CHECK(b.ceiling(6) == 640ms);
  CHECK(b.ceiling(7) == 1s);  // 1280 ms capped
  CHECK(b.ceiling(8) == 1s);
}

TEST_CASE("no jitter is exactly the ceiling") {
  const dibs::exponential_backoff b{3ms, 3.0, 500ms, dibs::jitter::none};
  for (std::uint64_t n = 0; n < 20; ++n) CHECK(b.delay(n, 0ns, 0.999) == b.ceiling(n));
}

TEST_CASE("huge attempt numbers saturate at the cap: no overflow, no zero, no negative delay") {
  for (auto j : {dibs::jitter::none, dibs::jitter::full, dibs::jitter::equal, dibs::jitter::decorrelated}) {
    INFO(dibs::to_string(j));
    const dibs::exponential_backoff b{1ms, 2.0, 30s, j};
    for (std::uint64_t n : {std::uint64_t{62}, std::uint64_t{63}, std::uint64_t{64}, std::uint64_t{1000},
                            std::uint64_t{10'000}, std::numeric_limits<std::uint64_t>::max()}) {
      INFO("n = " << n);
      CHECK(b.ceiling(n) == 30s);
      const ns d = b.delay(n, 30s, 0.5);
      CHECK(d > 0ns);
      CHECK(d <= 30s);
    }
  }
  // A multiplier near the double limit and a cap near the duration limit.
  const dibs::exponential_backoff extreme{1ns, 1e300, ns::max(), dibs::jitter::none};
  CHECK(extreme.ceiling(10'000) == ns::max());
  CHECK(extreme.ceiling(0) == 1ns);
}

TEST_CASE("full jitter stays from 0 up to (not including) min(cap, initial * mult^n) with a seeded source") {
  const dibs::exponential_backoff b{10ms, 2.0, 1s, dibs::jitter::full};
  std::mt19937_64 rng{42};
  ns lo = ns::max(), hi = ns::zero();
  for (std::uint64_t n = 0; n < 40; ++n) {
    const ns c = b.ceiling(n);
    for (int i = 0; i < 500; ++i) {
      const ns d = b.delay(n, 0ns, uniform(rng));
      REQUIRE(d >= 0ns);
      REQUIRE(d < c);
      if (n >= 7) {
        lo = std::min(lo, d);
        hi = std::max(hi, d);
      }
    }
  }
  // Spread over the whole range at the cap, not piled onto it.
  CHECK(lo < 50ms);
  CHECK(hi > 950ms);
  // Exact values: u scales the ceiling.
  CHECK(b.delay(2, 0ns, 0.25) == 10ms);
  CHECK(b.delay(0, 0ns, 0.0) == 0ns);
}

TEST_CASE("equal jitter stays from c/2 up to (not including) c") {
  const dibs::exponential_backoff b{10ms, 2.0, 1s, dibs::jitter::equal};
  std::mt19937_64 rng{7};
  for (std::uint64_t n = 0; n < 30; ++n) {
    const ns c = b.ceiling(n);
    for (int i = 0; i < 200; ++i) {
      const ns d = b.delay(n, 0ns, uniform(rng));
      REQUIRE(d >= c / 2);
      REQUIRE(d < c);
    }
  }
  CHECK(b.delay(1, 0ns, 0.5) == 15ms);
}

TEST_CASE("decorrelated jitter follows its recurrence: d' from initial up to min(cap, 3 d)") {
  const dibs::exponential_backoff b{10ms, 2.0, 1s, dibs::jitter::decorrelated};
  // Exact values: lo + u * (hi - lo).
  CHECK(b.delay(0, 0ns, 0.0) == 10ms);
  CHECK(b.delay(0, 0ns, 0.5) == 20ms);    // 10 + 0.5 * (30 - 10)
  CHECK(b.delay(5, 100ms, 0.5) == 155ms);  // 10 + 0.5 * (300 - 10)
  CHECK(b.delay(5, 900ms, 0.5) == 505ms);  // hi is the cap, 1 s
  std::mt19937_64 rng{1};
  ns previous = 0ns;
  bool reached_high = false;
  for (std::uint64_t n = 0; n < 2000; ++n) {
    const ns d = b.delay(n, previous, uniform(rng));
    const ns prev = std::max(previous, ns{10ms});
    REQUIRE(d >= 10ms);
    REQUIRE(d <= std::min<ns>(1s, 3 * prev));
    REQUIRE(d <= 1s);
    reached_high = reached_high || d > 800ms;
    previous = d;
  }
  CHECK(reached_high);
}

TEST_CASE("the default schedule is 10 ms doubling to 1 s with full jitter") {
  const dibs::exponential_backoff b;
  CHECK(b.initial() == 10ms);
  CHECK(b.multiplier() == 2.0);
  CHECK(b.cap() == 1s);
  CHECK(b.jitter() == dibs::jitter::full);
}

TEST_CASE("invalid schedules are rejected when built, naming the field") {
  using Catch::Contains;
  CHECK_THROWS_WITH((dibs::exponential_backoff{0ms, 2.0, 1s}), Contains("initial"));
  CHECK_THROWS_WITH((dibs::exponential_backoff{-5ms, 2.0, 1s}), Contains("initial"));
  CHECK_THROWS_WITH((dibs::exponential_backoff{10ms, 0.5, 1s}), Contains("multiplier"));
  CHECK_THROWS_WITH((dibs::exponential_backoff{10ms, std::numeric_limits<double>::quiet_NaN(), 1s}),
                    Contains("multiplier"));
  CHECK_THROWS_WITH((dibs::exponential_backoff{10ms, std::numeric_limits<double>::infinity(), 1s}),
                    Contains("multiplier"));
  CHECK_THROWS_WITH((dibs::exponential_backoff{10ms, 2.0, 5ms}), Contains("cap"));
  CHECK_THROWS_AS((dibs::exponential_backoff{10ms, 2.0, 5ms}), std::invalid_argument);
  CHECK_NOTHROW(dibs::exponential_backoff{10ms, 1.0, 10ms});
}

TEST_CASE("bad schedules are refused with durations in human units, not nanoseconds") {
  CHECK_THROWS_WITH((dibs::exponential_backoff{1s, 2.0, 100ms}),
                    Catch::Contains("cap 100 ms < initial 1 s") && !Catch::Contains("ns"));
  CHECK_THROWS_WITH((dibs::exponential_backoff{-1500us, 2.0, 100ms}), Catch::Contains("got -1.5 ms"));
  CHECK(dibs::show_duration(90s) == "1.5 min");
  CHECK(dibs::show_duration(250us) == "250 µs");
  CHECK(dibs::show_duration(7ns) == "7 ns");
  CHECK(dibs::show_duration(1234567us) == "1.235 s");
  CHECK(dibs::show_duration(100ms) == "100 ms");
}

TEST_CASE("fixed-width digits, as the names, checksums and dates dibs writes need them") {
  using dibs::detail::fixed_digits;
  CHECK(dibs::detail::hex_digits(0xabc, 8) == "00000abc");
  CHECK(dibs::detail::hex_digits(0xdeadbeefcafe1234u, 16) == "deadbeefcafe1234");
  CHECK(dibs::detail::hex_digits(0x1f, 2, true) == "1F");
  CHECK(fixed_digits(0644, 8, 4) == "0644");
  CHECK(dibs::detail::padded(7, 2) == "07");
  CHECK(dibs::detail::padded(2026, 4) == "2026");
  CHECK(dibs::detail::padded(12345, 3) == "12345");
  CHECK(dibs::detail::padded(-5, 3) == "-005");
  CHECK(dibs::detail::padded(std::numeric_limits<std::int64_t>::min(), 1) == "-9223372036854775808");
}
