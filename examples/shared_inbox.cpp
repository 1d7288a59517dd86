// shared_inbox: the three problems dibs exists for, in one run on one machine.
//
//   - A mailbox: a SQLite table of messages, into which a delivery process
//     drops new messages while the workers run.
//   - M worker processes watch the mailbox; every one of them sees every new
//     message, and each message is claimed by exactly one of them with
//     dibs::marker_claim<dibs::sqlite_store>: the claim marker lives on the
//     message's own row.
//   - Handling a message writes an order into a shared results database in a
//     transaction that dibs::transact retries when it loses the write lock,
//     and appends a line to one shared log file (dibs::shared_log).
//   - Chaos: random workers are killed with SIGKILL while they work and
//     replacements are started; the claims of the dead are recovered.
//
// At the end the program checks what it claims: every message completed,
// no order written twice, no stock update lost, the log line of every
// completed message present and none torn. It exits with status 1 if any of
// that fails.
//
// With --store postgres the mailbox (with its claim markers:
// marker_claim<postgres_store>) and the results are tables on a PostgreSQL
// server (--pg CONNINFO, or $DIBS_PG_CONNINFO), the order transactions run
// SERIALIZABLE and dibs::transact retries their serialization failures, and
// the checks are the same. scripts/demo.sh --store postgres starts a
// throwaway server for it.
//
//   shared_inbox [--store sqlite|postgres] [--pg CONNINFO] [--workers M] [--messages N] [--kills K] [--rate R]
//                [--hold-us U] [--dir D] [--json FILE] [--keep]
//
// Workers are this program started again (by exec, with --role worker): a
// database connection must never be carried across fork().
#include <dibs/marker_claim.hpp>
#include <dibs/postgres_store.hpp>
#include <dibs/retry.hpp>
#include <dibs/shared_log.hpp>
#include <dibs/sqlite.hpp>
#include <dibs/sqlite_store.hpp>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

extern char** environ;

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using steady = std::chrono::steady_clock;

namespace {

struct args {
  int workers = 4;
  int messages = 2000;
  int kills = 5;
  int rate = 1000;  // messages delivered per second
  int hold_us = 300;  // how long an order transaction works while it holds the lock
  fs::path dir;
  fs::path json;
  bool keep = false;
  std::string store = "sqlite";
  std::string pg;  // conninfo, for --store postgres
  // Internal: the roles of the processes the demo starts; the name of the
  // run (its PostgreSQL tables start with it).
  std::string role;
  int id = 0;
  std::string run;
};

[[noreturn]] void usage(int code) {
  std::fputs(
      "usage: shared_inbox [--store sqlite|postgres] [--pg CONNINFO] [--workers M] [--messages N]\n"
      "                    [--kills K] [--rate R] [--hold-us U] [--dir D] [--json FILE] [--keep]\n"
      "\n"
      "  A delivery process drops N messages into a SQLite mailbox at R per second\n"
      "  while M worker processes watch it. Each message is claimed by exactly one\n"
      "  worker (dibs::marker_claim on the message's row), which writes an order into a\n"
      "  shared results database (dibs::transact retries lost lock races) and a line\n"
      "  into one shared log (dibs::shared_log). K times during the run a random\n"
      "  worker is killed with SIGKILL and a new one started; its claims are recovered.\n"
      "  At the end a table shows what happened, and the program exits with status 1\n"
      "  if any message was lost or done twice, or a log line lost or torn.\n"
      "\n"
      "  --store S      where the mailbox, its claims and the results live: sqlite (files\n"
      "                 in --dir, the default) or postgres (tables on a server)\n"
      "  --pg C         the PostgreSQL server, a libpq connection string (default:\n"
      "                 $DIBS_PG_CONNINFO, else the PG* environment)\n"
      "  --workers M    worker processes (default 4)\n"
      "  --messages N   messages to deliver (default 2000)\n"
      "  --kills K      workers killed with SIGKILL during the run (default 5; 0: no chaos)\n"
      "  --rate R       messages delivered per second (default 1000)\n"
      "  --hold-us U    work each order transaction does while it holds the results\n"
      "                 database's write lock, in microseconds (default 300): what makes\n"
      "                 workers collide and retry\n"
      "  --dir D        where the databases and the log go (default: a new temporary\n"
      "                 directory, removed at the end unless --keep)\n"
      "  --json FILE    also write the figures to FILE as one JSON object\n"
      "  --keep         keep the files (the directory is printed)\n",
      code ? stderr : stdout);
  std::exit(code);
}

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "shared_inbox: %s needs a value\n", opt.c_str());
        usage(2);
      }
      return argv[++i];
    };
    auto number = [&](int lo, int hi) {
      const std::string v = value();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < lo || n > hi) {
        std::fprintf(stderr, "shared_inbox: %s must be a number from %d to %d (got '%s')\n", opt.c_str(), lo, hi,
                     v.c_str());
        std::exit(2);
      }
      return static_cast<int>(n);
    };
    if (opt == "--workers") a.workers = number(1, 64);
    else if (opt == "--messages") a.messages = number(1, 1'000'000);
    else if (opt == "--kills") a.kills = number(0, 10'000);
    else if (opt == "--rate") a.rate = number(1, 1'000'000);
    else if (opt == "--hold-us") a.hold_us = number(0, 1'000'000);
    else if (opt == "--dir") a.dir = value();
    else if (opt == "--json") a.json = value();
    else if (opt == "--keep") a.keep = true;
    else if (opt == "--store") a.store = value();
    else if (opt == "--pg") a.pg = value();
    else if (opt == "--run") a.run = value();
    else if (opt == "--role") a.role = value();
    else if (opt == "--id") a.id = number(0, 1'000'000);
    else if (opt == "--help" || opt == "-h") usage(0);
    else {
      std::fprintf(stderr, "shared_inbox: unknown option '%s'\n", opt.c_str());
      usage(2);
    }
  }
  if (a.store != "sqlite" && a.store != "postgres") {
    std::fprintf(stderr, "shared_inbox: --store must be sqlite or postgres (got '%s')\n", a.store.c_str());
    std::exit(2);
  }
  if (a.pg.empty() && std::getenv("DIBS_PG_CONNINFO")) a.pg = std::getenv("DIBS_PG_CONNINFO");
  return a;
}

