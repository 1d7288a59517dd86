// dibs/imap/client.hpp: a small IMAP4rev1 client (RFC 3501) for dibs's IMAP store
// and mailbox claims: one connection, commands pipelined, replies parsed into
// values. Kept apart from the claim logic (imap_store.hpp) so each can be
// tested on its own.
//
//   dibs::imap::session s{dibs::imap::options::from_env()};
//   s.check(s.run("SELECT INBOX"), "select");
//   for (const auto& line : s.run("UID SEARCH ALL").untagged) ...
//
// The server's LITERAL+ (RFC 7888) is used for APPEND where it has it.
//
// TLS, through OpenSSL (the target dibs::imap links OpenSSL::SSL):
// options::tls is tls_mode::none (plain TCP: a server on loopback or inside
// a network you trust; the default), tls_mode::starttls (STARTTLS before
// the login, RFC 3501/2595; port 143) or tls_mode::implicit (TLS from the
// first byte, RFC 8314; port 993, the default port then). The server's
// certificate is verified against the system's CA store, or options::ca_file,
// and must name options::host (options::verify = false turns that off: for
// tests only, it is unsafe). No password and no token is sent where the
// server announces LOGINDISABLED on a plain connection: that fails,
// telling to use starttls.
//
//   dibs::imap::session s{{.host = "imap.example.com", .user = "me", .password = pw,
//                          .tls = dibs::imap::tls_mode::implicit}};
//
// Logging in (options::auth, auth_mechanism::automatic by default): LOGIN
// with a password; AUTHENTICATE PLAIN (RFC 4616) where an authorization
// identity (options::authzid: the mailbox to act as) is given or the server
// says LOGINDISABLED and offers AUTH=PLAIN; with an OAuth2 token provider
// (options::oauth2_token) AUTHENTICATE OAUTHBEARER (RFC 7628) where the
// server announces it, else XOAUTH2 (Google's and Microsoft's) where it
// announces that; neither announced: std::errc::not_supported, naming the
// AUTH= mechanisms it announces, before the provider is asked (an explicit
// options::auth = xoauth2 or oauthbearer sends the token anyway). The initial
// response goes on the AUTHENTICATE line where the server announces SASL-IR
// (RFC 4959). A token the server refuses is asked for once more, renewed
// (oauth2_token(true)), and tried again (not for a refusal a renewed token
// would meet again: BAD, [CANNOT], RFC 7628's insufficient_scope or
// invalid_request); token_command() makes a provider
// that runs a helper command, as mail clients do. Exchange Online logs into
// a shared mailbox with the shared mailbox's address as the identity and a
// licensed user's token:
//
//   dibs::imap::session s{{.host = "outlook.office365.com", .user = "me@example.com",
//                          .tls = dibs::imap::tls_mode::implicit, .authzid = "shared@example.com",
//                          .oauth2_token = dibs::imap::token_command("oauth2-helper --account work")}};
//
// Passwords and tokens go to the server and nowhere else: no message of an
// exception this header throws holds one (nor their base64), and what a
// server says during the login is quoted only with them cut out.
//
// Failures, as std::system_error:
//   - the server cannot be reached, closes the connection, says BYE, or a
//     reply does not come within options::timeout: errc::connection_lost or
//     errc::timed_out (transient), and the session is closed; the next
//     command connects and logs in again by itself. A caller that had sent a
//     write when that happened cannot know whether it was applied
//     (run_write() says errc::outcome_unknown then). Connecting as a whole
//     (name resolution, the TCP connect to each address, TLS handshake,
//     greeting, login) takes options::timeout at most: a server whose
//     accept queue is full is errc::timed_out naming host:port;
//   - a malformed reply (a number that is not one, or out of IMAP's range,
//     where the client or its callers read one; a literal or line over
//     options::max_line, refused before it is read): std::errc::protocol_error
//     naming the server and quoting the start of the line; not transient. The
//     session is closed (what else was in flight cannot be read reliably):
//     under run_write() that is errc::outcome_unknown, never a reply dropped;
//   - a login refused: std::errc::permission_denied, naming server and user
//     (and the authorization identity, the mechanism); an OAuth2 token
//     refused, renewed through the provider and refused again: the same,
//     saying so; refused once and the connection then lost before the
//     server's answer to the renewed token (or to the first, after its
//     error challenge): the same, not transient, saying the retry could not
//     be made. A refusal that says the server is busy (UNAVAILABLE, or the
//     throttling words of Exchange Online and Gmail: detail::throttle_texts)
//     is errc::connection_lost (transient). A token provider that throws:
//     its error's code, its message wrapped with the server and user. An
//     options::auth that cannot be used with the options given
//     (auth_mechanism::login with an authzid: std::errc::not_supported;
//     xoauth2 or oauthbearer without oauth2_token: errc::invalid_argument),
//     and AUTHENTICATE in a build without OpenSSL (its base64 comes from
//     there): std::errc::not_supported, before anything secret is sent;
//   - TLS: a server certificate that does not verify (wrong CA, not for the
//     host): std::errc::permission_denied, with OpenSSL's verify result
//     ("certificate verify failed: self-signed certificate"); a handshake
//     that fails otherwise: std::errc::protocol_error; a server without
//     STARTTLS under tls_mode::starttls: std::errc::not_supported; a server
//     with LOGINDISABLED under tls_mode::none: permission_denied. None of
//     these is transient. A connection lost or a reply too slow during or
//     after the handshake is as above (transient);
//   - a tagged NO or BAD, through check(): the server's response code decides
//     (NONEXISTENT: no_such_file_or_directory, NOPERM/AUTHORIZATIONFAILED:
//     permission_denied, OVERQUOTA: no_space_on_device, UNAVAILABLE/INUSE/
//     LIMIT/THROTTLED, or words of a server that throttles: transient;
//     Exchange Online's "User is authenticated but not connected.":
//     permission_denied, not transient, naming its likely causes), and the
//     message names server, user, what was done and the server's own words.
// A session is used by one thread at a time. After fork() the child's copy
// never writes to the parent's connection, nor uses its TLS state (it frees
// it without SSL_shutdown): it connects anew.
//
// On Windows the same code runs over Winsock (detail/win32/socket.hpp; link
// ws2_32, as dibs::imap does): a refused or reset connection is a WSA code
// in std::system_category(), transient as ECONNREFUSED is on Linux. TLS is
// compiled in only with DIBS_IMAP_OPENSSL=1 (dibs::imap sets it where CMake
// finds an OpenSSL for the target); without it, options::tls other than
// tls_mode::none is std::errc::not_supported (not transient), naming why,
// before anything is sent. docs/windows.md says what was verified.
#pragma once

// DIBS_IMAP_OPENSSL: 1 compiles TLS in (OpenSSL; link OpenSSL::SSL), 0
// leaves it out (plain IMAP only; tls_mode::starttls and implicit are then
// refused with errc::not_supported, naming why). Unset: 1 on POSIX; 0 on
// Windows, where the target dibs::imap sets it to 1 if CMake found an
// OpenSSL for the target (Debian ships none for mingw-w64).
#ifndef DIBS_IMAP_OPENSSL
#ifdef _WIN32
#define DIBS_IMAP_OPENSSL 0
#else
#define DIBS_IMAP_OPENSSL 1
#endif
#endif

// The socket calls (connect with a deadline, waiting, send, recv, close,
// name resolution, their errors): POSIX or Winsock.
#include <dibs/detail/tcp.hpp>
#ifndef _WIN32
#include <dibs/detail/posix/shell_command.hpp>
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#if DIBS_IMAP_OPENSSL
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#endif

#include <dibs/error.hpp>

namespace dibs::imap {

/// How the connection is protected.
enum class tls_mode {
  none,      ///< plain TCP (a server on loopback or inside a network you trust)
  starttls,  ///< plain TCP, then STARTTLS before the login (RFC 3501 6.2.1, RFC 2595); usually port 143
  implicit,  ///< TLS from the first byte (RFC 8314); usually port 993
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

// Effects: overwrites `s` (a password, a token, what holds one) and empties
// it, so that the bytes do not linger in freed memory.
inline void forget(std::string& s) noexcept {
#if DIBS_IMAP_OPENSSL
  if (!s.empty()) OPENSSL_cleanse(s.data(), s.size());
#else
  for (volatile char* p = s.data(); p != s.data() + s.size(); ++p) *p = 0;
#endif
  s.clear();
}

// The SASL client responses, before base64 (the session encodes them).
// XOAUTH2 (Google's "OAuth 2.0 Mechanism", Microsoft's "Authenticate an
// IMAP connection using OAuth"): user=U ^A auth=Bearer T ^A ^A.
inline std::string xoauth2_response(std::string_view user, std::string_view token) {
  // "\x01" "auth": one string, and the 'a' is no hex digit of the escape.
  return fmt::format("user={}\x01" "auth=Bearer {}\x01\x01", user, token);
}

// Returns: `s` with ',' and '=' written =2C and =3D, as a GS2 header's a=
// wants them (RFC 5801 4, saslname).
inline std::string gs2_escape(std::string_view s) {
  std::string out;
  for (const char c : s) {
    if (c == ',') out += "=2C";
    else if (c == '=') out += "=3D";
    else out += c;
  }
  return out;
}

// OAUTHBEARER (RFC 7628 3.1): the GS2 header "n,a=AUTHZID," then
// key=value pairs, each ended by ^A, and a final ^A.
inline std::string oauthbearer_response(std::string_view authzid, std::string_view host, std::string_view port,
                                        std::string_view token) {
  return fmt::format("n,a={},\x01host={}\x01port={}\x01" "auth=Bearer {}\x01\x01", gs2_escape(authzid), host, port,
                     token);
}

// PLAIN (RFC 4616 2): authzid NUL authcid NUL password.
inline std::string plain_response(std::string_view authzid, std::string_view user, std::string_view password) {
  std::string out;
  out.reserve(authzid.size() + user.size() + password.size() + 2);
  out.append(authzid).append(1, '\0').append(user).append(1, '\0').append(password);
  return out;
}

// Returns: the value of "status" in the JSON error an OAuth2 mechanism's
// server sends when it refuses a token (RFC 7628 3.2.2: {"status":
// "invalid_token", ...}; XOAUTH2: {"status":"401",...}), as printable
// text of at most 40 characters; "" if there is none.
inline std::string sasl_error_status(std::string_view json) {
  auto at = json.find("\"status\"");
  if (at == std::string_view::npos) return {};
  at += 8;
  while (at < json.size() && (json[at] == ' ' || json[at] == ':' || json[at] == '\t')) ++at;
  if (at >= json.size() || json[at] != '"') return {};
  std::string out;
  for (++at; at < json.size() && json[at] != '"' && out.size() < 40; ++at) {
    const auto c = static_cast<unsigned char>(json[at]);
    out += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
  }
  return out;
}

#if DIBS_IMAP_OPENSSL
inline std::string base64_encode(std::string_view in) {
  std::string out(4 * ((in.size() + 2) / 3), '\0');
  if (!in.empty())
    EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), reinterpret_cast<const unsigned char*>(in.data()),
                    static_cast<int>(in.size()));
  return out;
}

