// dibs/testing/store_conformance.hpp: the checks every dibs::shared_store
// model must pass, for dibs's own adapters and for yours.
//
// Framework-neutral: each check throws dibs::testing::conformance_failure
// (a std::runtime_error saying which rule broke) and returns normally if the
// store keeps the rules. With Catch2:
//
//   dibs::memory_store s;
//   REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "t1-"));
//   REQUIRE_NOTHROW(dibs::testing::check_counter_race_processes(
//       [&] { return my_store{dir}; }, 8, 1000, "counter"));
//
// Keys used start with the given prefix and must not exist beforehand.
//
// The queue checks (check_queue, check_queue_race_*) run
// dibs::marker_claim's queue operations over a listable store: priorities,
// scheduled items, backoffs after release, claim_next_n, and no item handed
// to two workers. They take a few seconds (they wait out backoffs).
//
// The *_processes checks fork, so they exist on POSIX only; on Windows the
// *_threads checks run (each thread with the store object it is given), and
// dibs's own Windows tests race processes started with CreateProcessW.
#pragma once

#ifndef _WIN32
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstdio>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include <dibs/marker_claim.hpp>
#include <dibs/store.hpp>

namespace dibs::testing {

struct conformance_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Models dibs::shared_store and nothing more: code written against the
/// concept compiles with it (declared only; never called).
struct store_archetype {
  std::optional<record> read(std::string_view key);
  std::optional<dibs::version> create(std::string_view key, std::string_view value);
  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value);
  bool erase(std::string_view key, dibs::version expected);
};
static_assert(shared_store<store_archetype>);

namespace detail {

inline void expect(bool ok, std::string_view rule) {
  if (!ok) throw conformance_failure(fmt::format("shared_store conformance: {}", rule));
}

// Returns: true if f() threw std::system_error(errc::invalid_argument)
// whose message contains `mention`.
template <class F>
bool refuses(F&& f, std::string_view mention) {
  try {
    f();
  } catch (const std::system_error& e) {
    return e.code() == dibs::errc::invalid_argument && std::string_view(e.what()).find(mention) != std::string_view::npos;
  }
  return false;
}

#ifndef _WIN32  // fork: the process races are POSIX only
// Waits for every child; returns their exit codes.
inline std::vector<int> wait_all(const std::vector<pid_t>& pids) {
  std::vector<int> codes;
  for (pid_t p : pids) {
    int status = 0;
    while (::waitpid(p, &status, 0) < 0 && errno == EINTR) {
    }
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0));
  }
  return codes;
}

// Forks n children that each wait at a barrier, then run body(i) and exit
// with its result (99 if it threw: losing a race must not throw).
template <class Body>
std::vector<int> race_processes(int n, Body body) {
  int gate[2];
  if (::pipe(gate) != 0) throw std::system_error(errno, std::generic_category(), "pipe");
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::system_error(errno, std::generic_category(), "fork");
    if (pid == 0) {
      ::close(gate[1]);
      char c;
      while (::read(gate[0], &c, 1) < 0 && errno == EINTR) {
      }
      int code = 99;
      try {
        code = body(i);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "conformance child %d: %s\n", i, e.what());
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  ::close(gate[0]);
  ::close(gate[1]);  // everyone starts at once
  return wait_all(pids);
}

#endif

// The largest value `s` holds: its own max_value_size() where it has one.
template <shared_store S>
std::size_t max_value_of(const S& s) {
  if constexpr (requires { { s.max_value_size() } -> std::convertible_to<std::size_t>; }) return s.max_value_size();
  else return key_rules::max_value_size;
}

template <shared_store S>
std::uint64_t increment(S& s, std::string_view key, std::uint64_t& losses) {
  for (;;) {
    auto r = s.read(key);
    if (!r) throw conformance_failure("counter record vanished");
    const std::uint64_t next = std::stoull(r->value) + 1;
    if (s.replace(key, r->version, std::to_string(next))) return next;
    ++losses;
  }
}

}  // namespace detail

