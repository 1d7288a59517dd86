// dibs/imap/store.hpp: a dibs::shared_store whose records are messages in a
// folder of an IMAP mailbox, for workers that share nothing but a mail
// server (Dovecot, or any server with UIDPLUS and QRESYNC).
//
//   dibs::imap_store store{dibs::imap::options::from_env()};   // folder "dibs"
//   dibs::marker_claim<dibs::imap_store> claims{store};
//
// CMake target dibs::imap (the core's dependencies only; dibs/imap.hpp is
// the client).
//
// The protocol (docs/stores.md says why it is correct):
//   - every write is a new message APPENDed to the folder: "create",
//     "replace <base>" or "erase <base>", with the key and the new value.
//     The server gives each message of a folder a UID larger than every UID
//     before it (RFC 3501 2.3.1.1) and says which (APPENDUID, RFC 4315);
//   - a key's state is what its messages say when replayed in UID order: a
//     create counts if the key is absent at that point, a replace or erase
//     if the version it names is current then. Every other message is a lost
//     race and changes nothing. Every reader replays the same messages in
//     the same order, so every reader sees the same winner: the APPEND order
//     is the order of the writes;
//   - a write's version is its message's UID, with the folder's UIDVALIDITY
//     above it: versions grow with every change, also across erase and
//     re-create, and never repeat;
//   - the writer learns whether its write counted by reading the key's
//     messages up to its own after the APPEND has completed: by then its
//     session sees every message with a smaller UID (they were committed
//     before it);
//   - each store keeps a mirror of the folder's records, brought up to date
//     with every operation by one "UID FETCH <last seen + 1>:*" (what others
//     appended since) and the server's reports of what others expunged
//     (QRESYNC's VANISHED, RFC 7162) and marked: a read is one round trip
//     that carries only what is new, and a write is the APPEND and that
//     read, whatever the size of the folder;
//   - old messages are removed without changing what any replay says: a
//     writer whose write counted APPENDs a base record, "base <UID>
//     present|absent" with the key and value, a fact about the key after
//     that UID; only after the server has committed it are the messages at
//     or below that UID expunged, and only those older than compact_grace,
//     so a writer still waiting to learn whether its write counted finds
//     its message (one that does not says errc::outcome_unknown, and the
//     policies read back). A replay starts from the latest such fact. It is
//     a message's own content, which nobody changes: no keyword a person
//     can clear in a mail client decides anything (stores before base
//     records marked the start with the keyword $DibsBase, which is still
//     read in folders compacted so). A lost race's message is expunged by
//     its writer (it never changed anything).
// A read goes on until the server reports nothing new came meanwhile, so
// the mirror is the folder as it was at one moment (Dovecot runs a FETCH
// on the session's view as of the previous command); a writer decides only
// from such a view, or says errc::outcome_unknown. A write made again
// after an unknown outcome carries the first try's nonce, and only the
// first message of a nonce counts, so a first try that lands late is
// recognised as the writer's own.
// Nothing here relies on CONDSTORE's conditional STORE, on flags as locks,
// or on MOVE: on Dovecot those let two racing clients both succeed.
//
// Messages in the folder without the X-Dibs-Record header (a person filed a
// mail there) are never read, changed or removed. The folder is created if
// absent; one that is read-only for the user is refused when the store is
// opened.
//
// The server must have UIDPLUS (RFC 4315) and QRESYNC (RFC 7162);
// Dovecot has both (dibs is tested against Dovecot 2.3).
//
// Failures: the server unreachable, restarting, or the connection lost:
// transient (the next operation reconnects); a NO [SERVERBUG] within 30 s
// of connecting again after a lost connection (Dovecot repairing what a
// crash left behind): transient, and EIO (not transient) at other times; a write whose reply was lost:
// errc::outcome_unknown (the policies read back); a refused login: not
// transient, naming user and server; the folder deleted and re-created
// under the store (a new UIDVALIDITY): ESTALE (generic_category; on
// Windows, whose C library has no ESTALE, WSAESTALE in system_category:
// imap_store::stale_folder() is the code on either), not transient: every
// record in it is gone. Thread-safe (one connection, used
// by one thread at a time); open a new store in a child after fork().
#pragma once


#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include <dibs/error.hpp>
#include <dibs/imap/client.hpp>
#include <dibs/store.hpp>

namespace dibs {

namespace imap::detail {

inline std::string base64(std::string_view in) {
  static constexpr char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (std::size_t i = 0; i < in.size(); i += 3) {
    std::uint32_t n = static_cast<std::uint32_t>(static_cast<unsigned char>(in[i])) << 16;
    if (i + 1 < in.size()) n |= static_cast<std::uint32_t>(static_cast<unsigned char>(in[i + 1])) << 8;
    if (i + 2 < in.size()) n |= static_cast<unsigned char>(in[i + 2]);
    out += abc[(n >> 18) & 63];
    out += abc[(n >> 12) & 63];
    out += i + 1 < in.size() ? abc[(n >> 6) & 63] : '=';
    out += i + 2 < in.size() ? abc[n & 63] : '=';
  }
  return out;
}

// Returns: the bytes of `in` (whitespace skipped), or nullopt if it is not base64.
inline std::optional<std::string> unbase64(std::string_view in) {
  std::string out;
  std::uint32_t n = 0;
  int bits = 0;
  for (const char c : in) {
    int v;
    if (c >= 'A' && c <= 'Z') v = c - 'A';
    else if (c >= 'a' && c <= 'z') v = c - 'a' + 26;
    else if (c >= '0' && c <= '9') v = c - '0' + 52;
    else if (c == '+') v = 62;
    else if (c == '/') v = 63;
    else if (c == '=' || c == '\r' || c == '\n' || c == ' ') continue;
    else return std::nullopt;
    n = (n << 6) | static_cast<std::uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((n >> bits) & 0xff);
    }
  }
  return out;
}

// The key's search tag: "k" and 16 hex digits of a 64-bit FNV-1a hash and a
// ".": no hex digit is a "k" or ".", so a substring search finds exactly the
// messages of keys with this hash (a collision only costs a message read
// and dropped: the key itself is in the body).
inline std::string key_tag(std::string_view key) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : key) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return fmt::format("k{:016x}.", h);
}

