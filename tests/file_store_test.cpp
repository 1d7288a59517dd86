#include <dibs/detail/owner.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>

#include "exactly_once.hpp"
#include "support.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using Catch::Contains;
using dibs_test::slurp;
using dibs_test::spit;
using dibs_test::temp_dir;
namespace fs = std::filesystem;


TEST_CASE("file_store passes the conformance suite, in one process and across 8", "[conformance]") {
  const bool in_place = GENERATE(false, true);
  INFO("in_place " << in_place);
  temp_dir dir;
  const dibs::file_store_options opts{.in_place = in_place};
  dibs::file_store s{dir.path, opts};
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-"));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 4, 200, "threads-"));
  auto open = [&] { return dibs::file_store{dir.path, opts}; };
  REQUIRE_NOTHROW(dibs::testing::check_create_race_processes(open, 8, "raced"));
  REQUIRE_NOTHROW(dibs::testing::check_counter_race_processes(open, 8, 1000, "counter"));
  REQUIRE_NOTHROW(dibs::testing::check_removed_by_hand(s, "hand-", [&](std::string_view key) {
    REQUIRE(fs::remove(s.path_of(key)));
  }));
}

TEST_CASE("a record file removed by hand: the record made again starts above its key's version floor, in every window") {
  const bool in_place = GENERATE(false, true);
  INFO("in_place " << in_place);
  temp_dir dir;
  dibs::file_store s{dir.path, {.in_place = in_place}};
  // A record near the end of its first window of versions (as one rewritten
  // 65,534 times would be), written as a dibs before the floor wrote it:
  // no floor file yet.
  spit(s.path_of("k"), dibs::detail::encode_record(65534, true, "old", {}));
  auto v = s.replace("k", 65534, "a");
  REQUIRE(v == dibs::version{65535});
  v = s.replace("k", *v, "b");
  REQUIRE(v == dibs::version{65536});
  CHECK_FALSE(fs::exists(dir.path / ".dibs-floor"));  // still in the first window
  v = s.replace("k", *v, "c");  // into the second window: the floor is raised first
  REQUIRE(v == dibs::version{65537});
  CHECK_THAT(slurp(dir.path / ".dibs-floor"), Contains("floor 131072\n"));
  REQUIRE(fs::remove(s.path_of("k")));
  const auto again = s.create("k", "again");
  REQUIRE(again);
  CHECK(*again > 65537);
  CHECK_FALSE(s.replace("k", 65537, "stale"));
  CHECK(s.read("k") == dibs::record{"again", *again});
  CHECK(s.keys() == std::vector<std::string>{"k"});  // the floor is no key
  // A long name's floor is cut, like a long record name, and still works.
  const std::string long_key(240, 'x');
  const auto l1 = s.create(long_key, "1");
  REQUIRE(l1);
  REQUIRE(fs::remove(s.path_of(long_key)));
  const auto l2 = s.create(long_key, "2");
  REQUIRE(l2);
  CHECK(*l2 > *l1);
}

TEST_CASE("removed by hand 4 x 150 times: no version is handed out twice", "[chaos]") {
  temp_dir dir;
  const int procs = 4, rounds = 150;
  dibs_test::channel out;
  std::vector<pid_t> pids;
  for (int p = 0; p < procs; ++p) {
    pids.push_back(dibs_test::spawn([&] {
      dibs::file_store s{dir.path};
      std::string got = "v";
      // Each process makes the record `rounds` times itself, however often
      // another has it when it tries (a count of tries would count on the
      // scheduler: under load one process can hold it through most of the
      // others' tries).
      for (int made = 0; made < rounds;) {
        if (const auto v = s.create("k", "mine")) {
          got += fmt::format(" {}", *v);
          ++made;
          // Removed by hand, while no one else can have made it again (it exists).
          (void)fs::remove(s.path_of("k"));
        }
      }
      return out.send(got) ? 0 : 1;
    }));
  }
  std::vector<dibs::version> all;
  for (const pid_t pid : pids) {
    CHECK(dibs_test::wait_exit(pid) == 0);
    const auto w = dibs_test::words(out.receive(60s).value_or(""));
    for (std::size_t i = 1; i < w.size(); ++i) all.push_back(std::stoull(w[i]));
  }
  CHECK(all.size() == static_cast<std::size_t>(procs * rounds));
  std::sort(all.begin(), all.end());
  CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
}

TEST_CASE("a record file is readable text") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  const auto v = s.create("msg-1", "processing by worker 3");
  REQUIRE(v);
  const std::string text = slurp(s.path_of("msg-1"));
  CHECK_THAT(text, Contains("dibs-record 1\nversion 1\nstate live\nsize 22\ncrc32 "));
  CHECK_THAT(text, Contains("\n\nprocessing by worker 3"));
  REQUIRE(s.erase("msg-1", *v));
  CHECK_THAT(slurp(s.path_of("msg-1")), Contains("version 2\nstate erased\n"));
}

TEST_CASE("a damaged, torn or foreign record file is reported by name, never misread") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  REQUIRE(s.create("k", "the value"));
  const auto path = s.path_of("k");
  const std::string good = slurp(path);
  auto expect_corrupt = [&](const std::string& content, const char* why) {
    spit(path, content);
    try {
      (void)s.read("k");
      FAIL("read a damaged record: " << why);
    } catch (const std::system_error& e) {
      CHECK(e.code() == dibs::errc::corrupt_record);
      CHECK_THAT(e.what(), Contains(path.string()) && Contains(why));
    }
    CHECK_THROWS_AS(s.replace("k", 1, "x"), std::system_error);  // and nothing is overwritten
    CHECK(slurp(path) == content);
  };
  std::string flipped = good;
  flipped.back() = 'X';
  expect_corrupt(flipped, "checksum");
  expect_corrupt(good.substr(0, good.size() - 3), "bytes");                  // torn: value cut short
  expect_corrupt(good.substr(0, 20), "expected 'version '");                // torn: header cut short
  expect_corrupt("pid 4242 host old-box\n", "expected 'dibs-record 1'");     // a lock file of another tool
  expect_corrupt("dibs-record 0\nversion 3\n", "format");                   // an older format
  spit(path, good);
  CHECK(s.read("k")->value == "the value");
}

