// Tests of dibs::dot_lock: mutual exclusion with dotlockfile(1) (Debian's
// liblockfile-bin, which scripts/install-deps.sh installs) and with a
// `set -o noclobber` shell loop, both ways; stale locks broken on proof or by
// age only, by one breaker at a time; errors that name the path.
#include "support.hpp"

#include <dibs/dot_lock.hpp>

#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using Catch::Contains;
using dibs_test::sh;
using dibs_test::temp_dir;
namespace fs = std::filesystem;

namespace {

// Starts bash running `script` in a child process.
pid_t bash(const std::string& script) {
  return dibs_test::spawn([&] {
    ::execl("/bin/bash", "bash", "-c", script.c_str(), static_cast<char*>(nullptr));
    return 127;
  });
}

bool has_dotlockfile() { return sh("command -v dotlockfile >/dev/null 2>&1") == 0; }

// Sets the mtime (and atime) of `p` to `age` ago.
void age_file(const fs::path& p, std::chrono::seconds age) {
  const auto t = std::chrono::system_clock::now() - age;
  const auto s = std::chrono::duration_cast<std::chrono::seconds>(t.time_since_epoch()).count();
  const timespec ts[2] = {{s, 0}, {s, 0}};
  REQUIRE(::utimensat(AT_FDCWD, p.c_str(), ts, AT_SYMLINK_NOFOLLOW) == 0);
}

// The critical section of every locker: read the counter, pause, write it
// back plus one; and an O_EXCL marker that two holders at once cannot both make.
int increment(const fs::path& dir) {
  const auto inside = dir / "inside";
  const int fd = ::open(inside.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return 3;  // someone else is inside: two holders
  ::close(fd);
  const long n = std::stol("0" + dibs_test::slurp(dir / "counter"));
  std::this_thread::sleep_for(1ms);
  dibs_test::spit(dir / "counter", std::to_string(n + 1) + "\n");
  ::unlink(inside.c_str());
  return 0;
}

// The file names in `dir` other than counter: lock files, temporaries,
// moved-away stale locks left behind.
std::vector<std::string> leftovers(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != "counter") out.push_back(e.path().filename().string());
  return out;
}

// The same critical section in bash: the marker with noclobber.
const char* bash_increment = R"(
  if ! ( set -o noclobber; : > "$D/inside" ) 2>/dev/null; then exit 3; fi
  n=$(cat "$D/counter"); sleep 0.001; echo $((10#${n:-0} + 1)) >| "$D/counter"
  rm -f "$D/inside"
)";

// Starts `body` in a child process as another user than this test's when
// run as root (nobody: root reads and moves every file, so only another uid
// meets the permissions these tests are about), else as this user.
dibs_test::child spawn_as_other_user(const std::function<int()>& body) {
  return dibs_test::child{dibs_test::spawn([&] {
    if (::geteuid() == 0) {
      uid_t uid = 65534;
      gid_t gid = 65534;
      (void)dibs_test::unprivileged_ids(uid, gid);
      if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) return 78;
    }
    return body();
  })};
}

// Makes at `p` the lock file of another user's noclobber job under umask
// 077: "<pid>\n", mode 0600, owned by uid 1001 when root; as another user,
// this user's own file with mode 0, which it cannot read either.
void unreadable_lock_file(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, "4242\n", 5) == 5);
  if (::geteuid() == 0) {
    REQUIRE(::fchown(fd, 1001, 1001) == 0);
  } else {
    REQUIRE(::fchmod(fd, 0) == 0);
  }
  ::close(fd);
}

}  // namespace

