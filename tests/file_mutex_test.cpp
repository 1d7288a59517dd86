#include <dibs/file_mutex.hpp>

#include <catch2/catch.hpp>

#include "support.hpp"

#include <boost/interprocess/sync/file_lock.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using Catch::Contains;
using dibs_test::sh;
using dibs_test::temp_dir;
namespace fs = std::filesystem;

namespace {


// A util-linux flock(1) process that holds `path` until release() (or destruction).
struct flock_holder {
  pid_t pid = -1;
  int release_fd = -1;
  flock_holder(const fs::path& path, const fs::path& mark, const char* mode = "-x") {
    int p[2];
    REQUIRE(::pipe(p) == 0);
    std::fflush(nullptr);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::dup2(p[0], 0);
      ::close(p[0]);
      ::close(p[1]);
      const std::string script = "touch '" + mark.string() + "'; read x";
      ::execlp("flock", "flock", mode, path.c_str(), "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(p[0]);
    release_fd = p[1];
    REQUIRE(dibs_test::eventually([&] { return fs::exists(mark); }));
  }
  void release() {
    if (release_fd >= 0) ::close(release_fd);
    release_fd = -1;
    if (pid > 0) dibs_test::wait_exit(pid);
    pid = -1;
  }
  ~flock_holder() { release(); }
};

// (Not "'" + s + "'": GCC 12 at -O3 warns, wrongly, that the insert at the front may overlap.)
std::string q(const fs::path& p) {
  std::string s = "'";
  s += p.string();
  s += '\'';
  return s;
}

}  // namespace

TEST_CASE("file_mutex models the standard lock concepts") {
  temp_dir dir;
  dibs::file_mutex m{dir.path / "a.lock"};
  { std::scoped_lock hold{m}; }
  { std::unique_lock hold{m, 100ms}; CHECK(hold.owns_lock()); }
  { std::shared_lock hold{m}; CHECK(hold.owns_lock()); }
  CHECK(m.try_lock_until(std::chrono::system_clock::now() + 10ms));
  m.unlock();
  CHECK(m.try_lock_shared_for(10ms));
  m.unlock_shared();
}

TEST_CASE("interop with flock(1): it excludes file_mutex, and file_mutex excludes it") {
  temp_dir dir;
  const auto path = dir.path / "job.lock";
  dibs::file_mutex m{path};
  {
    flock_holder other{path, dir.path / "held"};
    CHECK_FALSE(m.try_lock());
    CHECK_FALSE(m.try_lock_for(100ms));
    CHECK_FALSE(m.try_lock_shared());
    std::atomic<bool> acquired{false};
    std::thread waiter([&] {
      m.lock();
      acquired = true;
    });
    std::this_thread::sleep_for(200ms);
    CHECK_FALSE(acquired.load());  // lock() waits while flock(1) holds it
    other.release();
    CHECK(dibs_test::eventually([&] { return acquired.load(); }));
    waiter.join();
    CHECK(sh("flock -n " + q(path) + " true") == 1);     // flock(1) is kept out
    CHECK(sh("flock -s -n " + q(path) + " true") == 1);  // also as a reader
    m.unlock();
  }
  CHECK(sh("flock -n " + q(path) + " true") == 0);
  m.lock_shared();
  CHECK(sh("flock -s -n " + q(path) + " true") == 0);  // readers share
  CHECK(sh("flock -n " + q(path) + " true") == 1);     // a writer is kept out
  m.unlock_shared();
  {
    flock_holder reader{path, dir.path / "shared", "-s"};
    CHECK(m.try_lock_shared());
    m.unlock_shared();
    CHECK_FALSE(m.try_lock());
  }
}

TEST_CASE("posix family: interop with Boost.Interprocess file_lock and lockf(3)") {
  temp_dir dir;
  const auto path = dir.path / "record.lock";
  dibs::file_mutex m{path, {.family = dibs::lock_family::posix}};
  int go[2], ready[2];
  REQUIRE(::pipe(go) == 0);
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = dibs_test::spawn([&] {
    boost::interprocess::file_lock fl{path.c_str()};
    fl.lock();
    char c = 'r';
    if (::write(ready[1], &c, 1) != 1) return 2;
    if (::read(go[0], &c, 1) != 1) return 3;
    fl.unlock();
    return 0;
  });
  char c;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  CHECK_FALSE(m.try_lock());  // Boost's file_lock holds it
  CHECK_FALSE(m.try_lock_for(50ms));
  REQUIRE(::write(go[1], "g", 1) == 1);
  CHECK(dibs_test::wait_exit(child) == 0);
  REQUIRE(m.try_lock());
  // While file_mutex holds it, Boost's file_lock and lockf(3) in another process are refused.
  const int code = dibs_test::wait_exit(dibs_test::spawn([&] {
    boost::interprocess::file_lock fl{path.c_str()};
    if (fl.try_lock()) return 10;
    const int fd = ::open(path.c_str(), O_RDWR);
    if (::lockf(fd, F_TLOCK, 0) == 0) return 11;
    return 0;
  }));
  CHECK(code == 0);
  m.unlock();
  CHECK(dibs_test::wait_exit(dibs_test::spawn([&] {
          const int fd = ::open(path.c_str(), O_RDWR);
          return ::lockf(fd, F_TLOCK, 0) == 0 ? 0 : 1;
        })) == 0);
}

TEST_CASE("threads of one process exclude each other, through one object or several") {
  temp_dir dir;
  const auto path = dir.path / "threads.lock";
  dibs::file_mutex shared_object{path};
  constexpr int threads = 4, rounds = 2000;
  long counter = 0;
  std::atomic<int> inside{0}, overlaps{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      // Half the threads share one object, half have their own on the same file.
      std::unique_ptr<dibs::file_mutex> own;
      if (t % 2) own = std::make_unique<dibs::file_mutex>(path);
      dibs::file_mutex& m = own ? *own : shared_object;
      for (int i = 0; i < rounds; ++i) {
        std::scoped_lock hold{m};
        if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
        const long v = counter;
        if (i % 64 == 0) std::this_thread::yield();
        counter = v + 1;
        inside.fetch_sub(1);
      }
    });
  for (auto& t : ts) t.join();
  CHECK(overlaps.load() == 0);
  CHECK(counter == threads * rounds);
}