TEST_CASE("a missing, non-directory or unwritable directory is refused by name") {
  temp_dir dir;
  const auto missing = dir.path / "nope";
  CHECK_THROWS_WITH(dibs::file_store{missing}, Contains(missing.string()) && Contains("does the directory exist"));
  spit(dir.path / "plain", "x");
  CHECK_THROWS_WITH(dibs::file_store{dir.path / "plain"}, Contains((dir.path / "plain").string()) && Contains("not a directory"));
  ::chmod(dir.path.c_str(), 0755);
  const int code = dibs_test::run_unprivileged([&] {
    try {
      dibs::file_store s{dir.path};
      return 10;
    } catch (const std::system_error& e) {
      if (e.code() != std::errc::permission_denied) return 11;
      if (std::string(e.what()).find(dir.path.string()) == std::string::npos) return 12;
    }
    return 0;
  });
  INFO("child exit code " << code);
  if (code == 77) WARN("no unprivileged account: the permission case was not run");
  CHECK((code == 0 || code == 77));
}

namespace {
// The name file_store gives a temporary file of process `p` (its header
// comment: .dibs-tmp.<boot>.<pid ns>.<time ns>.<pid>.<start>.<random>).
std::string temporary_name(const dibs::detail::owner_id& p, std::uint64_t random) {
  std::string boot;
  for (const char c : p.boot)
    if (c != '-') boot += c;
  return fmt::format(".dibs-tmp.{}.{}.{}.{}.{}.{:016x}", boot, p.pid_ns, p.time_ns, p.pid, p.start, random);
}
}  // namespace

TEST_CASE("a store removes only its own temporary files of processes provably gone, never other programs' files") {
  temp_dir dir;
  // A process that is gone, as it named itself.
  dibs_test::channel said;
  const pid_t dead = dibs_test::spawn([&] {
    const auto& me = dibs::detail::this_process_base();
    said.send(fmt::format("{} {} {} {}", me.pid, me.start, me.pid_ns, me.time_ns));
    return 0;
  });
  CHECK(dibs_test::wait_exit(dead) == 0);
  const auto line = said.receive();
  REQUIRE(line);
  const auto w = dibs_test::words(*line);
  REQUIRE(w.size() == 4);
  dibs::detail::owner_id gone = dibs::detail::this_process_base();
  gone.pid = std::stol(w[0]);
  gone.start = std::stoull(w[1]);
  gone.pid_ns = static_cast<std::uint32_t>(std::stoul(w[2]));
  gone.time_ns = static_cast<std::uint32_t>(std::stoul(w[3]));
  REQUIRE(::kill(static_cast<pid_t>(gone.pid), 0) != 0);
  dibs::detail::owner_id elsewhere = gone;  // the same pid in another PID namespace: nobody here can judge it
  elsewhere.pid_ns += 1;

  const auto stale = dir.path / temporary_name(gone, 1);
  const auto mine = dir.path / temporary_name(dibs::detail::this_process_base(), 2);
  const auto other_ns = dir.path / temporary_name(elsewhere, 3);
  const auto foreign = dir.path / fmt::format(".tmp.{}.upload-part", dibs_test::unused_pid());
  const auto older = dir.path / (".tmp." + std::to_string(gone.pid) + ".0000000000000004.k");  // a name of no proof
  for (const auto& p : {stale, mine, other_ns, foreign, older}) spit(p, "half");
  dibs::file_store s{dir.path};
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(mine));
  CHECK(fs::exists(other_ns));
  CHECK(fs::exists(foreign));  // another program's file: never touched
  CHECK(slurp(foreign) == "half");
  CHECK(fs::exists(older));
}

TEST_CASE("a symbolic link at a record's path is refused by name, never followed or spun on") {
  temp_dir dir, elsewhere;
  dibs::file_store s{dir.path};
  const auto path = s.path_of("k");
  std::string target;
  SECTION("a dangling link") { target = "/nonexistent/k"; }
  SECTION("a link to a record elsewhere") {
    dibs::file_store other{elsewhere.path};
    REQUIRE(other.create("k", "theirs"));
    target = other.path_of("k").string();
  }
  SECTION("a link to another file") {
    target = (elsewhere.path / "notes.txt").string();
    spit(target, "precious\n");
  }
  const std::string before = fs::exists(target) ? slurp(target) : std::string{};
  REQUIRE(::symlink(target.c_str(), path.c_str()) == 0);
  // Before issue 11 create() spun for ever on a dangling link: end that, so the test fails instead of hanging.
  dibs_test::watchdog dog{3s, [&] { ::unlink(path.c_str()); }};
  auto refused = [&](const char* op, auto&& call) {
    const auto t0 = std::chrono::steady_clock::now();
    std::string what = "(nothing thrown)";
    try {
      (void)call();
    } catch (const std::system_error& e) {
      what = e.what();
    }
    const auto took = dibs_test::ms_since(t0);
    INFO(op << " on a link to " << target << ": " << what << ", after " << took << " ms"
            << (dog.fired() ? " (only because the watchdog removed the link)" : ""));
    CHECK_THAT(what, Contains(path.string()) && Contains("symbolic link"));
    CHECK(took < 2500);  // at once (a few ms), not at the watchdog's 3 s; wide for a loaded machine
  };
  refused("read", [&] { return s.read("k"); });
  refused("create", [&] { return s.create("k", "mine"); });
  refused("replace", [&] { return s.replace("k", 1, "mine"); });
  refused("erase", [&] { return s.erase("k", 1); });
  CHECK(fs::is_symlink(fs::symlink_status(path)));
  if (!before.empty()) CHECK(slurp(target) == before);  // nothing written through the link
}

