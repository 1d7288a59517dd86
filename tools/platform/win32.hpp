// dibs.cpp's system calls on Windows (dibs.exe): the twin of
// platform/posix.hpp, with the same functions. Part of tools/dibs.cpp,
// included inside its namespace after the definitions it uses (lock_args,
// lease_kind, dot_kind). docs/windows.md says what differs from Linux:
//
// - COMMAND is started with CreateProcessW, in dibs's console, with dibs's
//   standard handles; its command line is quoted so that the C runtime's
//   parser (CommandLineToArgvW, MSVC's rules) gives COMMAND its arguments
//   exactly as dibs got them. dibs returns COMMAND's exit code.
// - Ctrl+C and Ctrl+Break go to every process of the console, COMMAND
//   included: dibs ignores them while COMMAND runs (it waits for COMMAND's
//   end, then releases the lock); while dibs waits for a lock or sleeps
//   between retries, they end dibs with 130 (Ctrl+Break: 149), as SIGINT
//   would end it on Linux.
// - The locks are held by dibs itself (Windows has no fork: COMMAND cannot
//   be started before its token is known and then told it), and COMMAND
//   runs in a job object that ends it when dibs ends (a kill-on-close job):
//   if dibs is killed, COMMAND is killed too, so that it never runs on
//   without the lock. -o leaves COMMAND out of the job, as on Linux it
//   leaves COMMAND without the lock.
#pragma once

// ---------------------------------------------------------------------------
// Text: dibs keeps UTF-8; Windows takes UTF-16.

std::wstring widen(std::string_view s) {
  if (s.empty()) return {};
  const int n = ::MultiByteToWideChar(CP_UTF8, 0, s.data(), static_cast<int>(s.size()), nullptr, 0);
  std::wstring w(static_cast<std::size_t>(n), L'\0');
  ::MultiByteToWideChar(CP_UTF8, 0, s.data(), static_cast<int>(s.size()), w.data(), n);
  return w;
}

std::string narrow(std::wstring_view w) {
  if (w.empty()) return {};
  const int n = ::WideCharToMultiByte(CP_UTF8, 0, w.data(), static_cast<int>(w.size()), nullptr, 0, nullptr, nullptr);
  std::string s(static_cast<std::size_t>(n), '\0');
  ::WideCharToMultiByte(CP_UTF8, 0, w.data(), static_cast<int>(w.size()), s.data(), n, nullptr, nullptr);
  return s;
}

// Returns: dibs's arguments as UTF-8 (main's argv is in the ANSI code page,
// which cannot hold every file name or argument).
std::vector<std::string> utf8_arguments() {
  int n = 0;
  wchar_t** w = ::CommandLineToArgvW(::GetCommandLineW(), &n);
  std::vector<std::string> out;
  for (int i = 0; w && i < n; ++i) out.push_back(narrow(w[i]));
  if (w) ::LocalFree(w);
  return out;
}

// ---------------------------------------------------------------------------
// Ctrl+C and Ctrl+Break.

HANDLE console_interrupt = nullptr;  // set by the handler; manual reset
volatile LONG console_interrupt_code = 130;

BOOL WINAPI on_console_ctrl(DWORD type) {
  if (type != CTRL_C_EVENT && type != CTRL_BREAK_EVENT) return FALSE;  // close, logoff, shutdown: end dibs
  ::InterlockedExchange(&console_interrupt_code, type == CTRL_C_EVENT ? 128 + 2 : 128 + 21);
  ::SetEvent(console_interrupt);
  return TRUE;  // dibs lives on: it waits for COMMAND, which got the event itself
}

// Installs the handler (once) and forgets an interrupt that came before:
// call it where a wait that Ctrl+C ends begins.
HANDLE arm_interrupt() {
  if (!console_interrupt) {
    console_interrupt = ::CreateEventW(nullptr, TRUE, FALSE, nullptr);
    if (!console_interrupt || !::SetConsoleCtrlHandler(on_console_ctrl, TRUE))
      fail(ex::software, fmt::format("dibs: cannot handle Ctrl+C: {}", std::system_category().message(static_cast<int>(::GetLastError()))));
  }
  ::ResetEvent(console_interrupt);
  return console_interrupt;
}

