// dibs/file_mutex.hpp: a lock on a file through the kernel's advisory locks.
//
//   dibs::file_mutex m{"/var/lock/nightly.lock"};
//   std::scoped_lock hold{m};            // also: try_lock_for, std::shared_lock
//
// Why a kernel lock: the kernel releases it when the holder dies, however it
// dies, so it never goes stale and there is nothing to break. What the kernel
// does not give, this class adds:
//   - threads of one process exclude each other (the kernel lock belongs to an
//     open file description, which all threads share): an in-process registry
//     keyed by (device, inode) serialises them first;
//   - a forked child never releases its parent's lock, and never keeps it
//     either: the descriptors of this registry are closed in the child at
//     fork (closing a copy never releases the parent's flock or OFD lock,
//     and a copy left open would hold the lock for as long as the child
//     lives, after its parent died too); the child's unlock() leaves the
//     parent's lock alone, and the child locks through a descriptor of its own;
//   - descriptors are O_CLOEXEC, so a lock never leaks into a program the
//     holder starts;
//   - the file is never unlinked, so the unlink race (a waiter locking a dead
//     inode while a third process creates a new file) cannot happen.
//
// Two kernel lock families exist, and they do not see each other:
//   lock_family::flock (default)  flock(2): interoperates with util-linux flock(1)
//   lock_family::posix            open-file-description record locks (F_OFD_SETLK),
//                                 falling back to classic fcntl locks on old kernels:
//                                 interoperates with lockf(3), fcntl(2) and
//                                 Boost.Interprocess file_lock.
//
// On Windows both families are LockFileEx over the whole file (which
// Boost.Interprocess's file_lock and py-filelock meet); see
// detail/win32/file_lock.hpp for what differs there. The system calls of
// each platform are in detail/posix/file_lock.hpp and detail/win32/file_lock.hpp.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stop_token>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/backoff.hpp>
#include <dibs/detail/cancel.hpp>
#include <dibs/detail/format.hpp>
#include <dibs/error.hpp>

#ifdef _WIN32
#include <dibs/detail/win32/file_lock.hpp>
#else
#include <dibs/detail/posix/file_lock.hpp>
#endif

namespace dibs {

enum class lock_family {
  flock,  ///< flock(2), as util-linux flock(1)
  posix,  ///< POSIX record locks on the whole file (OFD locks where the kernel has them)
};

inline const char* to_string(lock_family f) noexcept {
  return f == lock_family::flock ? "flock" : f == lock_family::posix ? "posix" : "?";
}

struct file_mutex_options {
  lock_family family = lock_family::flock;
  /// Write "pid <pid> host <host>" into the file on each exclusive lock, so a
  /// person can see who holds it (`cat` the file). Off by default: the pwrite
  /// doubles the cost of a lock (2.2x the raw flock pair instead of 1.0x, see
  /// docs/BENCHMARKS.md).
  bool write_owner = false;
  /// Permissions of a lock file that does not exist yet (the umask applies;
  /// ignored on Windows, where a new file gets its directory's security).
  detail::file_mode mode = 0644;
};

namespace detail {

// One per file (device and inode; volume and file index) per process: holds
// the descriptor that owns the kernel lock and the in-process reader/writer
// state in front of it.
struct lock_entry {
  std::filesystem::path path;
  file_lock::handle fd;
  bool writable = false;
  std::string owner;  // the owner line this process writes (made after any fork, so its pid is right)
  std::mutex m;
  std::condition_variable cv;
  bool writer = false;      // a thread of this process holds (or is taking) it exclusively
  int readers = 0;          // threads of this process holding it shared
  bool acquiring = false;   // the first reader is taking the kernel's shared lock
  int waiting_writers = 0;  // readers let writers go first, so writers do not starve
};

struct lock_registry {
  std::mutex m;
  std::map<file_lock::identity, std::weak_ptr<lock_entry>> entries;
  // Bumped in a forked child: every entry made before the fork belongs to the
  // parent's locks, and the child must neither unlock nor reuse them.
  std::atomic<std::uint64_t> generation{0};