TEST_CASE("SIGKILLs during compare-and-set increments: no wedged key, no garbage, no lost acknowledged increment", "[chaos]") {
  const bool in_place = GENERATE(false, true);
  INFO("in_place " << in_place);
  const dibs::file_store_options opts{.in_place = in_place};
  temp_dir dir;
  dibs::file_store s{dir.path, opts};
  REQUIRE(s.create("n", "0"));
  int acks[2];
  REQUIRE(::pipe(acks) == 0);
  auto worker = [&] {
    return dibs_test::spawn([&] {
      ::close(acks[0]);
      dibs::file_store mine{dir.path, opts};
      for (;;) {
        auto r = mine.read("n");
        if (!r) return 2;
        if (mine.replace("n", r->version, std::to_string(std::stoll(r->value) + 1))) {
          if (::write(acks[1], "+", 1) != 1) return 3;
        }
      }
    });
  };
  std::vector<pid_t> workers;
  for (int i = 0; i < 4; ++i) workers.push_back(worker());
  std::mt19937 rng(7);
  for (int k = 0; k < 20; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{2, 25}(rng)});
    const std::size_t victim = std::uniform_int_distribution<std::size_t>{0, workers.size() - 1}(rng);
    ::kill(workers[victim], SIGKILL);
    dibs_test::wait_exit(workers[victim]);
    workers[victim] = worker();
  }
  for (pid_t p : workers) {
    ::kill(p, SIGKILL);
    dibs_test::wait_exit(p);
  }
  ::close(acks[1]);
  long acked = 0;
  char buf[4096];
  for (ssize_t n; (n = ::read(acks[0], buf, sizeof buf)) > 0;) acked += n;
  ::close(acks[0]);
  // The record reads whole, and holds every acknowledged increment (at most one
  // more per killed worker: its replace landed but it died before saying so).
  const auto r = s.read("n");
  REQUIRE(r);
  const long value = std::stol(r->value);
  CHECK(value >= acked);
  CHECK(value <= acked + 24);
  // One version per increment; in place, a write cut short by a kill (rare:
  // the kernel finishes a one-page write unless the copy itself faults) is
  // skipped past.
  if (in_place) CHECK(r->version >= static_cast<dibs::version>(value) + 1);
  else CHECK(r->version == static_cast<dibs::version>(value) + 1);
  // Nobody is wedged: a fresh increment goes through at once.
  CHECK(s.replace("n", r->version, "done"));
}

TEST_CASE("in place: records alternate between two slots of one file, the old one marked stale, and a write cut short leaves the current record") {
  temp_dir dir;
  dibs::file_store s{dir.path, {.in_place = true}};
  const auto path = s.path_of("k");
  const auto v1 = s.create("k", std::string(300, 'a'));  // a new file: one record, written whole
  REQUIRE(v1);
  struct ::stat before {}, after {};
  REQUIRE(::stat(path.c_str(), &before) == 0);
  const auto v2 = s.replace("k", *v1, "second");  // into the slot at 2048
  REQUIRE(v2);
  REQUIRE(::stat(path.c_str(), &after) == 0);
  CHECK(after.st_ino == before.st_ino);  // the same file: no new inode, no rename
  std::string text = slurp(path);
  REQUIRE(text.size() > 2048);
  // The old record is gone from the file once the new one is whole: its
  // slot says so, and where to look, and is otherwise padding.
  CHECK(text.find(std::string(300, 'a')) == std::string::npos);
  const std::string mark = text.substr(0, text.find('\n', 14) + 1);
  CHECK_THAT(mark, Contains("stale copy, not the record") && Contains("further down, at byte 2048"));
  CHECK(text.substr(0, 2048).find_first_not_of('\n', mark.size()) == std::string::npos);
  CHECK(text.substr(2048, 14) == "dibs-record 1\n");
  CHECK(text.find("version ") == 2048 + 14);  // one record in the file
  CHECK(s.read("k") == dibs::record{"second", *v2});
  const auto v3 = s.replace("k", *v2, "third");  // back into the first slot
  REQUIRE(v3);
  CHECK(*v3 == *v2 + 1);  // a marked slot is no tear: no version skipped
  CHECK(s.read("k") == dibs::record{"third", *v3});
  text = slurp(path);
  CHECK(text.substr(0, 2048).find("third") != std::string::npos);
  CHECK(text.find("second") == std::string::npos);
  CHECK_THAT(text.substr(2048), Contains("stale copy, not the record") && Contains("the one above"));
  // Erased, the file reads as erased, with no live record left in it.
  {
    const auto v = s.create("e", "held");
    REQUIRE(v);
    REQUIRE(s.replace("e", *v, "held again"));
    REQUIRE(s.erase("e", *v + 1));
    const std::string erased = slurp(s.path_of("e"));
    CHECK(erased.find("state live") == std::string::npos);
    CHECK(erased.find("state erased") != std::string::npos);
    CHECK_FALSE(s.read("e"));
    CHECK(s.create("e", "again") == *v + 3);  // versions go on from the erased record
  }

  // Writers killed in the middle of writing into the slot that is not
  // current: the slot holds the first part of their record and the rest of
  // the old one, cut anywhere (in the header too), once or several times.
  // The offset of the slot that does not hold version v.
  const auto other_slot = [&](dibs::version v) {
    return slurp(path).substr(0, 2048).find(fmt::format("version {}\n", v)) != std::string::npos ? std::size_t{2048} : std::size_t{0};
  };
  dibs::version last = *v3;
  for (const std::size_t cut : {std::size_t{3}, std::size_t{23}, std::size_t{30}, std::size_t{62}}) {
    INFO("cut after " << cut << " bytes");
    const std::string next_rec =
        fmt::format("dibs-record 1\nversion {}\nstate live\nsize 4\ncrc32 00000000\n\nnext", last + 1);
    std::string torn = slurp(path);
    const std::size_t other = other_slot(last);
    torn.replace(other, cut, next_rec.substr(0, cut));
    // A cut within the bytes the stale mark shares with the new record
    // leaves the mark whole: that is no tear at all. A torn header that
    // names a version (cut after 30 bytes or more) is skipped past.
    const bool changed = torn != slurp(path);
    const bool names_version = cut >= 30;
    spit(path, torn);
    const auto cur = s.read("k");  // lock-free: the torn slot sends it to the shared flock, then the whole one
    REQUIRE(cur);
    CHECK(cur->version == last);
    const auto v = s.replace("k", last, "third");  // into the torn slot; a version past any it names
    REQUIRE(v);
    CHECK(*v == (!changed ? last + 1 : names_version ? last + 3 : last + 2));
    last = *v;
    CHECK(s.read("k") == dibs::record{"third", last});
  }
  // Two cuts in a row in the same slot, the second after a skipped version.
  {
    std::string torn = slurp(path);
    const std::size_t other = other_slot(last);
    torn.replace(other, 30, fmt::format("dibs-record 1\nversion {}\nsta", last + 2).substr(0, 30));
    spit(path, torn);
    torn = slurp(path);
    torn.replace(other, 30, fmt::format("dibs-record 1\nversion {}\nsta", last + 5).substr(0, 30));
    spit(path, torn);
    CHECK(s.read("k") == dibs::record{"third", last});
    const auto v = s.replace("k", last, "after two cuts");
    REQUIRE(v);
    CHECK(*v >= last + 7);  // past the version the torn header names
    last = *v;
  }
  // A file whose slots are both damaged is reported, not guessed around.
  text = slurp(path);
  std::string both = text;
  both.at(14) ^= 1;  // the header of each slot
  both.at(2048 + 14) ^= 1;
  spit(path, both);
  CHECK_THROWS_WITH(s.read("k"), Contains("damaged"));
  spit(path, text);
  const auto v5 = s.read("k")->version;

  // A value larger than a slot goes to a new file, as without in_place.
  const auto v6 = s.replace("k", v5, std::string(5000, 'b'));
  REQUIRE(v6);
  REQUIRE(::stat(path.c_str(), &after) == 0);
  CHECK(after.st_ino != before.st_ino);
  CHECK(s.read("k")->value == std::string(5000, 'b'));
  const auto v7 = s.replace("k", *v6, "small again");  // a new file once more: the large record fills both slots
  REQUIRE(v7);
  CHECK(s.read("k") == dibs::record{"small again", *v7});
  CHECK(slurp(path).size() < 2048);
}