struct paths {
  fs::path mailbox, results, log;
  explicit paths(const fs::path& dir)
      : mailbox(dir / "mailbox.db"), results(dir / "results.db"), log(dir / "inbox.log") {}
};

const char* const items[] = {"apples", "pears", "plums", "figs"};
constexpr long initial_stock = 1'000'000;

// Transactions on the shared databases: a lost lock race is retried after a
// short jittered delay, for as long as 30 s.
dibs::retry_policy transaction_policy() {
  return dibs::retry_policy{}.backoff({1ms, 2.0, 50ms}).deadline(30s).unlimited_attempts();
}

std::string message_key(int i) { return fmt::format("msg-{:06}", i); }

struct message {
  std::string key, body;
  std::int64_t seq = 0;
};
struct order_row {
  std::string message;
  std::int64_t token = 0, worker = 0;
};

// ---------------------------------------------------------------------------
// The databases, on SQLite files (one directory) or a PostgreSQL server (the
// tables of one run start with its name). Each engine gives the same things:
// set-up by the parent, a delivery batch, what a worker needs, the checks.

class sqlite_engine {
public:
  using store = dibs::sqlite_store;
  using results_db = dibs::sqlite::connection;

  explicit sqlite_engine(const args& a) : p_(a.dir) {}
  std::string table(std::string_view name) const { return std::string(name); }
  store open_mailbox() const { return store{p_.mailbox, "mailbox"}; }
  results_db open_results() const { return results_db{p_.results}; }

  void create() const {
    results_db mail{p_.mailbox};
    // The message rows carry the claim marker (key, value, version) next to
    // their own columns: a message reads as unclaimed while value is NULL.
    mail.exec(
        "CREATE TABLE mailbox (key TEXT PRIMARY KEY NOT NULL, value BLOB, version INTEGER NOT NULL DEFAULT 0,"
        " seq INTEGER, body TEXT, delivered_at REAL);"
        "CREATE INDEX mailbox_seq ON mailbox (seq)");
    results_db res{p_.results};
    // No unique constraint on orders.message: a message handled twice would
    // show up as two orders, and the demo counts them.
    res.exec(
        "CREATE TABLE orders (message TEXT NOT NULL, token INTEGER NOT NULL, worker INTEGER NOT NULL,"
        " attempts INTEGER NOT NULL, qty INTEGER NOT NULL, item TEXT NOT NULL);"
        "CREATE INDEX orders_message ON orders (message);"
        "CREATE TABLE stock (item TEXT PRIMARY KEY, qty INTEGER NOT NULL)");
    for (const char* item : items) res.exec(fmt::format("INSERT INTO stock VALUES ('{}', {})", item, initial_stock));
  }