bool interrupted() { return console_interrupt && ::WaitForSingleObject(console_interrupt, 0) == WAIT_OBJECT_0; }

// Nothing to block: Windows has no signals to keep from the library's threads.
void block_forwarded() {}

// ---------------------------------------------------------------------------
// Starting COMMAND.

// Returns: `arg` quoted for the C runtime's parser (CommandLineToArgvW and
// MSVC's rules): backslashes are literal unless they come before a quote;
// 2n backslashes and a quote are n backslashes and the end of a quoted
// part, 2n+1 and a quote are n backslashes and a quote.
std::wstring quote_argument(std::wstring_view arg) {
  if (!arg.empty() && arg.find_first_of(L" \t\n\v\"") == std::wstring_view::npos) return std::wstring(arg);
  std::wstring out = L"\"";
  for (std::size_t i = 0;; ++i) {
    std::size_t slashes = 0;
    while (i < arg.size() && arg[i] == L'\\') ++slashes, ++i;
    if (i == arg.size()) {
      out.append(slashes * 2, L'\\');  // before the closing quote
      break;
    }
    if (arg[i] == L'"') {
      out.append(slashes * 2 + 1, L'\\');
      out += L'"';
    } else {
      out.append(slashes, L'\\');
      out += arg[i];
    }
  }
  return out + L"\"";
}

// COMMAND as CreateProcessW takes it: a command line and an environment.
struct exec_args {
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> set;
  std::vector<std::string> unset;
  bool raw = false;  // the arguments after the program are one line for cmd.exe (-c STRING), not quoted
  exec_args(const std::vector<std::string>& cmd, const std::vector<std::pair<std::string, std::string>>& s,
            const std::vector<std::string>& u = {})
      : argv(cmd), set(s), unset(u) {}

  std::wstring command_line() const {
    // The program's name is parsed by other rules (no escapes: a quote only
    // starts or ends a quoted part), and a Windows file name has no quote.
    const std::wstring program = widen(argv[0]);
    std::wstring line = program.empty() || program.find_first_of(L" \t") != std::wstring::npos ? L"\"" + program + L"\"" : program;
    for (std::size_t i = 1; i < argv.size(); ++i) line += L" " + (raw ? widen(argv[i]) : quote_argument(widen(argv[i])));
    return line;
  }

  // Returns: the environment block, or an empty one for dibs's own.
  std::wstring environment() const {
    if (set.empty() && unset.empty()) return {};
    auto name_of = [](std::wstring_view kv) { return kv.substr(0, kv.find(L'=', 1)); };  // "=C:=C:\x" is named "=C:"
    auto same = [](std::wstring_view x, std::wstring_view y) {  // names are compared without case
      return ::CompareStringOrdinal(x.data(), static_cast<int>(x.size()), y.data(), static_cast<int>(y.size()), TRUE) == CSTR_EQUAL;
    };
    std::vector<std::wstring> vars;
    if (wchar_t* block = ::GetEnvironmentStringsW()) {
      for (const wchar_t* p = block; *p; p += std::wcslen(p) + 1) {
        const std::wstring_view kv{p};
        bool drop = false;
        for (const auto& [k, v] : set) drop = drop || same(name_of(kv), widen(k));
        for (const auto& k : unset) drop = drop || same(name_of(kv), widen(k));
        if (!drop) vars.emplace_back(kv);
      }
      ::FreeEnvironmentStringsW(block);
    }
    for (const auto& [k, v] : set) vars.push_back(widen(k + "=" + v));
    // Windows keeps the block sorted by name, without case.
    std::stable_sort(vars.begin(), vars.end(), [&](const std::wstring& x, const std::wstring& y) {
      const auto a = name_of(x), b = name_of(y);
      return ::CompareStringOrdinal(a.data(), static_cast<int>(a.size()), b.data(), static_cast<int>(b.size()), TRUE) == CSTR_LESS_THAN;
    });
    std::wstring out;
    for (const auto& v : vars) out += v + L'\0';
    return out + L'\0';
  }
};