// Returns: the bytes of `in` (base64, white space around it allowed), or
// nullopt if it is not base64.
inline std::optional<std::string> base64_decode(std::string_view in) {
  while (!in.empty() && std::isspace(static_cast<unsigned char>(in.front()))) in.remove_prefix(1);
  while (!in.empty() && std::isspace(static_cast<unsigned char>(in.back()))) in.remove_suffix(1);
  if (in.size() % 4 != 0 || in.size() > INT_MAX) return std::nullopt;
  std::string out(in.size() / 4 * 3, '\0');
  if (in.empty()) return out;
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(in.data()), static_cast<int>(in.size()));
  if (n < 0) return std::nullopt;
  // EVP_DecodeBlock counts the padding's bytes as decoded zeros.
  out.resize(static_cast<std::size_t>(n) - (in.ends_with("==") ? 2 : in.ends_with('=') ? 1 : 0));
  return out;
}
#endif

// What servers say, in words rather than a response code, when they
// throttle a client or have too many of its connections: a retry after a
// backoff can succeed, so a tagged NO or BAD (through check(), or refusing
// the login) saying one of these is transient (a BYE always is). Compared
// without case, anywhere in the text. Neither vendor documents its words;
// these are from public logs (docs/guide-exchange.md has the links), and
// no real server has been seen saying them to dibs.
inline constexpr std::string_view throttle_texts[] = {
    // Exchange Online, a mailbox over its IMAP budget: "NO Request is
    // throttled. Suggested Backoff Time: 299609 milliseconds", also as a
    // BAD (imapsync#198, email-oauth2-proxy#191).
    "Request is throttled",
    // Exchange Online, the mailbox's server busy or moving: "NO Server
    // Unavailable. 15" (imapfilter#146).
    "Server Unavailable",
    // Gmail, one connection more than its 15 per account, at the login:
    // "NO [ALERT] Too many simultaneous connections. (Failure)" (Gmail Help 97150).
    "Too many simultaneous connections",
    // Gmail, an account past its command or bandwidth limits: "NO [ALERT]
    // Account exceeded command or bandwidth limits. (Failure)" (no source
    // checked here; past the daily bandwidth IMAP stays off for hours, and
    // the retries' own limit ends them).
    "Account exceeded command or bandwidth limits",
};

// Exchange Online, the command after a successful AUTHENTICATE when the
// session to the mailbox could not be made: "BAD User is authenticated but
// not connected." Mostly a setup error a retry does not fix (IMAP off for
// the mailbox, no FullAccess, a wrong user=), so not transient: a caller
// that waits out transient errors (imap_mailbox::next()) would otherwise
// take a mailbox it can never open for an empty one.
inline constexpr std::string_view not_connected_text = "User is authenticated but not connected";

// Returns: true if `text` holds `t`, compared without case.
inline bool icontains(std::string_view text, std::string_view t) {
  for (std::size_t i = 0; i + t.size() <= text.size(); ++i)
    if (iequals(text.substr(i, t.size()), t)) return true;
  return false;
}

// Returns: true if a reply's response code (UNAVAILABLE, INUSE, LIMIT:
// RFC 5530; THROTTLED: no RFC, reported of Gmail) or its words
// (throttle_texts) say the server is busy or throttling: worth a retry
// after a backoff.
inline bool throttled(std::string_view code, std::string_view text) {
  const auto name = code.substr(0, code.find(' '));
  if (iequals(name, "THROTTLED") || iequals(name, "UNAVAILABLE") || iequals(name, "INUSE") ||
      iequals(name, "LIMIT"))
    return true;
  for (const auto t : throttle_texts)
    if (icontains(text, t)) return true;
  return false;
}

}  // namespace detail

/// How the session logs in (options::auth).
enum class auth_mechanism {
  /// With options::oauth2_token: OAUTHBEARER where the server announces
  /// AUTH=OAUTHBEARER, else XOAUTH2 where it announces AUTH=XOAUTH2, else
  /// std::errc::not_supported (nothing sent). Without: PLAIN where options::authzid
  /// is set, or where the server announces LOGINDISABLED and AUTH=PLAIN;
  /// else LOGIN.
  automatic,
  login,        ///< LOGIN user password (RFC 3501 6.2.3); no authorization identity
  plain,        ///< AUTHENTICATE PLAIN (RFC 4616): authzid, user and password
  xoauth2,      ///< AUTHENTICATE XOAUTH2 (Google, Microsoft): user= (authzid, else user) and the token
  oauthbearer,  ///< AUTHENTICATE OAUTHBEARER (RFC 7628): a= (authzid, else user), host, port and the token
};

#ifndef _WIN32
/// Returns: a provider for options::oauth2_token that runs `command` with
/// the shell (/bin/sh -c) at every call and takes what it prints on its
/// standard output, trailing white space (the final newline) cut, as the
/// token: the convention of mbsync's PassCmd, msmtp's passwordeval and
/// neomutt's imap_oauth_refresh_command. It is run again at every call,
/// refresh or not: a helper that keeps its token until it expires decides
/// that itself (most do). Its standard error is ours; its standard input
/// is ours only if that is a terminal (it may ask a person there), else
/// /dev/null. The token is what it printed by the time the shell exited: a
/// process it left in the background does not hold it up. Throws (the
/// provider, when called): std::errc::permission_denied if the command
/// exits with a status other than 0, is ended by a signal, prints nothing
/// but white space, or prints more than one line; errc::timed_out (it is
/// killed, transient) if it has not finished within `timeout`;
/// errc::invalid_argument if it prints more than 64 KiB; the errno of a
/// failed start of /bin/sh. Each message names the command and how it
/// ended, never what it printed (that would be the token).
/// Windows: not offered yet (there is no process-running code for it in
/// dibs's platform layer); give options::oauth2_token a provider of your own.
inline std::function<std::string(bool refresh)> token_command(std::string command,
                                                               std::chrono::milliseconds timeout = std::chrono::seconds{60}) {
  return [command = std::move(command), timeout](bool) {
    constexpr std::size_t max_out = 64 * 1024;
    auto fail = [&](std::error_code ec, std::string_view how) -> std::string {
      throw std::system_error(ec, fmt::format("dibs::imap: the token command '{}' {}", command, how));
    };
    dibs::detail::shell_result r;
    try {
      r = dibs::detail::run_shell(command, timeout, max_out);
    } catch (const std::system_error& e) {
      return fail(e.code(), fmt::format("could not be run: {}", e.what()));
    }
    auto& out = r.out;
    if (r.timed_out) {
      detail::forget(out);
      return fail(make_error_code(errc::timed_out),
                  fmt::format("did not finish within {} ms, and was killed (is it waiting for input? it is run "
                              "with our standard error, and our standard input if that is a terminal)",
                              timeout.count()));
    }
    if (r.too_long) {
      detail::forget(out);
      return fail(make_error_code(errc::invalid_argument),
                  fmt::format("printed more than {} KiB, which is no access token; it was killed", max_out / 1024));
    }
    if (r.signal != 0 || r.exit_code != 0) {
      detail::forget(out);
      return fail(std::make_error_code(std::errc::permission_denied),
                  r.signal != 0      ? fmt::format("was ended by signal {}; no token", r.signal)
                  : r.exit_code > 0 ? fmt::format("exited with status {} (what it wrote to standard error says "
                                                  "why); no token",
                                                  r.exit_code)
                                    : std::string("ended, and how could not be learned (is SIGCHLD ignored in "
                                                  "this process?); its output is not trusted"));
    }
    while (!out.empty() && std::isspace(static_cast<unsigned char>(out.back()))) out.pop_back();
    if (out.empty()) return fail(std::make_error_code(std::errc::permission_denied), "exited 0 but printed no token");
    for (const char c : out)
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        detail::forget(out);
        return fail(std::make_error_code(std::errc::permission_denied),
                    "printed more than one line, or control characters: a token is one line of printable characters");
      }
    return std::move(out);
  };
}
#endif

