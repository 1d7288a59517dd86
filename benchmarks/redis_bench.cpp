// Redis benchmarks of dibs against the same work written by hand with
// hiredis, P processes at once (benchmarks/run_redis_benchmarks.sh runs
// them on a server of scripts/redis.sh, beside redlock and BullMQ;
// docs/BENCHMARKS.md has the figures).
//
//   redis_bench --bench lock  --procs P --items M
//       M lock + unlock of one lease_mutex<redis_store> in all, shared by P
//       processes (P > 1: contended; waiters woken by the store's PUBLISH)
//   redis_bench --bench claim --way <dibs|hand> --procs P --items M
//       each process claims and completes its own M/P keys:
//       marker_claim<redis_store> try_claim + complete, against the usual
//       hand-written pair: SET key owner NX PX, then an EVAL that sets it to
//       "completed" if it still names the owner
//   redis_bench --bench drain --way <complete_n|pool> --procs P --items M [--batch N] [--threads T]
//       M items offered beforehand (not timed); P workers each looping
//       claim_next_n(N) (default 100) + complete_n, or each running a
//       dibs::worker_pool of T handler threads (default 8) with a local
//       queue of N; the time from the gate to the last completion
//
// The server: $DIBS_REDIS_URL (scripts/redis.sh env DIR prints it). Each
// run uses a namespace of its own. Prints one JSON object.
#include <dibs/lease_mutex.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/stores/redis_store.hpp>
#include <dibs/worker_pool.hpp>

#include <hiredis/hiredis.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "drain.hpp"

namespace {

std::string url() {
  const char* u = std::getenv("DIBS_REDIS_URL");
  if (!u) throw std::runtime_error("set DIBS_REDIS_URL (eval \"$(scripts/redis.sh env DIR)\")");
  return u;
}

std::string key_of(long i) { return fmt::format("job-{:08}", i); }

// A hiredis connection for the hand-written side, to the server of
// redis://USER:PASSWORD@HOST:PORT (scripts/redis.sh's form).
struct hand_conn {
  std::unique_ptr<redisContext, decltype(&::redisFree)> c{nullptr, ::redisFree};
  hand_conn() {
    const std::string u = url();
    const auto at = u.rfind('@'), colon = u.rfind(':');
    const auto creds = u.substr(8, at - 8);
    const auto host = u.substr(at + 1, colon - at - 1);
    c.reset(::redisConnect(host.c_str(), std::stoi(u.substr(colon + 1))));
    if (!c || c->err) throw std::runtime_error("hand: cannot connect to " + host);
    const auto user = creds.substr(0, creds.find(':')), pw = creds.substr(creds.find(':') + 1);
    expect(command("AUTH %b %b", user.data(), user.size(), pw.data(), pw.size()), REDIS_REPLY_STATUS, "AUTH");
  }
  template <class... A>
  std::unique_ptr<redisReply, decltype(&::freeReplyObject)> command(const char* format, A... a) {
    auto* r = static_cast<redisReply*>(::redisCommand(c.get(), format, a...));
    if (!r) throw std::runtime_error(std::string("hand: ") + c->errstr);
    return {r, ::freeReplyObject};
  }
  static void expect(const std::unique_ptr<redisReply, decltype(&::freeReplyObject)>& r, int type, const char* what) {
    if (r->type != type) throw std::runtime_error(fmt::format("hand: {} answered {}", what, r->str ? r->str : "?"));
  }
};

// The usual hand-written claim: SET NX with an expiry, then a
// compare-and-set script for the completion.
struct hand_claims {
  hand_conn db;
  std::string ns, owner = fmt::format("processing by {}", ::getpid());
  explicit hand_claims(std::string n) : ns(std::move(n)) {}
  bool claim_and_complete(const std::string& k) {
    const std::string key = ns + ":" + k;
    const auto set = db.command("SET %b %b NX PX 60000", key.data(), key.size(), owner.data(), owner.size());
    if (set->type != REDIS_REPLY_STATUS) return false;  // nil: someone else has it
    const auto done = db.command(
        "EVAL %s 1 %b %b",
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], 'completed') end return 0",
        key.data(), key.size(), owner.data(), owner.size());
    return done->type == REDIS_REPLY_STATUS;
  }
};

struct shared {
  std::atomic<long> done[64];
};

