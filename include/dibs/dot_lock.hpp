// dibs/dot_lock.hpp: a lock that is held exactly while its file exists, the
// way O_EXCL, dotlockfile(1), lockfile(1) and `set -o noclobber` scripts lock,
// so dibs programs and those old jobs exclude each other while a fleet moves
// over (docs/migration.md).
//
//   dibs::dot_lock lock{"/var/mail/alice.lock"};
//   std::scoped_lock hold{lock};     // dotlockfile -p, procmail and a noclobber loop see it as held
//
// The file, the first line of which is the pid (what liblockfile writes and
// reads with atoi(), so `dotlockfile -p` sees a live holder), then dibs's
// own lines, so a dibs waiter can apply the proof rule of detail/owner.hpp:
//
//   48121
//   dibs-dot-lock 1
//   host build-7
//   boot 3f1c…
//   pid 48121
//   start 9132245
//   pid_ns 4026531836
//   time_ns 4026531834
//   lease_ms 300000           (the holder's stale_after)
//
// Acquire: the whole record is written to a temporary file beside the lock,
// which is then link()ed to the lock's name: link fails with EEXIST if any
// file is there, so creation is atomic and no one ever sees a half-written
// lock (liblockfile's method, also safe on NFS). A symbolic link at the path
// is a lock file of nobody's and an error naming the path, never followed.
//
// Judging a lock that is there (a waiter): a dibs record is stale if its
// holder is provably gone (detail::provably_dead), or if its file's mtime is
// older than stale_after. Anything else (an empty or touched file, a bare pid
// of dotlockfile or of a shell, "0" of `dotlockfile` without -p) is a foreign
// lock that is held: a bare pid has no boot id and no PID namespace, so it
// proves nothing; such a lock is stale only by age. The age is the one place
// dibs compares a wall clock: the other tools keep no lease a waiter could
// watch change, only the file's mtime (liblockfile breaks a lock without a
// live pid after 5 minutes the same way), and mtime is a wall-clock stamp. A
// holder refreshes the mtime about every third of stale_after
// (dot_lock_options::touch, like `dotlockfile -t`), so a live dibs holder is
// never judged by age, by dibs or by dotlockfile without -p.
//
// A file this user may not read (another user's mode 0600 lock, from a job
// under umask 077) is held, and never broken by us whatever its age: breaking
// needs proof, and the flock and checks below need the file open. It is
// waited for, as `dotlockfile -p` waits, and try_lock_for returns false if it
// stays. So is a stale lock this user may not move away (another user's, in a
// sticky directory such as /tmp). ENOENT and ESTALE (NFS: another client
// removed it) mean the file went away: look again. The directory is another
// matter: one this user may not write in is an error at once, naming it, as
// no lock can ever be created there.
//
// Breaking a stale lock is never unlink-then-create, which can delete a lock
// that was created after the judgement. The waiter
//   1. keeps open the file it judged, and takes a flock on it (LOCK_NB: a
//      dibs holder's unlock and other dibs breakers take the same flock, so
//      among dibs processes exactly one acts on a judged file);
//   2. under the flock, checks that the path still names that inode and that
//      its mtime and size are the judged ones (a touch means a live holder);
//   3. rename()s the path to `<path>.broken.<pid>.<random>`, atomically;
//   4. checks that the file it moved is the judged inode (lstat of the new
//      name against the open file). If so, it unlinks it and links its own
//      lock. If not (a foreign tool removed the judged file and another
//      process created a fresh lock between steps 2 and 3), it moves the
//      file back with renameat2(RENAME_NOREPLACE), which never clobbers.
// The remaining window, with foreign tools only: in step 4's misfortune, a
// third process can create a lock in the microseconds between the rename and
// the move back; the move back then fails, the moved file stays at its
// `.broken.` name for a person to see, and two processes hold the lock. It
// needs a foreign job that removes or breaks the judged lock and two other
// lockers within those microseconds; dibs processes alone never meet it.
//
// unlock() removes the file only if the path still names the inode this
// object linked (checked under the same flock), so it never removes a lock
// that a breaker moved away and someone else created meanwhile.
//
// No fencing token: the lock's whole state is a file that other tools create
// and delete, so there is no number that grows from holder to holder (the
// inode number is reused). Where a token is needed, use dibs::lock_file.
//
// fork(): a child inherits a copy of a held dot_lock, but the hold stays the
// parent's: the child's unlock() and destructor never remove the file.
//
// Holding for another process (dot_lock_options::on_behalf_of): the record
// names that process (first line and owner lines), so waiters break the lock
// on proof once it is gone, not once this object's process is; this object
// still creates, touches and removes the file.
//
// The system calls are each platform's (detail/posix/dot_file.hpp,
// detail/win32/dot_file.hpp, one interface); this header holds the policy
// once. On Windows (docs/windows.md):
//   - the lock file is made with CreateFileW(CREATE_NEW), then the record is
//     written and flushed; a waiter may read it empty or cut short, which it
//     judges as foreign (held until older than stale_after): the identity
//     lines come before lease_ms, so a cut record never parses into a proof;
//   - the holder keeps its handle open, sharing reads and deletes but not
//     writes, so a batch file's `echo %COMPUTERNAME% > job.lck` over a held
//     lock fails instead of overwriting the record;
//   - steps 1 to 4 are the same, with LockFileEx on one byte far past the
//     end for the flock, MoveFileExW without MOVEFILE_REPLACE_EXISTING for
//     the rename and the move back;
//   - unlock() deletes through its own handle (FileDispositionInfo) after
//     checking that the path names its file, so it never deletes another;
//   - there is no temporary file, no fork, and `mode` is ignored.
#pragma once

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <optional>
#include <random>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/detail/cancel.hpp>
#include <dibs/detail/owner.hpp>
#include <dibs/detail/renewal_keeper.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/detail/timed_lockable.hpp>
#include <dibs/error.hpp>
#include <dibs/lock_holder.hpp>

