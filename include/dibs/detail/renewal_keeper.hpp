// dibs/detail/renewal_keeper.hpp: one thread per process that renews every
// lease the process holds, so taking a lock does not start a thread.
#pragma once

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include <dibs/detail/posix.hpp>

namespace dibs::detail {

class renewal_keeper {
public:
  using clock = std::chrono::steady_clock;

  /// Returns: this process's keeper (a forked child gets a new one: the
  /// parent's thread does not exist there).
  static renewal_keeper& instance() {
    static std::mutex m;
    static renewal_keeper* keeper = nullptr;
    static pid_t owner = 0;
    std::lock_guard g{m};
    const pid_t self = current_pid();
    if (!keeper || owner != self) {
      keeper = new renewal_keeper;  // leaked: leases with static storage may outlive any destructor order
      owner = self;
    }
    return *keeper;
  }

  /// Effects: calls renew() every `every` until it returns false or remove(id).
  /// Returns: the id for remove().
  std::uint64_t add(clock::duration every, std::function<bool()> renew) {
    std::lock_guard g{m_};
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    const std::uint64_t id = ++last_id_;
    const auto due = clock::now() + every;
    entries_.emplace(id, entry{due, every, std::move(renew)});
    // Wake the thread only if it sleeps past the new due time: waking it for
    // every hold cost ~14 µs a lock (two context switches).
    if (due < waiting_until_) cv_.notify_all();
    return id;
  }

  /// Effects: stops renewing `id`; when it returns, its renew() is not running
  /// (unless called from inside that renew(), which then finishes by itself).
  void remove(std::uint64_t id) {
    std::unique_lock g{m_};
    entries_.erase(id);
    if (std::this_thread::get_id() == thread_.get_id()) return;
    cv_.wait(g, [&] { return running_ != id; });
  }

private:
  struct entry {
    clock::time_point due;
    clock::duration every;
    std::function<bool()> renew;
  };

  renewal_keeper() = default;

  void loop() {
    std::unique_lock g{m_};
    for (;;) {
      if (entries_.empty()) {
        waiting_until_ = clock::time_point::max();
        cv_.wait(g);
        continue;
      }
      auto next = entries_.begin();
      for (auto it = entries_.begin(); it != entries_.end(); ++it)
        if (it->second.due < next->second.due) next = it;
      if (const auto due = next->second.due; clock::now() < due) {
        // A copy: the entry may be erased while we wait (wait_until keeps a reference).
        waiting_until_ = due;
        cv_.wait_until(g, due);
        waiting_until_ = clock::time_point::min();  // awake: add() need not wake it
        continue;  // entries may have changed meanwhile
      }
      const std::uint64_t id = next->first;
      auto renew = next->second.renew;  // a copy: remove() may erase the entry while it runs
      next->second.due = clock::now() + next->second.every;
      running_ = id;
      g.unlock();
      bool again = false;
      try {
        again = renew();
      } catch (...) {
        again = true;  // a passing failure of the store: the lease's own code decides when it is lost
      }
      g.lock();
      running_ = 0;
      if (!again) entries_.erase(id);
      cv_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::uint64_t, entry> entries_;
  std::uint64_t last_id_ = 0;
  std::uint64_t running_ = 0;
  // What the thread sleeps until (max: until woken; min: it is awake and
  // will look at the entries before it sleeps again).
  clock::time_point waiting_until_ = clock::time_point::min();
  std::thread thread_;
};

}  // namespace dibs::detail