  // The delivery process's side.
  class delivery_db {
  public:
    explicit delivery_db(const sqlite_engine& e)
        : db_(e.p_.mailbox),
          insert_(db_.prepare("INSERT INTO mailbox (key, seq, body, delivered_at) VALUES (?1, ?2, ?3, julianday('now'))")) {}
    void insert(const std::vector<message>& batch) {
      dibs::transact(transaction_policy(), db_, [&] {
        for (const auto& m : batch) {
          insert_.bind(1, m.key).bind(2, m.seq).bind(3, m.body);
          (void)insert_.step();
        }
      });
    }

  private:
    results_db db_;
    dibs::sqlite::statement insert_;
  };

  // A worker's side: its claims store, the mailbox reader, the results.
  class worker_db {
  public:
    explicit worker_db(const sqlite_engine& e)
        : mailbox(e.open_mailbox()),
          results(e.open_results()),
          fresh_(mailbox.connection().prepare("SELECT key, body, seq FROM mailbox WHERE seq > ?1 ORDER BY seq LIMIT 500")),
          applied_(results.prepare("SELECT max(token) FROM orders WHERE message = ?1")),
          insert_(results.prepare("INSERT INTO orders VALUES (?1, ?2, ?3, ?4, ?5, ?6)")),
          take_(results.prepare("UPDATE stock SET qty = qty - ?1 WHERE item = ?2")) {}
    store mailbox;
    results_db results;

    std::vector<message> fresh(std::int64_t after) {
      std::vector<message> out;
      fresh_.bind(1, after);
      while (fresh_.step()) out.push_back({fresh_.column_text(0), fresh_.column_text(1), fresh_.column_int64(2)});
      return out;
    }
    std::optional<std::int64_t> applied(const std::string& key) {
      applied_.bind(1, key);
      (void)applied_.step();
      const std::optional<std::int64_t> prior =
          applied_.column_is_null(0) ? std::nullopt : std::optional{applied_.column_int64(0)};
      applied_.reset();
      return prior;
    }
    void insert_order(const std::string& key, std::int64_t token, int worker, int attempts, int qty,
                      const std::string& item) {
      insert_.bind(1, key).bind(2, token).bind(3, worker).bind(4, attempts).bind(5, qty).bind(6, item);
      (void)insert_.step();
    }
    void take_stock(int qty, const std::string& item) {
      take_.bind(1, qty).bind(2, item);
      (void)take_.step();
    }

  private:
    dibs::sqlite::statement fresh_, applied_, insert_, take_;
  };

  // The parent's view, while the demo runs and for the checks.
  long delivered(results_db& mail) const { return static_cast<long>(*mail.query_int64("SELECT count(*) FROM mailbox")); }
  long completed(results_db& mail) const {
    return static_cast<long>(*mail.query_int64("SELECT count(*) FROM mailbox WHERE instr(value, 'state completed') > 0"));
  }
  results_db open_monitor() const { return results_db{p_.mailbox, {.journal_mode = "", .synchronous = ""}}; }
  std::vector<order_row> orders(results_db& res) const {
    std::vector<order_row> out;
    auto o = res.prepare("SELECT message, token, worker FROM orders");
    while (o.step()) out.push_back({o.column_text(0), o.column_int64(1), o.column_int64(2)});
    return out;
  }

private:
  paths p_;
};

class postgres_engine {
public:
  using store = dibs::postgres_store;
  using results_db = dibs::postgres::connection;

  explicit postgres_engine(const args& a) : conninfo_(a.pg), run_(a.run) {}
  std::string table(std::string_view name) const { return fmt::format("{}_{}", run_, name); }
  store open_mailbox() const { return store{conninfo_, {.table = table("mailbox")}}; }
  // SERIALIZABLE: two orders of one item collide, and transact retries the loser.
  results_db open_results() const { return results_db{conninfo_, {.begin = "BEGIN ISOLATION LEVEL SERIALIZABLE"}}; }

  void create() const {
    // The claim markers live on the message rows: the store makes its table,
    // the mailbox adds its own columns.
    { auto mailbox = open_mailbox(); }
    results_db db{conninfo_};
    db.exec(fmt::format("ALTER TABLE {0} ADD COLUMN seq bigint, ADD COLUMN body text, ADD COLUMN delivered_at "
                        "timestamptz; CREATE INDEX {0}_seq ON {0} (seq)",
                        table("mailbox")));
    db.exec(fmt::format("CREATE TABLE {0} (message text NOT NULL, token bigint NOT NULL, worker int NOT NULL, "
                        "attempts int NOT NULL, qty int NOT NULL, item text NOT NULL); "
                        "CREATE INDEX {0}_message ON {0} (message); "
                        "CREATE TABLE {1} (item text PRIMARY KEY, qty bigint NOT NULL)",
                        table("orders"), table("stock")));
    for (const char* item : items)
      db.exec(fmt::format("INSERT INTO {} VALUES ($1, $2)", table("stock")), {item, std::to_string(initial_stock)});
  }
  void drop() const {
    results_db db{conninfo_};
    db.exec(fmt::format("DROP TABLE {}, {}, {}", table("mailbox"), table("orders"), table("stock")));
  }

