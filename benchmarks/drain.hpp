// What the queue benchmarks share (pg_claims, redis_bench): their command
// line, and one worker's part of a drain.
#pragma once

#include <dibs/worker_pool.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "procs.hpp"

namespace dibs_bench {

/// --bench B --way W --procs P --items M --batch N --threads T, each optional.
struct bench_args {
  std::string bench = "claim", way = "dibs";
  int procs = 1;
  long items = 5000, batch = 0, threads = 8;
};

/// Returns: the arguments, or exits 2 after printing `usage` on one it does not know.
inline bench_args parse_bench_args(int argc, char** argv, const char* usage) {
  bench_args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = i + 1 < argc ? argv[i] : "";  // an option without its value: unknown
    const char* v = i + 1 < argc ? argv[i + 1] : "";
    if (k == "--bench") a.bench = v;
    else if (k == "--way") a.way = v;
    else if (k == "--procs") a.procs = std::atoi(v);
    else if (k == "--items") a.items = std::atol(v);
    else if (k == "--batch") a.batch = std::atol(v);
    else if (k == "--threads") a.threads = std::atol(v);
    else {
      std::fputs(usage, stderr);
      std::exit(2);
    }
  }
  return a;
}

/// One worker process of a drain, after its set-up: with `way` "pool" or
/// "pool_renew", a dibs::worker_pool of `threads` handlers and a local queue
/// of `batch`, drained; otherwise claim_next_n(batch) in a loop, completing
/// each batch with complete_n ("complete_n") or each claim alone. Calls
/// g.wait() before its first claim and g.end() after its last completion.
/// Returns: the items it completed.
template <class Queue>
long drain_worker(Queue& claims, const std::string& way, long batch, long threads, gate& g) {
  if (way == "pool" || way == "pool_renew") {
    std::atomic<long> handled{0};
    dibs::worker_pool pool{claims, [&](const auto&) { ++handled; },
                           {.concurrency = static_cast<std::size_t>(threads), .prefetch = static_cast<std::size_t>(batch)}};
    g.wait();
    const auto st = pool.drain();
    g.end();
    if (st.completed != static_cast<std::uint64_t>(handled.load()) || st.errors != 0)
      throw std::runtime_error("drain: the pool did not complete every item it handled");
    return static_cast<long>(st.completed);
  }
  long won = 0;
  g.wait();
  for (;;) {
    auto got = claims.claim_next_n(static_cast<std::size_t>(batch));
    if (got.empty()) break;
    if (way == "complete_n") {
      const auto done = claims.complete_n(got);
      if (std::count(done.begin(), done.end(), true) != static_cast<long>(got.size()))
        throw std::runtime_error("drain: a claim was taken over before its completion");
    } else {
      for (auto& c : got) c.complete();
    }
    won += static_cast<long>(got.size());
    // The time ends at the last completion, not at the empty claim (and the
    // recovery sweep it may run) that tells a worker it is done.
    g.end();
  }
  return won;
}

}  // namespace dibs_bench