TEST_CASE("wait_for_change wakes on a write to the key's file, in place or not, and other files' writes are no change of the key") {
  using namespace std::chrono_literals;
  const bool in_place = GENERATE(false, true);
  INFO("in_place " << in_place);
  temp_dir dir;
  dibs::file_store s{dir.path, {.in_place = in_place}};
  auto v = s.create("k", "one");
  REQUIRE(v);
  REQUIRE(s.replace("k", *v, "two"));  // in place: the file now has both slots
  v = s.read("k")->version;

  // Writes to another file in the directory (the log beside a lock file)
  // are not reported as a change of the key. (Whether they wake the waiter's
  // poll inside wait_for_change at all is not visible from here.)
  {
    auto waiter = std::async(std::launch::async, [&] { return s.wait_for_change("k", 400ms); });
    std::this_thread::sleep_for(50ms);
    std::ofstream other{dir.path / "batch.log", std::ios::app};
    for (int i = 0; i < 100; ++i) other << "line " << i << "\n" << std::flush;
    CHECK_FALSE(waiter.get());
  }
  // A compare-and-set on the key wakes it at once, long before its timeout.
  // The waiter thread may not be waiting yet when a write comes (it used to
  // be given 50 ms), so the key is written again every 100 ms until it wakes:
  // each write is a change, and one made while it waits must wake it.
  const auto t0 = std::chrono::steady_clock::now();
  auto waiter = std::async(std::launch::async, [&] { return s.wait_for_change("k", 20s); });
  int writes = 0;
  do {
    const auto next = s.replace("k", *v, "three-" + std::to_string(writes++));
    REQUIRE(next);
    v = *next;
  } while (waiter.wait_for(100ms) != std::future_status::ready && std::chrono::steady_clock::now() - t0 < 30s);
  INFO(writes << " writes until it woke");
  CHECK(waiter.get());
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
}

TEST_CASE("any key has a file a person can find: the key itself, with '/', '%' and control bytes written %XX") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  const std::string id = "<abc/def+123@mail.example.com>";
  REQUIRE(s.create(id, "processing"));
  CHECK(s.path_of(id) == dir.path / "<abc%2Fdef+123@mail.example.com>.rec");
  CHECK(fs::exists(dir.path / "<abc%2Fdef+123@mail.example.com>.rec"));
  CHECK_THAT(slurp(s.path_of(id)), Contains("key <abc%2Fdef+123@mail.example.com>\n"));
  // A key without such bytes is its own name, and its record has no key line,
  // as with dibs 0.1.
  REQUIRE(s.create("msg 1", "v"));
  CHECK(fs::exists(dir.path / "msg 1.rec"));
  CHECK_THAT(slurp(dir.path / "msg 1.rec"), !Contains("\nkey "));
  CHECK(s.path_of(".") == dir.path / "%2E.rec");
  CHECK(s.path_of(".dibs-tmp.x") == dir.path / "%2Edibs-tmp.x.rec");
  CHECK(s.path_of(std::string("a\0b\n", 4)) == dir.path / "a%00b%0A.rec");
  // Too long for a file name: cut, marked, hashed; the record holds the key.
  const std::string long_key = std::string(300, 'x') + "/1", other = std::string(300, 'x') + "/2";
  REQUIRE(s.create(long_key, "one"));
  REQUIRE(s.create(other, "two"));
  const auto name = s.path_of(long_key).filename().string();
  CHECK(name.size() <= 255);
  CHECK_THAT(name, Contains("%~"));
  CHECK(s.path_of(long_key) != s.path_of(other));
  CHECK(s.read(long_key)->value == "one");
  CHECK(s.read(other)->value == "two");
  auto keys = s.keys();
  std::sort(keys.begin(), keys.end());
  CHECK(keys == std::vector<std::string>{"<abc/def+123@mail.example.com>", "msg 1", long_key, other});
}

TEST_CASE("a record at a cut name that holds another key is reported, never read as this key's") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  const std::string a = std::string(300, 'y') + "a", b = std::string(300, 'y') + "b";
  REQUIRE(s.create(a, "a's"));
  // Make b's name hold a's record, as a hash collision would.
  fs::copy_file(s.path_of(a), s.path_of(b));
  CHECK_THROWS_WITH(s.read(b), Contains("holds the record of key 'yyy") && Contains("not of 'yyy"));
  CHECK_THROWS_WITH(s.create(b, "b's"), Contains("holds the record of key"));
  CHECK(s.read(a)->value == "a's");
}