TEST_CASE("readers share, a writer waits for them, and readers then wait for the writer") {
  temp_dir dir;
  dibs::file_mutex m{dir.path / "rw.lock"};
  std::shared_lock r1{m};
  std::atomic<bool> second_reader{false}, writer{false};
  std::thread t1([&] {
    std::shared_lock r2{m};
    second_reader = true;
  });
  t1.join();
  CHECK(second_reader.load());
  std::thread w([&] {
    std::unique_lock x{m};
    writer = true;
  });
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(writer.load());
  r1.unlock();
  w.join();
  CHECK(writer.load());
}

TEST_CASE("a forked child neither releases nor shares its parent's lock") {
  temp_dir dir;
  const auto path = dir.path / "fork.lock";
  dibs::file_mutex m{path};
  m.lock();
  const int code = dibs_test::wait_exit(dibs_test::spawn([&] {
    m.unlock();                    // the parent's lock: must stay held
    if (m.try_lock()) return 10;   // the child must not get it either
    return 0;                      // and exiting closes the inherited descriptor
  }));
  CHECK(code == 0);
  CHECK(sh("flock -n " + q(path) + " true") == 1);
  m.unlock();
  CHECK(sh("flock -n " + q(path) + " true") == 0);
  // A child locks through its own descriptor once the parent lets go.
  CHECK(dibs_test::wait_exit(dibs_test::spawn([&] {
          if (!m.try_lock()) return 1;
          m.unlock();
          return 0;
        })) == 0);
}