  class delivery_db {
  public:
    explicit delivery_db(const postgres_engine& e) : e_(e), db_(e.conninfo_) {}
    void insert(const std::vector<message>& batch) {
      const std::string sql = fmt::format(
          "INSERT INTO {} (key, seq, body, delivered_at) VALUES (convert_to($1, 'UTF8'), $2, $3, now())", e_.table("mailbox"));
      dibs::transact(transaction_policy(), db_, [&] {
        for (const auto& m : batch) db_.exec(sql, {m.key, std::to_string(m.seq), m.body});
      });
    }

  private:
    const postgres_engine& e_;
    results_db db_;
  };

  class worker_db {
  public:
    explicit worker_db(const postgres_engine& e) : mailbox(e.open_mailbox()), results(e.open_results()), e_(e), reader_(e.conninfo_) {}
    store mailbox;
    results_db results;

    std::vector<message> fresh(std::int64_t after) {
      std::vector<message> out;
      for (auto& r : reader_.query(fmt::format("SELECT convert_from(key, 'UTF8'), body, seq FROM {} WHERE seq > $1 "
                                               "ORDER BY seq LIMIT 500",
                                               e_.table("mailbox")),
                                   {std::to_string(after)}))
        out.push_back({*r[0], *r[1], std::stoll(*r[2])});
      return out;
    }
    std::optional<std::int64_t> applied(const std::string& key) {
      return results.query_int64(fmt::format("SELECT max(token) FROM {} WHERE message = $1", e_.table("orders")), {key});
    }
    void insert_order(const std::string& key, std::int64_t token, int worker, int attempts, int qty,
                      const std::string& item) {
      results.exec(fmt::format("INSERT INTO {} VALUES ($1, $2, $3, $4, $5, $6)", e_.table("orders")),
                   {key, std::to_string(token), std::to_string(worker), std::to_string(attempts), std::to_string(qty),
                    item});
    }
    void take_stock(int qty, const std::string& item) {
      results.exec(fmt::format("UPDATE {} SET qty = qty - $1 WHERE item = $2", e_.table("stock")),
                   {std::to_string(qty), item});
    }

  private:
    const postgres_engine& e_;
    results_db reader_;
  };

  long delivered(results_db& db) const {
    return static_cast<long>(*db.query_int64(fmt::format("SELECT count(*) FROM {}", table("mailbox"))));
  }
  long completed(results_db& db) const {
    return static_cast<long>(*db.query_int64(
        fmt::format("SELECT count(*) FROM {} WHERE position('state completed'::bytea IN value) > 0", table("mailbox"))));
  }
  results_db open_monitor() const { return results_db{conninfo_}; }
  std::vector<order_row> orders(results_db& db) const {
    std::vector<order_row> out;
    for (auto& r : db.query(fmt::format("SELECT message, token, worker FROM {}", table("orders"))))
      out.push_back({*r[0], std::stoll(*r[1]), std::stoll(*r[2])});
    return out;
  }

private:
  std::string conninfo_, run_;
};

// ---------------------------------------------------------------------------
// The delivery process: N messages, in small batches, at R per second.

template <class Engine>
int deliver(const Engine& engine, int messages, int rate) {
  typename Engine::delivery_db db{engine};
  std::mt19937 rng(12345);
  const int per_tick = std::max(1, rate / 100);  // one batch every 10 ms
  auto next = steady::now();
  for (int first = 1; first <= messages; first += per_tick) {
    const int last = std::min(messages, first + per_tick - 1);
    std::vector<message> batch;
    for (int i = first; i <= last; ++i)
      batch.push_back({message_key(i),
                       fmt::format("order {} {}", std::uniform_int_distribution<int>{1, 9}(rng),
                                   items[std::uniform_int_distribution<int>{0, 3}(rng)]),
                       i});
    db.insert(batch);
    next += 10ms;
    std::this_thread::sleep_until(next);
  }
  return 0;
}

// ---------------------------------------------------------------------------
// A worker.

volatile std::sig_atomic_t stop_requested = 0;
extern "C" void on_term(int) { stop_requested = 1; }

