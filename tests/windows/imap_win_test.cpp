// dibs::imap over Winsock, under Wine, against the Linux Dovecot of
// scripts/imap.sh (the ctest fixture `imap`; scripts/wine-run.sh passes its
// DIR/env to the Wine process as DIBS_IMAP_HOST, _PORT, _USER, _PASSWORD):
// imap_store through the conformance kit, marker_claim<imap_store> across
// worker processes ended by TerminateProcess, imap_mailbox, and a server
// that is not there or goes away. This build has no OpenSSL: TLS is refused
// by name.
#include "win_support.hpp"

#include "../fenced_effect.hpp"

#include <dibs/imap/client.hpp>
#include <dibs/imap/mailbox.hpp>
#include <dibs/imap/store.hpp>
// The forwarding paths of 0.1 build on Windows too.
#include <dibs/imap/client.hpp>
#include <dibs/imap/mailbox.hpp>
#include <dibs/imap/store.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace win_test;

// The Dovecot of the fixture, as the environment names it.
dibs::imap::options server() {
  const char* port = std::getenv("DIBS_IMAP_PORT");
  if (!port || !*port)
    FAIL("DIBS_IMAP_PORT is not set: run this test through ctest (fixture imap: scripts/imap.sh, whose DIR/env "
         "scripts/wine-run.sh passes to Wine)");
  auto o = dibs::imap::options::from_env();
  o.timeout = 30s;
  return o;
}

std::string fresh_folder(const std::string& stem) {
  std::random_device rd;
  return fmt::format("t-win-{}-{:x}{:x}", stem, rd(), rd());
}

// A loopback port nothing listens on: one the system gave and took back.
std::string closed_port() {
  dibs::detail::socket_startup();
  const SOCKET s = ::socket(AF_INET, SOCK_STREAM, IPPROTO_TCP);
  REQUIRE(s != INVALID_SOCKET);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int len = sizeof a;
  REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::closesocket(s);
  return std::to_string(ntohs(a.sin_port));
}

std::string item_key(int i) { return fmt::format("<item-{:03}@win.example>", i); }

// The claiming role: claims every item it can over imap_store, writes the
// effect to a fenced journal (a file_store), completes it; exits 0 once
// every item is completed. Transient failures are waited out.
int claim_worker(const std::string& folder, const fs::path& journal_dir, int items, unsigned seed) {
  const auto o = server();
  dibs::imap_store store{o, {.folder = folder}};
  dibs::file_store journal{journal_dir};
  dibs::marker_claim<dibs::imap_store> claims{store, {.lease = 30s, .max_attempts = 10}};
  // Each item held 150 ms: most kills find a claim held.
  return dibs_test::claim_every_item(claims, journal, items, item_key, seed, 150ms, 20ms);
}

const register_role claim_role{"--imap-claim-worker", [](int argc, char** argv) {
  return argc == 4 ? claim_worker(argv[0], argv[1], std::atoi(argv[2]), static_cast<unsigned>(std::atoi(argv[3]))) : 2;
}};

}  // namespace

TEST_CASE("Windows imap_store passes the conformance kit's single-process checks against Dovecot") {
  dibs::imap_store s{server(), {.folder = fresh_folder("conf")}};
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-", 20));
}

TEST_CASE("Windows imap_store: 4 threads race the conformance kit's create and counter checks") {
  dibs::imap_store s{server(), {.folder = fresh_folder("thr")}};
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 4, 10, "thr-"));
}

TEST_CASE("Windows marker_claim<imap_store>: 3 worker processes, 60 items, 3 TerminateProcess kills, each item completed once with its effect") {
  temp_dir dir;
  const auto journal_dir = dir.path / "journal";
  fs::create_directories(journal_dir);
  const auto folder = fresh_folder("claim");
  { dibs::imap_store create{server(), {.folder = folder}}; }  // made once, not raced by the workers
  constexpr int items = 60;
  int seed = 0;
  auto start = [&] {
    return std::make_unique<child>(std::vector<std::wstring>{L"--imap-claim-worker",
                                                             std::wstring(folder.begin(), folder.end()),
                                                             journal_dir.wstring(), std::to_wstring(items),
                                                             std::to_wstring(seed++)});
  };
  std::vector<std::unique_ptr<child>> procs;
  for (int i = 0; i < 3; ++i) procs.push_back(start());
  // The effects written so far (a process takes about 3 s to start under
  // Wine: each kill waits until the workers are at it).
  auto effects = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(journal_dir)) n += e.path().extension() == ".rec";
    return n;
  };
  std::mt19937 rng(7);
  for (int k = 0; k < 3; ++k) {
    for (const auto until = std::chrono::steady_clock::now() + 30s;
         effects() < (k + 1) * items / 5 && std::chrono::steady_clock::now() < until;)
      std::this_thread::sleep_for(20ms);
    auto& victim = procs[std::uniform_int_distribution<std::size_t>{0, procs.size() - 1}(rng)];
    victim->kill();
    victim = start();
  }
  for (auto& p : procs) CHECK(p->wait(120s) == DWORD{0});

  dibs::imap_store store{server(), {.folder = folder}};
  dibs::file_store journal{journal_dir};
  dibs::marker_claim<dibs::imap_store> claims{store};
  int completed = 0, effects_match = 0, retried = 0;
  for (int i = 0; i < items; ++i) {
    const auto s = claims.status(item_key(i));
    completed += s.state == dibs::claim_state::completed;
    retried += s.attempts > 1;
    const auto e = journal.read(item_key(i));
    effects_match += e && e->value == s.result;
  }
  INFO("items claimed again after a kill: " << retried);
  CHECK(completed == items);
  CHECK(effects_match == items);  // each item's effect in the journal once, from the claim that completed it
  CHECK(retried >= 1);            // the kills found claims held (each is held about 150 ms of its ~170)
}

