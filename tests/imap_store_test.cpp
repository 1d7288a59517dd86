// imap_store against a real Dovecot (scripts/imap.sh, ctest fixture `imap`):
// the conformance suite, compaction, UIDVALIDITY, bad input, lost
// connections and a crashed server, and the CONDSTORE race the design
// avoids. Each test case keeps its records in a folder of its own.
#include <dibs/imap/client.hpp>
#include <dibs/imap/store.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>

#include "imap_support.hpp"
#include "support.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using Catch::Contains;
namespace imap = dibs_test::imap;
using dibs_test::fs::path;

namespace {

dibs::imap_store open_store(const std::string& folder) {
  return dibs::imap_store{imap::options(), {.folder = folder}};
}

// Compaction as eager as it gets: every write that counts removes the key's
// older messages, however young.
dibs::imap_store open_compacting(const std::string& folder) {
  return dibs::imap_store{imap::options(), {.folder = folder, .compact_after = 2, .compact_grace = 0s}};
}

// Children wait here until the parent opens it (closes its end).
struct gate {
  int fd[2];
  gate() { REQUIRE(::pipe2(fd, O_CLOEXEC) == 0); }
  ~gate() { open(); }
  void wait_in_child() const {
    ::close(fd[1]);
    char c;
    while (::read(fd[0], &c, 1) < 0 && errno == EINTR) {
    }
  }
  void open() {
    for (int& f : fd)
      if (f >= 0) ::close(std::exchange(f, -1));
  }
};

// Appends `line` and a newline to `file` in one write (O_APPEND: lines of
// several processes never mix).
void append_line(const path& file, const std::string& line) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(dibs_test::os_error("open wins file"));
  const std::string l = line + '\n';
  const auto n = ::write(fd, l.data(), l.size());
  ::close(fd);
  if (n != static_cast<ssize_t>(l.size())) throw std::runtime_error(dibs_test::os_error("write wins file"));
}

std::vector<std::string> lines_of(const path& file) {
  std::istringstream in(dibs_test::slurp(file));
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

/// `workers` processes, each with its own store from open(), start at once
/// and go through `items` keys in the same order with
/// marker_claim::try_claim until every key is completed; a winner appends
/// "<key> <token> <pid>" to a file before complete(token). Checks: every
/// worker ends cleanly, each key was won exactly once (exactly `items`
/// lines, `items` distinct keys), and each key is completed with the result
/// of the claim that won it.
template <class Open>
void check_each_claimed_once(Open open, int workers, int items, const std::string& prefix) {
  using Store = std::remove_cvref_t<decltype(open())>;
  dibs_test::temp_dir tmp;
  const auto wins = tmp.path / "wins";
  auto key = [&](int i) { return fmt::format("{}<item/{:03}@mail.example.com>", prefix, i); };
  dibs_test::channel ready;
  gate start;
  std::vector<pid_t> pids;
  for (int w = 0; w < workers; ++w)
    pids.push_back(dibs_test::spawn([&]() -> int {
      auto store = open();
      // A short lease: a claim whose create's outcome could not be learned
      // (held in this worker's name, with no claim object) comes back soon.
      dibs::marker_claim<Store> claims{store, {.lease = 10s, .max_attempts = 10}};
      ready.send("ready");
      start.wait_in_child();
      const auto deadline = std::chrono::steady_clock::now() + 240s;
      while (std::chrono::steady_clock::now() < deadline) {
        bool all_done = true;
        for (int i = 0; i < items; ++i) {
          const auto k = key(i);
          try {
            if (auto c = claims.try_claim(k)) {
              append_line(wins, fmt::format("{} {} {}", k, c->token(), ::getpid()));
              c->complete(std::to_string(c->token()));
            } else if (claims.status(k).state != dibs::claim_state::completed) {
              all_done = false;
            }
          } catch (const std::system_error& e) {
            if (!dibs::is_transient(e.code()) && e.code() != dibs::errc::outcome_unknown) throw;
            all_done = false;
            std::this_thread::sleep_for(20ms);
          }
        }
        if (all_done) return 0;
        std::this_thread::sleep_for(5ms);
      }
      return 3;  // not everything completed in time
    }));
  for (int w = 0; w < workers; ++w) REQUIRE(ready.receive(60s));
  start.open();
  int failed = 0;
  for (const pid_t p : pids) failed += dibs_test::wait_exit(p) != 0;
  CHECK(failed == 0);

  const auto lines = lines_of(wins);
  std::map<std::string, std::vector<std::string>> by_key;  // key -> the tokens of its wins
  for (const auto& l : lines) {
    const auto sp = l.find(' ');
    by_key[l.substr(0, sp)].push_back(dibs_test::words(l.substr(sp + 1)).front());
  }
  int twice = 0;
  for (const auto& [k, tokens] : by_key) twice += tokens.size() > 1;
  CHECK(lines.size() == static_cast<std::size_t>(items));
  CHECK(by_key.size() == static_cast<std::size_t>(items));
  CHECK(twice == 0);

  auto store = open();
  dibs::marker_claim<Store> claims{store};
  int completed = 0, by_winner = 0;
  for (int i = 0; i < items; ++i) {
    const auto s = claims.status(key(i));
    completed += s.state == dibs::claim_state::completed;
    const auto it = by_key.find(key(i));
    by_winner += it != by_key.end() && it->second.size() == 1 && s.result == it->second.front();
  }
  CHECK(completed == items);
  CHECK(by_winner == items);  // completed by the claim that won it, with its token
}

std::string flags_of(dibs::imap::session& s, std::uint32_t uid) {
  const auto r = s.run(fmt::format("UID FETCH {} (FLAGS)", uid));
  s.check(r, "UID FETCH FLAGS");
  for (const auto& u : r.untagged)
    if (u.find("FETCH") != std::string::npos) return u;
  return {};
}

// A port on 127.0.0.1 where nothing listens: bound (so nobody else gets it)
// and never listening, so a connect is refused.
struct dead_port {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  std::string port;
  dead_port() {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port = std::to_string(ntohs(a.sin_port));
  }
  ~dead_port() { ::close(fd); }
};

}  // namespace