#ifdef _WIN32
#include <dibs/detail/win32/dot_file.hpp>
#else
#include <dibs/detail/posix/dot_file.hpp>
#endif


namespace dibs {

struct dot_lock_options {
  /// A lock file whose mtime is older than this is stale (a dibs record is
  /// also stale at once when its holder is provably gone). Keep it well above
  /// the longest pause of a holder; 5 minutes is liblockfile's rule.
  std::chrono::milliseconds stale_after{std::chrono::minutes{5}};
  /// Refresh the lock file's mtime about every third of stale_after while it
  /// is held (one renewal thread per process, shared with lease_mutex).
  /// Without it, a hold longer than stale_after is broken by the next waiter.
  bool touch = true;
  /// Permissions of the lock file, exactly (the umask does not narrow them).
  /// Ignored on Windows: a new file gets the security its directory passes on.
  detail::file_mode mode = 0644;
  /// Waiting between tries; a removal of the lock file does not wake a waiter
  /// early, so the cap bounds the handoff delay.
  exponential_backoff wait{std::chrono::microseconds{500}, 2.0, std::chrono::milliseconds{50}, jitter::full};
  /// The process the lock is held for; 0: this process. Its pid (first
  /// line) and identity go into the record instead of this process's, while
  /// this object takes, touches and removes the lock as usual: a launcher
  /// (dibs lock --dot) holds it for a COMMAND it forked, so the lock outlives
  /// the launcher exactly as long as the COMMAND runs. Requires: a live
  /// process of this host and PID namespace (a child not yet reaped).
  process_id on_behalf_of = 0;
  /// Instead of dibs's record, the lock file's whole content, exactly as
  /// another tool writes it ("0" as lockfile(1), "0\n" as dotlockfile
  /// without -p). Such a lock names no holder, so every waiter, dibs's
  /// included, judges it by its age alone (stale_after): only for a lock
  /// that must look exactly like theirs (dibs's lockfile and dotlockfile
  /// names). on_behalf_of is then not used.
  std::optional<std::string> content{};
};

namespace detail {

inline constexpr std::string_view dot_lock_magic = "dibs-dot-lock 1";

/// Returns: the owner of a dot_lock record `text` ("<pid>\ndibs-dot-lock
/// 1\n<owner lines>"), or nullopt for anything else (a foreign lock).
inline std::optional<owner_id> parse_dot_lock(std::string_view text) {
  const auto nl = text.find('\n');
  if (nl == std::string_view::npos || nl == 0) return std::nullopt;
  long pid = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + nl, pid);
  if (ec != std::errc{} || p != text.data() + nl) return std::nullopt;
  const auto rest = text.substr(nl + 1);
  if (rest.substr(0, dot_lock_magic.size()) != dot_lock_magic || rest.size() == dot_lock_magic.size() ||
      rest[dot_lock_magic.size()] != '\n')
    return std::nullopt;
  auto o = parse_owner(rest.substr(dot_lock_magic.size() + 1));
  if (!o || o->pid != pid) return std::nullopt;
  return o;
}

}  // namespace detail

