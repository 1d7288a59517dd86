#include <dibs/detail/owner.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <random>
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
      for (int i = 0; i < rounds; ++i) {
        if (const auto v = s.create("k", "mine")) {
          got += fmt::format(" {}", *v);
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
  CHECK(all.size() >= static_cast<std::size_t>(rounds));
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
