// dibs/imap.hpp: a small IMAP4rev1 client (RFC 3501) for dibs's IMAP store
// and mailbox claims: one connection, commands pipelined, replies parsed into
// values. Kept apart from the claim logic (imap_store.hpp) so each can be
// tested on its own.
//
//   dibs::imap::session s{dibs::imap::options::from_env()};
//   s.check(s.run("SELECT INBOX"), "select");
//   for (const auto& line : s.run("UID SEARCH ALL").untagged) ...
//
// Plain TCP (a server on loopback or inside a trusted network); the
// server's LITERAL+ (RFC 7888) is used for APPEND where it has it.
//
// Failures, as std::system_error:
//   - the server cannot be reached, closes the connection, says BYE, or a
//     reply does not come within options::timeout: errc::connection_lost or
//     errc::timed_out (transient), and the session is closed; the next
//     command connects and logs in again by itself. A caller that had sent a
//     write when that happened cannot know whether it was applied
//     (run_write() says errc::outcome_unknown then);
//   - a login refused: std::errc::permission_denied, naming server and user;
//   - a tagged NO or BAD, through check(): the server's response code decides
//     (NONEXISTENT: no_such_file_or_directory, NOPERM/AUTHORIZATIONFAILED:
//     permission_denied, OVERQUOTA: no_space_on_device, UNAVAILABLE/INUSE/
//     LIMIT: transient), and the message names server, user, what was done
//     and the server's own words.
// A session is used by one thread at a time. After fork() the child's copy
// never writes to the parent's connection: it connects anew.
#pragma once

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include <dibs/error.hpp>

namespace dibs::imap {

/// Where the server is and who logs in.
struct options {
  std::string host = "127.0.0.1";
  std::string port = "143";
  std::string user;
  std::string password;
  /// How long a reply may take before the connection is given up.
  std::chrono::milliseconds timeout{30'000};

  /// Returns: options from DIBS_IMAP_HOST, DIBS_IMAP_PORT, DIBS_IMAP_USER
  /// and DIBS_IMAP_PASSWORD (what scripts/imap.sh prints), defaults where unset.
  static options from_env() {
    options o;
    auto get = [](const char* name, std::string& to) {
      if (const char* v = std::getenv(name); v && *v) to = v;
    };
    get("DIBS_IMAP_HOST", o.host);
    get("DIBS_IMAP_PORT", o.port);
    get("DIBS_IMAP_USER", o.user);
    get("DIBS_IMAP_PASSWORD", o.password);
    return o;
  }
};

/// One parsed element of a server response: an atom (also numbers and
/// FETCH item names such as BODY[TEXT]), a string (quoted or literal), a
/// parenthesized list, or NIL.
struct value {
  enum class kind { atom, string, list, nil };
  value::kind kind = kind::atom;
  std::string text;
  std::vector<value> items;

