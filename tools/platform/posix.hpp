// dibs.cpp's system calls on POSIX (Linux): running COMMAND as a child and
// forwarding signals to it, the lease and presence locks held on behalf of
// that child, the kernel lock (flock(2)) and its inherited descriptor, and
// the sleep of `dibs retry`. Part of tools/dibs.cpp, included inside its
// namespace after the definitions it uses (lock_args, lease_kind, dot_kind);
// platform/win32.hpp is its Windows twin, with the same functions.
#pragma once

// ---------------------------------------------------------------------------
// Running COMMAND as a child, forwarding signals, with an optional tick.

int status_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return ex::software;
}

// Returns: "exited N" or "was ended by signal N", for a wait status.
std::string describe_status(int status) {
  if (WIFSIGNALED(status)) return fmt::format("was ended by signal {}", WTERMSIG(status));
  return fmt::format("exited {}", status_code(status));
}

// Signals dibs forwards to its COMMAND (and SIGCHLD, to learn its end): all
// blocked and read from a signalfd, so nothing races with the wait.
sigset_t forwarded_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCHLD}) sigaddset(&set, s);
  return set;
}

// The mask dibs was started with, for COMMAND.
sigset_t original_mask;
bool signals_blocked = false;

// Blocks the forwarded signals in this thread and in every thread started
// after it (a library's renewal thread must not take SIGCHLD away from the
// signalfd): call it before anything that may start a thread.
void block_forwarded() {
  if (signals_blocked) return;
  const sigset_t set = forwarded_set();
  if (::pthread_sigmask(SIG_BLOCK, &set, &original_mask) != 0) fail(ex::software, "dibs: pthread_sigmask failed");
  signals_blocked = true;
}

// Signals dibs forwards to its COMMAND (and SIGCHLD, to learn its end): all
// blocked and read from a signalfd, so nothing races with the wait.
class signal_gate {
public:
  signal_gate() {
    block_forwarded();
    const sigset_t set = forwarded_set();
    fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    if (fd_ < 0) fail(ex::software, fmt::format("dibs: signalfd failed: {}", std::strerror(errno)));
  }
  ~signal_gate() { ::close(fd_); }
  signal_gate(const signal_gate&) = delete;
  signal_gate& operator=(const signal_gate&) = delete;
  int fd() const { return fd_; }
  // For a forked child, before exec: the mask dibs was started with.
  void restore_in_child() const { ::sigprocmask(SIG_SETMASK, &original_mask, nullptr); }
  // Returns: the next pending signal, or 0.
  int next() const {
    signalfd_siginfo si{};
    if (::read(fd_, &si, sizeof si) != static_cast<ssize_t>(sizeof si)) return 0;
    return static_cast<int>(si.ssi_signo);
  }

private:
  int fd_ = -1;
};

// While it lives, a thread that requests a stop through `src` as soon as a
// signal is pending on the gate's descriptor (it reads nothing: the signal
// is left for whoever handles it), so that a lock's one long wait can be
// cancelled by a signal.
class signal_watch {
public:
  signal_watch(int signal_fd, std::stop_source src) {
    if (::pipe2(wake_, O_CLOEXEC) != 0) fail(ex::software, fmt::format("dibs: pipe failed: {}", std::strerror(errno)));
    thread_ = std::thread([signal_fd, src, done = wake_[0]]() mutable {
      pollfd fds[2] = {{signal_fd, POLLIN, 0}, {done, POLLIN, 0}};
      while (::poll(fds, 2, -1) < 0 && errno == EINTR) {
      }
      if (fds[0].revents & POLLIN) src.request_stop();
    });
  }
  ~signal_watch() {
    (void)!::write(wake_[1], "x", 1);
    thread_.join();
    ::close(wake_[0]);
    ::close(wake_[1]);
  }
  signal_watch(const signal_watch&) = delete;
  signal_watch& operator=(const signal_watch&) = delete;

private:
  int wake_[2] = {-1, -1};
  std::thread thread_;
};

