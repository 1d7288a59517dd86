// dibs::imap's logins other than LOGIN, against the tests' Dovecot
// (scripts/imap.sh: its oauth2 passdb validates JWTs locally, signed with
// the key in DIBS_IMAP_OAUTH2_KEY; `dibs` is a master user): XOAUTH2 and
// OAUTHBEARER with and without SASL-IR, a SELECT and an APPEND after each;
// AUTHENTICATE PLAIN, and as the master user into `other`'s mailbox (not as
// `third`); XOAUTH2 and OAUTHBEARER with an authorization identity (dibs's
// token into other's mailbox, in Dovecot's master-user form `other*dibs`:
// the only form Dovecot 2.3 takes; `other` with dibs's token and third's
// token as `other*third` refused); login counts read from Dovecot's log,
// polled for, of logins only these tests make; an expired token renewed
// through the provider, called again after a reconnect; tokens for another
// user, signed with another key, or no JWT at all, refused twice and not
// transient; secrets in no message, nor in the output of the demo run with
// --imap-token-cmd. The wire forms,
// throttling words and the failures a scripted server makes (a connection
// cut mid-AUTHENTICATE, a malformed reply during it, a provider that
// throws): imap_client_test.cpp.
#include <dibs/imap/client.hpp>

#include <catch2/catch.hpp>

#include "imap_support.hpp"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace imap = dibs_test::imap;
using Catch::Contains;
using dibs::imap::auth_mechanism;

namespace auth_test {

// Returns: the tests' server, logging in as `user` (dibs unless said) with
// the tokens of `tokens` (no password) by `mech`.
dibs::imap::options oauth(const imap::token_script& tokens, auth_mechanism mech = auth_mechanism::automatic,
                          const std::string& user = {}) {
  auto o = imap::options();
  if (!user.empty()) o.user = user;
  o.password.clear();
  o.oauth2_token = tokens.provider();
  o.auth = mech;
  return o;
}

// Returns: how many logins of `user` by `method` the server's log shows
// ("imap-login: Login: user=<dibs>, method=XOAUTH2, ...").
std::size_t logins(const std::string& user, const std::string& method) {
  const auto log = dibs_test::slurp(imap::dir() + "/dovecot.log");
  const auto needle = fmt::format("Login: user=<{}>, method={},", user, method);
  std::size_t n = 0;
  for (auto at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) ++n;
  return n;
}

// Returns: the number of logins of `user` by `method` in the log once it
// shows `expected` of them or more (the log process writes a login's line
// some time after its OK was sent, later on a loaded machine), or after
// 120 s. A test counting them exactly logs in as a user and by a mechanism
// no other test's successful logins use (`third`; dibs logs in by LOGIN,
// logged as method=PLAIN, all over the suite, and a line of an earlier
// test written late would be counted).
std::size_t logins_reach(const std::string& user, const std::string& method, std::size_t expected) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds{120};
  auto n = logins(user, method);
  while (n < expected && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds{20});
    n = logins(user, method);
  }
  return n;
}

// Returns: false, and says where, if `secret` or its base64 is in `text`.
bool clean_of(std::string_view text, const std::string& secret) {
  for (const auto& s : {secret, dibs::imap::detail::base64_encode(secret)})
    if (text.find(s) != std::string_view::npos) {
      UNSCOPED_INFO("a secret in: " << text);
      return false;
    }
  return true;
}

// Returns: the demo (examples/shared_inbox), built beside this test program
// ($DIBS_SHARED_INBOX names another), or "" if it was not built.
std::string demo_program() {
  if (const char* p = std::getenv("DIBS_SHARED_INBOX")) return p;
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  const auto demo = self.parent_path().parent_path() / "examples" / "shared_inbox";
  return std::filesystem::exists(demo) ? demo.string() : std::string{};
}

}  // namespace auth_test