// Calls f(first, last) for each range of an IMAP sequence set of UIDs
// ("3:5,9": 3..5, then 9..9). The set has been checked by the client (a
// malformed reply never gets here); a part that does not read as numbers is
// skipped. Ranges are not expanded: "1:4294967295" is one call.
template <class F>
void for_each_uid_range(std::string_view s, F&& f) {
  const auto number = [](std::string_view t, std::uint32_t& out) {
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
    return ec == std::errc{} && end == t.data() + t.size();
  };
  while (!s.empty()) {
    const auto comma = s.find(',');
    const auto part = s.substr(0, comma);
    const auto colon = part.find(':');
    std::uint32_t a = 0, b = 0;
    if (number(part.substr(0, colon), a) && (colon == std::string_view::npos ? (b = a, true) : number(part.substr(colon + 1), b)))
      f(std::min(a, b), std::max(a, b));
    s = comma == std::string_view::npos ? std::string_view{} : s.substr(comma + 1);
  }
}

// Returns: an INTERNALDATE ("03-Dec-2026 19:30:00 +0000") as seconds since
// the epoch, or 0 if it cannot be read.
inline std::int64_t parse_date(std::string_view d) {
  static constexpr std::string_view months = "JanFebMarAprMayJunJulAugSepOctNovDec";
  while (d.starts_with(' ')) d.remove_prefix(1);
  int day = 0, year = 0, h = 0, mi = 0, sec = 0, zone = 0;
  char mon[4] = {}, sign = '+';
  if (std::sscanf(std::string(d).c_str(), "%d-%3s-%d %d:%d:%d %c%d", &day, mon, &year, &h, &mi, &sec, &sign, &zone) != 8)
    return 0;
  const auto at = months.find(std::string_view(mon, 3));
  if (at == std::string_view::npos) return 0;
  std::tm t{};
  t.tm_mday = day;
  t.tm_mon = static_cast<int>(at / 3);
  t.tm_year = year - 1900;
  t.tm_hour = h;
  t.tm_min = mi;
  t.tm_sec = sec;
  const std::int64_t offset = (zone / 100 * 3600 + zone % 100 * 60) * (sign == '-' ? -1 : 1);
#ifdef _WIN32
  return static_cast<std::int64_t>(::_mkgmtime(&t)) - offset;
#else
  return static_cast<std::int64_t>(::timegm(&t)) - offset;
#endif
}

// Tells a server's internal error while it recovers from a crash from one
// that lasts. Killed in the middle of an APPEND, Dovecot leaves the
// message's file without its index entry (sdbox); after the restart it
// answers the next APPEND there NO [SERVERBUG] and rebuilds the index, and
// the next one succeeds. The same reply also means a folder it cannot
// write, for good. So a SERVERBUG within `span` of connecting again after
// a lost connection is transient, and any other is not.
class server_recovery {
public:
  static constexpr std::chrono::seconds span{30};

  /// Effects: notes that the connection was lost (the server may have crashed).
  void lost() noexcept { lost_ = true; }
  /// Effects: notes that the session is connected again, if it was lost.
  void reconnected() noexcept {
    if (!lost_) return;
    lost_ = false;
    since_ = std::chrono::steady_clock::now();
  }
  /// Returns: true from a lost connection until `span` after connecting again.
  bool recovering() const noexcept {
    return lost_ || (since_ && std::chrono::steady_clock::now() - *since_ < span);
  }
  /// Throws: as s.check(r, what); but for a NO [SERVERBUG] while
  /// recovering(), errc::connection_lost (transient). The connection is
  /// left open (closing it would count as losing it again): the caller
  /// selects its folder again before the next command.
  void check(const session& s, const reply& r, std::string_view what) const {
    if (r.ok() || !recovering() || !iequals(std::string_view(r.code).substr(0, r.code.find(' ')), "SERVERBUG")) {
      s.check(r, what);
      return;
    }
    throw std::system_error(make_error_code(errc::connection_lost),
                            fmt::format("dibs::imap: {} on {}: the server said {} [{}] {} soon after its connection "
                                        "was lost and made again (a server repairing what a crash left behind): "
                                        "try again",
                                        what, s.where(), r.status, r.code, r.text));
  }

private:
  bool lost_ = false;
  std::optional<std::chrono::steady_clock::time_point> since_;
};