// argv/envp for execvpe, built before fork (a child of a process with
// threads may not allocate).
struct exec_args {
  std::vector<std::string> argv_s, env_s;
  std::vector<char*> argv, envp;
  exec_args(const std::vector<std::string>& cmd, const std::vector<std::pair<std::string, std::string>>& set,
            const std::vector<std::string>& unset = {}) : argv_s(cmd) {
    for (char** e = environ; *e; ++e) {
      std::string_view kv{*e};
      const auto name = kv.substr(0, kv.find('='));
      bool drop = false;
      for (const auto& [k, v] : set) drop = drop || name == k;
      for (const auto& k : unset) drop = drop || name == k;
      if (!drop) env_s.emplace_back(kv);
    }
    for (const auto& [k, v] : set) env_s.push_back(k + "=" + v);
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    for (auto& s : env_s) envp.push_back(s.data());
    envp.push_back(nullptr);
  }
};

// In a forked child: exec COMMAND, or say why not and _exit 126/127.
[[noreturn]] void exec_or_die(exec_args& a) {
  ::execvpe(a.argv[0], a.argv.data(), a.envp.data());
  const int e = errno;
  const char* hint = e != ENOENT        ? ""
                     : a.argv[0][0] == '-' && exec_failure_code == 0 ? " (options of dibs go before its PATH, STORE or TARGET: from there on "
                                             "every argument is data, and COMMAND begins after them)"
                                           : " (is it on PATH?)";
  const std::string msg = fmt::format("{}: cannot run '{}': {}{}\n", exec_failure_who, a.argv[0], std::strerror(e), hint);
  (void)!::write(2, msg.data(), msg.size());
  ::_exit(exec_failure_code != 0 ? exec_failure_code : e == ENOENT ? ex::not_found : ex::cannot_exec);
}

// Waits for `pid`, forwarding signals to it; calls `tick` every `period`
// (if set) and `on_fd` when `extra_fd` is readable. Returns: its wait status.
template <class Tick, class OnFd>
int supervise(const signal_gate& g, pid_t pid, std::optional<milliseconds> period, Tick&& tick, int extra_fd, OnFd&& on_fd) {
  auto next_tick = steady::now() + period.value_or(milliseconds{0});
  for (;;) {
    pollfd fds[2] = {{g.fd(), POLLIN, 0}, {extra_fd, POLLIN, 0}};
    int timeout = -1;
    if (period) {
      const auto left = std::chrono::duration_cast<milliseconds>(next_tick - steady::now()).count();
      timeout = static_cast<int>(std::max<long long>(0, left));
    }
    const int n = ::poll(fds, extra_fd >= 0 ? 2 : 1, timeout);
    if (n < 0 && errno != EINTR) fail(ex::software, fmt::format("dibs: poll failed: {}", std::strerror(errno)));
    if (n > 0 && (fds[0].revents & POLLIN)) {
      for (int s; (s = g.next()) != 0;) {
        if (s != SIGCHLD) {
          ::kill(pid, s);
          continue;
        }
      }
      int status = 0;
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) return status;
    }
    if (n > 0 && extra_fd >= 0 && (fds[1].revents & (POLLIN | POLLHUP))) {
      if (!on_fd()) extra_fd = -1;
    }
    if (period && steady::now() >= next_tick) {
      tick();
      next_tick = steady::now() + *period;
    }
  }
}

// Forks a child that becomes COMMAND (with the signal mask dibs was started
// with: the gate `g` blocks the forwarded signals in dibs). `stop_with_dibs`:
// the child gets SIGKILL if dibs dies first (PR_SET_PDEATHSIG: tied to the
// thread that forks, so call it from the thread that lives as long as dibs).
// Returns: the child's pid.
pid_t spawn_command(const signal_gate& g, exec_args& a, bool stop_with_dibs) {
  const int pdeath = stop_with_dibs ? SIGKILL : 0;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) fail(ex::software, fmt::format("dibs: fork failed: {}", std::strerror(errno)));
  if (pid == 0) {
    if (pdeath != 0) {
      ::prctl(PR_SET_PDEATHSIG, pdeath);
      if (::getppid() != parent) ::_exit(128 + pdeath);  // dibs died before prctl
    }
    g.restore_in_child();
    exec_or_die(a);
  }
  return pid;
}

