// dibs/imap.hpp on its own: the response parser, quoting, and the session
// against a scripted server on a loopback socket (no Dovecot needed): a
// server without LITERAL+, a connection cut after a write was sent, a
// refused login, BYE; before the login: capabilities asked when the
// greeting has none, LOGINDISABLED, STARTTLS missing or followed by injected
// plaintext, a TLS handshake that never comes (TLS itself:
// imap_tls_test.cpp, against Dovecot); options::timeout bounding the whole
// connect (a full accept queue, a slow greeting); malformed replies (numbers
// that are none, a literal that lies about its size); untagged lines said
// while a literal waits for the server's go-ahead. Logging in with SASL
// (Dovecot's side: imap_auth_test.cpp): the SASL responses' encodings, the
// initial response with SASL-IR and after "+" without, the mechanism
// automatic picks, a refused token's JSON challenge answered and the
// provider asked once to renew it, refusals twice and throttled ones,
// check()'s throttling words (and Exchange's "not connected", not
// transient), secrets kept out of every message (a cut connection, a
// malformed reply, an echo; a LOGIN password echoed escaped, not ASCII, or
// across excerpt()'s cut), a provider that throws, options that cannot go
// together, LOGINDISABLED on a plain connection for every mechanism, an
// OAuth2 mechanism the server does not announce, a refused token and then
// a lost connection (not transient), from_env, and token_command and
// run_shell (a helper leaving a process in the background, standard input
// /dev/null, SIGCHLD at its default, no descriptor left open).
#include <dibs/imap/client.hpp>
#include <dibs/imap/store.hpp>

#include <catch2/catch.hpp>

#include "imap_support.hpp"
#include "support.hpp"

#include <arpa/inet.h>
#include <signal.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

using dibs::imap::value;

TEST_CASE("imap::parse reads literals, quoted strings, bracketed item names, lists and NIL") {
  const std::string line =
      "12 FETCH (UID 34 FLAGS (\\Seen $DibsBase) BODY[HEADER.FIELDS (X-DIBS-RECORD)] {7}\r\nab)\r\n( BODY[TEXT] "
      "\"q\\\"u\\\\o\" X NIL)";
  const auto v = dibs::imap::parse(line);
  REQUIRE(v.size() == 3);
  CHECK(v[0].number() == 12u);
  CHECK(v[1].is("fetch"));
  REQUIRE(v[2].kind == value::kind::list);
  const auto& items = v[2].items;
  REQUIRE(items.size() == 10);
  CHECK(items[0].is("UID"));
  CHECK(items[1].number() == 34u);
  REQUIRE(items[3].kind == value::kind::list);
  CHECK(items[3].items.size() == 2);
  CHECK(items[3].items[1].is("$DibsBase"));
  CHECK(items[4].text == "BODY[HEADER.FIELDS (X-DIBS-RECORD)]");  // spaces and parentheses inside [...] belong to the atom
  CHECK(items[5].kind == value::kind::string);
  CHECK(items[5].text == "ab)\r\n( ");  // a literal's bytes are not parsed: ')' and '(' in it change nothing
  CHECK(items[6].text == "BODY[TEXT]");
  CHECK(items[7].text == "q\"u\\o");
  CHECK(items[8].is("X"));
  CHECK(items[9].kind == value::kind::nil);
  CHECK_FALSE(items[8].number());
}

TEST_CASE("imap::parse: a bracket opens a section only in a FETCH item name, not in a keyword") {
  const auto v = dibs::imap::parse("1 FETCH (UID 1 FLAGS (\\Seen todo[1) BODY[TEXT] {3}\r\nabc)");
  REQUIRE(v.size() == 3);
  const auto& items = v[2].items;
  REQUIRE(items.size() == 6);
  REQUIRE(items[3].items.size() == 2);
  CHECK(items[3].items[1].text == "todo[1");
  CHECK(items[4].text == "BODY[TEXT]");
  CHECK(items[5].text == "abc");
}

TEST_CASE("imap::quote quotes what it can and sends the rest as a literal") {
  CHECK(dibs::imap::quote("INBOX") == "\"INBOX\"");
  CHECK(dibs::imap::quote("a\"b\\c") == "\"a\\\"b\\\\c\"");
  CHECK(dibs::imap::quote("two\r\nlines") == "{10+}\r\ntwo\r\nlines");
  CHECK(dibs::imap::quote("caf\xc3\xa9") == "{5+}\r\ncaf\xc3\xa9");
}

TEST_CASE("imap_store's encodings: base64 of every byte, UID sets, INTERNALDATE, key tags") {
  std::string all;
  for (int c = 0; c < 256; ++c) all += static_cast<char>(c);
  for (std::size_t n = 0; n <= 5; ++n)
    CHECK(dibs::imap::detail::unbase64(dibs::imap::detail::base64(all.substr(0, n) + all)) == all.substr(0, n) + all);
  CHECK_FALSE(dibs::imap::detail::unbase64("ab*c"));
  std::vector<std::pair<std::uint32_t, std::uint32_t>> ranges;
  dibs::imap::detail::for_each_uid_range("3:5,9,12:10,1:4294967295", [&](std::uint32_t a, std::uint32_t b) {
    ranges.emplace_back(a, b);
  });
  CHECK(ranges == std::vector<std::pair<std::uint32_t, std::uint32_t>>{{3, 5}, {9, 9}, {10, 12}, {1, 4294967295u}});
  CHECK(dibs::imap::detail::parse_date("03-Dec-2026 19:30:00 +0100") == 1796322600);
  CHECK(dibs::imap::detail::parse_date(" 3-Dec-2026 18:30:00 +0000") == 1796322600);
  CHECK(dibs::imap::detail::parse_date("garbage") == 0);
  const auto tag = dibs::imap::detail::key_tag("a/b");
  CHECK(tag.size() == 18);
  CHECK(tag.front() == 'k');
  CHECK(tag.back() == '.');
  CHECK(tag != dibs::imap::detail::key_tag("a/c"));
}

namespace {

// A server on a loopback port that runs `script` on the first connection.
struct scripted_server {
  int listener = -1;
  std::string port;
  std::thread thread;

  explicit scripted_server(std::function<void(int fd)> script) {
    listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
    port = std::to_string(ntohs(a.sin_port));
    ::listen(listener, 1);
    thread = std::thread([this, script] {
      const int fd = ::accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      script(fd);
      ::close(fd);
    });
  }
  ~scripted_server() {
    ::shutdown(listener, SHUT_RDWR);
    ::close(listener);
    thread.join();
  }
};

// MSG_NOSIGNAL: a client that hung up must not kill the test with SIGPIPE.
void say(int fd, const std::string& s) { (void)!::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

// Reads up to and including `until` (or to the end); returns what came.
std::string hear(int fd, const std::string& until) {
  std::string in;
  char c;
  while (in.find(until) == std::string::npos && ::read(fd, &c, 1) == 1) in += c;
  return in;
}

dibs::imap::options at(const std::string& port) {
  dibs::imap::options o;
  o.port = port;
  o.user = "u";
  o.password = "p w";
  o.timeout = std::chrono::seconds{5};
  return o;
}

}  // namespace

TEST_CASE("imap::session sends a literal only after the server's go-ahead when it lacks LITERAL+") {
  std::string login, append;
  {
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=PLAIN] ready\r\n");
      login = hear(fd, "\r\n");
      say(fd, "d1 OK [CAPABILITY IMAP4rev1 UIDPLUS] logged in\r\n");
      append = hear(fd, "}\r\n");
      say(fd, "+ go ahead\r\n");
      append += hear(fd, "line two\r\n");
      say(fd, "d2 OK [APPENDUID 7 42] done\r\n");
      hear(fd, "LOGOUT\r\n");
    });
    dibs::imap::session s{at(server.port)};
    CHECK_FALSE(s.has("LITERAL+"));
    CHECK(s.has("uidplus"));
    const auto r = s.run("APPEND box " + dibs::imap::quote("line one\r\nline two"));
    CHECK(r.ok());
    CHECK(r.code == "APPENDUID 7 42");
  }
  CHECK(login == "d1 LOGIN \"u\" \"p w\"\r\n");
  CHECK(append == "d2 APPEND box {18}\r\nline one\r\nline two\r\n");  // "{18+}" became "{18}", then the bytes
}