TEST_CASE("dot_lock: dibs, dotlockfile -p, dotlockfile and a noclobber loop exclude each other") {
  if (!has_dotlockfile()) FAIL("dotlockfile is missing: run scripts/install-deps.sh (package liblockfile-bin)");
  temp_dir d;
  const auto lock = d.path / "counter.lck";
  dibs_test::spit(d.path / "counter", "0\n");
  constexpr int k = 40;
  const std::string env = "D='" + d.path.string() + "'; L='" + lock.string() + "'; K=" + std::to_string(k) + "\n";
  std::vector<dibs_test::child> kids;
  for (int i = 0; i < 2; ++i) {
    kids.emplace_back(dibs_test::spawn([&] {
      dibs::dot_lock l{lock};
      for (int j = 0; j < k; ++j) {
        std::scoped_lock hold{l};
        if (const int rc = increment(d.path)) return rc;
      }
      return 0;
    }));
  }
  // dotlockfile -r 1000 sleeps 5 s and more between tries: a loop of single
  // tries with a short sleep is what a job that wants a quick handoff runs.
  for (const char* flags : {"-p", ""}) {
    kids.emplace_back(bash(env + "for ((i = 0; i < K; i++)); do\n"
                                 "  until dotlockfile -l -r 0 " + std::string(flags) + " \"$L\" 2>/dev/null; do sleep 0.001; done\n" +
                           bash_increment + "  dotlockfile -u \"$L\" || exit 4\ndone\n"));
  }
  kids.emplace_back(bash(env + "set -o noclobber\nfor ((i = 0; i < K; i++)); do\n"
                               "  until { echo $$ > \"$L\"; } 2>/dev/null; do sleep 0.001; done\n" +
                         bash_increment + "  rm -f \"$L\"\ndone\n"));
  const int n = static_cast<int>(kids.size());
  for (auto& c : kids) CHECK(c.wait() == 0);
  CHECK(dibs_test::slurp(d.path / "counter") == std::to_string(n * k) + "\n");
  CHECK(leftovers(d.path).empty());
}

TEST_CASE("dot_lock: a dibs holder is held for dotlockfile and noclobber, and theirs for dibs") {
  if (!has_dotlockfile()) FAIL("dotlockfile is missing: run scripts/install-deps.sh (package liblockfile-bin)");
  temp_dir d;
  const auto lock = d.path / "x.lck";
  const std::string l = "'" + lock.string() + "'";
  {
    dibs::dot_lock mine{lock};
    REQUIRE(mine.try_lock());
    // The pid first, where liblockfile reads it.
    CHECK(dibs_test::slurp(lock).rfind(std::to_string(::getpid()) + "\ndibs-dot-lock 1\nhost ", 0) == 0);
    CHECK(sh("dotlockfile -l -r 0 -p " + l + " 2>/dev/null") != 0);
    CHECK(sh("dotlockfile -l -r 0 " + l + " 2>/dev/null") != 0);
    CHECK(sh("set -o noclobber; { echo $$ > " + l + "; } 2>/dev/null") != 0);
    CHECK(mine.still_held());
    // An hour old: dotlockfile -p still sees the live pid; without -p it
    // judges by age alone, and a touch (what the holder does on its own
    // every third of stale_after) makes the lock young again.
    age_file(lock, 3600s);
    CHECK(sh("dotlockfile -l -r 0 -p " + l + " 2>/dev/null") != 0);
    CHECK(mine.touch());
    CHECK(sh("dotlockfile -l -r 0 " + l + " 2>/dev/null") != 0);
    CHECK(mine.still_held());
    mine.unlock();
    CHECK(!fs::exists(lock));
  }
  dibs::dot_lock dibs_side{lock};
  REQUIRE(sh("dotlockfile -l -r 0 -p " + l) == 0);  // the pid of a shell that is gone by now: no proof
  CHECK(!dibs_side.try_lock());
  CHECK(!dibs_side.try_lock_for(30ms));
  REQUIRE(sh("dotlockfile -u " + l) == 0);
  REQUIRE(sh("dotlockfile -l -r 0 " + l) == 0);  // "0": no pid at all
  CHECK(!dibs_side.try_lock());
  REQUIRE(sh("dotlockfile -u " + l) == 0);
  REQUIRE(sh("set -o noclobber; echo $$ > " + l) == 0);
  CHECK(!dibs_side.try_lock());
  fs::remove(lock);
  CHECK(dibs_side.try_lock());
}

