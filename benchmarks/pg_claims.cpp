// PostgreSQL benchmarks of dibs against the same work written by hand with
// libpq, P processes at once (benchmarks/run_pg_benchmarks.sh runs them on
// a server of scripts/pg.sh; docs/BENCHMARKS.md has the figures).
//
//   pg_claims --bench claim   --way <dibs|hand|floor|shape> --procs P --items M
//       each process claims and completes its own M/P keys: marker_claim<
//       postgres_store> try_claim + complete, against the two statements
//       (INSERT ... ON CONFLICT ... RETURNING, UPDATE ... WHERE version)
//   pg_claims --bench next    --way <dibs|hand|floor|shape> --procs P --items M
//       M queued items, P workers take them without knowing keys: claim_next
//       + complete, against the usual SKIP LOCKED loop over a partial index
//   pg_claims --bench drain   --way <dibs|complete_n|pool> --procs P --items M [--batch N] [--threads T]
//       M items offered beforehand (not timed), P workers each looping
//       claim_next_n(N) (default 100) + complete() of each (dibs), or
//       complete_n of the N in one statement (complete_n), until the queue
//       is empty; or each running a dibs::worker_pool of T handler threads
//       (default 8) with a local queue of N, drained (pool; pool_renew: with
//       the claims renewing themselves, claim_options' default); the time from the gate (every worker's first claim) to the
//       last completion of any (benchmarks/run_queue_peers.sh runs it beside
//       graphile-worker)
//   pg_claims --bench enqueue --way <dibs|offer_n> --items M [--batch B]
//       one process puts M new items in the queue: offer() one by one, or
//       marker_claim::offer_n, B keys a call (default: all M at once); the
//       time of the offers alone
//
// `floor`: the hand-written statements, but on dibs's own table (made by
// postgres_store: its columns, indexes and triggers; for `next` the items
// offered by dibs) and writing rows of dibs's size and shape: the owner
// record (head, changed, nonce, token, owner lines: about 250 bytes) and
// the queue columns, made by the client for every write. What dibs costs
// beyond it is its own; what hand costs less is the row.
// `shape`: the floor writing short values ("state processing", "state
// completed") instead of the records: what dibs's table costs apart from
// the record's size.
//   pg_claims --bench handoff --way <notify|poll> --items N
//       two processes pass one lease_mutex<postgres_store> back and forth N
//       times, each holding it 30 ms; the time from one's unlock to the
//       other's lock, with waiters woken by NOTIFY or polling (the same store
//       without wait_for_change; lease_mutex's default backoff, 0.5-50 ms)
//
// The server: the conninfo in $DIBS_PG_CONNINFO. Prints one JSON object.
#include <dibs/lease_mutex.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/worker_pool.hpp>
#include <dibs/stores/postgres_store.hpp>

#include <libpq-fe.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "drain.hpp"

namespace {

using dibs_bench::mono_ns;

std::string conninfo() {
  const char* c = std::getenv("DIBS_PG_CONNINFO");
  if (!c) throw std::runtime_error("set DIBS_PG_CONNINFO (scripts/pg.sh start DIR writes DIR/conninfo)");
  return c;
}

std::string key_of(long i) { return fmt::format("job-{:08}", i); }

// A libpq connection for the hand-written side.
struct pg {
  std::unique_ptr<PGconn, decltype(&::PQfinish)> c{::PQconnectdb(conninfo().c_str()), ::PQfinish};
  pg() {
    if (::PQstatus(c.get()) != CONNECTION_OK) throw std::runtime_error(::PQerrorMessage(c.get()));
  }
  void exec(const std::string& sql) {
    std::unique_ptr<PGresult, decltype(&::PQclear)> r{::PQexec(c.get(), sql.c_str()), ::PQclear};
    const auto st = ::PQresultStatus(r.get());
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) throw std::runtime_error(sql + ": " + ::PQresultErrorMessage(r.get()));
  }
  void prepare(const char* name, const std::string& sql) {
    std::unique_ptr<PGresult, decltype(&::PQclear)> r{::PQprepare(c.get(), name, sql.c_str(), 0, nullptr), ::PQclear};
    if (::PQresultStatus(r.get()) != PGRES_COMMAND_OK) throw std::runtime_error(::PQresultErrorMessage(r.get()));
  }
  // Returns: the rows the prepared statement returned.
  int run(const char* name, std::vector<std::string> params) {
    std::vector<const char*> v;
    for (auto& p : params) v.push_back(p.c_str());
    std::unique_ptr<PGresult, decltype(&::PQclear)> r{
        ::PQexecPrepared(c.get(), name, static_cast<int>(v.size()), v.data(), nullptr, nullptr, 0), ::PQclear};
    const auto st = ::PQresultStatus(r.get());
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) throw std::runtime_error(::PQresultErrorMessage(r.get()));
    return ::PQntuples(r.get());
  }
  std::string first(const std::string& sql) {
    std::unique_ptr<PGresult, decltype(&::PQclear)> r{::PQexec(c.get(), sql.c_str()), ::PQclear};
    return ::PQntuples(r.get()) ? ::PQgetvalue(r.get(), 0, 0) : "";
  }
};

