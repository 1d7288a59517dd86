// The Dovecot of the tests (started by scripts/imap.sh through the ctest
// fixture `imap`, its directory in DIBS_IMAP_DIR): connection options, a
// fresh folder per test, crashing and restarting the server, a plain
// session's view of a folder (what a person's mail client would see), and
// OAuth2 access tokens the server takes (JWTs signed with its test key).
#pragma once

#include <dibs/imap/client.hpp>

#include <functional>
#include <memory>
#include <algorithm>
#include <system_error>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "support.hpp"

namespace dibs_test::imap {

inline std::string dir() {
  const char* d = std::getenv("DIBS_IMAP_DIR");
  if (!d) throw std::runtime_error("DIBS_IMAP_DIR is not set: run the IMAP tests through ctest (fixture imap)");
  return d;
}

/// Returns: the value of `name` in DIR/env ("" if it has none).
inline std::string env(const std::string& name) {
  std::ifstream in(dir() + "/env");
  if (!in) throw std::runtime_error("no " + dir() + "/env: was the server started (scripts/imap.sh start)?");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with(name + "=")) return line.substr(name.size() + 1);
  return {};
}

/// Returns: the server of the tests, as DIR/env says (user dibs), plain.
inline dibs::imap::options options() {
  dibs::imap::options o;
  o.host = env("DIBS_IMAP_HOST");
  o.port = env("DIBS_IMAP_PORT");
  o.user = env("DIBS_IMAP_USER");
  o.password = env("DIBS_IMAP_PASSWORD");
  o.timeout = std::chrono::seconds{30};
  return o;
}

/// Returns: `s` in base64url without padding (RFC 7515 2), as JWTs have it.
inline std::string base64url(std::string_view s) {
  auto out = dibs::imap::detail::base64_encode(s);
  while (!out.empty() && out.back() == '=') out.pop_back();
  for (auto& c : out) c = c == '+' ? '-' : c == '/' ? '_' : c;
  return out;
}

/// Returns: an OAuth2 access token the tests' server takes for `user` (its
/// oauth2 passdb checks it locally, scripts/imap.sh): a JWT signed HS256
/// with DIBS_IMAP_OAUTH2_KEY (or with `key`, base64, when given: a key the
/// server does not have), "sub" `user`, expiring `expires_in` from now
/// (negative: expired already), issued an hour ago.
inline std::string jwt(const std::string& user, std::chrono::seconds expires_in = std::chrono::hours{1},
                       const std::string& key = {}) {
  const auto k = dibs::imap::detail::base64_decode(key.empty() ? env("DIBS_IMAP_OAUTH2_KEY") : key);
  if (!k || k->empty())
    throw std::runtime_error("no DIBS_IMAP_OAUTH2_KEY in " + dir() + "/env: was the server started by this imap.sh?");
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch());
  const auto signed_part =
      base64url(R"({"alg":"HS256","typ":"JWT"})") + "." +
      base64url(fmt::format(R"({{"sub":"{}","iat":{},"exp":{}}})", user, (now - std::chrono::hours{1}).count(),
                            (now + expires_in).count()));
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), k->data(), static_cast<int>(k->size()), reinterpret_cast<const unsigned char*>(signed_part.data()),
            signed_part.size(), mac, &len))
    throw std::runtime_error("HMAC-SHA256 failed");
  return signed_part + "." + base64url(std::string_view(reinterpret_cast<const char*>(mac), len));
}

/// Returns: the same server over TLS (the fixture starts it with --tls):
/// STARTTLS on the plain port, or implicit TLS on DIBS_IMAP_TLS_PORT, the
/// certificate verified against the test CA (DIBS_IMAP_CA_FILE).
inline dibs::imap::options tls_options(dibs::imap::tls_mode mode) {
  auto o = options();
  o.tls = mode;
  o.ca_file = env("DIBS_IMAP_CA_FILE");
  if (mode == dibs::imap::tls_mode::implicit) o.port = env("DIBS_IMAP_TLS_PORT");
  if (o.ca_file.empty() || (mode == dibs::imap::tls_mode::implicit && o.port.empty()))
    throw std::runtime_error("the tests' server runs without TLS: start it with scripts/imap.sh start DIR --tls");
  return o;
}

/// Returns: a folder name no test used before ("t-<stem>-<hex>").
inline std::string fresh_folder(const std::string& stem) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("t-{}-{:x}", stem, rng() & 0xffffffffffull);
}

/// Runs scripts/imap.sh `cmd` on the tests' server (kill, restart).
inline void script(const std::string& cmd) {
  const std::string line = std::string(DIBS_SOURCE_DIR) + "/scripts/imap.sh " + cmd + " " + dir() + " >/dev/null";
  if (sh(line) != 0) throw std::runtime_error("failed: " + line);
}
inline void kill_server() { script("kill"); }
inline void restart_server() { script("restart"); }

/// Returns: the directory of `folder` of user dibs in the server's sdbox
/// mail (DIR/home names where the server keeps its files).
inline std::filesystem::path folder_dir(const std::string& folder) {
  std::ifstream in(dir() + "/home");
  std::string home;
  std::getline(in, home);
  if (home.empty()) home = dir();
  return std::filesystem::path(home) / "mail" / "dibs" / "mailboxes" / folder;
}

