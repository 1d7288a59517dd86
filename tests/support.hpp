// Helpers shared by the tests: temporary directories, child processes, the
// handshakes between them, and the adversaries of the safety tests: processes
// in other namespaces, under other user ids, stopped while they hold a lock.
#pragma once

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <stop_token>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace dibs_test {

namespace fs = std::filesystem;

/// A fresh directory under the system temp dir, removed at scope exit.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::string tmpl = (fs::temp_directory_path() / "dibs-test-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

/// Returns: the whole content of the file at `p` ("" if it cannot be read).
inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Effects: replaces the content of the file at `p` with `s`.
inline void spit(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary | std::ios::trunc) << s; }

/// Runs a shell command (std::system); returns its exit code, or -1 if it did not exit.
inline int sh(const std::string& cmd) {
  const int st = std::system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/// Effects: forks; the child runs `body` and exits with its return value (1 if
/// it throws, after printing what). Never returns in the child.
inline pid_t spawn(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 1;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), e.what());
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  return pid;
}

/// Returns: the child's exit code, or 128 + signal if it was killed.
inline int wait_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

/// Returns: the uid and gid of an unprivileged account ("nobody"), for tests
/// of permission errors: root ignores file permissions.
inline bool unprivileged_ids(uid_t& uid, gid_t& gid) {
  const passwd* pw = ::getpwnam("nobody");
  if (!pw) return false;
  uid = pw->pw_uid;
  gid = pw->pw_gid;
  return true;
}

/// Effects: in a child process, drops to the unprivileged account and runs body.
/// Returns: body's exit code (77 if no unprivileged account exists).
inline int run_unprivileged(const std::function<int()>& body) {
  uid_t uid;
  gid_t gid;
  if (!unprivileged_ids(uid, gid)) return 77;
  return wait_exit(spawn([&] {
    if (::getuid() == 0 && (::setgid(gid) != 0 || ::setuid(uid) != 0)) return 78;
    return body();
  }));
}

/// Effects: polls `pred` until it holds or `timeout` passes. Returns: pred().
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds{10}) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  return true;
}

// --- handshakes, timing, and the adversaries of the safety tests ---

/// Returns: "<what>: <strerror(e)>".
inline std::string os_error(const char* what, int e = errno) { return std::string(what) + ": " + std::strerror(e); }

/// Returns: the milliseconds since `t0` on the steady clock.
inline long long ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
}

/// Returns: the steady clock now, as a number another process of this time
/// namespace can compare (CLOCK_MONOTONIC is one clock for the whole machine).
inline long long steady_ns() { return std::chrono::steady_clock::now().time_since_epoch().count(); }
inline std::chrono::steady_clock::time_point from_steady_ns(long long ns) {
  return std::chrono::steady_clock::time_point{std::chrono::steady_clock::duration{ns}};
}

/// A child process, killed (SIGKILL, which ends a stopped one too) and reaped
/// at scope exit unless wait() reaped it first.
class child {
public:
  child() = default;
  explicit child(pid_t pid) noexcept : pid_(pid) {}
  child(child&& o) noexcept : pid_(std::exchange(o.pid_, -1)) {}
  child& operator=(child&& o) noexcept {
    if (this != &o) {
      kill();
      pid_ = std::exchange(o.pid_, -1);
    }
    return *this;
  }
  child(const child&) = delete;
  child& operator=(const child&) = delete;
  ~child() { kill(); }
  pid_t pid() const noexcept { return pid_; }
  /// Returns: its exit code, or 128 + signal (wait_exit).
  int wait() noexcept { return pid_ > 0 ? wait_exit(std::exchange(pid_, -1)) : -1; }
  /// Effects: forgets it (it was reaped elsewhere).
  void release() noexcept { pid_ = -1; }
  /// Effects: SIGKILL, then reaps it. Returns: as wait().
  int kill() noexcept {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGKILL);
    return wait();
  }

private:
  pid_t pid_ = -1;
};

/// A pipe for short messages, one line each, between a process and its
/// children. Both ends stay open in every process that has them, so readers
/// wait with a timeout, never for an end of file.
class channel {
public:
  channel() { REQUIRE(::pipe2(fd_, O_CLOEXEC) == 0); }
  ~channel() {
    ::close(fd_[0]);
    ::close(fd_[1]);
  }
  channel(const channel&) = delete;
  channel& operator=(const channel&) = delete;