// Runs COMMAND to its end, forwarding signals. `stop_with_dibs`: COMMAND
// gets SIGKILL if dibs dies first.
int run_command(exec_args& a, bool stop_with_dibs, std::optional<milliseconds> period = {}, std::function<void()> tick = {}) {
  signal_gate g;
  const pid_t pid = spawn_command(g, a, stop_with_dibs);
  return status_code(supervise(g, pid, period, [&] { if (tick) tick(); }, -1, [] { return false; }));
}

// ---------------------------------------------------------------------------
// Many COMMANDs at once (dibs work), supervised from one loop: one signalfd
// for all of them. (One run_command per thread would not do: each makes a
// signalfd of its own, and a SIGCHLD one thread reads is lost to the others.)

class command_pool {
public:
  using id = pid_t;
  struct ending {
    id who;
    int code;  // its exit status, or 128+N if signal N ended it
  };
  struct events {
    std::vector<ending> ended;  // the COMMANDs that ended, in no order
    std::vector<int> signals;  // the signals that came (forwarded to every running COMMAND), SIGCHLD aside
  };

  command_pool() = default;  // the gate blocks the forwarded signals first
  command_pool(const command_pool&) = delete;
  command_pool& operator=(const command_pool&) = delete;
  // COMMANDs still running are left to PR_SET_PDEATHSIG (dibs is ending).
  ~command_pool() = default;

  // Starts COMMAND; it gets SIGKILL if dibs dies. Returns: its id.
  id start(exec_args& a) {
    const pid_t pid = spawn_command(gate_, a, true);
    running_.push_back(pid);
    return pid;
  }
  std::size_t running() const { return running_.size(); }

  // Waits up to `d` (for ever if not set) until a COMMAND ends or a signal
  // comes; forwards each signal to every running COMMAND. Returns: what
  // happened (nothing if `d` ran out).
  events wait(std::optional<milliseconds> d) {
    events out;
    pollfd p{gate_.fd(), POLLIN, 0};
    const int timeout = d ? static_cast<int>(std::clamp<long long>(d->count(), 0, 24 * 3600 * 1000)) : -1;
    const int n = ::poll(&p, 1, timeout);
    if (n < 0 && errno != EINTR) fail(ex::software, fmt::format("dibs: poll failed: {}", std::strerror(errno)));
    if (n <= 0) return out;
    bool child = false;
    for (int s; (s = gate_.next()) != 0;) {
      if (s == SIGCHLD) {
        child = true;
        continue;
      }
      for (const pid_t pid : running_) ::kill(pid, s);
      out.signals.push_back(s);
    }
    // SIGCHLDs of children that end together merge into one: every child is
    // asked, without waiting.
    if (child) {
      for (auto it = running_.begin(); it != running_.end();) {
        int status = 0;
        pid_t r;
        while ((r = ::waitpid(*it, &status, WNOHANG)) < 0 && errno == EINTR) {
        }
        if (r == *it) {
          out.ended.push_back({*it, status_code(status)});
          it = running_.erase(it);
        } else {
          ++it;
        }
      }
    }
    return out;
  }

private:
  signal_gate gate_;
  std::vector<pid_t> running_;
};

// Returns: 0 if `program` can be run (found on PATH if it has no '/', and
// executable), else the code exec would fail with (127 not found, 126 not
// executable), with what to say. dibs work asks before it claims anything,
// so that a misspelt COMMAND costs no item an attempt.
std::pair<int, std::string> check_runnable(const std::string& program) {
  auto try_one = [](const std::string& path) -> int {
    struct ::stat st {};
    if (::stat(path.c_str(), &st) != 0) return ex::not_found;
    if (S_ISDIR(st.st_mode) || ::access(path.c_str(), X_OK) != 0) return ex::cannot_exec;
    return 0;
  };
  if (program.empty()) return {ex::not_found, "an empty COMMAND"};
  if (program.find('/') != std::string::npos) {
    const int code = try_one(program);
    return {code, code == ex::not_found ? "no such file" : code ? "not executable" : ""};
  }
  const char* path = std::getenv("PATH");
  std::string_view dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  int best = ex::not_found;
  for (;;) {
    const auto colon = dirs.find(':');
    std::string dir{dirs.substr(0, colon)};
    if (dir.empty()) dir = ".";
    const int code = try_one(dir + "/" + program);
    if (code == 0) return {0, ""};
    best = std::min(best, code);  // found but not executable (126) says more than not found
    if (colon == std::string_view::npos) break;
    dirs.remove_prefix(colon + 1);
  }
  return {best, best == ex::not_found ? "not found (is it on PATH?)" : "not executable"};
}