TEST_CASE("imap_store passes the conformance suite, in one process and across 4", "[conformance]") {
  const auto f = imap::fresh_folder("conf");
  auto s = open_store(f);
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-", 30));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 4, 25, "thr-"));
  REQUIRE_NOTHROW(dibs::testing::check_create_race_processes([&] { return open_store(f); }, 4, "race-create"));
  REQUIRE_NOTHROW(dibs::testing::check_counter_race_processes([&] { return open_store(f); }, 4, 50, "race-counter"));
  // A person deletes the key's mails in a mail client: every message whose
  // subject names the key, marked \Deleted and expunged.
  dibs::imap::session person{imap::options()};
  person.check(person.run("SELECT " + dibs::imap::quote(f)), "select");
  REQUIRE_NOTHROW(dibs::testing::check_removed_by_hand(s, "hand-", [&](std::string_view key) {
    // Dovecot searches the session's view as of its previous command: a
    // NOOP first brings in what the store appended since.
    person.check(person.run("NOOP"), "noop");
    const auto found = person.run(fmt::format("UID SEARCH SUBJECT \"{}\"", key));
    person.check(found, "search");
    std::string uids;
    for (const auto& u : found.untagged)
      if (u.starts_with("SEARCH ")) uids = u.substr(7);
    REQUIRE_FALSE(uids.empty());
    for (auto& c : uids) c = c == ' ' ? ',' : c;
    person.check(person.run("UID STORE " + uids + " +FLAGS.SILENT (\\Deleted)"), "store");
    person.check(person.run("UID EXPUNGE " + uids), "expunge");
  }));
}

TEST_CASE("compaction keeps one key's messages at 2 or fewer through 60 replaces, and the last value and version") {
  const auto f = imap::fresh_folder("compact");
  auto s = open_compacting(f);
  dibs::imap::session look{imap::options()};
  const auto first = s.create("k", "0");
  REQUIRE(first);
  auto v = *first;
  std::uint64_t most = imap::messages(look, f);
  for (int i = 1; i <= 60; ++i) {
    const auto next = s.replace("k", v, std::to_string(i));
    REQUIRE(next);
    CHECK(*next > v);  // versions strictly grow
    v = *next;
    // The write's own message and the one before it, whose expunge is owed
    // until the store's next command; never more.
    most = std::max(most, imap::messages(look, f));
  }
  CHECK(most <= 2);
  CHECK(s.read("k") == dibs::record{"60", v});
  CHECK(imap::messages(look, f) == 1);  // the read sent the owed expunge first
  // The version the first message had (compacted away) is no longer
  // current: a replace naming it loses, and changes nothing.
  CHECK_FALSE(s.replace("k", *first, "stale"));
  auto other = open_store(f);  // another process's view
  CHECK(other.read("k") == dibs::record{"60", v});
  CHECK(other.keys() == std::vector<std::string>{"k"});
}

