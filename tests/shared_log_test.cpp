#include <dibs/shared_log.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using Catch::Contains;
using dibs_test::slurp;
using dibs_test::spit;
using dibs_test::temp_dir;
namespace fs = std::filesystem;

namespace {


// A record whose every byte can be checked: "w<writer>:s<seq>:n<len>:<payload>".
std::string make_record(int writer, int seq, std::size_t len) {
  std::string r = "w" + std::to_string(writer) + ":s" + std::to_string(seq) + ":n" + std::to_string(len) + ":";
  for (std::size_t i = 0; i < len; ++i) r += static_cast<char>('a' + (static_cast<std::size_t>(writer * 7 + seq) + i) % 26);
  return r;
}

// Every line of the log and its rotated files, parsed.
struct census {
  std::map<std::pair<int, int>, int> seen;  // (writer, seq) -> times seen whole
  long torn = 0;                            // lines that are not a whole record
  long blank = 0;
  std::size_t files = 0;
};

census read_all(const fs::path& log) {
  census c;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(log.parent_path())) {
    const auto name = e.path().filename().string();
    const auto base = log.filename().string();
    if (name == base || (name.rfind(base + ".", 0) == 0 && name != base + ".lock")) files.push_back(e.path());
  }
  c.files = files.size();
  for (const auto& f : files) {
    std::istringstream in(slurp(f));
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) {
        ++c.blank;
        continue;
      }
      int w = -1, s = -1;
      std::size_t n = 0;
      if (std::sscanf(line.c_str(), "w%d:s%d:n%zu:", &w, &s, &n) != 3 || make_record(w, s, n) != line) {
        ++c.torn;
        continue;
      }
      ++c.seen[{w, s}];
    }
  }
  return c;
}

// Random lengths: mostly short lines, some far above a page.
std::size_t random_length(std::mt19937& rng) {
  const int pick = std::uniform_int_distribution<int>{0, 99}(rng);
  if (pick < 3) return std::uniform_int_distribution<std::size_t>{5000, 40000}(rng);
  if (pick < 10) return std::uniform_int_distribution<std::size_t>{1000, 4100}(rng);
  return std::uniform_int_distribution<std::size_t>{0, 200}(rng);
}

}  // namespace

TEST_CASE("append writes whole lines, adding the newline only when missing") {
  temp_dir dir;
  dibs::shared_log log{dir.path / "a.log"};
  log.append("first");
  log.append("second\n");
  log.append("");
  std::error_code ec;
  CHECK(log.append("third", ec));
  CHECK_FALSE(ec);
  CHECK(slurp(dir.path / "a.log") == "first\nsecond\n\nthird\n");
  CHECK(fs::exists(dir.path / "a.log.lock"));
}

TEST_CASE("8 processes x 10,000 records with rotation: every record exactly once, none torn") {
  constexpr int writers = 8, records = 10'000;
  temp_dir dir;
  const auto path = dir.path / "batch.log";
  std::vector<pid_t> pids;
  for (int w = 0; w < writers; ++w)
    pids.push_back(dibs_test::spawn([&, w] {
      dibs::shared_log log{path, {.rotate_size = 300 * 1024}};
      std::mt19937 rng(static_cast<unsigned>(w));
      for (int s = 0; s < records; ++s) log.append(make_record(w, s, random_length(rng)));
      return 0;
    }));
  for (pid_t p : pids) REQUIRE(dibs_test::wait_exit(p) == 0);
  const census c = read_all(path);
  CHECK(c.torn == 0);
  CHECK(c.blank == 0);
  CHECK(c.seen.size() == static_cast<std::size_t>(writers * records));
  long duplicates = 0;
  for (auto& [k, n] : c.seen) duplicates += n - 1;
  CHECK(duplicates == 0);
  CHECK(c.files > 10);  // it did rotate, many times
  for (std::size_t n = 1; n < c.files; ++n) CHECK(fs::exists(path.string() + "." + std::to_string(n)));
}