  /// Returns: true if this is the atom `name`, compared without case.
  bool is(std::string_view name) const noexcept {
    if (kind != kind::atom || text.size() != name.size()) return false;
    for (std::size_t i = 0; i < name.size(); ++i)
      if (std::tolower(static_cast<unsigned char>(text[i])) != std::tolower(static_cast<unsigned char>(name[i])))
        return false;
    return true;
  }
  /// Returns: the atom as a number, or nullopt if it is not one.
  std::optional<std::uint64_t> number() const noexcept {
    if (kind != kind::atom || text.empty() || text.size() > 19) return std::nullopt;
    std::uint64_t n = 0;
    for (const char c : text) {
      if (c < '0' || c > '9') return std::nullopt;
      n = n * 10 + static_cast<std::uint64_t>(c - '0');
    }
    return n;
  }
};

namespace detail {

inline bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

inline bool istarts_with(std::string_view s, std::string_view prefix) noexcept {
  return s.size() >= prefix.size() && iequals(s.substr(0, prefix.size()), prefix);
}

// Parses the elements of `s` from `pos` up to the end or a ')' that closes
// an enclosing list.
inline std::vector<value> parse_items(std::string_view s, std::size_t& pos) {
  std::vector<value> out;
  while (pos < s.size()) {
    const char c = s[pos];
    if (c == ' ' || c == '\r' || c == '\n') {
      ++pos;
    } else if (c == ')') {
      return out;
    } else if (c == '(') {
      ++pos;
      value v{value::kind::list, {}, parse_items(s, pos)};
      if (pos < s.size()) ++pos;  // the ')'
      out.push_back(std::move(v));
    } else if (c == '"') {
      std::string text;
      for (++pos; pos < s.size() && s[pos] != '"'; ++pos) {
        if (s[pos] == '\\' && pos + 1 < s.size()) ++pos;
        text += s[pos];
      }
      ++pos;
      out.push_back({value::kind::string, std::move(text), {}});
    } else if (c == '{') {
      const auto close = s.find('}', pos);
      std::size_t n = 0;
      for (auto i = pos + 1; i < close && i < s.size(); ++i)
        if (s[i] >= '0' && s[i] <= '9') n = n * 10 + static_cast<std::size_t>(s[i] - '0');
      pos = close == std::string_view::npos ? s.size() : close + 1;
      if (s.substr(pos, 2) == "\r\n") pos += 2;
      out.push_back({value::kind::string, std::string(s.substr(pos, n)), {}});
      pos = std::min(s.size(), pos + n);
    } else {
      // An atom. A FETCH item's section, '[' ... ']', belongs to it, spaces
      // and parentheses included (BODY[HEADER.FIELDS (SUBJECT)]); in any
      // other atom '[' is a plain character (a keyword a person set may be
      // "todo[1").
      std::string text;
      for (int depth = 0; pos < s.size(); ++pos) {
        const char a = s[pos];
        if (depth == 0 && (a == ' ' || a == '(' || a == ')' || a == '\r' || a == '\n')) break;
        if (a == '[' && (depth > 0 || detail::iequals(text, "BODY") || detail::iequals(text, "BODY.PEEK") ||
                         detail::iequals(text, "BINARY") || detail::iequals(text, "BINARY.PEEK") ||
                         detail::iequals(text, "BINARY.SIZE")))
          ++depth;
        if (a == ']' && depth > 0) --depth;
        text += a;
      }
      if (detail::iequals(text, "NIL")) out.push_back({value::kind::nil, {}, {}});
      else out.push_back({value::kind::atom, std::move(text), {}});
    }
  }
  return out;
}

}  // namespace detail

/// Returns: the elements of one response line (without its "* " or tag).
inline std::vector<value> parse(std::string_view line) {
  std::size_t pos = 0;
  std::vector<value> all;
  while (pos < line.size()) {
    auto part = detail::parse_items(line, pos);
    all.insert(all.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
    if (pos < line.size()) ++pos;  // an unbalanced ')'
  }
  return all;
}

/// Returns: `s` as an IMAP string: quoted if it can be, else a literal.
inline std::string quote(std::string_view s) {
  bool plain = s.size() < 1000;
  for (const char c : s)
    if (c == '\r' || c == '\n' || c == '\0' || static_cast<unsigned char>(c) >= 0x80) plain = false;
  if (!plain) return fmt::format("{{{}+}}\r\n{}", s.size(), s);
  std::string q = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') q += '\\';
    q += c;
  }
  return q + '"';
}

/// The reply to one command: what the server said untagged while running
/// it, and its tagged completion.
struct reply {
  std::vector<std::string> untagged;  ///< each "* ..." line, without "* ", literals inline
  std::string status;                 ///< OK, NO or BAD
  std::string code;                   ///< the response code inside [...], e.g. "APPENDUID 38505 3955"
  std::string text;                   ///< the rest of the tagged line
  bool ok() const noexcept { return status == "OK"; }
};

/// Returns: the untagged lines of every reply of a pipelined batch. A
/// server may run pipelined commands side by side (Dovecot does), so what
/// it says untagged comes while another command is still open: read a
/// batch's FETCH responses here, not from one reply.
inline std::vector<std::string> untagged_of(const std::vector<reply>& replies) {
  std::vector<std::string> all;
  for (const auto& r : replies) all.insert(all.end(), r.untagged.begin(), r.untagged.end());
  return all;
}

/// One connection to an IMAP server, logged in.
class session {
public:
  /// Connects and logs in. Throws: as described at the top of this header.
  explicit session(options o) : opts_(std::move(o)) { connect(); }
  ~session() { close(); }
  session(const session&) = delete;
  session& operator=(const session&) = delete;

  const options& opts() const noexcept { return opts_; }
  /// Returns: "user@host:port", for messages.
  std::string where() const { return fmt::format("{}@{}:{}", opts_.user, opts_.host, opts_.port); }
  /// Returns: true if the server announced `capability` (compared without case).
  bool has(std::string_view capability) const {
    for (const auto& c : caps_)
      if (detail::iequals(c, capability)) return true;
    return false;
  }
  /// Returns: true if the connection is open (a command after a failure
  /// reconnects by itself).
  bool connected() const noexcept { return fd_ >= 0 && pid_ == ::getpid(); }