/// Where the server is, how to reach it, and who logs in.
struct options {
  std::string host = "127.0.0.1";
  /// Empty: 143, or 993 with tls_mode::implicit.
  std::string port;
  std::string user;
  std::string password;
  /// How long connecting may take (name resolution, the TCP connect to
  /// each address the name resolves to, the TLS handshake, greeting and
  /// login: all of it together), and each reply after that, before the
  /// connection is given up (errc::timed_out).
  std::chrono::milliseconds timeout{30'000};
  /// The most bytes one response line may hold, its literals included (a
  /// message fetched whole is one line). A literal announced larger is
  /// refused before a byte of it is read (std::errc::protocol_error), so a
  /// server that lies about a size cannot make the client allocate it.
  std::size_t max_line = 64 * 1024 * 1024;
  /// TLS: none (plain, the default), starttls or implicit.
  tls_mode tls = tls_mode::none;
  /// With TLS: the CA certificates (PEM) to verify the server's certificate
  /// against; empty: the system's store (SSL_CTX_set_default_verify_paths).
  std::string ca_file;
  /// With TLS: verify the server's certificate and that it names `host`.
  /// false is UNSAFE (anyone on the path can read the password and every
  /// message): for tests only.
  bool verify = true;
  /// The authorization identity: the mailbox to act as when it is not
  /// `user`'s own (an Exchange Online shared mailbox's address; the user a
  /// Dovecot master user logs in as). Sent as PLAIN's authzid, XOAUTH2's
  /// user= (there `user` itself is not sent: the token says who logs in)
  /// and OAUTHBEARER's a=. Empty: `user`'s own mailbox.
  std::string authzid;
  /// OAuth2: returns the current access token (refresh = false), called at
  /// each login; called once more, with refresh = true, right after the
  /// server refused the token it gave (expired: it should renew it). Set,
  /// it is used instead of `password`. token_command() makes one that runs
  /// a helper command. What it throws ends the login (see the top of this
  /// header). Called on the thread that uses the session.
  std::function<std::string(bool refresh)> oauth2_token;
  /// How to log in: see auth_mechanism (automatic by default).
  auth_mechanism auth = auth_mechanism::automatic;
  /// Send the first client response on the AUTHENTICATE line where the
  /// server announces SASL-IR (RFC 4959); false: wait for the server's "+"
  /// first (a round trip more; for a server that announces SASL-IR and
  /// mishandles it).
  bool sasl_ir = true;

  /// Returns: options from DIBS_IMAP_HOST, DIBS_IMAP_PORT, DIBS_IMAP_USER,
  /// DIBS_IMAP_PASSWORD (what scripts/imap.sh prints), DIBS_IMAP_TLS (none,
  /// starttls or implicit), DIBS_IMAP_CA_FILE, DIBS_IMAP_AUTHZID,
  /// DIBS_IMAP_TOKEN_CMD (oauth2_token = token_command(it)) and
  /// DIBS_IMAP_AUTH (automatic, login, plain, xoauth2 or oauthbearer),
  /// defaults where unset. Throws: errc::invalid_argument for another
  /// DIBS_IMAP_TLS or DIBS_IMAP_AUTH; std::errc::not_supported for
  /// DIBS_IMAP_TOKEN_CMD on Windows (no token_command there yet).
  static options from_env() {
    options o;
    auto get = [](const char* name, std::string& to) {
      if (const char* v = std::getenv(name); v && *v) to = v;
    };
    get("DIBS_IMAP_HOST", o.host);
    get("DIBS_IMAP_PORT", o.port);
    get("DIBS_IMAP_USER", o.user);
    get("DIBS_IMAP_PASSWORD", o.password);
    get("DIBS_IMAP_CA_FILE", o.ca_file);
    std::string tls;
    get("DIBS_IMAP_TLS", tls);
    if (tls == "starttls") o.tls = tls_mode::starttls;
    else if (tls == "implicit") o.tls = tls_mode::implicit;
    else if (!tls.empty() && tls != "none")
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::imap: DIBS_IMAP_TLS is '{}': say none, starttls or implicit", tls));
    get("DIBS_IMAP_AUTHZID", o.authzid);
    std::string auth;
    get("DIBS_IMAP_AUTH", auth);
    if (auth == "login") o.auth = auth_mechanism::login;
    else if (auth == "plain") o.auth = auth_mechanism::plain;
    else if (auth == "xoauth2") o.auth = auth_mechanism::xoauth2;
    else if (auth == "oauthbearer") o.auth = auth_mechanism::oauthbearer;
    else if (!auth.empty() && auth != "automatic")
      throw std::system_error(
          make_error_code(errc::invalid_argument),
          fmt::format("dibs::imap: DIBS_IMAP_AUTH is '{}': say automatic, login, plain, xoauth2 or oauthbearer", auth));
    std::string command;
    get("DIBS_IMAP_TOKEN_CMD", command);
    if (!command.empty()) {
#ifdef _WIN32
      throw std::system_error(std::make_error_code(std::errc::not_supported),
                              "dibs::imap: DIBS_IMAP_TOKEN_CMD is set, but this Windows build has no token_command "
                              "yet: give options::oauth2_token a provider of your own");
#else
      o.oauth2_token = token_command(command);
#endif
    }
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

// The largest number (nz-number) IMAP has, RFC 3501 9: message numbers,
// UIDs, UIDVALIDITY are 32 bits; a mod-sequence 63 (RFC 7162 7).
inline constexpr std::uint64_t max_number = 0xffff'ffffu;
inline constexpr std::uint64_t max_modseq = 0x7fff'ffff'ffff'ffffu;

// Returns: `s` as a number of at most `max`, or nullopt if it is not one
// (empty, a sign, another character, too large). What a server sends is
// read only through this: std::stoul would accept "12abc", wrap at 64 bits
// and throw std::invalid_argument, which names nothing.
inline std::optional<std::uint64_t> to_number(std::string_view s, std::uint64_t max) noexcept {
  if (s.empty() || s.front() < '0' || s.front() > '9') return std::nullopt;
  std::uint64_t n = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (ec != std::errc{} || end != s.data() + s.size() || n > max) return std::nullopt;
  return n;
}

inline bool is_nz_number(std::string_view s) noexcept {
  const auto n = to_number(s, max_number);
  return n && *n != 0;
}

// Returns: true if `s` is a set of UIDs as a server reports them ("3:5,9":
// no '*', RFC 4315 4 uid-set).
inline bool is_uid_set(std::string_view s) noexcept {
  for (;;) {
    const auto comma = s.find(',');
    const auto part = s.substr(0, comma);
    const auto colon = part.find(':');
    if (!is_nz_number(part.substr(0, colon))) return false;
    if (colon != std::string_view::npos && !is_nz_number(part.substr(colon + 1))) return false;
    if (comma == std::string_view::npos) return true;
    s.remove_prefix(comma + 1);
  }
}

// Returns: at most the first 100 bytes of what a server sent, control
// characters and bytes past ASCII shown as \xNN, for an error message.
inline std::string excerpt(std::string_view s) {
  std::string out;
  const auto n = std::min<std::size_t>(s.size(), 100);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c >= 0x7f) fmt::format_to(std::back_inserter(out), "\\x{:02x}", c);
    else out.push_back(static_cast<char>(c));
  }
  if (n < s.size()) fmt::format_to(std::back_inserter(out), "... ({} bytes)", s.size());
  return out;
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
      const auto size = to_number(s.substr(pos + 1, close == std::string_view::npos ? 0 : close - pos - 1), SIZE_MAX);
      const std::size_t n = static_cast<std::size_t>(size.value_or(0));
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

#if DIBS_IMAP_OPENSSL
// OpenSSL's own socket BIO writes with write(2), which raises SIGPIPE when
// the server has gone; this one sends as the plain path does (POSIX:
// MSG_NOSIGNAL; Windows: send()). Its data is the socket; it never closes it.
inline dibs::detail::socket_handle tls_bio_socket(BIO* b) noexcept {
  return static_cast<dibs::detail::socket_handle>(reinterpret_cast<std::intptr_t>(BIO_get_data(b)));
}
inline int tls_bio_write(BIO* b, const char* data, int len) {
  BIO_clear_retry_flags(b);
  const auto n = dibs::detail::send_socket(tls_bio_socket(b), data, static_cast<std::size_t>(len));
  if (n < 0 && dibs::detail::socket_would_block()) BIO_set_retry_write(b);
  return static_cast<int>(n);
}
inline int tls_bio_read(BIO* b, char* data, int len) {
  BIO_clear_retry_flags(b);
  const auto n = dibs::detail::recv_socket(tls_bio_socket(b), data, static_cast<std::size_t>(len));
  if (n < 0 && dibs::detail::socket_would_block()) BIO_set_retry_read(b);
  return static_cast<int>(n);
}
inline long tls_bio_ctrl(BIO*, int cmd, long, void*) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }
inline int tls_bio_create(BIO* b) {
  BIO_set_data(b, nullptr);
  BIO_set_init(b, 0);
  return 1;
}
inline int tls_bio_destroy(BIO*) { return 1; }
inline BIO_METHOD* tls_bio_method() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK | BIO_TYPE_DESCRIPTOR, "dibs::imap socket");
    if (m) {
      BIO_meth_set_write(m, tls_bio_write);
      BIO_meth_set_read(m, tls_bio_read);
      BIO_meth_set_ctrl(m, tls_bio_ctrl);
      BIO_meth_set_create(m, tls_bio_create);
      BIO_meth_set_destroy(m, tls_bio_destroy);
    }
    return m;
  }();
  return method;
}

// Returns: OpenSSL's queued errors of this thread, as text (and clears them).
inline std::string tls_errors() {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(e);
    char buf[256];
    if (!reason) {
      ERR_error_string_n(e, buf, sizeof buf);
      reason = buf;
    }
    if (!out.empty()) out += "; ";
    out += reason;
  }
  return out;
}
#endif  // DIBS_IMAP_OPENSSL

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