TEST_CASE("imap::session: a connection cut after a write was sent is outcome_unknown, before it transient") {
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=PLAIN] ready\r\n");
    hear(fd, "\r\n");
    say(fd, "d1 OK [CAPABILITY IMAP4rev1 LITERAL+] logged in\r\n");
    hear(fd, "\r\n");  // the APPEND arrives; the server dies without a word
  });
  dibs::imap::session s{at(server.port)};
  try {
    s.run_write({"APPEND box {1+}\r\nx"});
    FAIL("a cut connection went unnoticed");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::outcome_unknown);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("u@127.0.0.1:" + server.port));
  }
  CHECK_FALSE(s.connected());
  try {
    s.run("NOOP");  // reconnecting: nobody listens any more
    FAIL("a dead server was reached");
  } catch (const std::system_error& e) {
    CHECK(dibs::is_transient(e.code()));
  }
}

TEST_CASE("imap::session: a refused login names user and server, a BYE is a lost connection") {
  {
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=PLAIN] ready\r\n");
      hear(fd, "\r\n");
      say(fd, "d1 NO [AUTHENTICATIONFAILED] Authentication failed.\r\n");
    });
    try {
      dibs::imap::session s{at(server.port)};
      FAIL("a refused login was accepted");
    } catch (const std::system_error& e) {
      CHECK(e.code() == std::errc::permission_denied);
      CHECK_THAT(e.what(), Catch::Contains("user 'u'") && Catch::Contains("127.0.0.1:" + server.port) &&
                               Catch::Contains("AUTHENTICATIONFAILED"));
    }
  }
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=PLAIN] ready\r\n");
    hear(fd, "\r\n");
    say(fd, "d1 OK logged in\r\n");
    hear(fd, "\r\n");  // CAPABILITY (none came with the login)
    say(fd, "* CAPABILITY IMAP4rev1\r\nd2 OK done\r\n");
    hear(fd, "\r\n");
    say(fd, "* BYE shutting down\r\n");
  });
  dibs::imap::session s{at(server.port)};
  try {
    s.run("NOOP");
    FAIL("a BYE went unnoticed");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::connection_lost);
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("BYE shutting down"));
  }
}

TEST_CASE("imap::session asks for the capabilities before the login when the greeting has none") {
  std::string heard;
  {
    scripted_server server([&](int fd) {
      say(fd, "* OK ready\r\n");
      heard = hear(fd, "\r\n");
      say(fd, "* CAPABILITY IMAP4rev1\r\nd1 OK done\r\n");
      heard += hear(fd, "\r\n");
      say(fd, "d2 OK [CAPABILITY IMAP4rev1 IDLE] logged in\r\n");
      hear(fd, "LOGOUT\r\n");
    });
    dibs::imap::session s{at(server.port)};
    CHECK(s.has("IDLE"));
  }
  CHECK(heard == "d1 CAPABILITY\r\nd2 LOGIN \"u\" \"p w\"\r\n");
}

TEST_CASE("imap::session never sends LOGIN in the clear where the server announces LOGINDISABLED") {
  for (const bool in_greeting : {true, false}) {
    std::string heard;
    {
      scripted_server server([&](int fd) {
        if (in_greeting) {
          say(fd, "* OK [CAPABILITY IMAP4rev1 STARTTLS LOGINDISABLED] ready\r\n");
        } else {
          say(fd, "* OK ready\r\n");
          hear(fd, "\r\n");
          say(fd, "* CAPABILITY IMAP4rev1 STARTTLS LOGINDISABLED\r\nd1 OK done\r\n");
        }
        char c;
        while (::read(fd, &c, 1) == 1) heard += c;  // until the client closes
      });
      try {
        dibs::imap::session s{at(server.port)};
        FAIL("logged in in the clear");
      } catch (const std::system_error& e) {
        CHECK(e.code() == std::errc::permission_denied);
        CHECK_FALSE(dibs::is_transient(e.code()));
        CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + server.port) && Catch::Contains("LOGINDISABLED") &&
                                 Catch::Contains("tls_mode::starttls"));
      }
    }
    CHECK(heard.find("LOGIN") == std::string::npos);
    CHECK(heard.find("p w") == std::string::npos);
  }
}

TEST_CASE("tls_mode::starttls: a server without STARTTLS, or with plaintext after its OK, is refused before the login") {
  auto o = [](const std::string& port) {
    auto opts = at(port);
    opts.tls = dibs::imap::tls_mode::starttls;
    return opts;
  };
  {
    std::string heard;
    {
      scripted_server server([&](int fd) {
        say(fd, "* OK [CAPABILITY IMAP4rev1] ready\r\n");
        char c;
        while (::read(fd, &c, 1) == 1) heard += c;
      });
      try {
        dibs::imap::session s{o(server.port)};
        FAIL("went on without TLS");
      } catch (const std::system_error& e) {
        CHECK(e.code() == std::errc::not_supported);
        CHECK_FALSE(dibs::is_transient(e.code()));
        CHECK_THAT(e.what(), Catch::Contains("does not offer STARTTLS"));
      }
    }
    CHECK(heard.find("LOGIN") == std::string::npos);
  }
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 STARTTLS] ready\r\n");
    hear(fd, "STARTTLS\r\n");
    // An attacker on the path appends a line of its own to the OK.
    say(fd, "d1 OK Begin TLS negotiation now\r\n* CAPABILITY IMAP4rev1 AUTH=PLAIN\r\n");
    hear(fd, "never");
  });
  try {
    dibs::imap::session s{o(server.port)};
    FAIL("plaintext after STARTTLS's OK was taken");
  } catch (const std::system_error& e) {
    CHECK(e.code() == std::errc::protocol_error);
    CHECK_THAT(e.what(), Catch::Contains("after its OK to STARTTLS"));
  }
}

TEST_CASE("implicit TLS: a server that never answers the handshake is timed_out, transient") {
  scripted_server server([&](int fd) { hear(fd, "never"); });  // reads the ClientHello, says nothing
  auto o = at(server.port);
  o.tls = dibs::imap::tls_mode::implicit;
  o.timeout = std::chrono::milliseconds{300};
  const auto start = std::chrono::steady_clock::now();
  try {
    dibs::imap::session s{o};
    FAIL("no handshake, yet a session");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::timed_out);
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("TLS handshake did not finish within 300 ms"));
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds{3});
}

TEST_CASE("imap::options: the port follows the TLS mode when it is left empty, and DIBS_IMAP_TLS") {
  CHECK(dibs::imap::options{}.port.empty());
  CHECK(dibs::imap::options{}.tls == dibs::imap::tls_mode::none);
  CHECK(dibs::imap::options{}.verify);
  ::setenv("DIBS_IMAP_TLS", "implicit", 1);
  ::setenv("DIBS_IMAP_CA_FILE", "/ca.pem", 1);
  const auto o = dibs::imap::options::from_env();
  CHECK(o.tls == dibs::imap::tls_mode::implicit);
  CHECK(o.ca_file == "/ca.pem");
  ::setenv("DIBS_IMAP_TLS", "yes", 1);
  CHECK_THROWS_WITH(dibs::imap::options::from_env(), Catch::Contains("none, starttls or implicit"));
  ::unsetenv("DIBS_IMAP_TLS");
  ::unsetenv("DIBS_IMAP_CA_FILE");
}

namespace {

using std::chrono::steady_clock;

// A listening socket whose accept queue is full: it never accepts, and
// the kernel drops every further SYN (the client's connect() would retry
// for about two minutes).
struct full_listener {
  int listener = -1;
  std::string port;
  std::vector<int> queued;