  /// Sends `commands` (each without tag; literals written "{n+}\r\n..."
  /// through quote()) in one go and returns their replies in order. Throws:
  /// errc::connection_lost or errc::timed_out if the connection fails.
  std::vector<reply> run(const std::vector<std::string>& commands) {
    if (!connected()) connect();
    const bool plus = has("LITERAL+");
    std::vector<std::string> tags;
    std::string out;
    std::vector<reply> replies;
    for (const auto& c : commands) {
      tags.push_back(fmt::format("d{}", ++tag_));
      if (plus || c.find("+}\r\n") == std::string::npos) {
        out += tags.back() + ' ' + c + "\r\n";
        continue;
      }
      // A server without LITERAL+ confirms each literal with "+" first.
      send(out);
      out.clear();
      auto done = collect({tags.begin(), tags.end() - 1});
      replies.insert(replies.end(), done.begin(), done.end());
      tags.erase(tags.begin(), tags.end() - 1);
      std::string part = tags.back() + ' ';
      for (std::size_t pos = 0;;) {
        const auto mark = c.find("+}\r\n", pos);
        if (mark == std::string::npos) break;
        const auto open = c.rfind('{', mark);
        const auto n = static_cast<std::size_t>(std::stoull(c.substr(open + 1, mark - open - 1)));
        send(part + c.substr(pos, mark - pos) + "}\r\n");
        for (const auto until = std::chrono::steady_clock::now() + opts_.timeout;;) {
          const auto line = read_line(until);
          if (line.starts_with("+")) break;
          if (line.starts_with(tags.back() + ' ')) fail(errc::connection_lost, "the server refused a literal: " + line);
        }
        part = c.substr(mark + 4, n);
        pos = mark + 4 + n;
        if (c.find("+}\r\n", pos) == std::string::npos) part += c.substr(pos) + "\r\n";
      }
      out = part;
    }
    send(out);
    auto rest = collect(tags);
    replies.insert(replies.end(), rest.begin(), rest.end());
    return replies;
  }
  reply run(const std::string& command) { return std::move(run(std::vector<std::string>{command}).front()); }

  /// As run(), for commands that change something: if the connection fails
  /// after they were sent, throws errc::outcome_unknown instead (they may
  /// or may not have been applied).
  std::vector<reply> run_write(const std::vector<std::string>& commands) {
    if (!connected()) connect();
    try {
      return run(commands);
    } catch (const std::system_error& e) {
      if (e.code() == make_error_code(errc::connection_lost) || e.code() == make_error_code(errc::timed_out))
        throw std::system_error(make_error_code(errc::outcome_unknown), e.what());
      throw;
    }
  }

  /// Throws: std::system_error for a reply that is not OK, naming the
  /// server, user, `what` was done, and what the server said.
  void check(const reply& r, std::string_view what) const {
    if (r.ok()) return;
    throw std::system_error(code_of(r), fmt::format("dibs::imap: {} on {}: the server said {} {}{}", what, where(),
                                                   r.status, r.code.empty() ? "" : "[" + r.code + "] ", r.text));
  }

  /// Waits in IDLE (RFC 2177) until the server reports a change of the
  /// selected mailbox (EXISTS, EXPUNGE, FETCH) or `wait` passes. Returns:
  /// true if something changed. Without IDLE on the server: waits and
  /// returns true.
  bool idle(std::chrono::milliseconds wait) {
    if (!has("IDLE")) {
      ::poll(nullptr, 0, static_cast<int>(wait.count()));
      return true;
    }
    if (!connected()) connect();
    const auto tag = fmt::format("d{}", ++tag_);
    send(tag + " IDLE\r\n");
    const auto until = std::chrono::steady_clock::now() + opts_.timeout;
    for (;;) {
      const auto line = read_line(until);
      if (line.starts_with("+")) break;
      if (line.starts_with(tag)) return true;  // refused: treat as a change and poll
    }
    bool changed = false;
    const auto end = std::chrono::steady_clock::now() + wait;
    while (!changed) {
      const auto left = end - std::chrono::steady_clock::now();
      if (left <= std::chrono::nanoseconds::zero() || !readable(std::chrono::duration_cast<std::chrono::milliseconds>(left)))
        break;
      const auto line = read_line(std::chrono::steady_clock::now() + opts_.timeout);
      if (detail::istarts_with(line, "* BYE")) fail(errc::connection_lost, "the server said " + line);
      changed = line.find(" EXISTS") != std::string::npos || line.find(" EXPUNGE") != std::string::npos ||
                line.find(" FETCH") != std::string::npos || line.find(" RECENT") != std::string::npos;
    }
    send("DONE\r\n");
    collect({tag});
    return changed;
  }