// A started COMMAND: its process, and the job that ends it with dibs.
struct child_process {
  HANDLE process = nullptr;
  HANDLE job = nullptr;
  child_process() = default;
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;
  ~child_process() {
    if (process) ::CloseHandle(process);
    if (job) ::CloseHandle(job);  // COMMAND has ended by now: closing the job ends nothing
  }
};

// Starts COMMAND; `stop_with_dibs`: in a job that ends it if dibs ends
// first. Returns: the exit code to end with if it cannot be started (126,
// 127; said on standard error), else 0.
int start_command(const exec_args& a, bool stop_with_dibs, child_process& c) {
  const std::string& program = a.argv[0];
  auto ends_with = [&](std::string_view suffix) {
    return program.size() >= suffix.size() &&
           std::equal(suffix.rbegin(), suffix.rend(), program.rbegin(), [](char x, char y) { return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y)); });
  };
  if (!a.raw && (ends_with(".bat") || ends_with(".cmd"))) {
    // CreateProcessW would run it through cmd.exe, which reads its
    // arguments by rules of its own: they would not arrive as given.
    std::cerr << fmt::format("dibs: cannot run '{}' directly: a batch file's arguments are read by cmd.exe, not as "
                             "given; write -c \"{} ARGS...\" (dibs lock), or cmd /d /c {} ARGS... as COMMAND\n",
                             program, program, program);
    return ex::cannot_exec;
  }
  std::wstring line = a.command_line();
  std::wstring env = a.environment();
  // COMMAND gets dibs's standard handles (redirected or the console) and
  // no other handle: dibs opens its files without inheritance.
  STARTUPINFOW si{};
  si.cb = sizeof si;
  si.dwFlags = STARTF_USESTDHANDLES;
  si.hStdInput = ::GetStdHandle(STD_INPUT_HANDLE);
  si.hStdOutput = ::GetStdHandle(STD_OUTPUT_HANDLE);
  si.hStdError = ::GetStdHandle(STD_ERROR_HANDLE);
  for (HANDLE h : {si.hStdInput, si.hStdOutput, si.hStdError})
    if (h && h != INVALID_HANDLE_VALUE) ::SetHandleInformation(h, HANDLE_FLAG_INHERIT, HANDLE_FLAG_INHERIT);
  if (stop_with_dibs) {
    c.job = ::CreateJobObjectW(nullptr, nullptr);
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION limits{};
    limits.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE;
    if (c.job && !::SetInformationJobObject(c.job, JobObjectExtendedLimitInformation, &limits, sizeof limits)) {
      ::CloseHandle(c.job);
      c.job = nullptr;
    }
  }
  PROCESS_INFORMATION pi{};
  const DWORD flags = CREATE_UNICODE_ENVIRONMENT | (c.job ? CREATE_SUSPENDED : 0);
  std::cout.flush();
  if (!::CreateProcessW(nullptr, line.data(), nullptr, nullptr, TRUE, flags, env.empty() ? nullptr : env.data(), nullptr,
                        &si, &pi)) {
    const DWORD e = ::GetLastError();
    const bool missing = e == ERROR_FILE_NOT_FOUND || e == ERROR_PATH_NOT_FOUND || e == ERROR_INVALID_NAME;
    const char* hint = !missing ? ""
                       : program.starts_with("-") ? " (options of dibs go before its PATH, STORE or TARGET: from there on "
                                                    "every argument is data, and COMMAND begins after them)"
                                                  : " (is it on PATH?)";
    std::cerr << fmt::format("dibs: cannot run '{}': {}{}\n", program, std::system_category().message(static_cast<int>(e)), hint);
    return missing ? ex::not_found : ex::cannot_exec;
  }
  // A job that cannot be joined (an older Windows whose job of dibs
  // forbids nesting) leaves COMMAND as a plain child: it then outlives a
  // killed dibs, as on Linux.
  if (c.job && !::AssignProcessToJobObject(c.job, pi.hProcess)) {
    ::CloseHandle(c.job);
    c.job = nullptr;
  }
  if (flags & CREATE_SUSPENDED) ::ResumeThread(pi.hThread);
  ::CloseHandle(pi.hThread);
  c.process = pi.hProcess;
  return 0;
}

