// dibs/detail/wait_in_turn.hpp: how a lease waits for its turn, written
// once for lease_mutex (one record) and lease_semaphore (N records, one
// queue): tries in the order of a store's waiter queue where it has one,
// else with backoff and the store's change notification.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <stop_token>
#include <string_view>
#include <type_traits>
#include <utility>

#include <dibs/backoff.hpp>
#include <dibs/detail/cancel.hpp>
#include <dibs/store.hpp>

namespace dibs::detail {

template <class S>
concept store_with_change_wait = requires(const S& s, std::string_view key, std::chrono::nanoseconds t) {
  { s.wait_for_change(key, t) } -> std::same_as<bool>;
};

// A store that keeps a queue of the waiters for a key (file_store: this
// host's processes, in a file beside the record); lease_mutex then takes
// turns first come, first served, and an unlock wakes the next waiter.
template <class S>
concept store_with_waiter_queue = requires(const S& s, std::string_view key, bool create) {
  { s.open_waiter_queue(key, create) } -> std::same_as<typename S::waiter_queue>;
};
struct no_waiter_queue {};
template <class S>
struct waiter_queue_of {
  using type = no_waiter_queue;
};
template <store_with_waiter_queue S>
struct waiter_queue_of<S> {
  using type = typename S::waiter_queue;
};

// How long a queued waiter lets the queue stand still (no unlock, no
// acquisition, and the lock not found held) before it tries the lock out of
// turn: the waiter whose turn it is may be stopped (SIGSTOP, a debugger) or
// starved of a processor.
// The k-th waiter in line waits k times this, so only the one right behind
// a stopped waiter tries, and the rest keep their order. A waiter that
// takes the lock out of turn marks the ones it passed, which every waiter
// and unlock then skips until they run again (and go to the back), so a
// stopped one costs this once, not each time it would come to the head.
inline constexpr std::chrono::milliseconds queue_patience{100};

// A cancellable wait looks at its stop token at least this often: a
// store operation waits at most this long in one go, and so does a sleep
// of the store's change notification.
inline constexpr std::chrono::milliseconds stop_check{10};

// Waiting, with a store that has a waiter queue: a waiter queues (takes a
// ticket) when its first try fails, or before it when others are queued
// already, and then tries only when no live waiter is ahead of it; it
// sleeps on its own slot, woken by the unlock that gives it its turn, or
// after its backoff delay (a holder that died unlocks nobody; proof (a)
// or (b) is found by the try that follows). If the queue stands still for
// queue_patience while it is not this waiter's turn, it tries anyway.
// Without a queue (other stores, or no slot free): backoff and the
// store's change notification, unordered.
//
// The parts of one wait, given by the lock that waits:
//   queue            its waiter queue (no_waiter_queue: none), opened by
//   open(create)     -> bool: true if `queue` is open (made if `create`);
//   try_once(free_first, limit) -> bool: one try, giving up on the store
//                    at `limit` (false); free_first: the lock is probably
//                    free, write before reading;
//   change_wait      nullptr, or (nanoseconds) -> bool: the store's change
//                    notification for what is waited on;
//   cancelled()      [[noreturn]]: throws errc::cancelled, saying what;
//   pass_on          after an acquisition through the queue, wake the next
//                    waiter too (a semaphore: more than one may get in).
// Returns: true once try_once succeeded; false if `until` passed first.
// Throws: what try_once throws; cancelled()'s error on a stop request.
template <class Queue, class Open, class Try, class ChangeWait, class Cancelled>
bool wait_in_turn(Queue& queue, Open open, Try try_once, ChangeWait change_wait, Cancelled cancelled,
                  const exponential_backoff& backoff, bool pass_on, dibs::time_limit until,
                  const std::stop_token& st) {
  struct {
    Queue& queue;
    Open& open;
    Try& try_once;
    ChangeWait& change_wait;
    Cancelled& cancelled;
    const exponential_backoff& backoff;
    bool pass_on;
  } t{queue, open, try_once, change_wait, cancelled, backoff, pass_on};
  using clock = std::chrono::steady_clock;
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const bool stoppable = st.stop_possible();
  constexpr bool queued = !std::is_same_v<Queue, no_waiter_queue>;
  // Our slot in the queue while we wait; given up however we leave.
  struct place {
    Queue& queue;
    int slot = -1;
    ~place() {
      if constexpr (queued) {
        if (slot >= 0) queue.leave(slot, false);
      }
    }
  } at{t.queue};
  // Opened (made) at the first acquisition, so that later ones, and their
  // unlocks, find it mapped at no cost.
  if constexpr (queued) (void)t.open(true);
  std::optional<std::uint64_t> seen_progress;
  clock::time_point progress_since{};
  bool woken = true;  // the lock is probably free: create first
  bool full = false;  // every slot was taken when we looked: wait unordered this time
  for (std::uint64_t n = 0;; ++n) {
    if (st.stop_requested()) t.cancelled();
    std::uint32_t word = 0;
    bool my_turn = true, out_of_turn = false;
    if constexpr (queued) {
      if (at.slot < 0 && !full && t.queue && t.queue.busy()) full = (at.slot = t.queue.enter()) < 0;
      if (at.slot >= 0) {
        // Passed while it stood still (stopped, or starved): running again,
        // it goes to the back.
        if (t.queue.was_passed(at.slot)) t.queue.requeue(at.slot);
        word = t.queue.wake_word(at.slot);
        const int ahead = t.queue.ahead(at.slot);
        my_turn = ahead == 0;
        if (!my_turn) {
          const auto p = t.queue.progress();
          const auto now = clock::now();
          if (!seen_progress || *seen_progress != p) {
            seen_progress = p;
            progress_since = now;
          } else if (now - progress_since >= queue_patience * ahead) {
            my_turn = out_of_turn = true;  // the waiters ahead do not take their turn
          }
        }
      }
    }
    if (my_turn && t.try_once(woken, stoppable ? std::min(until, clock::now() + stop_check) : until)) {
      if constexpr (queued) {
        if (at.slot >= 0) {
          t.queue.leave(std::exchange(at.slot, -1), true, out_of_turn);
          if (t.pass_on) t.queue.wake_first();
        }
      }
      return true;
    }
    woken = false;
    // Tried out of turn and the lock was held: the queue stands still for
    // its holder, not for the waiter ahead, whose patience starts again
    // (else every waiter behind a long hold would try at each look, and
    // take the lock between its unlock and the woken waiter's try).
    if (out_of_turn) progress_since = clock::now();
    if constexpr (queued) {
      if (at.slot < 0 && !full && t.open(true)) {
        full = (at.slot = t.queue.enter()) < 0;
        // Look again at once: an unlock between our try and our queueing
        // woke nobody for us.
        if (at.slot >= 0) continue;
      }
    }
    auto delay = t.backoff.delay(n, {}, std::uniform_real_distribution<double>{0.0, 1.0}(rng));
    if (until != dibs::time_limit::max()) {
      const auto left = until - clock::now();
      if (left <= clock::duration::zero()) return false;
      delay = std::min<std::chrono::nanoseconds>(delay, left);
    }
    if constexpr (queued) {
      if (at.slot >= 0) {
        // A waiter whose turn it is not yet is woken when it comes; it
        // looks on its own only for a waiter ahead that died after it was
        // woken, and for the patience. Waking at the backoff's first,
        // short delays would take processors from the handoff itself.
        if (!my_turn) delay = std::max<std::chrono::nanoseconds>(delay, queue_patience / 2);
        if (until != dibs::time_limit::max()) delay = std::min<std::chrono::nanoseconds>(delay, until - clock::now());
        for (const auto end = clock::now() + delay; !(stoppable && st.stop_requested());) {
          const auto left = end - clock::now();
          if (left <= clock::duration::zero()) break;
          t.queue.wait(at.slot, word, stoppable ? std::min<std::chrono::nanoseconds>(left, stop_check) : left);
          if (t.queue.wake_word(at.slot) != word) {
            woken = true;  // our turn: the lock was just unlocked
            break;
          }
        }
        continue;
      }
    }
    if constexpr (!std::is_null_pointer_v<ChangeWait>) {
      if (!stoppable) {
        (void)t.change_wait(delay);
      } else {
        for (const auto end = clock::now() + delay; !st.stop_requested();) {
          const auto left = end - clock::now();
          if (left <= clock::duration::zero() || t.change_wait(std::min<std::chrono::nanoseconds>(left, stop_check)))
            break;
        }
      }
    } else {
      (void)sleep_unless_stopped(delay, st);
    }
  }
}

}  // namespace dibs::detail