inline std::string uid_set(const std::vector<std::uint32_t>& uids) {
  std::string s;
  // (Not s += "," + std::to_string(u): GCC 12 at -O3 warns, wrongly, in
  // every program that includes this header.)
  for (const auto u : uids) fmt::format_to(std::back_inserter(s), "{}{}", s.empty() ? "" : ",", u);
  return s;
}

// The code of a folder deleted and re-created under an open store (a new
// UIDVALIDITY): ESTALE; Windows's C library has none, so there Winsock's
// WSAESTALE ("stale handle"), the same meaning. Neither is transient.
inline std::error_code stale_folder() noexcept {
#ifdef _WIN32
  return {WSAESTALE, std::system_category()};
#else
  return {ESTALE, std::generic_category()};
#endif
}

}  // namespace imap::detail

/// What an imap_store is called, where it keeps its records, and how it
/// tidies them.
struct imap_store_options {
  /// The folder dibs owns (created if absent). Give each application its own.
  std::string folder = "dibs";
  /// A key's messages are compacted (all but the current one expunged) once
  /// it has this many older than compact_grace.
  int compact_after = 4;
  /// How old (by the server's clock) a message must be before compaction
  /// may remove it: longer than a writer takes to learn whether its write
  /// counted (a writer whose message is removed before that learns
  /// errc::outcome_unknown instead; nothing is wrong, but it costs a read).
  std::chrono::seconds compact_grace{60};
};

class imap_store {
public:
  /// The keyword with which stores before base records marked the message
  /// a key's replay starts from. It is still read in folders compacted
  /// that way, and never set: a keyword is a flag any mail client can
  /// clear, so the replay's start is a record of its own (see compaction).
  static constexpr std::string_view base_keyword = "$DibsBase";

  /// Returns: the code thrown when the folder was deleted and re-created
  /// under this store (a new UIDVALIDITY): ESTALE in generic_category, or
  /// on Windows (no ESTALE there) WSAESTALE in system_category.
  static std::error_code stale_folder() noexcept { return imap::detail::stale_folder(); }

  /// Connects, logs in, creates the folder if absent, selects it and reads
  /// the records in it. Throws: std::system_error naming server, user and
  /// folder if any of that fails (a wrong password, the folder read-only,
  /// a server without UIDPLUS or QRESYNC).
  explicit imap_store(imap::options server, imap_store_options o = {})
      : opts_(std::move(o)), session_(std::move(server)) {
    if (opts_.folder.empty())
      throw std::system_error(make_error_code(errc::invalid_argument),
                              "dibs::imap_store: the folder name is empty; name the folder dibs keeps its records in");
    std::lock_guard lock{mutex_};
    ready();
  }

  /// Sends the tidying owed by the last writes (best effort).
  ~imap_store() {
    try {
      std::lock_guard lock{mutex_};
      if (!owed_.empty() && session_.connected()) run({}, true);
    } catch (...) {
    }
  }
  imap_store(const imap_store&) = delete;
  imap_store& operator=(const imap_store&) = delete;

  const std::string& folder() const noexcept { return opts_.folder; }
  /// Returns: "user@host:port folder 'name'", for messages.
  std::string where() const { return fmt::format("{} folder '{}'", session_.where(), opts_.folder); }
  std::uint32_t uid_validity() const noexcept { return uid_validity_; }

  std::optional<record> read(std::string_view key) {
    validate_key(key, "dibs::imap_store::read");
    std::lock_guard lock{mutex_};
    sync({});
    const auto s = state_of(key, std::numeric_limits<std::uint32_t>::max());
    if (!s.present) return std::nullopt;
    return record{s.value, version_of(s.uid)};
  }

  std::optional<dibs::version> create(std::string_view key, std::string_view value) {
    validate_key(key, "dibs::imap_store::create");
    validate_value(key, value);
    return write(key, op::create, 0, value);
  }

  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value) {
    validate_key(key, "dibs::imap_store::replace");
    validate_value(key, value);
    return write(key, op::replace, expected, value);
  }

  bool erase(std::string_view key, dibs::version expected) {
    validate_key(key, "dibs::imap_store::erase");
    return write(key, op::erase, expected, {}).has_value();
  }

  /// Returns: the keys that hold a record and start with `prefix`.
  std::vector<std::string> keys(std::string_view prefix = {}) {
    std::lock_guard lock{mutex_};
    sync({});
    std::vector<std::string> out;
    for (const auto& [k, uids] : by_key_) {
      if (!std::string_view(k).starts_with(prefix)) continue;
      try {
        if (state_of(k, std::numeric_limits<std::uint32_t>::max()).present) out.push_back(k);
      } catch (const std::system_error& e) {
        if (e.code() != make_error_code(errc::corrupt_record)) throw;
        out.push_back(k);  // a damaged record is listed: reading it says what is wrong
      }
    }
    return out;
  }

  /// Returns: every record whose key starts with `prefix`, with its
  /// version, as of one look at the folder (one round trip).
  std::vector<std::pair<std::string, record>> records(std::string_view prefix = {}) {
    std::lock_guard lock{mutex_};
    sync({});
    std::vector<std::pair<std::string, record>> out;
    for (const auto& [k, uids] : by_key_) {
      if (!std::string_view(k).starts_with(prefix)) continue;
      try {
        const auto s = state_of(k, std::numeric_limits<std::uint32_t>::max());
        if (s.present) out.emplace_back(k, record{s.value, version_of(s.uid)});
      } catch (const std::system_error& e) {
        if (e.code() != make_error_code(errc::corrupt_record)) throw;  // left out: keys() lists it
      }
    }
    return out;
  }

  /// Returns: the key's record as of this store's last look at the folder,
  /// without a round trip, or nothing if it had none then (or it is
  /// damaged). It may be out of date (others may have written since): a
  /// hint for what to try first, never a decision.
  std::optional<record> read_cached(std::string_view key) {
    std::lock_guard lock{mutex_};
    try {
      const auto s = state_of(key, std::numeric_limits<std::uint32_t>::max());
      if (!s.present) return std::nullopt;
      return record{s.value, version_of(s.uid)};
    } catch (const std::system_error&) {
      return std::nullopt;
    }
  }

  /// The store's session (for tests that break the connection).
  imap::session& session() noexcept { return session_; }