namespace detail {

// Returns: what is wrong in a FETCH response's items (empty: nothing).
inline std::string malformed_fetch(std::string_view text) {
  const auto v = parse(text);
  if (v.size() != 1 || v[0].kind != value::kind::list) return "a FETCH response without its list of items";
  const auto& items = v[0].items;
  if (items.size() % 2 != 0) return "a FETCH item without a value";
  for (std::size_t i = 0; i < items.size(); i += 2) {
    const auto& name = items[i];
    const auto& val = items[i + 1];
    if (name.is("UID") && (val.kind != value::kind::atom || !is_nz_number(val.text)))
      return "a FETCH UID that is not a number from 1 to 4294967295";
    if (name.is("RFC822.SIZE") && (val.kind != value::kind::atom || !to_number(val.text, max_number)))
      return "a FETCH RFC822.SIZE that is not a 32-bit number";
    if (name.is("MODSEQ") && (val.kind != value::kind::list || val.items.size() != 1 ||
                              val.items[0].kind != value::kind::atom || !to_number(val.items[0].text, max_modseq)))
      return "a FETCH MODSEQ that is not one 63-bit number in parentheses";
  }
  return {};
}

// Returns: what is wrong in a response code (what is inside "[...]", RFC
// 3501 7.1, RFC 4315 3, RFC 7162 3.1.2.1) whose arguments are numbers.
inline std::string malformed_code(std::string_view code) {
  const auto sp = code.find(' ');
  const auto name = code.substr(0, sp);
  const auto args = sp == std::string_view::npos ? std::string_view{} : code.substr(sp + 1);
  std::vector<std::string_view> words;
  for (std::size_t at = 0; at <= args.size() && !args.empty();) {
    const auto end = std::min(args.find(' ', at), args.size());
    words.push_back(args.substr(at, end - at));
    at = end + 1;
  }
  if (iequals(name, "UIDVALIDITY") || iequals(name, "UIDNEXT") || iequals(name, "UNSEEN")) {
    if (words.size() != 1 || !is_nz_number(words[0]))
      return fmt::format("{} is not a number from 1 to 4294967295", name);
  } else if (iequals(name, "HIGHESTMODSEQ")) {
    if (words.size() != 1 || !to_number(words[0], max_modseq)) return "HIGHESTMODSEQ is not a 63-bit number";
  } else if (iequals(name, "APPENDUID")) {
    if (words.size() != 2 || !is_nz_number(words[0]) || !is_uid_set(words[1]))
      return "APPENDUID is not a UIDVALIDITY and a UID set";
  } else if (iequals(name, "COPYUID")) {
    if (words.size() != 3 || !is_nz_number(words[0]) || !is_uid_set(words[1]) || !is_uid_set(words[2]))
      return "COPYUID is not a UIDVALIDITY and two UID sets";
  }
  return {};
}

// Returns: what is wrong with the numbers in a response line (empty if
// nothing is): message numbers, UIDs and UID sets, the response codes
// that carry numbers, SEARCH, ESEARCH and VANISHED. Everything a caller
// reads as a number was checked here first, so a caller never meets a
// malformed one.
inline std::string malformed(std::string_view line) {
  if (line.starts_with('+')) return {};
  const bool untagged = line.starts_with("* ");
  const auto tag_end = line.find(' ');
  if (tag_end == std::string_view::npos) return untagged ? "an empty untagged response" : "a tagged reply without a status";
  auto rest = line.substr(tag_end + 1);
  const auto word_end = rest.find(' ');
  const auto word = rest.substr(0, word_end);
  rest = word_end == std::string_view::npos ? std::string_view{} : rest.substr(word_end + 1);
  if (iequals(word, "OK") || iequals(word, "NO") || iequals(word, "BAD") || iequals(word, "PREAUTH") ||
      iequals(word, "BYE")) {
    if (!rest.starts_with('[')) return {};
    const auto close = rest.find(']');
    if (close == std::string_view::npos) return "a response code without its closing ']'";
    return malformed_code(rest.substr(1, close - 1));
  }
  if (!untagged) return {};
  if (!word.empty() && word.front() >= '0' && word.front() <= '9') {  // "* 12 EXISTS", "* 3 FETCH (...)"
    const auto kind = rest.substr(0, rest.find(' '));
    const auto n = to_number(word, max_number);
    if (!n) return fmt::format("a message number in {} that is not a 32-bit number", kind);
    if (*n == 0 && (iequals(kind, "EXPUNGE") || iequals(kind, "FETCH"))) return fmt::format("{} of message 0", kind);
    if (iequals(kind, "FETCH")) return malformed_fetch(rest.substr(kind.size()));
    return {};
  }
  if (iequals(word, "EXISTS") || iequals(word, "RECENT") || iequals(word, "EXPUNGE") || iequals(word, "FETCH"))
    return fmt::format("{} without its message number", word);
  if (iequals(word, "VANISHED")) {  // RFC 7162 3.2.10
    if (istarts_with(rest, "(EARLIER) ")) rest.remove_prefix(10);
    return is_uid_set(rest) ? std::string{} : "VANISHED with no UID set (numbers from 1 to 4294967295)";
  }
  if (iequals(word, "SEARCH")) {  // numbers, then perhaps "(MODSEQ n)" (RFC 7162 3.1.5)
    for (const auto& v : parse(rest))
      if (v.kind == value::kind::atom && !is_nz_number(v.text)) return "SEARCH with something other than numbers";
    return {};
  }
  if (iequals(word, "ESEARCH")) {  // RFC 4731: [(TAG "x")] [UID] ALL set | MIN n | MAX n | COUNT n ...
    const auto v = parse(rest);
    std::size_t i = !v.empty() && v[0].kind == value::kind::list ? 1 : 0;
    if (i < v.size() && v[i].is("UID")) ++i;
    for (; i + 1 < v.size(); i += 2) {
      const bool set = v[i].is("ALL");
      const bool number = v[i].is("MIN") || v[i].is("MAX") || v[i].is("COUNT");
      if ((set && !is_uid_set(v[i + 1].text)) || (number && !to_number(v[i + 1].text, max_number)))
        return fmt::format("ESEARCH {} with a malformed value", v[i].text);
    }
  }
  return {};
}

}  // namespace detail

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
  explicit session(options o) : opts_(std::move(o)) {
    if (opts_.port.empty()) opts_.port = opts_.tls == tls_mode::implicit ? "993" : "143";
    try {
      connect();
    } catch (...) {  // no destructor runs: free the TLS state here
      drop();
      free_context();
      throw;
    }
  }
  ~session() {
    close();
    free_context();
  }
  session(const session&) = delete;
  session& operator=(const session&) = delete;

  const options& opts() const noexcept { return opts_; }
  /// Returns: "user@host:port", and " (as AUTHZID)" where options::authzid
  /// is set, for messages.
  std::string where() const {
    return fmt::format("{}@{}:{}{}", opts_.user, opts_.host, opts_.port,
                       opts_.authzid.empty() ? std::string{} : fmt::format(" (as {})", opts_.authzid));
  }
  /// Returns: true if the server announced `capability` (compared without case).
  bool has(std::string_view capability) const {
    for (const auto& c : caps_)
      if (detail::iequals(c, capability)) return true;
    return false;
  }
  /// Returns: true if the connection is open (a command after a failure
  /// reconnects by itself).
  bool connected() const noexcept { return fd_ != dibs::detail::no_socket && pid_ == dibs::detail::socket_owner(); }
  /// Returns: true if the connection is open and protected by TLS.
  bool encrypted() const noexcept {
#if DIBS_IMAP_OPENSSL
    return connected() && ssl_ != nullptr;
#else
    return false;
#endif
  }

  /// Sends `commands` (each without tag; literals written "{n+}\r\n..."
  /// through quote()) in one go and returns their replies in order. Throws:
  /// errc::connection_lost or errc::timed_out if the connection fails,
  /// std::errc::protocol_error for a malformed reply (the session is then
  /// closed), errc::invalid_argument for a literal whose size is not its
  /// length (write literals with quote()).
  std::vector<reply> run(const std::vector<std::string>& commands) {
    read_ahead();
    if (!connected()) connect();
    const bool plus = has("LITERAL+");
    std::vector<std::string> tags;
    std::string out;
    std::vector<reply> replies;
    for (const auto& c : commands) {
      tags.push_back(fmt::format("d{}", ++tag_));
      if (plus || c.find("+}\r\n") == std::string::npos) {
        out.append(tags.back()).append(" ").append(c).append("\r\n");
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
        const auto size = open == std::string::npos || open < pos
                              ? std::nullopt
                              : detail::to_number(std::string_view(c).substr(open + 1, mark - open - 1), SIZE_MAX);
        if (!size || *size > c.size() - (mark + 4))
          throw std::system_error(make_error_code(errc::invalid_argument),
                                  fmt::format("dibs::imap: {}: the command '{}' has a literal whose size is not its "
                                              "length: write it with imap::quote()",
                                              where(), shown(c)));
        const auto n = static_cast<std::size_t>(*size);
        part.append(c, pos, mark - pos).append("}\r\n");
        send(part);
        for (const auto until = deadline();;) {
          auto line = read_reply_line(until);
          if (line.starts_with("+")) break;
          if (line.starts_with(tags.back() + ' '))
            fail(errc::connection_lost, fmt::format("the server refused a literal: {}", shown(line)));
          if (detail::istarts_with(line, "* BYE"))
            fail(errc::connection_lost, fmt::format("the server said {}", shown(line.substr(2))));
          // Said while this command is the only one open: its reply's, as
          // collect() would file it (an EXISTS here is news a caller needs).
          if (line.starts_with("* ")) early_.push_back(line.substr(2));
        }
        part.assign(c, mark + 4, n);
        pos = mark + 4 + n;
        if (c.find("+}\r\n", pos) == std::string::npos) part.append(c, pos).append("\r\n");
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
  /// or a reply is malformed after they were sent, throws
  /// errc::outcome_unknown instead (they may or may not have been applied).
  std::vector<reply> run_write(const std::vector<std::string>& commands) {
    if (!connected()) connect();
    try {
      return run(commands);
    } catch (const std::system_error& e) {
      // A malformed reply closes the connection as a lost one does: the
      // write's own reply may have been among what was not read.
      if (e.code() == make_error_code(errc::connection_lost) || e.code() == make_error_code(errc::timed_out) ||
          e.code() == std::errc::protocol_error)
        throw std::system_error(make_error_code(errc::outcome_unknown), e.what());
      throw;
    }
  }

  /// Sends `commands` (without literals) at once and returns without
  /// waiting for their replies: the server works on them while the caller
  /// does other things (a write on another connection, say). The next
  /// run(), idle() or finish() reads their replies first and keeps them for
  /// finish(); what they say untagged of the mailbox's state (EXISTS,
  /// EXPUNGE, VANISHED: every line but a FETCH) also counts as the first
  /// reply's of the next run(), as if the commands had been sent with it.
  /// Throws: as run() (the commands may then have been applied or not);
  /// errc::invalid_argument for a command with a literal.
  void send_ahead(const std::vector<std::string>& commands) {
    if (!connected()) connect();
    std::string out;
    std::vector<std::string> tags;
    for (const auto& c : commands) {
      if (c.find("}\r\n") != std::string::npos)
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("dibs::imap: {}: the command '{}' has a literal, which send_ahead() "
                                            "cannot send: use run()",
                                            where(), shown(c)));
      tags.push_back(fmt::format("d{}", ++tag_));
      out.append(tags.back()).append(" ").append(c).append("\r\n");
    }
    send(out);
    ahead_.insert(ahead_.end(), tags.begin(), tags.end());
  }

  /// Returns: the replies of the commands sent by send_ahead() since the
  /// last finish(), in the order sent, waiting for those not read yet.
  /// Fewer replies than commands: the connection failed while they were
  /// read (the commands without a reply here may or may not have been
  /// applied). Throws: nothing for a failed connection; std::bad_alloc.
  std::vector<reply> finish() {
    try {
      read_ahead();
    } catch (const std::system_error&) {
    }
    return std::exchange(ahead_done_, {});
  }

  /// Throws: std::system_error for a reply that is not OK, naming the
  /// server, user, `what` was done, and what the server said.
  void check(const reply& r, std::string_view what) const {
    if (r.ok()) return;
    const bool not_connected = detail::icontains(r.text, detail::not_connected_text);
    const auto as = opts_.authzid.empty() ? opts_.user : opts_.authzid;
    throw std::system_error(
        code_of(r),
        fmt::format("dibs::imap: {} on {}: the server said {} {}{}{}{}{}", what, where(), r.status,
                    r.code.empty() ? "" : "[", r.code, r.code.empty() ? "" : "] ", r.text,
                    not_connected
                        ? fmt::format(" (Exchange Online accepted the login but could not open the mailbox '{}': "
                                      "usually IMAP is turned off for that mailbox, the token's user or service "
                                      "principal lacks FullAccess to it, or user=/options::authzid names the wrong "
                                      "mailbox for a shared one; a retry does not fix these)",
                                      as)
                        : std::string{}));
  }

  /// Waits in IDLE (RFC 2177) until the server reports a change of the
  /// selected mailbox (EXISTS, EXPUNGE, FETCH) or `wait` passes. Returns:
  /// true if something changed. Without IDLE on the server: waits and
  /// returns true.
  bool idle(std::chrono::milliseconds wait) {
    if (!has("IDLE")) {
      std::this_thread::sleep_for(wait);
      return true;
    }
    read_ahead();
    if (!connected()) connect();
    const auto tag = fmt::format("d{}", ++tag_);
    send(fmt::format("{} IDLE\r\n", tag));
    const auto until = deadline();
    for (;;) {
      const auto line = read_reply_line(until);
      if (line.starts_with("+")) break;
      if (line.starts_with(tag)) return true;  // refused: treat as a change and poll
    }
    bool changed = false;
    const auto end = std::chrono::steady_clock::now() + wait;
    while (!changed) {
      const auto left = end - std::chrono::steady_clock::now();
      if (left <= std::chrono::nanoseconds::zero() || !readable(std::chrono::duration_cast<std::chrono::milliseconds>(left)))
        break;
      const auto line = read_reply_line(deadline());
      if (detail::istarts_with(line, "* BYE"))
        fail(errc::connection_lost, fmt::format("the server said {}", shown(line.substr(2))));
      changed = line.find(" EXISTS") != std::string::npos || line.find(" EXPUNGE") != std::string::npos ||
                line.find(" FETCH") != std::string::npos || line.find(" RECENT") != std::string::npos;
    }
    send("DONE\r\n");
    collect({tag});
    return changed;
  }

  /// Closes the connection (logging out politely if it is open).
  void close() noexcept {
    if (connected()) {
      const std::string bye = fmt::format("d{} LOGOUT\r\n", ++tag_);
#if DIBS_IMAP_OPENSSL
      if (ssl_) {  // the socket is non-blocking: neither call waits
        ERR_clear_error();
        (void)SSL_write(ssl_, bye.data(), static_cast<int>(bye.size()));
        (void)SSL_shutdown(ssl_);
        ERR_clear_error();
      } else
#endif
      {
        dibs::detail::send_socket_nowait(fd_, bye.data(), bye.size());
      }
    }
    drop();
  }

  /// Closes the connection at once, as if it broke (for tests of failures).
  /// The TLS state is freed without a word to the server (no SSL_shutdown):
  /// in a child after fork() it is the parent's connection.
  void drop() noexcept {
#if DIBS_IMAP_OPENSSL
    if (ssl_) SSL_free(ssl_);
    ssl_ = nullptr;
#endif
    if (fd_ != dibs::detail::no_socket) dibs::detail::close_socket(fd_);
    fd_ = dibs::detail::no_socket;
    in_.clear();
    early_.clear();
    ahead_.clear();  // their replies never come
  }

private:
  [[noreturn]] void fail(std::error_code ec, std::string_view why) {
    drop();
    throw std::system_error(ec, redact(fmt::format("dibs::imap: {}: {}", where(), why)));
  }
  [[noreturn]] void fail(errc e, std::string_view why) { fail(make_error_code(e), why); }
  // A reply that breaks the protocol: the connection is closed (what else
  // is in flight cannot be read reliably: a write's reply among it is then
  // outcome_unknown through run_write()). Not transient: the same server
  // is likely to say the same again. During AUTHENTICATE the line is not
  // quoted: a server that echoes what it was sent would echo a secret,
  // perhaps cut where no redaction finds it.
  [[noreturn]] void malformed(std::string_view line, std::string_view why) {
    fail(std::make_error_code(std::errc::protocol_error),
         fmt::format("the server sent a malformed reply ({}): {}; the connection is closed (is it an IMAP "
                     "server? if so, report this to its operator)",
                     why,
                     secrets_.empty() ? fmt::format("'{}'", detail::excerpt(line))
                                      : std::string("not quoted, as it came during the login")));
  }

  // Returns: what a server sent (or a command), for a message: its secrets
  // cut out (redact()) first, then shortened and escaped (detail::excerpt);
  // the other way round an escaped or cut secret would not be found.
  std::string shown(std::string_view line) const { return detail::excerpt(redact(std::string(line))); }

  // Returns: `text` with every secret of the login under way (secrets_),
  // and the password while connecting, cut out: a server may quote what it
  // was sent in its reply, and messages quote servers.
  std::string redact(std::string text) const {
    auto cut = [&](const std::string& secret) {
      if (secret.size() < 4) return;  // too short to tell from other text; it is never echoed whole by a server
      for (auto at = text.find(secret); at != std::string::npos; at = text.find(secret, at))
        text.replace(at, secret.size(), "<secret>");
    };
    for (const auto& s : secrets_) cut(s);
    if (connecting_until_) {
      cut(opts_.password);
      cut(quoted_password());
    }
    return text;
  }

  // Returns: the password as quote() sends it, without the quotes ("" if it
  // is sent as a literal, as is, or needs no escaping).
  std::string quoted_password() const {
    auto q = quote(opts_.password);
    if (q.size() < 2 || q.front() != '"' || q.size() == opts_.password.size() + 2) return {};
    return q.substr(1, q.size() - 2);
  }

  static std::error_code code_of(const reply& r) {
    const std::string_view code = std::string_view(r.code).substr(0, r.code.find(' '));
    if (detail::iequals(code, "NONEXISTENT") || detail::iequals(code, "TRYCREATE"))
      return std::make_error_code(std::errc::no_such_file_or_directory);
    if (detail::iequals(code, "NOPERM") || detail::iequals(code, "AUTHORIZATIONFAILED") ||
        detail::iequals(code, "AUTHENTICATIONFAILED") || detail::iequals(code, "READ-ONLY"))
      return std::make_error_code(std::errc::permission_denied);
    if (detail::iequals(code, "OVERQUOTA")) return std::make_error_code(std::errc::no_space_on_device);
    if (detail::iequals(code, "ALREADYEXISTS")) return std::make_error_code(std::errc::file_exists);
    // The server failed (Dovecot: a file it cannot write; its log says which).
    if (detail::iequals(code, "SERVERBUG")) return std::make_error_code(std::errc::io_error);
    // Exchange Online's "User is authenticated but not connected.": a setup
    // error, not transient (detail::not_connected_text).
    if (detail::icontains(r.text, detail::not_connected_text)) return std::make_error_code(std::errc::permission_denied);
    // Busy or throttling (UNAVAILABLE, INUSE, LIMIT, THROTTLED, or the words
    // of detail::throttle_texts, such as Exchange Online's "Request is
    // throttled."): a retry after a backoff.
    if (detail::throttled(r.code, r.text)) return make_error_code(errc::contended);
    return make_error_code(errc::invalid_argument);
  }

  void connect() {
    drop();
#if !DIBS_IMAP_OPENSSL
    if (opts_.tls != tls_mode::none)
      throw std::system_error(
          std::make_error_code(std::errc::not_supported),
          fmt::format("dibs::imap: {}:{}: TLS (options::tls = {}) is not in this build: dibs::imap was built "
                      "without OpenSSL (DIBS_IMAP_OPENSSL is 0; on Windows, CMake found no OpenSSL for the "
                      "target). Build with an OpenSSL for this platform, or use tls_mode::none only for a "
                      "server on loopback or a network you trust. Nothing was sent",
                      opts_.host, opts_.port, opts_.tls == tls_mode::starttls ? "starttls" : "implicit"));
#endif
    dibs::detail::socket_startup();
    pid_ = dibs::detail::socket_owner();
    caps_.clear();
    const auto until = std::chrono::steady_clock::now() + opts_.timeout;
    // Every reply while connecting (greeting, STARTTLS, LOGIN) shares the
    // one deadline: a reconnect inside a timed call takes options::timeout
    // at most, not that much per step.
    connecting_until_ = until;
    struct done_connecting {
      session& s;
      ~done_connecting() { s.connecting_until_.reset(); }
    } guard{*this};
    open_socket(until);
    if (opts_.tls == tls_mode::implicit) handshake(until);
    const auto greeting = read_reply_line(until);
    if (!detail::istarts_with(greeting, "* OK") && !detail::istarts_with(greeting, "* PREAUTH"))
      fail(errc::connection_lost, fmt::format("the server greeted with '{}'", shown(greeting)));
    // What the server can do before the login: from the greeting, or asked.
    if (const auto open = greeting.find('['); open != std::string::npos &&
                                              detail::istarts_with(std::string_view(greeting).substr(open + 1), "CAPABILITY"))
      set_caps(greeting.substr(open + 1, greeting.find(']', open) - open - 1));
    else
      ask_caps();
    if (opts_.tls == tls_mode::starttls) {
      if (detail::istarts_with(greeting, "* PREAUTH"))
        fail(std::make_error_code(std::errc::not_supported),
             "the server greeted with PREAUTH, which leaves no way to STARTTLS; refusing to go on unprotected");
      if (!has("STARTTLS"))
        fail(std::make_error_code(std::errc::not_supported),
             "the server does not offer STARTTLS (tls_mode::starttls); use tls_mode::implicit on its TLS port "
             "(usually 993) if it has one. Nothing was sent in the clear");
      const auto r = run("STARTTLS");
      if (!r.ok())
        fail(std::make_error_code(std::errc::not_supported),
             fmt::format("the server refused STARTTLS: {} {}", r.status, r.text));
      // What came after the OK came before the handshake, unprotected: an
      // attacker's injection (CVE-2011-0411), never to be read as the server's.
      if (!in_.empty())
        fail(std::make_error_code(std::errc::protocol_error),
             "the server sent more after its OK to STARTTLS, before the TLS handshake; refusing it");
      handshake(until);
      ask_caps();  // what was said in the clear may have been forged: forget it
    }
    try {
      log_in();
    } catch (...) {  // whatever failed (a token provider's own exception too), never a half-open session
      drop();
      throw;
    }
  }

  // Returns: the mechanism to log in by, as options::auth says (see
  // auth_mechanism), for what the server announced. Throws: for options
  // that cannot go together (see the top of this header).
  auth_mechanism mechanism() {
    const bool token = static_cast<bool>(opts_.oauth2_token);
    switch (opts_.auth) {
      case auth_mechanism::automatic:
        if (token) {
          if (has("AUTH=OAUTHBEARER")) return auth_mechanism::oauthbearer;
          if (has("AUTH=XOAUTH2")) return auth_mechanism::xoauth2;
          std::string announced;
          for (const auto& c : caps_)
            if (detail::istarts_with(c, "AUTH=")) announced += (announced.empty() ? "" : " ") + c;
          fail(std::make_error_code(std::errc::not_supported),
               fmt::format("options::oauth2_token is set, but the server announces neither AUTH=OAUTHBEARER nor "
                           "AUTH=XOAUTH2 ({}): set options::auth to auth_mechanism::xoauth2 or oauthbearer to send "
                           "the token anyway. The token provider was not asked, and nothing was sent",
                           announced.empty() ? std::string("it announces no AUTH= mechanism")
                                             : fmt::format("it announces {}", announced)));
        }
        if (!opts_.authzid.empty() || (has("LOGINDISABLED") && has("AUTH=PLAIN"))) return auth_mechanism::plain;
        return auth_mechanism::login;
      case auth_mechanism::login:
        if (!opts_.authzid.empty())
          fail(std::make_error_code(std::errc::not_supported),
               fmt::format("LOGIN has no authorization identity, so it cannot log in as '{}' (options::authzid): "
                           "use auth_mechanism::plain (AUTHENTICATE PLAIN) or automatic. Nothing was sent",
                           opts_.authzid));
        return auth_mechanism::login;
      case auth_mechanism::xoauth2:
      case auth_mechanism::oauthbearer:
        if (!token)
          fail(errc::invalid_argument,
               fmt::format("options::auth is {} but options::oauth2_token is not set: give it a token provider "
                           "(such as imap::token_command(\"your-oauth2-helper\"))",
                           opts_.auth == auth_mechanism::xoauth2 ? "xoauth2" : "oauthbearer"));
        return opts_.auth;
      case auth_mechanism::plain: break;
    }
    return auth_mechanism::plain;
  }

  // Logs in on the connection just opened, by mechanism() (an OAuth2 token
  // the server refuses is renewed once through the provider and tried
  // again), and learns the logged-in state's capabilities.
  void log_in() {
    const auto mech = mechanism();
    // LOGINDISABLED on an unprotected connection (RFC 3501 6.2.3): no
    // password and no token goes out in the clear, whatever the mechanism.
    if (has("LOGINDISABLED") && opts_.tls == tls_mode::none)
      fail(std::make_error_code(std::errc::permission_denied),
           fmt::format("the server refuses logins on an unprotected connection (it announces LOGINDISABLED): set "
                       "options::tls to tls_mode::starttls (or tls_mode::implicit on its TLS port, usually 993). "
                       "{}",
                       mech == auth_mechanism::login || mech == auth_mechanism::plain
                           ? "The password was not sent"
                           : "The token provider was not asked, and no token was sent"));
    if (mech == auth_mechanism::login) {
      if (has("LOGINDISABLED"))
        fail(std::make_error_code(std::errc::permission_denied),
             "the server announces LOGINDISABLED even over TLS, and no AUTH=PLAIN: dibs::imap logs in "
             "with LOGIN, AUTHENTICATE PLAIN, XOAUTH2 or OAUTHBEARER");
      reply r;
      {
        // What the server says is not quoted with the password in it, as
        // sent or as quote() escaped it ("\"" and "\\").
        secrets_ = {opts_.password, quoted_password()};
        struct forget_guard {
          session& s;
          ~forget_guard() { s.forget_secrets(); }
        } guard{*this};
        std::string command = fmt::format("LOGIN {} {}", quote(opts_.user), quote(opts_.password));
        r = run(command);
        detail::forget(command);
        if (!r.ok()) refused(r, "LOGIN", {}, false);
      }
      return logged_in(r);
    }
#if !DIBS_IMAP_OPENSSL
    fail(std::make_error_code(std::errc::not_supported),
         fmt::format("AUTHENTICATE {} needs base64, which dibs::imap takes from OpenSSL, and this build has no "
                     "OpenSSL (DIBS_IMAP_OPENSSL is 0): build with an OpenSSL for this platform. Nothing was sent",
                     mech == auth_mechanism::plain     ? "PLAIN"
                     : mech == auth_mechanism::xoauth2 ? "XOAUTH2"
                                                       : "OAUTHBEARER"));
#else
    if (mech == auth_mechanism::plain) {
      auto response = detail::plain_response(opts_.authzid, opts_.user, opts_.password);
      auto password = opts_.password;
      sasl_result r;
      authenticate("PLAIN", response, password, r);
      if (!r.completion.ok()) refused(r.completion, "AUTHENTICATE PLAIN", {}, false);
      return logged_in(r.completion);
    }
    const std::string_view name = mech == auth_mechanism::xoauth2 ? "XOAUTH2" : "OAUTHBEARER";
    const auto how = fmt::format("AUTHENTICATE {}", name);
    const auto& as = opts_.authzid.empty() ? opts_.user : opts_.authzid;
    std::string first_status;  // the JSON status of the first refusal
    for (const bool refresh : {false, true}) {
      auto token = token_from(refresh);
      auto response = mech == auth_mechanism::xoauth2 ? detail::xoauth2_response(as, token)
                                                      : detail::oauthbearer_response(as, opts_.host, opts_.port, token);
      sasl_result r;
      try {
        authenticate(name, response, token, r);
      } catch (const std::system_error& e) {
        // The connection lost (a BYE, closed, no answer in time) once the
        // token was refused (a NO before this attempt, or the JSON error
        // challenge of this one): a refusal still, never transient (it
        // would be retried for ever, the provider asked twice each time).
        const bool lost = e.code() == make_error_code(errc::connection_lost) ||
                          e.code() == make_error_code(errc::timed_out);
        if (lost && (refresh || r.challenged)) lost_after_refusal(how, refresh ? first_status : r.status, refresh, e);
        throw;
      }
      if (r.completion.ok()) return logged_in(r.completion);
      // Busy or throttling: no fault of the token's, and no reason to renew
      // it; nor a refusal a renewed token would meet again (renewal_futile).
      if (refresh || detail::throttled(r.completion.code, r.completion.text) || renewal_futile(r))
        refused(r.completion, how, r.status, refresh);
      first_status = r.status;
    }
#endif
  }

  void logged_in(const reply& r) {
    if (detail::istarts_with(r.code, "CAPABILITY")) set_caps(r.code);
    else ask_caps();
  }

  // Throws: the login refused by `r` (to `how`: "LOGIN", "AUTHENTICATE
  // PLAIN"; `status`: an OAuth2 refusal's JSON status), transient if it
  // says the server is busy or throttling; `twice`: an OAuth2 token refused,
  // renewed through the provider, and refused again. The connection is dropped.
  [[noreturn]] void refused(const reply& r, std::string_view how, std::string_view status, bool twice) {
    drop();
    const bool transient = detail::throttled(r.code, r.text);
    const bool token = how.ends_with("XOAUTH2") || how.ends_with("OAUTHBEARER");
    const auto as = opts_.authzid.empty() ? std::string{} : fmt::format(" as '{}'", opts_.authzid);
    const auto said = redact(fmt::format("{}{}{}", r.code.empty() ? "" : fmt::format("[{}] ", r.code), r.text,
                                         status.empty() ? "" : fmt::format(" (status {})", status)));
    std::string why;
    if (transient) why = "; the server is busy or throttling: retry later";
    else if (twice)
      why = "; the token was refused twice, the second time just after the provider was asked to renew it "
            "(oauth2_token(true)): it is expired and was not renewed, is for another user, lacks the IMAP scope, "
            "or its grant was revoked";
    else if (token)
      why = "; check the token's user and scope (it was not renewed: a renewed token would be refused the same way)";
    else if (!opts_.authzid.empty())
      why = fmt::format("; check the user name and password, and that '{}' may log in as '{}'", opts_.user,
                        opts_.authzid);
    else why = "; check the user name and password";
    throw std::system_error(
        transient ? make_error_code(errc::connection_lost) : std::make_error_code(std::errc::permission_denied),
        redact(fmt::format("dibs::imap: {}:{} refused the login of user '{}'{}{}{}{}: {}{}", opts_.host, opts_.port,
                           opts_.user, as, how == "LOGIN" ? "" : " by ", how == "LOGIN" ? "" : how,
                           twice ? ", twice" : "", said, why)));
  }

  // Throws: std::errc::permission_denied (not transient), the OAuth2 token
  // refused by `how` (`status`: its JSON status), then the connection `e`
  // lost before the server's answer to the renewed token (`retry`) or to
  // the first (after its error challenge). The connection is dropped.
  [[noreturn]] void lost_after_refusal(std::string_view how, std::string_view status, bool retry,
                                       const std::system_error& e) {
    drop();
    const auto as = opts_.authzid.empty() ? std::string{} : fmt::format(" as '{}'", opts_.authzid);
    throw std::system_error(
        std::make_error_code(std::errc::permission_denied),
        redact(fmt::format("dibs::imap: {}:{} refused the OAuth2 token of user '{}'{} by {}{}, and {}: {}; check the "
                           "token's user and scope (an expired token the provider did not renew, another user's, "
                           "one without the IMAP scope, or a revoked grant)",
                           opts_.host, opts_.port, opts_.user, as, how,
                           status.empty() ? "" : fmt::format(" (status {})", status),
                           retry ? "the retry with a token renewed through the provider could not be made (the "
                                   "connection was lost before the server answered it)"
                                 : "the connection was lost before its final answer",
                           e.what())));
  }

  // Returns: a token from options::oauth2_token(refresh). The provider's
  // own time (a helper that renews a token over the network) is not the
  // server's: the connect's deadline moves by it. Throws: what the provider
  // throws, as a std::system_error of its code (std::errc::permission_denied
  // for an exception that is not a system_error), its message after the
  // server's and user's names; std::errc::permission_denied for an empty
  // token, errc::invalid_argument for one with control characters or
  // spaces (neither is quoted).
  std::string token_from(bool refresh) {
    const auto start = std::chrono::steady_clock::now();
    const auto asked = refresh ? ", asked to renew the token the server refused" : "";
    std::string token;
    try {
      token = opts_.oauth2_token(refresh);
    } catch (const std::system_error& e) {
      drop();
      throw std::system_error(e.code(), fmt::format("dibs::imap: {}: no OAuth2 token to log in with: the provider "
                                                    "(options::oauth2_token{}) failed: {}",
                                                    where(), asked, e.what()));
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const std::exception& e) {
      drop();
      throw std::system_error(std::make_error_code(std::errc::permission_denied),
                              fmt::format("dibs::imap: {}: no OAuth2 token to log in with: the provider "
                                          "(options::oauth2_token{}) failed: {}",
                                          where(), asked, e.what()));
    }
    if (connecting_until_) *connecting_until_ += std::chrono::steady_clock::now() - start;
    if (token.empty())
      fail(std::make_error_code(std::errc::permission_denied),
           fmt::format("no OAuth2 token to log in with: the provider (options::oauth2_token{}) returned an empty one",
                       asked));
    for (const char c : token)
      if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) {
        detail::forget(token);
        fail(errc::invalid_argument,
             fmt::format("the OAuth2 token the provider (options::oauth2_token{}) returned holds spaces or control "
                         "characters, which no access token has (a helper's output of several lines?)",
                         asked));
      }
    return token;
  }

#if DIBS_IMAP_OPENSSL
  struct sasl_result {
    reply completion;         // the tagged completion (secrets cut out)
    std::string status;       // the "status" of the JSON error of an OAuth2 refusal ("" if none came)
    bool challenged = false;  // a "+" came after the response was sent: an error challenge (a refusal)
  };

  // Returns: true if an OAuth2 refusal is one a renewed token would meet
  // again: a BAD or [CANNOT] (the server does not take the mechanism or the
  // request as sent), or RFC 7628's "insufficient_scope" or
  // "invalid_request" (the same grant gives the same scope).
  static bool renewal_futile(const sasl_result& r) {
    const auto code = std::string_view(r.completion.code).substr(0, r.completion.code.find(' '));
    return r.completion.status == "BAD" || detail::iequals(code, "CANNOT") || r.status == "insufficient_scope" ||
           r.status == "invalid_request";
  }

  // Runs one AUTHENTICATE `mech` with the client response `response`, sent
  // base64: on the AUTHENTICATE line where the server announces SASL-IR
  // (and options::sasl_ir), else after the server's "+". An OAuth2
  // mechanism's server refuses a token with a "+" challenge holding a JSON
  // error first: answered as RFC 7628 3.2.3 (OAUTHBEARER: ^A) and Google's
  // XOAUTH2 (an empty line) say, and its status kept; then its NO follows.
  // While this runs `secret` (the token or password), the response and
  // their base64 are cut out of every message (secrets_); at the end they
  // are forgotten, `response` and `secret` too. Effects: `out` filled as
  // the exchange goes (so a caller learns of an error challenge even when
  // the connection is then lost), the completion last.
  void authenticate(std::string_view mech, std::string& response, std::string& secret, sasl_result& out) {
    struct forget_guard {
      session& s;
      std::string& said;
      std::string& key;
      ~forget_guard() {
        s.forget_secrets();
        detail::forget(said);
        detail::forget(key);
      }
    } guard{*this, response, secret};
    secrets_ = {secret, detail::base64_encode(secret), response, detail::base64_encode(response)};
    const std::string& encoded = secrets_.back();
    const bool ir = opts_.sasl_ir && has("SASL-IR");
    const auto tag = fmt::format("d{}", ++tag_);
    {
      // RFC 4959: an empty initial response is sent as "=".
      auto line = fmt::format("{} AUTHENTICATE {}{}{}\r\n", tag, mech, ir ? " " : "",
                              ir ? (encoded.empty() ? std::string_view("=") : std::string_view(encoded)) : "");
      send(line);
      detail::forget(line);
    }
    bool sent = ir;
    const auto until = deadline();
    for (;;) {
      const auto line = read_reply_line(until);
      if (line.starts_with("+")) {
        if (!sent) {
          auto data = encoded + "\r\n";
          send(data);
          detail::forget(data);
          sent = true;
        } else if (!out.challenged) {
          if (const auto json = detail::base64_decode(std::string_view(line).substr(1)))
            out.status = redact(detail::sasl_error_status(*json));
          out.challenged = true;
          send(mech == "OAUTHBEARER" ? "AQ==\r\n" : mech == "XOAUTH2" ? "\r\n" : "*\r\n");
        } else {
          send("*\r\n");  // a server that asks on and on: cancel (RFC 3501 6.2.2); its BAD follows
        }
        continue;
      }
      if (line.starts_with("* ")) {
        if (detail::istarts_with(line, "* BYE"))
          fail(errc::connection_lost, fmt::format("the server said {} during AUTHENTICATE {}",
                                                  shown(line.substr(2)), mech));
        if (detail::istarts_with(line, "* CAPABILITY ")) set_caps(line.substr(2));
        continue;
      }
      if (!line.starts_with(tag + ' ')) continue;
      read_completion(line, out.completion);
      out.completion.code = redact(out.completion.code);
      out.completion.text = redact(out.completion.text);
      return;
    }
  }
#endif

  void forget_secrets() noexcept {
    for (auto& s : secrets_) detail::forget(s);
    secrets_.clear();
  }

  // Connects fd_ to the first address of the server that answers by
  // `until` (each address tried gets an equal share of the time left), and
  // leaves it non-blocking: every read and write after this poll()s with a
  // deadline. Throws: errc::timed_out if the time ran out (the server's
  // accept queue full, packets dropped); the connect's own error (refused,
  // unreachable: transient) otherwise; both name host and port.
  void open_socket(std::chrono::steady_clock::time_point until) {
    auto c = dibs::detail::connect_tcp(opts_.host, opts_.port, until);
    if (!c.resolved)
      throw std::system_error(make_error_code(errc::timed_out),
                              fmt::format("dibs::imap: cannot find server {}:{}: the name was not resolved within "
                                          "{} ms (options::timeout); is DNS reachable?",
                                          opts_.host, opts_.port, opts_.timeout.count()));
    if (c.resolve_error != 0)
      throw std::system_error(make_error_code(errc::connection_lost),
                              fmt::format("dibs::imap: cannot find server {}:{}: {}", opts_.host, opts_.port,
                                          dibs::detail::resolve_error_text(c.resolve_error)));
    fd_ = c.socket;
    if (fd_ != dibs::detail::no_socket) return;
    if (c.timed_out)
      throw std::system_error(make_error_code(errc::timed_out),
                              fmt::format("dibs::imap: cannot connect to {}:{} within {} ms (options::timeout): {}; "
                                          "is the IMAP server running and accepting connections?",
                                          opts_.host, opts_.port, opts_.timeout.count(), c.tried));
    throw std::system_error(c.error,
                            fmt::format("dibs::imap: cannot connect to {}:{} ({}); is the IMAP server running?",
                                        opts_.host, opts_.port, c.tried));
  }

  // Returns: when the reply being read must have come: options::timeout
  // from now, or sooner while connecting.
  std::chrono::steady_clock::time_point deadline() const {
    const auto until = std::chrono::steady_clock::now() + opts_.timeout;
    return connecting_until_ ? std::min(until, *connecting_until_) : until;
  }

  void set_caps(const std::string& caps) {
    caps_.clear();
    for (const auto& v : parse(caps)) caps_.push_back(v.text);
  }
  void ask_caps() {
    caps_.clear();
    const auto r = run("CAPABILITY");
    for (const auto& u : r.untagged)
      if (detail::istarts_with(u, "CAPABILITY")) set_caps(u);
  }

#if DIBS_IMAP_OPENSSL
  // TLS on the connected socket (implicit: at once; starttls: after the
  // server's OK), the server's certificate verified against the CA file or
  // the system's store, and that it names the host. The socket is
  // non-blocking (open_socket()): every TLS read and write poll()s with a
  // deadline. Throws: not transient for a certificate that does not verify
  // or a handshake the server or client refused; transient for a
  // connection lost or a handshake not done by `until`.
  void handshake(std::chrono::steady_clock::time_point until) {
    if (!ctx_) ctx_ = make_context();
    BIO* bio = detail::tls_bio_method() ? BIO_new(detail::tls_bio_method()) : nullptr;
    ssl_ = bio ? SSL_new(ctx_) : nullptr;
    if (!ssl_) {
      if (bio) BIO_free(bio);
      fail(std::make_error_code(std::errc::not_enough_memory), fmt::format("cannot set up TLS: {}", detail::tls_errors()));
    }
    BIO_set_data(bio, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd_)));
    BIO_set_init(bio, 1);
    SSL_set_bio(ssl_, bio, bio);
    const bool ip = dibs::detail::is_ip_address(opts_.host);
    if (!ip) SSL_set_tlsext_host_name(ssl_, opts_.host.c_str());  // SNI: never an address (RFC 6066 3)
    if (opts_.verify) {
      SSL_set_hostflags(ssl_, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
      const int set = ip ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl_), opts_.host.c_str())
                         : SSL_set1_host(ssl_, opts_.host.c_str());
      if (set != 1)
        fail(make_error_code(errc::invalid_argument),
             fmt::format("cannot verify the server's certificate against the host name '{}': {}", opts_.host,
                         detail::tls_errors()));
    }
    for (;;) {
      ERR_clear_error();
      const int rc = SSL_connect(ssl_);
      if (rc == 1) return;
      const int err = SSL_get_error(ssl_, rc);
      if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
        if (!wait_io(err == SSL_ERROR_WANT_WRITE, until))
          fail(errc::timed_out, fmt::format("the TLS handshake did not finish within {} ms", opts_.timeout.count()));
        continue;
      }
      const long verified = SSL_get_verify_result(ssl_);
      if (opts_.verify && verified != X509_V_OK) {
        const bool name = verified == X509_V_ERR_HOSTNAME_MISMATCH || verified == X509_V_ERR_IP_ADDRESS_MISMATCH;
        ERR_clear_error();
        fail(std::make_error_code(std::errc::permission_denied),
             fmt::format("TLS: the server's certificate does not verify: certificate verify failed: {} ({})",
                         X509_verify_cert_error_string(verified),
                         name ? fmt::format("it is not for '{}': connect by the name the certificate has", opts_.host)
                         : opts_.ca_file.empty()
                             ? std::string("checked against the system's CA store; set options::ca_file to the CA "
                                           "that signed it")
                             : fmt::format("checked against the CA file '{}'", opts_.ca_file)));
      }
      const auto why = detail::tls_errors();
      if (err == SSL_ERROR_SSL && why.find("unexpected eof") == std::string::npos)
        fail(std::make_error_code(std::errc::protocol_error),
             fmt::format("the TLS handshake failed: {}{}", why,
                         opts_.tls == tls_mode::implicit
                             ? "; is this a port with TLS from the first byte (usually 993)?"
                             : ""));
      fail(errc::connection_lost, fmt::format("the connection broke during the TLS handshake{}{}",
                                              why.empty() ? "" : ": ", why.empty() ? dibs::detail::last_socket_error_text() : why));
    }
  }

  SSL_CTX* make_context() const {
    SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
    if (!ctx)
      throw std::system_error(std::make_error_code(std::errc::not_enough_memory),
                              fmt::format("dibs::imap: cannot set up TLS: {}", detail::tls_errors()));
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_verify(ctx, opts_.verify ? SSL_VERIFY_PEER : SSL_VERIFY_NONE, nullptr);
    if (opts_.verify) {
      const int ok = opts_.ca_file.empty() ? SSL_CTX_set_default_verify_paths(ctx)
                                           : SSL_CTX_load_verify_locations(ctx, opts_.ca_file.c_str(), nullptr);
      if (ok != 1) {
        const auto why = detail::tls_errors();
        SSL_CTX_free(ctx);
        throw std::system_error(
            make_error_code(errc::invalid_argument),
            opts_.ca_file.empty()
                ? fmt::format("dibs::imap: {}: cannot load the system's CA store: {}", where(), why)
                : fmt::format("dibs::imap: {}: cannot read the CA file '{}': {}", where(), opts_.ca_file, why));
      }
    }
    return ctx;
  }

  // Reads what the server sent over TLS into in_. Returns: false if nothing
  // came by `until`. What OpenSSL has already decrypted (SSL_pending) is
  // taken first: SSL_read comes before every poll().
  bool tls_read(std::chrono::steady_clock::time_point until) {
    char buf[65536];
    for (;;) {
      ERR_clear_error();
      const int n = SSL_read(ssl_, buf, static_cast<int>(sizeof buf));
      if (n > 0) {
        in_.append(buf, static_cast<std::size_t>(n));
        return true;
      }
      const int err = SSL_get_error(ssl_, n);
      if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
        if (!wait_io(err == SSL_ERROR_WANT_WRITE, until)) return false;
        continue;
      }
      if (err == SSL_ERROR_ZERO_RETURN) fail(errc::connection_lost, "the server closed the connection");
      const auto why = detail::tls_errors();
      fail(errc::connection_lost, fmt::format("reading failed: {}", why.empty() ? dibs::detail::last_socket_error_text() : why));
    }
  }

  void tls_send(const std::string& data) {
    const auto until = deadline();
    for (std::size_t done = 0; done < data.size();) {
      ERR_clear_error();
      const int n = SSL_write(ssl_, data.data() + done, static_cast<int>(std::min<std::size_t>(data.size() - done, INT_MAX)));
      if (n > 0) {
        done += static_cast<std::size_t>(n);
        continue;
      }
      const int err = SSL_get_error(ssl_, n);
      if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
        if (!wait_io(err == SSL_ERROR_WANT_WRITE, until))
          fail(errc::timed_out, fmt::format("sending did not finish within {} ms", opts_.timeout.count()));
        continue;
      }
      const auto why = detail::tls_errors();
      fail(errc::connection_lost, fmt::format("sending failed: {}", why.empty() ? dibs::detail::last_socket_error_text() : why));
    }
  }