// What the waiting child learns from dibs: go, with or without a token,
// and the permit it holds (--max).
struct go_message {
  dibs::version token = 0;
  std::uint32_t permit = 0;
  std::uint8_t has_token = 0;
  std::uint8_t has_permit = 0;
};

// The lease lock and the presence lock, held on behalf of COMMAND
// (lease_options::on_behalf_of, dot_lock_options::on_behalf_of): dibs forks
// the child that becomes COMMAND, takes the lock naming the child's pid and
// start time, then lets the child exec. dibs renews the lease (touches the
// lock file) while COMMAND runs and removes the record when it has ended. If
// dibs is killed, COMMAND keeps the lock until it exits (then the next taker
// breaks it on proof at once: the pid is gone), or for one lease after dibs's
// last renewal, whichever comes first. With -o the lock names dibs itself,
// as flock -o leaves COMMAND without the lock: if dibs is killed, the lock
// is free at once, though COMMAND runs on.
template <class Kind>
int lock_for_child(const lock_args& a, std::optional<milliseconds> wait, Kind& kind, int lost_read) {
  const auto started = steady::now();
  // The go message goes to the child through a socket pair, so that a send
  // to a child that has died meanwhile fails with EPIPE instead of raising
  // SIGPIPE (whose disposition COMMAND would inherit if dibs ignored it).
  int go[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, go) != 0) fail(ex::software, "dibs lock: socketpair failed");
  signal_gate g;  // before the renewal thread starts: it must not take the forwarded signals
  const pid_t pid = ::fork();
  if (pid < 0) fail(ex::software, fmt::format("dibs lock: fork failed: {}", std::strerror(errno)));
  if (pid == 0) {
    ::close(go[1]);
    g.restore_in_child();
    go_message m;
    ssize_t n;
    while ((n = ::read(go[0], &m, sizeof m)) < 0 && errno == EINTR) {
    }
    if (n != static_cast<ssize_t>(sizeof m)) ::_exit(ex::software);  // dibs did not get the lock (or died)
    if (m.has_token)
      ::setenv("DIBS_TOKEN", std::to_string(m.token).c_str(), 1);
    else
      ::unsetenv("DIBS_TOKEN");
    if (m.has_permit)
      ::setenv("DIBS_PERMIT", std::to_string(m.permit).c_str(), 1);
    else
      ::unsetenv("DIBS_PERMIT");
    exec_args ea{a.command, {}};
    exec_or_die(ea);
  }
  ::close(go[0]);
  // Ends the child that waits for `go`: nothing runs.
  auto abandon = [&] {
    ::close(go[1]);
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
  };
  // Waits up to `d` for a signal: one meant for COMMAND ends the wait
  // (forwarded to the waiting child, it ends dibs as it would COMMAND).
  // Returns: the exit status to end with, if it ended.
  auto signalled = [&](milliseconds d) -> std::optional<int> {
    pollfd p{g.fd(), POLLIN, 0};
    if (d.count() > 0 && ::poll(&p, 1, static_cast<int>(d.count())) <= 0) return std::nullopt;
    for (int s; (s = g.next()) != 0;) {
      int st = 0;
      if (s == SIGCHLD) {
        // The waiting child was ended from outside: nothing to run, nothing to lock for.
        if (::waitpid(pid, &st, WNOHANG) == pid) return status_code(st);
        continue;
      }
      ::kill(pid, s);
      while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
      return status_code(st);
    }
    return std::nullopt;
  };
  try {
    kind.open(a.close ? 0 : pid);
    const auto taken = acquire(a, wait, kind, signalled,
                               [&](std::stop_source src) { return std::make_unique<signal_watch>(g.fd(), src); });
    if (const int* code = std::get_if<int>(&taken)) return *code;  // a signal: the child was ended with it
    if (!std::get<bool>(taken)) {
      // Silent, as flock(1), unless --verbose: cron mails whatever a skipped run prints.
      const std::string msg = a.verbose ? kind.conflict(!a.nonblock && (wait || a.retries >= 0)) : std::string{};
      abandon();
      if (a.verbose) std::cerr << msg << '\n';
      return a.conflict_code;
    }
  } catch (...) {
    abandon();
    throw;
  }
  say_took(a, started);
  say_executing(a);
  const auto token = kind.token();
  const auto permit = kind.permit();
  const go_message m{token.value_or(0), permit.value_or(0), token ? std::uint8_t{1} : std::uint8_t{0},
                     permit ? std::uint8_t{1} : std::uint8_t{0}};
  (void)::send(go[1], &m, sizeof m, MSG_NOSIGNAL);  // if the child is gone, supervise reaps it below
  ::close(go[1]);
  bool told = false;  // that the lock was lost
  const int status = supervise(g, pid, std::nullopt, [] {}, lost_read, [&] {
    char c;
    if (::read(lost_read, &c, 1) != 1) return true;
    std::cerr << fmt::format("dibs lock: lost the lock on '{}' (token {}): it was taken over or its lease ran out "
                             "unrenewed; stopping COMMAND with SIGTERM; exit {}\n",
                             a.path, token.value_or(0), ex::lock_lost);
    told = true;
    ::kill(pid, SIGTERM);
    return false;
  });
  // Lost at any time of the run counts, also when COMMAND ended before dibs
  // noticed (dibs stopped past its lease while another took the lock): the
  // hold is judged before it is given back.
  const bool lost = told || kind.lost();
  if (lost && !told)
    std::cerr << fmt::format("dibs lock: lost the lock on '{}' (token {}) while COMMAND ran: it was taken over or its "
                             "lease ran out unrenewed (was dibs stopped?); COMMAND {}; exit {}\n",
                             a.path, token.value_or(0), describe_status(status), ex::lock_lost);
  try {
    kind.unlock();
  } catch (const std::system_error& e) {
    std::cerr << "dibs lock: could not remove the lock record of '" << a.path << "': " << e.what()
              << " (it is stale now: the next taker breaks it)\n";
  }
  return lost ? ex::lock_lost : status_code(status);
}