  static lock_registry& instance() {
    // Leaked on purpose: file_mutex objects with static storage may outlive it otherwise.
    static lock_registry* r = [] {
      auto* reg = new lock_registry;
      file_lock::at_fork([] { instance().m.lock(); }, [] { instance().m.unlock(); },
                       [] {
                         auto& self = instance();
                         // Only this thread exists in the child; abandon the parent's entries
                         // (their mutexes may be held by threads that are not here), and
                         // close their descriptors: the locks on them are the parent's.
                         for (auto& [key, weak] : self.entries)
                           if (const auto e = weak.lock()) e->fd.reset();
                         self.entries.clear();
                         self.generation.fetch_add(1, std::memory_order_relaxed);
                         self.m.unlock();
                       });
      return reg;
    }();
    return *r;
  }
};

inline std::string owner_line() {
  std::string s = file_lock::owner_text();
  // Fixed width, so a shorter line never leaves the tail of a longer one behind.
  if (s.size() < 127) s.resize(127, ' ');
  s += '\n';
  return s;
}

}  // namespace detail

/// A mutex over a file, shared with other processes through the kernel.
/// Meets Lockable, TimedLockable, SharedLockable and SharedTimedLockable.
/// Not recursive: a thread that locks a file_mutex it holds deadlocks, as with
/// std::mutex.
class file_mutex {
public:
  /// Effects: opens (creating if needed) the file at `path`. A file this user
  /// may only read is opened read-only; flock locks still work on it (the
  /// owner line is not written), POSIX write locks do not.
  /// Throws: std::system_error naming the path (missing directory, a
  /// directory, no permission).
  explicit file_mutex(std::filesystem::path path, file_mutex_options opts = {})
      : path_(std::move(path)), opts_(opts) {
    attach();
  }

  file_mutex(const file_mutex&) = delete;
  file_mutex& operator=(const file_mutex&) = delete;
  /// Requires: no other thread uses `o` meanwhile.
  /// Effects: this object takes `o`'s file and its share of the process's
  /// lock on it: a lock held stays held (it belongs to the process's entry
  /// for the file, which moves, not to an address). `o` is left empty: its
  /// destructor does nothing, its unlock() does nothing, and it may only be
  /// destroyed or assigned to (a lock call on it throws
  /// std::errc::operation_not_permitted).
  file_mutex(file_mutex&& o) noexcept = default;
  /// Effects: as destroying this object, then as the move constructor. As
  /// with the destructor, a lock this object's file holds is released when
  /// this was the process's last file_mutex on that file (its descriptor is
  /// closed); while another one of the process is open on the file, the
  /// lock stays with the process (any of them may unlock it: the lock is the
  /// process's, not one object's, so one object cannot tell that it is
  /// "its" lock to release).
  file_mutex& operator=(file_mutex&& o) noexcept = default;
  ~file_mutex() = default;

  /// Effects: blocks (in the kernel, once no other thread of this process is
  /// ahead) until this process holds the lock exclusively.
  /// Throws: std::system_error naming the path if the kernel refuses.
  void lock() { (void)acquire(true, nullptr); }
  /// Effects: as lock(), but a stop requested through `st` ends the wait
  /// (within about 2 ms: the wait then polls the kernel instead of blocking
  /// in it, since a library must not take a signal from its program).
  /// Throws: std::system_error(errc::cancelled) if stopped; nothing is held then.
  void lock(std::stop_token st) { (void)acquire(true, nullptr, &st); }
  bool try_lock() { return acquire(true, &now_deadline); }
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& d) {
    return try_lock_until(std::chrono::steady_clock::now() + d);
  }
  /// Returns: as try_lock_for(d). Throws: errc::cancelled if a stop is
  /// requested through `st` first.
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& d, std::stop_token st) {
    const steady::time_point until = steady::now() + std::chrono::duration_cast<steady::duration>(d);
    return acquire(true, &until, &st);
  }
  template <class Clock, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& t) {
    const auto until = to_steady(t);
    return acquire(true, &until);
  }
  /// Requires: this process holds the lock exclusively, taken through this
  /// object or another file_mutex on the same file. In a forked child of the
  /// holder it does nothing: the lock is the parent's.
  void unlock() { release(true); }

  void lock_shared() { (void)acquire(false, nullptr); }
  void lock_shared(std::stop_token st) { (void)acquire(false, nullptr, &st); }
  bool try_lock_shared() { return acquire(false, &now_deadline); }
  template <class Rep, class Period>
  bool try_lock_shared_for(const std::chrono::duration<Rep, Period>& d) {
    return try_lock_shared_until(std::chrono::steady_clock::now() + d);
  }
  template <class Clock, class Duration>
  bool try_lock_shared_until(const std::chrono::time_point<Clock, Duration>& t) {
    const auto until = to_steady(t);
    return acquire(false, &until);
  }
  void unlock_shared() { release(false); }

  const std::filesystem::path& path() const noexcept { return path_; }
  /// Returns: the descriptor that holds the kernel lock (shared by every
  /// file_mutex of this process on the same file).
  detail::file_lock::native_type native_handle() const noexcept {
    return entry_ ? detail::file_lock::native(entry_->fd) : detail::file_lock::no_native();
  }