TEST_CASE("4 processes race marker_claim over 100 keys with compaction at grace 0 and each key is completed once") {
  const auto f = imap::fresh_folder("claimcompact");
  check_each_claimed_once([&] { return open_compacting(f); }, 4, 100, "c/");
  // Every key ends as one message: compaction removed the creates, and each
  // loser removed its own message (the stores' destructors send what is
  // owed). A write that learned errc::outcome_unknown (a message of a higher
  // UID already marked $DibsBase when it looked) may leave its message
  // behind: a few of those at most; without compaction there are 350-400.
  dibs::imap::session look{imap::options()};
  const auto left = imap::messages(look, f);
  INFO("messages left in the folder: " << left);
  CHECK(left >= 100);
  CHECK(left <= 110);
}

TEST_CASE("a person clearing $DibsBase in dibs's folder after compaction never makes a completed item claimable again") {
  const auto f = imap::fresh_folder("clearbase");
  auto s = open_compacting(f);
  dibs::marker_claim<dibs::imap_store> claims{s};
  for (const auto* key : {"order/1", "order/2"}) {
    auto c = claims.try_claim(key);
    REQUIRE(c);
    c->complete("shipped");
  }
  (void)s.read("order/1");  // sends what compaction owes
  dibs::imap::session person{imap::options()};
  REQUIRE(imap::messages(person, f) == 2);  // compacted: one message per key, the history below it gone
  // Any mail client can do this: take the keyword off every message.
  person.check(person.run("SELECT " + dibs::imap::quote(f)), "select");
  person.check(person.run("UID STORE 1:* -FLAGS ($DibsBase)"), "store");
  auto fresh = open_store(f);  // another worker, reading the folder from scratch
  dibs::marker_claim<dibs::imap_store> others{fresh};
  for (auto* cl : {&claims, &others})
    for (const auto* key : {"order/1", "order/2"}) {
      INFO(key);
      const auto st = cl->status(key);
      CHECK(st.state == dibs::claim_state::completed);
      CHECK(st.result == "shipped");
      CHECK_FALSE(cl->try_claim(key));  // nobody does the work again
    }
  CHECK(fresh.keys() == std::vector<std::string>{"order/1", "order/2"});
  CHECK(imap::messages(person, f) == 2);  // no claim was written
}