/// Single-process semantics of the four operations, versions across erase and
/// re-create, and binary and empty values.
template <shared_store S>
void check_semantics(S& s, std::string_view prefix) {
  using detail::expect;
  const std::string k = std::string(prefix) + "item";
  const std::string other = std::string(prefix) + "other";
  expect(!s.read(k), "read of an absent key returns nothing");
  expect(!s.replace(k, 1, "x"), "replace of an absent key returns nothing");
  expect(!s.erase(k, 1), "erase of an absent key returns false");

  const auto v1 = s.create(k, "one");
  expect(v1.has_value(), "create of an absent key succeeds");
  expect(s.read(k) == record{"one", *v1}, "read returns the created value and version");
  expect(!s.create(k, "again"), "create of an existing key returns nothing");
  expect(s.read(k) == record{"one", *v1}, "a failed create changes nothing");

  expect(!s.replace(k, *v1 + 1000, "wrong"), "replace with a wrong version returns nothing");
  expect(s.read(k) == record{"one", *v1}, "a failed replace changes nothing");
  const auto v2 = s.replace(k, *v1, "two");
  expect(v2.has_value(), "replace with the current version succeeds");
  expect(*v2 > *v1, "replace gives a larger version");
  expect(s.read(k) == record{"two", *v2}, "read returns the replaced value");
  expect(!s.replace(k, *v1, "stale"), "replace with a stale version returns nothing");

  expect(s.create(other, "").has_value(), "create of a second key succeeds, with an empty value");
  expect(s.read(other).has_value() && s.read(other)->value.empty(), "an empty value reads back empty");
  expect(s.read(k) == record{"two", *v2}, "keys are independent");

  expect(!s.erase(k, *v1), "erase with a stale version returns false");
  expect(s.read(k).has_value(), "a failed erase changes nothing");
  expect(s.erase(k, *v2), "erase with the current version succeeds");
  expect(!s.read(k), "an erased key reads as absent");
  expect(!s.erase(k, *v2), "erase of an erased key returns false");
  expect(!s.replace(k, *v2, "ghost"), "replace of an erased key returns nothing");

  const auto v3 = s.create(k, "three");
  expect(v3.has_value(), "create after erase succeeds");
  expect(*v3 > *v2, "versions grow across erase and re-create (they are fencing tokens)");

  std::string binary = "a\nb";
  binary += '\0';
  binary += "c\r\x01\xff";
  const auto v4 = s.replace(k, *v3, binary);
  expect(v4.has_value() && s.read(k) == record{binary, *v4}, "values are bytes: newlines, NUL and high bytes survive");
  const std::string big(detail::max_value_of(s), 'v');
  const auto v5 = s.replace(k, *v4, big);
  expect(v5.has_value() && s.read(k)->value == big, "a value of the maximum size round-trips");
}

/// A record removed behind the store's back, the way a person can on its
/// medium (`remove(key)`: rm of a record file, a DELETE of a row, an
/// EXPUNGE of a message), and made again: the new record's version is
/// larger than every version the removed one had (versions are fencing
/// tokens), so an operation that names an old version (a holder renewing
/// a lock it held before the removal) fails and leaves the new record alone.
template <shared_store S, class Remove>
void check_removed_by_hand(S& s, std::string_view prefix, Remove remove) {
  using detail::expect;
  const std::string k = std::string(prefix) + "removed";
  dibs::version highest = 0;
  std::optional<dibs::version> v = s.create(k, "first");
  expect(v.has_value(), "create of a fresh key succeeds");
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 3; ++i) {
      const auto next = s.replace(k, *v, fmt::format("round {} write {}", round, i));
      expect(next.has_value() && *next > *v, "replace with the current version succeeds, with a larger version");
      v = next;
    }
    const dibs::version old = *v;
    highest = std::max(highest, old);
    remove(k);
    expect(!s.read(k), "a record removed by hand reads as absent");
    v = s.create(k, fmt::format("made again {}", round));
    expect(v.has_value(), "create after a removal by hand succeeds");
    expect(*v > highest, "a record made again after a removal by hand has a larger version than every earlier one");
    expect(!s.replace(k, old, "stale holder"), "replace with a version from before the removal returns nothing");
    expect(!s.erase(k, old), "erase with a version from before the removal returns false");
    expect(s.read(k) == record{fmt::format("made again {}", round), *v}, "the new record is left alone");
  }
}

