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
// With --store imap the mailbox is a real one on an IMAP server (from
// $DIBS_IMAP_HOST, _PORT, _USER, _PASSWORD): the delivery process APPENDs
// each message, an RFC 5322 mail with the order in its body, into a mailbox
// the run creates (demo-<pid>); each worker watches it with
// dibs::imap_mailbox (IDLE), its claims in the folder demo-<pid>-claims
// (marker_claim<imap_store>), and the keywords $Processing/$Completed show
// the state on each message. The results database and the log stay local
// (SQLite, in --dir). The checks are the same, and the end also lists the
// mailbox: every message must show $Completed, the store agreeing.
// scripts/demo.sh --store imap starts a throwaway Dovecot for it. A mailbox
// that takes OAuth2 tokens only (Exchange Online, Gmail) is reached with
// --imap-token-cmd CMD (a command printing the access token, run at each
// login, as mail clients' PassCmd is), a shared mailbox with --imap-authzid
// ADDR (its address; the token is the user's); the rest of
// dibs::imap::options::from_env() applies (DIBS_IMAP_TLS=implicit, ...).
// Such servers lack QRESYNC, which a claims folder needs: --imap-claims
// sqlite keeps the claims in claims.db in --dir instead
// (dibs::basic_imap_mailbox<dibs::sqlite_store>). Where the server keeps no
// keywords (Exchange), the mailbox shows the state by folders
// (demo-<pid>/Processing, /Done, /Failed), and the end checks that every
// message is in Done, none in two folders.
//
//   shared_inbox [--store sqlite|postgres|imap] [--pg CONNINFO] [--imap-token-cmd CMD] [--imap-authzid ADDR]
//                [--imap-claims imap|sqlite] [--lease S] [--workers M] [--messages N] [--kills K] [--rate R]
//                [--hold-us U] [--dir D] [--json FILE] [--keep]
//
// Workers are this program started again (by exec, with --role worker): a
// database connection must never be carried across fork(). On Windows they
// are started with CreateProcessW and killed with TerminateProcess
// (demo_process.hpp); the SQLite mailbox is there, PostgreSQL and IMAP are
// built where their client libraries are (DIBS_DEMO_POSTGRES, DIBS_DEMO_IMAP).
#ifndef DIBS_DEMO_POSTGRES
#define DIBS_DEMO_POSTGRES 0
#endif
#ifndef DIBS_DEMO_IMAP
#define DIBS_DEMO_IMAP 0
#endif
#ifndef DIBS_DEMO_REDIS
#define DIBS_DEMO_REDIS 0
#endif
#if DIBS_DEMO_IMAP
#include <dibs/imap/client.hpp>
#include <dibs/imap/mailbox.hpp>
#include <dibs/imap/store.hpp>
#endif
#include <dibs/marker_claim.hpp>
#if DIBS_DEMO_POSTGRES
#include <dibs/stores/postgres_store.hpp>
#endif
#if DIBS_DEMO_REDIS
#include <dibs/stores/redis_store.hpp>
#endif
#include <dibs/retry.hpp>
#include <dibs/shared_log.hpp>
#include <dibs/sqlite/connection.hpp>
#include <dibs/stores/sqlite_store.hpp>

#include "demo_process.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

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
  std::string redis;  // URL, for --store redis
  // For --store imap: the OAuth2 token command and the authorization
  // identity (empty: from the environment, see imap_options()).
  std::string imap_token_cmd;
  std::string imap_authzid;
  // For --store imap: where the claims are: "imap" (a folder on the server,
  // which needs QRESYNC) or "sqlite" (claims.db in --dir).
  std::string imap_claims = "imap";
  int lease_s = 30;  // the claims' lease, seconds
  // Internal: the roles of the processes the demo starts; the name of the
  // run (its PostgreSQL tables start with it; on IMAP, its mailboxes).
  std::string role;
  int id = 0;
  std::string run;
};