  /// Effects: writes `msg` and a newline in one write (atomic below PIPE_BUF,
  /// so lines of several writers never mix).
  bool send(std::string_view msg) const {
    std::string line(msg);
    line += '\n';
    ssize_t n;
    do n = ::write(fd_[1], line.data(), line.size());
    while (n < 0 && errno == EINTR);
    return n == static_cast<ssize_t>(line.size());
  }
  /// Returns: the next line, without its newline; nullopt if none came within `timeout`.
  std::optional<std::string> receive(std::chrono::milliseconds timeout = std::chrono::seconds{20}) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    std::string line;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      pollfd p{fd_[0], POLLIN, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(std::max<long long>(0, left.count())));
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0) return std::nullopt;
      char c;
      const ssize_t n = ::read(fd_[0], &c, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;
      if (c == '\n') return line;
      line += c;
    }
  }
  /// Returns: every line written so far, without waiting for more.
  std::vector<std::string> drain() const {
    std::vector<std::string> lines;
    while (auto l = receive(std::chrono::milliseconds{0})) lines.push_back(std::move(*l));
    return lines;
  }

private:
  int fd_[2];
};

/// Returns: `line` split at spaces.
inline std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < line.size()) {
    const auto sp = line.find(' ', pos);
    out.push_back(line.substr(pos, sp == std::string::npos ? std::string::npos : sp - pos));
    if (sp == std::string::npos) break;
    pos = sp + 1;
  }
  return out;
}

/// Runs `action` on a thread of its own after `after`, unless destroyed
/// first. A safety test arms one to end a wait that the code under test must
/// never begin (code before issue 11 blocked for ever on the flock of a stopped
/// process, or spun on a symbolic link): the test then fails on its timing
/// instead of hanging.
class watchdog {
public:
  watchdog(std::chrono::milliseconds after, std::function<void()> action)
      : thread_([this, after, action = std::move(action)] {
          std::unique_lock g{m_};
          if (cv_.wait_for(g, after, [&] { return done_; })) return;
          fired_ = true;
          g.unlock();
          action();
        }) {}
  ~watchdog() {
    {
      std::lock_guard g{m_};
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  bool fired() const {
    std::lock_guard g{m_};
    return fired_;
  }

private:
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  bool fired_ = false;
  std::thread thread_;  // last: it starts once the members above exist
};

/// A process that takes an exclusive flock on `path` (an existing file), as
/// a store operation does while it changes a record, and stops there
/// (SIGSTOP): a process stopped in the middle of that operation. Killed and
/// reaped at scope exit (or by kill(), which drops the flock).
class stopped_flock_holder {
public:
  explicit stopped_flock_holder(const std::filesystem::path& path) {
    REQUIRE(std::filesystem::exists(path));
    channel locked;
    proc_ = child{spawn([&]() -> int {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || ::flock(fd, LOCK_EX) != 0) {
        locked.send("error " + os_error("open/flock"));
        return 2;
      }
      locked.send(std::to_string(steady_ns()));
      ::raise(SIGSTOP);
      for (;;) ::pause();
    })};
    const auto line = locked.receive();
    REQUIRE(line);
    INFO(*line);
    REQUIRE(line->rfind("error", 0) != 0);
    locked_at_ = from_steady_ns(std::stoll(*line));
    int status = 0;
    REQUIRE(::waitpid(proc_.pid(), &status, WUNTRACED) == proc_.pid());
    REQUIRE(WIFSTOPPED(status));
  }
  /// When it held the flock (just before it stopped).
  std::chrono::steady_clock::time_point locked_at() const noexcept { return locked_at_; }
  pid_t pid() const noexcept { return proc_.pid(); }
  /// Effects: kills it, which releases the flock.
  void kill() noexcept { proc_.kill(); }

private:
  child proc_;
  std::chrono::steady_clock::time_point locked_at_{};
};

/// Returns: true if this process may change user ids and make namespaces:
/// the multi-user and namespace tests need it (root ignores permissions, so
/// they run as unprivileged ids 1001 and 1002, made in forked children).
inline bool is_root() { return ::geteuid() == 0; }

/// True in a ThreadSanitizer build, where a child forked from a process
/// with threads may not start threads of its own (TSan refuses it).
#if defined(__SANITIZE_THREAD__)
inline constexpr bool under_tsan = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif
#else
inline constexpr bool under_tsan = false;
#endif

/// True in an AddressSanitizer build. Its allocator is not fork-safe: a
/// child forked while another thread is inside malloc can hang in its first
/// allocation (seen with the PostgreSQL proxy's threads).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool under_asan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool under_asan = true;
#else
inline constexpr bool under_asan = false;
#endif
#else
inline constexpr bool under_asan = false;
#endif

/// True where a test must not fork while threads run (TSan, ASan).
inline constexpr bool no_fork_with_threads = under_tsan || under_asan;

/// Effects: makes this process (a forked child) user `uid` with group `gid`
/// and supplementary `groups`; no account is needed.
/// Returns: "" on success, else what failed.
inline std::string become(uid_t uid, gid_t gid, const std::vector<gid_t>& groups = {}) {
  if (::setgroups(groups.size(), groups.data()) != 0) return os_error("setgroups");
  if (::setgid(gid) != 0) return os_error("setgid");
  if (::setuid(uid) != 0) return os_error("setuid");
  return {};
}

/// Effects: in a forked child, becomes `uid`/`gid` with `groups` and runs body.
/// Returns: body's exit code (78 if the ids could not be taken).
inline int run_as(uid_t uid, gid_t gid, const std::vector<gid_t>& groups, const std::function<int()>& body) {
  return wait_exit(spawn([&] {
    if (const auto why = become(uid, gid, groups); !why.empty()) {
      std::fprintf(stderr, "run_as(%d): %s\n", static_cast<int>(uid), why.c_str());
      return 78;
    }
    return body();
  }));
}

/// Effects: in a mount namespace of this process's own (unshare(CLONE_NEWNS)
/// first), makes every mount private (nothing leaks to the rest of the
/// machine) and mounts a new proc over /proc with `options` ("" or e.g.
/// "hidepid=2"): the proc of this process's PID namespace, as
/// `unshare --mount-proc` does. Returns: "" on success, else what failed.
inline std::string mount_own_proc(const char* options) {
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return os_error("mount --make-rprivate /");
  if (::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, options) != 0)
    return os_error("mount -t proc proc /proc");
  return {};
}