/// Bad keys and values are refused by every operation with a message naming
/// the key and the rule, and nothing is written. A key is refused only if it
/// is empty or longer than key_rules::max_key_size.
template <shared_store S>
void check_bad_input(S& s, std::string_view prefix) {
  using detail::expect;
  using detail::refuses;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "empty"},
      {std::string(prefix) + std::string(key_rules::max_key_size, 'k'), "at most"},
  };
  for (const auto& entry : bad) {
    const std::string& key = entry.first;  // not a structured binding: clang 14 cannot capture those
    const std::string& rule = entry.second;
    const std::string what = fmt::format("a bad key ({}) is refused", rule);
    expect(refuses([&] { (void)s.read(key); }, rule), what + " by read");
    expect(refuses([&] { (void)s.create(key, "v"); }, rule), what + " by create");
    expect(refuses([&] { (void)s.replace(key, 1, "v"); }, rule), what + " by replace");
    expect(refuses([&] { (void)s.erase(key, 1); }, rule), what + " by erase");
  }
  const std::string k = std::string(prefix) + "big";
  const std::string huge(detail::max_value_of(s) + 1, 'h');
  expect(refuses([&] { (void)s.create(k, huge); }, k), "a too large value is refused by create, naming the key");
  expect(!s.read(k), "a refused create writes nothing");
  const auto v = s.create(k, "small");
  expect(refuses([&] { (void)s.replace(k, *v, huge); }, k), "a too large value is refused by replace, naming the key");
  expect(s.read(k) == record{"small", *v}, "a refused replace writes nothing");
}

/// Any non-empty string of bytes up to key_rules::max_key_size is a key, and
/// every key is its own: keys that a careless encoding would confuse ("a/b",
/// "a%2Fb", ".", "..", NUL and control bytes, invalid UTF-8, keys of the
/// longest size that differ only at their end) and `random` random byte
/// strings of random length round-trip through create, read, replace and
/// erase, each keeping its own value; a listable_store lists exactly the live
/// ones. Uses keys starting with `prefix`, and "." and "..".
template <shared_store S>
void check_any_keys(S& s, std::string_view prefix, int random = 200, std::uint64_t seed = 1) {
  using detail::expect;
  const std::string p(prefix);
  const std::size_t max = key_rules::max_key_size;
  std::vector<std::string> keys = {
      ".", "..", p + "a/b", p + "a%2Fb", p + "a%252Fb", p + "%", p + "%2", p + "50%off", p + "%~0123456789abcdef",
      p + std::string("nul\0x", 5), std::string(1, '\0') + p, p + "\x01\x7f\n\t", p + "\xff\xfe\xc3", p + "\xc3\xbc",
      p + "<abc/def+123@mail.example.com>", p + "https://example.com/a?b=c&d=%20#x", p + " spaced key ", p + "\\",
      p + ".", p + "..", p + "/", p + ".dibs-tmp.0.0.0.1.1.0123456789abcdef", ".dibs-" + p, "./" + p,
      p + std::string(max - p.size(), 'k'), p + std::string(max - p.size() - 1, 'k') + "j",
      p + std::string(max - p.size(), '/'), p + std::string(max - p.size() - 1, '/') + "x",
      p + std::string(300, 'k') + "1", p + std::string(300, 'k') + "2", p + std::string(120, '%') + "end",
  };
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&] {  // splitmix64: the same keys on every machine for a seed
    x += 0x9e3779b97f4a7c15ull;
    std::uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int i = 0; i < random; ++i) {
    std::string k = p;
    const std::size_t len = 1 + next() % (i % 4 == 0 ? max - p.size() : 40);
    while (k.size() < p.size() + len) k += static_cast<char>(next() & 0xff);
    keys.push_back(std::move(k));
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  auto shown = [](const std::string& k) {
    std::string out;
    for (const char c : k.substr(0, 40)) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
    return fmt::format("key of {} bytes starting {}", k.size(), out);
  };
  std::vector<dibs::version> versions;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const auto v = s.create(keys[i], fmt::format("value {}", i));
    expect(v.has_value(), "any key can be created: " + shown(keys[i]));
    versions.push_back(*v);
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const auto r = s.read(keys[i]);
    expect(r && r->value == fmt::format("value {}", i) && r->version == versions[i],
           "each key reads back its own value, no other key's: " + shown(keys[i]));
  }
  for (std::size_t i = 0; i < keys.size(); i += 2) {
    const auto v = s.replace(keys[i], versions[i], fmt::format("again {}", i));
    expect(v && *v > versions[i], "any key can be replaced: " + shown(keys[i]));
    expect(s.erase(keys[i], *v), "any key can be erased: " + shown(keys[i]));
    expect(!s.read(keys[i]), "an erased key reads as absent: " + shown(keys[i]));
  }
  for (std::size_t i = 1; i < keys.size(); i += 2)
    expect(s.read(keys[i]) == record{fmt::format("value {}", i), versions[i]},
           "changing one key changes no other: " + shown(keys[i]));
  if constexpr (listable_store<S>) {
    std::vector<std::string> live;
    for (std::size_t i = 1; i < keys.size(); i += 2)
      if (keys[i].starts_with(p)) live.push_back(keys[i]);
    auto listed = s.keys(p);
    std::sort(listed.begin(), listed.end());
    expect(listed == live, fmt::format("keys(prefix) lists exactly the {} live keys with the prefix (listed {})",
                                       live.size(), listed.size()));
  }
  for (std::size_t i = 1; i < keys.size(); i += 2) (void)s.erase(keys[i], versions[i]);
}

