// dibs/store.hpp: the shared_store concept: versioned records that many
// processes (or machines) read and change with compare-and-set.
//
// | expression              | returns                 | meaning                                        |
// | ---                     | ---                     | ---                                            |
// | s.read(key)             | std::optional<record>   | the current value and version, or nothing      |
// | s.create(key, value)    | std::optional<version>  | insert if absent; nothing if the key exists    |
// | s.replace(key, v, value)| std::optional<version>  | compare-and-set on version v; nothing if moved |
// | s.erase(key, v)         | bool                    | delete if the version is still v               |
//
// Every model keeps these invariants (include/dibs/testing/store_conformance.hpp
// checks them):
//   - each operation is atomic with respect to every other user of the medium;
//   - the versions of a key only grow, also across erase and create, because
//     policies use the version as a fencing token;
//   - losing a race is a result (nullopt / false), never an exception;
//   - a failure of the medium throws std::system_error, and dibs::is_transient
//     says whether a retry can help;
//   - a bad key or value is refused before anything is written, with
//     std::system_error(errc::invalid_argument) naming the key and the rule.
//
// A store may also offer every operation with a last argument
// `dibs::time_limit t` (timed_shared_store): the operation then gives up at t,
// if what it waits for inside the medium (a record's lock held by a process
// that was stopped, a busy database) has not come by then, with
// std::system_error(errc::timed_out), which is transient. Policies use it
// for try_lock, try_lock_for and try_claim, so a timed or "try" call returns
// within its time whatever another process holds.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/error.hpp>
#include <dibs/text.hpp>

