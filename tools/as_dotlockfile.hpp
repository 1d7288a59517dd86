// dibs started as `dotlockfile`: liblockfile's dotlockfile (1.17).
//
//   dotlockfile [-l] [-r RETRIES] [-i INTERVAL] [-p] [-q] [-N] <-m|LOCKFILE>
//   dotlockfile [-l] [-r RETRIES] [-i INTERVAL] [-p] [-q] [-P] <-m|LOCKFILE> COMMAND [ARGS...]
//   dotlockfile -u|-t|-c [-p] [-q] <-m|LOCKFILE>
//
// Options as getopt("+qpNr:mluctPi:") reads them: they end at LOCKFILE, and
// everything after it is COMMAND. Exit codes as dotlockfile's (liblockfile's
// lockfile.h): 0 done; 1 bad usage, and -u, -t, -c's "no"; 4 (L_MAXTRYS)
// the retries ran out, silently; 5 (L_ERROR) any other error (no such
// directory, no permission), said unless -q. With COMMAND: 0 once it ran
// (-P: its status; 127 if it cannot be run).
//
// -l (the default) makes LOCKFILE and leaves it. It holds what dotlockfile
// writes: "0" without -p, and with -p the pid of the caller, the shell that
// ran dotlockfile (getppid), not dibs's own: dibs has ended by the time the
// lock is used, and a lock that named it would be stale at once. With -p
// the file is dibs's record of that caller (its pid first, as liblockfile
// reads it; start time and boot after), so a dibs waiter breaks it on proof
// once the caller is gone, where dotlockfile -p believes a bare pid. A
// lock is tried -r times more (5; -1: for ever) after pauses of 5 s growing
// by 5 s to 60 s, or -i seconds each.
// With COMMAND the lock is held for COMMAND (dibs lock --dot's way: the
// record names COMMAND, with or without -p, so the lock ends with COMMAND
// even if dibs is killed), removed when it ends.
// -u removes LOCKFILE whoever made it (0 also if it was not there), -t sets
// its mtime (1 if it is not there), -c answers whether it is held: 0 if a
// dibs waiter would wait for it (dibs::dot_lock::is_held), else 1.
// Part of tools/dibs.cpp.
#pragma once

constexpr const char* dotlockfile_usage_text =
    "Usage:  dotlockfile -l [-r retries] [-i interval] [-p] [-q] <-m|lockfile>\n"
    "        dotlockfile -l [-r retries] [-i interval] [-p] [-q] <-m|lockfile> [-P] command args...\n"
    "        dotlockfile -u|-t\n";

namespace dotlockfile_code {
constexpr int usage = 1;
constexpr int max_tries = 4;  // L_MAXTRYS
constexpr int error = 5;      // L_ERROR
// What lock_for_child returns on a conflict here: no exit status can be it,
// so a COMMAND's own 4 is not taken for one.
constexpr int conflict_marker = 1000;
}  // namespace dotlockfile_code

// Returns: the lock file of the user's mailbox, as dotlockfile -m names it:
// $MAIL.lock, or /var/mail/USER.lock.
std::string dotlockfile_mailbox() {
  if (const char* mail = std::getenv("MAIL"); mail && *mail) return std::string{mail} + ".lock";
  // The user's name from /etc/passwd, not getpwuid(): dibs is linked
  // statically, where glibc's NSS would need its shared libraries.
  std::ifstream passwd{"/etc/passwd"};
  const std::string uid = std::to_string(::getuid());
  for (std::string line; std::getline(passwd, line);) {
    const auto a = line.find(':'), b = line.find(':', a + 1), c = line.find(':', b + 1);
    if (c != std::string::npos && line.compare(b + 1, c - b - 1, uid) == 0)
      return fmt::format("/var/mail/{}.lock", line.substr(0, a));
  }
  fail(dotlockfile_code::error, fmt::format("dotlockfile: -m: user {} is not in /etc/passwd; set MAIL to the mailbox "
                                            "(its lock is $MAIL.lock), or name the lock file",
                                            uid));
}

