// dibs/detail/posix/waiter_queue.hpp: a first-come, first-served queue of
// the processes of one host that wait for one lock, in a small file that
// each of them maps (file_store keeps it beside a record, for lease_mutex).
//
// The file is one page: a header (the next ticket, a progress counter) and
// 63 slots. A waiter owns a slot while it holds an open-file-description
// lock (F_OFD_SETLK) on the slot's first byte, and writes its ticket there.
// The kernel drops that lock when the waiter dies, however it dies, so a
// slot whose byte nobody locks is no waiter, whatever ticket it still shows:
// a waiter killed while queued is passed over at once. Each slot has a
// futex word; whoever unlocks the lock bumps the word of the live slot with
// the lowest ticket and wakes that process only.
//
// The queue only orders the waiters; it never decides who holds the lock.
// The record's compare-and-set does that, so a queue that lies (a file
// damaged or shared with another host over NFS, where mappings are not
// coherent) can cost fairness and time, never mutual exclusion.
// Separate, like the other files here, so that a port to another system
// gives it a body of its own (detail/win32/: a named section and
// WaitOnAddress cannot be shared between processes; there the queue would
// be a directory of entries held open without sharing).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <utility>

#include <dibs/detail/posix/fork_fds.hpp>
#include <dibs/detail/posix/robust_mutex.hpp>
#include <dibs/detail/posix/shared_mapping.hpp>
#include <dibs/detail/posix/sys.hpp>

namespace dibs::detail {

struct queue_slot {
  std::atomic<std::uint64_t> ticket;  // 0: nobody's; else its owner's place (smaller: earlier)
  std::atomic<std::uint32_t> wake;    // bumped to wake the owner (a shared futex word)
  std::atomic<std::int32_t> pid;      // the owner, for a person reading the file
  std::atomic<std::uint32_t> passed;  // 1: a waiter behind it took the lock out of turn; skipped until it runs
  char padding[44];
};
static_assert(sizeof(queue_slot) == 64);

struct queue_page {
  static constexpr std::uint64_t magic_value = 0x3130307571736264;  // "dbsqu001" in the file
  static constexpr int slots = 63;
  std::atomic<std::uint64_t> magic;        // 0 in a fresh (all zero) file
  std::atomic<std::uint64_t> next_ticket;  // the last ticket handed out
  std::atomic<std::uint64_t> progress;     // bumped by every unlock and every acquisition through the queue
  std::atomic<std::uint64_t> passes;       // acquisitions out of turn (past a stopped or starved waiter)
  char padding[32];
  queue_slot slot[slots];
};
static_assert(sizeof(queue_page) == 4096);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free);