  full_listener() {
    listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
    port = std::to_string(ntohs(a.sin_port));
    REQUIRE(::listen(listener, 0) == 0);
    for (int i = 0; i < 3; ++i) {  // fill the queue (non-blocking: the later ones hang in SYN_SENT)
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      (void)::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      queued.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{100});
  }
  ~full_listener() {
    for (const int fd : queued) ::close(fd);
    ::close(listener);
  }
};

// Returns: the error of opening a session with `o` (fails the test if it
// opens), and how long that took.
std::pair<std::system_error, steady_clock::duration> refused(const dibs::imap::options& o) {
  const auto start = steady_clock::now();
  try {
    dibs::imap::session s{o};
  } catch (const std::system_error& e) {
    return {e, steady_clock::now() - start};
  }
  FAIL("the session opened");
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("imap::session: connecting to a server whose accept queue is full gives up after options::timeout") {
  full_listener server;
  auto o = at(server.port);
  o.timeout = std::chrono::seconds{2};
  const auto [e, took] = refused(o);
  CHECK(e.code() == dibs::errc::timed_out);
  CHECK(dibs::is_transient(e.code()));
  CHECK_THAT(e.what(), Catch::Contains("cannot connect to 127.0.0.1:" + server.port + " within 2000 ms"));
  CHECK(took >= std::chrono::milliseconds{1900});
  CHECK(took < std::chrono::seconds{10});  // its 2 s, not the kernel's minutes; wide for a loaded machine
  // The store opens its session the same way.
  const auto start = steady_clock::now();
  try {
    dibs::imap_store store{o, {.folder = "dibs"}};
    FAIL("a store opened on a server that never accepts");
  } catch (const std::system_error& e2) {
    CHECK(e2.code() == dibs::errc::timed_out);
    CHECK_THAT(e2.what(), Catch::Contains("127.0.0.1:" + server.port));
  }
  CHECK(steady_clock::now() - start < std::chrono::seconds{10});
}

TEST_CASE("imap::session: options::timeout bounds the whole connect, not each step of it") {
  // Each reply comes after 1.2 s: well within 2 s one by one, but greeting
  // and capabilities together take longer.
  scripted_server server([&](int fd) {
    std::this_thread::sleep_for(std::chrono::milliseconds{1200});
    say(fd, "* OK ready\r\n");
    hear(fd, "\r\n");
    std::this_thread::sleep_for(std::chrono::milliseconds{1200});
    say(fd, "* CAPABILITY IMAP4rev1\r\nd1 OK done\r\n");
    hear(fd, "\r\n");
    say(fd, "d2 OK logged in\r\n");
    hear(fd, "never");
  });
  auto o = at(server.port);
  o.timeout = std::chrono::seconds{2};
  const auto [e, took] = refused(o);
  CHECK(e.code() == dibs::errc::timed_out);
  CHECK_THAT(e.what(), Catch::Contains("u@127.0.0.1:" + server.port) && Catch::Contains("no reply within 2000 ms"));
  // A timeout of each step would have let the session open (the FAIL in
  // refused()); the time is a bound a loaded machine keeps, not the proof.
  CHECK(took < std::chrono::seconds{10});
}

TEST_CASE("STARTTLS: a server that accepts the STARTTLS and never answers the handshake is timed_out, naming it") {
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 STARTTLS] ready\r\n");
    hear(fd, "STARTTLS\r\n");
    say(fd, "d1 OK Begin TLS negotiation now\r\n");
    hear(fd, "never");  // reads the ClientHello, says nothing
  });
  auto o = at(server.port);
  o.tls = dibs::imap::tls_mode::starttls;
  o.timeout = std::chrono::seconds{2};
  const auto [e, took] = refused(o);
  CHECK(e.code() == dibs::errc::timed_out);
  CHECK(dibs::is_transient(e.code()));
  CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + server.port) && Catch::Contains("TLS handshake did not finish"));
  CHECK(took < std::chrono::seconds{10});  // its 2 s; wide for a loaded machine
}

namespace {

// Reads one command, its literals included; returns it (empty at the end).
std::string command(int fd) {
  std::string c = hear(fd, "\r\n");
  while (c.ends_with("+}\r\n")) {
    const auto open = c.rfind('{');
    const auto n = std::stoul(c.substr(open + 1));
    std::string bytes(n, '\0');
    for (std::size_t got = 0; got < n;) {
      const auto r = ::read(fd, bytes.data() + got, n - got);
      if (r <= 0) return {};
      got += static_cast<std::size_t>(r);
    }
    c += bytes + hear(fd, "\r\n");
  }
  return c;
}

// A server with LITERAL+, UIDPLUS and QRESYNC that answers every command
// OK, and says `untagged` (then `code` in its OK) to the first command
// that starts with `when`.
std::function<void(int)> answering(std::string when, std::string untagged, std::string code = {}) {
  return [=](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 LITERAL+ UIDPLUS QRESYNC] ready\r\n");
    bool said = false;
    for (std::string c; !(c = command(fd)).empty();) {
      const auto tag = c.substr(0, c.find(' '));
      const auto verb = c.substr(tag.size() + 1);
      if (verb.starts_with("SELECT")) say(fd, "* OK [UIDVALIDITY 7] ok\r\n");
      if (!said && verb.starts_with(when)) {
        said = true;
        say(fd, untagged + tag + " OK " + (code.empty() ? "" : "[" + code + "] ") + "done\r\n");
      } else {
        say(fd, tag + " OK [CAPABILITY IMAP4rev1 LITERAL+ UIDPLUS QRESYNC] done\r\n");
      }
    }
  };
}

void check_malformed(const std::system_error& e, const std::string& port, const std::string& quoted) {
  CHECK(e.code() == std::errc::protocol_error);
  CHECK_FALSE(dibs::is_transient(e.code()));
  CHECK_THAT(e.what(), Catch::Contains("u@127.0.0.1:" + port) && Catch::Contains("malformed reply") &&
                           Catch::Contains(quoted));
}

}  // namespace

TEST_CASE("imap::session: a malformed number in a reply is a protocol_error naming the server and quoting it") {
  // Each form, as an untagged line of a NOOP's reply.
  for (const std::string line :
       {"* OK [UIDVALIDITY abc] UIDs valid", "* OK [UIDVALIDITY 4294967296] UIDs valid", "* OK [UIDNEXT -1] next",
        "* OK [HIGHESTMODSEQ 1x] x", "* VANISHED x:y", "* VANISHED (EARLIER) 1:99999999999", "* VANISHED 3,,4",
        "* 12abc EXISTS", "* 99999999999 EXISTS", "* 1 FETCH (UID abc FLAGS ())", "* 1 FETCH (UID 4294967296)",
        "* 0 FETCH (UID 1)", "* 1 FETCH (MODSEQ (x))", "* 1 FETCH UID 1", "* SEARCH 1 2 x", "* ESEARCH (TAG \"d2\") UID ALL 1:x"}) {
    INFO(line);
    scripted_server server(answering("NOOP", line + "\r\n"));
    dibs::imap::session s{at(server.port)};
    try {
      s.run("NOOP");
      FAIL("a malformed reply was taken");
    } catch (const std::system_error& e) {
      check_malformed(e, server.port, line.substr(0, 12));
    }
    CHECK_FALSE(s.connected());  // the session is broken: the next command connects anew
  }
  // Well-formed ones at the limits pass.
  scripted_server server(answering("NOOP", "* OK [UIDVALIDITY 4294967295] ok\r\n* VANISHED (EARLIER) 1:4294967295,7\r\n"
                                           "* 4294967295 EXISTS\r\n* 1 FETCH (UID 4294967295 MODSEQ (9223372036854775807))\r\n",
                                   "APPENDUID 1 3:5,9"));
  dibs::imap::session s{at(server.port)};
  const auto r = s.run("NOOP");
  CHECK(r.ok());
  CHECK(r.untagged.size() == 4);
}

TEST_CASE("imap::session: a malformed reply to a pipelined write is outcome_unknown, never its reply dropped") {
  scripted_server server(answering("APPEND", "* VANISHED x:y\r\n", "APPENDUID 7 42"));
  dibs::imap::session s{at(server.port)};
  try {
    s.run_write({"APPEND box {1+}\r\nx", "NOOP"});
    FAIL("a malformed reply was taken");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::outcome_unknown);
    CHECK_THAT(e.what(), Catch::Contains("u@127.0.0.1:" + server.port) && Catch::Contains("'* VANISHED x:y'"));
  }
  CHECK_FALSE(s.connected());
  // A tagged reply's code is checked too.
  scripted_server tagged(answering("APPEND", "", "APPENDUID 7 x"));
  dibs::imap::session t{at(tagged.port)};
  CHECK_THROWS_MATCHES(t.run_write({"APPEND box {1+}\r\nx"}), std::system_error,
                       Catch::Matchers::Predicate<std::system_error>(
                           [](const auto& e) { return e.code() == dibs::errc::outcome_unknown; }));
}

TEST_CASE("imap_store: a malformed UIDVALIDITY or VANISHED is a system_error naming the server, not std::invalid_argument") {
  {
    scripted_server server(answering("SELECT", "* OK [UIDVALIDITY abc] UIDs valid\r\n"));
    try {
      dibs::imap_store store{at(server.port), {.folder = "dibs"}};
      FAIL("a store opened on a malformed UIDVALIDITY");
    } catch (const std::system_error& e) {
      check_malformed(e, server.port, "UIDVALIDITY abc");
    }
  }
  // VANISHED with the reply to the APPEND of a create: the record may be
  // written; the caller must hear outcome_unknown.
  scripted_server server(answering("APPEND", "* VANISHED x:y\r\n", "APPENDUID 7 1"));
  dibs::imap_store store{at(server.port), {.folder = "dibs"}};
  try {
    store.create("k", "v");
    FAIL("a malformed reply to a write was taken");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::outcome_unknown);
    CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + server.port) && Catch::Contains("VANISHED x:y"));
  }
}