TEST_CASE("Windows imap_mailbox: next() and complete() take each of 12 delivered messages once, shown $Completed") {
  const auto o = server();
  const auto mailbox = fresh_folder("box");
  dibs::imap::session s{o};
  s.check(s.run("CREATE " + dibs::imap::quote(mailbox)), "CREATE");
  constexpr int n = 12;
  for (int i = 0; i < n; ++i) {
    const auto text = fmt::format("From: a@win.example\r\nSubject: order {}\r\nMessage-ID: <o{}@win.example>\r\n\r\nbody {}\r\n", i, i, i);
    s.check(s.run(fmt::format("APPEND {} {{{}+}}\r\n{}", dibs::imap::quote(mailbox), text.size(), text)), "APPEND");
  }
  dibs::imap_store store{o, {.folder = fresh_folder("boxclaims")}};
  dibs::imap_mailbox box{o, store, {.mailbox = mailbox, .on_note = [](std::string_view) {}}};
  std::set<std::string> subjects;
  int handed = 0;
  while (auto m = box.next(500ms)) {
    ++handed;
    const auto at = m->raw().find("Subject: ");
    REQUIRE(at != std::string::npos);
    subjects.insert(m->raw().substr(at, m->raw().find('\r', at) - at));
    m->complete("done");
  }
  CHECK(handed == n);
  CHECK(subjects.size() == static_cast<std::size_t>(n));
  const auto seen = box.status();
  int completed = 0, shown = 0;
  for (const auto& e : seen) {
    completed += e.status.state == dibs::claim_state::completed;
    for (const auto& k : e.keywords) shown += k == "$Completed";
  }
  CHECK(seen.size() == static_cast<std::size_t>(n));
  CHECK(completed == n);
  CHECK(shown == n);
}

TEST_CASE("Windows imap: a closed port is a transient error naming host:port, and TLS without OpenSSL is refused by name") {
  auto o = server();
  o.port = closed_port();
  o.timeout = 5s;
  try {
    dibs::imap::session s{o};
    FAIL("connected to a closed port");
  } catch (const std::system_error& e) {
    INFO(e.what());
    CHECK(dibs::is_transient(e.code()));
    CHECK(e.code() == std::error_code(WSAECONNREFUSED, std::system_category()));
    CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + o.port) && Catch::Contains("is the IMAP server running?"));
  }
  try {
    dibs::imap_store st{o, {.folder = "x"}};
    FAIL("opened a store on a closed port");
  } catch (const std::system_error& e) {
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:" + o.port));
  }

  auto t = server();
  t.tls = dibs::imap::tls_mode::starttls;
  try {
    dibs::imap::session s{t};
    FAIL("TLS without OpenSSL");
  } catch (const std::system_error& e) {
    INFO(e.what());
    CHECK(e.code() == std::errc::not_supported);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains("TLS") && Catch::Contains("without OpenSSL") &&
                             Catch::Contains(t.host + ":" + t.port));
  }
}

TEST_CASE("Windows imap: Dovecot closing the connection mid-command is transient, naming host:port, and the next command reconnects") {
  const auto o = server();
  dibs::imap::session s{o};
  REQUIRE(s.connected());
  try {
    // LOGOUT: Dovecot says BYE and closes the connection before the
    // command's tagged reply is read.
    (void)s.run("LOGOUT");
    FAIL("no error after the server closed the connection");
  } catch (const std::system_error& e) {
    INFO(e.what());
    CHECK(e.code() == dibs::make_error_code(dibs::errc::connection_lost));
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Catch::Contains(o.host + ":" + o.port));
  }
  CHECK_FALSE(s.connected());
  const auto r = s.run("NOOP");  // connects and logs in again
  CHECK(r.ok());
  CHECK(s.connected());
}
