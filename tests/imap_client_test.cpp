// dibs/imap.hpp on its own: the response parser, quoting, and the session
// against a scripted server on a loopback socket (no Dovecot needed): a
// server without LITERAL+, a connection cut after a write was sent, a
// refused login, BYE; before the login: capabilities asked when the
// greeting has none, LOGINDISABLED, STARTTLS missing or followed by injected
// plaintext, a TLS handshake that never comes (TLS itself:
// imap_tls_test.cpp, against Dovecot); options::timeout bounding the whole
// connect (a full accept queue, a slow greeting); malformed replies (numbers
// that are none, a literal that lies about its size); untagged lines said
// while a literal waits for the server's go-ahead.
#include <dibs/imap/client.hpp>
#include <dibs/imap/store.hpp>

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
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