// Kind: lease_kind (the lease lock), or permit_kind<Store> (--max N; `more`:
// --store's store).
template <class Kind = lease_kind, class... More>
int lock_lease(const lock_args& a, std::optional<milliseconds> wait, More... more) {
  // A lost lease is told to the main thread through `lost` (from the
  // library's renewal thread), so that only the thread that reaps COMMAND
  // ever signals it.
  int lost[2];
  if (::pipe2(lost, O_CLOEXEC | O_NONBLOCK) != 0) fail(ex::software, "dibs lock: pipe failed");
  Kind k{a, [fd = lost[1]] { (void)!::write(fd, "x", 1); }, more...};
  return lock_for_child(a, wait, k, lost[0]);
}

int lock_dot(const lock_args& a, std::optional<milliseconds> wait) {
  dot_kind k{a, {}};
  return lock_for_child(a, wait, k, -1);
}

// -w for a blocking flock(2), as flock(1) does it: a timer whose signal
// interrupts the call.
volatile sig_atomic_t flock_timed_out = 0;
extern "C" void on_flock_timer(int) { flock_timed_out = 1; }

// Takes flock(2) `op` on `fd` (`what`: "descriptor 9" or "'PATH'", for
// messages), waiting as -n and -w say.
// Returns: false if another holds it (-n) or the wait ran out (-w).
bool flock_fd(const lock_args& a, int fd, int op, std::optional<milliseconds> wait, const std::string& what) {
  if (a.nonblock || (wait && wait->count() == 0)) op |= LOCK_NB;
  const bool timed = wait && !(op & LOCK_NB);
  struct sigaction old_action {};
  // The clock decides too: where the handler runs late (a sanitizer defers
  // it), the flock has returned EINTR with the flag not yet set, and must
  // not be started again once the time is up.
  const auto deadline = std::chrono::steady_clock::now() + wait.value_or(milliseconds{0});
  if (timed) {
    struct sigaction sa {};
    sa.sa_handler = on_flock_timer;  // no SA_RESTART: the flock returns EINTR
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGALRM, &sa, &old_action);
    flock_timed_out = 0;
    itimerval t{};
    t.it_value.tv_sec = wait->count() / 1000;
    t.it_value.tv_usec = (wait->count() % 1000) * 1000;
    ::setitimer(ITIMER_REAL, &t, nullptr);
  }
  int e = 0;
  while (::flock(fd, op) != 0) {
    e = errno;
    if (e == EINTR && !flock_timed_out && !(timed && std::chrono::steady_clock::now() >= deadline)) continue;
    break;
  }
  if (timed) {
    itimerval off{};
    ::setitimer(ITIMER_REAL, &off, nullptr);
    ::sigaction(SIGALRM, &old_action, nullptr);
  }
  if (e == 0) return true;
  if (e == EWOULDBLOCK || e == EINTR) return false;
  // As flock(1): EX_DATAERR for a descriptor that is not open (or cannot be locked).
  fail(e == ENOLCK || e == ENOMEM ? ex::software : ex::dataerr,
       fmt::format("dibs lock: {}: {}{}", what, std::strerror(e),
                   e == EBADF ? " (open it in the calling shell first, e.g. 'exec 9>/var/lock/app; dibs lock --kernel 9')"
                              : ""));
}