TEST_CASE("XOAUTH2 and OAUTHBEARER, with SASL-IR and without: logged in, SELECT and APPEND work, the log names the mechanism", "[server-alone]") {
  for (const auto mech : {auth_mechanism::xoauth2, auth_mechanism::oauthbearer, auth_mechanism::automatic})
    for (const bool sasl_ir : {true, false}) {
      // automatic: OAUTHBEARER, which Dovecot announces.
      const std::string method = mech == auth_mechanism::xoauth2 ? "XOAUTH2" : "OAUTHBEARER";
      INFO(method << (mech == auth_mechanism::automatic ? " (automatic)" : "") << (sasl_ir ? " with SASL-IR" : " without"));
      // As third: the log is counted (see logins_reach).
      const imap::token_script tokens{{imap::jwt("third")}};
      auto o = auth_test::oauth(tokens, mech, "third");
      o.sasl_ir = sasl_ir;
      const auto before = auth_test::logins("third", method);
      dibs::imap::session s{o};
      CHECK(s.has("IDLE"));  // the logged-in state's capabilities
      imap::round_trip(s, "oauth", "Subject: logged in");
      CHECK(*tokens.calls == std::vector<bool>{false});
      CHECK(auth_test::logins_reach("third", method, before + 1) == before + 1);
    }
}

TEST_CASE("AUTHENTICATE PLAIN: a user's own mailbox, dibs as master user into other's (seen by other), not as third", "[server-alone]") {
  auto plain = imap::options();
  plain.auth = auth_mechanism::plain;
  {
    // As third: the log is counted (see logins_reach).
    plain.user = "third";
    plain.password = "third-secret";
    const auto before = auth_test::logins("third", "PLAIN");
    dibs::imap::session s{plain};
    imap::round_trip(s, "plain", "Subject: logged in");
    CHECK(auth_test::logins_reach("third", "PLAIN", before + 1) == before + 1);
  }
  // dibs, a master user, logs in as other (automatic: PLAIN, for the authzid).
  auto as_other = imap::options();
  as_other.authzid = "other";
  const auto folder = imap::fresh_folder("master");
  std::uint32_t uid = 0;
  {
    dibs::imap::session s{as_other};
    s.check(s.run("CREATE " + dibs::imap::quote(folder)), "CREATE");
    uid = imap::append(s, folder, "Subject: for other\r\n\r\nput there by dibs\r\n");
  }
  auto own = imap::options();
  own.user = "other";
  own.password = "other-secret";
  {
    dibs::imap::session s{own};
    CHECK(imap::all_uids(s, folder) == std::set<std::uint32_t>{uid});
    CHECK(imap::subject(s, uid) == "Subject: for other");
    s.check(s.run("CLOSE"), "CLOSE");
    s.check(s.run("DELETE " + dibs::imap::quote(folder)), "DELETE");
  }
  {  // dibs's own mailbox has no such folder: the login above was other's
    dibs::imap::session s{imap::options()};
    CHECK_FALSE(s.run(fmt::format("STATUS {} (MESSAGES)", dibs::imap::quote(folder))).ok());
  }
  // third is no master user.
  auto third = imap::options();
  third.user = "third";
  third.password = "third-secret";
  third.authzid = "other";
  const auto e = imap::refusal(third);
  CHECK(e.code() == std::errc::permission_denied);
  CHECK_FALSE(dibs::is_transient(e.code()));
  CHECK_THAT(e.what(), Contains(third.host + ":" + third.port) && Contains("user 'third' as 'other'") &&
                           Contains("AUTHENTICATE PLAIN") && Contains("that 'third' may log in as 'other'"));
  CHECK(auth_test::clean_of(e.what(), "third-secret"));
  // LOGIN cannot carry the authorization identity.
  as_other.auth = auth_mechanism::login;
  CHECK(imap::refusal(as_other).code() == std::errc::not_supported);
}

