// dibs/imap.hpp on its own: the response parser, quoting, and the session
// against a scripted server on a loopback socket (no Dovecot needed): a
// server without LITERAL+, a connection cut after a write was sent, a
// refused login, BYE; before the login: capabilities asked when the
// greeting has none, LOGINDISABLED, STARTTLS missing or followed by injected
// plaintext, a TLS handshake that never comes (TLS itself:
// imap_tls_test.cpp, against Dovecot).
#include <dibs/imap.hpp>
#include <dibs/imap_store.hpp>

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <thread>

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
  CHECK(dibs::imap::detail::parse_uid_set("3:5,9,12:10") == std::set<std::uint32_t>{3, 4, 5, 9, 10, 11, 12});
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

void say(int fd, const std::string& s) { (void)!::write(fd, s.data(), s.size()); }

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