// Waits for COMMAND's end; if `lost` is set first, calls `on_lost` (once).
// Returns: its exit code.
template <class OnLost>
int wait_command(const child_process& c, HANDLE lost, OnLost&& on_lost) {
  for (;;) {
    const HANDLE hs[2] = {c.process, lost};
    const DWORD r = ::WaitForMultipleObjects(lost ? 2 : 1, hs, FALSE, INFINITE);
    if (r == WAIT_OBJECT_0 + 1) {
      on_lost();
      lost = nullptr;
      continue;
    }
    if (r != WAIT_OBJECT_0) fail(ex::software, "dibs: WaitForMultipleObjects failed");
    DWORD code = 0;
    ::GetExitCodeProcess(c.process, &code);
    return static_cast<int>(code);
  }
}

// Runs COMMAND to its end (Ctrl+C reaches it through the console).
// `stop_with_dibs`: it is ended if dibs ends first.
int run_command(exec_args& a, bool stop_with_dibs) {
  arm_interrupt();  // dibs outlives a Ctrl+C, to see COMMAND's end
  child_process c;
  if (const int code = start_command(a, stop_with_dibs, c)) return code;
  return wait_command(c, nullptr, [] {});
}

// Many COMMANDs at once (dibs work): not built on Windows yet. The same
// interface as on POSIX, so that dibs.cpp's claim logic compiles here too;
// a port starts each COMMAND with start_command in a job of its own and
// waits on their process handles and console_interrupt together.
class command_pool {
public:
  using id = int;
  struct ending {
    id who;
    int code;
  };
  struct events {
    std::vector<ending> ended;
    std::vector<int> signals;
  };
  command_pool() {
    fail(ex::unavailable, "dibs work: not built on Windows yet (it runs its COMMANDs from one loop that waits for "
                          "their ends and for signals, which dibs has on POSIX only); run one item at a time with "
                          "'dibs claim --next PREFIX STORE -- COMMAND' in a loop instead");
  }
  id start(exec_args&) { return 0; }
  std::size_t running() const { return 0; }
  events wait(std::optional<milliseconds>) { return {}; }
};

// dibs work asks this before it claims anything; on Windows command_pool
// refuses first.
std::pair<int, std::string> check_runnable(const std::string&) { return {0, ""}; }
bool is_stop_signal(int) { return false; }

// Sleeps for `d` (dibs retry). Returns: 130 (149) if Ctrl+C (Ctrl+Break)
// came meanwhile, as SIGINT ends the sleep on Linux.
std::optional<int> sleep_unless_signalled(std::chrono::nanoseconds d) {
  const HANDLE stop = arm_interrupt();
  const auto ms = std::chrono::ceil<milliseconds>(d).count();
  if (::WaitForSingleObject(stop, static_cast<DWORD>(std::max<long long>(ms, 0))) == WAIT_OBJECT_0)
    return static_cast<int>(console_interrupt_code);
  return std::nullopt;
}

// Waits up to `d` unless Ctrl+C comes. Returns: true if it came.
bool interrupted_within(milliseconds d) {
  return ::WaitForSingleObject(console_interrupt, static_cast<DWORD>(std::max<long long>(d.count(), 1))) == WAIT_OBJECT_0;
}

// ---------------------------------------------------------------------------
// dibs lock