TEST_CASE("dot_lock: a killed dibs holder is broken at once, on proof") {
  temp_dir d;
  const auto lock = d.path / "x.lck";
  dibs_test::channel ch;
  dibs_test::child holder{dibs_test::spawn([&] {
    dibs::dot_lock l{lock};
    l.lock();
    ch.send("held");
    ::pause();
    return 0;
  })};
  REQUIRE(ch.receive() == "held");
  dibs::dot_lock waiter{lock};  // stale_after: 5 minutes, so only the proof can free it
  CHECK(!waiter.try_lock());
  holder.kill();
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(waiter.try_lock());
  CHECK(dibs_test::ms_since(t0) < 5000);  // one try (a few ms), not stale_after's 5 minutes; wide for a loaded machine
  CHECK(leftovers(d.path) == std::vector<std::string>{"x.lck"});
}

TEST_CASE("dot_lock: on_behalf_of names that process, and the lock is broken once it is gone, though its taker lives") {
  temp_dir d;
  const auto lock = d.path / "x.lck";
  dibs_test::child sleeper{dibs_test::spawn([] {
    ::pause();
    return 0;
  })};
  const pid_t behalf = sleeper.pid();
  dibs::dot_lock held{lock, {.on_behalf_of = behalf}};
  REQUIRE(held.try_lock());
  const std::string text = dibs_test::slurp(lock);
  CHECK(text.substr(0, text.find('\n')) == std::to_string(behalf));  // what dotlockfile -p reads
  dibs::dot_lock waiter{lock};
  CHECK(!waiter.try_lock());  // the process it names lives
  sleeper.kill();
  CHECK(waiter.try_lock());  // gone: proof, while `held`'s process still runs
  CHECK_NOTHROW(held.unlock());  // leaves the new holder's file alone
  CHECK(fs::exists(lock));
  waiter.unlock();
  CHECK_THROWS_WITH(dibs::dot_lock(lock, {.on_behalf_of = behalf}), Contains("does not exist"));
}

TEST_CASE("dot_lock: a foreign lock is broken only by age") {
  temp_dir d;
  const auto lock = d.path / "x.lck";
  dibs::dot_lock waiter{lock, {.stale_after = 2s}};
  SECTION("an empty file") { dibs_test::spit(lock, ""); }
  SECTION("the bare pid of a process that is gone") {
    // No boot id, no namespace: a pid alone proves nothing (it may be of
    // another container, or another machine over NFS).
    dibs_test::child gone{dibs_test::spawn([] { return 0; })};
    const pid_t pid = gone.pid();
    gone.wait();
    dibs_test::spit(lock, std::to_string(pid) + "\n");
  }
  SECTION("a dibs record whose pid namespace is not ours") {
    dibs::dot_lock other{lock, {.stale_after = 2s}};  // the age a record gets is its writer's, at least
    REQUIRE(other.try_lock());
    auto text = dibs_test::slurp(lock);
    other.unlock();
    const auto ns = text.find("pid_ns ");
    text.replace(ns, text.find('\n', ns) - ns, "pid_ns 1");
    text.replace(0, text.find('\n'), "999999");  // and a pid that does not exist
    text.replace(text.find("\npid ") + 5, text.find('\n', text.find("\npid ") + 1) - text.find("\npid ") - 5, "999999");
    dibs_test::spit(lock, text);
  }
  CHECK(!waiter.try_lock());
  age_file(lock, 1s);
  CHECK(!waiter.try_lock());
  age_file(lock, 3s);
  CHECK(waiter.try_lock());
  CHECK(leftovers(d.path) == std::vector<std::string>{"x.lck"});
  CHECK(dibs_test::slurp(lock).rfind(std::to_string(::getpid()) + "\n", 0) == 0);
}