TEST_CASE("a record of dibs 0.1 under a key with '%' is reported by both keys it could be, never taken for absent") {
  temp_dir dir;
  // dibs 0.1 kept key "a%2Fb" (a URL-encoded name: '/' was not allowed) in
  // "a%2Fb.rec", which is now the name of key "a/b". Written here as 0.1 did.
  {
    dibs::file_store writer{dir.path};
    REQUIRE(writer.create("plain", "dibs-claim 1\nstate completed\nattempts 1\n"));
  }
  fs::rename(dir.path / "plain.rec", dir.path / "a%2Fb.rec");
  dibs::file_store s{dir.path};
  // The old key: its record is at its old name; using it must not make a new one.
  CHECK_THROWS_WITH(s.read("a%2Fb"), Contains("the record of key 'a%2Fb' is in") && Contains("dibs 0.1") &&
                                         Contains("keeps it in '" + (dir.path / "a%252Fb.rec").string() + "'"));
  CHECK_THROWS(s.create("a%2Fb", "again"));
  CHECK(!fs::exists(dir.path / "a%252Fb.rec"));
  // The new key spelled alike: the file is not its record.
  CHECK_THROWS_WITH(s.read("a/b"), Contains("a record of dibs 0.1 for the key 'a%2Fb'"));
  CHECK_THROWS(s.create("a/b", "mine"));
  CHECK_THROWS_WITH(s.read("a%2Fb"), Contains("adopt_old_record"));
  // A renamed record does not know its key: still reported, not misread.
  fs::rename(dir.path / "a%2Fb.rec", dir.path / "a%252Fb.rec");
  CHECK_THROWS_WITH(s.read("a%2Fb"), Contains("holds a record of dibs 0.1"));
  fs::rename(dir.path / "a%252Fb.rec", dir.path / "a%2Fb.rec");
  // What the message advises: the record moves, with its version and value.
  CHECK(s.adopt_old_record("a%2Fb"));
  CHECK(!s.adopt_old_record("a%2Fb"));
  const auto r = s.read("a%2Fb");
  REQUIRE(r);
  CHECK(r->value == "dibs-claim 1\nstate completed\nattempts 1\n");
  CHECK(r->version == 1);
  CHECK(!fs::exists(dir.path / "a%2Fb.rec"));
  CHECK(!s.read("a/b"));
  // A fresh key now (its version starts at the directory's floor, not at 1).
  const auto v = s.create("a/b", "mine");
  REQUIRE(v);
  CHECK(s.read("a/b")->value == "mine");
  CHECK(s.read("a/b")->version == *v);
}

TEST_CASE("a damaged or unreadable record of dibs 0.1 at a '%' key's old name is reported, never taken for none") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  // Damaged, but a record of dibs: it may be the key's, completed.
  dibs_test::spit(dir.path / "50%off.rec", "dibs-record 1\nversion 3\nstate li");
  CHECK_THROWS_AS(s.create("50%off", "mine"), std::system_error);
  CHECK(!fs::exists(dir.path / "50%25off.rec"));
  // A file of some other program there is not the key's record.
  dibs_test::spit(dir.path / "90%off.rec", "somebody's notes\n");
  CHECK(s.create("90%off", "mine"));
  if (!dibs_test::is_root()) {
    // Unreadable now: reported too.
    dibs_test::spit(dir.path / "10%off.rec", "dibs-record 1\n");
    fs::permissions(dir.path / "10%off.rec", fs::perms::none);
    CHECK_THROWS_AS(s.create("10%off", "mine"), std::system_error);
  }
}

TEST_CASE("file_store passes the queue checks: priorities, schedules, backoffs, claim_next_n, each item once across 4 processes", "[conformance]") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  REQUIRE_NOTHROW(dibs::testing::check_queue(s, "q-"));
  REQUIRE_NOTHROW(dibs::testing::check_queue_race_processes([&] { return dibs::file_store{dir.path}; }, 4, 150, "race-"));
}

// --- the queue view (.dibs-claims/): take_claimable and processing_keys ---

static_assert(dibs::claim_queue_store<dibs::file_store>);

namespace {

using file_claims_t = dibs::marker_claim<dibs::file_store>;

std::string claim_head(dibs::claim_state st, std::uint32_t attempts, std::int64_t priority = 0,
                       std::optional<std::int64_t> not_before = std::nullopt) {
  std::string v;
  dibs::detail::claim_record::append_head(v, st, attempts, priority, not_before);
  return v;
}

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::vector<std::string> taken_keys(const std::vector<std::pair<std::string, dibs::record>>& got) {
  std::vector<std::string> out;
  for (const auto& [k, r] : got) out.push_back(k);
  return out;
}

// The names of the files of `dir` that were opened while `f` ran (inotify's
// IN_OPEN, which the kernel queues at the open itself: no timing involved).
template <class F>
std::multiset<std::string> files_opened_during(const fs::path& dir, F f) {
  const int fd = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(::inotify_add_watch(fd, dir.c_str(), IN_OPEN) >= 0);
  f();
  std::multiset<std::string> out;
  alignas(inotify_event) char buf[65536];
  for (;;) {
    const auto n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    for (char* p = buf; p < buf + n;) {
      const auto* e = reinterpret_cast<const inotify_event*>(p);
      REQUIRE_FALSE(e->mask & IN_Q_OVERFLOW);
      if (e->len) out.insert(e->name);
      p += sizeof(inotify_event) + e->len;
    }
  }
  ::close(fd);
  return out;
}

}  // namespace