/// Meets Lockable and TimedLockable. One holder at a time among every
/// process that locks the same path with dot_lock, dotlockfile(1),
/// lockfile(1), O_EXCL or a noclobber shell; not recursive. One object is
/// one would-be holder: share the path, not the object, between threads.
class dot_lock : public detail::timed_lockable<dot_lock> {
  friend class detail::timed_lockable<dot_lock>;

public:
  /// Throws: std::system_error naming the path if its directory is missing
  /// or not a directory; errc::invalid_argument for a path without a file
  /// name or a stale_after under 3 ms; std::errc::no_such_process if
  /// opts.on_behalf_of names no process.
  explicit dot_lock(std::filesystem::path path, dot_lock_options opts = {}) : path_(std::move(path)), opts_(opts) {
    if (!path_.has_filename() || path_.filename() == "." || path_.filename() == "..")
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::dot_lock '{}': the path names no file", detail::path_text(path_)));
    if (opts_.stale_after < std::chrono::milliseconds{3})
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::dot_lock '{}': stale_after must be at least 3 ms", detail::path_text(path_)));
    dir_ = path_.has_parent_path() ? path_.parent_path() : std::filesystem::path{"."};
    detail::dot_file::check_directory(dir_, path_);
    if (opts_.on_behalf_of != 0 && !opts_.content) {
      // Read once, now: the start time is what tells the process from a
      // later one that reuses its pid.
      behalf_ = detail::other_process(opts_.stale_after, static_cast<long>(opts_.on_behalf_of),
                                      fmt::format("dibs::dot_lock '{}'", detail::path_text(path_)));
    }
  }
  dot_lock(const dot_lock&) = delete;
  dot_lock& operator=(const dot_lock&) = delete;
  /// Requires: no other thread uses `o` meanwhile.
  /// Effects: takes over `o`'s path, options and hold: a lock `o` held stays
  /// held (its file, and its mtime touched from now on by this object). `o`
  /// is left empty: it holds nothing, its destructor does nothing, and it may
  /// only be destroyed or assigned to (a lock call on it throws
  /// std::errc::operation_not_permitted). Throws: std::bad_alloc.
  dot_lock(dot_lock&& o) { take(o); }
  /// Effects: unlock() if this object holds the lock, then as the move
  /// constructor. Throws: as unlock() (then `o` is untouched).
  dot_lock& operator=(dot_lock&& o) {
    if (this != &o) {
      unlock();
      take(o);
    }
    return *this;
  }
  /// Effects: unlock() if held; errors are swallowed (a destructor must not throw).
  ~dot_lock() {
    try {
      unlock();
    } catch (...) {
    }
  }

  // lock(), lock(stop_token), try_lock_for(d[, stop_token]), try_lock_until(t):
  // from detail::timed_lockable, through acquire(). Each throws
  // std::system_error naming the path for a symbolic link, a directory or
  // another non-file at the path, and naming the directory for one this user
  // may not write in. A lock file of another user that this user may not
  // read or move is no error: it is held (waited for, never broken).
  /// Returns: true if this object now holds the lock (one try; a stale lock
  /// is broken first).
  bool try_lock() {
    std::lock_guard g{m_};
    return try_once();
  }