[[noreturn]] void usage(int code) {
  std::fputs(
      "usage: shared_inbox [--store sqlite|postgres|imap|redis] [--pg CONNINFO] [--redis URL] [--imap-token-cmd CMD]\n"
      "                    [--imap-authzid ADDR] [--imap-claims imap|sqlite] [--lease S] [--workers M]\n"
      "                    [--messages N] [--kills K] [--rate R] [--hold-us U] [--dir D] [--json FILE] [--keep]\n"
      "\n"
      "  A delivery process drops N messages into a SQLite mailbox at R per second\n"
      "  while M worker processes watch it. Each message is claimed by exactly one\n"
      "  worker (dibs::marker_claim on the message's row), which writes an order into a\n"
      "  shared results database (dibs::transact retries lost lock races) and a line\n"
      "  into one shared log (dibs::shared_log). K times during the run a random\n"
      "  worker is killed with SIGKILL (TerminateProcess on Windows) and a new one\n"
      "  started; its claims are recovered.\n"
      "  At the end a table shows what happened, and the program exits with status 1\n"
      "  if any message was lost or done twice, or a log line lost or torn.\n"
      "\n"
      "  --store S      where the mailbox, its claims and the results live: sqlite (files\n"
      "                 in --dir, the default), postgres (tables on a server) or imap (the\n"
      "                 messages and claims in mailboxes demo-<pid> and demo-<pid>-claims on\n"
      "                 the IMAP server of $DIBS_IMAP_HOST, _PORT, _USER, _PASSWORD; the\n"
      "                 results and the log in --dir) or redis (the messages and claims on a\n"
      "                 Redis server, in namespaces of the run; the results and the log in --dir)\n"
      "  --pg C         the PostgreSQL server, a libpq connection string (default:\n"
      "                 $DIBS_PG_CONNINFO, else the PG* environment)\n"
      "  --redis URL    the Redis server, redis://[USER:PASSWORD@]HOST[:PORT][/DB] (default:\n"
      "                 $DIBS_REDIS_URL)\n"
      "  --imap-token-cmd CMD\n"
      "                 log in to the IMAP server with an OAuth2 access token (XOAUTH2 or\n"
      "                 OAUTHBEARER, as Exchange Online and Gmail want) that the shell command\n"
      "                 CMD prints, run at each login (as mbsync's PassCmd; default:\n"
      "                 $DIBS_IMAP_TOKEN_CMD); the token is never printed\n"
      "  --imap-authzid ADDR\n"
      "                 the mailbox to act as, when it is not $DIBS_IMAP_USER's own (an Exchange\n"
      "                 Online shared mailbox's address; default: $DIBS_IMAP_AUTHZID)\n"
      "  --imap-claims C\n"
      "                 where the claims are: imap (a folder demo-<pid>-claims on the server,\n"
      "                 which must have QRESYNC; the default) or sqlite (claims.db in --dir:\n"
      "                 for a server without QRESYNC, as Exchange Online and Gmail are)\n"
      "  --lease S      the claims' lease in seconds (default 30): how long a claim whose\n"
      "                 holder cannot be proven gone (on another machine) waits, and, on\n"
      "                 IMAP's folder view, how long a message whose move a kill cut short\n"
      "                 waits for the watchers' repair\n"
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
    else if (opt == "--redis") a.redis = value();
    else if (opt == "--imap-token-cmd") a.imap_token_cmd = value();
    else if (opt == "--imap-authzid") a.imap_authzid = value();
    else if (opt == "--imap-claims") a.imap_claims = value();
    else if (opt == "--lease") a.lease_s = number(1, 3600);
    else if (opt == "--run") a.run = value();
    else if (opt == "--role") a.role = value();
    else if (opt == "--id") a.id = number(0, 1'000'000);
    else if (opt == "--help" || opt == "-h") usage(0);
    else {
      std::fprintf(stderr, "shared_inbox: unknown option '%s'\n", opt.c_str());
      usage(2);
    }
  }
  if (a.store != "sqlite" && a.store != "postgres" && a.store != "imap" && a.store != "redis") {
    std::fprintf(stderr, "shared_inbox: --store must be sqlite, postgres, imap or redis (got '%s')\n", a.store.c_str());
    std::exit(2);
  }
  if (a.imap_claims != "imap" && a.imap_claims != "sqlite") {
    std::fprintf(stderr, "shared_inbox: --imap-claims must be imap or sqlite (got '%s')\n", a.imap_claims.c_str());
    std::exit(2);
  }
  if ((a.store == "postgres" && !DIBS_DEMO_POSTGRES) || (a.store == "imap" && !DIBS_DEMO_IMAP) ||
      (a.store == "redis" && !DIBS_DEMO_REDIS)) {
    std::fprintf(stderr, "shared_inbox: this build has no --store %s (it was built without its client library)\n",
                 a.store.c_str());
    std::exit(2);
  }
  if (a.pg.empty() && std::getenv("DIBS_PG_CONNINFO")) a.pg = std::getenv("DIBS_PG_CONNINFO");
  if (a.redis.empty() && std::getenv("DIBS_REDIS_URL")) a.redis = std::getenv("DIBS_REDIS_URL");
  if (a.store == "redis" && a.redis.empty()) {
    std::fprintf(stderr, "shared_inbox: --store redis needs --redis URL or $DIBS_REDIS_URL\n");
    std::exit(2);
  }
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

// The results database and its statements on a SQLite file: the sqlite and
// imap engines keep their results there.
class sqlite_results_engine {
public:
  using results_db = dibs::sqlite::connection;

  explicit sqlite_results_engine(const args& a) : p_(a.dir) {}
  std::string table(std::string_view name) const { return std::string(name); }
  results_db open_results() const { return results_db{p_.results}; }

  void create_results() const {
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

  // What a worker does to the results.
  class results_access {
  public:
    explicit results_access(const sqlite_results_engine& e)
        : results(e.open_results()),
          applied_(results.prepare("SELECT max(token) FROM orders WHERE message = ?1")),
          insert_(results.prepare("INSERT INTO orders VALUES (?1, ?2, ?3, ?4, ?5, ?6)")),
          take_(results.prepare("UPDATE stock SET qty = qty - ?1 WHERE item = ?2")) {}
    results_db results;

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
    dibs::sqlite::statement applied_, insert_, take_;
  };

  std::vector<order_row> orders(results_db& res) const {
    std::vector<order_row> out;
    auto o = res.prepare("SELECT message, token, worker FROM orders");
    while (o.step()) out.push_back({o.column_text(0), o.column_int64(1), o.column_int64(2)});
    return out;
  }

protected:
  paths p_;
};

class sqlite_engine : public sqlite_results_engine {
public:
  using store = dibs::sqlite_store;

  explicit sqlite_engine(const args& a) : sqlite_results_engine(a) {}
  store open_mailbox() const { return store{p_.mailbox, "mailbox"}; }

  void create() const {
    results_db mail{p_.mailbox};
    // The message rows carry the claim marker (key, value, version) next to
    // their own columns: a message reads as unclaimed while value is NULL.
    mail.exec(
        "CREATE TABLE mailbox (key TEXT PRIMARY KEY NOT NULL, value BLOB, version INTEGER NOT NULL DEFAULT 0,"
        " seq INTEGER, body TEXT, delivered_at REAL);"
        "CREATE INDEX mailbox_seq ON mailbox (seq)");
    create_results();
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
  class worker_db : public results_access {
  public:
    explicit worker_db(const sqlite_engine& e)
        : results_access(e),
          mailbox(e.open_mailbox()),
          fresh_(mailbox.connection().prepare("SELECT key, body, seq FROM mailbox WHERE seq > ?1 ORDER BY seq LIMIT 500")) {}
    store mailbox;

    std::vector<message> fresh(std::int64_t after) {
      std::vector<message> out;
      fresh_.bind(1, after);
      while (fresh_.step()) out.push_back({fresh_.column_text(0), fresh_.column_text(1), fresh_.column_int64(2)});
      return out;
    }

  private:
    dibs::sqlite::statement fresh_;
  };

  // The parent's view, while the demo runs and for the checks.
  long delivered(results_db& mail) const { return static_cast<long>(*mail.query_int64("SELECT count(*) FROM mailbox")); }
  long completed(results_db& mail) const {
    return static_cast<long>(*mail.query_int64("SELECT count(*) FROM mailbox WHERE instr(value, 'state completed') > 0"));
  }
  results_db open_monitor() const { return results_db{p_.mailbox, {.journal_mode = "", .synchronous = ""}}; }
};

#if DIBS_DEMO_POSTGRES
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
  std::string kept() const { return fmt::format("tables kept: {}_*", run_); }

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
#endif


#if DIBS_DEMO_REDIS
// The mailbox on a Redis server (--redis URL): each message a record of the
// namespace RUN-mail (key msg-NNNNNN, value "SEQ BODY"), delivered in
// batches (create_n, one script each); the claims in the namespace RUN
// (marker_claim<redis_store>); the results database and the log in --dir,
// on SQLite.
class redis_engine : public sqlite_results_engine {
public:
  using store = dibs::redis_store;

  explicit redis_engine(const args& a) : sqlite_results_engine(a), url_(a.redis), run_(a.run) {}
  store open_mailbox() const { return store{url_, {.ns = run_}}; }
  store open_mail() const { return store{url_, {.ns = run_ + "-mail"}}; }
  std::string where() const {
    return fmt::format("Redis {}: messages in namespace '{}-mail', claims in '{}'", open_mail().server(), run_, run_);
  }

  void create() const {
    for (bool mail : {true, false}) {
      store s = mail ? open_mail() : open_mailbox();
      if (!s.keys().empty())
        throw std::runtime_error(fmt::format("shared_inbox: {} is not empty; give another --run", s.where()));
    }
    create_results();
  }
  // Erases the run's records (messages and claims).
  void drop() const {
    for (bool mail : {true, false}) {
      store s = mail ? open_mail() : open_mailbox();
      for (const auto& k : s.keys())
        if (const auto r = s.read(k)) (void)s.erase(k, r->version);
    }
  }
  std::string kept() const { return fmt::format("Redis namespaces kept: '{}-mail' and '{}'", run_, run_); }

  class delivery_db {
  public:
    explicit delivery_db(const redis_engine& e) : mail_(e.open_mail()) {}
    void insert(const std::vector<message>& batch) {
      std::vector<std::string> values;
      for (const auto& m : batch) values.push_back(fmt::format("{} {}", m.seq, m.body));
      std::vector<dibs::key_value> records;
      for (std::size_t i = 0; i < batch.size(); ++i) records.push_back({batch[i].key, values[i]});
      (void)mail_.create_n(records);  // one script: the batch lands whole
    }

  private:
    store mail_;
  };

  class worker_db : public results_access {
  public:
    explicit worker_db(const redis_engine& e) : results_access(e), mailbox(e.open_mailbox()), mail_(e.open_mail()) {}
    store mailbox;

    // The messages after `after`, in order: delivered in order, each batch
    // whole, so the first one missing ends them.
    std::vector<message> fresh(std::int64_t after) {
      std::vector<message> out;
      for (auto seq = after + 1; out.size() < 500; ++seq) {
        const auto r = mail_.read(message_key(static_cast<int>(seq)));
        if (!r) break;
        const auto space = r->value.find(' ');
        out.push_back({message_key(static_cast<int>(seq)), r->value.substr(space + 1), seq});
      }
      return out;
    }

  private:
    store mail_;
  };

  // The parent's view: the messages delivered, and the claims completed
  // (those made, less those still in progress: a claim of this demo is
  // never released, and never fails within its 10 attempts).
  struct monitor {
    store mail, claims;
  };
  monitor open_monitor() const { return {open_mail(), open_mailbox()}; }
  long delivered(monitor& m) const { return static_cast<long>(m.mail.keys().size()); }
  long completed(monitor& m) const {
    return static_cast<long>(m.claims.keys().size()) - static_cast<long>(m.claims.processing_keys().size());
  }
private:
  std::string url_, run_;
};
#endif

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

using demo::stop_requested;

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

// The claims' lease and attempts, in every mode.
// The claims' lease (--lease; every process of a run gets the same).
std::chrono::seconds claim_lease{30};
dibs::claim_options claim_policy() { return {.lease = claim_lease, .max_attempts = 10}; }

// Handling one claimed message: its order written into the results database
// in a transaction transact retries, its line in the shared log, and then
// its claim completed. `Results` is the engine's worker-side access to the
// results database (applied, insert_order, take_stock).
template <class Results>
class order_handler {
public:
  order_handler(Results& db, const paths& p, int id, std::chrono::microseconds hold)
      : db_(db), id_(id), hold_(hold), log_(p.log) {}
  order_handler(const order_handler&) = delete;  // policy_ holds `this`
  order_handler& operator=(const order_handler&) = delete;

  // `key`: the message's own name (msg-NNNNNN), in the orders and the log.
  template <class Claim>
  void handle(Claim& c, const std::string& key, const std::string& body) {
    const order_text order = parse_body(body);
    const auto token = static_cast<std::int64_t>(c.token());
    retries_ = 0;
    dibs::transact(policy_, db_.results, [&] {
      const int attempts = retries_ + 1;  // this one, after the retries before it
      // Fencing, and the crash between commit and complete(): an order
      // already written for this message by an earlier claim (a worker
      // killed after its commit) is the effect; it is not written again. An
      // order with a larger token means this claim was taken over.
      const std::optional<std::int64_t> prior = db_.applied(key);
      if (prior && *prior > token) throw std::runtime_error(fmt::format("{}: claim taken over", key));
      if (prior) return;
      std::this_thread::sleep_for(hold_);  // the work of the order, done under the lock
      db_.insert_order(key, token, id_, attempts, order.qty, order.item);
      db_.take_stock(order.qty, order.item);
    });
    log_.append(fmt::format("{} token {} worker {} order {} {}", key, token, id_, order.qty, order.item));
    c.complete(fmt::format("token {}", token));
  }

private:
  Results& db_;
  int id_;
  std::chrono::microseconds hold_;
  int retries_ = 0;  // of the current transaction, counted by the policy's hook
  dibs::retry_policy policy_ = transaction_policy().on_retry([this](const dibs::retry_event&) { ++retries_; });
  dibs::shared_log log_;
};

template <class Engine>
class worker {
public:
  worker(const Engine& engine, const paths& p, int id, std::chrono::microseconds hold)
      : db_(engine), claims_(db_.mailbox, claim_policy()), handler_(db_, p, id, hold) {}

  int run() {
    while (!stop_requested) {
      const bool got_new = poll_mailbox();
      bool worked = false;
      // Every worker tries every message it has seen and not seen finished:
      // the claim decides who handles it. A message claimed by a worker that
      // was killed is taken over here, on proof that its process is gone.
      for (auto it = pending_.begin(); it != pending_.end() && !stop_requested;) {
        if (auto c = claims_.try_claim(it->first)) {
          handler_.handle(*c, it->first, it->second);
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

  typename Engine::worker_db db_;
  dibs::marker_claim<typename Engine::store> claims_;
  order_handler<typename Engine::worker_db> handler_;
  std::int64_t last_seq_ = 0;
  std::map<std::string, std::string> pending_;  // key -> body
};

// ---------------------------------------------------------------------------
// What the claims say of each message at the end (by its name, msg-NNNNNN),
// and on IMAP what the mailbox shows.

struct mailbox_state {
  std::map<std::string, dibs::claim_status> claims;
  long shown_completed = -1;  // messages shown done ($Completed, or in Done), the store agreeing (IMAP only)
  long copies = 0;            // messages found twice (in two folders: a move's copy left behind; IMAP only)
  std::vector<std::string> listing;  // a few lines of the mailbox, for the reader (IMAP only)
};

template <class Engine>
mailbox_state inspect(const Engine& engine, int messages) {
  auto mailbox = engine.open_mailbox();
  dibs::marker_claim<typename Engine::store> claims{mailbox};
  mailbox_state st;
  for (int i = 1; i <= messages; ++i) st.claims[message_key(i)] = claims.status(message_key(i));
  return st;
}

#if DIBS_DEMO_IMAP
// ---------------------------------------------------------------------------
// The mailbox on an IMAP server (DIBS_IMAP_HOST, _PORT, _USER, _PASSWORD):
// the delivery process APPENDs real mails into a mailbox of the run's own
// (demo-<pid>), each worker watches it with dibs::imap_mailbox (the claims
// in the folder demo-<pid>-claims: marker_claim<imap_store>; the keywords
// $Processing/$Completed on the messages are their view), and the results
// database and the log stay in --dir, on SQLite.

// Returns: the demo's name of a message (msg-NNNNNN) from its Message-ID,
// <msg-NNNNNN.RUN@dibs-demo.invalid>.
std::string key_of_message_id(const std::string& id) {
  const auto from = id.starts_with('<') ? 1u : 0u;
  const auto dot = id.find('.', from);
  if (dot == std::string::npos || id.compare(from, 4, "msg-") != 0)
    throw std::runtime_error(fmt::format("a message that the demo did not deliver: Message-ID '{}'", id));
  return id.substr(from, dot - from);
}

// Returns: the body of an RFC 5322 message.
std::string body_of(const std::string& raw) {
  const auto blank = raw.find("\r\n\r\n");
  return blank == std::string::npos ? std::string{} : raw.substr(blank + 4);
}

// The IMAP server and login: dibs::imap::options::from_env() ($DIBS_IMAP_HOST,
// _PORT, _USER, _PASSWORD, _TLS, _TOKEN_CMD, _AUTHZID, ...), then
// --imap-token-cmd and --imap-authzid. A token command replaces the
// password: it logs in by XOAUTH2 or OAUTHBEARER (dibs::imap::token_command).
dibs::imap::options imap_options(const args& a) {
  auto o = dibs::imap::options::from_env();
  if (!a.imap_token_cmd.empty()) {
#ifdef _WIN32
    throw std::runtime_error("shared_inbox: --imap-token-cmd is not supported on Windows yet");
#else
    o.oauth2_token = dibs::imap::token_command(a.imap_token_cmd);
#endif
  }
  if (!a.imap_authzid.empty()) o.authzid = a.imap_authzid;
  return o;
}

// Claims: Claims is dibs::imap_store (a folder demo-<pid>-claims on the
// server, which must have QRESYNC) or dibs::sqlite_store (claims.db in
// --dir: --imap-claims sqlite, for a server without QRESYNC, as Exchange
// Online and Gmail are). The mailbox's view is whichever it chooses: the
// keywords where the server keeps them, else the folders
// demo-<pid>/Processing, /Done and /Failed.
template <class Claims>
class imap_engine : public sqlite_results_engine {
public:
  static constexpr bool claims_on_server = std::is_same_v<Claims, dibs::imap_store>;
  using mailbox_type = dibs::basic_imap_mailbox<Claims>;

  explicit imap_engine(const args& a)
      : sqlite_results_engine(a), server_(imap_options(a)), mailbox_(a.run), folder_(a.run + "-claims"),
        claims_db_(a.dir / "claims.db") {}
  const dibs::imap::options& server() const { return server_; }
  Claims open_claims() const {
    if constexpr (claims_on_server) return dibs::imap_store{server_, {.folder = folder_}};
    else return dibs::sqlite_store{claims_db_};
  }
  dibs::imap_mailbox_options mailbox_options() const { return {.mailbox = mailbox_, .claims = claim_policy()}; }
  std::string where() const {
    return fmt::format("IMAP server {}@{}:{}{}{}: messages delivered into mailbox '{}', claims in {}", server_.user,
                       server_.host, server_.port,
                       server_.authzid.empty() ? std::string{} : fmt::format(" (as {})", server_.authzid),
                       server_.oauth2_token ? " (OAuth2 token from a command)" : "", mailbox_, claims_where());
  }

  void create() const {
    dibs::imap::session s{server_};
    s.check(s.run(fmt::format("CREATE {}", dibs::imap::quote(mailbox_))), fmt::format("creating the mailbox '{}'", mailbox_));
    { auto claims = open_claims(); }  // creates its folder (its table)
    create_results();
  }
  // Removes the run's mailbox, the folder view's folders (where it made
  // them: subfolders first) and the claims folder.
  void drop() const {
    dibs::imap::session s{server_};
    std::vector<std::string> gone;
    for (const auto& f : view_folders(s))
      if (exists(s, f)) gone.push_back(f);
    gone.push_back(mailbox_);
    if constexpr (claims_on_server) gone.push_back(folder_);
    for (const auto& f : gone) s.check(s.run(fmt::format("DELETE {}", dibs::imap::quote(f))), "deleting the run's mailboxes");
  }
  std::string kept() const {
    return fmt::format("IMAP mailbox kept: '{}' (the messages, and its folders Processing, Done and Failed if the "
                       "folder view made them); the claims in {}",
                       mailbox_, claims_where());
  }

  // The delivery process's side: each message a mail of its own.
  class delivery_db {
  public:
    explicit delivery_db(const imap_engine& e) : e_(e), session_(e.server_) {}
    void insert(const std::vector<message>& batch) {
      std::vector<std::string> appends;
      for (const auto& m : batch)
        appends.push_back(fmt::format("APPEND {} {}", dibs::imap::quote(e_.mailbox_), dibs::imap::quote(mail(m))));
      for (const auto& r : session_.run_write(appends)) session_.check(r, fmt::format("delivering into '{}'", e_.mailbox_));
    }

  private:
    std::string mail(const message& m) const {
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      ::gmtime_r(&now, &tm);
      char date[64];
      std::strftime(date, sizeof date, "%a, %d %b %Y %H:%M:%S +0000", &tm);
      return fmt::format(
          "From: Shop orders <orders@shop.example>\r\nTo: Shared inbox <inbox@shop.example>\r\n"
          "Subject: {0}: {1}\r\nMessage-ID: <{0}.{2}@dibs-demo.invalid>\r\nDate: {3}\r\n"
          "MIME-Version: 1.0\r\nContent-Type: text/plain; charset=us-ascii\r\n\r\n{1}\r\n",
          m.key, m.body, e_.mailbox_, date);
    }
    const imap_engine& e_;
    dibs::imap::session session_;
  };

  // The parent's view while the demo runs: the messages in the mailbox and
  // its view's folders, and those shown done: $Completed (keywords), or in
  // Done (folders): the view, set after the store decided; the checks at
  // the end ask the store.
  // (Polled every 20 ms: one pipelined batch each, the folders' names
  // looked up once.)
  dibs::imap::session open_monitor() const { return dibs::imap::session{server_}; }
  long delivered(dibs::imap::session& s) const {
    std::vector<std::string> folders{mailbox_};
    for (const auto& f : view_folders(s)) folders.push_back(f);
    std::vector<std::string> commands;
    for (const auto& f : folders) commands.push_back(fmt::format("STATUS {} (MESSAGES)", dibs::imap::quote(f)));
    return messages_of(s.run(commands));  // a folder the view has not made yet: NO, nothing counted
  }
  long completed(dibs::imap::session& s) const {
    const auto r = s.run({fmt::format("EXAMINE {}", dibs::imap::quote(mailbox_)), "UID SEARCH KEYWORD $Completed",
                          fmt::format("STATUS {} (MESSAGES)", dibs::imap::quote(view_folders(s)[1]))});  // Done
    s.check(r[0], "counting the messages done");
    s.check(r[1], "counting the messages done");
    long n = 0;
    for (const auto& line : dibs::imap::untagged_of(r))
      if (line.starts_with("SEARCH")) n += static_cast<long>(dibs::imap::parse(line).size()) - 1;
    return n + messages_of(r);
  }

  // Every message of the mailbox and its view's folders, as the store and
  // the view say, and its Subject and Message-ID.
  mailbox_state inspect() const {
    auto claims = open_claims();
    mailbox_type inbox{server_, claims, mailbox_options()};
    const bool folders = inbox.view() == dibs::imap_mailbox_options::view_by::folders;
    const auto entries = inbox.status();
    // (folder, UID) -> Subject, Message-ID
    std::map<std::pair<std::string, std::uint32_t>, std::pair<std::string, std::string>> headers;
    dibs::imap::session s{server_};
    std::set<std::string> seen_in;
    for (const auto& e : entries) seen_in.insert(e.folder);
    for (const auto& folder : seen_in) {
      const auto r = s.run({fmt::format("EXAMINE {}", dibs::imap::quote(folder)),
                            "UID FETCH 1:* (UID BODY.PEEK[HEADER.FIELDS (SUBJECT MESSAGE-ID)])"});
      for (const auto& reply : r) s.check(reply, fmt::format("reading the headers of the messages in '{}'", folder));
      for (const auto& line : dibs::imap::untagged_of(r)) {
        const auto v = dibs::imap::parse(line);
        if (v.size() < 3 || !v[1].is("FETCH") || v[2].kind != dibs::imap::value::kind::list) continue;
        std::uint32_t uid = 0;
        std::string subject, id;
        const auto& fetched = v[2].items;
        for (std::size_t i = 0; i + 1 < fetched.size(); i += 2) {
          if (fetched[i].is("UID")) uid = static_cast<std::uint32_t>(fetched[i + 1].number().value_or(0));
          if (!fetched[i].text.starts_with("BODY[")) continue;
          std::istringstream in(fetched[i + 1].text);
          for (std::string field; std::getline(in, field);) {
            if (field.ends_with('\r')) field.pop_back();
            if (field.starts_with("Subject: ")) subject = field.substr(9);
            if (field.starts_with("Message-ID: ")) id = field.substr(12);
          }
        }
        headers[{folder, uid}] = {subject, id};
      }
    }
    mailbox_state st;
    st.shown_completed = 0;
    for (const auto& e : entries) {
      const auto& [subject, id] = headers[{e.folder, e.uid}];
      const auto key = key_of_message_id(id);
      if (st.claims.count(key)) ++st.copies;  // a message in two folders: a copy left by a move
      st.claims[key] = e.status;
      auto has = [&](std::string_view k) { return std::find(e.keywords.begin(), e.keywords.end(), k) != e.keywords.end(); };
      const bool shown = folders ? e.folder == inbox.done_folder()
                                 : has("$Completed") && !has("$Processing") && !has("$Failed");
      if (shown && e.status.state == dibs::claim_state::completed) ++st.shown_completed;
      if (st.listing.size() < 10) {
        std::string view = folders ? e.folder : std::string{};
        if (!folders)
          for (const auto& k : e.keywords) view += (view.empty() ? "" : " ") + k;
        st.listing.push_back(fmt::format("  UID {:>5}  {:<26}  {:<16}  store: {}", e.uid, subject, view,
                                         dibs::to_string(e.status.state)));
      }
    }
    st.listing.insert(st.listing.begin(),
                      fmt::format("mailbox '{}' after the run ({} messages; UID, Subject, {}, what the claims store "
                                  "says):",
                                  mailbox_, entries.size(), folders ? "folder" : "keywords"));
    if (entries.size() > 10)
      st.listing.push_back(fmt::format("  ... and {} more; {} of {} {} and are completed in the store",
                                       entries.size() - 10, st.shown_completed, entries.size(),
                                       folders ? "are in Done" : "show $Completed"));
    return st;
  }

private:
  std::string claims_where() const {
    if constexpr (claims_on_server) return fmt::format("folder '{}'", folder_);
    else return fmt::format("SQLite '{}'", claims_db_.string());
  }
  // The folder view's folders, named as the mailbox names them: its
  // subfolders Processing, Done and Failed, joined by the server's hierarchy
  // delimiter (from LIST; "/" where it says none).
  const std::vector<std::string>& view_folders(dibs::imap::session& s) const {
    if (!view_folders_.empty()) return view_folders_;
    const auto r = s.run(fmt::format("LIST \"\" {}", dibs::imap::quote(mailbox_)));
    s.check(r, fmt::format("listing the mailbox '{}'", mailbox_));
    std::string delimiter = "/";
    for (const auto& line : r.untagged)
      if (const auto v = dibs::imap::parse(line); v.size() >= 4 && v[0].is("LIST") && !v[2].text.empty())
        delimiter = v[2].text;
    view_folders_ = {mailbox_ + delimiter + "Processing", mailbox_ + delimiter + "Done", mailbox_ + delimiter + "Failed"};
    return view_folders_;
  }
  static bool exists(dibs::imap::session& s, const std::string& folder) {
    const auto r = s.run(fmt::format("LIST \"\" {}", dibs::imap::quote(folder)));
    s.check(r, fmt::format("looking for the folder '{}'", folder));
    return std::any_of(r.untagged.begin(), r.untagged.end(), [](const std::string& l) { return l.starts_with("LIST"); });
  }
  // Returns: the sum of the MESSAGES counts the STATUS replies of a batch
  // carry (a folder that does not exist has none).
  static long messages_of(const std::vector<dibs::imap::reply>& r) {
    long n = 0;
    for (const auto& line : dibs::imap::untagged_of(r))
      if (const auto at = line.find("(MESSAGES "); line.starts_with("STATUS") && at != std::string::npos)
        n += std::stol(line.substr(at + 10));
    return n;
  }

  dibs::imap::options server_;
  std::string mailbox_, folder_;
  fs::path claims_db_;
  mutable std::vector<std::string> view_folders_;  // view_folders(), once known
};

template <class Claims>
mailbox_state inspect(const imap_engine<Claims>& engine, int) {
  return engine.inspect();
}

// An IMAP worker: its own claims store and its own watcher of the mailbox,
// which waits for new mail with IDLE and hands over each message claimed.
template <class Claims>
class worker<imap_engine<Claims>> {
public:
  worker(const imap_engine<Claims>& engine, const paths& p, int id, std::chrono::microseconds hold)
      : claims_(engine.open_claims()),
        inbox_(engine.server(), claims_, engine.mailbox_options()),
        db_(engine),
        handler_(db_, p, id, hold) {}

  int run() {
    while (!stop_requested)
      if (auto mail = inbox_.next(200ms)) handler_.handle(*mail, key_of_message_id(mail->message_id()), body_of(mail->raw()));
    return 0;
  }

private:
  Claims claims_;
  typename imap_engine<Claims>::mailbox_type inbox_;
  typename imap_engine<Claims>::results_access db_;
  order_handler<typename imap_engine<Claims>::results_access> handler_;
};

#endif

// ---------------------------------------------------------------------------
// The parent: starts the processes, the chaos, the progress line, and checks.

struct figures {
  int workers = 0, messages = 0;
  long delivered = 0, completed = 0, failed = 0, duplicates = 0, missing_effects = 0, recovered = 0, killed = 0;
  long orders = 0, transactions_retried = 0, retries = 0, lost_updates = 0, worker_errors = 0;
  long log_lines_expected = 0, log_lines_found = 0, log_lines_of_killed = 0, torn = 0, stray = 0;
  long shown_completed = -1;  // IMAP: messages shown done ($Completed, or in Done), the store agreeing (-1: no such view)
  long copies = 0;            // IMAP: messages found in two folders
  double elapsed_s = 0;
  bool ok() const {
    return delivered == messages && completed == messages && failed == 0 && duplicates == 0 && missing_effects == 0 &&
           lost_updates == 0 && copies == 0 && log_lines_found == log_lines_expected && torn == 0 && stray == 0 && worker_errors == 0 &&
           (shown_completed < 0 || shown_completed == messages);
  }
};

// Counts and checks everything from what is stored: the claims (`st`),
// the results database, the log.
// `killed` holds the ids of the workers killed by the chaos: only they may
// have left an effect or a log line of a claim that did not complete.
template <class Engine>
figures check(const Engine& engine, const paths& p, figures f, const std::set<int>& killed, const mailbox_state& st) {
  auto res = engine.open_results();
  auto monitor = engine.open_monitor();
  f.delivered = engine.delivered(monitor);
  f.shown_completed = st.shown_completed;
  f.copies = st.copies;
  std::map<std::string, std::int64_t> completing_token;  // message -> token of the claim that completed it
  for (const auto& [key, s] : st.claims) {
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
  std::fprintf(out, "dibs shared inbox on %s: %d workers, %d messages, %ld workers killed with %s\n\n", engine,
               f.workers, f.messages, f.killed, demo::kill_name);
  row("messages delivered", n(f.delivered));
  row("completed exactly once", n(f.completed - f.duplicates), f.failed ? fmt::format("{} failed", f.failed) : "");
  row("duplicate effects", n(f.duplicates), "orders written twice for one message (must be 0)");
  if (f.missing_effects) row("completed without order", n(f.missing_effects), "(must be 0)");
  row("claims recovered", n(f.recovered), "taken over from killed workers, on proof they were gone");
  row("transactions retried", n(f.transactions_retried),
      fmt::format("{}: {} retries in all", std::string_view(engine) == "PostgreSQL" ? "serialization failures"
                                                                                   : "lost the results database's lock",
                  f.retries));
  row("lost stock updates", n(f.lost_updates), "(must be 0)");
  row("log lines expected", n(f.log_lines_expected), "one per completed message");
  row("log lines found", n(f.log_lines_found),
      f.log_lines_of_killed ? fmt::format("and {} from attempts killed before they completed", f.log_lines_of_killed)
                            : "");
  row("log lines torn", n(f.torn), "(must be 0)");
  if (f.stray) row("log lines unexplained", n(f.stray), "a second line, or one of a claim that was not killed (must be 0)");
  if (f.shown_completed >= 0)
    row("shown done", n(f.shown_completed),
        "messages whose $Completed keyword, or the Done folder, says so, the store agreeing (must be all)");
  if (f.copies > 0) row("copies", n(f.copies), "messages found in two folders (must be none)");
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
      "\"messages_per_s\": {:.1f}, {}\"ok\": {}}}\n",
      f.workers, f.messages, f.delivered, f.completed, f.failed, f.duplicates, f.missing_effects, f.recovered, f.killed,
      f.orders, f.transactions_retried, f.retries, f.lost_updates, f.log_lines_expected, f.log_lines_found,
      f.log_lines_of_killed, f.torn, f.stray, f.worker_errors, f.elapsed_s,
      static_cast<double>(f.completed) / std::max(f.elapsed_s, 1e-9),
      f.shown_completed >= 0 ? fmt::format("\"shown_completed\": {}, \"copies\": {}, ", f.shown_completed, f.copies)
                             : std::string{},
      f.ok() ? "true" : "false");
  if (!out) throw std::runtime_error(fmt::format("shared_inbox: cannot write '{}'", path.string()));
}

template <class Engine>
int run_demo(args a) {
  fs::path dir = a.dir;
  bool made_temp = false;
  if (dir.empty()) {
    dir = demo::make_temp_directory("dibs-inbox-");
    made_temp = true;
  } else {
    fs::create_directories(dir);
    for (const char* f : {"mailbox.db", "results.db", "inbox.log"})
      if (fs::exists(dir / f))
        throw std::runtime_error(fmt::format("shared_inbox: '{}' already exists; give an empty --dir", (dir / f).string()));
  }
  const paths p{dir};
  a.dir = dir;
  if (a.run.empty()) a.run = fmt::format("{}{}", a.store == "imap" ? "demo-" : "inbox_", demo::current_process_id());
  const Engine engine{a};
  engine.create();
  if constexpr (requires { engine.where(); }) std::printf("%s\n", engine.where().c_str());

  const std::string d = dir.string();
  // Every process gets the same place: the directory (the log; SQLite's
  // files), the store, the server and the run's name.
  const std::vector<std::string> place = {"--dir", d, "--store", a.store, "--pg", a.pg, "--redis", a.redis, "--run", a.run,
                                           "--imap-token-cmd", a.imap_token_cmd, "--imap-authzid", a.imap_authzid,
                                           "--imap-claims", a.imap_claims, "--lease", std::to_string(a.lease_s)};
  auto with_place = [&](std::vector<std::string> v) {
    v.insert(v.end(), place.begin(), place.end());
    return v;
  };
  auto worker_argv = [&](int id) {
    return with_place({"shared_inbox", "--role", "worker", "--id", std::to_string(id), "--hold-us",
                       std::to_string(a.hold_us)});
  };
  const auto t0 = steady::now();
  demo::stop_signal stop{a.run};  // before the workers, which watch it
  demo::process delivery{with_place({"shared_inbox", "--role", "deliver", "--messages", std::to_string(a.messages),
                                     "--rate", std::to_string(a.rate)})};
  std::vector<demo::process> workers;
  std::vector<int> id_of;  // the worker id of workers[i]
  int next_id = 1;
  std::set<int> killed_ids;
  auto start_worker = [&](std::size_t slot) {
    demo::process w{worker_argv(next_id)};
    if (slot == workers.size()) {
      workers.push_back(std::move(w));
      id_of.push_back(next_id++);
    } else {
      workers[slot] = std::move(w);
      id_of[slot] = next_id++;
    }
  };
  for (int i = 0; i < a.workers; ++i) start_worker(workers.size());

  figures f;
  f.workers = a.workers;
  f.messages = a.messages;
  const bool tty = demo::stdout_is_terminal();
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
  // Processes are started by exec, so this connection is never used across
  // a fork. It is closed at the end of this block, before the files are
  // removed: Windows removes no open file.
  for (auto monitor = engine.open_monitor();;) {
    std::this_thread::sleep_for(20ms);
    const auto now = steady::now();
    if (!delivered_all)
      if (const auto code = delivery.try_wait()) {
        delivered_all = true;
        if (*code != 0) throw std::runtime_error("shared_inbox: the delivery process failed");
      }
    for (std::size_t i = 0; i < workers.size(); ++i)  // a worker that died on its own is an error, and is replaced
      if (workers[i].try_wait()) {
        ++f.worker_errors;
        start_worker(i);
      }
    const long delivered = engine.delivered(monitor);
    completed = engine.completed(monitor);
    if (f.killed < a.kills && now >= kill_at[static_cast<std::size_t>(f.killed)]) {
      const std::size_t v = std::uniform_int_distribution<std::size_t>{0, workers.size() - 1}(rng);
      workers[v].kill();
      killed_ids.insert(id_of[v]);
      start_worker(v);
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
  stop.raise(workers);
  for (auto& w : workers)
    if (w.wait() != 0) ++f.worker_errors;

  const mailbox_state st = inspect(engine, a.messages);
  f = check(engine, p, f, killed_ids, st);
  print_table(f, stdout,
              a.store == "postgres" ? "PostgreSQL" : a.store == "imap" ? "IMAP" : a.store == "redis" ? "Redis" : "SQLite");
  if (!st.listing.empty()) std::printf("\n");
  for (const auto& line : st.listing) std::printf("%s\n", line.c_str());
  if (!a.json.empty()) write_json(f, a.json);
  constexpr bool on_server = requires { engine.drop(); };
  if (a.keep || !made_temp) {
    std::printf("files kept in %s\n", d.c_str());
    if constexpr (on_server) std::printf("%s\n", engine.kept().c_str());
  } else {
    fs::remove_all(dir);
    if constexpr (on_server) engine.drop();
  }
  return f.ok() ? 0 : 1;
}

template <class Engine>
int run_role(const args& a) {
  const Engine engine{a};
  if (a.role == "worker") {
    demo::watch_for_stop(a.run);
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
  claim_lease = std::chrono::seconds{a.lease_s};
  try {
#if DIBS_DEMO_POSTGRES
    if (a.store == "postgres") return run_role<postgres_engine>(a);
#endif
#if DIBS_DEMO_REDIS
    if (a.store == "redis") return run_role<redis_engine>(a);
#endif
#if DIBS_DEMO_IMAP
    if (a.store == "imap")
      return a.imap_claims == "sqlite" ? run_role<imap_engine<dibs::sqlite_store>>(a)
                                       : run_role<imap_engine<dibs::imap_store>>(a);
#endif
    return run_role<sqlite_engine>(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shared_inbox%s: %s\n", a.role.empty() ? "" : (" " + a.role).c_str(), e.what());
    return 1;
  }
}