TEST_CASE("imap::session: a literal larger than options::max_line is refused before it is read") {
  std::size_t sent = 0;
  {
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 LITERAL+] ready\r\n");
      const auto login = command(fd);
      say(fd, login.substr(0, login.find(' ')) + " OK [CAPABILITY IMAP4rev1 LITERAL+] done\r\n");
      command(fd);
      say(fd, "* 1 FETCH (UID 1 BODY[TEXT] {2000000000}\r\n");
      const std::string chunk(1 << 20, 'x');  // as fast as the client takes it, until it hangs up
      for (ssize_t n; (n = ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL)) > 0;) sent += static_cast<std::size_t>(n);
    });
    dibs::imap::session s{at(server.port)};
    const auto start = steady_clock::now();
    try {
      s.run("UID FETCH 1 BODY[TEXT]");
      FAIL("a 2 GB literal was read");
    } catch (const std::system_error& e) {
      check_malformed(e, server.port, "* 1 FETCH (UID 1 BODY[TEXT] {2000000000}");
      CHECK_THAT(e.what(), Catch::Contains("a literal of 2000000000 bytes, more than options::max_line (67108864 bytes)"));
    }
    CHECK(steady_clock::now() - start < std::chrono::seconds{10});  // refused at the literal's size, not read
  }
  CHECK(sent < 64u << 20);  // what the socket buffers took before the client hung up; never read into memory
  // At a small limit: a line that fits passes, a literal or a line without
  // an end that does not is refused.
  for (const auto& [reply, ok] : std::vector<std::pair<std::string, bool>>{
           {"* 1 FETCH (UID 1 BODY[TEXT] {900}\r\n" + std::string(900, 'a') + ")\r\n", true},
           {"* 1 FETCH (UID 1 BODY[TEXT] {1000}\r\n" + std::string(1000, 'a') + ")\r\n", false},
           {"* OK " + std::string(5000, 'a'), false}}) {
    scripted_server server(answering("NOOP", reply));
    auto o = at(server.port);
    o.max_line = 1000;
    dibs::imap::session s{o};
    if (ok) {
      CHECK(s.run("NOOP").untagged.size() == 1);
      continue;
    }
    try {
      s.run("NOOP");
      FAIL("a line over options::max_line was read");
    } catch (const std::system_error& e) {
      check_malformed(e, server.port, "options::max_line (1000 bytes)");
    }
  }
}

TEST_CASE("imap::session: what the server says while a literal waits for its go-ahead is kept in the command's reply") {
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1] ready\r\n");
    hear(fd, "\r\n");
    say(fd, "d1 OK [CAPABILITY IMAP4rev1 UIDPLUS] logged in\r\n");
    hear(fd, "}\r\n");
    say(fd, "* 5 EXISTS\r\n+ go ahead\r\n");
    hear(fd, "x\r\n");
    say(fd, "* 6 EXISTS\r\nd2 OK [APPENDUID 7 42] done\r\n");
    hear(fd, "LOGOUT\r\n");
  });
  dibs::imap::session s{at(server.port)};
  const auto r = s.run("APPEND box " + dibs::imap::quote("\r\nx"));
  CHECK(r.ok());
  CHECK(r.untagged == std::vector<std::string>{"5 EXISTS", "6 EXISTS"});
}

TEST_CASE("imap::session::send_ahead: replies kept for finish() in order, state changes passed to the next run") {
  std::string ahead, after;
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=PLAIN] ready\r\n");
    hear(fd, "\r\n");
    say(fd, "d1 OK [CAPABILITY IMAP4rev1 LITERAL+] logged in\r\n");
    ahead = hear(fd, "d3 UID FETCH 7 (UID BODY.PEEK[])\r\n");
    // Side by side: the FETCH's data and another client's news come while
    // the first STORE is still open, the second is refused.
    say(fd, "* 4 FETCH (UID 7 BODY[] {2}\r\nhi)\r\n* 9 EXISTS\r\nd2 OK stored\r\nd3 OK fetched\r\nd4 NO [CANNOT] no\r\n");
    after = hear(fd, "d5 NOOP\r\n");
    say(fd, "d5 OK done\r\n");
    hear(fd, "LOGOUT\r\n");
  });
  dibs::imap::session s{at(server.port)};
  s.send_ahead({"UID STORE 7 +FLAGS.SILENT ($A)", "UID FETCH 7 (UID BODY.PEEK[])", "UID STORE 8 +FLAGS.SILENT ($A)"});
  // A command with a literal cannot go ahead (its go-ahead would be lost among the replies).
  CHECK_THROWS_MATCHES(s.send_ahead({"APPEND box {1+}\r\nx"}), std::system_error,
                       Catch::Predicate<std::system_error>([](const std::system_error& e) {
                         return e.code() == dibs::errc::invalid_argument;
                       }));
  const auto r = s.run("NOOP");  // reads what went ahead first
  CHECK(r.ok());
  CHECK(r.untagged == std::vector<std::string>{"9 EXISTS"});  // news for this run; the FETCH is the command's own
  const auto done = s.finish();
  REQUIRE(done.size() == 3);
  CHECK(done[0].ok());
  CHECK(done[1].ok());
  CHECK(done[2].status == "NO");
  CHECK(dibs::imap::untagged_of(done) == std::vector<std::string>{"4 FETCH (UID 7 BODY[] {2}\r\nhi)", "9 EXISTS"});
  CHECK(s.finish().empty());
  CHECK(ahead == "d2 UID STORE 7 +FLAGS.SILENT ($A)\r\nd3 UID FETCH 7 (UID BODY.PEEK[])\r\n");
  CHECK(after == "d4 UID STORE 8 +FLAGS.SILENT ($A)\r\nd5 NOOP\r\n");
}

TEST_CASE("imap::session::send_ahead: a connection lost before every reply came gives finish() fewer of them") {
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=PLAIN] ready\r\n");
    hear(fd, "\r\n");
    say(fd, "d1 OK [CAPABILITY IMAP4rev1 LITERAL+] logged in\r\n");
    hear(fd, "d3 UID STORE 8 +FLAGS.SILENT ($A)\r\n");
    say(fd, "d2 OK stored\r\n");  // then it dies: d3's outcome is unknown
  });
  dibs::imap::session s{at(server.port)};
  s.send_ahead({"UID STORE 7 +FLAGS.SILENT ($A)", "UID STORE 8 +FLAGS.SILENT ($A)"});
  CHECK(s.finish().empty());  // all of that read is in doubt, d2 too (its reply came, but not d3's)
  CHECK_FALSE(s.connected());
  CHECK(s.finish().empty());
}

// --- Logging in with SASL: PLAIN, XOAUTH2, OAUTHBEARER (against Dovecot:
// imap_auth_test.cpp), token providers, throttling words, secrets.

namespace {

std::string b64(std::string_view s) { return dibs::imap::detail::base64_encode(s); }

dibs::imap::options oauth_at(const std::string& port, const dibs_test::imap::token_script& tokens) {
  auto o = at(port);
  o.password.clear();
  o.oauth2_token = tokens.provider();
  return o;
}

// Returns: false, and says where, if `secret` or its base64 is in `text`.
bool clean_of(std::string_view text, const std::string& secret) {
  for (const auto& s : {secret, b64(secret)})
    if (text.find(s) != std::string_view::npos) {
      UNSCOPED_INFO("a secret in: " << text);
      return false;
    }
  return true;
}

}  // namespace