  /// Closes the connection (logging out politely if it is open).
  void close() noexcept {
    if (fd_ >= 0 && pid_ == ::getpid()) {
      const std::string bye = fmt::format("d{} LOGOUT\r\n", ++tag_);
      (void)::send(fd_, bye.data(), bye.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    drop();
  }

  /// Closes the connection at once, as if it broke (for tests of failures).
  void drop() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    in_.clear();
  }

private:
  [[noreturn]] void fail(errc e, std::string_view why) {
    drop();
    throw std::system_error(make_error_code(e), fmt::format("dibs::imap: {}: {}", where(), why));
  }

  static std::error_code code_of(const reply& r) {
    const std::string_view code = std::string_view(r.code).substr(0, r.code.find(' '));
    if (detail::iequals(code, "NONEXISTENT") || detail::iequals(code, "TRYCREATE"))
      return std::make_error_code(std::errc::no_such_file_or_directory);
    if (detail::iequals(code, "NOPERM") || detail::iequals(code, "AUTHORIZATIONFAILED") ||
        detail::iequals(code, "AUTHENTICATIONFAILED") || detail::iequals(code, "READ-ONLY"))
      return std::make_error_code(std::errc::permission_denied);
    if (detail::iequals(code, "OVERQUOTA")) return std::make_error_code(std::errc::no_space_on_device);
    if (detail::iequals(code, "UNAVAILABLE") || detail::iequals(code, "INUSE") || detail::iequals(code, "LIMIT"))
      return make_error_code(errc::contended);
    if (detail::iequals(code, "ALREADYEXISTS")) return std::make_error_code(std::errc::file_exists);
    // The server failed (Dovecot: a file it cannot write; its log says which).
    if (detail::iequals(code, "SERVERBUG")) return std::make_error_code(std::errc::io_error);
    return make_error_code(errc::invalid_argument);
  }

  void connect() {
    drop();
    pid_ = ::getpid();
    caps_.clear();
    const auto until = std::chrono::steady_clock::now() + opts_.timeout;
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(opts_.host.c_str(), opts_.port.c_str(), &hints, &found); rc != 0)
      throw std::system_error(make_error_code(errc::connection_lost),
                              fmt::format("dibs::imap: cannot find server {}:{}: {}", opts_.host, opts_.port,
                                          ::gai_strerror(rc)));
    int err = 0;
    for (addrinfo* a = found; a && fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) { err = errno; continue; }
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) fd_ = fd;
      else { err = errno; ::close(fd); }
    }
    ::freeaddrinfo(found);
    if (fd_ < 0)
      throw std::system_error(std::error_code(err, std::generic_category()),
                              fmt::format("dibs::imap: cannot connect to {}:{} ({}); is the IMAP server running?",
                                          opts_.host, opts_.port, std::strerror(err)));
    const auto greeting = read_line(until);
    if (!detail::istarts_with(greeting, "* OK") && !detail::istarts_with(greeting, "* PREAUTH"))
      fail(errc::connection_lost, "the server greeted with '" + greeting + "'");
    const auto login = run(fmt::format("LOGIN {} {}", quote(opts_.user), quote(opts_.password)));
    if (!login.ok()) {
      const auto text = login.text;
      drop();
      const bool transient = detail::iequals(login.code, "UNAVAILABLE");
      throw std::system_error(
          transient ? make_error_code(errc::connection_lost) : std::make_error_code(std::errc::permission_denied),
          fmt::format("dibs::imap: {}:{} refused the login of user '{}': {}{}{}", opts_.host, opts_.port, opts_.user,
                      login.code.empty() ? "" : "[" + login.code + "] ", text,
                      transient ? "" : "; check the user name and password"));
    }
    auto caps = login.code;
    if (!detail::istarts_with(caps, "CAPABILITY")) {
      const auto r = run("CAPABILITY");
      for (const auto& u : r.untagged)
        if (detail::istarts_with(u, "CAPABILITY")) caps = u;
    }
    for (const auto& v : parse(caps)) caps_.push_back(v.text);
  }