struct order_text {
  int qty = 0;
  std::string item;
};

order_text parse_body(const std::string& body) {
  order_text o;
  char item[32] = {};
  if (std::sscanf(body.c_str(), "order %d %31s", &o.qty, item) != 2)
    throw std::runtime_error(fmt::format("a message body that is not an order: '{}'", body));
  o.item = item;
  return o;
}

template <class Engine>
class worker {
public:
  worker(const Engine& engine, const paths& p, int id, std::chrono::microseconds hold)
      : id_(id), hold_(hold), db_(engine), claims_(db_.mailbox, {.lease = 30s, .max_attempts = 10}), log_(p.log) {}

  int run() {
    while (!stop_requested) {
      const bool got_new = poll_mailbox();
      bool worked = false;
      // Every worker tries every message it has seen and not seen finished:
      // the claim decides who handles it. A message claimed by a worker that
      // was killed is taken over here, on proof that its process is gone.
      for (auto it = pending_.begin(); it != pending_.end() && !stop_requested;) {
        if (auto c = claims_.try_claim(it->first)) {
          handle(*c, it->second);
          worked = true;
          it = pending_.erase(it);
          continue;
        }
        const auto state = claims_.status(it->first).state;
        if (state == dibs::claim_state::completed || state == dibs::claim_state::failed) it = pending_.erase(it);
        else ++it;
      }
      if (!got_new && !worked) std::this_thread::sleep_for(2ms);
    }
    return 0;
  }

private:
  // Returns: true if new messages arrived (all of them are seen by every worker).
  bool poll_mailbox() {
    bool any = false;
    for (auto& m : db_.fresh(last_seq_)) {
      last_seq_ = m.seq;
      pending_.emplace(std::move(m.key), std::move(m.body));
      any = true;
    }
    return any;
  }

  void handle(typename dibs::marker_claim<typename Engine::store>::claim& c, const std::string& body) {
    const order_text order = parse_body(body);
    const auto token = static_cast<std::int64_t>(c.token());
    retries_ = 0;
    dibs::transact(policy_, db_.results, [&] {
      const int attempts = retries_ + 1;  // this one, after the retries before it
      // Fencing, and the crash between commit and complete(): an order
      // already written for this message by an earlier claim (a worker
      // killed after its commit) is the effect; it is not written again. An
      // order with a larger token means this claim was taken over.
      const std::optional<std::int64_t> prior = db_.applied(c.key());
      if (prior && *prior > token) throw std::runtime_error(fmt::format("{}: claim taken over", c.key()));
      if (prior) return;
      std::this_thread::sleep_for(hold_);  // the work of the order, done under the lock
      db_.insert_order(c.key(), token, id_, attempts, order.qty, order.item);
      db_.take_stock(order.qty, order.item);
    });
    log_.append(fmt::format("{} token {} worker {} order {} {}", c.key(), token, id_, order.qty, order.item));
    c.complete(fmt::format("token {}", token));
  }

  int id_;
  std::chrono::microseconds hold_;
  int retries_ = 0;  // of the current transaction, counted by the policy's hook
  dibs::retry_policy policy_ = transaction_policy().on_retry([this](const dibs::retry_event&) { ++retries_; });
  typename Engine::worker_db db_;
  dibs::marker_claim<typename Engine::store> claims_;
  dibs::shared_log log_;
  std::int64_t last_seq_ = 0;
  std::map<std::string, std::string> pending_;  // key -> body
};

// ---------------------------------------------------------------------------
// The parent: starts the processes, the chaos, the progress line, and checks.

pid_t start(const std::vector<std::string>& argv) {
  std::vector<char*> av;
  for (const auto& a : argv) av.push_back(const_cast<char*>(a.c_str()));
  av.push_back(nullptr);
  pid_t pid = 0;
  std::fflush(nullptr);
  const int rc = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, av.data(), environ);
  if (rc != 0) throw std::system_error(rc, std::generic_category(), "shared_inbox: cannot start a process");
  return pid;
}

struct figures {
  int workers = 0, messages = 0;
  long delivered = 0, completed = 0, failed = 0, duplicates = 0, missing_effects = 0, recovered = 0, killed = 0;
  long orders = 0, transactions_retried = 0, retries = 0, lost_updates = 0, worker_errors = 0;
  long log_lines_expected = 0, log_lines_found = 0, log_lines_of_killed = 0, torn = 0, stray = 0;
  double elapsed_s = 0;
  bool ok() const {
    return delivered == messages && completed == messages && failed == 0 && duplicates == 0 && missing_effects == 0 &&
           lost_updates == 0 && log_lines_found == log_lines_expected && torn == 0 && stray == 0 && worker_errors == 0;
  }
};