namespace dibs {

/// A record's version: grows with every change of the key, never reused.
using version = std::uint64_t;

/// A value and the version it was stored at.
struct record {
  std::string value;
  dibs::version version = 0;
  friend bool operator==(const record&, const record&) = default;
};

template <class S>
concept shared_store = requires(S& s, std::string_view key, std::string_view value, dibs::version v) {
  { s.read(key) } -> std::same_as<std::optional<record>>;
  { s.create(key, value) } -> std::same_as<std::optional<dibs::version>>;
  { s.replace(key, v, value) } -> std::same_as<std::optional<dibs::version>>;
  { s.erase(key, v) } -> std::same_as<bool>;
};

/// When an operation gives up: a point on this process's steady clock
/// (time_limit::max(): never).
using time_limit = std::chrono::steady_clock::time_point;

template <class S>
concept timed_shared_store = shared_store<S> && requires(S& s, std::string_view key, std::string_view value,
                                                         dibs::version v, dibs::time_limit t) {
  { s.read(key, t) } -> std::same_as<std::optional<record>>;
  { s.create(key, value, t) } -> std::same_as<std::optional<dibs::version>>;
  { s.replace(key, v, value, t) } -> std::same_as<std::optional<dibs::version>>;
  { s.erase(key, v, t) } -> std::same_as<bool>;
};

/// Optional: a store whose medium has transactions that the application
/// opens itself (sqlite_store's connection()). Operations of the thread that
/// has one open are part of it; marker_claim then keeps a claim's completion
/// (or give-back) pending until the transaction ends, and holds the claim
/// again if it was rolled back.
///
/// | expression | returns | meaning |
/// | --- | --- | --- |
/// | `s.in_transaction()` | `bool` | the calling thread has a transaction open on the store |
/// | `s.after_transaction(f)` | `std::uint64_t` | calls `f(committed)` once when that transaction ends |
/// | `s.forget_after_transaction(id)` | | `f` of `id` will not be called (nor is it running) |
template <class S>
concept transaction_aware_store =
    shared_store<S> && requires(S& s, std::function<void(bool)> f, std::uint64_t id) {
      { s.in_transaction() } -> std::convertible_to<bool>;
      { s.after_transaction(std::move(f)) } -> std::same_as<std::uint64_t>;
      s.forget_after_transaction(id);
    };

/// A record and how long ago, by the store's clock, it was last written.
struct aged_record {
  dibs::record record;
  std::chrono::milliseconds age{0};
};

/// A store with its own clock: `read_aged(key, t)` also says how old the
/// record is by one clock for every client (a server's), so lease_mutex
/// judges a lease expired by it instead of by each waiter watching the
/// record for a whole lease (postgres_store is one).
template <class S>
concept store_with_clock = shared_store<S> && requires(S& s, std::string_view key, dibs::time_limit t) {
  { s.read_aged(key, t) } -> std::same_as<std::optional<aged_record>>;
};

/// A store with a wall clock of its own, the same for every client (a
/// server's): `now(t)` reads it. dibs::once numbers its slots by it, so
/// that hosts whose clocks differ agree on which slot is due
/// (postgres_store is one).
template <class S>
concept store_with_wall_clock = shared_store<S> && requires(S& s, dibs::time_limit t) {
  { s.now(t) } -> std::same_as<std::chrono::system_clock::time_point>;
};

/// What create_or_read did: `created` the new record's version, if the key
/// had no record; else `existing`, the record it has (left as it was). Both
/// empty: another writer created the key at that moment, and its record was
/// not yet visible (a lost race).
struct create_or_read_result {
  std::optional<dibs::version> created;
  std::optional<record> existing;
};

/// Optional: a store that creates a record if the key has none and
/// otherwise returns the one it has, in one step (postgres_store: one
/// statement where a read and then a create are two round trips).
/// marker_claim's try_claim uses it: a fresh key is claimed in one step,
/// and a key with a record is judged from what came back.
template <class S>
concept create_or_read_store =
    timed_shared_store<S> && requires(S& s, std::string_view key, std::string_view value, dibs::time_limit t) {
      { s.create_or_read(key, value, t) } -> std::same_as<create_or_read_result>;
    };

/// One record of a batch: create_n's key and value.
struct key_value {
  std::string_view key;
  std::string_view value;
};

/// One compare-and-set of a batch: replace_n's key, the version it expects
/// and the new value.
struct replace_item {
  std::string_view key;
  dibs::version expected = 0;
  std::string_view value;
};

/// Optional: a store that writes many records in one statement or one
/// transaction (sqlite_store, postgres_store): marker_claim's offer_n and
/// complete_n use it; elsewhere they write item by item.
///
/// | expression | returns | meaning |
/// | --- | --- | --- |
/// | `s.create_n(items, t)` | `std::vector<std::optional<version>>` | create each absent key; per item its version, or nothing if the key had a record |
/// | `s.replace_n(items, t)` | `std::vector<std::optional<version>>` | compare-and-set each; per item its new version, or nothing if it had moved |
///
/// A batch is atomic: it is applied whole or not at all (a failure throws,
/// having changed nothing, or with errc::outcome_unknown). Its keys are
/// distinct; each item is checked as its single operation would be, before
/// anything is written.
template <class S>
concept batch_store = shared_store<S> && requires(S& s, std::span<const key_value> kv,
                                                  std::span<const replace_item> ri, dibs::time_limit t) {
  { s.create_n(kv, t) } -> std::same_as<std::vector<std::optional<dibs::version>>>;
  { s.replace_n(ri, t) } -> std::same_as<std::vector<std::optional<dibs::version>>>;
};

/// A store where a create() that finds the key taken costs about as much as
/// the create that succeeds, and less than a read followed by a create of a
/// fresh key: `S::create_before_read` is true. marker_claim then claims a
/// fresh item with the create alone while the items it meets are fresh, and
/// reads first once it has met a taken one (a taken item then costs a read,
/// not a write; see marker_claim::try_claim). sqlite_store is one: a read
/// and a write are a statement each, and the write lock is what contending
/// processes queue for.
template <class S>
concept create_before_read_store = shared_store<S> && requires {
  requires S::create_before_read;
};

namespace detail {

/// Returns: true if `e` says a write may or may not have been applied.
inline bool outcome_unknown(const std::system_error& e) noexcept {
  return e.code() == make_error_code(errc::outcome_unknown);
}

// Runs f() again after a transient failure (a server restarting, a
// connection lost before the operation was sent: nothing changed), with
// backoff, until `t`; then, or for any other error, throws. Not retried:
// timed_out (the deadline came) and contended (someone holds what the call
// needs, e.g. sqlite_store refusing a renewal during another thread's
// transaction: the caller decides when to come back).
template <class F>
auto retry_transient(dibs::time_limit t, F f) -> decltype(f()) {
  for (std::chrono::microseconds pause{500};; pause = std::min(pause * 2, std::chrono::microseconds{200'000})) {
    try {
      return f();
    } catch (const std::system_error& e) {
      if (!is_transient(e.code()) || e.code() == make_error_code(errc::timed_out) ||
          e.code() == make_error_code(errc::contended) || std::chrono::steady_clock::now() + pause >= t)
        throw;
    }
    std::this_thread::sleep_for(pause);
  }
}

// The policies' way into a store: with a deadline where the store takes one,
// and transient failures retried until it.
template <class S>
std::optional<record> store_read(S& s, std::string_view key, dibs::time_limit t) {
  return retry_transient(t, [&] {
    if constexpr (timed_shared_store<S>) return s.read(key, t);
    else return s.read(key);
  });
}

// Reads `key` back after a write whose outcome is unknown; if that cannot be
// done by `t`, the outcome stays unknown and `unknown` is thrown. The store
// has made sure by then that the lost write can no longer land
// (postgres_store ends the old server session first).
template <class S>
std::optional<record> read_back(S& s, std::string_view key, dibs::time_limit t, const std::system_error& unknown) {
  try {
    return store_read(s, key, t);
  } catch (const std::system_error& e) {
    if (is_transient(e.code())) throw unknown;
    throw;
  }
}

// The writes, with an unknown outcome resolved by reading back: the values
// the policies write name their writer (an owner record, a token, a time),
// so the value it wrote, found at a newer version, is its own write; the
// record as it was before means the write was not applied, and it is made
// again; anything else is a change by someone else, i.e. a lost race.
template <class S>
std::optional<dibs::version> store_create(S& s, std::string_view key, std::string_view value, dibs::time_limit t) {
  for (;;) {
    try {
      return retry_transient(t, [&] {
        if constexpr (timed_shared_store<S>) return s.create(key, value, t);
        else return s.create(key, value);
      });
    } catch (const std::system_error& e) {
      if (!outcome_unknown(e)) throw;
      const auto r = read_back(s, key, t, e);
      if (r) return r->value == value ? std::optional{r->version} : std::nullopt;
    }
  }
}
template <class S>
std::optional<dibs::version> store_replace(S& s, std::string_view key, dibs::version v, std::string_view value,
                                           dibs::time_limit t) {
  for (;;) {
    try {
      return retry_transient(t, [&] {
        if constexpr (timed_shared_store<S>) return s.replace(key, v, value, t);
        else return s.replace(key, v, value);
      });
    } catch (const std::system_error& e) {
      if (!outcome_unknown(e)) throw;
      const auto r = read_back(s, key, t, e);
      if (!r) return std::nullopt;
      if (r->version > v && r->value == value) return r->version;
      if (r->version != v) return std::nullopt;
    }
  }
}

// create_or_read, with an unknown outcome resolved by reading back, as
// store_create does: its own value found means created.
template <class S>
create_or_read_result store_create_or_read(S& s, std::string_view key, std::string_view value, dibs::time_limit t) {
  for (;;) {
    try {
      return retry_transient(t, [&] { return s.create_or_read(key, value, t); });
    } catch (const std::system_error& e) {
      if (!outcome_unknown(e)) throw;
      auto r = read_back(s, key, t, e);
      if (!r) continue;  // not applied: made again
      if (r->value == value) return {r->version, std::nullopt};
      return {std::nullopt, std::move(r)};
    }
  }
}

// Batches, with an unknown outcome resolved as for single writes: a batch
// is atomic, so it landed if any item reads back with its own value (each
// value the policies write names its writer), and then the items found
// with their own values are its; if none is found, it did not land and is
// sent again. A store without batches: item by item.
template <class S>
std::vector<std::optional<dibs::version>> store_create_n(S& s, std::span<const key_value> items, dibs::time_limit t) {
  if constexpr (batch_store<S>) {
    for (;;) {
      try {
        return retry_transient(t, [&] { return s.create_n(items, t); });
      } catch (const std::system_error& e) {
        if (!outcome_unknown(e)) throw;
        std::vector<std::optional<dibs::version>> out;
        bool landed = false;
        for (const auto& it : items) {
          const auto r = read_back(s, it.key, t, e);
          out.push_back(r && r->value == it.value ? std::optional{r->version} : std::nullopt);
          landed = landed || out.back().has_value();
        }
        if (landed) return out;
      }
    }
  } else {
    std::vector<std::optional<dibs::version>> out;
    out.reserve(items.size());
    for (const auto& it : items) out.push_back(store_create(s, it.key, it.value, t));
    return out;
  }
}

template <class S>
std::vector<std::optional<dibs::version>> store_replace_n(S& s, std::span<const replace_item> items,
                                                          dibs::time_limit t) {
  if constexpr (batch_store<S>) {
    for (;;) {
      try {
        return retry_transient(t, [&] { return s.replace_n(items, t); });
      } catch (const std::system_error& e) {
        if (!outcome_unknown(e)) throw;
        std::vector<std::optional<dibs::version>> out;
        std::vector<bool> unchanged;
        bool landed = false;
        for (const auto& it : items) {
          const auto r = read_back(s, it.key, t, e);
          const bool mine = r && r->version > it.expected && r->value == it.value;
          out.push_back(mine ? std::optional{r->version} : std::nullopt);
          unchanged.push_back(r && r->version == it.expected);
          landed = landed || mine;
        }
        if (landed) return out;
        // Not applied: the items still as they were are written again (one
        // by one), the others were moved by someone else (lost races).
        for (std::size_t i = 0; i < items.size(); ++i)
          if (unchanged[i]) out[i] = store_replace(s, items[i].key, items[i].expected, items[i].value, t);
        return out;
      }
    }
  } else {
    std::vector<std::optional<dibs::version>> out;
    out.reserve(items.size());
    for (const auto& it : items) out.push_back(store_replace(s, it.key, it.expected, it.value, t));
    return out;
  }
}

template <class S>
bool store_erase(S& s, std::string_view key, dibs::version v, dibs::time_limit t) {
  for (;;) {
    try {
      return retry_transient(t, [&] {
        if constexpr (timed_shared_store<S>) return s.erase(key, v, t);
        else return s.erase(key, v);
      });
    } catch (const std::system_error& e) {
      if (!outcome_unknown(e)) throw;
      const auto r = read_back(s, key, t, e);
      if (!r) return true;  // erased: by this write (or, after it, by whoever took the key over and let go)
      if (r->version != v) return false;
    }
  }
}

/// How long a "try" operation (try_lock, try_claim) waits for a record that
/// another process is changing: a running process holds a record for
/// microseconds, so one still held after this is stopped or stalled, and the
/// item is reported busy instead.
inline constexpr std::chrono::milliseconds try_wait{20};

/// Returns: true if `e` is a timed operation giving up (errc::timed_out).
inline bool timed_out(const std::system_error& e) noexcept { return e.code() == make_error_code(errc::timed_out); }

}  // namespace detail

/// The rules every store applies to keys and values before writing anything.
/// A key is any non-empty string of bytes up to max_key_size: a Message-ID
/// with '/', '+' and '@', a URL, a file name, also bytes that are not text
/// (NUL and other control bytes). Each store keeps every such key apart from
/// every other (file_store encodes keys into file names reversibly).
struct key_rules {
  static constexpr std::size_t max_key_size = 1024;
  static constexpr std::size_t max_value_size = 1 << 20;
};

/// A listable_store can also say which keys hold a live record: `keys(prefix)`
/// returns them (those starting with `prefix`), in no particular order, as
/// they were at some moment during the call. marker_claim's list() and
/// purge() need it; every store of dibs has it.
template <class S>
concept listable_store = shared_store<S> && requires(S& s, std::string_view prefix) {
  { s.keys(prefix) } -> std::same_as<std::vector<std::string>>;
};

/// Optional: a listable store that can also hand out every record whose key
/// starts with `prefix` at once, as they were at one moment
/// (imap_store, whose records are all at hand after one round trip).
/// marker_claim::list() then reads them so, instead of key by key.
template <class S>
concept snapshot_store = listable_store<S> && requires(S& s, std::string_view prefix) {
  { s.records(prefix) } -> std::same_as<std::vector<std::pair<std::string, record>>>;
};

namespace detail {
using dibs::show_key;  // <dibs/text.hpp>
}  // namespace detail

/// Throws: std::system_error(errc::invalid_argument) naming the call, the key
/// and the rule it breaks (empty, or longer than key_rules::max_key_size
/// bytes), with what to do instead. `call` is what the user called, e.g.
/// "dibs::marker_claim::try_claim".
inline void validate_key(std::string_view key, std::string_view call = "dibs") {
  if (key.empty())
    throw std::system_error(make_error_code(errc::invalid_argument),
                            fmt::format("{}: invalid key '': a key must not be empty; name the item (any bytes, "
                                        "at most {})",
                                        call, key_rules::max_key_size));
  if (key.size() > key_rules::max_key_size)
    throw std::system_error(make_error_code(errc::invalid_argument),
                            fmt::format("{}: invalid key '{}': a key must be at most {} bytes (it has {}); key the "
                                        "item by a digest of its name instead (e.g. its SHA-256 in hex), and keep "
                                        "the name in the value",
                                        call, detail::show_key(key), key_rules::max_key_size, key.size()));
}

/// Throws: std::system_error(errc::invalid_argument) naming the key if the
/// value is larger than 1 MiB.
inline void validate_value(std::string_view key, std::string_view value) {
  if (value.size() > key_rules::max_value_size)
    throw std::system_error(make_error_code(errc::invalid_argument),
                            fmt::format("dibs: value for key '{}' is {} bytes; at most {} are allowed",
                                        detail::show_key(key),
                                        value.size(), key_rules::max_value_size));
}

namespace detail {

/// Throws: std::system_error(errc::invalid_argument) naming `call` and the
/// item, before anything is written, if a key or value of a batch breaks its
/// rules or a key is given twice.
template <class Item>
void check_batch(std::span<const Item> items, std::string_view call) {
  std::vector<std::string_view> keys;
  keys.reserve(items.size());
  for (const auto& it : items) {
    validate_key(it.key, call);
    validate_value(it.key, it.value);
    keys.push_back(it.key);
  }
  std::sort(keys.begin(), keys.end());
  if (const auto d = std::adjacent_find(keys.begin(), keys.end()); d != keys.end())
    throw std::system_error(make_error_code(errc::invalid_argument),
                            fmt::format("{}: key '{}' is given twice in one batch", call, show_key(*d)));
}

}  // namespace detail

}  // namespace dibs