// Returns: a descriptor of the lock file at `a.path` (close-on-exec), opened
// as flock(1) opens it: read-only, created if missing (0666 less the umask);
// a directory read-only, without O_CREAT. A FIFO or a socket is refused (it
// cannot be opened without waiting for a peer). Exit codes as flock(1)'s:
// 66 (EX_NOINPUT) for a path it cannot open, permission denied included;
// 73 (EX_CANTCREAT) for a read-only or full filesystem.
int open_lock_path(const lock_args& a) {
  constexpr int flags = O_RDONLY | O_NOCTTY | O_CLOEXEC | O_NONBLOCK;
  int fd;
  while ((fd = ::open(a.path.c_str(), flags | O_CREAT, 0666)) < 0 && errno == EINTR) {
  }
  if (fd < 0 && errno == EISDIR) {
    // Linux refuses O_CREAT on a directory, which flock(1) then opens read-only.
    while ((fd = ::open(a.path.c_str(), flags)) < 0 && errno == EINTR) {
    }
  }
  if (fd < 0) {
    const int e = errno;
    const int code = e == ENOMEM || e == EMFILE || e == ENFILE ? ex::software
                     : e == EROFS || e == ENOSPC               ? ex::cantcreat
                                                               : ex::noinput;
    fail(code, fmt::format("dibs lock: cannot open lock file '{}': {}{}", a.path, std::strerror(e),
                           e == EACCES ? " (may this user read it, or create it in its directory?)" : ""));
  }
  struct ::stat st {};
  if (::fstat(fd, &st) != 0 || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode)) {
    ::close(fd);
    fail(ex::dataerr, fmt::format("dibs lock: '{}' is a {}, not a lock file: give the path of a regular file (or a "
                                  "directory)",
                                  a.path, S_ISSOCK(st.st_mode) ? "socket" : "FIFO (named pipe)"));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // COMMAND inherits it as a plain descriptor
  return fd;
}

// Runs COMMAND holding the kernel lock on `lock_fd` (a descriptor COMMAND
// inherits unless -o: `inherit`, or -1). -F: dibs becomes COMMAND.
int run_kernel_command(const lock_args& a, int inherit) {
  std::vector<std::pair<std::string, std::string>> set;
  std::vector<std::string> unset{"DIBS_TOKEN", "DIBS_PERMIT"};
  if (inherit >= 0 && !a.close)
    set.emplace_back("DIBS_LOCK_FD", std::to_string(inherit));
  else
    unset.push_back("DIBS_LOCK_FD");
  exec_args ea{a.command, set, unset};
  say_executing(a);
  if (a.no_fork) exec_or_die(ea);  // the lock stays with the inherited descriptor
  signal_gate g;
  const pid_t pid = ::fork();
  if (pid < 0) fail(ex::software, "dibs lock: fork failed");
  if (pid == 0) {
    if (a.close && inherit >= 0) ::close(inherit);
    g.restore_in_child();
    exec_or_die(ea);
  }
  return status_code(supervise(g, pid, std::nullopt, [] {}, -1, [] { return false; }));
}