TEST_CASE("versions carry the folder's UIDVALIDITY, and a folder re-created under an open store is ESTALE") {
  const auto f = imap::fresh_folder("validity");
  auto s = open_store(f);
  dibs::imap::session look{imap::options()};
  const auto validity = imap::status(look, f, "UIDVALIDITY");
  CHECK(validity != 0);
  CHECK(s.uid_validity() == validity);
  const auto v1 = s.create("k", "one");
  REQUIRE(v1);
  CHECK((*v1 >> 32) == validity);
  CHECK((*v1 & 0xffffffffu) == *imap::all_uids(look, f).rbegin());  // the low half is the message's UID
  const auto v2 = s.replace("k", *v1, "two");
  REQUIRE(v2);
  CHECK((*v2 >> 32) == validity);
  CHECK(*v2 > *v1);

  // Deleted and re-created by someone else while the store has it selected.
  {
    dibs::imap::session admin{imap::options()};
    admin.check(admin.run(fmt::format("DELETE {}", dibs::imap::quote(f))), "DELETE");
    admin.check(admin.run(fmt::format("CREATE {}", dibs::imap::quote(f))), "CREATE");
    CHECK(imap::status(admin, f, "UIDVALIDITY") != validity);
  }
  auto expect_stale = [&](auto&& op, const char* what) {
    INFO(what);
    try {
      op();
      FAIL("an operation on a re-created folder did not fail");
    } catch (const std::system_error& e) {
      INFO(e.what());
      CHECK(e.code() == std::error_code(ESTALE, std::generic_category()));
      CHECK_FALSE(dibs::is_transient(e.code()));
      CHECK_THAT(e.what(), Contains("re-created") && Contains("'" + f + "'"));
    }
  };
  // Dovecot 2.3 ends the session that has the deleted folder selected at its
  // next command ("BYE FETCH failed: Internal error"): the first operation
  // may see that lost connection (transient) instead; the one after it, and
  // the policies' read (which retries transient failures), must say ESTALE.
  try {
    (void)s.read("k");
    FAIL("a read on a re-created folder succeeded");
  } catch (const std::system_error& e) {
    WARN("the first read after the folder was re-created: " << e.code() << ": " << e.what());
    CHECK((e.code() == std::error_code(ESTALE, std::generic_category()) || e.code() == dibs::errc::connection_lost));
  }
  expect_stale([&] { (void)s.read("k"); }, "a read after it");
  expect_stale([&] { (void)dibs::detail::store_read(s, "k", dibs::time_limit::max()); }, "the policies' read");
  expect_stale([&] { (void)s.replace("k", *v2, "three"); }, "a write after it");
  expect_stale([&] { (void)s.create("fresh", "x"); }, "a create after it");

  // A new store starts over: the records are gone, nothing the old store
  // tried landed, and the new incarnation's versions differ from the old
  // ones also where the UIDs coincide.
  auto again = open_store(f);
  CHECK(again.uid_validity() != validity);
  CHECK_FALSE(again.read("k"));
  CHECK_FALSE(again.read("fresh"));
  CHECK(again.keys().empty());
  const auto n1 = again.create("k", "new");
  REQUIRE(n1);
  CHECK((*n1 >> 32) == again.uid_validity());
  CHECK((*n1 & 0xffffffffu) == (*v1 & 0xffffffffu));  // UID 1 in both incarnations
  CHECK(*n1 != *v1);
  CHECK_FALSE(again.replace("k", *v1, "stale"));  // the old incarnation's version is never current
  CHECK_FALSE(again.erase("k", *v1));
  CHECK(again.read("k") == dibs::record{"new", *n1});
}

TEST_CASE("a write as the first operation on a re-created folder fails and writes nothing, and ESTALE follows") {
  // The APPEND names the folder: it lands in the new one. The writer must
  // not say "not applied" (ESTALE) while its record counts there.
  const auto f = imap::fresh_folder("validity2");
  auto s = open_store(f);
  REQUIRE(s.create("k", "one"));
  const auto validity = s.uid_validity();
  {
    dibs::imap::session admin{imap::options()};
    admin.check(admin.run(fmt::format("DELETE {}", dibs::imap::quote(f))), "DELETE");
    admin.check(admin.run(fmt::format("CREATE {}", dibs::imap::quote(f))), "CREATE");
  }
  std::error_code code;
  try {
    (void)s.create("fresh", "x");
    FAIL("a create on a re-created folder succeeded");
  } catch (const std::system_error& e) {
    WARN("a create as the first operation after the folder was re-created: " << e.code() << ": " << e.what());
    code = e.code();
  }
  CHECK_FALSE(dibs::is_transient(code));
  // Dovecot 2.3 refuses that APPEND ("NO [SERVERBUG]") while the session has
  // the deleted folder selected; the store must say ESTALE by the operation
  // after it at the latest.
  try {
    (void)s.create("fresh2", "x");
    FAIL("a second create on a re-created folder succeeded");
  } catch (const std::system_error& e) {
    INFO(e.what());
    CHECK(e.code() == std::error_code(ESTALE, std::generic_category()));
    CHECK_THAT(e.what(), Contains("re-created"));
  }
  auto again = open_store(f);
  CHECK(again.uid_validity() != validity);
  // Unless the writer was told its outcome is unknown, nothing it tried landed.
  const auto landed = again.read("fresh");
  INFO("the first create's record in the new folder: " << (landed ? landed->value : std::string("none")));
  if (code != dibs::errc::outcome_unknown) CHECK_FALSE(landed);
  CHECK_FALSE(again.read("fresh2"));
  CHECK_FALSE(again.read("k"));
}