TEST_CASE("dot_lock: another user's lock file this user cannot read is held: waited for, never broken") {
  // A noclobber job under umask 077 leaves a mode 0600 file. dibs cannot read
  // its record, so it has no proof that the holder is gone, and cannot take
  // the flock the breaking protocol takes: it waits, like `dotlockfile -p`.
  temp_dir d;
  REQUIRE(::chmod(d.path.c_str(), 01777) == 0);  // like /tmp: both users create files there
  const auto lock = d.path / "x.lck";
  unreadable_lock_file(lock);
  age_file(lock, 3600s);  // older than stale_after: were it readable, age alone would break it
  struct ::stat before {};
  REQUIRE(::lstat(lock.c_str(), &before) == 0);
  const dibs::dot_lock_options opts{.stale_after = 2s};

  SECTION("while the file stays, try_lock_for times out and leaves it") {
    dibs_test::child waiter = spawn_as_other_user([&] {
      dibs::dot_lock l{lock, opts};
      if (::access(lock.c_str(), R_OK) == 0) return 4;  // the test would prove nothing
      const auto t0 = std::chrono::steady_clock::now();
      try {
        if (l.try_lock_for(800ms)) return 5;
      } catch (const std::system_error& e) {
        std::fprintf(stderr, "try_lock_for threw: %s\n", e.what());
        return 3;
      }
      const auto waited = dibs_test::ms_since(t0);
      return waited >= 790 && waited < 8000 ? 0 : 6;  // its time: 800 ms (10x of it for a loaded machine)
    });
    CHECK(waiter.wait() == 0);
    struct ::stat after {};
    REQUIRE(::lstat(lock.c_str(), &after) == 0);
    CHECK(after.st_ino == before.st_ino);
    CHECK(after.st_mtim.tv_sec == before.st_mtim.tv_sec);
    CHECK((after.st_mode & 07777) == (before.st_mode & 07777));
    CHECK(after.st_uid == before.st_uid);
    CHECK(dibs_test::slurp(lock) == (::geteuid() == 0 ? "4242\n" : ""));  // mode 0: unreadable to its owner too
    CHECK(leftovers(d.path) == std::vector<std::string>{"x.lck"});
  }

  SECTION("once its owner removes it, the waiter takes the lock within a poll") {
    dibs_test::channel to_parent;
    dibs_test::child waiter = spawn_as_other_user([&] {
      dibs::dot_lock l{lock, opts};
      if (::access(lock.c_str(), R_OK) == 0) return 4;
      to_parent.send("waiting");
      try {
        if (!l.try_lock_for(10s)) return 5;
      } catch (const std::system_error& e) {
        std::fprintf(stderr, "try_lock_for threw: %s\n", e.what());
        return 3;
      }
      to_parent.send(std::to_string(dibs_test::steady_ns()));
      // Its own record now, not the other user's file.
      if (dibs_test::slurp(lock).rfind(std::to_string(::getpid()) + "\ndibs-dot-lock 1\n", 0) != 0) return 7;
      l.unlock();
      return 0;
    });
    REQUIRE(to_parent.receive() == "waiting");
    std::this_thread::sleep_for(300ms);  // several polls that meet the unreadable file
    REQUIRE(fs::exists(lock));
    const long long removed = dibs_test::steady_ns();
    REQUIRE(::unlink(lock.c_str()) == 0);
    const auto got = to_parent.receive(5s);
    CHECK(waiter.wait() == 0);
    REQUIRE(got);
    const long long taken = std::stoll(*got);
    CHECK(taken > removed);  // not before: it was never broken
    CHECK((taken - removed) / 1'000'000 < 500);  // the backoff caps a poll at 50 ms
    CHECK(leftovers(d.path).empty());
  }
}