/// Effects: writes `offsets` ("boottime 1000 0") to /proc/self/timens_offsets:
/// the offsets of the time namespace that unshare(CLONE_NEWTIME) made for this
/// process's children. Returns: "" on success, else what failed.
inline std::string set_time_offsets(const std::string& offsets) {
  const int fd = ::open("/proc/self/timens_offsets", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return os_error("open /proc/self/timens_offsets");
  const ssize_t n = ::write(fd, offsets.data(), offsets.size());
  const int e = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(offsets.size())) return os_error("write /proc/self/timens_offsets", e);
  return {};
}

/// A process started in new namespaces, as `unshare --fork` starts one: a
/// child calls unshare(flags) and runs `prepare` (e.g. set_time_offsets,
/// which must come before any process enters the new time namespace), then
/// forks the process that runs `setup` (e.g. mount_own_proc, become) and then
/// `body`. With CLONE_NEWPID that process is pid 1 of a new PID namespace;
/// with CLONE_NEWTIME it is in the new time namespace. Both processes are
/// killed and reaped at scope exit (the inner one also dies with the outer
/// one: PR_SET_PDEATHSIG).
class ns_process {
public:
  ns_process(int flags, std::function<std::string()> prepare, std::function<std::string()> setup,
             std::function<int()> body) {
    int st[2];
    REQUIRE(::pipe2(st, O_CLOEXEC) == 0);
    auto report = [&](std::string line) {
      line += '\n';
      if (::write(st[1], line.data(), line.size()) < 0) std::perror("ns_process report");
    };
    outer_ = child{spawn([&]() -> int {
      ::close(st[0]);
      if (::unshare(flags) != 0) {
        report("refused " + os_error("unshare"));
        return 77;
      }
      if (prepare) {
        if (const auto why = prepare(); !why.empty()) {
          report("refused " + why);
          return 77;
        }
      }
      const pid_t inner = ::fork();
      if (inner < 0) {
        report("refused " + os_error("fork"));
        return 77;
      }
      if (inner == 0) {
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        int code = 77;
        try {
          if (const auto why = setup ? setup() : std::string{}; !why.empty()) {
            report("refused " + why);
          } else {
            report("running");
            code = body();
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "ns_process %d: %s\n", static_cast<int>(::getpid()), e.what());
          code = 1;
        }
        std::fflush(nullptr);
        ::_exit(code);
      }
      report("pid " + std::to_string(inner));
      return wait_exit(inner);
    })};
    ::close(st[1]);
    // Two lines, in either order: "pid N" from the outer process, "running"
    // (or "refused why") from the inner one; or "refused why" from the outer.
    std::string text;
    bool running = false;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds{20};
    while (!refused_.size() && !(running && inner_ > 0)) {
      pollfd p{st[0], POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
        refused_ = "no word from the processes in the new namespaces within 20 s";
        break;
      }
      char c;
      if (::read(st[0], &c, 1) != 1) {
        refused_ = "the processes in the new namespaces ended without saying why";
        break;
      }
      if (c != '\n') {
        text += c;
        continue;
      }
      if (text.rfind("refused ", 0) == 0) refused_ = text.substr(8);
      else if (text == "running") running = true;
      else if (text.rfind("pid ", 0) == 0) inner_ = static_cast<pid_t>(std::stol(text.substr(4)));
      text.clear();
    }
    ::close(st[0]);
  }
  ns_process(const ns_process&) = delete;
  ns_process& operator=(const ns_process&) = delete;
  ~ns_process() { kill(); }

