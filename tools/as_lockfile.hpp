// dibs started as `lockfile`: procmail's lockfile(1) (3.22/3.23pre).
//
//   lockfile [-SLEEPTIME] [-r RETRIES] [-l LOCKTIMEOUT] [-s SUSPEND] [-!] FILENAME...
//
// Options and files are read left to right, each when it comes, so an
// option changes only the files after it; values attached (-r0) or apart
// (-r 0). Each file is made as lockfile(1) makes it, with O_EXCL meaning
// (dibs::dot_lock: link() of a whole temporary file), read-only, holding
// "0", and left behind: the script removes it with rm -f. A file that is
// there is tried again every SLEEPTIME seconds (8), RETRIES times (-1:
// for ever), the retries used up across the files. Exit 0 once every file
// is made; 73 (EX_CANTCREAT) when the retries ran out ("Sorry, giving up"),
// after removing the files made before it; -! swaps those two (not the
// others); 69 (EX_UNAVAILABLE) for a file that cannot be made at all (no
// such directory, no permission: "Try praying"); 64 bad usage.
//
// -l LOCKTIMEOUT: a lock file older than that (by its mtime) is broken,
// but by dot_lock's rename-and-check, which never removes a lock made
// after the judgement: so -s SUSPEND, lockfile(1)'s pause after forcing a
// lock, has nothing left to guard and is accepted and not slept; nor is
// "Forcing lock" said. A live `dibs lock --dot` holder touches its file and
// is never forced. -ml and -mu (the user's system mailbox) are refused:
// they need lockfile(1)'s setgid privileges. Part of tools/dibs.cpp.
#pragma once

constexpr const char* lockfile_usage_text =
    "Usage: lockfile -v | -nnn | -r nnn | -l nnn | -s nnn | -! | -ml | -mu | file ...\n";

// The lock file lockfile(1) makes: "0", read-only (so only rm -f removes
// it), never stale unless -l says so.
dibs::dot_lock_options lockfile_options(std::optional<long> timeout_s) {
  dibs::dot_lock_options o;
  o.content = "0";
  o.mode = 0444;
  o.touch = false;  // dibs ends holding it, as lockfile(1) does: nothing touches it after
  // No -l: for ever, as lockfile(1) keeps a lock; a century is that, and
  // still fits a steady nanosecond count.
  o.stale_after = timeout_s ? milliseconds{*timeout_s * 1000} : milliseconds{std::chrono::hours{24 * 365 * 100}};
  return o;
}

int lockfile_run(int argc, char** argv) {
  constexpr int cantcreat = ex::cantcreat;  // 73: the retries ran out
  constexpr int praying = ex::unavailable;  // 69: the file cannot be made at all
  milliseconds sleep{8000};
  long retries = -1;
  std::optional<long> timeout;
  bool invert = false;
  bool any_file = false;
  std::list<left_lock> made;
  // Removes the files made so far (a later one failed, or a signal came).
  const auto remove_made = [&] {
    for (auto& l : made)
      if (l.kind.lk) l.kind.lk->unlock();
  };
  // A signal is taken during a pause, ending it: the files made are then
  // removed before dibs ends, as lockfile(1) removes its own.
  block_forwarded();
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg{argv[i]};
    if (arg.size() > 1 && arg[0] == '-') {
      const char o = arg[1];
      if (o == 'r' || o == 'l' || o == 's') {
        const char* value = arg.size() > 2 ? argv[i] + 2 : i + 1 < argc ? argv[++i] : nullptr;
        char* end = nullptr;
        const long n = value ? std::strtol(value, &end, 10) : 0;
        if (!value || end == value || *end != '\0') {
          remove_made();
          std::cerr << lockfile_usage_text;
          return ex::usage;
        }
        if (o == 'r') retries = n < 0 ? -1 : n;
        if (o == 'l') timeout = n > 0 ? std::optional<long>{n} : std::nullopt;
        continue;  // -s: see the top of this file
      }
      if (arg == "-!") {
        invert = !invert;
        continue;
      }
      if (arg.find_first_not_of("0123456789", 1) == std::string_view::npos) {
        sleep = milliseconds{std::strtol(argv[i] + 1, nullptr, 10) * 1000};
        continue;
      }
      remove_made();
      if (arg == "-ml" || arg == "-mu")
        fail(praying, fmt::format("lockfile: {}: the system mailbox's lock needs procmail's setgid lockfile; dibs "
                                  "does not lock it: run procmail's lockfile {} (or name the lock file: lockfile "
                                  "\"$MAIL.lock\" where the spool is writable)",
                                  arg, arg));
      if (arg == "-v") {
        std::cerr << fmt::format("lockfile from dibs {}.{}.{} (procmail lockfile(1)'s command line)\n",
                                 DIBS_VERSION_MAJOR, DIBS_VERSION_MINOR, DIBS_VERSION_PATCH);
        return ex::usage;  // as lockfile(1) -v
      }
      std::cerr << lockfile_usage_text;
      return ex::usage;
    }
    any_file = true;
    auto& l = made.emplace_back();
    l.args.path = std::string{arg};
    l.args.dot = true;
    l.args.retries = static_cast<int>(std::min<long>(retries, INT32_MAX));
    l.args.dot_options = lockfile_options(timeout);
    long pauses = 0;
    l.args.pause_for = [&pauses, sleep](int) {
      ++pauses;
      return sleep;
    };
    std::variant<bool, int> taken;
    try {
      taken = take_presence(l, 0);
    } catch (...) {
      remove_made();
      try {
        throw;
      } catch (const failure& f) {
        std::cerr << fmt::format("lockfile: Try praying, giving up on \"{}\" ({})\n", arg, f.msg);
      } catch (const std::system_error& e) {
        std::cerr << fmt::format("lockfile: Try praying, giving up on \"{}\" ({})\n", arg, e.what());
      }
      return praying;
    }
    if (const int* signalled = std::get_if<int>(&taken)) {
      remove_made();
      return *signalled;
    }
    if (!std::get<bool>(taken)) {
      std::cerr << fmt::format("lockfile: Sorry, giving up on \"{}\"\n", arg);
      remove_made();
      return invert ? ex::ok : cantcreat;
    }
    if (retries > 0) retries = std::max(0L, retries - pauses);  // used up, not reset per file
  }
  if (!any_file) {
    std::cerr << lockfile_usage_text;
    return ex::usage;
  }
  for (auto& l : made) l.kind.lk->release();  // left for the script's rm -f
  return invert ? cantcreat : ex::ok;
}

int as_lockfile(int argc, char** argv) {
  const bool quiet = false;
  return as_tool("lockfile", quiet, [&] { return lockfile_run(argc, argv); },
                 [](int code) { return code == ex::usage ? ex::usage : ex::unavailable; });
}
