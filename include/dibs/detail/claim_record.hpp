// dibs/detail/claim_record.hpp: the one home of marker_claim's record format,
// which the policy writes and reads and the stores with a queue index
// (postgres_store's columns, sqlite_store's expression index, file_store's
// queue directory) read too, so that an index never disagrees with the
// record it indexes.
//
// A claim record is readable text, "name value" lines:
//
//   dibs-claim 1            the format (line 1)
//   state offered           line 2: offered, processing, released, completed, failed
//   attempts 0              line 3: claims made so far
//   priority 5              only if not 0
//   not_before 1765012345678  only if set: ms since the epoch, by the offering machine's clock
//   changed ...             then the rest (time, nonce, token, error, result, owner),
//   ...                     which only marker_claim reads
//
// The head (lines 1 to 3, and priority and not_before) is what a queue
// needs: parse_head() reads it as every store's index does: the state and
// attempts at lines 2 and 3, priority and not_before as the first line with
// their name. A store whose index is written in another language (SQL)
// keeps to these rules, and its test checks it against parse_head().
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <dibs/detail/owner.hpp>

namespace dibs {

/// `damaged`: the item's record cannot be read as a claim (a damaged file, a
/// foreign value). It is never taken for absent: claim loops skip it, and
/// status() says what is wrong, naming the key (and the file).
enum class claim_state { absent, offered, processing, released, completed, failed, damaged };

inline const char* to_string(claim_state s) noexcept {
  switch (s) {
    case claim_state::absent: return "absent";
    case claim_state::offered: return "offered";
    case claim_state::processing: return "processing";
    case claim_state::released: return "released";
    case claim_state::completed: return "completed";
    case claim_state::failed: return "failed";
    case claim_state::damaged: return "damaged";
  }
  return "?";
}

namespace detail::claim_record {

/// Line 1 of every claim record.
inline constexpr std::string_view magic = "dibs-claim 1\n";

/// The head of a record, as parse_head() finds it.
struct head {
  /// The word on line 2 ("state <lowercase letters, at most 20>"); empty if
  /// line 2 is not such a line.
  std::string_view state_word;
  /// The state it names; claim_state::damaged if none of the five.
  claim_state state = claim_state::damaged;
  /// Line 3 ("attempts <1 to 9 digits>"); nullopt if it is not such a line.
  std::optional<std::uint32_t> attempts;
  /// The first "priority <-?1 to 18 digits>" line; 0 if none.
  std::int64_t priority = 0;
  /// The first "not_before <1 to 18 digits>" line; nullopt if none.
  std::optional<std::int64_t> not_before_ms;

  /// Offered or released (a queue's claimable states; not_before aside).
  bool waiting() const noexcept { return state == claim_state::offered || state == claim_state::released; }
  /// Waiting and its not_before (if any) is at or before `now_ms`.
  bool claimable_at(std::int64_t now_ms) const noexcept {
    return waiting() && (!not_before_ms || *not_before_ms <= now_ms);
  }
};

/// Returns: the head of `v`, or nullopt if `v` does not start with `magic`
/// (not a claim record).
inline std::optional<head> parse_head(std::string_view v) {
  if (!v.starts_with(magic)) return std::nullopt;
  const auto line = [&](std::size_t& pos) {
    const auto nl = v.find('\n', pos);
    const auto l = v.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    pos = nl == std::string_view::npos ? v.size() + 1 : nl + 1;
    return l;
  };
  const auto all = [](std::string_view s, bool (*pred)(char)) {
    for (const char c : s)
      if (!pred(c)) return false;
    return true;
  };
  const auto lower = [](char c) { return c >= 'a' && c <= 'z'; };
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  // A number of at most `max_digits` digits (and a '-' if `sign`), or nullopt.
  const auto number = [&](std::string_view s, std::size_t max_digits, bool sign) -> std::optional<std::int64_t> {
    const auto digits = sign && s.starts_with('-') ? s.substr(1) : s;
    if (digits.empty() || digits.size() > max_digits || !all(digits, digit)) return std::nullopt;
    std::int64_t n = 0;
    (void)std::from_chars(s.data(), s.data() + s.size(), n);
    return n;
  };
  head h;
  std::size_t pos = magic.size();
  const auto l2 = line(pos);
  if (l2.starts_with("state ") && l2.size() > 6 && l2.size() <= 26 && all(l2.substr(6), lower)) {
    h.state_word = l2.substr(6);
    if (h.state_word == "offered") h.state = claim_state::offered;
    else if (h.state_word == "processing") h.state = claim_state::processing;
    else if (h.state_word == "released") h.state = claim_state::released;
    else if (h.state_word == "completed") h.state = claim_state::completed;
    else if (h.state_word == "failed") h.state = claim_state::failed;
  }
  if (pos <= v.size()) {
    const auto l3 = line(pos);
    if (l3.starts_with("attempts "))
      if (const auto a = number(l3.substr(9), 9, false)) h.attempts = static_cast<std::uint32_t>(*a);
  }
  bool have_priority = false, have_not_before = false;
  for (std::size_t p = magic.size(); p <= v.size() && !(have_priority && have_not_before);) {
    const auto l = line(p);
    if (!have_priority && l.starts_with("priority "))
      if (const auto n = number(l.substr(9), 18, true)) {
        h.priority = *n;
        have_priority = true;
      }
    if (!have_not_before && l.starts_with("not_before "))
      if (const auto n = number(l.substr(11), 18, false)) {
        h.not_before_ms = *n;
        have_not_before = true;
      }
  }
  return h;
}

/// Effects: appends the head: "dibs-claim 1\nstate S\nattempts N\n", then
/// "priority P\n" if P is not 0 and "not_before T\n" if T is set. What
/// follows is the caller's (marker_claim's rest of the record).
inline void append_head(std::string& v, claim_state s, std::uint32_t attempts, std::int64_t priority = 0,
                        std::optional<std::int64_t> not_before_ms = std::nullopt) {
  v += magic;
  v += "state ";
  v += to_string(s);
  v += "\nattempts ";
  append_number(v, attempts);
  v += '\n';
  if (priority != 0) {
    v += "priority ";
    append_number(v, priority);
    v += '\n';
  }
  if (not_before_ms) {
    v += "not_before ";
    append_number(v, *not_before_ms);
    v += '\n';
  }
}

/// Returns: the head of a claim taken from the queue, `attempts` counting
/// this one, its priority kept (what a claim_queue_store's take_claimable
/// writes before the rest marker_claim gives it).
inline std::string taken_head(std::uint64_t attempts, std::int64_t priority) {
  std::string v;
  v.reserve(64 + 20);
  append_head(v, claim_state::processing, static_cast<std::uint32_t>(attempts), priority);
  return v;
}

}  // namespace detail::claim_record
}  // namespace dibs