#ifndef _WIN32
/// n processes, each opening the store with open(), create one key at the same
/// moment: exactly one wins, and the value is the winner's.
template <class Open>
void check_create_race_processes(Open open, int n, std::string_view key) {
  const std::string k(key);
  const auto codes = detail::race_processes(n, [&](int i) {
    auto s = open();
    return s.create(k, fmt::format("winner {}", i)) ? 0 : 1;
  });
  int winners = 0, winner = -1;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    detail::expect(codes[i] == 0 || codes[i] == 1, "losing a create race is a result, not an exception or a crash");
    if (codes[i] == 0) {
      ++winners;
      winner = static_cast<int>(i);
    }
  }
  detail::expect(winners == 1, fmt::format("exactly one of {} racing creates wins (won: {})", n, winners));
  auto s = open();
  detail::expect(s.read(k) && s.read(k)->value == fmt::format("winner {}", winner), "the stored value is the winner's");
}

/// n processes each compare-and-set-increment one counter `increments` times:
/// it ends at exactly n * increments, with no exception on a lost race.
template <class Open>
void check_counter_race_processes(Open open, int n, int increments, std::string_view key) {
  const std::string k(key);
  {
    auto s = open();
    detail::expect(s.create(k, "0").has_value(), "the counter record can be created");
  }
  const auto codes = detail::race_processes(n, [&](int) {
    auto s = open();
    std::uint64_t losses = 0, last = 0;
    for (int j = 0; j < increments; ++j) {
      const std::uint64_t now = detail::increment(s, k, losses);
      if (now <= last) return 2;  // a process saw the counter go backwards
      last = now;
    }
    return 0;
  });
  for (int c : codes) detail::expect(c == 0, fmt::format("every incrementing process finishes cleanly (exit {})", c));
  auto s = open();
  const auto r = s.read(k);
  const auto expected = static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(increments);
  detail::expect(r && std::stoull(r->value) == expected,
                 fmt::format("{} x {} compare-and-set increments end at {} (got {})", n, increments, expected,
                             r ? r->value : "nothing"));
}
#endif

/// The same two races with threads sharing one store object, for stores that
/// live in one process.
template <shared_store S>
void check_races_threads(S& s, int n, int increments, std::string_view prefix) {
  const std::string k = std::string(prefix) + "created";
  std::atomic<int> winners{0}, errors{0};
  {
    std::vector<std::jthread> ts;
    for (int i = 0; i < n; ++i) ts.emplace_back([&, i] {
      try {
        if (s.create(k, std::to_string(i))) winners.fetch_add(1);
      } catch (...) {
        errors.fetch_add(1);
      }
    });
  }
  detail::expect(errors == 0, "losing a create race is a result, not an exception");
  detail::expect(winners == 1, fmt::format("exactly one of {} racing creates wins (won: {})", n, winners.load()));
  const std::string c = std::string(prefix) + "counter";
  detail::expect(s.create(c, "0").has_value(), "the counter record can be created");
  {
    std::vector<std::jthread> ts;
    for (int i = 0; i < n; ++i) ts.emplace_back([&] {
      try {
        std::uint64_t losses = 0;
        for (int j = 0; j < increments; ++j) detail::increment(s, c, losses);
      } catch (...) {
        errors.fetch_add(1);
      }
    });
  }
  detail::expect(errors == 0, "lost compare-and-set races are results, not exceptions");
  const auto expected = static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(increments);
  detail::expect(std::stoull(s.read(c)->value) == expected,
                 fmt::format("{} x {} compare-and-set increments end at {}", n, increments, expected));
}