// The kernel lock (--kernel): flock(2), which flock(1) sees, taken as
// flock(1) takes it. As flock(1) does by default, COMMAND inherits a
// descriptor of the locked file: if dibs is killed, the lock stays with
// COMMAND (and whatever it passes the descriptor on to) until they end. When
// COMMAND ends, dibs closes its descriptors and never unlocks (flock(2)
// LOCK_UN would take the lock from COMMAND's children that still run, e.g.
// a daemon started in the background): the lock ends with the last process
// that has the descriptor. The descriptor form (FD instead of PATH) locks
// the calling shell's own descriptor, which keeps the lock after dibs ends,
// as with flock(1).
int lock_kernel(const lock_args& a, std::optional<milliseconds> wait) {
  const auto started = steady::now();
  const int op = a.unlock ? LOCK_UN : a.shared ? LOCK_SH : LOCK_EX;
  if (a.fd >= 0) {
    if (!flock_fd(a, a.fd, op, wait, fmt::format("descriptor {}", a.fd))) {
      if (a.verbose)
        std::cerr << fmt::format("{}: descriptor {} is locked by another process (a kernel lock{})\n", a.who, a.fd,
                                 !a.nonblock && wait ? ", --wait ran out" : "");
      return a.conflict_code;
    }
    say_took(a, started);
    if (a.command.empty()) return ex::ok;
    return run_kernel_command(a, a.fd);
  }
  struct closer {
    int fd;
    ~closer() {
      if (fd >= 0) ::close(fd);
    }
  };
  const closer lock{open_lock_path(a)};
  if (!flock_fd(a, lock.fd, op, wait, fmt::format("'{}'", a.path))) {
    if (a.verbose)
      std::cerr << fmt::format("{}: '{}' is locked by another process (a kernel lock{}); see who with 'fuser "
                               "-v {}'\n",
                               a.who, a.path, !a.nonblock && wait ? ", --wait ran out" : "", a.path);
    return a.conflict_code;
  }
  say_took(a, started);
  // The child gets `inherited` (unless -o); dibs's copies are closed when
  // COMMAND ends, never unlocked (above).
  const closer inherited{a.close ? -1 : ::fcntl(lock.fd, F_DUPFD, 3)};  // no FD_CLOEXEC: COMMAND keeps it
  if (!a.close && inherited.fd < 0) fail(ex::software, fmt::format("dibs lock: dup failed: {}", std::strerror(errno)));
  return run_kernel_command(a, inherited.fd);
}

// Sleeps for `d`, but a signal meant for COMMAND ends the wait (dibs retry).
// Returns: the exit status to end with (128+N, as the signal would have
// ended COMMAND), if one came.
std::optional<int> sleep_unless_signalled(std::chrono::nanoseconds d) {
  signal_gate g;
  pollfd p{g.fd(), POLLIN, 0};
  const auto until = steady::now() + d;
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(until - steady::now()).count();
    if (left <= 0) return std::nullopt;
    if (::poll(&p, 1, static_cast<int>(left) + 1) > 0) {
      const int s = g.next();
      if (s != 0 && s != SIGCHLD) return 128 + s;
    }
  }
}

// Where an option of the command has no meaning on this system: none on
// POSIX (Windows refuses the descriptor forms).
void refuse_unported(const lock_args&) {}

// The shell of 'dibs lock -c STRING', as flock(1): $SHELL, or /bin/sh.
std::vector<std::string> shell_command(const std::string& s) {
  const char* sh = std::getenv("SHELL");
  return {sh && *sh ? sh : "/bin/sh", "-c", s};
}

// Returns: true for the signals that stop dibs work (it claims nothing
// more); the others it forwards (USR1, USR2) only.
bool is_stop_signal(int s) { return s == SIGINT || s == SIGTERM || s == SIGHUP || s == SIGQUIT; }
