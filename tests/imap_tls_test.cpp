// dibs::imap over TLS, against the tests' Dovecot (started with
// scripts/imap.sh start DIR --tls: STARTTLS on the plain port, TLS from the
// first byte on DIBS_IMAP_TLS_PORT, a certificate for 127.0.0.1 signed by a
// test CA in DIBS_IMAP_CA_FILE): a round trip both ways, the certificate
// checked (a CA that did not sign it, a host name it does not have), TLS
// spoken to a plain port, a session over TLS used by a fork()ed child, and
// imap_store's conformance suite over TLS.
#include <dibs/imap/client.hpp>
#include <dibs/imap/store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>

#include "imap_support.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <string>

namespace imap = dibs_test::imap;
using dibs::imap::tls_mode;
using Catch::Contains;

namespace {

}  // namespace

TEST_CASE("implicit TLS: login and a round trip, the certificate verified against the CA file") {
  const auto o = imap::tls_options(tls_mode::implicit);
  dibs::imap::session s{o};
  CHECK(s.encrypted());
  CHECK(s.has("IDLE"));
  imap::round_trip(s, "tls", "Subject: over TLS");
  // A dropped connection comes back over TLS by itself.
  s.drop();
  CHECK_FALSE(s.connected());
  CHECK(s.run("NOOP").ok());
  CHECK(s.encrypted());
}

TEST_CASE("STARTTLS: login and a round trip on the plain port, capabilities asked again after the handshake") {
  dibs::imap::session plain{imap::options()};
  CHECK_FALSE(plain.encrypted());
  dibs::imap::session s{imap::tls_options(tls_mode::starttls)};
  CHECK(s.encrypted());
  CHECK_FALSE(s.has("STARTTLS"));  // said in the clear only; forgotten
  CHECK(s.has("UIDPLUS"));
  imap::round_trip(s, "starttls", "Subject: over TLS");
}

TEST_CASE("a certificate the CA does not vouch for is refused, naming the server and OpenSSL's verify result") {
  // The system's store, and a CA file of a CA that signed nothing (public
  // certificate only, tests/data/other-ca.crt).
  for (const std::string ca : {"", DIBS_SOURCE_DIR "/tests/data/other-ca.crt"})
    for (const auto mode : {tls_mode::implicit, tls_mode::starttls}) {
      auto o = imap::tls_options(mode);
      o.ca_file = ca;
      const auto e = imap::refusal(o);
      CHECK(e.code() == std::errc::permission_denied);
      CHECK_FALSE(dibs::is_transient(e.code()));
      CHECK_THAT(e.what(), Contains("127.0.0.1:" + o.port) && Contains("certificate verify failed: ") &&
                               Contains("local issuer certificate") &&
                               Contains(ca.empty() ? "system's CA store" : "other-ca.crt"));
    }
}

TEST_CASE("a certificate for another host name is refused, and verify = false (unsafe, tests only) takes it") {
  for (const auto mode : {tls_mode::implicit, tls_mode::starttls}) {
    auto o = imap::tls_options(mode);
    o.host = "localhost";  // the certificate names only IP 127.0.0.1
    const auto e = imap::refusal(o);
    CHECK(e.code() == std::errc::permission_denied);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("localhost:" + o.port) && Contains("certificate verify failed: hostname mismatch") &&
                             Contains("not for 'localhost'"));
    o.verify = false;
    o.ca_file.clear();
    dibs::imap::session s{o};
    CHECK(s.encrypted());
    CHECK(s.run("NOOP").ok());
  }
}

TEST_CASE("TLS spoken to the plain port fails the handshake, not transient") {
  auto o = imap::tls_options(tls_mode::implicit);
  o.port = imap::options().port;
  const auto e = imap::refusal(o);
  CHECK(e.code() == std::errc::protocol_error);
  CHECK_FALSE(dibs::is_transient(e.code()));
  CHECK_THAT(e.what(), Contains("TLS handshake failed") && Contains("993"));
}

TEST_CASE("a fork()ed child reconnects over TLS of its own, and the parent's TLS stream goes on unharmed") {
  dibs::imap::session s{imap::tls_options(tls_mode::implicit)};
  REQUIRE(s.run("NOOP").ok());
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int rc = 1;
    try {
      if (!s.connected() && s.run("NOOP").ok() && s.encrypted()) rc = 0;
    } catch (...) {
    }
    ::_exit(rc);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // Had the child written on the parent's TLS state, the server would see a
  // broken record sequence and drop the parent's connection.
  CHECK(s.connected());
  CHECK(s.run("NOOP").ok());
  CHECK(s.connected());
}

TEST_CASE("imap_store passes the conformance suite over TLS, across processes too", "[conformance]") {
  const auto f = imap::fresh_folder("tlsconf");
  auto open = [&] { return dibs::imap_store{imap::tls_options(tls_mode::implicit), {.folder = f}}; };
  auto s = open();
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 4, 10, "thr-"));
  REQUIRE_NOTHROW(dibs::testing::check_create_race_processes(open, 4, "race-create"));
  auto st = dibs::imap_store{imap::tls_options(tls_mode::starttls), {.folder = imap::fresh_folder("starttlsconf")}};
  REQUIRE_NOTHROW(dibs::testing::check_semantics(st, "sem-"));
}