namespace detail {

// Polls claim_next(prefix) until it hands out an item, at most `patience`.
// Returns: the claim and when it came, by the steady clock.
template <class Claims>
auto poll_next(Claims& claims, const std::string& prefix, std::chrono::milliseconds patience) {
  const auto end = std::chrono::steady_clock::now() + patience;
  for (;;) {
    auto c = claims.claim_next(prefix);
    // The wall clock, as not_before times are (and as PostgreSQL compares
    // them): a steady clock and the wall clock may drift apart on a VM.
    const auto at = std::chrono::system_clock::now();
    if (c || std::chrono::steady_clock::now() >= end) return std::pair{std::move(c), at};
    std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
}

}  // namespace detail

namespace detail {

/// Returns: true if `f()` throws std::system_error with code `code`.
template <class F>
bool throws_code(F f, std::error_code code) {
  try {
    f();
  } catch (const std::system_error& e) {
    return e.code() == code;
  }
  return false;
}

}  // namespace detail

/// marker_claim's batches over `s`: offer_n makes the absent keys offered
/// and counts them, leaving the others as they were; bad batches (empty,
/// a key twice, an invalid key) are refused before anything is written;
/// complete_n completes the claims it still holds and reports, never
/// completes, one that was taken over.
template <listable_store S>
void check_batches(marker_claim<S>& claims, S& s, const std::string& p) {
  detail::expect(claims.offer(p + "0"), "offer() creates an offered item");
  const std::vector<std::string> keys{p + "0", p + "1", p + "2", p + "3"};
  detail::expect(claims.offer_n(keys, {.priority = 4}) == 3, "offer_n counts the keys it made (3 of 4 were new)");
  detail::expect(claims.status(p + "0").priority == 0, "offer_n leaves a key that had a record as it was");
  detail::expect(claims.status(p + "2").state == claim_state::offered && claims.status(p + "2").priority == 4,
                 "offer_n makes offered items with the priority given");
  const auto invalid = make_error_code(errc::invalid_argument);
  detail::expect(detail::throws_code([&] { (void)claims.offer_n(std::vector<std::string>{}); }, invalid),
                 "offer_n of no keys is refused as invalid_argument");
  detail::expect(detail::throws_code([&] { (void)claims.offer_n(std::vector<std::string>{p + "x", p + "x"}); }, invalid),
                 "offer_n of a key twice is refused as invalid_argument");
  detail::expect(detail::throws_code([&] { (void)claims.offer_n(std::vector<std::string>{p + "y", ""}); }, invalid),
                 "offer_n with an empty key is refused as invalid_argument");
  detail::expect(!s.read(p + "x") && !s.read(p + "y"), "a refused batch writes nothing");
  // complete_n: three held, one of them taken over by another worker.
  auto got = claims.claim_next_n(4, p);
  detail::expect(got.size() == 4, fmt::format("claim_next_n(4) takes the 4 offered items (took {})", got.size()));
  const auto& stolen = got[1].key();
  const auto r = s.read(stolen);
  detail::expect(r && s.replace(stolen, r->version, "dibs-claim 1\nstate released\nattempts 1\n").has_value(),
                 "the record of a claim can be changed by another writer");
  const auto done = claims.complete_n(std::span(got), "batch done");
  detail::expect(done == std::vector<bool>{true, false, true, true},
                 "complete_n completes the claims it holds and reports the one taken over");
  for (std::size_t i = 0; i < got.size(); ++i) {
    const auto st = claims.status(got[i].key());
    detail::expect((st.state == claim_state::completed) == (i != 1) && (i == 1 || st.result == "batch done"),
                   "complete_n's items are completed with the result, the one taken over is not");
  }
  detail::expect(claims.complete_n(std::span<typename marker_claim<S>::claim>{}).empty(),
                 "complete_n of no claims does nothing");
}

/// The queue operations of marker_claim over `s`, in one process: higher
/// priorities first, a scheduled item not before its time, an item
/// released with a retry_after (or by claim_options::retry_backoff) not
/// before that and soon after, its priority kept, claim_next_n taking
/// distinct items and no more than there are.
template <listable_store S>
void check_queue(S& s, std::string_view prefix) {
  using namespace std::chrono_literals;
  using std::chrono::system_clock;
  const std::string p(prefix);
  marker_claim<S> claims{s, {.renew = false}};
  // Priorities, and a scheduled item of the highest one.
  detail::expect(claims.offer(p + "p-a"), "offer() creates an offered item");
  detail::expect(claims.offer(p + "p-b", {.priority = 5}), "offer() with a priority");
  detail::expect(claims.offer(p + "p-c", {.priority = -1}), "offer() with a negative priority");
  // 2 s: the three claims below must all come before it, also on a slow
  // machine (under Wine on a loaded one they took over 400 ms).
  const auto scheduled = system_clock::now() + 2s;
  detail::expect(claims.offer(p + "p-d", {.not_before = scheduled, .priority = 9}),
                 "offer() with a not_before time");
  detail::expect(!claims.offer(p + "p-a", {.priority = 3}), "offer() of an item that has a record changes nothing");
  std::vector<std::string> order;
  for (int i = 0; i < 3; ++i) {
    auto c = claims.claim_next(p + "p-");
    detail::expect(c.has_value(), "claim_next hands out the three items that are claimable");
    if (system_clock::now() < scheduled)
      detail::expect(c->key() != p + "p-d", "a scheduled item is not handed out before its not_before time");
    order.push_back(c->key());
    c->complete();
  }
  detail::expect(order == std::vector<std::string>{p + "p-b", p + "p-a", p + "p-c"},
                 fmt::format("claim_next hands out higher priorities first (got {}, {}, {})", order[0], order[1],
                             order[2]));
  {
    auto [d, at] = detail::poll_next(claims, p + "p-", 5s);
    detail::expect(d && d->key() == p + "p-d", "a scheduled item is handed out once its time has come");
    detail::expect(at >= scheduled, "a scheduled item is not handed out before its not_before time");
    detail::expect(d->priority() == 9, "a claim says its item's priority");
    d->complete();
  }
  // release(error, retry_after): not before, and soon after; priority kept.
  detail::expect(claims.offer(p + "r-1", {.priority = 7}), "offer() with a priority");
  {
    auto c = claims.claim_next(p + "r-");
    detail::expect(c && c->attempts() == 1, "claim_next takes an offered item, attempt 1");
    const auto released = system_clock::now();
    detail::expect(c->release("try later", 300ms), "release(error, retry_after) gives the item back");
    const auto st = claims.status(p + "r-1");
    detail::expect(st.state == claim_state::released && st.priority == 7 &&
                       st.not_before > system_clock::now() + 200ms,
                   "a released item says its priority and when it comes back");
    detail::expect(!claims.try_claim(p + "r-1"), "try_claim does not take an item before its retry_after");
    auto [again, at] = detail::poll_next(claims, p + "r-", 3s);
    detail::expect(again.has_value(), "an item released with retry_after 300 ms comes back after it");
    detail::expect(at - released >= 300ms, fmt::format("an item released with retry_after 300 ms is not handed out "
                                                       "before 300 ms (it came after {} ms)",
                                                       std::chrono::duration_cast<std::chrono::milliseconds>(
                                                           at - released)
                                                           .count()));
    detail::expect(at - released < 2s, "an item released with retry_after 300 ms comes back soon after");
    detail::expect(again->attempts() == 2 && again->priority() == 7, "the item keeps its attempts and priority");
    again->complete();
  }
  // claim_options::retry_backoff: release() without retry_after waits by it.
  {
    marker_claim<S> backed{s, {.renew = false,
                               .retry_backoff = exponential_backoff{250ms, 2.0, 1s, jitter::none}}};
    detail::expect(backed.offer(p + "b-1"), "offer() creates an offered item");
    auto c = backed.claim_next(p + "b-");
    detail::expect(c.has_value(), "claim_next takes an offered item");
    const auto released = system_clock::now();
    detail::expect(c->release("busy"), "release() gives the item back");
    auto [again, at] = detail::poll_next(backed, p + "b-", 3s);
    detail::expect(again.has_value() && at - released >= 250ms,
                   "an item released under retry_backoff (250 ms, no jitter) comes back after 250 ms, not before");
    again->complete();
  }
  // claim_next_n: distinct items, no more than there are.
  for (int i = 0; i < 5; ++i) detail::expect(claims.offer(fmt::format("{}n-{}", p, i)), "offer() creates an offered item");
  auto first = claims.claim_next_n(3, p + "n-");
  auto second = claims.claim_next_n(5, p + "n-");
  const auto third = claims.claim_next_n(5, p + "n-");
  detail::expect(first.size() == 3, fmt::format("claim_next_n(3) of 5 items takes 3 (took {})", first.size()));
  detail::expect(second.size() == 2, fmt::format("claim_next_n(5) of the 2 left takes 2 (took {})", second.size()));
  detail::expect(third.empty(), "claim_next_n takes nothing when nothing is claimable");
  std::vector<std::string> keys;
  for (auto* batch : {&first, &second})
    for (auto& c : *batch) {
      keys.push_back(c.key());
      c.complete();
    }
  std::sort(keys.begin(), keys.end());
  detail::expect(std::adjacent_find(keys.begin(), keys.end()) == keys.end(), "claim_next_n never takes an item twice");
  bool refused = false;
  try {
    (void)claims.claim_next_n(0, p);
  } catch (const std::system_error& e) {
    refused = e.code() == dibs::errc::invalid_argument;
  }
  detail::expect(refused, "claim_next_n(0) is refused as invalid_argument");
  check_batches(claims, s, p + "batch-");
}

/// `threads` workers share `s` and take `items` offered items with
/// claim_next_n (batches of 1 to 4) until none is left: each is handed out
/// exactly once.
template <listable_store S>
void check_queue_race_threads(S& s, int threads, int items, std::string_view prefix) {
  const std::string p(prefix);
  marker_claim<S> claims{s, {.renew = false}};
  for (int i = 0; i < items; ++i) claims.offer(fmt::format("{}{:05}", p, i));
  std::vector<std::atomic<int>> taken(static_cast<std::size_t>(items));
  std::vector<std::thread> pool;
  std::atomic<int> errors{0};
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      try {
        for (;;) {
          auto batch = claims.claim_next_n(static_cast<std::size_t>(1 + t % 4), p);
          if (batch.empty()) return;
          for (auto& c : batch) {
            ++taken[static_cast<std::size_t>(std::stoi(c.key().substr(p.size())))];
            c.complete();
          }
        }
      } catch (const std::exception&) {
        ++errors;
      }
    });
  for (auto& th : pool) th.join();
  detail::expect(errors == 0, "queue workers finish without an exception");
  int once = 0;
  for (auto& n : taken) once += n == 1;
  detail::expect(once == items, fmt::format("each of {} items is handed out exactly once (only {} were)", items, once));
}