TEST_CASE("SIGKILLs of random writers: every acknowledged record is present once and whole") {
  constexpr int initial = 8, kills = 20;
  temp_dir dir;
  const auto path = dir.path / "chaos.log";
  int acks[2];
  REQUIRE(::pipe(acks) == 0);
  std::map<pid_t, int> live;  // pid -> writer id
  int next_id = 0;
  auto start_writer = [&](int records) {
    const int id = next_id++;
    const pid_t pid = dibs_test::spawn([&, id, records] {
      ::close(acks[0]);
      dibs::shared_log log{path, {.rotate_size = 256 * 1024}};
      std::mt19937 rng(static_cast<unsigned>(id));
      char ack[24];
      for (int s = 0; s < records; ++s) {
        log.append(make_record(id, s, random_length(rng)));
        const int n = std::snprintf(ack, sizeof ack, "%08d %08d\n", id, s);  // 18 bytes: one atomic pipe write
        if (::write(acks[1], ack, static_cast<std::size_t>(n)) != n) return 3;
      }
      return 0;
    });
    live[pid] = id;
  };
  for (int i = 0; i < initial; ++i) start_writer(10'000);

  std::set<std::pair<int, int>> acked;
  std::string pending;
  auto drain = [&](int timeout_ms) {
    pollfd pfd{acks[0], POLLIN, 0};
    if (::poll(&pfd, 1, timeout_ms) <= 0) return false;
    char buf[65536];
    const ssize_t n = ::read(acks[0], buf, sizeof buf);
    if (n <= 0) return false;
    pending.append(buf, static_cast<std::size_t>(n));
    std::size_t pos = 0;
    while (pending.size() - pos >= 18) {
      int w, s;
      REQUIRE(std::sscanf(pending.c_str() + pos, "%d %d", &w, &s) == 2);
      acked.insert({w, s});
      pos += 18;
    }
    pending.erase(0, pos);
    return true;
  };

  std::mt19937 rng(12345);
  int killed = 0;
  auto next_kill = std::chrono::steady_clock::now() + 30ms;
  while (killed < kills) {
    drain(2);
    if (std::chrono::steady_clock::now() < next_kill) continue;
    auto it = live.begin();
    std::advance(it, std::uniform_int_distribution<std::size_t>{0, live.size() - 1}(rng));
    ::kill(it->first, SIGKILL);
    REQUIRE(dibs_test::wait_exit(it->first) >= 0);
    live.erase(it);
    ++killed;
    start_writer(1'500);
    next_kill = std::chrono::steady_clock::now() + std::chrono::milliseconds{std::uniform_int_distribution<int>{5, 60}(rng)};
  }
  ::close(acks[1]);
  int failed = 0;
  while (drain(100) || !live.empty()) {
    for (auto it = live.begin(); it != live.end();) {
      int status;
      if (::waitpid(it->first, &status, WNOHANG) == it->first) {
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
        it = live.erase(it);
      } else {
        ++it;
      }
    }
  }
  while (drain(100)) {
  }
  ::close(acks[0]);
  CHECK(failed == 0);

  const census c = read_all(path);
  long missing = 0, duplicates = 0;
  for (const auto& k : acked) {
    auto it = c.seen.find(k);
    if (it == c.seen.end()) ++missing;
  }
  for (auto& [k, n] : c.seen) duplicates += n - 1;
  INFO("acknowledged " << acked.size() << ", found " << c.seen.size() << ", torn lines " << c.torn);
  CHECK(acked.size() > 20'000);  // real work was done (sanitizer builds are slower)
  CHECK(missing == 0);
  CHECK(duplicates == 0);
  // A record cut short by the kill is cut off again by the next writer.
  CHECK(c.torn == 0);
  // At most one unacknowledged record per killed writer can be in the log.
  CHECK(c.seen.size() - acked.size() <= static_cast<std::size_t>(kills));
}

namespace {
// Another process that takes the log's lock through its shared page (as a
// writer would) and then does what the test says, so the tests can hold the
// lock, or die holding it, at a chosen moment.
dibs::detail::log_shared_state* map_lock(const fs::path& lock) {
  const int fd = ::open(lock.c_str(), O_RDWR);
  void* p = ::mmap(nullptr, sizeof(dibs::detail::log_shared_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<dibs::detail::log_shared_state*>(p);
}
}  // namespace

TEST_CASE("a lock that cannot be had in time is a timed_out error, and the record is not written") {
  temp_dir dir;
  const auto path = dir.path / "t.log";
  dibs::shared_log log{path, {.lock_timeout = 100ms}};
  log.append("before");
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t holder = dibs_test::spawn([&] {
    auto* st = map_lock(log.lock_path());
    if (!st || ::pthread_mutex_lock(&st->mutex.m) != 0) return 2;
    if (::write(ready[1], "r", 1) != 1) return 3;
    for (;;) ::pause();
  });
  char c;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  try {
    log.append("during");
    FAIL("appended while the lock was held");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::timed_out);
    CHECK(dibs::is_transient(e.code()));
    CHECK_THAT(e.what(), Contains(path.string()) && Contains("timed out"));
  }
  std::error_code ec;
  CHECK_FALSE(log.append("during", ec));
  CHECK(ec == dibs::errc::timed_out);
  // The holder dies holding the lock: the next append gets it at once.
  ::kill(holder, SIGKILL);
  dibs_test::wait_exit(holder);
  log.append("after");
  CHECK(slurp(path) == "before\nafter\n");
}

TEST_CASE("a writer killed half-way through a record: the next writer cuts the fragment off") {
  temp_dir dir;
  const auto path = dir.path / "torn.log";
  dibs::shared_log log{path};
  log.append("whole record 1");
  const pid_t w = dibs_test::spawn([&] {
    auto* st = map_lock(log.lock_path());
    if (!st || ::pthread_mutex_lock(&st->mutex.m) != 0) return 2;
    // Exactly what a writer does, stopped in the middle of its record.
    st->pending_start = static_cast<std::int64_t>(fs::file_size(path));
    st->pending_len = static_cast<std::int64_t>(std::string("half of a record\n").size());
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND);
    const std::string part = "half of a rec";
    if (::write(fd, part.data(), part.size()) != static_cast<ssize_t>(part.size())) return 3;
    ::kill(::getpid(), SIGKILL);
    return 4;
  });
  CHECK(dibs_test::wait_exit(w) == 128 + SIGKILL);
  CHECK_THAT(slurp(path), Contains("half of a rec"));
  log.append("whole record 2");
  CHECK(slurp(path) == "whole record 1\nwhole record 2\n");
}

namespace {
using slot = dibs::detail::log_slot;

// Waits (up to 10 s) until some slot of the log holds a record ready to be written.
bool wait_queued(dibs::detail::log_shared_state* st) {
  for (int i = 0; i < 10'000; ++i) {
    for (auto& s : st->slots)
      if ((s.word.load() & slot::state_mask) == slot::ready) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// In a process holding the lock: takes every queued record as a lock holder
// does, records the batch as pending, writes `keep` of it, tells the first
// record's writer that it is done if `tell_first`, and dies.
[[noreturn]] void take_batch_and_die(dibs::detail::log_shared_state* st, const fs::path& path, double keep,
                                     bool tell_first) {
  std::string batch;
  std::vector<slot*> taken;
  for (auto& s : st->slots) {
    std::uint32_t w = s.word.load();
    while ((w & slot::state_mask) == slot::ready &&
           !s.word.compare_exchange_weak(w, (w & ~slot::state_mask) | slot::taken)) {
    }
    if ((w & slot::state_mask) != slot::ready) continue;
    batch.append(s.data, s.size);
    taken.push_back(&s);
  }
  st->ready_slots.store(0);
  st->pending_start = static_cast<std::int64_t>(fs::file_size(path));
  st->pending_len = static_cast<std::int64_t>(batch.size());
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND);
  const auto n = static_cast<std::size_t>(static_cast<double>(batch.size()) * keep);
  if (::write(fd, batch.data(), n) != static_cast<ssize_t>(n)) ::_exit(3);
  if (tell_first && !taken.empty()) {
    taken[0]->word.store((taken[0]->word.load() & ~(slot::state_mask | slot::waiting)) | slot::done);
    dibs::detail::futex_wake(taken[0]->word);
  }
  ::kill(::getpid(), SIGKILL);
  ::_exit(4);
}
}  // namespace

TEST_CASE("a lock holder killed while writing others' queued records: each is in the log once") {
  // The whole batch written, and nobody told; the whole batch, and the first
  // writer told (its append returns: its record must stay); half of it.
  struct kill_point {
    double keep;
    bool tell_first;
  };
  for (const kill_point k : {kill_point{1.0, false}, kill_point{1.0, true}, kill_point{0.5, false}}) {
    INFO("part of the batch written before the kill: " << k.keep << ", first writer told: " << k.tell_first);
    temp_dir dir;
    const auto path = dir.path / "batch.log";
    dibs::shared_log log{path};
    log.append("first");
    auto* st = map_lock(log.lock_path());
    REQUIRE(st);
    int held[2], go[2];
    REQUIRE(::pipe(held) == 0);
    REQUIRE(::pipe(go) == 0);
    const pid_t holder = dibs_test::spawn([&] {
      if (::pthread_mutex_lock(&st->mutex.m) != 0) return 2;
      char c = 'h';
      if (::write(held[1], &c, 1) != 1 || ::read(go[0], &c, 1) != 1) return 3;
      take_batch_and_die(st, path, k.keep, k.tell_first);
    });
    char c;
    REQUIRE(::read(held[0], &c, 1) == 1);
    // Two writers queue their records behind the holder and wait for it.
    const pid_t a = dibs_test::spawn([&] {
      dibs::shared_log l{path};
      l.append("queued by a");
      return 0;
    });
    REQUIRE(wait_queued(st));
    const pid_t b = dibs_test::spawn([&] {
      dibs::shared_log l{path};
      l.append(std::string(300, 'b'));
      return 0;
    });
    std::this_thread::sleep_for(50ms);  // b queues too (or takes the lock after the holder dies)
    REQUIRE(::write(go[1], "g", 1) == 1);
    CHECK(dibs_test::wait_exit(holder) == 128 + SIGKILL);
    CHECK(dibs_test::wait_exit(a) == 0);
    CHECK(dibs_test::wait_exit(b) == 0);
    const std::string content = slurp(path);
    CHECK((content == "first\nqueued by a\n" + std::string(300, 'b') + "\n" ||
           content == "first\n" + std::string(300, 'b') + "\nqueued by a\n"));
    log.append("last");
    CHECK(slurp(path) == content + "last\n");
    for (auto& s : st->slots) CHECK((s.word.load() & slot::state_mask) == slot::free);
    ::munmap(st, sizeof *st);
  }
}

TEST_CASE("slots left by dead processes are freed, those of live ones are not") {
  temp_dir dir;
  const auto path = dir.path / "slots.log";
  dibs::shared_log log{path};
  auto* st = map_lock(log.lock_path());
  REQUIRE(st);
  const pid_t gone = dibs_test::spawn([] { return 0; });
  REQUIRE(dibs_test::wait_exit(gone) == 0);
  struct ::stat ns {};
  REQUIRE(::stat("/proc/self/ns/pid", &ns) == 0);
  const auto me = dibs::detail::this_process_base();
  // Every slot taken: by the dead process (filling, or done but never
  // collected), except one that this live process holds.
  for (std::size_t i = 0; i < dibs::detail::log_slot_count; ++i) {
    auto& s = st->slots[i];
    const bool live = i == 7;
    s.pid = live ? static_cast<std::int32_t>(me.pid) : gone;
    s.start = live ? me.start : 1;
    s.pid_ns = static_cast<std::uint64_t>(ns.st_ino);
    s.owner_ticket = slot::ticket_unit;
    s.word = slot::ticket_unit | (i % 2 ? slot::filling : slot::done);
  }
  log.append("after the dead");
  CHECK(slurp(path) == "after the dead\n");
  std::size_t free = 0;
  for (auto& s : st->slots) free += (s.word.load() & slot::state_mask) == slot::free;
  CHECK(free == dibs::detail::log_slot_count - 1);
  CHECK((st->slots[7].word.load() & slot::state_mask) == slot::filling);
  ::munmap(st, sizeof *st);
}

TEST_CASE("a lock file whose creator died before finishing it is set up again, not refused") {
  temp_dir dir;
  const auto path = dir.path / "half.log";
  // Sized, allocated, all zeros: what a creator killed before writing its magic leaves.
  spit(path.string() + ".lock", std::string(sizeof(dibs::detail::log_shared_state), '\0'));
  dibs::shared_log log{path};
  log.append("works");
  CHECK(slurp(path) == "works\n");
}

TEST_CASE("a writer that opened the log just before a rotation writes to the new file, not the rotated one") {
  temp_dir dir;
  const auto path = dir.path / "r.log";
  dibs::shared_log rotator{path, {.rotate_size = 1}};  // rotates after every record
  // Hold the lock file's set-up lock, so the next writer stops between
  // opening the log and mapping the lock file.
  const int setup = ::open(rotator.lock_path().c_str(), O_RDWR);
  REQUIRE(::flock(setup, LOCK_EX) == 0);
  const pid_t late = dibs_test::spawn([&] {
    ::close(setup);  // (its copy would hold the flock too)
    dibs::shared_log log{path};
    log.append("late");
    return 0;
  });
  // Wait until it has the log open (its descriptor shows in /proc).
  bool opened = false;
  for (int i = 0; i < 5000 && !opened; ++i) {
    for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(late) + "/fd")) {
      std::error_code ec;
      if (fs::read_symlink(e.path(), ec) == path) opened = true;
    }
    if (!opened) std::this_thread::sleep_for(1ms);
  }
  REQUIRE(opened);
  rotator.append("first");  // written, then the file is rotated to r.log.1
  REQUIRE(fs::exists(path.string() + ".1"));
  ::close(setup);  // releases the set-up lock
  CHECK(dibs_test::wait_exit(late) == 0);
  CHECK(slurp(path.string() + ".1") == "first\n");
  CHECK(slurp(path) == "late\n");
}

TEST_CASE("a relative path names the same file after the process changes directory") {
  temp_dir dir;
  const pid_t p = dibs_test::spawn([&] {
    if (::chdir(dir.path.c_str()) != 0) return 2;
    dibs::shared_log log{"rel.log", {.rotate_size = 8}};
    fs::create_directory("elsewhere");
    if (::chdir("elsewhere") != 0) return 3;
    log.append("one 1");   // 6 bytes
    log.append("two 22");  // 13 in all: rotated, to rel.log.1
    log.append("three");
    return 0;
  });
  REQUIRE(dibs_test::wait_exit(p) == 0);
  CHECK(slurp(dir.path / "rel.log.1") == "one 1\ntwo 22\n");
  CHECK(slurp(dir.path / "rel.log") == "three\n");
  CHECK_FALSE(fs::exists(dir.path / "elsewhere" / "rel.log"));
}

TEST_CASE("rotation keeps the requested number of files") {
  temp_dir dir;
  const auto path = dir.path / "k.log";
  dibs::shared_log log{path, {.rotate_size = 1000, .keep = 2}};
  for (int i = 0; i < 100; ++i) log.append(std::string(99, 'x'));  // 100 bytes each: a rotation every 10
  CHECK(fs::exists(path.string() + ".10"));
  CHECK(fs::exists(path.string() + ".9"));
  CHECK_FALSE(fs::exists(path.string() + ".8"));
  CHECK_FALSE(fs::exists(path.string() + ".1"));
  CHECK(fs::file_size(path.string() + ".10") == 1000);
}

TEST_CASE("bad paths: a missing directory, a directory, a foreign lock file, each named in the error") {
  temp_dir dir;
  const auto missing = dir.path / "nope" / "x.log";
  CHECK_THROWS_WITH(dibs::shared_log{missing}, Contains(missing.string()) && Contains("does the directory exist"));
  CHECK_FALSE(fs::exists(dir.path / "nope"));
  CHECK_THROWS_WITH(dibs::shared_log{dir.path}, Contains(dir.path.string()) && Contains("directory"));
  const auto log = dir.path / "y.log";
  { std::ofstream(log.string() + ".lock") << "pid 1 host elsewhere\n"; }
  CHECK_THROWS_WITH(dibs::shared_log{log}, Contains(log.string() + ".lock") && Contains("not a dibs shared_log lock file"));
}

TEST_CASE("no permission (as an unprivileged user): a clear error naming the path") {
  temp_dir dir;
  ::chmod(dir.path.c_str(), 0755);
  const auto path = dir.path / "root.log";
  const int code = dibs_test::run_unprivileged([&] {
    try {
      dibs::shared_log log{path};
      return 10;
    } catch (const std::system_error& e) {
      if (e.code() != std::errc::permission_denied) return 11;
      if (std::string(e.what()).find(path.string()) == std::string::npos) return 12;
    }
    return 0;
  });
  if (code == 77) WARN("no unprivileged account on this machine: the permission case was not run");
  INFO("child exit code " << code);
  CHECK((code == 0 || code == 77));
}

namespace {
// A 256 KiB tmpfs, mounted for one test and unmounted after it; where mount
// is refused, a loud warning that the full-disk case was not tested.
struct small_tmpfs {
  fs::path mnt;
  bool mounted = false;
  explicit small_tmpfs(const fs::path& parent) : mnt(parent / "small") {
    fs::create_directory(mnt);
    mounted = ::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=256k") == 0;
    if (!mounted)
      WARN("*** cannot mount a small tmpfs here (" << std::strerror(errno)
                                                   << "): the full-disk case was NOT tested on this machine ***");
  }
  ~small_tmpfs() {
    if (mounted) ::umount2(mnt.c_str(), MNT_DETACH);
  }
  small_tmpfs(const small_tmpfs&) = delete;
  small_tmpfs& operator=(const small_tmpfs&) = delete;
};
}  // namespace

TEST_CASE("a full filesystem: the error names the log, and no part of the record is left") {
  temp_dir dir;
  small_tmpfs tmp{dir.path};
  if (!tmp.mounted) return;
  const auto path = tmp.mnt / "full.log";
  dibs::shared_log log{path};
  std::error_code ec;
  int written = 0;
  const std::string record(3000, 'r');
  while (log.append(record, ec)) ++written;
  CHECK(ec == std::errc::no_space_on_device);
  CHECK(written > 5);
  CHECK_THROWS_WITH(log.append(record), Contains(path.string()) && Contains("full"));
  // Only whole records are in the file.
  CHECK(fs::file_size(path) == static_cast<std::uintmax_t>(written) * (record.size() + 1));
  const std::string content = slurp(path);
  CHECK(content == [&] {
    std::string s;
    for (int i = 0; i < written; ++i) s += record + "\n";
    return s;
  }());
  // A small record that still fits goes in.
  log.append("x");
}

TEST_CASE("a full filesystem under 3 queued writers: each record is in whole or reported, none in part") {
  temp_dir dir;
  small_tmpfs tmp{dir.path};
  if (!tmp.mounted) return;
  const auto path = tmp.mnt / "full.log";
  { dibs::shared_log setup{path}; }
  constexpr int writers = 3;
  int counts[2];
  REQUIRE(::pipe(counts) == 0);
  std::vector<pid_t> pids;
  for (int w = 0; w < writers; ++w)
    pids.push_back(dibs_test::spawn([&, w] {
      dibs::shared_log log{path};
      std::error_code ec;
      int s = 0;
      while (log.append(make_record(w, s, 400), ec)) ++s;  // small: queued, and written in batches
      if (ec != std::errc::no_space_on_device) return 2;
      char out[16];
      const int n = std::snprintf(out, sizeof out, "%d %06d\n", w, s);
      return ::write(counts[1], out, static_cast<std::size_t>(n)) == n ? 0 : 3;
    }));
  for (pid_t p : pids) CHECK(dibs_test::wait_exit(p) == 0);
  ::close(counts[1]);
  std::map<int, int> acked;
  {
    char buf[256] = {};
    std::size_t got = 0;
    for (ssize_t n; (n = ::read(counts[0], buf + got, sizeof buf - 1 - got)) > 0;) got += static_cast<std::size_t>(n);
    std::istringstream in(std::string(buf, got));
    int w, s;
    while (in >> w >> s) acked[w] = s;
  }
  ::close(counts[0]);
  REQUIRE(acked.size() == writers);
  const census c = read_all(path);
  CHECK(c.torn == 0);
  std::size_t expected = 0;
  for (auto [w, s] : acked) {
    expected += static_cast<std::size_t>(s);
    for (int i = 0; i < s; ++i) CHECK(c.seen.count({w, i}) == 1);
  }
  CHECK(c.seen.size() == expected);  // nothing that was reported failed is in the file
  CHECK(expected > 100);
}

TEST_CASE("durability settings append the same bytes, and bad options are refused by name") {
  temp_dir dir;
  for (auto d : {dibs::durability::none, dibs::durability::per_record, dibs::durability::per_batch}) {
    const auto path = dir.path / ("d" + std::to_string(static_cast<int>(d)) + ".log");
    {
      dibs::shared_log log{path, {.sync = d, .batch_records = 3}};
      for (int i = 0; i < 10; ++i) log.append("r" + std::to_string(i));
      log.flush();
    }
    CHECK(slurp(path) == "r0\nr1\nr2\nr3\nr4\nr5\nr6\nr7\nr8\nr9\n");
  }
  CHECK_THROWS_WITH((dibs::shared_log{dir.path / "x.log", {.sync = dibs::durability::per_batch, .batch_records = 0}}),
                    Contains("batch_records"));
  CHECK_THROWS_WITH((dibs::shared_log{dir.path / "x.log", {.lock_timeout = std::chrono::milliseconds{-1}}}),
                    Contains("lock_timeout"));
}