TEST_CASE("take_claimable: highest priority first, not_before honoured, prefix and n, attempts counted, only offered or released records") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  const std::string rest = "changed 1\\nowner me\\n";
  const auto t = dibs::time_limit::max();
  CHECK(s.create("q/low-1", claim_head(dibs::claim_state::offered, 0)));
  CHECK(s.create("q/low-2", claim_head(dibs::claim_state::released, 2)));
  CHECK(s.create("q/high", claim_head(dibs::claim_state::offered, 0, 7)));
  CHECK(s.create("q/mid", claim_head(dibs::claim_state::released, 1, 3, now_ms() - 1000)));  // its time has come
  CHECK(s.create("q/later", claim_head(dibs::claim_state::offered, 0, 9, now_ms() + 3'600'000)));
  CHECK(s.create("q/doing", claim_head(dibs::claim_state::processing, 1)));
  CHECK(s.create("q/done", claim_head(dibs::claim_state::completed, 1)));
  CHECK(s.create("q/failed", claim_head(dibs::claim_state::failed, 5)));
  CHECK(s.create("q/not-a-claim", "hello"));
  CHECK(s.create("other/x", claim_head(dibs::claim_state::offered, 0, 100)));

  // n = 2 of prefix q/: the two highest priorities.
  auto got = s.take_claimable("q/", rest, 2, t);
  REQUIRE(taken_keys(got) == std::vector<std::string>{"q/high", "q/mid"});
  for (const auto& [k, r] : got) {
    const auto h = dibs::detail::claim_record::parse_head(r.value);
    REQUIRE(h);
    CHECK(h->state == dibs::claim_state::processing);
    CHECK(r.value.ends_with(rest));
    CHECK(s.read(k)->version == r.version);  // the new record, with its new version
    CHECK(s.read(k)->value == r.value);
  }
  CHECK(dibs::detail::claim_record::parse_head(got[0].second.value)->attempts == 1u);
  CHECK(dibs::detail::claim_record::parse_head(got[0].second.value)->priority == 7);
  CHECK(dibs::detail::claim_record::parse_head(got[1].second.value)->attempts == 2u);  // 1 before, + this one
  CHECK(dibs::detail::claim_record::parse_head(got[1].second.value)->priority == 3);

  // The rest of q/: the two of priority 0, in any order; nothing scheduled
  // later, processing, completed, failed or foreign.
  got = s.take_claimable("q/", rest, 10, t);
  auto keys = taken_keys(got);
  std::sort(keys.begin(), keys.end());
  CHECK(keys == std::vector<std::string>{"q/low-1", "q/low-2"});
  CHECK(dibs::detail::claim_record::parse_head(s.read("q/low-2")->value)->attempts == 3u);
  CHECK(s.take_claimable("q/", rest, 10, t).empty());
  // The processing ones, for the sweep: those taken and the one written so.
  auto processing = s.processing_keys("q/");
  std::sort(processing.begin(), processing.end());
  CHECK(processing == std::vector<std::string>{"q/doing", "q/high", "q/low-1", "q/low-2", "q/mid"});
  CHECK(s.processing_keys("other/").empty());

  // The other prefix; then a record completed leaves the processing list.
  CHECK(taken_keys(s.take_claimable("other/", rest, 10, t)) == std::vector<std::string>{"other/x"});
  const auto doing = s.read("q/doing").value();
  CHECK(s.replace("q/doing", doing.version, claim_head(dibs::claim_state::completed, 1)));
  CHECK(s.processing_keys("q/").size() == 4);
  // Released again at once: claimable again, its attempts kept.
  const auto mid = s.read("q/mid").value();
  CHECK(s.replace("q/mid", mid.version, claim_head(dibs::claim_state::released, 2, 3)));
  got = s.take_claimable("", rest, 10, t);
  CHECK(taken_keys(got) == std::vector<std::string>{"q/mid"});
  CHECK(dibs::detail::claim_record::parse_head(got[0].second.value)->attempts == 3u);
  // An item scheduled a moment from now comes when its time does (waited
  // for by evidence: claims until it is taken).
  CHECK(s.create("q/soon", claim_head(dibs::claim_state::offered, 0, 0, now_ms() + 50)));
  CHECK(dibs_test::eventually([&] { return !s.take_claimable("q/soon", rest, 1, t).empty(); }));
  // Erased: gone from the view too.
  const auto low1 = s.read("q/low-1").value();
  CHECK(s.erase("q/low-1", low1.version));
  processing = s.processing_keys("q/");
  CHECK(std::find(processing.begin(), processing.end(), "q/low-1") == processing.end());
  // Keys that need escaping and a cut name go through the view as any other.
  const std::string odd = "<a/b%c+1@mail.example.com>", long_key = "q/" + std::string(300, 'k');
  CHECK(s.create(odd, claim_head(dibs::claim_state::offered, 0)));
  CHECK(s.create(long_key, claim_head(dibs::claim_state::offered, 0, 0, now_ms() - 5)));
  keys = taken_keys(s.take_claimable("", rest, 10, t));
  std::sort(keys.begin(), keys.end());
  CHECK(keys == std::vector<std::string>{odd, long_key});
  processing = s.processing_keys("");
  CHECK(std::count(processing.begin(), processing.end(), long_key) == 1);
  CHECK(std::count(processing.begin(), processing.end(), odd) == 1);
}

TEST_CASE("the queue view is kept by marker_claim's writes: claim_next over offered, released and scheduled items") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  file_claims_t claims{s, {.renew = false, .retry_backoff = std::nullopt}};
  for (int i = 0; i < 5; ++i) REQUIRE(claims.offer(fmt::format("job-{}", i), {.priority = i}));
  REQUIRE(claims.offer("tomorrow", {.not_before = std::chrono::system_clock::now() + std::chrono::hours{24}, .priority = 99}));
  // Given back at once (no retry_backoff), job-2 is next again: its priority is kept.
  for (const char* want : {"job-4", "job-3", "job-2", "job-2", "job-1", "job-0"}) {
    auto c = claims.claim_next();
    REQUIRE(c);
    CHECK(c->key() == want);
    if (c->key() == "job-2" && c->attempts() == 1) c->release("try again");
    else c->complete();
  }
  CHECK(claims.status("job-2").attempts == 2);
  CHECK_FALSE(claims.claim_next());
  CHECK(claims.status("tomorrow").state == dibs::claim_state::offered);
}