TEST_CASE("bad input: a wrong password, no server, an empty folder name") {
  const auto f = imap::fresh_folder("badinput");
  auto wrong = imap::options();
  wrong.password = "not-the-password";
  try {
    dibs::imap_store s{wrong, {.folder = f}};
    FAIL("a wrong password was accepted");
  } catch (const std::system_error& e) {
    CHECK(e.code() == std::make_error_code(std::errc::permission_denied));
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("user 'dibs'") && Contains(wrong.host + ":" + wrong.port));
  }

  dead_port nothing;
  auto down = imap::options();
  down.port = nothing.port;
  try {
    dibs::imap_store s{down, {.folder = f}};
    FAIL("connected to nothing");
  } catch (const std::system_error& e) {
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("127.0.0.1:" + nothing.port) && Contains("is the IMAP server running"));
  }

  try {
    dibs::imap_store s{imap::options(), {.folder = ""}};
    FAIL("an empty folder name was accepted");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::invalid_argument);
    CHECK_THAT(e.what(), Contains("folder name is empty"));
  }
  // None of it made the folder.
  dibs::imap::session look{imap::options()};
  CHECK_FALSE(look.run(fmt::format("STATUS {} (MESSAGES)", dibs::imap::quote(f))).ok());
}

TEST_CASE("a foreign message in dibs's folder is never listed, changed or removed, also by compaction") {
  const auto f = imap::fresh_folder("foreign");
  dibs::imap::session look{imap::options()};
  look.check(look.run(fmt::format("CREATE {}", dibs::imap::quote(f))), "CREATE");
  const auto foreign = imap::append(look, f,
                                    "From: A Person <person@example.com>\r\nSubject: please keep me\r\n"
                                    "Message-ID: <keep@example.com>\r\n\r\nk\r\nhello\r\n");
  auto s = open_compacting(f);
  CHECK(s.keys().empty());
  CHECK_FALSE(s.read("k"));
  auto v = s.create("k", "0");
  REQUIRE(v);
  for (int i = 1; i <= 30; ++i) {
    v = s.replace("k", *v, std::to_string(i));
    REQUIRE(v);
  }
  CHECK(s.keys() == std::vector<std::string>{"k"});
  CHECK(s.read("k") == dibs::record{"30", *v});
  // After a read (owed expunges sent): the foreign message and k's one.
  const auto uids = imap::all_uids(look, f);
  CHECK(uids.size() == 2);
  CHECK(uids.count(foreign) == 1);
  CHECK(imap::subject(look, foreign) == "Subject: please keep me");
  const auto flags = flags_of(look, foreign);
  CHECK_THAT(flags, !Contains("DibsBase") && !Contains("Deleted"));
  // Erased: gone for the store, and the foreign message still there.
  CHECK(s.erase("k", *v));
  CHECK_FALSE(s.read("k"));
  CHECK(s.keys().empty());
  CHECK(imap::all_uids(look, f).count(foreign) == 1);
}

TEST_CASE("a forged X-Dibs-Record message is corrupt_record naming its UID, and other keys work on") {
  const auto f = imap::fresh_folder("forged");
  dibs::imap::session look{imap::options()};
  look.check(look.run(fmt::format("CREATE {}", dibs::imap::quote(f))), "CREATE");
  const auto forged = imap::append(
      look, f,
      fmt::format("From: someone <x@example.com>\r\nSubject: forged\r\nX-Dibs-Record: 1 {} create\r\n\r\n"
                  "this is not a dibs record\r\n",
                  dibs::imap::detail::key_tag("k")));
  auto s = open_store(f);
  try {
    (void)s.read("k");
    FAIL("a forged record was read");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::corrupt_record);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains(fmt::format("UID {} ", forged)) && Contains("'" + f + "'"));
  }
  const auto v = s.create("other", "v");
  REQUIRE(v);
  CHECK(s.read("other") == dibs::record{"v", *v});
  CHECK(imap::all_uids(look, f).count(forged) == 1);  // left where it is, for a person to move

  // A claim whose key also has a forged message is listed as damaged (the
  // listing reads all records at once, and the damaged one by itself).
  dibs::marker_claim<dibs::imap_store> claims{s, {.on_damaged = [](std::string_view, std::string_view) {}}};
  auto job1 = claims.try_claim("job-1");
  auto job2 = claims.try_claim("job-2");
  REQUIRE(job1);
  REQUIRE(job2);
  imap::append(look, f,
               fmt::format("From: someone <x@example.com>\r\nSubject: forged\r\nX-Dibs-Record: 1 {} create\r\n\r\n"
                           "this is not a dibs record either\r\n",
                           dibs::imap::detail::key_tag("job-2")));
  const auto items = claims.list("job-");
  REQUIRE(items.size() == 2);
  CHECK(items[0].key == "job-1");
  CHECK(items[0].status.state == dibs::claim_state::processing);
  CHECK(items[1].key == "job-2");
  CHECK(items[1].status.state == dibs::claim_state::damaged);
  CHECK_THAT(items[1].status.error, Contains("move it out of the folder"));
}