#else
  // Without OpenSSL, connect() refuses TLS before it connects: never reached.
  void handshake(std::chrono::steady_clock::time_point) {}
  bool tls_read(std::chrono::steady_clock::time_point) { return false; }
  void tls_send(const std::string&) {}
#endif  // DIBS_IMAP_OPENSSL

  // Waits until the socket can be written (`write`) or read. Returns:
  // false if `until` passed first.
  bool wait_io(bool write, std::chrono::steady_clock::time_point until) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    return dibs::detail::wait_socket(fd_, write, left) != 0;  // ready, or an error that the next call reports
  }

  void send(const std::string& data) {
    if (ssl_) return tls_send(data);
    const auto until = deadline();
    for (std::size_t done = 0; done < data.size();) {
      const auto n = dibs::detail::send_socket(fd_, data.data() + done, data.size() - done);
      if (n < 0 && dibs::detail::socket_would_block()) {  // the server reads slower than we write
        if (!wait_io(true, until))
          fail(errc::timed_out, fmt::format("sending did not finish within {} ms", opts_.timeout.count()));
        continue;
      }
      if (n < 0) fail(errc::connection_lost, fmt::format("sending failed: {}", dibs::detail::last_socket_error_text()));
      done += static_cast<std::size_t>(n);
    }
  }

  bool readable(std::chrono::milliseconds wait) {
    if (!in_.empty()) return true;
    if (ssl_) return tls_read(std::chrono::steady_clock::now() + wait);
    return dibs::detail::wait_socket(fd_, false, wait) > 0;
  }

  void fill(std::chrono::steady_clock::time_point until) {
    if (ssl_) {
      if (!tls_read(until)) fail(errc::timed_out, fmt::format("no reply within {} ms", opts_.timeout.count()));
      return;
    }
    char buf[65536];
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !readable(left))
        fail(errc::timed_out, fmt::format("no reply within {} ms", opts_.timeout.count()));
      const auto n = dibs::detail::recv_socket(fd_, buf, sizeof buf);
      if (n < 0 && dibs::detail::socket_would_block()) continue;  // woken for nothing: wait again
      if (n <= 0)
        fail(errc::connection_lost,
             n == 0 ? std::string("the server closed the connection") : dibs::detail::last_socket_error_text());
      in_.append(buf, static_cast<std::size_t>(n));
      return;
    }
  }

  // One logical line: a line, and if it ends in a literal "{n}", its n
  // bytes and the rest of the line after them, and so on; never more than
  // options::max_line bytes of it (a literal announced larger is refused
  // before it is read: the server may lie about its size).
  std::string read_line(std::chrono::steady_clock::time_point until) {
    const std::size_t limit = std::min<std::size_t>(opts_.max_line, SIZE_MAX / 2);  // SIZE_MAX: no limit, no wrap
    std::string line;
    std::size_t scanned = 0;
    for (;;) {
      const auto eol = in_.find("\r\n", scanned);
      if (eol == std::string::npos) {
        if (line.size() + in_.size() > limit + 1)
          malformed(line.empty() ? std::string_view(in_) : std::string_view(line),
                    fmt::format("a line longer than options::max_line ({} bytes) without its end", opts_.max_line));
        scanned = in_.size() > 0 ? in_.size() - 1 : 0;
        fill(until);
        continue;
      }
      std::optional<std::uint64_t> n;
      if (eol > 0 && in_[eol - 1] == '}') {
        const auto open = in_.rfind('{', eol);
        if (open != std::string::npos) {
          const auto digits = std::string_view(in_).substr(open + 1, eol - 1 - (open + 1));
          n = detail::to_number(digits, UINT64_MAX);
          // Digits only, yet no number: more than 64 bits' worth.
          if (!n && !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos)
            n = UINT64_MAX;
        }
      }
      const std::size_t head = line.size() + eol + 2;
      if (head > limit + 2 || (n && *n > limit + 2 - head))
        malformed(line.empty() ? std::string_view(in_).substr(0, eol) : std::string_view(line),
                  n ? fmt::format("a literal of {} bytes, more than options::max_line ({} bytes) allows", *n,
                                  opts_.max_line)
                    : fmt::format("a line longer than options::max_line ({} bytes)", opts_.max_line));
      if (!n) {
        line.append(in_, 0, eol);
        in_.erase(0, eol + 2);
        return line;
      }
      const auto size = eol + 2 + static_cast<std::size_t>(*n);
      while (in_.size() < size) fill(until);
      line.append(in_, 0, size);
      in_.erase(0, size);
      scanned = 0;
    }
  }

  // read_line(), and the line's numbers checked (detail::malformed).
  std::string read_reply_line(std::chrono::steady_clock::time_point until) {
    auto line = read_line(until);
    if (const auto why = detail::malformed(line); !why.empty()) malformed(line, why);
    return line;
  }

  // Reads the replies of what send_ahead() sent, for finish(); what they
  // say of the mailbox's state goes to the next collect() as well.
  void read_ahead() {
    if (ahead_.empty()) return;
    auto early = std::exchange(early_, {});  // said before these commands: the next run's
    auto replies = collect(std::exchange(ahead_, {}));
    for (auto& r : replies)
      for (const auto& line : r.untagged) {
        const auto sp = line.find(' ');
        if (sp == std::string::npos || !detail::istarts_with(std::string_view(line).substr(sp + 1), "FETCH"))
          early.push_back(line);
      }
    early_ = std::move(early);
    ahead_done_.insert(ahead_done_.end(), std::make_move_iterator(replies.begin()), std::make_move_iterator(replies.end()));
  }

  std::vector<reply> collect(const std::vector<std::string>& tags) {
    std::vector<reply> replies(tags.size());
    std::vector<bool> done(tags.size());
    if (!tags.empty()) replies.front().untagged = std::exchange(early_, {});
    const auto until = deadline();
    // i: the first command not yet completed (untagged lines go to it).
    for (std::size_t i = 0; i < tags.size(); i = static_cast<std::size_t>(std::find(done.begin(), done.end(), false) - done.begin())) {
      auto line = read_reply_line(until);
      if (line.starts_with("* ")) {
        if (detail::istarts_with(line, "* BYE"))
          fail(errc::connection_lost, fmt::format("the server said {}", shown(line.substr(2))));
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
      done[static_cast<std::size_t>(it - tags.begin())] = true;
      read_completion(line, replies[static_cast<std::size_t>(it - tags.begin())]);
    }
    return replies;
  }

  // Effects: r's status (upper-cased), code and text from the tagged
  // completion `line` ("tag STATUS [CODE] text").
  static void read_completion(std::string_view line, reply& r) {
    const auto space = line.find(' ');
    auto rest = line.substr(space == std::string_view::npos ? line.size() : space + 1);
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

  options opts_;
  dibs::detail::socket_handle fd_ = dibs::detail::no_socket;
#if DIBS_IMAP_OPENSSL
  SSL_CTX* ctx_ = nullptr;  // made at the first TLS connection, kept for the next

  void free_context() noexcept {
    if (ctx_) SSL_CTX_free(ctx_);
    ctx_ = nullptr;
  }
  SSL* ssl_ = nullptr;      // the connection's TLS state (null: plain)
#else
  void free_context() noexcept {}
  static constexpr std::nullptr_t ssl_ = nullptr;  // no TLS in this build: always plain
#endif
  // While connecting: when the whole of it must be done.
  std::optional<std::chrono::steady_clock::time_point> connecting_until_;
  dibs::detail::socket_pid pid_ = 0;
  std::uint64_t tag_ = 0;
  std::string in_;
  std::vector<std::string> early_;  // untagged lines read while a literal waited for "+", for the next collect()
  std::vector<std::string> ahead_;  // tags of commands sent by send_ahead() whose replies are not read yet
  std::vector<reply> ahead_done_;   // their replies, read, for finish()
  std::vector<std::string> caps_;
  // While a login is under way: its password or token, the client response
  // and their base64, cut out of every message (redact()).
  std::vector<std::string> secrets_;
};

}  // namespace dibs::imap