// Counts and checks everything from the files alone.
// `killed` holds the ids of the workers killed by the chaos: only they may
// have left an effect or a log line of a claim that did not complete.
template <class Engine>
figures check(const Engine& engine, const paths& p, figures f, const std::set<int>& killed) {
  auto mailbox = engine.open_mailbox();
  dibs::marker_claim<typename Engine::store> claims{mailbox};
  auto res = engine.open_results();
  auto monitor = engine.open_monitor();
  f.delivered = engine.delivered(monitor);
  std::map<std::string, std::int64_t> completing_token;  // message -> token of the claim that completed it
  for (int i = 1; i <= f.messages; ++i) {
    const std::string key = message_key(i);
    const auto s = claims.status(key);
    if (s.state == dibs::claim_state::completed) {
      ++f.completed;
      if (s.attempts > 1) ++f.recovered;
      completing_token[key] = std::stoll(s.result.substr(s.result.find(' ') + 1));
    } else if (s.state == dibs::claim_state::failed) {
      ++f.failed;
    }
  }
  const std::string orders = engine.table("orders"), stock = engine.table("stock");
  auto number = [&](const std::string& sql) { return static_cast<long>(res.query_int64(sql).value_or(0)); };
  f.orders = number(fmt::format("SELECT count(*) FROM {}", orders));
  const long distinct = number(fmt::format("SELECT count(DISTINCT message) FROM {}", orders));
  f.duplicates = f.orders - distinct;
  f.missing_effects = f.completed - distinct;
  for (const auto& o : engine.orders(res)) {
    const auto it = completing_token.find(o.message);
    const bool by_completing_claim = it != completing_token.end() && o.token == it->second;
    if (!by_completing_claim && !killed.count(static_cast<int>(o.worker))) ++f.duplicates;  // a second handler
  }
  f.transactions_retried = number(fmt::format("SELECT count(*) FROM {} WHERE attempts > 1", orders));
  f.retries = number(fmt::format("SELECT sum(attempts - 1) FROM {}", orders));
  const long ordered = number(fmt::format("SELECT sum(qty) FROM {}", orders));
  const long taken = static_cast<long>(std::size(items)) * initial_stock - number(fmt::format("SELECT sum(qty) FROM {}", stock));
  f.lost_updates = ordered - taken;

  // The log: every line is "<key> token <t> worker <w> order <q> <item>".
  f.log_lines_expected = f.completed;
  std::ifstream in(p.log, std::ios::binary);
  std::string line;
  std::set<std::pair<std::string, std::int64_t>> seen;
  while (std::getline(in, line)) {
    char key[32] = {}, item[32] = {};
    long long token = 0;
    int w = 0, q = 0, used = 0;
    if (in.eof() || std::sscanf(line.c_str(), "%31s token %lld worker %d order %d %31s%n", key, &token, &w, &q, item, &used) != 5 ||
        static_cast<std::size_t>(used) != line.size()) {
      ++f.torn;  // a partial, glued or garbled line (or one without its newline)
      continue;
    }
    const auto it = completing_token.find(key);
    if (it == completing_token.end() || token > it->second || !seen.emplace(key, token).second) ++f.stray;
    else if (token == it->second) ++f.log_lines_found;
    else if (killed.count(w)) ++f.log_lines_of_killed;  // an attempt killed before complete()
    else ++f.stray;  // a claim that did not complete, by a worker that was not killed: a double handling
  }
  return f;
}