TEST_CASE("a folder the server cannot write: opening it and appending to it fail, naming the folder") {
  const auto f = imap::fresh_folder("readonly");
  auto s = open_store(f);
  const auto v = s.create("k", "v");
  REQUIRE(v);
  const auto dir = imap::folder_dir(f);
  REQUIRE(dibs_test::fs::is_directory(dir));
  struct restore {
    path dir;
    ~restore() { dibs_test::sh("chmod -R u+w '" + dir.string() + "'"); }
  } restore_after{dir};
  REQUIRE(dibs_test::sh("chmod -R a-w '" + dir.string() + "'") == 0);

  // Opening it (Dovecot 2.3 answers SELECT with NO [SERVERBUG], not [READ-ONLY]).
  try {
    auto s2 = open_store(f);
    FAIL("an unwritable folder was opened");
  } catch (const std::system_error& e) {
    WARN("opening an unwritable folder: " << e.code() << ": " << e.what());
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("'" + f + "'"));
  }
  // Writing through a store that had it open already.
  try {
    (void)s.create("k2", "v2");
    FAIL("an APPEND to an unwritable folder was reported a success");
  } catch (const std::system_error& e) {
    WARN("appending to an unwritable folder: " << e.code() << ": " << e.what());
    CHECK(e.code() != dibs::errc::outcome_unknown);
    CHECK_FALSE(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains("'" + f + "'") && Contains("k2"));
  }
  REQUIRE(dibs_test::sh("chmod -R u+w '" + dir.string() + "'") == 0);
  auto s3 = open_store(f);
  CHECK_FALSE(s3.read("k2"));  // nothing was written
  CHECK(s3.read("k") == dibs::record{"v", *v});
}

TEST_CASE("a dropped connection is reconnected by the next operation") {
  const auto f = imap::fresh_folder("drop");
  auto s = open_store(f);
  const auto v1 = s.create("k", "one");
  REQUIRE(v1);
  s.session().drop();
  CHECK_FALSE(s.session().connected());
  CHECK(s.read("k") == dibs::record{"one", *v1});
  CHECK(s.session().connected());
  s.session().drop();
  const auto v2 = s.replace("k", *v1, "two");  // a version from before the reconnect is still current
  REQUIRE(v2);
  CHECK(*v2 > *v1);
  s.session().drop();
  CHECK_FALSE(s.create("k", "again"));  // a lost race after a reconnect, not an error
  s.session().drop();
  CHECK(s.keys() == std::vector<std::string>{"k"});
  s.session().drop();
  CHECK(s.erase("k", *v2));
  s.session().drop();
  CHECK_FALSE(s.read("k"));
}