/// Returns: the number `item` (MESSAGES, UIDVALIDITY, ...) of STATUS `folder`.
inline std::uint64_t status(dibs::imap::session& s, const std::string& folder, const std::string& item) {
  const auto r = s.run(fmt::format("STATUS {} ({})", dibs::imap::quote(folder), item));
  s.check(r, "STATUS " + folder);
  for (const auto& u : r.untagged) {
    const auto v = dibs::imap::parse(u);
    if (v.size() < 3 || !v[0].is("STATUS")) continue;
    const auto& items = v.back().items;
    for (std::size_t i = 0; i + 1 < items.size(); ++i)
      if (items[i].is(item) && items[i + 1].number()) return *items[i + 1].number();
  }
  throw std::runtime_error("no " + item + " in the STATUS reply for " + folder);
}

/// Returns: the number of messages in `folder`.
inline std::uint64_t messages(dibs::imap::session& s, const std::string& folder) {
  return status(s, folder, "MESSAGES");
}

/// APPENDs `text` (a whole message, CRLF line ends) to `folder`. Returns: its UID.
inline std::uint32_t append(dibs::imap::session& s, const std::string& folder, const std::string& text) {
  const auto r = s.run(fmt::format("APPEND {} {{{}+}}\r\n{}", dibs::imap::quote(folder), text.size(), text));
  s.check(r, "APPEND to " + folder);
  const auto fields = dibs::imap::parse(r.code);
  if (fields.size() < 3 || !fields[0].is("APPENDUID") || !fields[2].number())
    throw std::runtime_error("no APPENDUID in: " + r.code);
  return static_cast<std::uint32_t>(*fields[2].number());
}

/// Returns: the UIDs of every message in `folder` (selects it).
inline std::set<std::uint32_t> all_uids(dibs::imap::session& s, const std::string& folder) {
  s.check(s.run(fmt::format("SELECT {}", dibs::imap::quote(folder))), "SELECT " + folder);
  const auto r = s.run("UID SEARCH ALL");
  s.check(r, "UID SEARCH ALL in " + folder);
  std::set<std::uint32_t> out;
  for (const auto& u : r.untagged) {
    const auto v = dibs::imap::parse(u);
    if (v.empty() || !v[0].is("SEARCH")) continue;
    for (std::size_t i = 1; i < v.size(); ++i)
      if (v[i].number()) out.insert(static_cast<std::uint32_t>(*v[i].number()));
  }
  return out;
}

/// Returns: the Subject header line of message `uid` in the selected folder ("" if none).
inline std::string subject(dibs::imap::session& s, std::uint32_t uid) {
  const auto r = s.run(fmt::format("UID FETCH {} (BODY.PEEK[HEADER.FIELDS (SUBJECT)])", uid));
  s.check(r, "UID FETCH");
  for (const auto& u : r.untagged) {
    const auto v = dibs::imap::parse(u);
    if (v.size() < 3 || !v[1].is("FETCH")) continue;
    const auto& items = v[2].items;
    for (std::size_t i = 0; i + 1 < items.size(); ++i)
      if (dibs::imap::detail::istarts_with(items[i].text, "BODY[HEADER")) {
        auto text = items[i + 1].text;
        while (!text.empty() && (text.back() == '\r' || text.back() == '\n')) text.pop_back();
        return text;
      }
  }
  return {};
}


// A token provider that gives `tokens` in turn (the last one again when
// they run out) and records how it was called (refresh or not).
struct token_script {
  std::vector<std::string> tokens;
  std::shared_ptr<std::vector<bool>> calls = std::make_shared<std::vector<bool>>();
  std::function<std::string(bool)> provider() const {
    return [t = tokens, c = calls](bool refresh) {
      c->push_back(refresh);
      return t[std::min(c->size(), t.size()) - 1];
    };
  }
};

// What a logged-in session must be able to do: a folder of its own, a
// message in, its Subject back (`subject_line`: the header line appended).
inline void round_trip(dibs::imap::session& s, const std::string& stem, const std::string& subject_line) {
  const auto folder = fresh_folder(stem);
  s.check(s.run("CREATE " + dibs::imap::quote(folder)), "CREATE");
  const auto uid = append(s, folder, subject_line + "\r\n\r\nhello\r\n");
  CHECK(all_uids(s, folder) == std::set<std::uint32_t>{uid});
  CHECK(subject(s, uid) == subject_line);
  s.check(s.run("CLOSE"), "CLOSE");
  s.check(s.run("DELETE " + dibs::imap::quote(folder)), "DELETE");
}

// Returns: the error of opening a session with `o` (fails the test if it opens).
inline std::system_error refusal(const dibs::imap::options& o) {
  try {
    dibs::imap::session s{o};
  } catch (const std::system_error& e) {
    return e;
  }
  FAIL("the session opened");
  throw std::logic_error("unreachable");
}

}  // namespace dibs_test::imap
