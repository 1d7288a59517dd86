// dibs/detail/shared_log/append.hpp: a writer's side of an append to a
// shared log: claim a free slot of the lock file (freeing those of writers
// that provably died), copy the record in and mark it ready, then try the
// lock, and wait (spin, yield, sleep on the slot's futex) until a holder has
// written it; or, for a record too large for a slot or one that found none
// free, take the lock and write it itself with the queued ones. Timeouts
// and cancellation withdraw a record only while no holder has taken it.
// Separate from the holder's side (holder.hpp): this is the waiting, and
// what the slot's states mean to the writer that owns it.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stop_token>
#include <string_view>
#include <system_error>

#include <dibs/detail/owner.hpp>
#include <dibs/detail/posix/robust_mutex.hpp>
#include <dibs/detail/shared_log/holder.hpp>
#include <dibs/detail/shared_log/shared_state.hpp>
#include <dibs/error.hpp>

namespace dibs::detail {

// One writer's queue of records: the slots of the lock file `state` it
// claims, and how long it waits for the lock (`lock_timeout`).
class log_queue {
public:
  log_queue(log_shared_state& state, log_holder& holder, std::chrono::milliseconds lock_timeout) noexcept
      : state_(state), holder_(holder), lock_timeout_(lock_timeout) {}

  // Effects: takes a free slot. Returns: its index, or nullopt if none is free.
  std::optional<unsigned> claim_slot() {
    const auto& me = this_process_base();  // before a claim: it may throw
    for (int pass = 0; pass < 2; ++pass) {
      for (unsigned k = 0; k < log_slot_count; ++k) {
        const unsigned i = (hint_ + k) % log_slot_count;
        slot& s = state_.slots[i];
        std::uint32_t w = s.word.load(std::memory_order_relaxed);
        if (slot_state(w) != slot::free) continue;
        const std::uint32_t ticket = slot_ticket(w) + slot::ticket_unit;
        if (!s.word.compare_exchange_strong(w, ticket + slot::filling, std::memory_order_acquire)) continue;
        s.start.store(me.start, std::memory_order_relaxed);
        s.pid_ns.store(pack_namespaces(me.pid_ns, me.time_ns), std::memory_order_relaxed);
        s.pid.store(static_cast<std::int32_t>(me.pid), std::memory_order_relaxed);
        s.owner_ticket.store(ticket, std::memory_order_release);
        hint_ = i;
        return i;
      }
      if (pass == 0 && !reclaim_dead_slots()) break;
    }
    return std::nullopt;
  }