TEST_CASE("dot_lock: a directory this user may not write is an error at once that names the directory") {
  // The one permission problem waiting cannot mend: no lock file can ever be
  // created there, whoever holds the lock now.
  temp_dir d;
  const auto dir = d.path / "locks";
  fs::create_directory(dir);
  const auto lock = dir / "x.lck";
  const bool held = GENERATE(false, true);
  if (held) unreadable_lock_file(lock);
  REQUIRE(::chmod(d.path.c_str(), 0755) == 0);
  REQUIRE(::chmod(dir.c_str(), ::geteuid() == 0 ? 0755 : 0555) == 0);  // root's own dir; as a user, no w bit
  dibs_test::channel out;
  dibs_test::child waiter = spawn_as_other_user([&] {
    dibs::dot_lock l{lock};
    const auto t0 = std::chrono::steady_clock::now();
    try {
      (void)l.try_lock_for(10s);
      return 5;
    } catch (const std::system_error& e) {
      out.send(e.what());
      if (e.code() != std::errc::permission_denied) return 6;
    }
    return dibs_test::ms_since(t0) < 5000 ? 0 : 7;  // at once (a few ms), not at the end of 10 s; wide for a loaded machine
  });
  CHECK(waiter.wait() == 0);
  const auto what = out.receive(1s);
  REQUIRE(what);
  CHECK_THAT(*what, Contains("directory '" + dir.string() + "'") && Contains(lock.string()) &&
                        Contains("write") && Contains("Permission denied"));
  ::chmod(dir.c_str(), 0755);
  CHECK(fs::exists(lock) == held);
}

TEST_CASE("dot_lock: a stale lock of another user in a sticky directory is waited for, not an error") {
  // In a mode 1777 directory only a file's owner (or root) may move it away:
  // the lock stays there, so it is held, until its owner removes it.
  if (!dibs_test::is_root()) {
    WARN("SKIPPED: not root, so no file of another user can be made");
    return;
  }
  temp_dir d;
  REQUIRE(::chmod(d.path.c_str(), 01777) == 0);
  const auto lock = d.path / "x.lck";
  dibs_test::spit(lock, "4242\n");
  REQUIRE(::chown(lock.c_str(), 1001, 1001) == 0);
  REQUIRE(::chmod(lock.c_str(), 0644) == 0);
  age_file(lock, 3600s);  // stale by age, readable: a breaker would move it
  dibs_test::child waiter = spawn_as_other_user([&] {
    dibs::dot_lock l{lock, {.stale_after = 2s}};
    try {
      return l.try_lock_for(300ms) ? 5 : 0;
    } catch (const std::system_error& e) {
      std::fprintf(stderr, "try_lock_for threw: %s\n", e.what());
      return 3;
    }
  });
  CHECK(waiter.wait() == 0);
  CHECK(dibs_test::slurp(lock) == "4242\n");
  CHECK(leftovers(d.path) == std::vector<std::string>{"x.lck"});
}

TEST_CASE("dot_lock: a live holder touches its file, so age never breaks it") {
  temp_dir d;
  const auto lock = d.path / "x.lck";
  // stale_after 1 s, not 300 ms: a touch late by a loaded machine's
  // scheduling is not what this tests. Several stale_after periods pass.
  dibs::dot_lock holder{lock, {.stale_after = 1s}};
  dibs::dot_lock waiter{lock, {.stale_after = 1s}};
  REQUIRE(holder.try_lock());
  const auto t0 = std::chrono::steady_clock::now();
  while (dibs_test::ms_since(t0) < 3500) {
    REQUIRE(!waiter.try_lock());
    std::this_thread::sleep_for(20ms);
  }
  CHECK(holder.still_held());
  holder.unlock();
  CHECK(waiter.try_lock());
}