TEST_CASE("SASL responses: XOAUTH2, OAUTHBEARER and PLAIN, as the RFCs' and Google's examples encode them") {
  using namespace dibs::imap::detail;
  // Google's XOAUTH2 documentation.
  CHECK(base64_encode(xoauth2_response("someuser@example.com", "ya29.vF9dft4qmTc2Nvb3RlckBhdHRhdmlzdGEuY29tCg")) ==
        "dXNlcj1zb21ldXNlckBleGFtcGxlLmNvbQFhdXRoPUJlYXJlciB5YTI5LnZGOWRmdDRxbVRjMk52YjNSbGNrQmhkSFJoZG1semRHRXVZMjl0"
        "Q2cBAQ==");
  // RFC 7628 4.1.
  CHECK(base64_encode(oauthbearer_response("user@example.com", "server.example.com", "143",
                                           "vF9dft4qmTc2Nvb3RlckBhbHRhdmlzdGEuY29tCg==")) ==
        "bixhPXVzZXJAZXhhbXBsZS5jb20sAWhvc3Q9c2VydmVyLmV4YW1wbGUuY29tAXBvcnQ9MTQzAWF1dGg9QmVhcmVyIHZGOWRmdDRxbVRjMk52"
        "YjNSbGNrQmhiSFJoZG1semRHRXVZMjl0Q2c9PQEB");
  // RFC 5801's saslname: ',' and '=' escaped in a=.
  CHECK(gs2_escape("a=b,c") == "a=3Db=2Cc");
  CHECK(base64_encode(oauthbearer_response("a=b,c", "h", "1", "t")) ==
        "bixhPWE9M0RiPTJDYywBaG9zdD1oAXBvcnQ9MQFhdXRoPUJlYXJlciB0AQE=");
  CHECK(base64_encode(plain_response("shared@example.com", "me@example.com", "pa ss")) ==
        "c2hhcmVkQGV4YW1wbGUuY29tAG1lQGV4YW1wbGUuY29tAHBhIHNz");
  CHECK(base64_encode("") == "");
  for (std::string s : {"", "a", "ab", "abc", "abcd", "\x01\x02\xff"})
    CHECK(base64_decode(base64_encode(s)) == s);
  CHECK_FALSE(base64_decode("abc"));
  CHECK_FALSE(base64_decode("ab!d"));
  CHECK(sasl_error_status(*base64_decode("eyJzdGF0dXMiOiI0MDEiLCJzY2hlbWVzIjoiYmVhcmVyIiwic2NvcGUiOiJtYWlsIn0=")) == "401");
  CHECK(sasl_error_status(R"({"status" : "invalid_token","scope":"x"})") == "invalid_token");
  CHECK(sasl_error_status("{}") == "");
}

TEST_CASE("XOAUTH2: the first response on the AUTHENTICATE line with SASL-IR, after the server's '+' without it") {
  const dibs_test::imap::token_script tokens{{"tok-1"}};
  for (const bool announced : {true, false})
    for (const bool allowed : {true, false}) {
      std::string heard;
      {
        scripted_server server([&](int fd) {
          say(fd, fmt::format("* OK [CAPABILITY IMAP4rev1 {}AUTH=XOAUTH2] ready\r\n", announced ? "SASL-IR " : ""));
          heard = hear(fd, "\r\n");
          if (heard == "d1 AUTHENTICATE XOAUTH2\r\n") {
            say(fd, "+ \r\n");
            heard += hear(fd, "\r\n");
          }
          say(fd, "d1 OK [CAPABILITY IMAP4rev1 IDLE] logged in\r\n");
          hear(fd, "LOGOUT\r\n");
        });
        auto o = oauth_at(server.port, tokens);
        o.sasl_ir = allowed;
        dibs::imap::session s{o};
        CHECK(s.has("IDLE"));  // the capabilities of the logged-in state, from the OK
      }
      const auto response = b64("user=u\x01" "auth=Bearer tok-1\x01\x01");
      CHECK(heard == (announced && allowed ? "d1 AUTHENTICATE XOAUTH2 " + response + "\r\n"
                                           : "d1 AUTHENTICATE XOAUTH2\r\n" + response + "\r\n"));
    }
}

TEST_CASE("automatic: OAUTHBEARER where announced (a= the authzid, escaped), XOAUTH2 (user= the authzid), PLAIN for an authzid") {
  const dibs_test::imap::token_script tokens{{"tok-2"}};
  // Logs in to a server announcing `caps`; returns what it heard first, with
  // the port it listened on.
  auto login = [](const std::string& caps, const std::function<void(dibs::imap::options&)>& configure) {
    std::string heard;
    std::string port;
    {
      scripted_server server([&](int fd) {
        say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR " + caps + "] ready\r\n");
        heard = hear(fd, "\r\n");
        say(fd, "d1 OK [CAPABILITY IMAP4rev1] logged in\r\n");
        hear(fd, "LOGOUT\r\n");
      });
      port = server.port;
      auto o = at(server.port);
      configure(o);
      dibs::imap::session s{o};
    }
    return std::pair{heard, port};
  };
  auto oauth = [&](dibs::imap::options& o) {
    o.password.clear();
    o.oauth2_token = tokens.provider();
    o.authzid = "shared,box=1@example.com";
  };
  {
    const auto [heard, port] = login("AUTH=PLAIN AUTH=XOAUTH2 AUTH=OAUTHBEARER", oauth);
    CHECK(heard == "d1 AUTHENTICATE OAUTHBEARER " +
                       b64("n,a=shared=2Cbox=3D1@example.com,\x01host=127.0.0.1\x01port=" + port +
                           "\x01" "auth=Bearer tok-2\x01\x01") + "\r\n");
  }
  {
    const auto [heard, port] = login("AUTH=PLAIN AUTH=XOAUTH2", oauth);
    CHECK(heard == "d1 AUTHENTICATE XOAUTH2 " + b64("user=shared,box=1@example.com\x01" "auth=Bearer tok-2\x01\x01") + "\r\n");
  }
  {
    const auto [heard, port] = login("AUTH=PLAIN", [](dibs::imap::options& o) { o.authzid = "shared@example.com"; });
    CHECK(heard == "d1 AUTHENTICATE PLAIN " + b64(std::string("shared@example.com") + '\0' + "u" + '\0' + "p w") + "\r\n");
  }
  CHECK(*tokens.calls == std::vector<bool>{false, false});
}

TEST_CASE("a refused OAuth2 token: the JSON challenge answered as each RFC says, the provider asked once to renew it") {
  for (const std::string mech : {"XOAUTH2", "OAUTHBEARER"}) {
    const dibs_test::imap::token_script tokens{{"old-token", "new-token"}};
    std::string answer, second, expected;
    {
      scripted_server server([&](int fd) {
        say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=" + mech + "] ready\r\n");
        hear(fd, "\r\n");
        say(fd, "+ " + b64(mech == "XOAUTH2" ? R"({"status":"401","schemes":"bearer","scope":"mail"})"
                                            : R"({"status":"invalid_token"})") + "\r\n");
        answer = hear(fd, "\r\n");
        say(fd, "d1 NO [AUTHENTICATIONFAILED] Authentication failed.\r\n");
        second = hear(fd, "\r\n");
        say(fd, "d2 OK [CAPABILITY IMAP4rev1] logged in\r\n");
        hear(fd, "LOGOUT\r\n");
      });
      auto o = oauth_at(server.port, tokens);
      o.auth = mech == "XOAUTH2" ? dibs::imap::auth_mechanism::xoauth2 : dibs::imap::auth_mechanism::oauthbearer;
      expected = "d2 AUTHENTICATE " + mech + " " +
                 b64(mech == "XOAUTH2" ? std::string("user=u\x01" "auth=Bearer new-token\x01\x01")
                                       : "n,a=u,\x01host=127.0.0.1\x01port=" + server.port +
                                             "\x01" "auth=Bearer new-token\x01\x01") + "\r\n";
      dibs::imap::session s{o};
      CHECK(s.connected());
    }
    // RFC 7628 3.2.3: OAUTHBEARER's client answers %x01; XOAUTH2's an empty response.
    CHECK(answer == (mech == "XOAUTH2" ? "\r\n" : "AQ==\r\n"));
    CHECK(second == expected);
    CHECK(*tokens.calls == std::vector<bool>{false, true});
  }
}

TEST_CASE("an OAuth2 token refused twice: permission_denied, not transient, naming server, user, mechanism and status") {
  const std::string token = "tok-zq7XW3vR9-never-in-a-message";
  const dibs_test::imap::token_script tokens{{token}};
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=XOAUTH2] ready\r\n");
    for (const std::string tag : {"d1", "d2"}) {
      hear(fd, "\r\n");
      say(fd, "+ \r\n");
      hear(fd, "\r\n");
      say(fd, "+ " + b64(R"({"status":"401","schemes":"bearer"})") + "\r\n");
      hear(fd, "\r\n");
      // A server that quotes what it was given (the token): cut out of the message.
      say(fd, tag + " NO [AUTHENTICATIONFAILED] Invalid credentials for " + token + " (Failure)\r\n");
    }
    hear(fd, "never");
  });
  auto o = oauth_at(server.port, tokens);
  o.authzid = "shared@example.com";
  const auto [e, took] = refused(o);
  CHECK(e.code() == std::errc::permission_denied);
  CHECK_FALSE(dibs::is_transient(e.code()));
  CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + server.port) && Catch::Contains("user 'u' as 'shared@example.com'") &&
                           Catch::Contains("AUTHENTICATE XOAUTH2, twice") && Catch::Contains("status 401") &&
                           Catch::Contains("[AUTHENTICATIONFAILED] Invalid credentials for <secret> (Failure)") &&
                           Catch::Contains("expired"));
  CHECK(clean_of(e.what(), token));
  CHECK(*tokens.calls == std::vector<bool>{false, true});
}