TEST_CASE("a holder killed with SIGKILL releases the lock at once") {
  temp_dir dir;
  const auto path = dir.path / "kill.lock";
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = dibs_test::spawn([&] {
    dibs::file_mutex m{path, {.write_owner = true}};
    m.lock();
    if (::write(ready[1], "r", 1) != 1) return 2;
    for (;;) ::pause();
  });
  char c;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  dibs::file_mutex m{path};
  CHECK_FALSE(m.try_lock());
  // The owner line names the holder.
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  CHECK_THAT(line, Contains("pid " + std::to_string(child) + " host "));
  ::kill(child, SIGKILL);
  CHECK(dibs_test::wait_exit(child) == 128 + SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  CHECK(m.try_lock());  // no stale lock: the kernel dropped it with the process
  CHECK(std::chrono::steady_clock::now() - start < 2s);  // one try, no wait (a few system calls; wide for a loaded machine)
  m.unlock();
  CHECK(fs::exists(path));  // never unlinked
}

TEST_CASE("descriptors are close-on-exec, so a started program does not inherit the lock") {
  temp_dir dir;
  const auto path = dir.path / "exec.lock";
  dibs::file_mutex m{path};
  CHECK((::fcntl(m.native_handle(), F_GETFD) & FD_CLOEXEC) != 0);
  m.lock();
  // A program started while the lock is held, that outlives the holder's unlock, holds nothing.
  const pid_t sleeper = dibs_test::spawn([] {
    ::execlp("sleep", "sleep", "5", static_cast<char*>(nullptr));
    return 127;
  });
  m.unlock();
  CHECK(sh("flock -n " + q(path) + " true") == 0);
  ::kill(sleeper, SIGKILL);
  dibs_test::wait_exit(sleeper);
}

TEST_CASE("bad paths give an error that names the path and what to check") {
  temp_dir dir;
  const auto missing = dir.path / "no" / "such" / "x.lock";
  CHECK_THROWS_WITH(dibs::file_mutex{missing}, Contains(missing.string()) && Contains("does the directory exist"));
  CHECK_THROWS_WITH(dibs::file_mutex{dir.path}, Contains(dir.path.string()) && Contains("directory"));
  try {
    dibs::file_mutex m{missing};
  } catch (const std::system_error& e) {
    CHECK(e.code() == std::errc::no_such_file_or_directory);
  }
}

TEST_CASE("permissions: an unprivileged user gets a clear error, and a read-only lock file still locks") {
  temp_dir dir;
  ::chmod(dir.path.c_str(), 0755);  // root's directory: others may not create files in it
  const auto path = dir.path / "root-only.lock";
  { dibs::file_mutex{dir.path / "readable.lock"}; }
  ::chmod((dir.path / "readable.lock").c_str(), 0644);
  const int code = dibs_test::run_unprivileged([&] {
    try {
      dibs::file_mutex m{path};
      return 10;
    } catch (const std::system_error& e) {
      const std::string what = e.what();
      if (e.code() != std::errc::permission_denied) return 11;
      if (what.find(path.string()) == std::string::npos || what.find("permissions") == std::string::npos) return 12;
    }
    dibs::file_mutex ro{dir.path / "readable.lock"};  // opened read-only; flock works on it
    if (!ro.try_lock()) return 13;
    ro.unlock();
    try {
      dibs::file_mutex posix{dir.path / "readable.lock", {.family = dibs::lock_family::posix}};
      return 14;  // a POSIX write lock needs a writable descriptor
    } catch (const std::system_error& e) {
      if (e.code() != std::errc::permission_denied) return 15;
    }
    return 0;
  });
  if (code == 77) WARN("no unprivileged account on this machine: permission cases not run");
  INFO("child exit code " << code);
  CHECK((code == 0 || code == 77));
}

TEST_CASE("a forked child of a holder does not keep the lock once the holder is SIGKILLed") {
  temp_dir dir;
  const auto path = dir.path / "inherited.lock";
  dibs_test::channel ready;
  dibs_test::child holder{dibs_test::spawn([&]() -> int {
    dibs::file_mutex m{path};
    m.lock();
    std::fflush(nullptr);
    const pid_t g = ::fork();
    if (g < 0) return 2;
    if (g == 0) {  // the grandchild: works on (never execs, so O_CLOEXEC does not help) until killed below
      std::this_thread::sleep_for(120s);  // (a bound only for a run that stops before its kill)
      ::_exit(0);
    }
    ready.send(std::to_string(g));
    for (;;) ::pause();
  })};
  const auto r = ready.receive();
  REQUIRE(r);
  const pid_t grandchild = static_cast<pid_t>(std::stol(*r));
  dibs::file_mutex m{path};
  CHECK_FALSE(m.try_lock());  // held
  CHECK(holder.kill() == 128 + SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  const bool got = m.try_lock_for(10s);
  const auto took = dibs_test::ms_since(t0);
  const bool grandchild_alive = ::kill(grandchild, 0) == 0;
  INFO("after the holder was killed, try_lock_for(10s) returned " << got << " after " << took << " ms; its child "
                                                                 << grandchild << (grandchild_alive ? " still runs" : " has ended"));
  CHECK(grandchild_alive);  // it still ran after the lock was taken: the lock was not freed by its end
  CHECK(got);
  CHECK(took < 5000);  // at once (a few ms), not at the end of the wait; wide for a loaded machine
  if (got) m.unlock();
  // Not our child (its parent died): it would end by itself after 120 s; end it now.
  if (grandchild_alive) ::kill(grandchild, SIGKILL);
}

// ---- Issue 12: a lock wait can be cancelled ------------------------------

TEST_CASE("a file_mutex wait ends promptly with errc::cancelled when a stop is requested, in the kernel or behind a thread") {
  temp_dir dir;
  const auto path = dir.path / "nightly.lock";
  auto expect_cancelled = [](auto&& wait) {
    const auto r = dibs_test::cancel_after(200ms, wait);
    CHECK(r.code == dibs::errc::cancelled);
    CHECK(r.waited >= 200ms);
    CHECK(r.waited < 200ms + 1500ms);  // well before the 4 s limit: a loaded sanitizer run is slow to schedule
  };
  SECTION("held by another process (a wait in the kernel)") {
    int ready[2];
    REQUIRE(::pipe(ready) == 0);
    dibs_test::child holder{dibs_test::spawn([&]() -> int {
      dibs::file_mutex m{path};
      m.lock();
      if (::write(ready[1], "r", 1) != 1) return 2;
      for (;;) ::pause();
    })};
    char c;
    REQUIRE(::read(ready[0], &c, 1) == 1);
    dibs::file_mutex m{path};
    expect_cancelled([&](std::stop_token st) { m.lock(st); });
    expect_cancelled([&](std::stop_token st) { (void)m.try_lock_for(4s, st); });
    holder.kill();
    CHECK(m.try_lock_for(2s));  // nothing was left half-taken by the cancelled waits
    m.unlock();
  }
  SECTION("held by another thread of this process") {
    dibs::file_mutex a{path};
    dibs::file_mutex b{path};
    a.lock();
    expect_cancelled([&](std::stop_token st) { b.lock(st); });
    a.unlock();
    CHECK(b.try_lock());
    b.unlock();
  }
}

TEST_CASE("a held file_mutex moved into a vector and an optional and out stays held, and the new owner's unlock frees it") {
  temp_dir dir;
  const auto path = dir.path / "moved.lock";
  const auto another_can_take = [&] {
    const int code = dibs_test::wait_exit(dibs_test::spawn([&]() -> int {
      dibs::file_mutex probe{path};
      if (!probe.try_lock()) return 10;
      probe.unlock();
      return 0;
    }));
    REQUIRE((code == 0 || code == 10));
    return code == 0;
  };
  std::vector<dibs::file_mutex> locks;
  {
    dibs::file_mutex a{path};
    a.lock();
    locks.push_back(std::move(a));
    CHECK(a.native_handle() == -1);
    a.unlock();  // a moved-from object's unlock does nothing: the lock stays held
    CHECK_THROWS_AS(a.try_lock(), std::system_error);
  }
  for (int i = 0; i < 8; ++i) locks.emplace_back(dir.path / ("other-" + std::to_string(i) + ".lock"));
  std::optional<dibs::file_mutex> opt{std::move(locks.front())};
  locks.clear();
  CHECK_FALSE(another_can_take());
  dibs::file_mutex back = std::move(*opt);
  opt.reset();
  CHECK_FALSE(another_can_take());
  back.unlock();
  CHECK(another_can_take());
  // Move assignment over the process's only file_mutex on a held file releases it.
  dibs::file_mutex x{dir.path / "assigned.lock"};
  x.lock();
  x = dibs::file_mutex{path};
  dibs::file_mutex probe{dir.path / "assigned.lock"};
  CHECK(probe.try_lock());
  probe.unlock();
}