TEST_CASE("dot_lock: many waiters break one stale lock, one holder at a time") {
  temp_dir d;
  const auto lock = d.path / "x.lck";
  dibs_test::spit(d.path / "counter", "0\n");
  constexpr int waiters = 6, rounds = 25;
  for (int r = 0; r < rounds; ++r) {
    dibs_test::spit(lock, "");
    age_file(lock, 10s);
    int go[2];
    REQUIRE(::pipe(go) == 0);
    std::vector<dibs_test::child> kids;
    for (int i = 0; i < waiters; ++i) {
      kids.emplace_back(dibs_test::spawn([&] {
        ::close(go[1]);
        char c;
        (void)::read(go[0], &c, 1);  // all start at once, when the pipe is closed
        dibs::dot_lock l{lock, {.stale_after = 5s}};
        std::scoped_lock hold{l};
        if (const int rc = increment(d.path)) return rc;
        std::this_thread::sleep_for(2ms);  // a longer hold: a second holder would overlap it
        return 0;
      }));
    }
    ::close(go[0]);
    ::close(go[1]);
    for (auto& c : kids) REQUIRE(c.wait() == 0);
    REQUIRE(dibs_test::slurp(d.path / "counter") == std::to_string((r + 1) * waiters) + "\n");
    REQUIRE(leftovers(d.path).empty());
  }
}

TEST_CASE("dot_lock: holders that die holding, every handoff a break by proof, one holder at a time") {
  // Each hold is a process that exits without unlocking, so every handoff
  // is a stale lock that several waiters, polling fast, judge at once.
  temp_dir d;
  const auto lock = d.path / "x.lck";
  dibs_test::spit(d.path / "counter", "0\n");
  constexpr int workers = 6, holds = 30;
  const dibs::dot_lock_options fast{.touch = false, .wait = {20us, 2.0, 500us, dibs::jitter::full}};  // holds are short
  std::vector<dibs_test::child> kids;
  for (int i = 0; i < workers; ++i) {
    kids.emplace_back(dibs_test::spawn([&] {
      for (int j = 0; j < holds; ++j) {
        const int rc = dibs_test::wait_exit(dibs_test::spawn([&] {
          dibs::dot_lock l{lock, fast};
          l.lock();
          const int r = increment(d.path);
          std::fflush(nullptr);
          ::_exit(r);  // holding: the lock file stays, naming a pid that is gone once reaped
          return r;
        }));
        if (rc != 0) return rc;
      }
      return 0;
    }));
  }
  for (auto& c : kids) CHECK(c.wait() == 0);
  CHECK(dibs_test::slurp(d.path / "counter") == std::to_string(workers * holds) + "\n");
  CHECK(leftovers(d.path) == std::vector<std::string>{"x.lck"});
}

TEST_CASE("dot_lock: unlock leaves a lock that is not its own") {
  temp_dir d;
  const auto lock = d.path / "x.lck";
  dibs::dot_lock l{lock};
  REQUIRE(l.try_lock());
  fs::remove(lock);  // broken by another tool
  dibs_test::spit(lock, "4242\n");  // and taken by it
  CHECK(!l.still_held());
  l.unlock();
  CHECK(dibs_test::slurp(lock) == "4242\n");
}

TEST_CASE("dot_lock: a forked child's copy does not release the parent's hold") {
  temp_dir d;
  const auto lock = d.path / "x.lck";
  dibs::dot_lock l{lock};
  REQUIRE(l.try_lock());
  CHECK(dibs_test::wait_exit(dibs_test::spawn([&] {
    l.unlock();
    return fs::exists(lock) ? 0 : 1;
  })) == 0);
  CHECK(fs::exists(lock));
  CHECK(l.still_held());
}

