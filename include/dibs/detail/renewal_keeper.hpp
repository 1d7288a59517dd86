// dibs/detail/renewal_keeper.hpp: renews every lease a process holds, and
// tells each holder when its lease has run out.
//
// One scheduler thread per process watches every hold; it never calls the
// store or the program's code itself. What falls due (a renewal, or the end
// of a lease whose renewal has not been confirmed) runs on a pool of worker
// threads that grows when all are busy, so a renewal stuck in the store (a
// record locked by a stopped process, a server that does not answer) delays
// no other lease's renewal and no other lease's end. Taking a lock starts no
// thread once the pool has one idle.
#pragma once

#ifndef _WIN32
#include <pthread.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <thread>

#include <dibs/detail/sys.hpp>
#include <dibs/detail/validity.hpp>

namespace dibs::detail {

class renewal_keeper {
public:
  using clock = std::chrono::steady_clock;

  struct hooks {
    /// Renews the lease; returns false to stop renewing (lost, or released).
    std::function<bool()> renew;
    /// Tells the holder, once, that its lease ran out unrenewed (called
    /// after the keeper has marked `hold` lost).
    std::function<void()> lost;
    /// The holder's validity: when it runs out, and whether it is lost
    /// (nullptr: a periodic task with no end to watch).
    validity* hold = nullptr;
  };

  /// Returns: this process's keeper (a forked child gets a new one: the
  /// parent's threads do not exist there).
  static renewal_keeper& instance() {
#ifndef _WIN32  // Windows has no fork
    static const bool registered = [] {
      // In a child the parent's keeper belongs to threads that are not there
      // (its mutex may be held by one): forget it and start anew on use.
      ::pthread_atfork(nullptr, nullptr, [] {
        new (&creation_mutex()) std::mutex;
        current().store(nullptr, std::memory_order_relaxed);
      });
      return true;
    }();
    (void)registered;
#endif
    if (auto* k = current().load(std::memory_order_acquire)) return *k;
    std::lock_guard g{creation_mutex()};
    if (auto* k = current().load(std::memory_order_relaxed)) return *k;
    auto* k = new renewal_keeper;  // leaked: leases with static storage may outlive any destructor order
    current().store(k, std::memory_order_release);
    return *k;
  }

  /// Effects: calls h.renew every `every` (on a worker) until it returns false
  /// or remove(id); when h.hold runs out, marks it lost and calls h.lost.
  /// Returns: the id for remove().
  std::uint64_t add(clock::duration every, hooks h) {
    std::lock_guard g{m_};
    if (!scheduler_.joinable()) scheduler_ = std::thread([this] { schedule(); });
    const std::uint64_t id = ++last_id_;
    const auto due = clock::now() + every;
    entries_.emplace(id, entry{due, every, std::move(h)});
    // Wake the scheduler only if it sleeps past the new due time: waking it
    // for every hold cost ~14 µs a lock (two context switches).
    if (std::min(due, until(entries_.at(id))) < sleeping_until_) cv_.notify_all();
    return id;
  }

  /// Effects: stops renewing `id`; when it returns, no task of `id` is
  /// running (except the one that calls it, if it is called from a task).
  void remove(std::uint64_t id) {
    std::unique_lock g{m_};
    const auto it = entries_.find(id);
    if (it == entries_.end()) return;
    it->second.removed = true;
    const int own = current_task() == id ? 1 : 0;
    done_.wait(g, [&] { return it->second.running <= own; });
    entries_.erase(it);
  }

  /// Returns: true on a renewal thread, while it runs a renewal or an expiry.
  static bool in_task() noexcept { return current_task() != 0; }

private:
  struct entry {
    clock::time_point due;
    clock::duration every;
    hooks h;
    bool renewing = false;  // a renewal task is queued or running
    bool expiring = false;  // an expiry task is queued or running
    bool over = false;      // renewals stopped: lost, released, or expired
    bool removed = false;
    int running = 0;        // tasks of this entry queued or running
  };
  struct task {
    std::uint64_t id;
    bool expire;
  };

  renewal_keeper() = default;