// Refuses what has no meaning on Windows: a descriptor of the calling
// shell (--fd, the descriptor form, -u) and dibs becoming COMMAND (-F).
void refuse_unported(const lock_args& a) {
  if (a.fd >= 0)
    fail(ex::usage, fmt::format("dibs lock: a descriptor ({}) of the calling shell cannot be locked on Windows (a "
                                "process does not pass its locks to another); give a PATH and a COMMAND: dibs lock "
                                "--kernel PATH -- COMMAND",
                                a.fd));
  if (a.unlock)
    fail(ex::usage, "dibs lock: -u unlocks a descriptor of the calling shell, which Windows does not have; the lock of "
                    "'dibs lock PATH -- COMMAND' ends with COMMAND");
  if (a.no_fork)
    fail(ex::usage, "dibs lock: -F (no fork): Windows cannot replace dibs with COMMAND; drop -F (dibs waits for COMMAND "
                    "and returns its exit code)");
}

// The shell of 'dibs lock -c STRING': cmd.exe (%ComSpec%), given STRING
// as cmd.exe reads its own command line (/s: the outer quotes go, the rest
// is read as typed).
std::vector<std::string> shell_command(const std::string& s) {
  const wchar_t* spec = ::_wgetenv(L"ComSpec");
  return {spec && *spec ? narrow(spec) : std::string{"cmd.exe"}, "/d", "/s", "/c", "\"" + s + "\""};
}

// While it lives, a thread that requests a stop through `src` when Ctrl+C
// (Ctrl+Break) comes, so that a lock's one long wait can be cancelled.
class interrupt_watch {
public:
  explicit interrupt_watch(std::stop_source src) {
    done_ = ::CreateEventW(nullptr, TRUE, FALSE, nullptr);
    if (!done_) fail(ex::software, "dibs lock: CreateEventW failed");
    thread_ = std::thread([src, done = done_]() mutable {
      const HANDLE hs[2] = {console_interrupt, done};
      if (::WaitForMultipleObjects(2, hs, FALSE, INFINITE) == WAIT_OBJECT_0) src.request_stop();
    });
  }
  ~interrupt_watch() {
    ::SetEvent(done_);
    thread_.join();
    ::CloseHandle(done_);
  }
  interrupt_watch(const interrupt_watch&) = delete;
  interrupt_watch& operator=(const interrupt_watch&) = delete;

private:
  HANDLE done_ = nullptr;
  std::thread thread_;
};

// Runs COMMAND holding `kind` (the lease lock or the presence lock), held
// by dibs: see the top of this file.
template <class Kind>
int lock_and_run(const lock_args& a, std::optional<milliseconds> wait, Kind& kind, HANDLE lost) {
  const auto started = steady::now();
  arm_interrupt();
  kind.open(0);
  const auto taken = acquire(
      a, wait, kind,
      [](milliseconds d) -> std::optional<int> {
        if (d.count() == 0 ? interrupted() : interrupted_within(d)) return static_cast<int>(console_interrupt_code);
        return std::nullopt;
      },
      [](std::stop_source src) { return std::make_unique<interrupt_watch>(src); });
  if (const int* code = std::get_if<int>(&taken)) return *code;  // Ctrl+C while waiting
  const bool got = std::get<bool>(taken);
  if (!got) {
    // Silent, as flock(1), unless --verbose.
    if (a.verbose) std::cerr << kind.conflict(!a.nonblock && (wait || a.retries >= 0)) << '\n';
    return a.conflict_code;
  }
  say_took(a, started);
  say_executing(a);
  const auto token = kind.token();
  std::vector<std::pair<std::string, std::string>> set;
  std::vector<std::string> unset{"DIBS_LOCK_FD"};
  if (token)
    set.emplace_back("DIBS_TOKEN", std::to_string(*token));
  else
    unset.emplace_back("DIBS_TOKEN");
  if (const auto permit = kind.permit())
    set.emplace_back("DIBS_PERMIT", std::to_string(*permit));
  else
    unset.emplace_back("DIBS_PERMIT");
  exec_args ea{a.command, set, unset};
  ea.raw = a.shell;
  int code = 0;
  bool told = false;  // that the lock was lost
  {
    child_process c;
    code = start_command(ea, !a.close, c);
    if (code == 0)
      code = wait_command(c, lost, [&] {
        std::cerr << fmt::format("dibs lock: lost the lock on '{}' (token {}): it was taken over or its lease ran out "
                                 "unrenewed; ending COMMAND; exit {}\n",
                                 a.path, token.value_or(0), ex::lock_lost);
        told = true;
        ::TerminateProcess(c.process, 128 + 15);
      });
  }
  // Lost at any time of the run counts, also when COMMAND ended before dibs
  // noticed: the hold is judged before it is given back.
  const bool was_lost = told || kind.lost();
  if (was_lost && !told)
    std::cerr << fmt::format("dibs lock: lost the lock on '{}' (token {}) while COMMAND ran: it was taken over or its "
                             "lease ran out unrenewed; COMMAND exited {}; exit {}\n",
                             a.path, token.value_or(0), code, ex::lock_lost);
  try {
    kind.unlock();
  } catch (const std::system_error& e) {
    std::cerr << "dibs lock: could not remove the lock record of '" << a.path << "': " << e.what()
              << " (it is stale now: the next taker breaks it)\n";
  }
  return was_lost ? ex::lock_lost : code;
}