TEST_CASE("dot_lock: bad paths are errors that name the path") {
  temp_dir d;
  SECTION("a symbolic link at the path, dangling or not") {
    const auto lock = d.path / "x.lck";
    const auto target = d.path / "target";
    const bool dangling = GENERATE(true, false);
    if (!dangling) dibs_test::spit(target, "keep\n");
    fs::create_symlink(target, lock);
    dibs::dot_lock l{lock};
    CHECK_THROWS_WITH(l.try_lock(), Contains(lock.string()) && Contains("symbolic link"));
    CHECK_THROWS_WITH(l.try_lock_for(20ms), Contains("symbolic link"));
    CHECK(fs::is_symlink(lock));
    if (!dangling) CHECK(dibs_test::slurp(target) == "keep\n");
    if (dangling) CHECK(!fs::exists(target));
  }
  SECTION("a missing directory") {
    const auto lock = d.path / "nope" / "x.lck";
    CHECK_THROWS_WITH(dibs::dot_lock{lock}, Contains(lock.string()) && Contains("does the directory exist?"));
  }
  SECTION("a directory at the path") {
    const auto lock = d.path / "x.lck";
    fs::create_directory(lock);
    dibs::dot_lock l{lock};
    CHECK_THROWS_WITH(l.try_lock(), Contains(lock.string()) && Contains("not a regular file"));
  }
  SECTION("a directory this user may not write") {
    uid_t uid;
    gid_t gid;
    if (::geteuid() != 0 || !dibs_test::unprivileged_ids(uid, gid)) return;
    REQUIRE(::chmod(d.path.c_str(), 0755) == 0);
    const auto lock = d.path / "x.lck";
    const int code = dibs_test::run_unprivileged([&] {
      dibs::dot_lock l{lock};
      try {
        (void)l.try_lock();
      } catch (const std::system_error& e) {
        const std::string what = e.what();
        return e.code() == std::errc::permission_denied && what.find(lock.string()) != std::string::npos ? 0 : 2;
      }
      return 1;
    });
    CHECK(code == 0);
  }
  SECTION("a path without a file name") {
    CHECK_THROWS_WITH(dibs::dot_lock{d.path / ""}, Contains("names no file"));
  }
}

TEST_CASE("a held dot_lock moved into a vector and an optional and out stays held and touched, and the new owner's unlock removes it") {
  temp_dir dir;
  const auto path = dir.path / "moved.lock";
  // Another process's view: can it take the lock now?
  const auto another_can_take = [&](const fs::path& p) {
    const int code = dibs_test::wait_exit(dibs_test::spawn([&]() -> int {
      dibs::dot_lock probe{p, {.stale_after = 600ms, .touch = false}};
      if (!probe.try_lock()) return 10;
      probe.unlock();
      return 0;
    }));
    REQUIRE((code == 0 || code == 10));
    return code == 0;
  };
  std::vector<dibs::dot_lock> locks;
  {
    dibs::dot_lock a{path, {.stale_after = 600ms}};
    REQUIRE(a.try_lock());
    locks.push_back(std::move(a));
    CHECK_FALSE(a.still_held());
    CHECK_THROWS_AS(a.try_lock(), std::system_error);
  }  // a's destructor must not remove the file
  for (int i = 0; i < 8; ++i) locks.emplace_back(dir.path / ("other-" + std::to_string(i) + ".lock"));
  std::optional<dibs::dot_lock> opt{std::move(locks.front())};
  locks.clear();
  CHECK(fs::exists(path));
  // Longer than stale_after: only the touches of the object it now lives in keep it fresh.
  std::this_thread::sleep_for(1s);
  CHECK(opt->still_held());
  CHECK_FALSE(another_can_take(path));
  dibs::dot_lock back = std::move(*opt);
  opt.reset();
  CHECK(fs::exists(path));
  back.unlock();
  CHECK_FALSE(fs::exists(path));
  CHECK(another_can_take(path));

  // Move assignment over a held lock releases it first.
  const auto other = dir.path / "assigned.lock";
  dibs::dot_lock x{other};
  REQUIRE(x.try_lock());
  dibs::dot_lock y{path};
  REQUIRE(y.try_lock());
  x = std::move(y);
  CHECK_FALSE(fs::exists(other));
  CHECK(x.path() == path);
  CHECK(x.still_held());
  x.unlock();
  CHECK_FALSE(fs::exists(path));
}