  /// Returns: "" if body runs in the namespaces asked for; else why they could not be had.
  const std::string& refused() const noexcept { return refused_; }
  /// Returns: the pid of the process that runs body, in this process's PID namespace.
  pid_t pid() const noexcept { return inner_; }
  /// Returns: body's exit code.
  int wait() noexcept {
    inner_ = -1;
    return outer_.wait();
  }
  /// Effects: kills both processes.
  void kill() noexcept {
    // The outer process reaps the inner one: while it has not ended, the
    // inner pid is still the inner process (alive or a zombie), never reused.
    if (outer_.pid() > 0) {
      int status = 0;
      if (::waitpid(outer_.pid(), &status, WNOHANG) == 0) {
        if (inner_ > 0) ::kill(inner_, SIGKILL);
        outer_.kill();
      } else {
        outer_.release();  // it had ended, and is reaped now
      }
    }
    inner_ = -1;
  }

private:
  child outer_;
  pid_t inner_ = -1;
  std::string refused_;
};

/// Returns: a pid that no process has now (kill says ESRCH), from `first` down.
inline pid_t unused_pid(pid_t first = 999999) {
  for (pid_t p = first; p > 1; --p)
    if (::kill(p, 0) != 0 && errno == ESRCH) return p;
  return -1;
}

}  // namespace dibs_test

namespace dibs_test {

/// What a wait that was cancelled gave: its error code (none if it returned)
/// and how long it took.
struct cancelled_wait {
  std::error_code code;
  std::chrono::steady_clock::duration waited{};
};

/// Effects: runs wait(token) while another thread requests a stop through
/// the token after `after`. Returns: the code of the std::system_error the
/// wait threw (none if it returned) and how long it waited.
template <class Wait>
cancelled_wait cancel_after(std::chrono::milliseconds after, Wait&& wait) {
  std::stop_source stop;
  // The clock starts before the canceller does: a canceller started first
  // could sleep its `after` while this thread waits for a core, and the
  // wait measured would then be shorter than `after`.
  const auto t0 = std::chrono::steady_clock::now();
  std::thread canceller([&stop, until = t0 + after] {
    std::this_thread::sleep_until(until);
    stop.request_stop();
  });
  cancelled_wait out;
  try {
    wait(stop.get_token());
  } catch (const std::system_error& e) {
    out.code = e.code();
  }
  out.waited = std::chrono::steady_clock::now() - t0;
  canceller.join();
  return out;
}

/// What on_full_filesystem() saw.
struct full_filesystem_result {
  bool ran = false;     ///< false: mounting was refused (not root, no namespaces); `what` says why
  std::string what;     ///< what `body` returned, or why it did not run
};

/// Effects: in a child process with a mount namespace of its own (nothing
/// leaks to the machine), mounts a 64 KiB tmpfs on `dir`, fills it to the
/// last byte, and runs `body(dir)` there.
/// Returns: what body returned (e.g. the message of the error it caught).
inline full_filesystem_result on_full_filesystem(const fs::path& dir,
                                                 const std::function<std::string(const fs::path&)>& body) {
  fs::create_directories(dir);
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const pid_t pid = spawn([&]() -> int {
    ::close(out[0]);
    auto say = [&](const std::string& text) {
      for (std::size_t done = 0; done < text.size();) {
        const auto n = ::write(out[1], text.data() + done, text.size() - done);
        if (n <= 0) return;
        done += static_cast<std::size_t>(n);
      }
    };
    if (::unshare(CLONE_NEWNS) != 0) return say(os_error("unshare(CLONE_NEWNS)")), 77;
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return say(os_error("mount --make-rprivate /")), 77;
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=64k") != 0) return say(os_error("mount -t tmpfs")), 77;
    {
      std::ofstream fill(dir / "fill", std::ios::binary);
      const std::string block(4096, 'f');
      while (fill.write(block.data(), static_cast<std::streamsize>(block.size())) && fill.flush()) {
      }
    }
    std::ofstream((dir / "fill"), std::ios::binary | std::ios::app).put('f');  // the last bytes of a partial block
    say(body(dir));
    return 0;
  });
  ::close(out[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<std::size_t>(n));
  ::close(out[0]);
  const int code = wait_exit(pid);
  REQUIRE((code == 0 || code == 77));
  return {code == 0, text};
}

}  // namespace dibs_test
