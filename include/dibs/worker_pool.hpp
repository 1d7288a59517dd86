// dibs/worker_pool.hpp: a pool of threads that run a handler over the items
// of a marker_claim queue, with the claims taken, renewed and completed in
// batches: what River, Oban and graphile-worker give their users, with
// every guarantee of marker_claim.
//
//   dibs::postgres_store store{conninfo};
//   dibs::marker_claim<dibs::postgres_store> claims{store};
//   dibs::worker_pool pool{claims, [](const auto& c) { send_mail(c.key(), c.token()); },
//                          {.concurrency = 16}};
//   std::jthread t{[&](std::stop_token st) { pool.run(st); }};   // until t.request_stop()
//
// How it works (docs/guide-worker-pool.md says how to size it):
//   - one fetcher (the thread that calls run) claims items with
//     claim_next_n, up to `prefetch` at a time, into a local queue, and
//     claims again when the queue is half empty: a claim statement per
//     batch, not per item;
//   - `concurrency` handler threads take items from the local queue and
//     call the handler; the claims renew themselves meanwhile
//     (claim_options::renew), prefetched ones too;
//   - a handler that returns has its item completed; the completions of
//     all handlers are written together by one completer thread with
//     complete_n, as many as have gathered while the last batch was
//     written (no timer: a lone completion is written at once);
//   - a handler that throws has its item given back with the error
//     (claim::release: claim_options::retry_backoff decides when it comes
//     back; after max_attempts it is failed);
//   - when nothing is claimable the fetcher waits, from 1 ms doubling to
//     `idle_wait`, and wakes at once when the store says an item was
//     offered, where it can (postgres_store: NOTIFY);
//   - a stop (std::stop_token) claims nothing more, gives back the items
//     not yet started (claimable at once, their attempt not counted), lets
//     the running handlers finish and writes their completions before
//     run() returns.
// A crash between a handler's return and its batch's commit loses nothing:
// the item's claim was never completed, so it comes back (when its worker
// is proved gone, or after its lease) and runs again. As with every
// at-least-once handler, make its effect idempotent or fence it with the
// claim's token.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/error.hpp>
#include <dibs/marker_claim.hpp>

namespace dibs {

struct worker_pool_options {
  /// Handler threads: items run at once.
  std::size_t concurrency = 4;
  /// Items claimed ahead of the handlers (the local queue); 0: twice
  /// `concurrency`. Each is a claim that renews itself while it waits: a
  /// larger queue costs fewer claim statements, and holds items another
  /// process could have run.
  std::size_t prefetch = 0;
  /// Only items whose key starts with this.
  std::string prefix{};
  /// The longest wait between two looks at an idle queue (the wait starts
  /// at 1 ms and doubles); a store that can say an item was offered
  /// (postgres_store) wakes the pool at once.
  std::chrono::milliseconds idle_wait{250};
  /// Called with what went wrong when the pool cannot claim or complete
  /// (the store failed; it goes on, and the items come back after their
  /// lease). Unset: one line on stderr.
  std::function<void(const std::exception&)> on_error{};
};

/// What run() did.
struct worker_pool_stats {
  std::uint64_t completed = 0;  ///< handlers returned, items completed
  std::uint64_t released = 0;   ///< handlers threw, items given back
  std::uint64_t lost = 0;       ///< handlers returned, but the claim had been taken over: not completed
  std::uint64_t returned = 0;   ///< claimed, never started (given back at a stop)
  std::uint64_t errors = 0;     ///< failed claims or completion batches (on_error)
  std::uint64_t batches = 0;    ///< completion batches written
};

template <class Store>
class worker_pool {
public:
  using claims_type = marker_claim<Store>;
  using claim = typename claims_type::claim;
  using handler_type = std::function<void(const claim&)>;