  // Effects: queues the record in slot i (claimed by claim_slot) and waits
  // until it is written (by whoever holds the lock, this writer included)
  // or it fails. Returns: the failure, with `what` saying what failed.
  std::error_code append_queued(unsigned i, std::string_view record, bool newline, bool sync, const char*& what,
                                const std::stop_token& stop) {
    slot& s = state_.slots[i];
    std::memcpy(s.data, record.data(), record.size());
    if (newline) s.data[record.size()] = '\n';
    s.size = static_cast<std::uint32_t>(record.size() + (newline ? 1 : 0));
    s.sync = sync ? 1 : 0;
    s.error = 0;
    s.failure = 0;
    const std::uint32_t ticket = slot_ticket(s.word.load(std::memory_order_relaxed));
    s.word.store(ticket + slot::ready, std::memory_order_seq_cst);
    state_.ready_slots.fetch_or(std::uint64_t{1} << i, std::memory_order_seq_cst);
    const auto deadline = std::chrono::steady_clock::now() + lock_timeout_;
    int rounds = 0, stuck = 0;
    for (;;) {
      std::uint32_t w = s.word.load(std::memory_order_acquire);
      const std::uint32_t st = slot_state(w);
      if (st == slot::done || st == slot::failed) {
        const int err = s.error;
        const auto failure = static_cast<log_failure>(s.failure);
        s.word.store(ticket + slot::free, std::memory_order_release);
        if (err == 0) return {};
        what = describe_log_failure(failure);
        return {err, std::system_category()};
      }
      // Ready or taken: try to be the one who writes it.
      const int rc = state_.mutex.try_lock();
      if (rc == 0 || rc == EOWNERDEAD) {
        // Flag it again: a holder that died may have cleared the flag.
        state_.ready_slots.fetch_or(std::uint64_t{1} << i);
        try {
          holder_.write_queued(rc, nullptr);
          // Held the lock and wrote what was queued, yet this record is
          // where it was: never spin on that. Wait a moment (a holder's
          // repair, or the lock's next holder, moves it on), and give up
          // at the deadline while it is still ours to withdraw.
          if (const auto now_w = s.word.load(std::memory_order_acquire);
              now_w == w && ++stuck > 2) {
            if (slot_state(now_w) == slot::ready && std::chrono::steady_clock::now() >= deadline &&
                s.word.compare_exchange_strong(w, ticket + slot::free)) {
              what = "timed out waiting for the lock of log";
              return errc::timed_out;
            }
            futex_wait(s.word, now_w, std::chrono::milliseconds{1});
          }
        } catch (...) {
          // The repair of a dead holder's batch failed. A record queued
          // again (a batch cut short) is not in the file: withdraw it. One
          // still taken is in a batch whose size could not be checked; it is
          // never withdrawn (a later holder may be writing it): wait for a
          // repair that can.
          w = s.word.load(std::memory_order_acquire);
          if (slot_state(w) == slot::ready && s.word.compare_exchange_strong(w, ticket + slot::free)) throw;
          futex_wait(s.word, w, holder_check);
          continue;
        }
        continue;
      }
      if (rc != EBUSY) {
        if (slot_state(w) == slot::ready && s.word.compare_exchange_strong(w, ticket + slot::free)) {
          what = "cannot take the lock of log";
          return {rc, std::system_category()};
        }
        futex_wait(s.word, w, holder_check);  // taken: a holder is writing it
        continue;
      }
      // Someone holds the lock: it writes this record, or looks for it after
      // unlocking. It is likely running and about to: watch for a while
      // before sleeping (a sleep costs the holder a wake-up call).
      if (rounds < spin_rounds + yield_rounds) {
        if (rounds++ < spin_rounds) {
          for (int k = 0; k < pauses_per_round && s.word.load(std::memory_order_relaxed) == w; ++k) cpu_relax();
        } else {
          ::sched_yield();
        }
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      auto wait = std::chrono::nanoseconds(holder_check);
      if (const bool stopped = stop.stop_requested(); stopped || now >= deadline) {
        if (st == slot::ready && s.word.compare_exchange_strong(w, ticket + slot::free)) {
          what = stopped ? "cancelled waiting for the lock of log" : "timed out waiting for the lock of log";
          return stopped ? errc::cancelled : errc::timed_out;
        }
        // Taken: being written. Its outcome comes soon, or the holder died
        // and the next one (perhaps this writer) deals with the batch.
      } else {
        wait = std::min(wait, std::chrono::nanoseconds(deadline - now));
      }
      if (!(w & slot::waiting)) {
        // Say so before sleeping, then try the lock once more: a holder that
        // unlocked before seeing the flag has left the lock free.
        s.word.compare_exchange_strong(w, w | slot::waiting);
        continue;
      }
      futex_wait(s.word, w, wait);
    }
  }

  // Effects: writes a record that is not queued (too large, or no free slot)
  // under the lock, with whatever is queued. Returns: as append_queued.
  std::error_code append_own(std::string_view record, bool newline, bool sync, const char*& what,
                             const std::stop_token& stop) {
    int rc;
    if (!stop.stop_possible()) {
      rc = state_.mutex.lock_for(lock_timeout_);
    } else {  // in slices, looking at the stop token between them
      const auto deadline = std::chrono::steady_clock::now() + lock_timeout_;
      for (;;) {
        if (stop.stop_requested()) {
          what = "cancelled waiting for the lock of log";
          return errc::cancelled;
        }
        const auto left = deadline - std::chrono::steady_clock::now();
        rc = state_.mutex.lock_for(std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::clamp<std::chrono::steady_clock::duration>(left, std::chrono::steady_clock::duration::zero(),
                                                            holder_check)));
        if (rc != ETIMEDOUT || left <= std::chrono::steady_clock::duration::zero()) break;
      }
    }
    if (rc == ETIMEDOUT) {
      what = "timed out waiting for the lock of log";
      return errc::timed_out;
    }
    if (rc != 0 && rc != EOWNERDEAD) {
      what = "cannot take the lock of log";
      return {rc, std::system_category()};
    }
    own_log_record own{record, newline, sync};
    holder_.write_queued(rc, &own);
    if (own.error == 0) return {};
    what = describe_log_failure(own.failure);
    return {own.error, std::system_category()};
  }

private:
  using slot = log_slot;
  // How long a writer whose record is queued sleeps before it looks again
  // whether the lock holder died (nobody would wake it then).
  static constexpr std::chrono::milliseconds holder_check{5};
  // A writer whose record is queued while another holds the lock watches
  // its slot for spin_rounds x 50 pauses (the holder is most likely running
  // and about to write it), then gives its processor away yield_rounds times
  // (so that other writers can queue theirs into the same batch), then
  // sleeps. Measured with 8 writers on 2 cores (docs/BENCHMARKS.md):
  // sleeping at once ran at 0.2x of bare appends, spinning only at 0.6x.
  static constexpr int spin_rounds = 4, yield_rounds = 16, pauses_per_round = 50;

  // Effects: frees slots whose owner died while filling them or before it
  // saw its record's outcome. Returns: whether any was freed.
  bool reclaim_dead_slots() {
    bool any = false;
    for (slot& s : state_.slots) {
      std::uint32_t w = s.word.load(std::memory_order_acquire);
      const std::uint32_t st = slot_state(w);
      if (st != slot::filling && st != slot::done && st != slot::failed) continue;
      // Who claimed it, as that claim wrote it (if it got that far; else keep it).
      if (s.owner_ticket.load(std::memory_order_acquire) != slot_ticket(w)) continue;
      const std::uint64_t ns = s.pid_ns.load(std::memory_order_relaxed);
      const process_identity owner{s.pid.load(std::memory_order_relaxed), s.start.load(std::memory_order_relaxed),
                                   static_cast<std::uint32_t>(ns), static_cast<std::uint32_t>(ns >> 32)};
      // (Same host and boot: the lock file is set up anew after a reboot.)
      if (!provably_gone(owner)) continue;  // alive, or cannot tell: keep it
      // Fails if the slot moved on meanwhile (then pid may not be its owner's).
      if (s.word.compare_exchange_strong(w, slot_ticket(w) + slot::free)) any = true;
    }
    return any;
  }

  log_shared_state& state_;
  log_holder& holder_;
  std::chrono::milliseconds lock_timeout_;
  unsigned hint_ = 0;  // where the next claim starts looking: where the last one succeeded
};

}  // namespace dibs::detail