// What dibs's lockfile and dotlockfile names need (tools/compat_names.hpp):
// a lock file exactly as the other tools write it, a lock left held when its
// taker ends, and the question dotlockfile -c asks.
TEST_CASE("dot_lock: content is written as given and judged by age alone, and release leaves the file held") {
  temp_dir d;
  const auto lock = d.path / "x.lock";
  CHECK(!dibs::dot_lock::is_held(lock));
  {
    dibs::dot_lock left{lock, {.stale_after = 2s, .touch = false, .mode = 0444, .content = std::string{"0"}}};
    REQUIRE(left.try_lock());
    CHECK(dibs_test::slurp(lock) == "0");
    CHECK((fs::status(lock).permissions() & fs::perms::all) ==
          (fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read));
    CHECK(left.release());
    CHECK(!left.release());  // holds nothing now
  }  // its destructor removes nothing: the hold was given up, not the lock
  REQUIRE(fs::exists(lock));
  CHECK(dibs::dot_lock::is_held(lock, {.stale_after = 2s}));
  {
    // Another tool's lock, as holder_of shows it: no host, the pid it names (none), its age's lease.
    const auto h = dibs::dot_lock::holder_of(lock, {.stale_after = 2s});
    REQUIRE(h);
    CHECK(h->host.empty());
    CHECK(h->pid == 0);
    CHECK(!h->gone);
    CHECK(h->lease == 2s);
    REQUIRE(h->lease_left);
    CHECK(h->lease_left->count() > 0);
    CHECK(*h->lease_left <= 2s);
  }
  dibs::dot_lock waiter{lock, {.stale_after = 2s}};
  CHECK(!waiter.try_lock());
  if (has_dotlockfile()) CHECK(sh("dotlockfile -r 0 " + lock.string()) == 4);  // L_MAXTRYS: held for it too
  age_file(lock, 3s);
  CHECK(!dibs::dot_lock::is_held(lock, {.stale_after = 2s}));
  const auto aged = dibs::dot_lock::holder_of(lock, {.stale_after = 2s});
  REQUIRE(aged);
  REQUIRE(aged->lease_left);
  CHECK(aged->lease_left->count() < 0);  // stale by age: the next lock breaks it
  CHECK(dibs_test::slurp(lock) == "0");  // is_held and holder_of read only: nothing broken
  CHECK(waiter.try_lock());
  waiter.unlock();
  CHECK(!fs::exists(lock));
}

TEST_CASE("dot_lock: a record left by release() for another process is held while it lives, and not once it is gone") {
  temp_dir d;
  const auto lock = d.path / "x.lock";
  dibs_test::child caller{bash("exec sleep 60")};
  {
    dibs::dot_lock left{lock, {.touch = false, .on_behalf_of = static_cast<dibs::process_id>(caller.pid())}};
    REQUIRE(left.try_lock());
    REQUIRE(left.release());
  }
  CHECK(dibs_test::slurp(lock).rfind(std::to_string(caller.pid()) + "\n", 0) == 0);
  CHECK(dibs::dot_lock::is_held(lock));
  const auto held = dibs::dot_lock::holder_of(lock);
  REQUIRE(held);
  CHECK(held->pid == caller.pid());
  CHECK(!held->host.empty());
  CHECK(!held->gone);
  CHECK(!held->mine);
  dibs::dot_lock waiter{lock};
  CHECK(!waiter.try_lock());
  caller.kill();
  CHECK(!dibs::dot_lock::is_held(lock));  // its holder is provably gone
  const auto gone = dibs::dot_lock::holder_of(lock);
  REQUIRE(gone);
  CHECK(gone->gone);
  CHECK(waiter.try_lock());
}