TEST_CASE("the server SIGKILLed and restarted under an open store: transient errors, then every record back", "[chaos][server-alone]") {
  const auto f = imap::fresh_folder("crash");
  auto s = open_store(f);
  std::map<std::string, dibs::record> before;
  for (int i = 0; i < 10; ++i) {
    const auto k = fmt::format("k{}", i);
    auto v = s.create(k, fmt::format("value {}", i));
    REQUIRE(v);
    if (i % 2) {
      v = s.replace(k, *v, fmt::format("value {} replaced", i));
      REQUIRE(v);
    }
    before[k] = {i % 2 ? fmt::format("value {} replaced", i) : fmt::format("value {}", i), *v};
  }
  struct restart_at_exit {
    bool done = false;
    ~restart_at_exit() {
      if (!done) dibs_test::sh(std::string(DIBS_SOURCE_DIR) + "/scripts/imap.sh restart " + imap::dir());
    }
  } guard;
  imap::kill_server();
  auto expect_transient = [&](auto&& op, const char* what) {
    INFO(what);
    try {
      op();
      FAIL("an operation succeeded while the server was down");
    } catch (const std::system_error& e) {
      INFO(e.what());
      CHECK(dibs::is_transient(e.code()));
    }
  };
  expect_transient([&] { (void)s.read("k0"); }, "a read on the connection the server had");
  expect_transient([&] { (void)s.read("k1"); }, "a read that reconnects");
  expect_transient([&] { (void)s.create("new", "x"); }, "a create (its connect fails before anything is sent)");
  expect_transient([&] { (void)s.keys(); }, "keys()");
  imap::restart_server();
  guard.done = true;
  for (const auto& [k, r] : before) CHECK(s.read(k) == r);
  CHECK_FALSE(s.read("new"));
  const auto v = s.create("new", "after");
  REQUIRE(v);
  CHECK((*v >> 32) == s.uid_validity());  // the same folder, the same UIDVALIDITY
  CHECK(s.keys().size() == 11);
}

TEST_CASE("after a crash mid-APPEND, the server's NO [SERVERBUG] to the next APPEND is transient, and the write counts once", "[server-alone]") {
  const auto f = imap::fresh_folder("serverbug");
  auto s = open_store(f);
  const auto v = s.create("k", "before");
  REQUIRE(v);
  struct restart_at_exit {
    bool done = false;
    ~restart_at_exit() {
      if (!done) dibs_test::sh(std::string(DIBS_SOURCE_DIR) + "/scripts/imap.sh restart " + imap::dir());
    }
  } guard;
  imap::kill_server();
  // What a kill during an APPEND leaves (sdbox): the next message's file,
  // which the index never took in (here a copy of the last one).
  const auto mails = imap::folder_dir(f) / "dbox-Mails";
  std::uint32_t last = 0;
  for (const auto& e : dibs_test::fs::directory_iterator(mails))
    if (const auto name = e.path().filename().string(); name.starts_with("u."))
      last = std::max(last, static_cast<std::uint32_t>(std::stoul(name.substr(2))));
  REQUIRE(dibs_test::sh(fmt::format("cp -p '{}/u.{}' '{}/u.{}'", mails.string(), last, mails.string(), last + 1)) == 0);
  imap::restart_server();
  guard.done = true;
  std::vector<std::string> errors;
  std::optional<dibs::version> w;
  for (int i = 0; i < 10 && !w; ++i) {
    try {
      w = s.replace("k", *v, "after");
      REQUIRE(w);
    } catch (const std::system_error& e) {
      errors.push_back(e.what());
      INFO(e.what());
      // The connection the server had (the APPEND was sent on it: unknown
      // outcome); then the server's internal error: transient, not EIO.
      if (errors.size() == 1) REQUIRE(e.code() == dibs::errc::outcome_unknown);
      else REQUIRE(dibs::is_transient(e.code()));
    }
  }
  REQUIRE(w);
  REQUIRE(errors.size() == 2);
  CHECK_THAT(errors[1], Contains("SERVERBUG") && Contains("try again"));
  CHECK(s.read("k") == dibs::record{"after", *w});
  CHECK(open_store(f).read("k") == dibs::record{"after", *w});
}