// Kind: lease_kind (the lease lock), or permit_kind<Store> (--max N; `more`:
// --store's store).
template <class Kind = lease_kind, class... More>
int lock_lease(const lock_args& a, std::optional<milliseconds> wait, More... more) {
  // A lost lease is told to the waiting thread through an event (set from
  // the library's renewal thread), so that only that thread ends COMMAND.
  const HANDLE lost = ::CreateEventW(nullptr, TRUE, FALSE, nullptr);
  if (!lost) fail(ex::software, "dibs lock: CreateEventW failed");
  struct closer {
    HANDLE h;
    ~closer() { ::CloseHandle(h); }
  } close_lost{lost};
  Kind k{a, [lost] { ::SetEvent(lost); }, more...};
  return lock_and_run(a, wait, k, lost);
}

int lock_dot(const lock_args& a, std::optional<milliseconds> wait) {
  dot_kind k{a, {}};
  return lock_and_run(a, wait, k, nullptr);
}

// The kernel lock (--kernel): LockFileEx over the whole file, as
// dibs::file_mutex takes it (Boost.Interprocess's file_lock meets it).
// Held by dibs while COMMAND runs: a process's byte-range locks are its own
// (COMMAND does not inherit them), so no DIBS_LOCK_FD.
int lock_kernel(const lock_args& a, std::optional<milliseconds> wait) {
  const auto started = steady::now();
  arm_interrupt();
  dibs::file_mutex m{native_path(a.path)};
  auto try_for = [&](milliseconds d) {
    return a.shared ? (d.count() == 0 ? m.try_lock_shared() : m.try_lock_shared_for(d))
                    : (d.count() == 0 ? m.try_lock() : m.try_lock_for(d));
  };
  bool got = false;
  if (a.nonblock || (wait && wait->count() == 0)) {
    got = try_for(milliseconds{0});
  } else {
    const auto until = wait ? steady::now() + *wait : steady::time_point::max();
    while (!got) {
      const auto left = std::chrono::duration_cast<milliseconds>(until - steady::now());
      if (left <= milliseconds{0}) break;
      got = try_for(std::clamp(left, milliseconds{1}, milliseconds{100}));  // slices: Ctrl+C ends the wait
      if (!got && interrupted()) return static_cast<int>(console_interrupt_code);
    }
  }
  if (!got) {
    if (a.verbose)
      std::cerr << fmt::format("dibs lock: '{}' is locked by another process (a kernel lock{}); Resource Monitor or "
                               "Sysinternals' handle.exe tell which\n",
                               a.path, !a.nonblock && wait ? ", --wait ran out" : "");
    return a.conflict_code;
  }
  say_took(a, started);
  say_executing(a);
  exec_args ea{a.command, {}, {"DIBS_TOKEN", "DIBS_PERMIT", "DIBS_LOCK_FD"}};
  ea.raw = a.shell;
  int code = 0;
  {
    child_process c;
    code = start_command(ea, !a.close, c);
    if (code == 0) code = wait_command(c, nullptr, [] {});
  }
  a.shared ? m.unlock_shared() : m.unlock();
  return code;
}