TEST_CASE("OAuth2 refusals a renewed token would meet again: not renewed (BAD, CANNOT, insufficient_scope, invalid_request)") {
  struct refusal {
    std::string mech, json, completion;
  };
  for (const auto& r :
       {refusal{"XOAUTH2", "", "BAD [CANNOT] Unsupported mechanism"}, refusal{"XOAUTH2", "", "NO [CANNOT] not here"},
        refusal{"OAUTHBEARER", R"({"status":"insufficient_scope","scope":"imap"})", "NO [AUTHENTICATIONFAILED] no"},
        refusal{"OAUTHBEARER", R"({"status":"invalid_request"})", "NO [AUTHENTICATIONFAILED] no"}}) {
    // named, not bound: clang before 16 cannot capture a structured binding in the lambda below
    const std::string& mech = r.mech;
    const std::string& json = r.json;
    const std::string& completion = r.completion;
    INFO(mech << " " << json << " " << completion);
    const dibs_test::imap::token_script tokens{{"tok-4", "tok-5"}};
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=" + mech + "] ready\r\n");
      hear(fd, "\r\n");
      if (!json.empty()) {
        say(fd, "+ " + b64(json) + "\r\n");
        hear(fd, "\r\n");
      }
      say(fd, "d1 " + completion + "\r\n");
      hear(fd, "never");
    });
    auto o = oauth_at(server.port, tokens);
    o.auth = mech == "XOAUTH2" ? dibs::imap::auth_mechanism::xoauth2 : dibs::imap::auth_mechanism::oauthbearer;
    const auto [e, took] = refused(o);
    CHECK(e.code() == std::errc::permission_denied);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("it was not renewed"));
    CHECK(std::string_view(e.what()).find("twice") == std::string_view::npos);
    CHECK(*tokens.calls == std::vector<bool>{false});
  }
}

TEST_CASE("a login refused with throttling words or UNAVAILABLE is transient, the token not renewed for it") {
  for (const std::string no : {"NO [UNAVAILABLE] Try later", "NO Request is throttled. Suggested Backoff Time: 500 milliseconds",
                               "NO [ALERT] Too many simultaneous connections. (Failure)", "NO [THROTTLED] slow down"}) {
    const dibs_test::imap::token_script tokens{{"tok-3"}};
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=XOAUTH2] ready\r\n");
      hear(fd, "\r\n");
      say(fd, "d1 " + no + "\r\n");
      hear(fd, "never");
    });
    const auto [e, took] = refused(oauth_at(server.port, tokens));
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("busy or throttling"));
    CHECK(*tokens.calls == std::vector<bool>{false});
  }
}

TEST_CASE("check(): the throttling words of Exchange Online and Gmail, and THROTTLED, are transient, other NOs not") {
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1] ready\r\n");
    hear(fd, "\r\n");
    say(fd, "d1 OK [CAPABILITY IMAP4rev1] logged in\r\n");
    hear(fd, "LOGOUT\r\n");
  });
  dibs::imap::session s{at(server.port)};
  auto code = [&](const std::string& status, const std::string& response_code, const std::string& text) {
    try {
      s.check(dibs::imap::reply{{}, status, response_code, text}, "SELECT INBOX");
    } catch (const std::system_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(text));
      return e.code();
    }
    return std::error_code{};
  };
  // Exchange Online's "not connected": a setup error, not transient (an
  // imap_mailbox would take the mailbox for an empty one for ever), naming
  // the likely causes.
  for (const std::string status : {"NO", "BAD"}) {
    const auto ec = code(status, "", "User is authenticated but not connected.");
    CHECK(ec == std::errc::permission_denied);
    CHECK_FALSE(dibs::is_transient(ec));
  }
  try {
    s.check(dibs::imap::reply{{}, "BAD", "", "User is authenticated but not connected."}, "SELECT INBOX");
  } catch (const std::system_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("SELECT INBOX") && Catch::Contains("IMAP is turned off") &&
                             Catch::Contains("FullAccess") && Catch::Contains("service principal") &&
                             Catch::Contains("options::authzid"));
  }
  CHECK(dibs::is_transient(code("NO", "", "Request is throttled. Suggested Backoff Time: 1200 milliseconds")));
  CHECK(dibs::is_transient(code("NO", "", "Server Unavailable. 15")));
  CHECK(dibs::is_transient(code("NO", "ALERT", "Too many simultaneous connections. (Failure)")));
  CHECK(dibs::is_transient(code("NO", "ALERT", "Account exceeded command or bandwidth limits. (Failure)")));
  CHECK(dibs::is_transient(code("NO", "THROTTLED", "slow down")));
  CHECK(dibs::is_transient(code("NO", "UNAVAILABLE", "try later")));
  CHECK_FALSE(dibs::is_transient(code("NO", "", "Mailbox doesn't exist: x")));
  CHECK(code("NO", "NONEXISTENT", "Mailbox doesn't exist: x") == std::errc::no_such_file_or_directory);
}

TEST_CASE("secrets: a connection cut mid-AUTHENTICATE, a malformed reply during it, a provider that throws") {
  const std::string token = "tok-Q9pL2mXv-distinctive";
  {  // cut after the token was sent: transient, the next command would log in anew
    const dibs_test::imap::token_script tokens{{token}};
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=XOAUTH2] ready\r\n");
      hear(fd, "\r\n");
    });
    const auto [e, took] = refused(oauth_at(server.port, tokens));
    CHECK(e.code() == dibs::errc::connection_lost);
    CHECK(clean_of(e.what(), token));
  }
  {  // a malformed line that echoes the client's response: not quoted
    const dibs_test::imap::token_script tokens{{token}};
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=XOAUTH2] ready\r\n");
      hear(fd, "\r\n");
      say(fd, "+\r\n");
      const auto sent = hear(fd, "\r\n");
      say(fd, "* 99999999999 EXISTS " + sent);  // a number out of range, then what it was sent
      hear(fd, "never");
    });
    const auto [e, took] = refused(oauth_at(server.port, tokens));
    CHECK(e.code() == std::errc::protocol_error);
    CHECK_THAT(e.what(), Catch::Contains("not quoted"));
    CHECK(clean_of(e.what(), token));
    CHECK(clean_of(e.what(), "user=u\x01" "auth=Bearer " + token + "\x01\x01"));
  }
  {  // a BYE that echoes the token
    const dibs_test::imap::token_script tokens{{token}};
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=XOAUTH2] ready\r\n");
      hear(fd, "\r\n");
      say(fd, "* BYE no such token " + token + "\r\n");
      hear(fd, "never");
    });
    const auto [e, took] = refused(oauth_at(server.port, tokens));
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("no such token <secret>"));
    CHECK(clean_of(e.what(), token));
  }
  {  // after the login, a malformed reply: the token was never kept to be quoted
    const dibs_test::imap::token_script tokens{{token}};
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=XOAUTH2] ready\r\n");
      hear(fd, "\r\n");
      say(fd, "d1 OK [CAPABILITY IMAP4rev1] logged in\r\n");
      hear(fd, "\r\n");
      say(fd, "* 0 FETCH (UID 1)\r\nd2 OK done\r\n");
      hear(fd, "never");
    });
    dibs::imap::session s{oauth_at(server.port, tokens)};
    try {
      s.run("NOOP");
      FAIL("a malformed reply was taken");
    } catch (const std::system_error& e) {
      CHECK(e.code() == std::errc::protocol_error);
      CHECK(clean_of(e.what(), token));
    }
  }
  for (const bool system_error : {true, false}) {  // a provider that throws: its code, its words, our context
    std::string heard;
    {
      scripted_server server([&](int fd) {
        say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=XOAUTH2] ready\r\n");
        char c;
        while (::read(fd, &c, 1) == 1) heard += c;
      });
      auto o = at(server.port);
      o.oauth2_token = [&](bool) -> std::string {
        if (system_error) throw std::system_error(dibs::make_error_code(dibs::errc::timed_out), "the helper is slow");
        throw std::runtime_error("no refresh token stored");
      };
      const auto [e, took] = refused(o);
      CHECK(dibs::is_transient(e.code()) == system_error);
      if (!system_error) CHECK(e.code() == std::errc::permission_denied);
      CHECK_THAT(e.what(), Catch::Contains("u@127.0.0.1:" + server.port) &&
                               Catch::Contains(system_error ? "the helper is slow" : "no refresh token stored") &&
                               Catch::Contains("no OAuth2 token"));
    }
    CHECK(heard.find("AUTHENTICATE") == std::string::npos);  // nothing sent without a token
  }
}