  /// Effects: removes the lock file if the path still names the file this
  /// object created; a lock that was broken and taken by another process is
  /// left alone. In a forked child of the holder it only forgets the hold.
  /// Throws: std::system_error naming the path if the file cannot be removed,
  /// or (errc::timed_out) if another process kept its flock for a second
  /// (a breaker stopped mid-break); the file is then left in place.
  void unlock() {
    if (!held_.load()) return;
    if (holder_pid_ != detail::current_pid()) {  // a forked child's copy: the parent's hold
      std::lock_guard g{m_};
      held_ = false;
      fd_.reset();
      return;
    }
    if (touch_id_) detail::renewal_keeper::instance().remove(std::exchange(touch_id_, 0));
    std::lock_guard g{m_};
    if (!held_) return;
    held_ = false;
    const detail::dot_file::handle fd = std::move(fd_);
    if (detail::dot_file::remove_own(fd, path_, own_) == detail::dot_file::removal::busy)
      throw std::system_error(make_error_code(errc::timed_out),
                              fmt::format("dibs::dot_lock: lock file '{}' left in place: another process has held "
                                          "its flock for a second (is it stopped?)",
                                          detail::path_text(path_)));
  }

  /// Effects: forgets the hold and leaves the lock file in place, held, as
  /// `lockfile FILE` and `dotlockfile -l FILE` leave theirs for a later
  /// `rm -f` or `dotlockfile -u` (std::unique_lock::release, for a file):
  /// nothing touches it from now on, so it ages like theirs.
  /// Returns: true if this object held the lock.
  bool release() {
    if (!held_.load()) return false;
    if (touch_id_) detail::renewal_keeper::instance().remove(std::exchange(touch_id_, 0));
    std::lock_guard g{m_};
    fd_.reset();
    return held_.exchange(false) && holder_pid_ == detail::current_pid();
  }

  /// Returns: true if a lock file is at `file` that a dot_lock with `o`
  /// would judge held (neither gone nor stale), as `dotlockfile -c` asks;
  /// reads only: breaks nothing, creates nothing.
  /// Throws: std::system_error naming the path for a symbolic link, a
  /// directory or another non-file at the path.
  static bool is_held(const std::filesystem::path& file, const dot_lock_options& o = {}) {
    detail::dot_file::handle fd;
    detail::dot_file::stamp st;
    return judge_at(file, o, fd, st) == verdict::held;
  }

  /// Returns: who holds the lock file at `file`, as a dot_lock with `o`
  /// judges it, or nothing if there is no lock file there. For dibs's own
  /// record: its host, pid, lease (its holder's stale_after) and gone
  /// (provably gone: the next lock breaks it at once); for a lock of
  /// another tool (dotlockfile, lockfile(1), O_EXCL): the pid on its first
  /// line (0 if none) and an empty host, as nothing more is known of it.
  /// lease_left: how much longer its age keeps it held (negative: it is
  /// stale by age, and the next lock breaks it). For a file this process may
  /// not read: pid 0, empty host, nothing else known. Reads only, as is_held.
  /// Throws: std::system_error naming the path for a symbolic link, a
  /// directory or another non-file at the path.
  static std::optional<lock_holder> holder_of(const std::filesystem::path& file, const dot_lock_options& o = {}) {
    detail::dot_file::handle fd;
    detail::dot_file::stamp st;
    return read_holder(file, o, fd, st);
  }

  /// Effects: sets the lock file's mtime to now (what touch does on its own).
  /// Returns: false if this object holds nothing.
  bool touch() {
    std::lock_guard g{m_};
    return held_ && detail::dot_file::touch(fd_);
  }
  /// Returns: true if this object holds the lock and the path still names
  /// its file (false: it was broken, by age, or removed by another tool).
  bool still_held() const {
    std::lock_guard g{m_};
    return held_ && fd_ && detail::dot_file::path_names(path_, own_);
  }
  const std::filesystem::path& path() const noexcept { return path_; }

private:
  using clock = std::chrono::steady_clock;