TEST_CASE("races on Dovecot: conditional STOREs and marker_claim over imap_store have one winner per key") {
  constexpr int procs = 4, messages = 200;
  const auto f = imap::fresh_folder("condstore");
  {
    dibs::imap::session s{imap::options()};
    s.check(s.run(fmt::format("CREATE {}", dibs::imap::quote(f))), "CREATE");
    std::vector<std::string> appends;
    for (int i = 0; i < messages; ++i) {
      const auto text = fmt::format("From: x@example.com\r\nSubject: race {}\r\n\r\nrace {}\r\n", i, i);
      appends.push_back(fmt::format("APPEND {} {{{}+}}\r\n{}", dibs::imap::quote(f), text.size(), text));
    }
    for (const auto& r : s.run(appends)) s.check(r, "APPEND");
  }
  // Each process reads every message's MODSEQ, then all of them at once
  // send "UID STORE <uid> (UNCHANGEDSINCE <modseq>) +FLAGS.SILENT (racer<i>)"
  // for every message: on a server where that is a compare-and-set, only
  // the first STORE of each message gets a plain OK.
  dibs_test::channel ready, results;
  gate start;
  std::vector<pid_t> pids;
  for (int p = 0; p < procs; ++p)
    pids.push_back(dibs_test::spawn([&, p]() -> int {
      dibs::imap::session s{imap::options()};
      s.check(s.run("ENABLE CONDSTORE"), "ENABLE CONDSTORE");
      s.check(s.run(fmt::format("SELECT {}", dibs::imap::quote(f))), "SELECT");
      const auto r = s.run("UID FETCH 1:* (MODSEQ)");
      s.check(r, "UID FETCH MODSEQ");
      std::map<std::uint64_t, std::uint64_t> modseq;
      for (const auto& u : r.untagged) {
        const auto v = dibs::imap::parse(u);
        if (v.size() < 3 || !v[1].is("FETCH")) continue;
        std::uint64_t uid = 0, m = 0;
        const auto& items = v[2].items;
        for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
          if (items[i].is("UID")) uid = items[i + 1].number().value_or(0);
          if (items[i].is("MODSEQ") && !items[i + 1].items.empty()) m = items[i + 1].items[0].number().value_or(0);
        }
        if (uid && m) modseq[uid] = m;
      }
      if (modseq.size() != static_cast<std::size_t>(messages)) return 2;
      ready.send("ready");
      start.wait_in_child();
      std::vector<std::string> stores;
      for (const auto& [uid, m] : modseq)
        stores.push_back(fmt::format("UID STORE {} (UNCHANGEDSINCE {}) +FLAGS.SILENT (racer{})", uid, m, p));
      const auto replies = s.run(stores);
      std::string won;
      std::size_t i = 0;
      for (const auto& [uid, m] : modseq) {
        const auto& rep = replies[i++];
        if (!rep.ok()) return 3;
        if (!dibs::imap::detail::istarts_with(rep.code, "MODIFIED")) won += fmt::format(" {}", uid);
      }
      results.send(fmt::format("{}{}", p, won));
      return 0;
    }));
  for (int p = 0; p < procs; ++p) REQUIRE(ready.receive(60s));
  start.open();
  int failed = 0;
  for (const pid_t pid : pids) failed += dibs_test::wait_exit(pid) != 0;
  REQUIRE(failed == 0);
  std::map<std::uint32_t, int> winners;
  for (const auto& line : results.drain()) {
    const auto w = dibs_test::words(line);
    for (std::size_t i = 1; i < w.size(); ++i) ++winners[static_cast<std::uint32_t>(std::stoul(w[i]))];
  }
  int twice = 0, none = 0;
  for (std::uint32_t uid = 1; uid <= messages; ++uid) {
    twice += winners[uid] >= 2;
    none += winners[uid] == 0;
  }
  // What the flags say: a STORE that got a plain OK set its keyword.
  int flagged_twice = 0;
  {
    dibs::imap::session s{imap::options()};
    s.check(s.run(fmt::format("EXAMINE {}", dibs::imap::quote(f))), "EXAMINE");
    const auto r = s.run("UID FETCH 1:* (FLAGS)");
    s.check(r, "UID FETCH FLAGS");
    for (const auto& u : r.untagged) {
      int keywords = 0;
      for (int p = 0; p < procs; ++p) keywords += u.find(fmt::format("racer{}", p)) != std::string::npos;
      flagged_twice += keywords >= 2;
    }
  }
  WARN(fmt::format("CONDSTORE race on this server: {} of {} messages had 2 or more conditional STOREs answered "
                   "plain OK ({} carry 2 or more of the racers' keywords), {} had none",
                   twice, messages, flagged_twice, none));

  // Whatever the server does with those, a claim on imap_store has one winner.
  const auto claims_folder = f + "-claims";
  check_each_claimed_once([&] { return open_store(claims_folder); }, procs, 200, "r/");
}
