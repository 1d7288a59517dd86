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
#pragma once

#ifdef _WIN32
#error "dibs/dot_lock.hpp is not ported to Windows yet; docs/windows.md lists the headers that are"
#endif

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

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
#include <dibs/detail/posix/sys.hpp>
#include <dibs/detail/renewal_keeper.hpp>
#include <dibs/detail/timed_lockable.hpp>
#include <dibs/error.hpp>

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
  mode_t mode = 0644;
  /// Waiting between tries; a removal of the lock file does not wake a waiter
  /// early, so the cap bounds the handoff delay.
  exponential_backoff wait{std::chrono::microseconds{500}, 2.0, std::chrono::milliseconds{50}, jitter::full};
  /// The process the lock is held for; 0: this process. Its pid (first
  /// line) and identity go into the record instead of this process's, while
  /// this object takes, touches and removes the lock as usual: a launcher
  /// (dibs lock --dot) holds it for a COMMAND it forked, so the lock outlives
  /// the launcher exactly as long as the COMMAND runs. Requires: a live
  /// process of this host and PID namespace (a child not yet reaped).
  pid_t on_behalf_of = 0;
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
                              fmt::format("dibs::dot_lock '{}': the path names no file", path_.string()));
    if (opts_.stale_after < std::chrono::milliseconds{3})
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::dot_lock '{}': stale_after must be at least 3 ms", path_.string()));
    dir_ = path_.has_parent_path() ? path_.parent_path() : std::filesystem::path{"."};
    struct ::stat st {};
    if (::stat(dir_.c_str(), &st) != 0) throw detail::path_error(errno, "dibs::dot_lock: cannot use lock file", path_);
    if (!S_ISDIR(st.st_mode)) throw detail::path_error(ENOTDIR, "dibs::dot_lock: cannot use lock file", path_);
    if (opts_.on_behalf_of != 0) {
      // Read once, now: the start time is what tells the process from a
      // later one that reuses its pid.
      behalf_ = detail::other_process(opts_.stale_after, opts_.on_behalf_of,
                                      fmt::format("dibs::dot_lock '{}'", path_.string()));
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
    const detail::unique_fd fd = std::move(fd_);
    if (!lock_inode(fd.get()))
      throw std::system_error(make_error_code(errc::timed_out),
                              fmt::format("dibs::dot_lock: lock file '{}' left in place: another process has held "
                                          "its flock for a second (is it stopped?)",
                                          path_.string()));
    if (names_file(fd.get()) && ::unlink(path_.c_str()) != 0 && !file_gone(errno))
      throw detail::path_error(errno, "dibs::dot_lock: cannot remove lock file", path_);
  }

  /// Effects: sets the lock file's mtime to now (what touch does on its own).
  /// Returns: false if this object holds nothing.
  bool touch() {
    std::lock_guard g{m_};
    return held_ && ::futimens(fd_.get(), nullptr) == 0;
  }
  /// Returns: true if this object holds the lock and the path still names
  /// its file (false: it was broken, by age, or removed by another tool).
  bool still_held() const {
    std::lock_guard g{m_};
    return held_ && names_file(fd_.get());
  }
  const std::filesystem::path& path() const noexcept { return path_; }