TEST_CASE("LOGINDISABLED on a plain connection: no token and no PLAIN password sent, and automatic needs an announced OAuth2 mechanism") {
  // Connects to a server announcing `caps` that reads everything until the
  // client closes. Returns: the error, its text, what the server heard.
  struct outcome {
    std::error_code code;
    std::string what, heard;
  };
  auto attempt = [](const std::string& caps, const std::function<void(dibs::imap::options&)>& configure) {
    outcome out;
    {
      scripted_server server([&](int fd) {
        say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR " + caps + "] ready\r\n");
        char c;
        while (::read(fd, &c, 1) == 1) out.heard += c;
      });
      auto o = at(server.port);
      configure(o);
      const auto [e, took] = refused(o);
      out.code = e.code();
      out.what = e.what();
    }
    return out;
  };
  const dibs_test::imap::token_script tokens{{"tok-clear-5Rw"}};
  auto oauth = [&](dibs::imap::auth_mechanism m) {
    return [&, m](dibs::imap::options& o) {
      o.password.clear();
      o.oauth2_token = tokens.provider();
      o.auth = m;
    };
  };
  using dibs::imap::auth_mechanism;
  for (const auto m : {auth_mechanism::automatic, auth_mechanism::xoauth2, auth_mechanism::oauthbearer}) {
    const auto r = attempt("STARTTLS LOGINDISABLED AUTH=XOAUTH2 AUTH=OAUTHBEARER", oauth(m));
    CHECK(r.code == std::errc::permission_denied);
    CHECK_FALSE(dibs::is_transient(r.code));
    CHECK_THAT(r.what, Catch::Contains("LOGINDISABLED") && Catch::Contains("tls_mode::starttls") &&
                           Catch::Contains("no token was sent"));
    CHECK(r.heard.empty());
  }
  CHECK(tokens.calls->empty());  // the provider not even asked
  {  // PLAIN (automatic picks it for LOGINDISABLED AUTH=PLAIN, and for an authzid): not in the clear either
    for (const bool authzid : {false, true}) {
      const auto r = attempt("STARTTLS LOGINDISABLED AUTH=PLAIN", [&](dibs::imap::options& o) {
        if (authzid) o.authzid = "shared@example.com";
      });
      CHECK(r.code == std::errc::permission_denied);
      CHECK_THAT(r.what, Catch::Contains("LOGINDISABLED") && Catch::Contains("password was not sent"));
      CHECK(r.heard.empty());
    }
  }
  {  // automatic with a provider, no OAuth2 mechanism announced: not_supported, naming what is
    const auto r = attempt("AUTH=PLAIN AUTH=GSSAPI", oauth(auth_mechanism::automatic));
    CHECK(r.code == std::errc::not_supported);
    CHECK_THAT(r.what, Catch::Contains("neither AUTH=OAUTHBEARER nor AUTH=XOAUTH2") &&
                           Catch::Contains("announces AUTH=PLAIN AUTH=GSSAPI") && Catch::Contains("127.0.0.1:"));
    CHECK(r.heard.empty());
    CHECK(tokens.calls->empty());
  }
  // Asked for explicitly: sent though not announced (the caller knows better).
  std::string heard;
  {
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=PLAIN] ready\r\n");
      heard = hear(fd, "\r\n");
      say(fd, "d1 OK [CAPABILITY IMAP4rev1] logged in\r\n");
      hear(fd, "LOGOUT\r\n");
    });
    auto o = at(server.port);
    oauth(auth_mechanism::xoauth2)(o);
    dibs::imap::session s{o};
    CHECK(s.connected());
  }
  CHECK(heard == "d1 AUTHENTICATE XOAUTH2 " + b64("user=u\x01" "auth=Bearer tok-clear-5Rw\x01\x01") + "\r\n");
  CHECK(*tokens.calls == std::vector<bool>{false});
}

TEST_CASE("a token refused, then the connection lost: permission_denied, not transient, before or after the renewal") {
  const std::string old_token = "tok-old-Hh4Tq8", new_token = "tok-new-Jm2Wz6";
  enum class cut { bye_after_retry, closed_after_no, bye_after_challenge };
  for (const auto how : {cut::bye_after_retry, cut::closed_after_no, cut::bye_after_challenge}) {
    const dibs_test::imap::token_script tokens{{old_token, new_token}};
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 SASL-IR AUTH=XOAUTH2] ready\r\n");
      hear(fd, "\r\n");
      if (how == cut::bye_after_challenge) {
        say(fd, "+ " + b64(R"({"status":"401","schemes":"bearer"})") + "\r\n");
        hear(fd, "\r\n");
        say(fd, "* BYE going away\r\n");
        return;
      }
      say(fd, "d1 NO [AUTHENTICATIONFAILED] Invalid credentials (Failure)\r\n");
      if (how == cut::closed_after_no) return;  // closed: the retry meets a closed connection
      hear(fd, "\r\n");
      say(fd, "* BYE going away\r\n");
    });
    const auto [e, took] = refused(oauth_at(server.port, tokens));
    INFO(e.what());
    CHECK(e.code() == std::errc::permission_denied);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + server.port) && Catch::Contains("user 'u'") &&
                             Catch::Contains("refused the OAuth2 token") && Catch::Contains("AUTHENTICATE XOAUTH2"));
    if (how == cut::bye_after_challenge) {
      CHECK_THAT(e.what(), Catch::Contains("status 401") && Catch::Contains("lost before its final answer"));
      CHECK(*tokens.calls == std::vector<bool>{false});
    } else {
      CHECK_THAT(e.what(), Catch::Contains("retry with a token renewed through the provider could not be made"));
      CHECK(*tokens.calls == std::vector<bool>{false, true});
    }
    CHECK(clean_of(e.what(), old_token));
    CHECK(clean_of(e.what(), new_token));
  }
}

TEST_CASE("LOGIN: a password a server echoes is cut out before the line is escaped or shortened") {
  // Each password, and what must not be in the message: the password as
  // sent, as excerpt() would escape it, a piece a cut at 100 bytes leaves.
  struct secret {
    std::string password, leak;
    bool whole_line;          // echo the LOGIN line as heard, else `before` and the password
    std::string before;
  };
  const std::vector<secret> cases = {
      {"p\xc3\xa4ssw\xc3\xb6rd-Zq9Xw", "rd-Zq9Xw", false, ""},  // not ASCII: sent as a literal, escaped in an excerpt
      {"pa\"ss\\word-7Kq", "word-7Kq", true, ""},               // sent escaped by quote(): echoed so
      // straddling excerpt()'s cut at 100 bytes: "BYE bad login " (14), 76 x, then 10 bytes of it
      {"Zq9Xw2Lm-secret-4417", "Zq9Xw2Lm", false, std::string(76, 'x')},
  };
  for (const auto& c : cases) {
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1] ready\r\n");
      auto heard = hear(fd, "\r\n");
      if (heard.ends_with("}\r\n")) {  // a literal: its go-ahead, then the rest
        say(fd, "+ go ahead\r\n");
        heard += hear(fd, "\r\n");
      }
      heard.resize(heard.size() - 2);
      // A server that quotes what it was sent (all of it, or the password).
      say(fd, "* BYE bad login " + (c.whole_line ? heard : c.before + c.password) + "\r\n");
      hear(fd, "never");
    });
    auto o = at(server.port);
    o.password = c.password;
    const auto [e, took] = refused(o);
    INFO(e.what());
    CHECK(e.code() == dibs::errc::connection_lost);
    CHECK_THAT(e.what(), Catch::Contains("bad login"));
    CHECK(std::string_view(e.what()).find(c.leak) == std::string_view::npos);
    CHECK(clean_of(e.what(), c.password));
    CHECK(std::string_view(e.what()).find(dibs::imap::detail::excerpt(c.password)) == std::string_view::npos);
  }
}

TEST_CASE("options that cannot go together: LOGIN with an authzid, XOAUTH2 without a provider, nothing sent") {
  std::string heard;
  {
    scripted_server server([&](int fd) {
      say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=PLAIN] ready\r\n");
      char c;
      while (::read(fd, &c, 1) == 1) heard += c;
    });
    auto o = at(server.port);
    o.auth = dibs::imap::auth_mechanism::login;
    o.authzid = "shared@example.com";
    const auto [e, took] = refused(o);
    CHECK(e.code() == std::errc::not_supported);
    CHECK_THAT(e.what(), Catch::Contains("auth_mechanism::plain") && Catch::Contains("shared@example.com"));
  }
  CHECK(heard.find("p w") == std::string::npos);
  scripted_server server([&](int fd) {
    say(fd, "* OK [CAPABILITY IMAP4rev1 AUTH=XOAUTH2] ready\r\n");
    hear(fd, "never");
  });
  auto o = at(server.port);
  o.auth = dibs::imap::auth_mechanism::xoauth2;
  const auto [e, took] = refused(o);
  CHECK(e.code() == dibs::errc::invalid_argument);
  CHECK_THAT(e.what(), Catch::Contains("oauth2_token is not set"));
}