struct shared {
  std::atomic<long> done[64];
  std::atomic<std::int64_t> unlocked_ns{0};
  std::atomic<long> round{0};
  std::int64_t handoff_ns[200'000];
};

// The hand-written claim of the "claim" benchmark: the same statements.
struct hand_claims {
  pg db;
  explicit hand_claims(const std::string& table) {
    db.prepare("claim", fmt::format("INSERT INTO {} (key, value, version) VALUES ($1, 'processing by ' || pg_backend_pid(), 1) "
                                    "ON CONFLICT (key) DO NOTHING RETURNING version",
                                    table));
    db.prepare("complete", fmt::format("UPDATE {} SET value = 'completed', version = version + 1 "
                                       "WHERE key = $1 AND version = $2 RETURNING version",
                                       table));
  }
  bool claim_and_complete(const std::string& k) {
    if (db.run("claim", {k}) != 1) return false;
    return db.run("complete", {k, "1"}) == 1;
  }
};

// The hand-written SKIP LOCKED queue loop, with a partial index.
struct hand_queue {
  pg db;
  explicit hand_queue(const std::string& table) {
    db.prepare("take", fmt::format("UPDATE {0} SET state = 'processing', attempts = attempts + 1 WHERE key = "
                                   "(SELECT key FROM {0} WHERE state = 'queued' ORDER BY key LIMIT 1 FOR UPDATE SKIP LOCKED) "
                                   "RETURNING key",
                                   table));
    db.prepare("done", fmt::format("UPDATE {} SET state = 'completed' WHERE key = $1", table));
  }
  bool next() {
    std::unique_ptr<PGresult, decltype(&::PQclear)> r{
        ::PQexecPrepared(db.c.get(), "take", 0, nullptr, nullptr, nullptr, 0), ::PQclear};
    if (::PQresultStatus(r.get()) != PGRES_TUPLES_OK) throw std::runtime_error(::PQresultErrorMessage(r.get()));
    if (::PQntuples(r.get()) == 0) return false;
    db.run("done", {::PQgetvalue(r.get(), 0, 0)});
    return true;
  }
};

// Records of dibs's shape (marker_claim's encode): the processing record
// with the owner lines, the completed one with the token; a new nonce and
// time in each, as dibs makes them. Short values for the `shape` way.
bool short_rows = false;
std::string floor_record(bool processing, long attempts, long token) {
  if (short_rows) return processing ? "state processing" : "state completed";
  std::string v = processing ? "dibs-claim 1\nstate processing\nattempts " : "dibs-claim 1\nstate completed\nattempts ";
  dibs::detail::append_number(v, attempts);
  v += "\nchanged ";
  dibs::detail::append_number(v, dibs::detail::wall_ms());
  v += '\n';
  dibs::detail::append_nonce(v);
  if (token) {
    v += "token ";
    dibs::detail::append_number(v, token);
    v += '\n';
  }
  if (processing) v += dibs::detail::this_process_lines(std::chrono::milliseconds{60'000});
  return v;
}

// Runs prepared statement `name` with parameters bytes (format 1) or text
// (format 0). Returns: its result.
std::unique_ptr<PGresult, decltype(&::PQclear)> run_mixed(PGconn* c, const char* name,
                                                          std::initializer_list<std::pair<std::string_view, int>> ps) {
  std::vector<const char*> v;
  std::vector<int> len, fmt;
  for (const auto& [p, f] : ps) {
    v.push_back(p.data());
    len.push_back(static_cast<int>(p.size()));
    fmt.push_back(f);
  }
  std::unique_ptr<PGresult, decltype(&::PQclear)> r{
      ::PQexecPrepared(c, name, static_cast<int>(v.size()), v.data(), len.data(), fmt.data(), 0), ::PQclear};
  const auto st = ::PQresultStatus(r.get());
  if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) throw std::runtime_error(::PQresultErrorMessage(r.get()));
  return r;
}

// The floor of `claim`: hand_claims's two statements on dibs's table,
// writing what dibs writes (the record and every queue column).
struct floor_claims {
  pg db;
  explicit floor_claims(const std::string& table) {
    db.prepare("claim", fmt::format("INSERT INTO \"{}\" (key, value, version, written, state, attempts, priority, "
                                    "not_before, synced, claimable) VALUES ($1, $2, 1, clock_timestamp(), 'processing', "
                                    "1, 0, NULL, 1, false) ON CONFLICT (key) DO NOTHING RETURNING version",
                                    table));
    db.prepare("complete", fmt::format("UPDATE \"{}\" SET value = $3, version = version + 1, written = clock_timestamp(), "
                                       "state = 'completed', attempts = 1, priority = 0, not_before = NULL, "
                                       "synced = version + 1, claimable = false "
                                       "WHERE key = $1 AND version = $2::bigint RETURNING version",
                                       table));
  }
  bool claim_and_complete(const std::string& k) {
    if (::PQntuples(run_mixed(db.c.get(), "claim", {{k, 1}, {floor_record(true, 1, 0), 1}}).get()) != 1) return false;
    const auto done = run_mixed(db.c.get(), "complete", {{k, 1}, {"1", 0}, {floor_record(false, 1, 1), 1}});
    return ::PQntuples(done.get()) == 1;
  }
};

// The floor of `next`: hand_queue's loop on dibs's table (its partial
// index over claimable rows, by priority and key), writing dibs's rows.
struct floor_queue {
  pg db;
  explicit floor_queue(const std::string& table) {
    db.prepare("take", fmt::format("UPDATE \"{0}\" SET value = $1, version = version + 1, written = clock_timestamp(), "
                                   "state = 'processing', attempts = attempts + 1, not_before = NULL, "
                                   "synced = version + 1, claimable = false WHERE key = "
                                   "(SELECT key FROM \"{0}\" WHERE claimable ORDER BY priority DESC, key LIMIT 1 "
                                   "FOR UPDATE SKIP LOCKED) RETURNING key, version",
                                   table));
    db.prepare("done", fmt::format("UPDATE \"{}\" SET value = $3, version = version + 1, written = clock_timestamp(), "
                                   "state = 'completed', synced = version + 1, claimable = false "
                                   "WHERE key = $1 AND version = $2::bigint RETURNING version",
                                   table));
  }
  bool next() {
    const auto r = run_mixed(db.c.get(), "take", {{floor_record(true, 1, 0), 1}});
    if (::PQntuples(r.get()) == 0) return false;
    // The key comes back as text (bytea's hex form): sent back as text.
    const std::string key = ::PQgetvalue(r.get(), 0, 0), version = ::PQgetvalue(r.get(), 0, 1);
    const auto done =
        run_mixed(db.c.get(), "done", {{key, 0}, {version, 0}, {floor_record(false, 1, std::stol(version)), 1}});
    if (::PQntuples(done.get()) != 1) throw std::runtime_error("floor: a taken item was not completed");
    return true;
  }
};

using queue = dibs::marker_claim<dibs::postgres_store>;

// Fills `table` with `items` offered items, untimed (a drain measures the
// taking, not the filling): offer_n in batches of 1,000, in a session that
// does not wait for its commits to be flushed, since postgres_store has no
// batches yet (offer_n goes key by key there, and 20,000 flushed commits
// take long on a shared disk).
void fill_queue(const std::string& table, long items) {
  dibs::postgres_store store{conninfo() + " options='-c synchronous_commit=off'", {.table = table}};
  queue claims{store};
  std::vector<std::string> keys;
  for (long k = 0; k < items; ++k) {
    keys.push_back(key_of(k));
    if (keys.size() == 1000 || k + 1 == items) {
      if (claims.offer_n(keys) != keys.size()) throw std::runtime_error("fill: some keys were already in the queue");
      keys.clear();
    }
  }
}

// The store without wait_for_change: lease_mutex then polls.
struct polling_store {
  dibs::postgres_store& s;
  std::optional<dibs::record> read(std::string_view k) { return s.read(k); }
  std::optional<dibs::record> read(std::string_view k, dibs::time_limit t) { return s.read(k, t); }
  std::optional<dibs::aged_record> read_aged(std::string_view k, dibs::time_limit t) { return s.read_aged(k, t); }
  std::optional<dibs::version> create(std::string_view k, std::string_view v) { return s.create(k, v); }
  std::optional<dibs::version> create(std::string_view k, std::string_view v, dibs::time_limit t) { return s.create(k, v, t); }
  std::optional<dibs::version> replace(std::string_view k, dibs::version e, std::string_view v) { return s.replace(k, e, v); }
  std::optional<dibs::version> replace(std::string_view k, dibs::version e, std::string_view v, dibs::time_limit t) {
    return s.replace(k, e, v, t);
  }
  bool erase(std::string_view k, dibs::version e) { return s.erase(k, e); }
  bool erase(std::string_view k, dibs::version e, dibs::time_limit t) { return s.erase(k, e, t); }
};

}  // namespace

int main(int argc, char** argv) {
  const auto args = dibs_bench::parse_bench_args(
      argc, argv,
      "usage: pg_claims --bench <claim|next|drain|enqueue|handoff> --way <dibs|hand|floor|shape> "
      "(handoff: <notify|poll>; drain: <dibs|complete_n|pool|pool_renew>; enqueue: <dibs|offer_n>) [--procs P] "
      "[--items M] [--batch N] [--threads T]\n");
  std::string bench = args.bench, way = args.way;  // not bindings: lambdas below capture them (clang 14)
  int procs = args.procs;
  long items = args.items, batch = args.batch, threads = args.threads;
  try {
    if (procs < 1 || procs > 64 || items < 1 || items > 200'000 || batch < 0 || batch > 200'000) return 2;
    if (bench == "drain" && way != "dibs" && way != "complete_n" && way != "pool" && way != "pool_renew") return 2;
    if (threads < 1 || threads > 1024) return 2;
    if (bench == "enqueue" && way != "dibs" && way != "offer_n") return 2;
    if (way == "shape") {
      short_rows = true;
      way = "floor";
    }
    auto* sh = dibs_bench::shared_new<shared>();
    const std::string table = fmt::format("bench_{}_{}_{}", bench, way, ::getpid());
    pg admin;
    long total = 0;
    double secs = 0;
    std::string extra;
    if (bench == "claim") {
      if (way == "dibs" || way == "floor") dibs::postgres_store{conninfo(), {.table = table}};  // the same table
      else admin.exec(fmt::format("CREATE TABLE {} (key text PRIMARY KEY, value text, version bigint NOT NULL DEFAULT 0)", table));
      secs = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
        long won = 0;
        const long first = p * items / procs, last = (p + 1) * items / procs;
        if (way == "dibs") {
          dibs::postgres_store store{conninfo(), {.table = table}};
          dibs::marker_claim<dibs::postgres_store> claims{store, {.renew = false}};
          g.wait();
          for (long k = first; k < last; ++k)
            if (auto c = claims.try_claim(key_of(k))) {
              c->complete();
              ++won;
            }
        } else if (way == "floor") {
          floor_claims f{table};
          g.wait();
          for (long k = first; k < last; ++k) won += f.claim_and_complete(key_of(k));
        } else {
          hand_claims h{table};
          g.wait();
          for (long k = first; k < last; ++k) won += h.claim_and_complete(key_of(k));
        }
        sh->done[p] = won;
      });
    } else if (bench == "next") {
      if (way == "dibs" || way == "floor") {
        dibs::postgres_store store{conninfo(), {.table = table}};
        dibs::marker_claim<dibs::postgres_store> claims{store};
        for (long k = 0; k < items; ++k) (void)claims.offer(key_of(k));
      } else {
        admin.exec(fmt::format("CREATE TABLE {0} (key text PRIMARY KEY, state text NOT NULL, attempts int NOT NULL DEFAULT 0); "
                               "CREATE INDEX {0}_queued ON {0} (key) WHERE state = 'queued'; "
                               "INSERT INTO {0} SELECT 'job-' || lpad(g::text, 8, '0'), 'queued' FROM generate_series(0, {1}) g",
                               table, items - 1));
      }
      admin.exec(fmt::format("VACUUM ANALYZE {}", table));
      secs = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
        long won = 0;
        if (way == "dibs") {
          dibs::postgres_store store{conninfo(), {.table = table}};
          dibs::marker_claim<dibs::postgres_store> claims{store, {.renew = false}};
          g.wait();
          while (auto c = claims.claim_next()) {
            c->complete();
            ++won;
          }
        } else if (way == "floor") {
          floor_queue q{table};
          g.wait();
          while (q.next()) ++won;
        } else {
          hand_queue q{table};
          g.wait();
          while (q.next()) ++won;
        }
        sh->done[p] = won;
      });
    } else if (bench == "drain") {
      if (batch == 0) batch = 100;
      if (batch > 10'000) return 2;  // claim_next_n's limit
      fill_queue(table, items);
      admin.exec(fmt::format("VACUUM ANALYZE \"{}\"", table));
      secs = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
        dibs::postgres_store store{conninfo(), {.table = table}};
        // No renewal thread: a batch is held for a few milliseconds, far
        // within a lease (graphile-worker's jobs, alike, have no heartbeat).
        queue claims{store, {.renew = way == "pool_renew"}};
        sh->done[p] = dibs_bench::drain_worker(claims, way, batch, threads, g);
      });
      extra = way.starts_with("pool") ? fmt::format(", \"batch\": {}, \"threads\": {}", batch, threads)
                            : fmt::format(", \"batch\": {}", batch);
    } else if (bench == "enqueue") {
      procs = 1;
      if (batch == 0) batch = items;
      dibs::postgres_store store{conninfo(), {.table = table}};
      queue claims{store};
      std::vector<std::vector<std::string>> batches;
      for (long k = 0; k < items; k += batch) {
        batches.emplace_back();
        for (long i = k; i < std::min(items, k + batch); ++i) batches.back().push_back(key_of(i));
      }
      const auto t0 = mono_ns();
      if (way == "dibs") {
        for (long k = 0; k < items; ++k) total += claims.offer(key_of(k));
      } else {
        for (const auto& b : batches) total += static_cast<long>(claims.offer_n(b));
      }
      secs = static_cast<double>(mono_ns() - t0) / 1e9;
      if (way == "offer_n") extra = fmt::format(", \"batch\": {}", batch);
    } else if (bench == "handoff") {
      procs = 2;
      dibs::postgres_store{conninfo(), {.table = table}};
      secs = dibs_bench::run_procs(2, [&](int p, dibs_bench::gate& g) {
        dibs::postgres_store store{conninfo(), {.table = table}};
        polling_store polling{store};
        auto loop = [&](auto& lock) {
          g.wait();
          long mine = 0;
          for (;;) {
            lock.lock();
            const auto now = mono_ns();
            const long r = sh->round.fetch_add(1);
            if (r >= items) {
              lock.unlock();
              return mine;
            }
            if (const auto u = sh->unlocked_ns.load(); u != 0 && r > 0) sh->handoff_ns[r] = now - u;
            ++mine;
            // Held for a while, as real work holds a lock: the waiter's
            // polls back off to their longest meanwhile.
            std::this_thread::sleep_for(std::chrono::milliseconds{30});
            sh->unlocked_ns = mono_ns();
            lock.unlock();
            // Let the other process, which waits, take it.
            while (sh->round.load() == r + 1 && sh->round.load() < items) ::usleep(100);
          }
        };
        const dibs::lease_options o{.lease = std::chrono::seconds{10}};
        if (way == "notify") {
          dibs::lease_mutex<dibs::postgres_store> lock{store, "handoff", o};
          loop(lock);
          return;
        }
        dibs::lease_mutex<polling_store> lock{polling, "handoff", o};
        (void)p;
        loop(lock);
      });
      std::vector<std::int64_t> h(sh->handoff_ns + 1, sh->handoff_ns + std::min<long>(items, 200'000));
      h.erase(std::remove(h.begin(), h.end(), 0), h.end());
      auto pct = [&](double q) { return dibs_bench::quantile(h, q) / 1e6; };
      extra = fmt::format(", \"handoffs\": {}, \"p50_ms\": {:.3f}, \"p99_ms\": {:.3f}", h.size(), pct(0.5), pct(0.99));
      total = items;
    } else {
      return 2;
    }
    if (bench != "handoff") {
      if (bench != "enqueue")
        for (int p = 0; p < procs; ++p) total += sh->done[p];
      const std::string check = bench == "claim"     ? "SELECT count(*) FROM {} WHERE value LIKE '%completed%'"
                                : bench == "enqueue" ? "SELECT count(*) FROM {} WHERE position('state offered'::bytea IN value) > 0"
                                : way != "hand"  ? "SELECT count(*) FROM {} WHERE position('state completed'::bytea IN value) > 0"
                                                 : "SELECT count(*) FROM {} WHERE state = 'completed'";
      const long completed = std::stol(admin.first(fmt::format(fmt::runtime(check), table)));
      if (total != items || completed != items) {
        std::fprintf(stderr, "check failed: %ld taken, %ld in the expected state, of %ld\n", total, completed, items);
        return 1;
      }
    }
    admin.exec(fmt::format("DROP TABLE {}", table));
    std::printf("{\"bench\": \"%s\", \"way\": \"%s\", \"procs\": %d, \"items\": %ld, \"seconds\": %.4f, "
                "\"items_per_s\": %.0f%s}\n",
                bench.c_str(), short_rows ? "shape" : way.c_str(), procs, items, secs,
                static_cast<double>(total) / secs, extra.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pg_claims: %s\n", e.what());
    return 1;
  }
}