  static std::mutex& creation_mutex() {
    static std::mutex m;
    return m;
  }
  static std::atomic<renewal_keeper*>& current() {
    static std::atomic<renewal_keeper*> k{nullptr};
    return k;
  }
  static std::uint64_t& current_task() {
    thread_local std::uint64_t id = 0;
    return id;
  }

  // How soon a renewal that failed is tried again.
  static clock::duration retry_after(clock::duration every) {
    return std::min<clock::duration>(every / 6, std::chrono::milliseconds{250});
  }

  static clock::time_point until(const entry& e) { return e.h.hold ? e.h.hold->end() : clock::time_point::max(); }

  // The expiry task: the hold is over if its end has passed (it may have
  // been renewed since the scheduler looked). Returns: true if over.
  static bool expire(const hooks& h) {
    if (!h.hold->expired()) return false;
    if (h.hold->mark_lost() && h.lost) h.lost();
    return true;
  }

  void schedule() {
    std::unique_lock g{m_};
    for (;;) {
      const auto now = clock::now();
      auto wake = clock::time_point::max();
      for (auto& [id, e] : entries_) {
        if (e.removed || e.over) continue;
        if (!e.expiring && e.h.hold) {
          if (const auto end = until(e); end <= now) dispatch(id, e, true);
          else wake = std::min(wake, end);
        }
        if (!e.renewing) {
          if (e.due <= now) {
            e.due = now + e.every;
            dispatch(id, e, false);
          } else {
            wake = std::min(wake, e.due);
          }
        }
      }
      sleeping_until_ = wake;
      if (wake == clock::time_point::max()) cv_.wait(g);
      else cv_.wait_until(g, wake);
      sleeping_until_ = clock::time_point::min();  // awake: add() need not wake it
    }
  }

  // Requires: m_ held.
  void dispatch(std::uint64_t id, entry& e, bool expire) {
    (expire ? e.expiring : e.renewing) = true;
    ++e.running;
    tasks_.push_back({id, expire});
    if (idle_ < static_cast<int>(tasks_.size())) {
      ++idle_;  // counted idle until it takes its first task
      std::thread([this] { work(); }).detach();
    }
    work_.notify_one();
  }

  void work() {
    std::unique_lock g{m_};
    for (;;) {
      work_.wait(g, [&] { return !tasks_.empty(); });
      const task t = tasks_.front();
      tasks_.pop_front();
      --idle_;
      const entry& e = entries_.at(t.id);  // not erased while a task of it is queued, only once it runs
      const hooks h = e.h;  // a copy: run unlocked
      const bool skip = e.removed || e.over;
      g.unlock();
      bool result = false, failed = false;
      if (!skip) {
        current_task() = t.id;
        try {
          result = t.expire ? expire(h) : h.renew();
        } catch (...) {
          // A renewal that failed for a moment (a store refusing it during
          // another thread's transaction, a server restarting) is tried
          // again soon, not a whole period later: the hold's lease must not
          // run out between two tries. The lease's end, watched here too,
          // says when it is over.
          result = !t.expire;
          failed = !t.expire;
        }
        current_task() = 0;
      }
      g.lock();
      ++idle_;
      // Found again: remove() called from this very task has erased it.
      if (const auto it = entries_.find(t.id); it != entries_.end()) {
        entry& done = it->second;
        if (t.expire) {
          done.expiring = false;
          if (result) done.over = true;
        } else {
          done.renewing = false;
          if (!result && !skip) done.over = true;
          if (failed) done.due = std::min(done.due, clock::now() + retry_after(done.every));
        }
        --done.running;
      }
      done_.notify_all();
      cv_.notify_all();  // the scheduler looks at this entry's times again
    }
  }

  std::mutex m_;
  std::condition_variable cv_;    // the scheduler's
  std::condition_variable work_;  // the workers'
  std::condition_variable done_;  // remove()'s
  std::map<std::uint64_t, entry> entries_;
  std::deque<task> tasks_;
  int idle_ = 0;
  std::uint64_t last_id_ = 0;
  // What the scheduler sleeps until (max: until woken; min: it is awake and
  // will look at the entries before it sleeps again).
  clock::time_point sleeping_until_ = clock::time_point::min();
  std::thread scheduler_;
};

}  // namespace dibs::detail