TEST_CASE("imap::options::from_env: DIBS_IMAP_AUTH, DIBS_IMAP_AUTHZID and DIBS_IMAP_TOKEN_CMD") {
  ::setenv("DIBS_IMAP_AUTH", "oauthbearer", 1);
  ::setenv("DIBS_IMAP_AUTHZID", "shared@example.com", 1);
  ::setenv("DIBS_IMAP_TOKEN_CMD", "printf 'tok-env\\n'", 1);
  auto o = dibs::imap::options::from_env();
  CHECK(o.auth == dibs::imap::auth_mechanism::oauthbearer);
  CHECK(o.authzid == "shared@example.com");
  REQUIRE(o.oauth2_token);
  CHECK(o.oauth2_token(false) == "tok-env");
  ::setenv("DIBS_IMAP_AUTH", "kerberos", 1);
  try {
    (void)dibs::imap::options::from_env();
    FAIL("DIBS_IMAP_AUTH=kerberos was taken");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::invalid_argument);
    CHECK_THAT(e.what(), Catch::Contains("'kerberos'") && Catch::Contains("xoauth2"));
  }
  ::unsetenv("DIBS_IMAP_AUTH");
  ::unsetenv("DIBS_IMAP_AUTHZID");
  ::unsetenv("DIBS_IMAP_TOKEN_CMD");
  o = dibs::imap::options::from_env();
  CHECK(o.auth == dibs::imap::auth_mechanism::automatic);
  CHECK_FALSE(o.oauth2_token);
}

TEST_CASE("token_command: output trimmed, run again at each call, failures name the command and status, never the output") {
  const dibs_test::temp_dir dir;
  const auto runs = (dir.path / "runs").string();
  // A helper that counts its runs and prints the count in its token.
  const auto provider = dibs::imap::token_command(
      fmt::format("echo x >> '{0}'; printf 'tok-%s \\r\\n\\n' \"$(wc -l < '{0}' | tr -d ' ')\"", runs));
  CHECK(provider(false) == "tok-1");
  CHECK(provider(true) == "tok-2");
  CHECK(provider(false) == "tok-3");
  CHECK(dibs_test::slurp(runs) == "x\nx\nx\n");

  // What the failing commands print: never in a message (their command
  // lines, which are named, do not hold it whole).
  const std::string printed = "tok-printed-8Hq";
  auto failure = [](const std::string& command, std::chrono::milliseconds timeout = std::chrono::seconds{60}) {
    try {
      (void)dibs::imap::token_command(command, timeout)(false);
    } catch (const std::system_error& e) {
      return std::pair{e.code(), std::string(e.what())};
    }
    FAIL("the token command '" << command << "' gave a token");
    return std::pair{std::error_code{}, std::string{}};
  };
  {
    const auto [code, what] = failure("printf '%s-%s\\n' tok-printed 8Hq; exit 3");
    CHECK(code == std::errc::permission_denied);
    CHECK_FALSE(dibs::is_transient(code));
    CHECK_THAT(what, Catch::Contains("the token command 'printf '%s-%s\\n' tok-printed 8Hq; exit 3' exited with status 3"));
    CHECK(what.find(printed) == std::string::npos);
  }
  {
    const auto [code, what] = failure("printf '%s-%s' tok-printed 8Hq; kill -TERM $$");
    CHECK(code == std::errc::permission_denied);
    CHECK_THAT(what, Catch::Contains("ended by signal 15"));
    CHECK(what.find(printed) == std::string::npos);
  }
  {
    const auto [code, what] = failure("printf '  \\n'");
    CHECK(code == std::errc::permission_denied);
    CHECK_THAT(what, Catch::Contains("printed no token"));
  }
  {
    const auto [code, what] = failure("printf 'one\\ntwo\\n'");
    CHECK(code == std::errc::permission_denied);
    CHECK_THAT(what, Catch::Contains("more than one line"));
    CHECK(what.find("one\ntwo") == std::string::npos);
  }
  {  // a helper that hangs: killed at the deadline, transient
    const auto start = std::chrono::steady_clock::now();
    const auto [code, what] = failure("sleep 30", std::chrono::milliseconds{300});
    CHECK(code == dibs::errc::timed_out);
    CHECK(dibs::is_transient(code));
    CHECK_THAT(what, Catch::Contains("'sleep 30' did not finish within 300 ms"));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds{20});
  }
  {
    const auto [code, what] = failure("head -c 100000 /dev/zero | tr '\\0' a");
    CHECK(code == dibs::errc::invalid_argument);
    CHECK_THAT(what, Catch::Contains("more than 64 KiB"));
  }
}

TEST_CASE("token_command: a helper that leaves a process in the background holding its output still gives its token at once") {
  const dibs_test::temp_dir dir;
  const auto pid_file = (dir.path / "pid").string();
  // The background sleep keeps the output pipe open for 30 s after the shell
  // exits: reading to the end of the output would stall until the deadline
  // (20 s) and give up the token.
  const auto provider = dibs::imap::token_command(
      fmt::format("sleep 30 & echo $! > '{}'; printf 'tok-bg\\n'", pid_file), std::chrono::seconds{20});
  std::string token;
  try {
    token = provider(false);
  } catch (const std::system_error& e) {
    FAIL_CHECK(e.what());
  }
  const auto pid = std::stoi(dibs_test::slurp(pid_file));
  CHECK(::kill(pid, SIGKILL) == 0);  // still running: it was not waited for
  CHECK(token == "tok-bg");
}

TEST_CASE("run_shell: standard input /dev/null (not ours), SIGCHLD at its default, no descriptor left open") {
  auto open_fds = [] {
    std::size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
    return n;
  };
  const auto fds_before = open_fds();
  {  // our standard input a pipe with data in it: never the helper's
    int p[2];
    REQUIRE(::pipe(p) == 0);
    (void)!::write(p[1], "data for us\n", 12);
    const int saved = ::dup(STDIN_FILENO);
    ::dup2(p[0], STDIN_FILENO);
    const auto r = dibs::detail::run_shell("readlink /proc/self/fd/0; cat", std::chrono::seconds{20}, 4096);
    ::dup2(saved, STDIN_FILENO);
    ::close(saved);
    ::close(p[0]);
    ::close(p[1]);
    CHECK(r.out == "/dev/null\n");
    CHECK(r.exit_code == 0);
  }
  {  // SIGCHLD ignored here: not in the helper (its own waitpid would fail)
    struct sigaction ignore {}, old {};
    ignore.sa_handler = SIG_IGN;
    ::sigaction(SIGCHLD, &ignore, &old);
    const auto r = dibs::detail::run_shell("grep '^SigIgn' /proc/self/status", std::chrono::seconds{20}, 4096);
    ::sigaction(SIGCHLD, &old, nullptr);
    REQUIRE(r.out.starts_with("SigIgn:"));
    const auto mask = std::stoull(r.out.substr(r.out.find_first_not_of(" \t", 7)), nullptr, 16);
    CHECK((mask & (1ull << (SIGCHLD - 1))) == 0);
    CHECK(r.exit_code == -1);  // reaped unseen here: how it ended is not known, and not made up
  }
  {  // killed at the deadline with what it started (a group of its own), and a helper that printed too much
    const dibs_test::temp_dir dir;
    const auto pid_file = (dir.path / "pid").string();
    const auto slow =
        dibs::detail::run_shell(fmt::format("sleep 30 & echo $! > '{}'; wait", pid_file), std::chrono::seconds{2}, 4096);
    CHECK(slow.timed_out);
    CHECK(slow.signal == SIGKILL);
    const auto pid = std::stoi(dibs_test::slurp(pid_file));
    const auto ended = [&] {  // gone, or a zombie its new parent has not reaped yet
      if (::kill(pid, 0) != 0) return errno == ESRCH;
      const auto stat = dibs_test::slurp(fmt::format("/proc/{}/stat", pid));
      return stat.find(") Z ") != std::string::npos;
    };
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds{20};
    while (!ended() && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds{10});
    CHECK(ended());
    const auto big = dibs::detail::run_shell("head -c 100000 /dev/zero", std::chrono::seconds{20}, 4096);
    CHECK(big.too_long);
  }
  CHECK(open_fds() == fds_before);
}
