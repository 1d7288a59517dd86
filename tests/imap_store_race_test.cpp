// imap_store's decisions in the races a review found (Dovecot, fixture
// `imap`): what happens between a writer's APPEND and its read, a write
// that lands after its writer gave up on it, a keyword with '['. The
// program's send() is wrapped so a test can act at an exact point of the
// protocol.
#include <dibs/imap/store.hpp>

#include <catch2/catch.hpp>

#include "imap_support.hpp"
#include "support.hpp"

#include <dirent.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <thread>

namespace {
std::function<void()> before_fetch;  // run once, before the next UID FETCH leaves this program
}

extern "C" ssize_t send(int fd, const void* buf, size_t n, int flags) {
  if (before_fetch && std::string_view(static_cast<const char*>(buf), n).find("UID FETCH") != std::string_view::npos) {
    auto hook = std::exchange(before_fetch, nullptr);
    hook();
  }
  return ::syscall(SYS_sendto, fd, buf, n, flags, nullptr, 0);
}

using namespace std::chrono_literals;
namespace imap = dibs_test::imap;

TEST_CASE("a writer whose read comes after another writer won and compacted does not decide from half a view") {
  for (const bool create : {true, false}) {
    const auto f = imap::fresh_folder("partial");
    const auto server = imap::options();
    dibs::imap_store c{server, {.folder = f, .compact_after = 1000}};
    dibs::imap_store a{server, {.folder = f, .compact_after = 1000}};
    dibs::imap_store b{server, {.folder = f, .compact_after = 2, .compact_grace = 2s}};
    auto v = *c.create("item", "c0");
    for (int i = 1; i <= 3; ++i) v = *c.replace("item", v, "c" + std::to_string(i));
    std::this_thread::sleep_for(3500ms);  // the history is older than b's grace
    const auto ra = a.read("item");
    REQUIRE(ra);
    std::optional<dibs::version> won_b;
    // Between a's APPEND and a's read of what came before it: b replaces
    // the current record, compacts the history below it, and expunges it.
    before_fetch = [&] {
      const auto rb = b.read("item");
      won_b = b.replace("item", rb->version, "b");
      (void)b.read("item");  // carries the owed expunge
    };
    std::optional<dibs::version> won_a;
    bool unknown = false;
    try {
      won_a = create ? a.create("item", "a") : a.replace("item", ra->version, "a");
    } catch (const std::system_error& e) {
      REQUIRE(e.code() == dibs::errc::outcome_unknown);  // allowed: it cannot know
      unknown = true;
    }
    REQUIRE(won_b);
    INFO((create ? "create" : "replace") << ": a " << (unknown ? "unknown" : won_a ? "won" : "lost"));
    dibs::imap_store d{server, {.folder = f}};
    const auto now = d.read("item");
    REQUIRE(now);
    if (create) CHECK_FALSE(won_a);  // the key was present throughout: a create can never win
    if (won_a) CHECK(now->version > *won_a);  // if a won, b replaced a's record (b read it), and nothing else
    if (!unknown && !won_a) CHECK(now->value == "b");
    CHECK(a.read("item") == now);
    CHECK(b.read("item") == now);
  }
}

namespace {
// The imap processes (one per connection) of this test's Dovecot: the
// children of its master (HOME/run/master.pid, HOME in DIR/home, as
// scripts/imap.sh keeps them), never another server's on the machine (a
// second suite's, whose process the test would stop instead).
std::set<int> imap_processes() {
  std::string home;
  std::getline(std::ifstream(dibs_test::imap::dir() + "/home"), home);
  std::string master;
  std::getline(std::ifstream(home + "/run/master.pid"), master);
  std::set<int> out;
  DIR* d = ::opendir("/proc");
  while (auto* e = ::readdir(d)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    std::ifstream comm(fmt::format("/proc/{}/comm", pid));
    std::string name;
    std::getline(comm, name);
    if (name != "imap") continue;
    std::ifstream status(fmt::format("/proc/{}/status", pid));
    for (std::string line; std::getline(status, line);)
      if (line.rfind("PPid:", 0) == 0) {
        if (!master.empty() && std::stoi(line.substr(5)) == std::stoi(master)) out.insert(pid);
        break;
      }
  }
  ::closedir(d);
  return out;
}
}  // namespace

TEST_CASE("a write that lands after its writer gave up on it, and is then made again, counts once", "[server-alone]") {
  auto server = imap::options();
  server.timeout = 1s;
  const auto f = imap::fresh_folder("late");
  const auto before = imap_processes();
  dibs::imap_store a{server, {.folder = f}};
  int mine = 0;
  for (const int p : imap_processes())
    if (!before.count(p)) mine = p;
  REQUIRE(mine > 0);
  const auto v1 = *a.create("k", "first");
  // The server process of a's connection stops: a's replace is sent and
  // never answered.
  REQUIRE(::kill(mine, SIGSTOP) == 0);
  try {
    (void)a.replace("k", v1, "mine");
    FAIL("an unanswered write was reported");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::outcome_unknown);
  }
  CHECK(a.read("k") == dibs::record{"first", v1});  // the read-back: not applied (yet)
  REQUIRE(::kill(mine, SIGCONT) == 0);
  // The stopped process applies the write it had: seen by another session,
  // not assumed after 500 ms (were it applied after the write below, the
  // case would be another one).
  {
    dibs::imap_store probe{server, {.folder = f}};
    const auto give_up = std::chrono::steady_clock::now() + 60s;
    auto landed = [&] {
      const auto r = probe.read("k");
      return r && r->value == "mine";
    };
    while (!landed() && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(20ms);
    REQUIRE(landed());
  }
  // The policies make the write again (detail::store_replace): it is
  // recognised as the one that landed late, not reported as a lost race.
  const auto again = a.replace("k", v1, "mine");
  REQUIRE(again);
  CHECK(a.read("k") == dibs::record{"mine", *again});
  CHECK_FALSE(a.replace("k", v1, "mine-twice"));
  dibs::imap_store fresh{server, {.folder = f}};
  CHECK(fresh.read("k") == dibs::record{"mine", *again});
}

TEST_CASE("a keyword a person set with an open bracket in it (todo-1 written with a bracket) does not hide a record") {
  const auto f = imap::fresh_folder("bracket");
  const auto server = imap::options();
  dibs::imap_store a{server, {.folder = f}};
  const auto v = a.create("k", "a holds it");
  REQUIRE(v);
  {
    dibs::imap::session person{server};
    person.check(person.run("SELECT " + dibs::imap::quote(f)), "select");
    person.check(person.run(fmt::format("UID STORE {} +FLAGS (todo[1)", *v & 0xffffffffu)), "tag");
  }
  dibs::imap_store b{server, {.folder = f}};
  CHECK(b.read("k") == dibs::record{"a holds it", *v});
  CHECK_FALSE(b.create("k", "b holds it"));
}