  bool acquire(clock::time_point until, const std::stop_token& st) {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    for (std::uint64_t n = 0;; ++n) {
      if (st.stop_requested()) detail::throw_cancelled("dibs::dot_lock", detail::path_text(path_));
      {
        std::lock_guard g{m_};
        if (try_once()) return true;
      }
      auto delay = opts_.wait.delay(n, {}, std::uniform_real_distribution<double>{0.0, 1.0}(rng));
      if (until != clock::time_point::max()) {
        const auto left = until - clock::now();
        if (left <= clock::duration::zero()) return false;
        delay = std::min<std::chrono::nanoseconds>(delay, left);
      }
      (void)detail::sleep_unless_stopped(delay, st);
    }
  }

  // Requires: no other thread uses `o`; this object holds nothing.
  void take(dot_lock& o) {
    if (o.touch_id_) detail::renewal_keeper::instance().remove(std::exchange(o.touch_id_, 0));  // its hooks name `o`
    std::lock_guard g{o.m_};
    path_ = std::move(o.path_);
    o.path_.clear();
    dir_ = std::move(o.dir_);
    opts_ = o.opts_;
    behalf_ = std::move(o.behalf_);
    held_ = o.held_.exchange(false);
    holder_pid_ = std::exchange(o.holder_pid_, 0);
    fd_ = std::move(o.fd_);
    own_ = o.own_;
    if (held_ && holder_pid_ == detail::current_pid()) start_touching();
  }

  void start_touching() {
    if (opts_.touch)
      touch_id_ = detail::renewal_keeper::instance().add(opts_.stale_after / 3, {[this] { return touch(); }, {}, nullptr});
  }

  // Requires: m_ held. Returns: true if this object now holds the lock.
  bool try_once() {
    if (path_.empty())
      throw std::system_error(std::make_error_code(std::errc::operation_not_permitted),
                              "dibs::dot_lock: this object was moved from; assign a lock to it first");
    if (held_ && holder_pid_ == detail::current_pid())
      throw std::system_error(make_error_code(std::errc::resource_deadlock_would_occur),
                              fmt::format("dibs::dot_lock '{}': already held by this object", detail::path_text(path_)));
    // A file that vanishes between our create and our look at it, or a stale
    // one just moved away, is worth another try at once; a few are enough.
    for (int round = 0; round < 4; ++round) {
      if (create_record()) return true;
      detail::dot_file::handle judged;
      detail::dot_file::stamp st;
      switch (judge(judged, st)) {
        case verdict::gone: continue;
        case verdict::held: return false;
        case verdict::stale:
          if (!break_stale(judged, st)) return false;
          continue;
      }
    }
    return false;
  }

  // Creates the lock file with the whole record in it.
  // Returns: true if this object now holds the lock; false if a file is there.
  bool create_record() {
    const auto pid = detail::current_pid();
    std::string text;
    if (opts_.content) {
      text = *opts_.content;
    } else {
      const detail::owner_id owner = behalf_ ? *behalf_ : detail::this_process(opts_.stale_after);
      text = fmt::format("{}\n{}\n{}", owner.pid, detail::dot_lock_magic, detail::format_owner(owner));
    }
    detail::dot_file::handle fd;
    detail::dot_file::stamp st;
    if (!detail::dot_file::create(path_, dir_, text, opts_.mode, fd, st)) return false;
    fd_ = std::move(fd);
    own_ = st;
    held_ = true;
    holder_pid_ = pid;
    start_touching();
    return true;
  }

  enum class verdict { gone, held, stale };