  void send(const std::string& data) {
    for (std::size_t done = 0; done < data.size();) {
      const auto n = ::send(fd_, data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(errc::connection_lost, fmt::format("sending failed: {}", std::strerror(errno)));
      done += static_cast<std::size_t>(n);
    }
  }

  bool readable(std::chrono::milliseconds wait) {
    if (!in_.empty()) return true;
    pollfd p{fd_, POLLIN, 0};
    int rc;
    while ((rc = ::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(0, wait.count())))) < 0 && errno == EINTR) {
    }
    return rc > 0;
  }

  void fill(std::chrono::steady_clock::time_point until) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0 || !readable(left))
      fail(errc::timed_out, fmt::format("no reply within {} ms", opts_.timeout.count()));
    char buf[65536];
    ssize_t n;
    while ((n = ::recv(fd_, buf, sizeof buf, 0)) < 0 && errno == EINTR) {
    }
    if (n <= 0) fail(errc::connection_lost, n == 0 ? "the server closed the connection" : std::strerror(errno));
    in_.append(buf, static_cast<std::size_t>(n));
  }

  // One logical line: a line, and if it ends in a literal "{n}", its n
  // bytes and the rest of the line after them, and so on.
  std::string read_line(std::chrono::steady_clock::time_point until) {
    std::string line;
    std::size_t scanned = 0;
    for (;;) {
      const auto eol = in_.find("\r\n", scanned);
      if (eol == std::string::npos) {
        scanned = in_.size() > 0 ? in_.size() - 1 : 0;
        fill(until);
        continue;
      }
      std::size_t n = 0;
      bool literal = eol > 0 && in_[eol - 1] == '}';
      if (literal) {
        const auto open = in_.rfind('{', eol);
        literal = open != std::string::npos;
        for (auto i = open + 1; literal && i + 1 < eol; ++i) {
          if (in_[i] < '0' || in_[i] > '9') literal = false;
          else n = n * 10 + static_cast<std::size_t>(in_[i] - '0');
        }
      }
      if (!literal) {
        line += in_.substr(0, eol);
        in_.erase(0, eol + 2);
        return line;
      }
      while (in_.size() < eol + 2 + n) fill(until);
      line += in_.substr(0, eol + 2 + n);
      in_.erase(0, eol + 2 + n);
      scanned = 0;
    }
  }

  std::vector<reply> collect(const std::vector<std::string>& tags) {
    std::vector<reply> replies(tags.size());
    std::vector<bool> done(tags.size());
    const auto until = std::chrono::steady_clock::now() + opts_.timeout;
    // i: the first command not yet completed (untagged lines go to it).
    for (std::size_t i = 0; i < tags.size(); i = static_cast<std::size_t>(std::find(done.begin(), done.end(), false) - done.begin())) {
      auto line = read_line(until);
      if (line.starts_with("* ")) {
        if (detail::istarts_with(line, "* BYE")) fail(errc::connection_lost, "the server said " + line.substr(2));
        // ESEARCH names its command (RFC 4731): a server running pipelined
        // commands side by side may answer a later one first.
        std::size_t to = i;
        if (detail::istarts_with(line, "* ESEARCH (TAG \"")) {
          const auto tag = line.substr(16, line.find('"', 16) - 16);
          for (std::size_t j = i; j < tags.size(); ++j)
            if (tags[j] == tag) to = j;
        }
        replies[to].untagged.push_back(line.substr(2));
        continue;
      }
      if (line.starts_with("+")) continue;  // a continuation (a literal the server wants to have confirmed)
      // A tagged completion, of whichever command it names (a server may
      // complete pipelined commands out of order).
      const auto space = line.find(' ');
      const auto it = std::find(tags.begin(), tags.end(), line.substr(0, space));
      if (it == tags.end()) continue;
      auto& r = replies[static_cast<std::size_t>(it - tags.begin())];
      done[static_cast<std::size_t>(it - tags.begin())] = true;
      auto rest = std::string_view(line).substr(space == std::string::npos ? line.size() : space + 1);
      const auto sp = rest.find(' ');
      r.status = std::string(rest.substr(0, sp));
      for (auto& ch : r.status) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
      rest = sp == std::string_view::npos ? std::string_view{} : rest.substr(sp + 1);
      if (rest.starts_with('[')) {
        const auto close = rest.find(']');
        r.code = std::string(rest.substr(1, close - 1));
        rest = close == std::string_view::npos ? std::string_view{} : rest.substr(close + 1);
        if (rest.starts_with(' ')) rest.remove_prefix(1);
      }
      r.text = std::string(rest);
    }
    return replies;
  }

  options opts_;
  int fd_ = -1;
  pid_t pid_ = 0;
  std::uint64_t tag_ = 0;
  std::string in_;
  std::vector<std::string> caps_;
};

}  // namespace dibs::imap