using queue = dibs::marker_claim<dibs::redis_store>;

}  // namespace

int main(int argc, char** argv) {
  const auto args = dibs_bench::parse_bench_args(
      argc, argv,
      "usage: redis_bench --bench <lock|claim|drain> [--way <dibs|hand> (claim), <complete_n|pool> (drain)] "
      "[--procs P] [--items M] [--batch N] [--threads T]\n");
  std::string bench = args.bench, way = args.way;  // not bindings: lambdas below capture them (clang 14)
  int procs = args.procs;
  long items = args.items, batch = args.batch, threads = args.threads;
  try {
    if (procs < 1 || procs > 64 || items < 1 || items > 200'000 || batch < 0 || batch > 10'000) return 2;
    if (threads < 1 || threads > 1024) return 2;
    if (bench == "claim" && way != "dibs" && way != "hand") return 2;
    if (bench == "drain" && way != "complete_n" && way != "pool") return 2;
    if (bench == "lock") way = "dibs";
    auto* sh = dibs_bench::shared_new<shared>();
    const std::string ns = fmt::format("bench-{}-{}-{}", bench, way, ::getpid());
    double secs = 0;
    std::string extra;
    if (bench == "lock") {
      secs = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
        dibs::redis_store store{url(), {.ns = ns}};
        dibs::lease_mutex<dibs::redis_store> lock{store, "bench-lock", {.lease = std::chrono::seconds{10}}};
        const long first = p * items / procs, last = (p + 1) * items / procs;
        g.wait();
        for (long k = first; k < last; ++k) {
          lock.lock();
          lock.unlock();
        }
        sh->done[p] = last - first;
      });
    } else if (bench == "claim") {
      secs = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
        long won = 0;
        const long first = p * items / procs, last = (p + 1) * items / procs;
        if (way == "dibs") {
          dibs::redis_store store{url(), {.ns = ns}};
          queue claims{store, {.renew = false}};
          g.wait();
          for (long k = first; k < last; ++k)
            if (auto c = claims.try_claim(key_of(k))) {
              c->complete();
              ++won;
            }
        } else {
          hand_claims h{ns};
          g.wait();
          for (long k = first; k < last; ++k) won += h.claim_and_complete(key_of(k));
        }
        sh->done[p] = won;
      });
    } else if (bench == "drain") {
      if (batch == 0) batch = 100;
      {
        dibs::redis_store store{url(), {.ns = ns}};
        queue claims{store};
        std::vector<std::string> keys;
        for (long k = 0; k < items; ++k) {
          keys.push_back(key_of(k));
          if (keys.size() == 1000 || k + 1 == items) {
            if (claims.offer_n(keys) != keys.size()) throw std::runtime_error("fill: some keys were already queued");
            keys.clear();
          }
        }
      }
      secs = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
        dibs::redis_store store{url(), {.ns = ns}};
        // No renewal thread: a batch is held for a few milliseconds, far
        // within a lease (BullMQ's jobs are alike: a lock renewed only
        // after half its 30 s).
        queue claims{store, {.renew = false}};
        sh->done[p] = dibs_bench::drain_worker(claims, way, batch, threads, g);
      });
      extra = way == "pool" ? fmt::format(", \"batch\": {}, \"threads\": {}", batch, threads)
                            : fmt::format(", \"batch\": {}", batch);
    } else {
      return 2;
    }
    long total = 0;
    for (int p = 0; p < procs; ++p) total += sh->done[p];
    // The check: every item done once, none left in progress or queued.
    long left = 0;
    if (bench == "drain") {
      dibs::redis_store store{url(), {.ns = ns}};
      queue claims{store};
      left = static_cast<long>(store.processing_keys().size() + claims.claim_next_n(10).size());
    }
    if (total != items || left != 0) {
      std::fprintf(stderr, "check failed: %ld done, %ld left in progress or queued, of %ld\n", total, left, items);
      return 1;
    }
    std::printf("{\"bench\": \"%s\", \"way\": \"%s\", \"procs\": %d, \"items\": %ld, \"seconds\": %.4f, "
                "\"items_per_s\": %.0f%s}\n",
                bench.c_str(), way.c_str(), procs, items, secs, static_cast<double>(total) / secs, extra.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "redis_bench: %s\n", e.what());
    return 1;
  }
}