class waiter_queue {
public:
  /// A queue that is not there: every call is a no-op and `*this` is false.
  waiter_queue() = default;
  /// Effects: opens (with `create`: creating, with exactly `mode`) and maps
  /// the queue file at `path`. Where that cannot be done (no such file
  /// without `create`, no permission, a file that is not a queue of this
  /// format, no memory) the queue is empty and the lock works unordered,
  /// as it did before queues: nothing is reported, as nothing is wrong.
  waiter_queue(const std::filesystem::path& path, mode_t mode, bool create) {
    constexpr int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY;
    int fd = create ? fork_fds::open(path.c_str(), flags | O_CREAT | O_EXCL, mode) : -1;
    if (fd >= 0) {
      (void)::fchmod(fd, mode);  // exactly `mode`, whatever the umask
      if (allocate_file(fd, sizeof(queue_page)) != 0) {
        fork_fds::close(fd);
        return;
      }
    } else {
      if (create && errno != EEXIST) return;
      fd = fork_fds::open(path.c_str(), flags);
      if (fd < 0) return;
    }
    struct ::stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      fork_fds::close(fd);
      return;
    }
    // Made a moment ago and not grown yet (or its maker was killed before
    // it grew it): grow it here. Allocating is idempotent and never
    // changes bytes that are there, and all zero is an empty queue.
    if (st.st_size < static_cast<off_t>(sizeof(queue_page)) && allocate_file(fd, sizeof(queue_page)) != 0) {
      fork_fds::close(fd);
      return;
    }
    void* p = map_shared(fd, sizeof(queue_page));
    if (!p) {
      fork_fds::close(fd);
      return;
    }
    auto* page = static_cast<queue_page*>(p);
    std::uint64_t m = 0;
    if (!page->magic.compare_exchange_strong(m, queue_page::magic_value) && m != queue_page::magic_value) {
      unmap_shared(p, sizeof(queue_page));
      fork_fds::close(fd);
      return;
    }
    fd_ = fd;
    page_ = page;
    pid_ = current_pid();
  }
  waiter_queue(waiter_queue&& o) noexcept
      : fd_(std::exchange(o.fd_, -1)),
        page_(std::exchange(o.page_, nullptr)),
        pid_(std::exchange(o.pid_, 0)),
        kept_(std::exchange(o.kept_, -1)) {}
  waiter_queue& operator=(waiter_queue&& o) noexcept {
    if (this != &o) {
      close();
      fd_ = std::exchange(o.fd_, -1);
      page_ = std::exchange(o.page_, nullptr);
      pid_ = std::exchange(o.pid_, 0);
      kept_ = std::exchange(o.kept_, -1);
    }
    return *this;
  }
  ~waiter_queue() { close(); }

  /// Returns: true if the queue is there for this process (false in a child
  /// made by fork(): its descriptor was closed at the fork; open it again).
  explicit operator bool() const noexcept { return page_ != nullptr && pid_ == current_pid(); }

  /// Returns: true if some slot shows a ticket (a waiter, or a dead one's leftover).
  bool busy() const noexcept {
    for (const auto& s : page_->slot)
      if (s.ticket.load(std::memory_order_acquire) != 0) return true;
    return false;
  }

  /// Effects: takes a free slot (one nobody holds the lock of; the one this
  /// object kept after its last acquisition, if it did) and the next
  /// ticket. Returns: the slot, or -1 if all are taken (then wait unordered).
  int enter() noexcept {
    if (kept_ >= 0) {
      const int i = std::exchange(kept_, -1);
      page_->slot[i].pid.store(current_pid(), std::memory_order_relaxed);
      page_->slot[i].passed.store(0);
      page_->slot[i].ticket.store(page_->next_ticket.fetch_add(1) + 1);
      return i;
    }
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < queue_page::slots; ++i) {
        auto& s = page_->slot[i];
        // First the slots that look free; then those a dead waiter left.
        if ((s.ticket.load(std::memory_order_relaxed) != 0) != (pass == 1)) continue;
        if (!range_lock(i, F_WRLCK)) continue;
        s.pid.store(current_pid(), std::memory_order_relaxed);
        s.passed.store(0);
        s.ticket.store(page_->next_ticket.fetch_add(1) + 1);
        return i;
      }
    }
    return -1;
  }

  /// Effects: gives slot `i`'s place up. `acquired`: its owner now holds
  /// the lock: counts progress, and keeps the slot (its lock, with no
  /// ticket) for its next enter(), which then needs no system call; with
  /// `passed`, it took the lock out of turn, so every live waiter still
  /// ahead (it did not take its turn: stopped, or starved of a processor)
  /// is marked passed: skipped by first(), ahead() and wake_first() until
  /// it runs again and requeue()s itself at the back. A stopped waiter so
  /// costs the queue's patience once, not each time it would come to the
  /// head again. Otherwise (it gave up waiting) frees the slot and wakes
  /// the first waiter, in case the lock was handed to this one and is free.
  void leave(int i, bool acquired, bool passed = false) noexcept {
    auto& s = page_->slot[i];
    const std::uint64_t mine = s.ticket.load();
    s.ticket.store(0);
    s.passed.store(0);
    if (!acquired) {
      s.pid.store(0, std::memory_order_relaxed);
      (void)range_lock(i, F_UNLCK);
      return wake_first();
    }
    kept_ = i;
    page_->progress.fetch_add(1);
    if (!passed) return;
    page_->passes.fetch_add(1);
    for (int j = 0; j < queue_page::slots; ++j) {
      auto& o = page_->slot[j];
      const std::uint64_t t = o.ticket.load();
      if (j == i || t == 0 || t >= mine || o.passed.load() != 0 || !alive(j)) continue;
      o.passed.store(1);
    }
  }

  /// Returns: whether slot `i`'s owner was passed (leave()) while it stood still.
  bool was_passed(int i) const noexcept { return page_->slot[i].passed.load() != 0; }
  /// Effects: slot `i`'s owner, running again after it was passed, takes
  /// the next ticket: the back of the queue.
  void requeue(int i) noexcept {
    auto& s = page_->slot[i];
    s.ticket.store(page_->next_ticket.fetch_add(1) + 1);
    s.passed.store(0);
  }

  /// Returns: how many live waiters that were not passed hold a ticket
  /// smaller than slot `i`'s (0: it is first).
  int ahead(int i) const noexcept {
    const std::uint64_t mine = page_->slot[i].ticket.load();
    int n = 0;
    for (int j = 0; j < queue_page::slots; ++j) {
      const auto& o = page_->slot[j];
      const std::uint64_t t = o.ticket.load();
      if (j != i && t != 0 && t < mine && o.passed.load() == 0 && alive(j)) ++n;
    }
    return n;
  }
  /// Returns: true if no live waiter that was not passed holds a ticket
  /// smaller than slot `i`'s.
  bool first(int i) const noexcept { return ahead(i) == 0; }

  /// Effects: counts progress (the lock was just unlocked) and wakes the
  /// live waiter with the smallest ticket.
  void wake_first() noexcept {
    page_->progress.fetch_add(1);
    for (std::uint64_t after = 0;;) {  // in ticket order, past the dead
      int best = -1;
      std::uint64_t best_ticket = 0;
      for (int j = 0; j < queue_page::slots; ++j) {
        const std::uint64_t t = page_->slot[j].ticket.load();
        if (t > after && page_->slot[j].passed.load() == 0 && (best < 0 || t < best_ticket)) {
          best = j;
          best_ticket = t;
        }
      }
      if (best < 0) return;
      if (alive(best)) {
        page_->slot[best].wake.fetch_add(1);
        futex_wake(page_->slot[best].wake);
        return;
      }
      after = best_ticket;
    }
  }

  /// Returns: how many live waiters are queued (each costs a system call).
  int queued() const noexcept {
    int n = 0;
    for (int j = 0; j < queue_page::slots; ++j) n += page_->slot[j].ticket.load() != 0 && alive(j);
    return n;
  }

  /// Returns: the progress counter (unlocks plus acquisitions through the queue).
  std::uint64_t progress() const noexcept { return page_->progress.load(); }
  /// Returns: how many acquisitions went out of turn, past a waiter that
  /// stood still, since the queue file was made.
  std::uint64_t passes() const noexcept { return page_->passes.load(); }
  /// Returns: slot `i`'s wake word, to pass to wait() after looking at the lock.
  std::uint32_t wake_word(int i) const noexcept { return page_->slot[i].wake.load(); }
  /// Effects: sleeps until slot `i` is woken after `seen` was read, or
  /// `timeout` passes (or spuriously).
  void wait(int i, std::uint32_t seen, std::chrono::nanoseconds timeout) noexcept {
    futex_wait(page_->slot[i].wake, seen, timeout);
  }