// The authorization identity with a token (Exchange's shared-mailbox form:
// XOAUTH2's user=, OAUTHBEARER's a= naming another mailbox than the
// token's user). Dovecot 2.3.19 checks the token's user ("sub") against
// that name and has no rule letting one user's token into another's
// mailbox, save its master-user form: the name `other*dibs`
// (auth_master_user_separator) and a master oauth2 passdb that takes dibs's
// tokens (scripts/imap.sh). So the identity sent here is `other*dibs`,
// which Exchange would not take; the plain `other` with dibs's token is
// refused, as on Exchange without FullAccess.
TEST_CASE("XOAUTH2 and OAUTHBEARER with an authzid: dibs's token into other's mailbox (Dovecot's master form), refused as plain 'other' and for third") {
  for (const auto mech : {auth_mechanism::xoauth2, auth_mechanism::oauthbearer}) {
    const std::string method = mech == auth_mechanism::xoauth2 ? "XOAUTH2" : "OAUTHBEARER";
    INFO(method);
    const imap::token_script tokens{{imap::jwt("dibs")}};
    auto o = auth_test::oauth(tokens, mech);
    o.authzid = "other*dibs";
    const auto folder = imap::fresh_folder("oauth-as");
    // Only this test logs into other's mailbox with a token: counted exactly.
    const auto before = auth_test::logins("other", method);
    std::uint32_t uid = 0;
    {
      dibs::imap::session s{o};
      s.check(s.run("CREATE " + dibs::imap::quote(folder)), "CREATE");
      uid = imap::append(s, folder, "Subject: for other by token\r\n\r\nput there with dibs's token\r\n");
    }
    CHECK(*tokens.calls == std::vector<bool>{false});
    CHECK(auth_test::logins_reach("other", method, before + 1) == before + 1);
    auto own = imap::options();
    own.user = "other";
    own.password = "other-secret";
    {
      dibs::imap::session s{own};
      CHECK(imap::all_uids(s, folder) == std::set<std::uint32_t>{uid});
      CHECK(imap::subject(s, uid) == "Subject: for other by token");
      s.check(s.run("CLOSE"), "CLOSE");
      s.check(s.run("DELETE " + dibs::imap::quote(folder)), "DELETE");
    }
    {  // not in dibs's own mailbox
      dibs::imap::session s{imap::options()};
      CHECK_FALSE(s.run(fmt::format("STATUS {} (MESSAGES)", dibs::imap::quote(folder))).ok());
    }
    // dibs's token for 'other' as such, and third's in the master form: refused
    // twice (renewed once), permission_denied, not transient.
    struct attempt {
      std::string token_user, authzid;
    };
    for (const auto& [token_user, authzid] : {attempt{"dibs", "other"}, attempt{"third", "other*third"}}) {
      INFO(token_user << "'s token as " << authzid);
      const imap::token_script refused_tokens{{imap::jwt(token_user)}};
      auto r = auth_test::oauth(refused_tokens, mech, token_user);
      r.authzid = authzid;
      const auto e = imap::refusal(r);
      CHECK(e.code() == std::errc::permission_denied);
      CHECK_FALSE(dibs::is_transient(e.code()));
      CHECK_THAT(e.what(), Contains(fmt::format("user '{}' as '{}'", token_user, authzid)) &&
                               Contains("AUTHENTICATE " + method + ", twice"));
      CHECK(*refused_tokens.calls == std::vector<bool>{false, true});
    }
  }
}

TEST_CASE("an expired token is renewed through the provider once, and the provider is asked again after a reconnect") {
  const imap::token_script tokens{{imap::jwt("dibs", std::chrono::seconds{-60}), imap::jwt("dibs")}};
  dibs::imap::session s{auth_test::oauth(tokens)};
  CHECK(*tokens.calls == std::vector<bool>{false, true});
  imap::round_trip(s, "renewed", "Subject: logged in");
  s.drop();  // the connection breaks: the next command logs in anew
  s.check(s.run("NOOP"), "NOOP");
  CHECK(*tokens.calls == std::vector<bool>{false, true, false});
  imap::round_trip(s, "renewed", "Subject: logged in");
}