private:
  using clock = std::chrono::steady_clock;

  bool acquire(clock::time_point until, const std::stop_token& st) {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    for (std::uint64_t n = 0;; ++n) {
      if (st.stop_requested()) detail::throw_cancelled("dibs::dot_lock", path_.string());
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
    dev_ = o.dev_;
    ino_ = o.ino_;
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
                              fmt::format("dibs::dot_lock '{}': already held by this object", path_.string()));
    // A file that vanishes between our link() and our look at it, or a stale
    // one just moved away, is worth another try at once; a few are enough.
    for (int round = 0; round < 4; ++round) {
      if (link_record()) return true;
      detail::unique_fd judged;
      struct ::stat st {};
      switch (judge(judged, st)) {
        case verdict::gone: continue;
        case verdict::held: return false;
        case verdict::stale:
          if (!break_stale(judged.get(), st)) return false;
          continue;
      }
    }
    return false;
  }

  // Writes the whole record to a temporary file and links it to the path.
  // Returns: true if this object now holds the lock; false if a file is there.
  bool link_record() {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    const auto tmp = dir_ / fmt::format(".{}.dibs-tmp.{}.{:016x}", path_.filename().string(),
                                        detail::current_pid(), rng());
    detail::unique_fd fd{detail::open_retry(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, opts_.mode)};
    if (!fd) throw directory_error(errno);
    const auto fail = [&](int e, const char* what) {
      ::unlink(tmp.c_str());
      return detail::path_error(e, what, path_);
    };
    // The mode exactly: a lock several users share must stay theirs to remove.
    if (::fchmod(fd.get(), opts_.mode) != 0) throw fail(errno, "dibs::dot_lock: cannot set the mode of lock file");
    const auto pid = detail::current_pid();
    const detail::owner_id owner = behalf_ ? *behalf_ : detail::this_process(opts_.stale_after);
    const std::string text = fmt::format("{}\n{}\n{}", owner.pid, detail::dot_lock_magic, detail::format_owner(owner));
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw fail(n < 0 ? errno : ENOSPC, "dibs::dot_lock: cannot write lock file");
      done += static_cast<std::size_t>(n);
    }
    const int rc = ::link(tmp.c_str(), path_.c_str());
    const int e = errno;
    struct ::stat st {};
    // Over NFS link() may report failure when it succeeded: the link count says.
    const bool linked = ::fstat(fd.get(), &st) == 0 && (rc == 0 || st.st_nlink == 2);
    ::unlink(tmp.c_str());
    if (!linked) {
      if (e == EEXIST) return false;
      throw detail::path_error(e, "dibs::dot_lock: cannot create lock file", path_);
    }
    fd_ = std::move(fd);
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    held_ = true;
    holder_pid_ = pid;
    start_touching();
    return true;
  }

  enum class verdict { gone, held, stale };

  // Opens the file at the path (into `fd`, `st`) and judges it.
  verdict judge(detail::unique_fd& fd, struct ::stat& st) const {
    fd.reset(detail::open_retry(path_.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    if (!fd) {
      const int e = errno;
      if (file_gone(e)) return verdict::gone;
      struct ::stat l {};
      if (e == ELOOP && ::lstat(path_.c_str(), &l) == 0 && S_ISLNK(l.st_mode))
        throw std::system_error(std::error_code{e, std::system_category()},
                                fmt::format("dibs::dot_lock: lock file '{}' is a symbolic link; dibs does not follow a "
                                            "link there (in a shared directory it could point anywhere): remove it",
                                            path_.string()));
      if (not_ours_to_read(e)) {
        // lstat needs no read permission: a directory there is still an error.
        if (::lstat(path_.c_str(), &l) == 0) {
          check_regular(l);
          return verdict::held;
        }
        return file_gone(errno) ? verdict::gone : verdict::held;
      }
      throw detail::path_error(e, "dibs::dot_lock: cannot open lock file", path_);
    }
    if (::fstat(fd.get(), &st) != 0) {
      if (file_gone(errno)) return verdict::gone;
      throw detail::path_error(errno, "dibs::dot_lock: cannot stat lock file", path_);
    }
    check_regular(st);
    char buf[4096];
    ssize_t n;
    do n = ::pread(fd.get(), buf, sizeof buf, 0);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
      const int e = errno;
      if (file_gone(e)) return verdict::gone;
      if (not_ours_to_read(e)) return verdict::held;  // NFS checks permission on each read, not only at open
      throw detail::path_error(e, "dibs::dot_lock: cannot read lock file", path_);
    }
    auto limit = opts_.stale_after;
    if (const auto owner = detail::parse_dot_lock(std::string_view(buf, static_cast<std::size_t>(n)))) {
      if (detail::provably_dead(*owner)) return verdict::stale;
      limit = std::max(limit, owner->lease);  // its holder touches it by its own stale_after
    }
    // The wall clock, against the mtime the kernel stamped with it: the only
    // lease the other tools keep (see the top of this header).
    const auto mtime = std::chrono::system_clock::time_point{
        std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::seconds{st.st_mtim.tv_sec} + std::chrono::nanoseconds{st.st_mtim.tv_nsec})};
    return std::chrono::system_clock::now() - mtime >= limit ? verdict::stale : verdict::held;
  }

  // Errors that say the file at the path went away since we looked: ENOENT,
  // and ESTALE (on NFS another client removed it, so our handle names
  // nothing). The path is free, or names a newer file: look again.
  static bool file_gone(int e) noexcept { return e == ENOENT || e == ESTALE; }

  // Errors that say a file is there that this user may not read or move (a
  // mode 0600 lock of another user; a sticky directory): by the presence
  // rule it is held. It is never broken by us: breaking needs proof from its
  // record, or the file open for the flock and checks of the protocol, and
  // an unreadable file gives neither. Only reached after link_record made a
  // file in the directory, so the directory itself is writable.
  static bool not_ours_to_read(int e) noexcept { return e == EACCES || e == EPERM; }

  void check_regular(const struct ::stat& st) const {
    if (!S_ISREG(st.st_mode))
      throw std::system_error(std::error_code{S_ISDIR(st.st_mode) ? EISDIR : EINVAL, std::system_category()},
                              fmt::format("dibs::dot_lock: lock file '{}' is not a regular file (a {}): move it away",
                                          path_.string(), S_ISDIR(st.st_mode) ? "directory" : "device, FIFO or socket"));
  }

  // The error for a file that cannot be made in the lock's directory: no
  // lock can ever be taken there by this user, so waiting would not help.
  std::system_error directory_error(int e) const {
    const bool denied = e == EACCES || e == EPERM;
    return std::system_error(
        std::error_code{e, std::system_category()},
        fmt::format("dibs::dot_lock: cannot create a file in directory '{}' (for lock file '{}'){}", dir_.string(),
                    path_.string(),
                    denied ? " (a dot_lock creates its lock file there: this user needs write and search permission on "
                             "the directory; share it by a group every locker is in, mode 2775, or make it mode 1777)"
                           : detail::errno_hint(e)));
  }

  // Moves away the file judged stale (open as `fd`, as it was `judged`),
  // by the protocol at the top of this header.
  // Returns: true if it was moved away (the path is free to link).
  bool break_stale(int fd, const struct ::stat& judged) const {
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) return false;  // another dibs process acts on it: judge again later
    struct ::stat now {};
    if (::lstat(path_.c_str(), &now) != 0 || !same_file(now, judged)) return false;
    if (::fstat(fd, &now) != 0 || !same_file(now, judged)) return false;  // touched since: its holder lives
    thread_local std::mt19937_64 rng{std::random_device{}()};
    const std::string moved = fmt::format("{}.broken.{}.{:016x}", path_.string(), detail::current_pid(), rng());
    if (::rename(path_.c_str(), moved.c_str()) != 0) {
      // Gone: look again. Not ours to move (another user's, in a sticky
      // directory): it stays, so it is held until its owner removes it.
      if (file_gone(errno) || not_ours_to_read(errno)) return false;
      throw detail::path_error(errno, "dibs::dot_lock: cannot move away the stale lock file", path_);
    }
    if (::lstat(moved.c_str(), &now) == 0 && same_file(now, judged)) {
      ::unlink(moved.c_str());
      return true;
    }
    // Not the file judged: a fresh lock made after our check. Put it back,
    // never over a lock made since (then it stays at `moved`: see the top).
    if (::renameat2(AT_FDCWD, moved.c_str(), AT_FDCWD, path_.c_str(), RENAME_NOREPLACE) != 0 &&
        (errno == EINVAL || errno == ENOSYS) && ::link(moved.c_str(), path_.c_str()) == 0)
      ::unlink(moved.c_str());  // a filesystem without RENAME_NOREPLACE: link never clobbers either
    return false;
  }

  static bool same_file(const struct ::stat& a, const struct ::stat& b) noexcept {
    return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
           a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec;
  }

  // Returns: true if the path names the inode of our lock file `fd`.
  bool names_file(int fd) const {
    struct ::stat st {};
    return fd >= 0 && ::lstat(path_.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_;
  }

  // Takes the flock breakers take on our file, for at most a second (a
  // breaker holds it for a few system calls). Returns: false if not had.
  static bool lock_inode(int fd) {
    const exponential_backoff schedule{std::chrono::microseconds{50}, 2.0, std::chrono::milliseconds{5}, jitter::equal};
    const auto end = clock::now() + std::chrono::seconds{1};
    for (std::uint64_t n = 0;; ++n) {
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return true;
      if (errno != EWOULDBLOCK && errno != EINTR) return true;  // no flock here (some NFS): judge by inode alone
      if (clock::now() >= end) return false;
      std::this_thread::sleep_for(schedule.delay(n, {}, 0.5));
    }
  }

  std::filesystem::path path_;
  std::filesystem::path dir_;
  dot_lock_options opts_;
  std::optional<detail::owner_id> behalf_;  // the process named in the record, if not this one
  mutable std::mutex m_;
  std::atomic<bool> held_{false};
  pid_t holder_pid_ = 0;
  detail::unique_fd fd_;  // our lock file, open from its creation to unlock
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  std::uint64_t touch_id_ = 0;
};

}  // namespace dibs