private:
  static off_t offset_of(int i) noexcept { return static_cast<off_t>(offsetof(queue_page, slot) + sizeof(queue_slot) * static_cast<std::size_t>(i)); }

  // Effects: takes (F_WRLCK) or drops (F_UNLCK) slot i's lock, not waiting.
  bool range_lock(int i, short type) const noexcept {
    struct ::flock l {};
    l.l_type = type;
    l.l_whence = SEEK_SET;
    l.l_start = offset_of(i);
    l.l_len = 1;
    return ::fcntl(fd_, F_OFD_SETLK, &l) == 0;
  }

  // Returns: true unless slot i's lock is provably free (its owner left or
  // died). What cannot be asked counts as alive: then the waiters behind it
  // go after lease_mutex's patience.
  bool alive(int i) const noexcept {
    struct ::flock l {};
    l.l_type = F_WRLCK;
    l.l_whence = SEEK_SET;
    l.l_start = offset_of(i);
    l.l_len = 1;
    if (::fcntl(fd_, F_OFD_GETLK, &l) != 0) return true;
    return l.l_type != F_UNLCK;
  }

  void close() noexcept {
    if (!page_) return;
    // In a forked child the descriptor was closed at the fork; its number
    // may name another file now.
    // Closing it drops the lock of a kept slot.
    if (pid_ == current_pid()) {
      if (kept_ >= 0) page_->slot[kept_].pid.store(0, std::memory_order_relaxed);
      fork_fds::close(fd_);
    }
    unmap_shared(page_, sizeof(queue_page));
    page_ = nullptr;
    fd_ = -1;
    kept_ = -1;
  }

  int fd_ = -1;
  queue_page* page_ = nullptr;
  pid_t pid_ = 0;
  int kept_ = -1;  // the slot this object still holds the lock of, with no ticket
};

}  // namespace dibs::detail