  /// Requires: `claims` outlives the pool. `handler(const claim&)` runs an
  /// item: it returns when it is done, and throws to give it back.
  /// Throws: errc::invalid_argument if `concurrency` is 0 or above 1,024, or
  /// `prefetch` above 10,000.
  template <class Handler>
    requires std::is_invocable_v<Handler&, const claim&>
  worker_pool(claims_type& claims, Handler handler, worker_pool_options o = {})
      : claims_(claims), handler_(std::move(handler)), opts_(std::move(o)) {
    if (opts_.concurrency == 0 || opts_.concurrency > 1024)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::worker_pool: concurrency must be 1 to 1,024 (got {})",
                                          opts_.concurrency));
    if (opts_.prefetch > 10'000)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::worker_pool: prefetch must be at most 10,000 (got {})", opts_.prefetch));
    if (opts_.prefetch == 0) opts_.prefetch = 2 * opts_.concurrency;
  }

  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;

  /// Effects: runs items until `stop` is requested, then stops as the top
  /// of this header says. Returns: what it did.
  worker_pool_stats run(std::stop_token stop) { return go(std::move(stop), false); }

  /// Effects: as run(), but also returns once nothing is claimable and
  /// nothing is running or waiting to be completed (a batch job's "until
  /// the queue is empty"; items given back with a backoff that has not run
  /// out do not count as claimable).
  worker_pool_stats drain(std::stop_token stop = {}) { return go(std::move(stop), true); }

private:
  worker_pool_stats go(std::stop_token stop, bool until_empty) {
    state st;
    std::vector<std::jthread> threads;
    {
      // Threads end (and are joined) before the state they use.
      std::jthread completer{[&] { complete_loop(st); }};
      for (std::size_t i = 0; i < opts_.concurrency; ++i) threads.emplace_back([&] { handler_loop(st); });
      // A stop: no handler starts another item from here on.
      std::stop_callback wake{stop, [&] {
                                std::lock_guard g{st.m};
                                st.stopping = true;
                                st.cv.notify_all();
                              }};
      fetch_loop(st, stop, until_empty);
      {
        std::unique_lock g{st.m};
        // Not started: given back at once, without a backoff.
        while (!st.ready.empty()) {
          claim c = std::move(st.ready.front());
          st.ready.pop_front();
          g.unlock();
          try {
            (void)c.give_back_unstarted("the worker pool stopped before the item started");
          } catch (const std::exception& e) {
            report(st, e);
          }
          g.lock();
          ++st.stats.returned;
        }
        st.stopping = true;
        st.cv.notify_all();
      }
      threads.clear();  // the handlers finish what they run
      {
        std::lock_guard g{st.m};
        st.handlers_done = true;
        st.cv.notify_all();
      }
    }  // the completer writes what is left, and ends
    return st.stats;
  }

  struct state {
    std::mutex m;
    std::condition_variable cv;
    std::deque<claim> ready;         // claimed, not started
    std::vector<claim> done;         // handled, to be completed
    std::size_t running = 0;         // handlers running an item
    bool stopping = false;           // no handler starts another item
    bool handlers_done = false;      // no item will be added to `done`
    bool completing = false;         // the completer is writing a batch
    std::uint64_t generation = 0;    // grows when a handler or a batch ends (an item may be claimable)
    worker_pool_stats stats;
  };