#ifndef _WIN32
/// The same with `procs` processes, each opening the store with open().
template <class Open>
void check_queue_race_processes(Open open, int procs, int items, std::string_view prefix) {
  const std::string p(prefix);
  {
    auto s = open();
    marker_claim<std::remove_cvref_t<decltype(s)>> claims{s, {.renew = false}};
    for (int i = 0; i < items; ++i) claims.offer(fmt::format("{}{:05}", p, i));
  }
  const std::size_t bytes = sizeof(std::atomic<int>) * static_cast<std::size_t>(items);
  void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap");
  auto* taken = static_cast<std::atomic<int>*>(mem);
  for (int i = 0; i < items; ++i) new (&taken[i]) std::atomic<int>{0};
  const auto codes = detail::race_processes(procs, [&](int i) {
    auto s = open();
    marker_claim<std::remove_cvref_t<decltype(s)>> claims{s, {.renew = false}};
    for (;;) {
      auto batch = claims.claim_next_n(static_cast<std::size_t>(1 + i % 4), p);
      if (batch.empty()) return 0;
      for (auto& c : batch) {
        ++taken[std::stoi(c.key().substr(p.size()))];
        c.complete();
      }
    }
  });
  int once = 0;
  for (int i = 0; i < items; ++i) once += taken[i] == 1;
  ::munmap(mem, bytes);
  for (int c : codes) detail::expect(c == 0, fmt::format("every queue worker process finishes cleanly (exit {})", c));
  detail::expect(once == items, fmt::format("each of {} items is handed out exactly once (only {} were)", items, once));
}
#endif

}  // namespace dibs::testing