void print_table(const figures& f, std::FILE* out, const char* engine) {
  auto row = [&](const char* what, const std::string& value, const std::string& note = {}) {
    if (note.empty()) std::fprintf(out, "  %-26s %10s\n", what, value.c_str());
    else std::fprintf(out, "  %-26s %10s   %s\n", what, value.c_str(), note.c_str());
  };
  auto n = [](long v) { return fmt::format("{}", v); };
  std::fprintf(out, "dibs shared inbox on %s: %d workers, %d messages, %ld workers killed with SIGKILL\n\n", engine,
               f.workers, f.messages, f.killed);
  row("messages delivered", n(f.delivered));
  row("completed exactly once", n(f.completed - f.duplicates), f.failed ? fmt::format("{} failed", f.failed) : "");
  row("duplicate effects", n(f.duplicates), "orders written twice for one message (must be 0)");
  if (f.missing_effects) row("completed without order", n(f.missing_effects), "(must be 0)");
  row("claims recovered", n(f.recovered), "taken over from killed workers, on proof they were gone");
  row("transactions retried", n(f.transactions_retried),
      fmt::format("{}: {} retries in all", std::string_view(engine) == "SQLite" ? "lost the results database's lock"
                                                                               : "serialization failures",
                  f.retries));
  row("lost stock updates", n(f.lost_updates), "(must be 0)");
  row("log lines expected", n(f.log_lines_expected), "one per completed message");
  row("log lines found", n(f.log_lines_found),
      f.log_lines_of_killed ? fmt::format("and {} from attempts killed before they completed", f.log_lines_of_killed)
                            : "");
  row("log lines torn", n(f.torn), "(must be 0)");
  if (f.stray) row("log lines unexplained", n(f.stray), "a second line, or one of a claim that was not killed (must be 0)");
  if (f.worker_errors) row("worker errors", n(f.worker_errors), "workers that exited with an error");
  row("elapsed", fmt::format("{:.2f} s", f.elapsed_s),
      fmt::format("{:.0f} messages/s", static_cast<double>(f.completed) / std::max(f.elapsed_s, 1e-9)));
  std::fprintf(out, "\n%s\n",
               f.ok() ? "OK: every message was handled exactly once and every log line is there, whole."
                      : "FAILED: see the figures above.");
}

void write_json(const figures& f, const fs::path& path) {
  std::ofstream out(path, std::ios::trunc);
  out << fmt::format(
      "{{\"workers\": {}, \"messages\": {}, \"delivered\": {}, \"completed\": {}, \"failed\": {}, \"duplicates\": {}, "
      "\"missing_effects\": {}, \"recovered\": {}, \"killed\": {}, \"orders\": {}, \"transactions_retried\": {}, "
      "\"retries\": {}, \"lost_updates\": {}, \"log_lines_expected\": {}, \"log_lines_found\": {}, "
      "\"log_lines_of_killed_attempts\": {}, \"torn\": {}, \"stray\": {}, \"worker_errors\": {}, \"elapsed_s\": {:.3f}, "
      "\"messages_per_s\": {:.1f}, \"ok\": {}}}\n",
      f.workers, f.messages, f.delivered, f.completed, f.failed, f.duplicates, f.missing_effects, f.recovered, f.killed,
      f.orders, f.transactions_retried, f.retries, f.lost_updates, f.log_lines_expected, f.log_lines_found,
      f.log_lines_of_killed, f.torn, f.stray, f.worker_errors, f.elapsed_s,
      static_cast<double>(f.completed) / std::max(f.elapsed_s, 1e-9), f.ok() ? "true" : "false");
  if (!out) throw std::runtime_error(fmt::format("shared_inbox: cannot write '{}'", path.string()));
}

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