  void fetch_loop(state& st, const std::stop_token& stop, bool until_empty) {
    auto pause = std::chrono::milliseconds{1};
    std::uint64_t seen = 0;  // st.generation when the last claim began
    while (!stop.stop_requested()) {
      std::size_t room = 0;
      {
        std::unique_lock g{st.m};
        // Claim again once the local queue is half empty.
        st.cv.wait(g, [&] { return stop.stop_requested() || st.ready.size() <= opts_.prefetch / 2; });
        if (stop.stop_requested()) return;
        room = opts_.prefetch - st.ready.size();
        seen = st.generation;
      }
      std::vector<claim> got;
      bool failed = false;
      try {
        got = claims_.claim_next_n(room, opts_.prefix);
      } catch (const std::exception& e) {
        report(st, e);
        failed = true;
      }
      std::unique_lock g{st.m};
      if (failed) {
        // The store is away (a server restarting): again after a pause,
        // doubling, not at once.
        st.cv.wait_for(g, pause, [&] { return stop.stop_requested(); });
        pause = std::min(pause * 2, opts_.idle_wait);
        continue;
      }
      if (!got.empty()) {
        for (auto& c : got) st.ready.push_back(std::move(c));
        st.cv.notify_all();
        pause = std::chrono::milliseconds{1};
        continue;
      }
      // Empty, and nothing ended while the claim ran (a handler that gave
      // its item back just after the claim looked would leave it behind).
      if (until_empty && st.ready.empty() && st.running == 0 && st.done.empty() && !st.completing &&
          st.generation == seen)
        return;
      if constexpr (requires(Store& s) { s.wait_for_offer(std::chrono::milliseconds{1}); }) {
        // The store says when an item is offered (postgres_store: NOTIFY):
        // wait for that, for at most idle_wait (a stop is seen then). Not
        // while draining: what ends a drain is the pool's own last item.
        if (!until_empty) {
          g.unlock();
          // In slices of at most 100 ms, each only a look at the LISTEN
          // connection (no statement), so that a stop is seen soon.
          const auto until = std::chrono::steady_clock::now() + opts_.idle_wait;
          for (auto now = std::chrono::steady_clock::now(); now < until && !stop.stop_requested();
               now = std::chrono::steady_clock::now())
            if (claims_.store().wait_for_offer(std::min<std::chrono::nanoseconds>(until - now,
                                                                                  std::chrono::milliseconds{100})))
              break;
          continue;
        }
      }
      // Idle: wait, doubling, for a stop or a handler's end (which may have
      // given an item back).
      const auto before = st.generation;
      st.cv.wait_for(g, pause, [&] { return stop.stop_requested() || st.generation != before; });
      pause = std::min(pause * 2, opts_.idle_wait);
    }
  }

  void handler_loop(state& st) {
    std::unique_lock g{st.m};
    for (;;) {
      st.cv.wait(g, [&] { return st.stopping || !st.ready.empty(); });
      if (st.stopping) return;  // what is left in `ready` is given back by go()
      claim c = std::move(st.ready.front());
      st.ready.pop_front();
      ++st.running;
      st.cv.notify_all();  // room in the local queue
      g.unlock();
      bool ok = true;
      std::string error;
      try {
        handler_(c);
      } catch (const std::exception& e) {
        ok = false;
        error = e.what();
      } catch (...) {
        ok = false;
        error = "the handler threw something that is not a std::exception";
      }
      if (!ok) {
        try {
          (void)c.release(error);
        } catch (const std::exception& e) {
          report(st, e);
        }
      }
      g.lock();
      --st.running;
      ++st.generation;
      if (ok) st.done.push_back(std::move(c));
      else ++st.stats.released;
      st.cv.notify_all();
    }
  }

  void complete_loop(state& st) {
    std::unique_lock g{st.m};
    for (;;) {
      st.cv.wait(g, [&] { return st.handlers_done || !st.done.empty(); });
      if (st.done.empty()) return;  // the handlers are done, and so is every completion
      std::vector<claim> batch;
      const std::size_t n = std::min(st.done.size(), claims_type::max_batch);
      batch.reserve(n);
      for (std::size_t i = 0; i < n; ++i) batch.push_back(std::move(st.done[i]));
      st.done.erase(st.done.begin(), st.done.begin() + static_cast<std::ptrdiff_t>(n));
      st.completing = true;
      g.unlock();
      std::uint64_t completed = 0, lost = 0;
      bool failed = false;
      try {
        for (const bool ok : claims_.complete_n(std::span<claim>(batch))) ok ? ++completed : ++lost;
      } catch (const std::exception& e) {
        failed = true;
        report(st, e);
      }
      batch.clear();
      g.lock();
      st.completing = false;
      st.stats.completed += completed;
      st.stats.lost += lost;
      if (!failed) ++st.stats.batches;
      ++st.generation;
      st.cv.notify_all();
    }
  }

  void report(state& st, const std::exception& e) {
    {
      std::lock_guard g{st.m};
      ++st.stats.errors;
    }
    if (opts_.on_error) return opts_.on_error(e);
    fmt::print(stderr, "dibs::worker_pool: {}\n", e.what());
  }

  claims_type& claims_;
  handler_type handler_;
  worker_pool_options opts_;
};

template <class Store, class Handler>
worker_pool(marker_claim<Store>&, Handler, worker_pool_options = {}) -> worker_pool<Store>;

}  // namespace dibs