int dotlockfile_run(int argc, char** argv, bool& quiet) {
  namespace code = dotlockfile_code;
  long retries = 5;
  std::optional<long> interval;
  bool pid = false, pass_status = false, mailbox = false;
  char mode = 0;  // l, u, t or c
  const auto usage = [] {
    std::cerr << dotlockfile_usage_text;
    return code::usage;
  };
  for (int c; (c = ::getopt(argc, argv, "+qpNr:mluctPi:")) != -1;) {
    switch (c) {
      case 'q': quiet = true; break;
      case 'p': pid = true; break;
      case 'N': break;  // liblockfile's no-op
      case 'P': pass_status = true; break;
      case 'm': mailbox = true; break;
      case 'r': {
        // As dotlockfile: atoi, and only 0 or -1 below 1.
        const long n = std::strtol(::optarg, nullptr, 10);
        if (n <= 0 && n != -1 && std::string_view{::optarg} != "0")
          fail(code::error, fmt::format("dotlockfile: -r {}: invalid argument", ::optarg));
        retries = n;
        break;
      }
      case 'i': {
        char* end = nullptr;
        const long n = std::strtol(::optarg, &end, 10);
        if (end == ::optarg || *end != '\0' || n < 0) fail(code::error, "dotlockfile: -i needs argument >= 0");
        interval = n;
        break;
      }
      case 'l':
      case 'u':
      case 't':
      case 'c':
        if (mode != 0 && mode != c) return usage();
        mode = static_cast<char>(c);
        break;
      default: return usage();  // getopt has said what was wrong
    }
  }
  std::string path;
  if (mailbox) {
    path = dotlockfile_mailbox();
  } else {
    if (::optind >= argc) return usage();
    path = argv[::optind++];
  }
  std::vector<std::string> command(argv + ::optind, argv + argc);
  if (mode != 0 && mode != 'l' && !command.empty()) return usage();

  if (mode == 'c') return dibs::dot_lock::is_held(native_path(path)) ? 0 : 1;
  if (mode == 't') return ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0) == 0 ? 0 : 1;
  if (mode == 'u') {
    if (::unlink(path.c_str()) == 0 || errno == ENOENT) return 0;
    if (!quiet) std::cerr << fmt::format("dotlockfile: cannot remove '{}': {}\n", path, std::strerror(errno));
    return 1;
  }

  lock_args a;
  a.path = path;
  a.dot = true;
  a.retries = static_cast<int>(std::clamp<long>(retries, -1, INT32_MAX));
  a.conflict_code = code::conflict_marker;
  a.pause_for = [interval](int n) {
    if (interval) return milliseconds{*interval * 1000};
    return milliseconds{std::min(5 * (n + 1), 60) * 1000};  // dotlockfile's 5 s, 10 s, ... 60 s
  };
  dibs::dot_lock_options o;  // liblockfile's age rule: 5 minutes
  if (!command.empty()) {
    a.dot_options = o;
    a.command = std::move(command);
    exec_failure_code = 127;  // dotlockfile's, whatever the reason
    exec_failure_who = "dotlockfile";
    const int status = cmd_lock(a);
    if (status == code::conflict_marker) return code::max_tries;
    return pass_status ? status : 0;
  }
  o.touch = false;  // dibs ends holding it, as dotlockfile does: nothing touches it after
  if (!pid) o.content = "0\n";
  a.dot_options = o;
  std::list<left_lock> one;
  left_lock& l = one.emplace_back();
  l.args = a;
  const auto taken = take_presence(l, pid ? static_cast<dibs::process_id>(::getppid()) : 0);
  if (const int* signalled = std::get_if<int>(&taken)) return *signalled;
  if (!std::get<bool>(taken)) return code::max_tries;
  l.kind.lk->release();  // left for dotlockfile -u (or rm -f)
  return 0;
}

int as_dotlockfile(int argc, char** argv) {
  bool quiet = false;
  return as_tool("dotlockfile", quiet, [&] { return dotlockfile_run(argc, argv, quiet); },
                 [](int code) { return code == ex::usage ? dotlockfile_code::usage : dotlockfile_code::error; });
}