template <class Engine>
int run_demo(args a) {
  fs::path dir = a.dir;
  bool made_temp = false;
  if (dir.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "dibs-inbox-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::system_error(errno, std::generic_category(), "shared_inbox: mkdtemp");
    dir = tmpl;
    made_temp = true;
  } else {
    fs::create_directories(dir);
    for (const char* f : {"mailbox.db", "results.db", "inbox.log"})
      if (fs::exists(dir / f))
        throw std::runtime_error(fmt::format("shared_inbox: '{}' already exists; give an empty --dir", (dir / f).string()));
  }
  const paths p{dir};
  a.dir = dir;
  if (a.run.empty()) a.run = fmt::format("inbox_{}", ::getpid());
  const Engine engine{a};
  engine.create();

  const std::string d = dir.string();
  // Every process gets the same place: the directory (the log; SQLite's
  // files), the store, the server and the run's name.
  const std::vector<std::string> place = {"--dir", d, "--store", a.store, "--pg", a.pg, "--run", a.run};
  auto with_place = [&](std::vector<std::string> v) {
    v.insert(v.end(), place.begin(), place.end());
    return v;
  };
  auto worker_argv = [&](int id) {
    return with_place({"shared_inbox", "--role", "worker", "--id", std::to_string(id), "--hold-us",
                       std::to_string(a.hold_us)});
  };
  const auto t0 = steady::now();
  const pid_t delivery = start(with_place({"shared_inbox", "--role", "deliver", "--messages", std::to_string(a.messages),
                                           "--rate", std::to_string(a.rate)}));
  std::vector<pid_t> workers;
  int next_id = 1;
  std::map<pid_t, int> id_of;
  std::set<int> killed_ids;
  for (int i = 0; i < a.workers; ++i) {
    workers.push_back(start(worker_argv(next_id)));
    id_of[workers.back()] = next_id++;
  }

  // Processes are started by exec, so this connection is never used across a fork.
  auto monitor = engine.open_monitor();
  figures f;
  f.workers = a.workers;
  f.messages = a.messages;
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  std::mt19937 rng(std::random_device{}());
  // Kills land at random moments between 10% and 85% of the delivery time,
  // so they hit workers while work is going on.
  const auto delivery_time = std::chrono::microseconds{1'000'000LL * a.messages / a.rate};
  std::vector<steady::time_point> kill_at;
  for (int k = 0; k < a.kills; ++k)
    kill_at.push_back(t0 + std::chrono::microseconds{std::uniform_int_distribution<long long>{
                               delivery_time.count() / 10, delivery_time.count() * 85 / 100}(rng)});
  std::sort(kill_at.begin(), kill_at.end());
  bool delivered_all = false;
  long completed = 0, last_completed = -1;
  auto last_progress = t0, last_change = t0;
  int delivery_status = 0;
  for (;;) {
    std::this_thread::sleep_for(20ms);
    const auto now = steady::now();
    if (!delivered_all && ::waitpid(delivery, &delivery_status, WNOHANG) == delivery) {
      delivered_all = true;
      if (exit_code(delivery_status) != 0) throw std::runtime_error("shared_inbox: the delivery process failed");
    }
    for (auto& w : workers) {  // a worker that died on its own is an error, and is replaced
      int st = 0;
      if (::waitpid(w, &st, WNOHANG) == w) {
        ++f.worker_errors;
        w = start(worker_argv(next_id));
        id_of[w] = next_id++;
      }
    }
    const long delivered = engine.delivered(monitor);
    completed = engine.completed(monitor);
    if (f.killed < a.kills && now >= kill_at[static_cast<std::size_t>(f.killed)]) {
      const std::size_t v = std::uniform_int_distribution<std::size_t>{0, workers.size() - 1}(rng);
      ::kill(workers[v], SIGKILL);
      killed_ids.insert(id_of[workers[v]]);
      ::waitpid(workers[v], nullptr, 0);
      workers[v] = start(worker_argv(next_id));
      id_of[workers[v]] = next_id++;
      ++f.killed;
    }
    if (tty && now - last_progress >= 100ms) {
      std::printf("\r\x1b[K  delivered %ld/%d   completed %ld   workers killed %ld/%d", delivered, a.messages, completed,
                  f.killed, a.kills);
      std::fflush(stdout);
      last_progress = now;
    }
    if (delivered_all && completed >= a.messages && f.killed == a.kills) break;
    if (completed != last_completed) {
      last_completed = completed;
      last_change = now;
    } else if (now - last_change > 60s) {
      std::fprintf(stderr, "shared_inbox: no progress for 60 s; stopping\n");
      break;
    }
  }
  f.elapsed_s = std::chrono::duration<double>(steady::now() - t0).count();
  if (tty) std::printf("\r\x1b[K");
  for (pid_t w : workers) ::kill(w, SIGTERM);
  for (pid_t w : workers) {
    int st = 0;
    ::waitpid(w, &st, 0);
    if (exit_code(st) != 0) ++f.worker_errors;
  }

  f = check(engine, p, f, killed_ids);
  print_table(f, stdout, a.store == "postgres" ? "PostgreSQL" : "SQLite");
  if (!a.json.empty()) write_json(f, a.json);
  if (a.keep || !made_temp) {
    std::printf("files kept in %s\n", d.c_str());
    if constexpr (std::is_same_v<Engine, postgres_engine>) std::printf("tables kept: %s_*\n", a.run.c_str());
  } else {
    fs::remove_all(dir);
    if constexpr (std::is_same_v<Engine, postgres_engine>) engine.drop();
  }
  return f.ok() ? 0 : 1;
}

template <class Engine>
int run_role(const args& a) {
  const Engine engine{a};
  if (a.role == "worker") {
    std::signal(SIGTERM, on_term);
    worker<Engine> w{engine, paths{a.dir}, a.id, std::chrono::microseconds{a.hold_us}};
    return w.run();
  }
  if (a.role == "deliver") return deliver(engine, a.messages, a.rate);
  if (!a.role.empty()) usage(2);
  return run_demo<Engine>(a);
}

}  // namespace

int main(int argc, char** argv) {
  const args a = parse(argc, argv);
  try {
    return a.store == "postgres" ? run_role<postgres_engine>(a) : run_role<sqlite_engine>(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shared_inbox%s: %s\n", a.role.empty() ? "" : (" " + a.role).c_str(), e.what());
    return 1;
  }
}