private:
  // base: not a write but a fact written by compaction, "after the
  // message UID <base>, the key was <present?, value>".
  enum class op { create, replace, erase, base };

  struct message {
    imap_store::op op = op::create;
    std::uint32_t base = 0;    // the UID a replace or erase names; for a base record, the UID it speaks of
    bool present = false;      // a base record's: the key held a value after `base`
    bool is_base = false;      // carries $DibsBase (set by stores before base records)
    std::int64_t arrived = 0;  // INTERNALDATE, seconds since the epoch by the server's clock
    std::string nonce;         // the write's: the same in a repeat of a write whose outcome was unknown
    std::string key;
    std::string value;
  };

  struct state {
    bool present = false;
    std::uint32_t uid = 0;  // the message that made it (0: none seen)
    std::string value;
  };

  dibs::version version_of(std::uint32_t uid) const noexcept {
    return (static_cast<dibs::version>(uid_validity_) << 32) | uid;
  }

  static constexpr std::string_view fetch_items =
      "(UID FLAGS INTERNALDATE BODY.PEEK[HEADER.FIELDS (X-Dibs-Record)] BODY.PEEK[TEXT])";

  // Logs in if needed, selects the folder with QRESYNC (RFC 7162: expunges
  // are then reported by UID, as VANISHED, and flag changes with their
  // UID), and reads every record in it into the mirror.
  void ready() {
    if (session_.connected() && selected_) return;
    try {
      select_folder();
    } catch (const std::system_error&) {
      if (!session_.connected()) recovery_.lost();
      throw;
    }
    recovery_.reconnected();
    sync({});
  }

  void select_folder() {
    selected_ = false;
    mirror_.clear();
    by_key_.clear();
    damaged_.clear();
    owed_.clear();
    max_uid_ = 0;
    if (!session_.connected()) session_.run("NOOP");  // connects and logs in
    for (const auto& [cap, why] : {std::pair{"UIDPLUS", "to learn the UID of each record it appends"},
                                   std::pair{"QRESYNC", "to learn which records other clients removed"}})
      if (!session_.has(cap))
        throw std::system_error(std::make_error_code(std::errc::not_supported),
                                fmt::format("dibs::imap_store: the server of {} lacks {}, which dibs needs {}",
                                            where(), cap, why));
    check(session_.run("ENABLE QRESYNC"), "enabling QRESYNC");
    // SELECT first, CREATE only if the folder is missing: a CREATE takes
    // the server's lock of the folder list, which a server killed during
    // one leaves behind (Dovecot then makes every CREATE wait 60 s for it,
    // and every store reconnecting after the crash with it).
    auto r = session_.run(fmt::format("SELECT {}", imap::quote(opts_.folder)));
    const std::string_view refused = std::string_view(r.code).substr(0, r.code.find(' '));
    // Dovecot 2.3 says "NO Mailbox doesn't exist: X", without [NONEXISTENT].
    if (!r.ok() && r.status == "NO" &&
        (imap::detail::iequals(refused, "NONEXISTENT") || imap::detail::iequals(refused, "TRYCREATE") ||
         (refused.empty() && r.text.find("exist") != std::string::npos))) {
      const auto created = session_.run(fmt::format("CREATE {}", imap::quote(opts_.folder)));
      if (!created.ok() && !imap::detail::iequals(created.code, "ALREADYEXISTS"))
        check(created, fmt::format("creating the folder '{}' for dibs's records", opts_.folder));
      r = session_.run(fmt::format("SELECT {}", imap::quote(opts_.folder)));
    }
    check(r, fmt::format("selecting dibs's folder '{}'", opts_.folder));
    if (imap::detail::istarts_with(r.code, "READ-ONLY"))
      throw std::system_error(std::make_error_code(std::errc::permission_denied),
                              fmt::format("dibs::imap_store: {} is read-only for this user; dibs needs to add and "
                                          "remove messages there (give the user the rights, or name another folder)",
                                          where()));
    std::uint32_t validity = 0;
    for (const auto& u : r.untagged) {
      if (const auto at = u.find("[UIDVALIDITY "); at != std::string::npos)
        validity = static_cast<std::uint32_t>(std::stoul(u.substr(at + 13)));
    }
    if (uid_validity_ != 0 && validity != uid_validity_) {
      session_.drop();
      throw std::system_error(imap::detail::stale_folder(),
                              fmt::format("dibs::imap_store: {} was deleted and re-created (UIDVALIDITY {} -> {}): "
                                          "every record in it is gone, and claims held in it are void; open a new "
                                          "store to start over",
                                          where(), uid_validity_, validity));
    }
    uid_validity_ = validity;
    selected_ = true;
  }

  // As session::check, with a server's internal error right after a
  // reconnect transient (server_recovery); the folder is selected again
  // before the next command after any refusal.
  void check(const imap::reply& r, std::string_view what) {
    if (!r.ok()) selected_ = false;
    recovery_.check(session_, r, what);
  }

  // Runs commands on the selected folder; expunges owed by earlier writes go
  // first. A failure after sending writes is errc::outcome_unknown.
  std::vector<imap::reply> run(std::vector<std::string> commands, bool writes) {
    ready();
    const auto owed = owed_.size();
    commands.insert(commands.begin(), owed_.begin(), owed_.end());
    try {
      auto replies = writes || owed ? session_.run_write(commands) : session_.run(commands);
      owed_.clear();
      absorb(replies);
      replies.erase(replies.begin(), replies.begin() + static_cast<std::ptrdiff_t>(owed));
      return replies;
    } catch (const std::system_error& e) {
      if (!session_.connected()) {
        selected_ = false;
        recovery_.lost();
      }
      if (!writes && detail::outcome_unknown(e))  // only the tidying was in doubt: harmless either way
        throw std::system_error(make_error_code(errc::connection_lost), e.what());
      throw;
    }
  }

  // Brings the mirror up to date: the records appended since the last look,
  // and what other clients expunged or marked meanwhile (reported with any
  // command's reply).
  // Reads until a FETCH's reply says no new message came meanwhile: the
  // mirror is then the folder as it was at one moment (new messages,
  // keywords and expunges, all of them up to then).
  void sync(std::vector<std::string> before) {
    int catch_ups = 0;
    for (int attempt = 0;; ++attempt) {
      hole_ = std::numeric_limits<std::uint32_t>::max();
      before.push_back(fmt::format("UID FETCH {}:* {}", max_uid_ + 1, fetch_items));
      const auto replies = run(std::move(before), false);
      before.clear();
      // Messages expunged while they were fetched: read from the first of
      // them again (what came after it is in the mirror already).
      const bool holes = hole_ != std::numeric_limits<std::uint32_t>::max();
      if (holes) max_uid_ = std::min(max_uid_, hole_ - 1);
      // A FETCH reads the session's view as it was; the server brings the
      // view up to date after the command and says "* N EXISTS" if others
      // appended meanwhile (a NOOP pipelined before it does not help:
      // Dovecot runs them side by side). Then read once more; without it a
      // read would show the folder as it was at the previous command.
      bool grew = false;
      for (const auto& r : replies)
        for (const auto& line : r.untagged) grew = grew || line.ends_with(" EXISTS");
      if (replies.back().ok() && !holes) {
        if (!grew) return;
        if (++catch_ups > 100)
          throw std::system_error(make_error_code(errc::contended),
                                  fmt::format("dibs::imap_store: {} was written to by others without a pause through "
                                              "100 reads: no whole view of it could be read",
                                              where()));
        --attempt;  // not a failure: others are writing
        continue;
      }
      if (attempt == 5) {
        check(replies.back(), fmt::format("reading records in {}", where()));
        throw std::system_error(make_error_code(errc::connection_lost),
                                fmt::format("dibs::imap_store: message UID {} in {} could not be read (it neither "
                                            "came whole nor vanished)",
                                            hole_, where()));
      }
      before.push_back("NOOP");  // brings the VANISHED of what was expunged
    }
  }

  // Takes in what the server said: new records, flags, expunges.
  void absorb(const std::vector<imap::reply>& replies) {
    for (const auto& r : replies)
      for (const auto& line : r.untagged) {
        if (imap::detail::istarts_with(line, "VANISHED")) {
          auto set = std::string_view(line).substr(8);
          while (set.starts_with(' ')) set.remove_prefix(1);
          if (imap::detail::istarts_with(set, "(EARLIER)")) set.remove_prefix(9);
          while (set.starts_with(' ')) set.remove_prefix(1);
          imap::detail::for_each_uid_range(set, [&](std::uint32_t a, std::uint32_t b) { forget(a, b); });
          continue;
        }
        const auto v = imap::parse(line);
        if (v.size() < 3 || !v[1].is("FETCH") || v[2].kind != imap::value::kind::list) continue;
        take(v[2].items);
      }
  }

  // Forgets the messages with UIDs first..last (those it knows: a range of
  // the server's can be as wide as 1:4294967295).
  void forget(std::uint32_t first, std::uint32_t last) {
    std::vector<std::uint32_t> known;
    for (auto it = mirror_.lower_bound(first); it != mirror_.end() && it->first <= last; ++it) known.push_back(it->first);
    for (auto it = damaged_.lower_bound(first); it != damaged_.end() && it->first <= last; ++it) known.push_back(it->first);
    for (const auto uid : known) forget(uid);
  }
  void forget(std::uint32_t uid) {
    const auto it = mirror_.find(uid);
    if (it == mirror_.end()) {
      damaged_.erase(uid);
      return;
    }
    auto& uids = by_key_[it->second.key];
    std::erase(uids, uid);
    if (uids.empty()) by_key_.erase(it->second.key);
    mirror_.erase(it);
  }

  void take(const std::vector<imap::value>& items) {
    std::uint32_t uid = 0;
    std::optional<bool> is_base;
    std::int64_t arrived = 0;
    std::optional<std::string> header, text;
    for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
      const auto& name = items[i];
      const auto& val = items[i + 1];
      if (name.is("UID")) uid = static_cast<std::uint32_t>(val.number().value_or(0));
      else if (name.is("INTERNALDATE")) arrived = imap::detail::parse_date(val.text);
      else if (name.is("FLAGS")) {
        is_base = false;
        for (const auto& f : val.items) *is_base = *is_base || f.is(base_keyword);
      } else if (imap::detail::istarts_with(name.text, "BODY[HEADER")) header = val.text;
      else if (imap::detail::istarts_with(name.text, "BODY[TEXT")) text = val.text;
    }
    if (uid == 0) return;
    if (!text) {  // a change of flags
      if (const auto it = mirror_.find(uid); it != mirror_.end() && is_base) it->second.is_base = *is_base;
      else if (uid > max_uid_ && !damaged_.count(uid)) hole_ = std::min(hole_, uid);  // not read yet: read it
      return;
    }
    if (mirror_.count(uid) || damaged_.count(uid)) return;
    if ((!header || header->empty()) && text->empty()) {
      // Expunged by another client while this FETCH ran (Dovecot sends it
      // empty): read from it again next time; its VANISHED will come.
      hole_ = std::min(hole_, uid);
      return;
    }
    max_uid_ = std::max(max_uid_, uid);
    if (!header || header->find(':') == std::string::npos) return;  // not a record: a person's mail; left alone
    message m;
    m.is_base = is_base.value_or(false);
    m.arrived = arrived;
    // X-Dibs-Record: 1 k<hash>. create | replace <base> | erase <base>
    const auto fields = imap::parse(header->substr(header->find(':') + 1));
    const std::string tag = fields.size() >= 2 ? fields[1].text : std::string{};
    auto damaged = [&](std::string_view why) { damaged_[uid] = {tag, std::string(why)}; };
    if (fields.size() < 3 || !fields[0].is("1")) return damaged("an X-Dibs-Record header dibs cannot read");
    if (fields[2].is("create")) m.op = op::create;
    else if (fields[2].is("replace")) m.op = op::replace;
    else if (fields[2].is("erase")) m.op = op::erase;
    else if (fields[2].is("base")) m.op = op::base;
    else return damaged("an unknown operation in its X-Dibs-Record header");
    std::size_t next = 3;
    if (m.op != op::create) {
      if (fields.size() < 4 || !fields[3].number() || *fields[3].number() == 0 ||
          *fields[3].number() > std::numeric_limits<std::uint32_t>::max())
        return damaged("no base UID in its X-Dibs-Record header");
      m.base = static_cast<std::uint32_t>(*fields[3].number());
      next = 4;
    }
    if (m.op == op::base) {  // "base <uid> present|absent"
      if (fields.size() < 5 || !(fields[4].is("present") || fields[4].is("absent")))
        return damaged("a base record that says neither present nor absent");
      m.present = fields[4].is("present");
      next = 5;
    }
    if (fields.size() > next && fields[next].text.starts_with('n')) m.nonce = fields[next].text;
    // Body: "key <base64>\r\nvalue\r\n<base64 lines>"
    const auto nl = text->find("\r\n");
    if (!text->starts_with("key ") || nl == std::string::npos) return damaged("a body that is not a dibs record");
    auto key = imap::detail::unbase64(std::string_view(*text).substr(4, nl - 4));
    const auto rest = std::string_view(*text).substr(nl + 2);
    if (!key || !rest.starts_with("value\r\n") || imap::detail::key_tag(*key) != tag)
      return damaged("a body that is not a dibs record of its key");
    auto value = imap::detail::unbase64(rest.substr(7));
    if (!value) return damaged("a value that is not base64");
    m.key = std::move(*key);
    m.value = std::move(*value);
    by_key_[m.key].push_back(uid);
    std::sort(by_key_[m.key].begin(), by_key_[m.key].end());
    mirror_.emplace(uid, std::move(m));
  }

  // The key's state after its messages up to and including UID `upto`:
  // replayed from the latest fact about it at or below `upto` (a base
  // record naming that UID, or a message marked $DibsBase by an older
  // store), or from nothing.
  state state_of(std::string_view key, std::uint32_t upto) const {
    const auto tag = imap::detail::key_tag(key);
    for (const auto& [uid, bad] : damaged_)
      if (bad.first == tag && uid <= upto)
        throw std::system_error(make_error_code(errc::corrupt_record),
                                fmt::format("dibs::imap_store: message UID {} in {} says it is a record of key '{}' "
                                            "but has {}; it was not written by dibs (or was changed): move it out of "
                                            "the folder",
                                            uid, where(), detail::show_key(key), bad.second));
    state s;
    const auto it = by_key_.find(std::string(key));
    if (it == by_key_.end()) return s;
    // A base record is a fact about the UID it names, true wherever it
    // sits: compaction writes it after deciding from a whole view, and
    // removes only messages at or below that UID, so every message above
    // it is still there to replay.
    std::uint32_t from = 0;
    for (const auto uid : it->second) {
      const auto& m = mirror_.at(uid);
      if (m.op == op::base && m.base <= upto && m.base > from) {
        from = m.base;
        s = {m.present, m.base, m.value};
      } else if (m.op != op::base && m.is_base && uid <= upto && uid > from) {
        from = uid;
        s = {m.op != op::erase, uid, m.value};
      }
    }
    std::set<std::string_view> nonces;  // a write repeated after an unknown outcome counts once
    for (const auto uid : it->second) {
      if (uid > upto) break;
      const auto& m = mirror_.at(uid);
      if (m.op == op::base) continue;
      const bool repeat = !m.nonce.empty() && !nonces.insert(m.nonce).second;
      if (uid <= from || repeat) continue;
      if (m.op == op::create ? s.present : !s.present || s.uid != m.base) continue;  // a lost race
      s = {m.op != op::erase, uid, m.value};
    }
    return s;
  }

  // `tail`: the write's nonce; for a base record, "present" or "absent".
  std::string message_text(std::string_view key, op o, std::uint32_t base, std::string_view value,
                           const std::string& tail) {
    std::string shown;
    for (const char c : detail::show_key(key).substr(0, 60)) shown += (c >= 0x20 && c < 0x7f) ? c : '?';
    const auto name = o == op::create ? "create" : o == op::replace ? "replace" : o == op::erase ? "erase" : "base";
    std::string text = fmt::format(
        "From: dibs <dibs@dibs.invalid>\r\nSubject: dibs {} {}\r\nMessage-ID: <{:016x}{:016x}@dibs.invalid>\r\n"
        "X-Dibs-Record: 1 {} {}{}{} {}\r\nMIME-Version: 1.0\r\nContent-Type: text/plain; charset=us-ascii\r\n\r\n"
        "key {}\r\nvalue\r\n",
        name, shown, rng_(), rng_(), imap::detail::key_tag(key), name, o == op::create ? "" : " ",
        o == op::create ? std::string{} : std::to_string(base), tail, imap::detail::base64(key));
    const auto b64 = imap::detail::base64(value);
    for (std::size_t i = 0; i < b64.size(); i += 76) text.append(b64, i, 76).append("\r\n");
    return text;
  }


  // Removes `uids` with the next command: UID EXPUNGE (UIDPLUS) removes
  // only messages marked \Deleted, and only those of the set.
  void owe_expunge(const std::vector<std::uint32_t>& uids) {
    const auto set = imap::detail::uid_set(uids);
    owed_.push_back(fmt::format("UID STORE {} +FLAGS.SILENT (\\Deleted)", set));
    owed_.push_back(fmt::format("UID EXPUNGE {}", set));
  }

  std::optional<dibs::version> write(std::string_view key, op o, dibs::version expected, std::string_view value) {
    std::lock_guard lock{mutex_};
    ready();
    std::uint32_t base = 0;
    if (o != op::create) {
      // A version of another incarnation of the folder, or none at all, is
      // never current: a lost race, without writing anything.
      if ((expected >> 32) != uid_validity_ || (expected & 0xffffffffu) == 0) return std::nullopt;
      base = static_cast<std::uint32_t>(expected & 0xffffffffu);
    }
    // The same write again after its outcome was unknown (the policies
    // repeat it when the read-back says it was not applied), or after a
    // transient failure (a server's internal error answered to its APPEND
    // is one, right after a restart), carries the same nonce: if the first
    // one still lands, late, only one of them counts.
    const bool again = unknown_ && unknown_->key == key && unknown_->o == o && unknown_->base == base &&
                       unknown_->value == value;
    const std::string nonce = again ? unknown_->nonce : fmt::format("n{:016x}", rng_());
    unknown_.reset();
    try {
      return write_once(key, o, base, value, nonce);
    } catch (const std::system_error& e) {
      if (detail::outcome_unknown(e) || is_transient(e.code())) unknown_ = unknown_write{std::string(key), o, base, std::string(value), nonce};
      throw;
    }
  }

  std::optional<dibs::version> write_once(std::string_view key, op o, std::uint32_t base, std::string_view value,
                                          const std::string& nonce) {
    const auto text = message_text(key, o, base, value, nonce);
    // The APPEND alone: a server may run commands pipelined behind it
    // before it has committed (Dovecot does). When it has, this session
    // sees every record with a smaller UID (they were committed before).
    const auto appended = run({fmt::format("APPEND {} (\\Seen) {{{}+}}\r\n{}", imap::quote(opts_.folder),
                                           text.size(), text)},
                              true);
    if (!appended.front().ok()) {
      // The folder may have been deleted (and re-created) under this
      // session: Dovecot then refuses the APPEND with [SERVERBUG]. Select
      // it again, which says so (ESTALE), before reporting the refusal.
      selected_ = false;
      ready();
      check(appended.front(),
                      fmt::format("appending a record of key '{}' to {}", detail::show_key(key), where()));
    }
    // APPENDUID <uidvalidity> <uid>
    const auto fields = imap::parse(appended.front().code);
    if (fields.size() < 3 || !fields[0].is("APPENDUID") || !fields[1].number() || !fields[2].number())
      throw std::system_error(std::make_error_code(std::errc::not_supported),
                              fmt::format("dibs::imap_store: the server of {} did not say which UID it gave the "
                                          "record (no APPENDUID): it lacks UIDPLUS",
                                          where()));
    if (static_cast<std::uint32_t>(*fields[1].number()) != uid_validity_) {
      selected_ = false;
      ready();  // throws: the folder was re-created
    }
    const auto uid = static_cast<std::uint32_t>(*fields[2].number());
    // The decision needs a whole view of the folder as of some moment
    // after the APPEND: every message then, with its keywords, and none
    // that was expunged by then. A read that learns of new messages reads
    // again (sync), so what it absorbed is such a view.
    try {
      sync({});
      if (!mirror_.count(uid)) sync({});
    } catch (const std::system_error& e) {
      if (e.code() == imap::detail::stale_folder() ||
          e.code() == make_error_code(errc::corrupt_record))
        throw;
      throw std::system_error(make_error_code(errc::outcome_unknown), e.what());
    }
    const auto& mine = by_key_[std::string(key)];
    // The first message with this write's nonce is the write (an earlier
    // try of it may have landed late); the replay says whether it counted.
    std::uint32_t first = uid;
    for (const auto u : mine)
      if (u < first && mirror_.at(u).nonce == nonce) first = u;
    // A replay from a fact about a later UID no longer shows what came
    // before it (compaction may have removed it).
    const bool above = std::any_of(mine.begin(), mine.end(), [&](std::uint32_t u) {
      const auto& m = mirror_.at(u);
      return m.op == op::base ? m.base > first : u > first && m.is_base;
    });
    if (!mirror_.count(uid) || above)
      throw std::system_error(make_error_code(errc::outcome_unknown),
                              fmt::format("dibs::imap_store: the record of key '{}' (UID {}) in {} was compacted "
                                          "away before its writer saw whether it counted",
                                          detail::show_key(key), uid, where()));
    const bool counts = state_of(key, first).uid == first;
    if (first != uid || !counts) owe_expunge({uid});  // this message changed nothing: tidied with the next command
    if (!counts) return std::nullopt;
    // Compaction: the messages before this one that are old enough (and
    // this one too if the grace is 0) give way to a base record.
    const auto now = mirror_.at(first).arrived;
    std::vector<std::uint32_t> old;
    for (const auto u : mine)
      if (u <= first && mirror_.at(u).arrived + opts_.compact_grace.count() <= now) old.push_back(u);
    const auto before = static_cast<int>(old.size()) - (std::count(old.begin(), old.end(), first) ? 1 : 0);
    if (before > 0 && before + 1 >= opts_.compact_after) compact(key, first, old);
    return version_of(first);
  }

  // Writes the base record "after UID `current`, the key is <its state>"
  // and, once the server has committed it, expunges `old` (messages at or
  // below `current`). The record is a message of its own, never changed
  // after it is written: what a replay from it says depends on no keyword
  // a person can clear (a keyword marked the start before), and the
  // expunge is never seen without it. Best effort: the write it follows
  // has counted whatever happens here, and what is left is compacted next
  // time.
  void compact(std::string_view key, std::uint32_t current, const std::vector<std::uint32_t>& old) {
    const auto s = state_of(key, current);
    const auto text = message_text(key, op::base, current, s.value, s.present ? "present" : "absent");
    try {
      const auto appended = run({fmt::format("APPEND {} (\\Seen) {{{}+}}\r\n{}", imap::quote(opts_.folder),
                                             text.size(), text)},
                                true);
      const auto fields = imap::parse(appended.front().code);
      if (!appended.front().ok() || fields.size() < 3 || !fields[0].is("APPENDUID") || !fields[1].number() ||
          !fields[2].number() || static_cast<std::uint32_t>(*fields[1].number()) != uid_validity_)
        return;
      // In the mirror now, so that it never lacks the fact while it lacks
      // what the expunge removes (the next read fetches it, and skips it).
      const auto uid = static_cast<std::uint32_t>(*fields[2].number());
      if (!mirror_.count(uid)) {
        message m;
        m.op = op::base;
        m.base = current;
        m.present = s.present;
        m.arrived = mirror_.at(current).arrived;
        m.key = std::string(key);
        m.value = s.value;
        auto& uids = by_key_[m.key];
        uids.insert(std::upper_bound(uids.begin(), uids.end(), uid), uid);
        mirror_.emplace(uid, std::move(m));
      }
      owe_expunge(old);
      (void)run({}, true);
    } catch (const std::system_error& e) {
      if (e.code() == imap::detail::stale_folder()) throw;
    }
  }

  struct unknown_write {
    std::string key;
    op o;
    std::uint32_t base;
    std::string value;
    std::string nonce;
  };

  imap_store_options opts_;
  imap::session session_;
  std::mutex mutex_;
  bool selected_ = false;
  std::uint32_t uid_validity_ = 0;
  std::uint32_t max_uid_ = 0;                                       // the highest UID read so far
  std::uint32_t hole_ = 0;                                          // the first UID a FETCH sent empty
  std::map<std::uint32_t, message> mirror_;                         // the records in the folder, by UID
  std::map<std::string, std::vector<std::uint32_t>> by_key_;        // their UIDs by key, ascending
  std::map<std::uint32_t, std::pair<std::string, std::string>> damaged_;  // UID -> key tag, what is wrong
  std::vector<std::string> owed_;
  std::optional<unknown_write> unknown_;  // the last write whose outcome was unknown (or that failed transiently)
  imap::detail::server_recovery recovery_;
  std::mt19937_64 rng_{std::random_device{}()};
};

static_assert(shared_store<imap_store>);
static_assert(listable_store<imap_store>);
static_assert(snapshot_store<imap_store>);

}  // namespace dibs