TEST_CASE("the queue view removed by hand (rm -rf .dibs-claims) is rebuilt from the records, by one scan") {
  temp_dir dir;
  {
    dibs::file_store s{dir.path};
    file_claims_t claims{s, {.renew = false}};
    for (int i = 0; i < 20; ++i) REQUIRE(claims.offer(fmt::format("item-{:02}", i)));
    for (int i = 0; i < 5; ++i) claims.claim_next()->complete();
  }
  REQUIRE(fs::remove_all(dir.path / ".dibs-claims") > 0);
  dibs::file_store s{dir.path};
  file_claims_t claims{s, {.renew = false}};
  std::set<std::string> got;
  while (auto c = claims.claim_next()) {
    got.insert(c->key());
    c->complete();
  }
  CHECK(got.size() == 15);
  CHECK(fs::exists(dir.path / ".dibs-claims" / "format"));
  for (int i = 0; i < 20; ++i) CHECK(claims.status(fmt::format("item-{:02}", i)).state == dibs::claim_state::completed);

  // Removed while a store is open and in use: rebuilt by its next claim.
  for (int i = 0; i < 3; ++i) REQUIRE(claims.offer(fmt::format("late-{}", i)));
  REQUIRE(fs::remove_all(dir.path / ".dibs-claims") > 0);
  int n = 0;
  while (auto c = claims.claim_next()) {
    ++n;
    c->complete();
  }
  CHECK(n == 3);
}

TEST_CASE("records an older dibs (or a person) wrote without the queue view are found by the periodic scan, never lost") {
  temp_dir dir, elsewhere;
  dibs::file_store s{dir.path};
  file_claims_t claims{s, {.renew = false}};
  REQUIRE(claims.offer("kept"));
  auto c = claims.claim_next();
  REQUIRE(c);
  c->complete();
  CHECK_FALSE(claims.claim_next());  // the view is whole and the queue empty

  // The "old writer": a claim record written into the directory without
  // touching the view (made in another directory, then copied in, as a
  // dibs without the view, or a restore from a backup, would leave it).
  {
    dibs::file_store other{elsewhere.path};
    file_claims_t old{other};
    REQUIRE(old.offer("from-an-old-dibs"));
    REQUIRE(old.offer("taken-by-an-old-dibs"));
  }
  fs::copy_file(elsewhere.path / "from-an-old-dibs.rec", dir.path / "from-an-old-dibs.rec");
  // Its record is not in the view until the view is checked: the check is
  // due after queue_rescan; here it is made due by setting the time of the
  // last check back (rather than waiting five minutes).
  CHECK_FALSE(claims.claim_next());
  const auto scanned = dir.path / ".dibs-claims" / "scanned";
  REQUIRE(fs::exists(scanned));
  fs::last_write_time(scanned, fs::file_time_type::clock::now() - std::chrono::hours{1});
  auto found = claims.claim_next();
  REQUIRE(found);
  CHECK(found->key() == "from-an-old-dibs");
  // An entry the old writer left behind (it took the item without removing
  // the entry) is skipped and removed: the item is not taken twice.
  found->complete();
  const auto entry = dir.path / ".dibs-claims" / "ready" / "0" / "from-an-old-dibs.rec";
  spit(entry, "");
  CHECK_FALSE(claims.claim_next());
  CHECK_FALSE(fs::exists(entry));
  CHECK(claims.status("from-an-old-dibs").attempts == 1);

  // rebuild_queue_view() checks at once, whatever queue_rescan says.
  dibs::file_store never{dir.path, {.queue_rescan = std::chrono::seconds::max()}};
  file_claims_t never_claims{never, {.renew = false}};
  fs::copy_file(elsewhere.path / "taken-by-an-old-dibs.rec", dir.path / "taken-by-an-old-dibs.rec");
  CHECK_FALSE(never_claims.claim_next());
  CHECK(never.rebuild_queue_view() == 1);
  auto last = never_claims.claim_next();
  REQUIRE(last);
  CHECK(last->key() == "taken-by-an-old-dibs");
  last->complete();
}

TEST_CASE("a new entry listed before its record is linked: a claim leaves it there, and the item is claimed next") {
  // A creator makes the entry, then links the record, holding the
  // directory's version floor across both. The test stands in for a
  // creator between its two steps: it holds the floor and makes the entry.
  // (Before the fix, the claim removed the entry as one of nothing, and the
  // item then waited for the next full check of the view, 5 minutes.)
  temp_dir dir;
  dibs::file_store s{dir.path};
  file_claims_t claims{s, {.renew = false}};
  REQUIRE(claims.offer("first"));
  claims.claim_next()->complete();  // the view is whole
  const auto entry = dir.path / ".dibs-claims" / "ready" / "0" / "late.rec";
  {
    dibs::detail::version_floor creator{dir.path, ".dibs-floor", 0644, false, dibs::time_limit::max()};
    fs::create_directories(entry.parent_path());
    spit(entry, "");
    CHECK_FALSE(claims.claim_next());  // no record yet: nothing to take
    CHECK(fs::exists(entry));          // and the entry stays (the claim waited a second for the floor)
  }
  REQUIRE(claims.offer("late"));       // the creator's second step
  auto c = claims.claim_next();
  REQUIRE(c);
  CHECK(c->key() == "late");
  c->complete();
  // With the floor free, an entry whose record never came is removed.
  spit(entry, "");
  const auto orphan = dir.path / ".dibs-claims" / "ready" / "0" / "never.rec";
  spit(orphan, "");
  CHECK_FALSE(claims.claim_next());
  CHECK_FALSE(fs::exists(orphan));
  CHECK_FALSE(fs::exists(entry));
}

TEST_CASE("claim_next over 2,000 completed items and 10 offered ones opens no completed item's record") {
  temp_dir dir;
  dibs::file_store s{dir.path};
  file_claims_t claims{s, {.renew = false}};
  // The completed records written directly (the record marker_claim leaves).
  REQUIRE(claims.offer("model"));
  auto m = claims.claim_next();
  REQUIRE(m);
  m->complete("done");
  const std::string completed = s.read("model").value().value;
  REQUIRE(dibs::detail::claim_record::parse_head(completed)->state == dibs::claim_state::completed);
  for (int i = 0; i < 2000; ++i) REQUIRE(s.create(fmt::format("done-{:04}", i), completed));
  for (int i = 0; i < 10; ++i) REQUIRE(claims.offer(fmt::format("todo-{:02}", i)));
  (void)claims.claim_next("nothing-has-this-prefix/");  // the view is whole before we count
  std::set<std::string> got;
  const auto opened = files_opened_during(dir.path, [&] {
    while (auto c = claims.claim_next()) {
      got.insert(c->key());
      c->complete();
    }
  });
  CHECK(got.size() == 10);
  int completed_opened = 0;
  for (const auto& f : opened) completed_opened += f.starts_with("done-");
  INFO("files opened: " << opened.size());
  CHECK(completed_opened == 0);
  CHECK(opened.size() < 200);  // the 10 items' own records, their temporaries, the floor: a few each
}