private:
  using steady = std::chrono::steady_clock;
  static inline const steady::time_point now_deadline = steady::time_point::min();

  template <class Clock, class Duration>
  static steady::time_point to_steady(const std::chrono::time_point<Clock, Duration>& t) {
    if constexpr (std::is_same_v<Clock, steady>) return std::chrono::time_point_cast<steady::duration>(t);
    else return steady::now() + std::chrono::duration_cast<steady::duration>(t - Clock::now());
  }

  // Finds or makes this process's entry for the file.
  void attach() {
    auto& reg = detail::lock_registry::instance();
    // Opened under the registry's lock, which fork() waits for: a child
    // forked between the open and the registration would keep an
    // unregistered copy of the descriptor, and with it the lock taken later.
    std::lock_guard lock{reg.m};
    // An existing file we may only read still takes a flock (not a POSIX write lock).
    auto [owned, key, writable] = detail::file_lock::open(path_, opts_.mode, opts_.family == lock_family::flock);
    generation_ = reg.generation.load(std::memory_order_relaxed);
    if (auto it = reg.entries.find(key); it != reg.entries.end()) {
      if (auto e = it->second.lock()) {
        entry_ = std::move(e);
        return;  // `owned` closes our descriptor; closing a second one never drops a flock or OFD lock
      }
    }
    auto e = std::make_shared<detail::lock_entry>();
    e->path = path_;
    e->fd = std::move(owned);
    e->writable = writable;
    if (writable && opts_.write_owner) e->owner = detail::owner_line();
    reg.entries[key] = e;
    entry_ = std::move(e);
  }

  // After fork() the entry is the parent's; take one of our own.
  bool forked() const noexcept {
    return detail::lock_registry::instance().generation.load(std::memory_order_relaxed) != generation_;
  }
  void reattach() {
    // The parent's entry may have mutexes held by threads that do not exist
    // here: leak it rather than destroy it. Its descriptor can be closed:
    // that never releases a flock or OFD lock the parent still holds through
    // its own copy.
    static auto* graveyard = new std::vector<std::shared_ptr<detail::lock_entry>>;
    entry_->fd.reset();
    graveyard->push_back(std::move(entry_));
    attach();
  }

  // Returns: true if acquired. deadline == nullptr: block; *deadline == now_deadline: one try.
  // Throws: errc::cancelled if a stop is requested through *stop (nothing held then).
  bool acquire(bool exclusive, const steady::time_point* deadline, const std::stop_token* stop = nullptr) {
    if (!entry_)
      throw std::system_error(std::make_error_code(std::errc::operation_not_permitted),
                              "dibs::file_mutex: this object was moved from; assign a lock to it first");
    if (stop && !stop->stop_possible()) stop = nullptr;
    if (forked()) reattach();
    auto& e = *entry_;
    std::unique_lock lock{e.m};
    if (exclusive) {
      ++e.waiting_writers;
      bool got = false;
      try {
        got = wait(lock, deadline, stop, [&] { return !e.writer && e.readers == 0 && !e.acquiring; });
      } catch (...) {
        --e.waiting_writers;
        e.cv.notify_all();  // readers that let this writer go first
        throw;
      }
      --e.waiting_writers;
      if (!got) return false;
      e.writer = true;
      lock.unlock();
      bool ok = false;
      try {
        ok = kernel_lock(true, deadline, stop);
      } catch (...) {
        give_back(true);
        throw;
      }
      if (!ok) {
        give_back(true);
        return false;
      }
      if (opts_.write_owner && e.writable) write_owner();
      return true;
    }
    const bool got = wait(lock, deadline, stop, [&] { return !e.writer && !e.acquiring && e.waiting_writers == 0; });
    if (!got) return false;
    if (e.readers > 0) {  // the kernel's shared lock is already ours
      ++e.readers;
      return true;
    }
    e.readers = 1;
    e.acquiring = true;
    lock.unlock();
    bool ok = false;
    try {
      ok = kernel_lock(false, deadline, stop);
    } catch (...) {
      give_back(false);
      throw;
    }
    if (!ok) {
      give_back(false);
      return false;
    }
    lock.lock();
    e.acquiring = false;
    e.cv.notify_all();
    return true;
  }

  void give_back(bool exclusive) noexcept {
    auto& e = *entry_;
    std::lock_guard lock{e.m};
    if (exclusive) e.writer = false;
    else {
      e.readers = 0;
      e.acquiring = false;
    }
    e.cv.notify_all();
  }

  template <class Pred>
  bool wait(std::unique_lock<std::mutex>& lock, const steady::time_point* deadline, const std::stop_token* stop,
            Pred ready) {
    auto& e = *entry_;
    if (deadline && *deadline == now_deadline) return ready();
    if (stop) {  // in slices, looking at the stop token between them
      for (;;) {
        if (ready()) return true;
        if (stop->stop_requested()) detail::throw_cancelled("dibs::file_mutex", detail::path_text(path_));
        auto until = steady::now() + stop_check;
        if (deadline) {
          if (steady::now() >= *deadline) return false;
          until = std::min(until, *deadline);
        }
        e.cv.wait_until(lock, until);
      }
    }
    if (!deadline) {
      e.cv.wait(lock, ready);
      return true;
    }
    return e.cv.wait_until(lock, *deadline, ready);
  }
  static constexpr std::chrono::milliseconds stop_check{2};

  void release(bool exclusive) {
    if (!entry_) return;   // moved from
    if (forked()) return;  // the parent's lock: not ours to release
    auto& e = *entry_;
    std::lock_guard lock{e.m};
    if (exclusive) {
      kernel_unlock();
      e.writer = false;
    } else {
      if (e.readers <= 0) return;
      if (--e.readers == 0) kernel_unlock();
    }
    e.cv.notify_all();
  }

  // One kernel call: true if acquired, false if held elsewhere (non-blocking).
  bool kernel_try(bool exclusive, bool block) {
    return detail::file_lock::try_lock(entry_->fd, opts_.family == lock_family::posix, exclusive, block, path_);
  }

  bool kernel_lock(bool exclusive, const steady::time_point* deadline, const std::stop_token* stop) {
    if (!deadline && !stop) return kernel_try(exclusive, true);
    if (kernel_try(exclusive, false)) return true;
    if (deadline && *deadline == now_deadline) return false;
    // Neither flock(2) nor F_OFD_SETLKW takes a timeout, and interrupting them
    // would need a signal, which a library must not take from its program. A
    // timed or cancellable wait therefore polls, with jittered backoff capped
    // at 2 ms so a handoff (or a stop) is noticed quickly; an untimed lock()
    // without a stop token blocks in the kernel.
    const exponential_backoff schedule{std::chrono::microseconds{20}, 2.0, std::chrono::milliseconds{2}, jitter::equal};
    thread_local std::minstd_rand rng{std::random_device{}()};
    for (std::uint64_t n = 0;; ++n) {
      if (stop && stop->stop_requested()) detail::throw_cancelled("dibs::file_mutex", detail::path_text(path_));
      const auto left = deadline ? *deadline - steady::now() : steady::duration::max();
      if (left <= steady::duration::zero()) return false;
      const double u = std::uniform_real_distribution<double>{0.0, 1.0}(rng);
      std::this_thread::sleep_for(std::min<steady::duration>(left, schedule.delay(n, {}, u)));
      if (kernel_try(exclusive, false)) return true;
    }
  }

  void kernel_unlock() noexcept { detail::file_lock::unlock(entry_->fd, opts_.family == lock_family::posix); }

  void write_owner() {
    // Best effort: the lock is held whether or not the note is written.
    // Built on first use: the first file_mutex on this file may not have
    // asked for it. Only the exclusive holder gets here, so no race.
    if (entry_->owner.empty()) entry_->owner = detail::owner_line();
    detail::file_lock::write_owner(entry_->fd, entry_->owner);
  }

  std::filesystem::path path_;
  file_mutex_options opts_;
  std::shared_ptr<detail::lock_entry> entry_;
  std::uint64_t generation_ = 0;
};

}  // namespace dibs