  // Opens the file at the path (into `fd`, `st`) and judges it.
  verdict judge(detail::dot_file::handle& fd, detail::dot_file::stamp& st) const {
    return judge_at(path_, opts_, fd, st);
  }
  // The rule, for a lock file at `file` judged with `o` (also for is_held):
  // gone if there is none; stale if its holder is provably gone or its age
  // has used up its lease; else held (also when it cannot be read).
  static verdict judge_at(const std::filesystem::path& file, const dot_lock_options& o,
                          detail::dot_file::handle& fd, detail::dot_file::stamp& st) {
    const auto h = read_holder(file, o, fd, st);
    if (!h) return verdict::gone;
    return h->gone || (h->lease_left && h->lease_left->count() <= 0) ? verdict::stale : verdict::held;
  }

  // Opens the lock file at `file` (into `fd`, `st`) and reads who holds it
  // (holder_of). lease_left is rounded up, so that it is <= 0 exactly when
  // the file's age has reached its limit. The wall clock, against the mtime
  // the system stamped with it: the only lease the other tools keep (see
  // the top of this header).
  static std::optional<lock_holder> read_holder(const std::filesystem::path& file, const dot_lock_options& o,
                                                detail::dot_file::handle& fd, detail::dot_file::stamp& st) {
    namespace f = detail::dot_file;
    char buf[4096];
    std::size_t n = 0;
    switch (f::open_judged(file, fd, st)) {
      case f::look::gone: return std::nullopt;
      case f::look::unreadable: return lock_holder{};
      case f::look::opened: break;
    }
    switch (f::read_head(fd, buf, sizeof buf, n, file)) {
      case f::look::gone: return std::nullopt;
      case f::look::unreadable: return lock_holder{};
      case f::look::opened: break;
    }
    const std::string_view text(buf, n);
    lock_holder h;
    auto limit = o.stale_after;
    if (const auto owner = detail::parse_dot_lock(text)) {
      h.host = owner->host;
      h.pid = owner->pid;
      h.gone = detail::provably_dead(*owner);
      limit = std::max(limit, owner->lease);  // its holder touches it by its own stale_after
    } else {
      const auto first = text.substr(0, text.find('\n'));
      long pid = 0;
      const auto [p, ec] = std::from_chars(first.data(), first.data() + first.size(), pid);
      h.pid = ec == std::errc{} && p == first.data() + first.size() ? pid : 0;
    }
    h.lease = std::chrono::duration_cast<std::chrono::milliseconds>(limit);
    h.lease_left = std::chrono::ceil<std::chrono::milliseconds>(limit - (std::chrono::system_clock::now() - st.modified()));
    return h;
  }

  // Moves away the file judged stale (open as `fd`, as it was `judged`),
  // by the protocol at the top of this header.
  // Returns: true if it was moved away (the path is free to create).
  bool break_stale(const detail::dot_file::handle& fd, const detail::dot_file::stamp& judged) const {
    namespace f = detail::dot_file;
    if (!f::try_break_lock(fd)) return false;  // another dibs process acts on it: judge again later
    if (!f::path_unchanged(path_, judged)) return false;
    if (!f::handle_unchanged(fd, judged)) return false;  // touched since: its holder lives
    const std::filesystem::path moved = f::broken_name(path_);
    switch (f::move_away(path_, moved)) {
      case f::moved::done: break;
      // Gone: look again. Not ours to move (another user's, in a sticky
      // directory): it stays, so it is held until its owner removes it.
      case f::moved::gone:
      case f::moved::refused: return false;
    }
    if (f::path_unchanged(moved, judged)) {
      f::remove_moved(moved);
      return true;
    }
    // Not the file judged: a fresh lock made after our check. Put it back,
    // never over a lock made since (then it stays at `moved`: see the top).
    f::move_back(moved, path_);
    return false;
  }

  std::filesystem::path path_;
  std::filesystem::path dir_;
  dot_lock_options opts_;
  std::optional<detail::owner_id> behalf_;  // the process named in the record, if not this one
  mutable std::mutex m_;
  std::atomic<bool> held_{false};
  detail::process_id holder_pid_ = 0;
  detail::dot_file::handle fd_;  // our lock file, open from its creation to unlock
  detail::dot_file::stamp own_;  // which file it is
  std::uint64_t touch_id_ = 0;
};

}  // namespace dibs