TEST_CASE("tokens refused: another user's, another key's, expired twice, no JWT: twice, permission_denied, not transient") {
  const std::string other_key = dibs::imap::detail::base64_encode("a key the server does not have, 32 bytes");
  struct bad {
    std::string what, token;
  };
  for (const auto& [what, token] : {bad{"for another user", imap::jwt("other")},
                                    bad{"signed with another key", imap::jwt("dibs", std::chrono::hours{1}, other_key)},
                                    bad{"expired, and expired again", imap::jwt("dibs", std::chrono::seconds{-60})},
                                    bad{"no JWT", "garbage-token-Zx81"}}) {
    INFO(what);
    for (const auto mech : {auth_mechanism::xoauth2, auth_mechanism::oauthbearer}) {
      const imap::token_script tokens{{token}};
      const auto o = auth_test::oauth(tokens, mech);
      const auto e = imap::refusal(o);
      CHECK(e.code() == std::errc::permission_denied);
      CHECK_FALSE(dibs::is_transient(e.code()));
      CHECK_THAT(e.what(), Contains(o.host + ":" + o.port) && Contains("user 'dibs'") && Contains(", twice") &&
                               Contains("AUTHENTICATIONFAILED") && Contains("status "));
      CHECK(*tokens.calls == std::vector<bool>{false, true});
      CHECK(auth_test::clean_of(e.what(), token));
    }
  }
}

TEST_CASE("secrets: no token in any message of the failure paths, nor in the demo's output with --imap-token-cmd") {
  const dibs_test::temp_dir dir;
  // A token no server takes, distinctive enough to be found anywhere.
  const std::string token = "dibs-secret-token-Kq4Zr8Wv2Lm6";
  std::vector<std::string> messages;
  auto failed = [&](const dibs::imap::options& o) {
    try {
      dibs::imap::session s{o};
      FAIL("logged in with a token no server takes");
    } catch (const std::exception& e) {
      messages.push_back(e.what());
    }
  };
  const imap::token_script refused{{token}};
  failed(auth_test::oauth(refused, auth_mechanism::xoauth2));
  failed(auth_test::oauth(refused, auth_mechanism::oauthbearer));
  {  // a token command that prints the token and fails
    auto o = imap::options();
    o.password.clear();
    o.oauth2_token = dibs::imap::token_command("printf '%s-%s\\n' dibs-secret-token Kq4Zr8Wv2Lm6; exit 7");
    failed(o);
    CHECK_THAT(messages.back(), Contains("exited with status 7"));
  }
  {  // a provider that throws, after a refused token
    auto o = imap::options();
    o.password.clear();
    o.oauth2_token = [&](bool refresh) -> std::string {
      if (refresh) throw std::runtime_error("cannot renew");
      return token;
    };
    failed(o);
    CHECK_THAT(messages.back(), Contains("cannot renew"));
  }
  REQUIRE(messages.size() == 4);
  for (const auto& m : messages) CHECK(auth_test::clean_of(m, token));

  const auto demo = auth_test::demo_program();
  if (demo.empty()) {
    WARN("examples/shared_inbox is not built: the demo's output is not checked");
    return;
  }
  // The demo with no password: a token command is how it logs in. First
  // with the refused token (it fails, saying why), then with one the
  // server takes (it runs, 2 workers, 10 messages).
  const auto token_file = dir.path / "token";
  const auto out = dir.path / "out";
  auto run_demo = [&](const std::string& t) {
    dibs_test::spit(token_file, t + "\n");
    const auto command = fmt::format(
        "env -u DIBS_IMAP_PASSWORD -u DIBS_IMAP_TOKEN_CMD -u DIBS_IMAP_AUTHZID DIBS_IMAP_HOST={} DIBS_IMAP_PORT={} "
        "DIBS_IMAP_USER=dibs '{}' --store imap --imap-token-cmd \"cat '{}'\" --workers 2 --messages 10 --kills 0 "
        "--rate 100 >'{}' 2>&1",
        imap::env("DIBS_IMAP_HOST"), imap::env("DIBS_IMAP_PORT"), demo, token_file.string(), out.string());
    const int rc = dibs_test::sh(command);
    return std::pair{rc, dibs_test::slurp(out)};
  };
  {
    const auto [rc, output] = run_demo(token);
    CHECK(rc != 0);
    CHECK_THAT(output, Contains("refused the login of user 'dibs'") && Contains("twice"));
    CHECK(auth_test::clean_of(output, token));
  }
  const auto good = imap::jwt("dibs");
  const auto [rc, output] = run_demo(good);
  INFO(output);
  CHECK(rc == 0);
  CHECK(auth_test::clean_of(output, good));
}