TEST_CASE("claim_next on a file_store's queue view across processes: 4 workers, 300 items, SIGKILLs, each completed exactly once", "[chaos]") {
  temp_dir items_dir, flags;
  const int items = 300;
  auto key = [](int i) { return fmt::format("q/<job/{:03}@queue>", i); };
  {
    dibs::file_store s{items_dir.path};
    file_claims_t claims{s};
    for (int i = 0; i < items; ++i) REQUIRE(claims.offer(key(i), {.priority = i % 3}));
  }
  const auto journal = flags.path / "journal";
  const auto stop_flag = flags.path / "stop";
  auto start_worker = [&](int seed) {
    return dibs_test::spawn([&, seed]() -> int {
      dibs::file_store s{items_dir.path};
      file_claims_t claims{s, {.lease = 1500ms, .max_attempts = 50}};
      std::mt19937 rng(static_cast<unsigned>(seed));
      const int jfd = ::open(journal.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
      if (jfd < 0) return 3;
      while (fs::exists(flags.path) && !fs::exists(stop_flag)) {
        auto c = claims.claim_next("q/");
        if (!c) {
          std::this_thread::sleep_for(std::chrono::milliseconds{std::uniform_int_distribution<int>{1, 5}(rng)});
          continue;
        }
        // The completion's journal line first, in one write (O_APPEND: whole
        // lines); a worker killed after it and before complete() leaves a
        // line whose token no completed record has.
        const std::string line = fmt::format("{} {}\n", c->key(), c->token());
        if (::write(jfd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return 5;
        // A trap item: the first worker to take it says so and stays in
        // the middle of it until the parent kills it (mid-item by
        // construction); the worker that takes it after the sweep finishes it.
        const auto trap = flags.path / ("trap-" + std::to_string(std::hash<std::string>{}(c->key())));
        if (c->key().ends_with("07@queue>") && !fs::exists(trap)) {
          spit(flags.path / "tmp", std::to_string(::getpid()));
          fs::rename(flags.path / "tmp", trap);
          while (fs::exists(flags.path) && !fs::exists(stop_flag)) std::this_thread::sleep_for(1ms);
          return 6;
        }
        c->complete(std::to_string(c->token()));
      }
      return 0;
    });
  };
  std::vector<pid_t> pids;
  // A failed REQUIRE leaves no worker behind.
  struct reaper {
    std::vector<pid_t>& pids;
    ~reaper() {
      for (pid_t p : pids)
        if (p > 0 && ::kill(p, SIGKILL) == 0) (void)dibs_test::wait_exit(p);
    }
  } reap{pids};
  int seed = 1;
  for (int i = 0; i < 4; ++i) pids.push_back(start_worker(seed++));
  // The trap items' kills (mid-item by construction), then random kills
  // (anywhere in a worker's loop: while it lists, takes, writes or sleeps).
  int trapped = 0;
  for (int i = 7; i < items; i += 10) {
    if (i % 100 != 7) continue;  // items 7, 107, 207: three traps
    const auto trap = flags.path / ("trap-" + std::to_string(std::hash<std::string>{}(key(i))));
    REQUIRE(dibs_test::eventually([&] { return fs::exists(trap); }, 120s));
    const pid_t victim = std::stoi(slurp(trap));
    const auto it = std::find(pids.begin(), pids.end(), victim);
    REQUIRE(it != pids.end());
    ::kill(victim, SIGKILL);
    trapped += dibs_test::wait_exit(victim) == 128 + SIGKILL;
    *it = start_worker(seed++);
  }
  CHECK(trapped == 3);
  const int landed = dibs_test::kill_and_replace(pids, 4, 11, [&] { return start_worker(seed++); });
  CHECK(landed == 4);
  dibs::file_store s{items_dir.path};
  file_claims_t claims{s};
  int completed = 0;
  const bool all = dibs_test::eventually(
      [&] {
        completed = 0;
        for (const auto& item : claims.list("q/")) completed += item.status.state == dibs::claim_state::completed;
        return completed == items;
      },
      120s);
  spit(stop_flag, "");
  int failed = 0;
  for (pid_t& p : pids) failed += dibs_test::wait_exit(std::exchange(p, 0)) != 0;
  CHECK(failed == 0);
  CHECK(all);
  CHECK(completed == items);
  // The journal: each item's completing token exactly once, and no token
  // handed out twice for an item.
  std::map<std::string, std::multiset<std::string>> lines;
  std::istringstream in(slurp(journal));
  for (std::string k, tok; in >> k >> tok;) lines[k].insert(tok);
  int exactly_once = 0, retried = 0;
  for (int i = 0; i < items; ++i) {
    const auto st = claims.status(key(i));
    const auto& toks = lines[key(i)];
    exactly_once += toks.count(st.result) == 1;
    retried += toks.size() > 1;
    CHECK(std::set<std::string>(toks.begin(), toks.end()).size() == toks.size());
  }
  INFO("items journaled more than once (a worker killed mid-item): " << retried);
  CHECK(exactly_once == items);
  CHECK_FALSE(claims.claim_next("q/"));
  // No item is processing; an entry a kill left in the view's processing
  // list (a worker killed between its record and the entry's removal) is
  // harmless (a sweep reads the record) and the full scan removes it.
  for (const auto& k : s.processing_keys("q/")) CHECK(claims.status(k).state == dibs::claim_state::completed);
  s.rebuild_queue_view();
  CHECK(s.processing_keys("q/").empty());
  CHECK(retried >= 3);  // the trap items at least
}
