// dibs/stores/postgres_store.hpp: a dibs::shared_store whose records are rows of a
// PostgreSQL table, for processes on many machines.
//
//   dibs::postgres_store store{"host=db.internal dbname=app user=worker"};
//   dibs::marker_claim<dibs::postgres_store> claims{store};
//
// CMake target dibs::postgres (links libpq). The connection string is a
// libpq conninfo or URI; empty: the PG* environment variables. The table
// (default dibs_records) is created if absent:
//
//   key     bytea PRIMARY KEY    any bytes
//   value   bytea                the record; NULL: no record (erased, or a row
//                                an application inserted for a future item)
//   version bigint NOT NULL      grows with every change, also across erase
//                                and re-create (rows are never deleted by dibs),
//                                and across a DELETE by hand: a new row starts
//                                at the server's clock in microseconds
//   written timestamptz          the server's clock at the last change
//   state, attempts, priority, not_before, synced, claimable
//                                marker_claim's queue: what the record says,
//                                written with it (by a trigger for writers
//                                other than this dibs), so they never
//                                disagree with it; a partial index
//                                <table>_queue over the claimable rows
//
// and marked with the comment 'dibs-store 3' (the schema version); a table
// of another shape under that name is refused, naming it, and so is one of
// a newer schema. A table of schema 1 (without the queue columns) or 2
// (without `claimable`) is migrated in place by the first process that
// opens it, in one transaction under an advisory lock, while workers of
// the older version go on (see migrate() and docs/stores.md).
//
// Every operation is one prepared autocommit statement (create_or_read on a
// row without a record: two, see there). Failures:
//   - a lost connection, a server restarting or shutting down (class 08,
//     57P01-57P03), a serialization failure or deadlock (40001, 40P01), too
//     many connections (53300): transient (dibs::is_transient), and the next
//     operation reconnects by itself. A statement refused with 40001 or
//     40P01 changed nothing: the store runs it again itself, up to 8 times
//     with jittered pauses within the time given, before it throws (under
//     SERIALIZABLE as a server's or role's default even a read is refused so);
//   - a write whose reply was lost: errc::outcome_unknown, never a lost race
//     and never repeated blindly. Before the next operation, the store ends
//     the old server session (pg_terminate_backend) and waits until it is
//     gone, so what is read back then is final; the policies read back and
//     recognise their own records (store.hpp, detail::store_create);
//   - a wrong password, a missing role or database, a permission denied, a
//     constraint: not transient; the message names the server and the table.
// Every result of a statement is read: its implicit COMMIT comes after its
// own result, and a COMMIT that fails (a deferred trigger, a serialization
// failure under a default of SERIALIZABLE) is its error (an ERROR: rolled
// back; a FATAL or a broken connection: a write's outcome is unknown). A
// session the server closed while idle (idle_session_timeout) is noticed
// before sending, and opened again.
// A timed operation (dibs::time_limit) cancels its statement at the deadline
// (PQcancel), but never before 250 ms (a statement's own work on a loaded
// machine must not count as waiting), and says errc::timed_out only if the
// server confirms it was cancelled (nothing changed); a statement that
// completed meanwhile counts.
//
// The server's clock: read_aged(key) also says how long ago, by the server's
// clock, the record was last written, so a lease held through this store is
// judged expired by one clock for every client (lease_mutex uses it: a
// store_with_clock, with a quarter of the lease as margin for clocks that
// NTP slews at different rates). It is the server's wall clock: never step
// it while leases are held.
//
// Waking: an erase notifies (a trigger, NOTIFY dibs_<table> with the key in
// hex); wait_for_change(key, timeout) LISTENs on a second connection, so a
// lock waiter wakes when the holder lets go instead of polling. An offer
// (create, create_n of a claimable record) notifies dibs_<table>_offered
// in its own statement; wait_for_offer(timeout) LISTENs on a third, so an
// idle worker_pool wakes when work comes.
//
// Thread-safe: each connection is used by one thread at a time; threads are
// spread over up to postgres_store_options::sessions connections (4), so a
// worker_pool's fetcher and completer, or an application's threads, run
// their statements side by side; renewals (on the renewal threads) have a
// connection of their own, so an application statement that waits on a row
// lock never holds a lease up.
// Open a new store in a child after fork(): the child's copy never touches
// the parent's connections (that would end the parent's sessions), but the
// store's mutexes may have been held by another thread at the fork.
// PostgreSQL 14 or later; not behind a transaction-pooling PgBouncer (ending
// a lost session by its pid would end another client's).
#pragma once

#ifdef _WIN32
#error "dibs/stores/postgres_store.hpp is not ported to Windows yet; docs/windows.md lists the headers that are"
#endif

#include <endian.h>
#include <libpq-fe.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/detail/claim_record.hpp>
#include <dibs/detail/posix/sys.hpp>
#include <dibs/detail/renewal_keeper.hpp>
#include <dibs/postgres/connection.hpp>
#include <dibs/error.hpp>
#include <dibs/retry.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct postgres_store_options {
  /// The table of the records: letters, digits and '_', not starting with a
  /// digit or "pg_", at most 48 characters.
  std::string table = "dibs_records";
  /// How long a server that stopped answering (a cut network, a frozen
  /// host) may take to be noticed: TCP keepalives and tcp_user_timeout.
  std::chrono::seconds dead_peer{10};
  /// Connections the store's operations use at most (besides the renewals'
  /// and the waiters'): each thread that calls the store is given one of
  /// them when it first does, in turn, and always uses that one; threads
  /// beyond this many share. A connection is opened when its first thread
  /// comes, so a store used by one thread opens one. 1: every thread takes
  /// turns on one connection (as before dibs 0.5).
  std::size_t sessions = 4;
};

class postgres_store {
public:
  /// Effects: connects, and creates the table (and its trigger) if absent.
  /// Throws: std::system_error naming the server and table: it cannot be
  /// reached (transient), refuses the login (not), the table has another
  /// shape (errc::corrupt_record), a bad table name (errc::invalid_argument),
  /// a role that may not create it.
  explicit postgres_store(std::string conninfo = {}, postgres_store_options opts = {})
      : conninfo_(std::move(conninfo)), opts_(std::move(opts)) {
    validate_table(opts_.table);
    if (opts_.sessions == 0 || opts_.sessions > 64)
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::postgres_store: sessions must be 1 to 64 (got {})", opts_.sessions));
    for (std::size_t i = 0; i < opts_.sessions; ++i) sessions_.push_back(std::make_unique<session>());
    session& first = current();
    std::lock_guard g{first.m};
    connect(first, true);
  }
  postgres_store(const postgres_store&) = delete;
  postgres_store& operator=(const postgres_store&) = delete;
  ~postgres_store() {
    // A forked child's copies of the connections are the parent's sessions.
    for (const auto& ses : sessions_)
      if (ses->conn && ses->owner == ::getpid()) ::PQfinish(ses->conn);
    if (renewals_.conn && renewals_.owner == ::getpid()) ::PQfinish(renewals_.conn);
    for (listener* l : {&changes_, &offers_})
      if (l->conn && l->owner == ::getpid()) ::PQfinish(l->conn);
  }

  std::optional<record> read(std::string_view key) { return read(key, dibs::time_limit::max()); }
  std::optional<record> read(std::string_view key, dibs::time_limit t) {
    validate_key(key, "dibs::postgres_store::read");
    const auto r = run(stmt::read, {key}, t, false, "read");
    if (::PQntuples(r.get()) == 0 || ::PQgetisnull(r.get(), 0, 0)) return std::nullopt;
    return record{bytes(r.get(), 0, 0), integer(r.get(), 0, 1)};
  }

  /// Returns: the record and how long ago the server last wrote it.
  std::optional<aged_record> read_aged(std::string_view key, dibs::time_limit t = dibs::time_limit::max()) {
    validate_key(key, "dibs::postgres_store::read_aged");
    const auto r = run(stmt::read_aged, {key}, t, false, "read");
    if (::PQntuples(r.get()) == 0 || ::PQgetisnull(r.get(), 0, 0)) return std::nullopt;
    return aged_record{record{bytes(r.get(), 0, 0), integer(r.get(), 0, 1)},
                       std::chrono::milliseconds{static_cast<std::int64_t>(integer(r.get(), 0, 2))}};
  }

  /// Returns: the server's wall clock now (clock_timestamp(), to the
  /// millisecond): one clock for every client, whatever the hosts' clocks
  /// say (dibs::once numbers its slots by it; store_with_wall_clock).
  std::chrono::system_clock::time_point now(dibs::time_limit t = dibs::time_limit::max()) {
    const auto r = run(stmt::now, {}, t, false, "read the server's clock");
    return std::chrono::system_clock::time_point{
        std::chrono::milliseconds{static_cast<std::int64_t>(integer(r.get(), 0, 0))}};
  }

  std::optional<dibs::version> create(std::string_view key, std::string_view value) {
    return create(key, value, dibs::time_limit::max());
  }
  std::optional<dibs::version> create(std::string_view key, std::string_view value, dibs::time_limit t) {
    validate_key(key, "dibs::postgres_store::create");
    validate_value(key, value);
    const queue_row q{value};
    const auto r = run(stmt::create, {key, value, q.state(), q.attempts(), q.priority(), q.not_before(), q.claimable()},
                       t, true, "create");
    if (::PQntuples(r.get()) == 0) return std::nullopt;
    return integer(r.get(), 0, 0);
  }

  /// For marker_claim's try_claim (dibs::create_or_read_store): creates the
  /// record of `key` as create() does if the key has none, else returns the
  /// one it has, unchanged, in one statement (INSERT ... ON CONFLICT DO
  /// NOTHING, which locks and writes nothing when the key has a row, and a
  /// read of that row). A row without a record (erased, or inserted by an
  /// application with value NULL) takes create()'s statement as a second.
  /// Returns: `created`, or `existing`; neither if another writer created
  /// the key at that moment (its record not yet visible to the statement).
  create_or_read_result create_or_read(std::string_view key, std::string_view value,
                                       dibs::time_limit t = dibs::time_limit::max()) {
    validate_key(key, "dibs::postgres_store::create_or_read");
    validate_value(key, value);
    const queue_row q{value};
    const auto r = run(stmt::create_or_read,
                       {key, value, q.state(), q.attempts(), q.priority(), q.not_before(), q.claimable()}, t, true,
                       "create");
    if (::PQntuples(r.get()) == 0) return {};
    if (integer(r.get(), 0, 2) == 1) return {integer(r.get(), 0, 0), std::nullopt};
    if (::PQgetisnull(r.get(), 0, 1)) return {create(key, value, t), std::nullopt};
    return {std::nullopt, record{bytes(r.get(), 0, 1), integer(r.get(), 0, 0)}};
  }

  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value) {
    return replace(key, expected, value, dibs::time_limit::max());
  }
  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value,
                                       dibs::time_limit t) {
    validate_key(key, "dibs::postgres_store::replace");
    validate_value(key, value);
    if (expected > static_cast<dibs::version>(INT64_MAX)) return std::nullopt;
    const std::string v = std::to_string(expected);
    const queue_row q{value};
    const auto r = run(stmt::replace,
                       {key, v, value, q.state(), q.attempts(), q.priority(), q.not_before(), q.claimable()}, t, true,
                       "replace");
    if (::PQntuples(r.get()) == 0) return std::nullopt;
    return integer(r.get(), 0, 0);
  }

  bool erase(std::string_view key, dibs::version expected) { return erase(key, expected, dibs::time_limit::max()); }
  bool erase(std::string_view key, dibs::version expected, dibs::time_limit t) {
    validate_key(key, "dibs::postgres_store::erase");
    if (expected > static_cast<dibs::version>(INT64_MAX)) return false;
    const std::string v = std::to_string(expected);
    const auto r = run(stmt::erase, {key, v}, t, true, "erase");
    return ::PQntuples(r.get()) == 1;
  }

  /// For marker_claim's offer_n (dibs::batch_store): creates each absent
  /// key as create() does, in one statement (INSERT ... SELECT FROM unnest
  /// of arrays ... ON CONFLICT), with each record's queue columns.
  /// Returns: per item its version, or nothing if the key had a record.
  /// Throws: errc::invalid_argument, before anything is sent, for a bad key
  /// or value or a key given twice; otherwise as create().
  std::vector<std::optional<dibs::version>> create_n(std::span<const key_value> items,
                                                     dibs::time_limit t = dibs::time_limit::max()) {
    detail::check_batch(items, "dibs::postgres_store::create_n");
    batch_arrays a{items.size()};
    for (const auto& it : items) a.add(it.key, it.value);
    const auto r = run(stmt::create_n, {a.keys.data(), a.values.data(), a.states.data(), a.attempts.data(),
                                        a.priorities.data(), a.not_befores.data(), a.claimables.data()},
                       t, true, "create a batch of records");
    return per_item(r.get(), items);
  }

  /// For marker_claim's complete_n (dibs::batch_store): each item's
  /// compare-and-set as replace() does it, in one statement (UPDATE ... FROM
  /// unnest of arrays). Returns: per item its new version, or nothing if its
  /// version had moved. Throws: as create_n.
  std::vector<std::optional<dibs::version>> replace_n(std::span<const replace_item> items,
                                                      dibs::time_limit t = dibs::time_limit::max()) {
    detail::check_batch(items, "dibs::postgres_store::replace_n");
    batch_arrays a{items.size()};
    pg_array expected{pg_array::int8_oid, items.size()};
    for (const auto& it : items) {
      a.add(it.key, it.value);
      // A version above what bigint holds is on no row: -1 never matches.
      expected.int8(it.expected > static_cast<dibs::version>(INT64_MAX) ? -1 : static_cast<std::int64_t>(it.expected));
    }
    const auto r = run(stmt::replace_n, {a.keys.data(), expected.data(), a.values.data(), a.states.data(),
                                         a.attempts.data(), a.priorities.data(), a.not_befores.data(),
                                         a.claimables.data()},
                       t, true, "replace a batch of records");
    return per_item(r.get(), items);
  }

  /// For marker_claim::claim_next and claim_next_n (dibs::claim_queue_store):
  /// in one statement, claims up to `n` claimable items whose key starts
  /// with `prefix` (state offered or released, or a row inserted with value
  /// NULL and version 0, whose not_before has come by the server's clock),
  /// the highest priority first, then in key order, skipping rows other
  /// workers are claiming (FOR UPDATE SKIP LOCKED, over a partial index of
  /// claimable rows); the new value of each is the processing head with the
  /// attempt counted (from the attempts column) and its priority kept, then
  /// `rest`. Returns: their keys and new records, highest priority first.
  std::vector<std::pair<std::string, record>> take_claimable(std::string_view prefix, std::string_view rest,
                                                             std::uint32_t n,
                                                             dibs::time_limit t = dibs::time_limit::max()) {
    validate_value(prefix, rest);
    // The key range [prefix, upper): upper is prefix with its last byte that
    // is not 0xff increased and the rest cut; none if there is no such byte.
    std::string upper(prefix);
    while (!upper.empty() && static_cast<unsigned char>(upper.back()) == 0xff) upper.pop_back();
    if (!upper.empty()) upper.back() = static_cast<char>(static_cast<unsigned char>(upper.back()) + 1);
    const std::string count = std::to_string(std::max<std::uint32_t>(n, 1));
    const auto r = run(prefix.empty() ? stmt::take_all : stmt::take, {prefix, upper, rest, count}, t, true,
                       "claim the next item");
    std::vector<std::pair<std::string, record>> out;
    const int rows = ::PQntuples(r.get());
    out.reserve(static_cast<std::size_t>(rows));
    for (int i = 0; i < rows; ++i)
      out.emplace_back(bytes(r.get(), i, 0),
                       record{claim_head(integer(r.get(), i, 1), static_cast<std::int64_t>(integer(r.get(), i, 3))) +
                                  std::string(rest),
                              integer(r.get(), i, 2)});
    if (rows > 1) {
      // RETURNING keeps no order: by priority, then key.
      std::vector<dibs::version> prio;
      for (int i = 0; i < rows; ++i) prio.push_back(integer(r.get(), i, 3));
      std::vector<std::size_t> idx(out.size());
      for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
      std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) {
        const auto pa = static_cast<std::int64_t>(prio[a]), pb = static_cast<std::int64_t>(prio[b]);
        return pa != pb ? pa > pb : out[a].first < out[b].first;
      });
      std::vector<std::pair<std::string, record>> sorted;
      sorted.reserve(out.size());
      for (auto i : idx) sorted.push_back(std::move(out[i]));
      out = std::move(sorted);
    }
    return out;
  }

  /// For marker_claim's sweeps (dibs::claim_queue_store). Returns: the keys
  /// that start with `prefix` whose record is a processing claim (by the
  /// state column; a scan of the table, run when the queue is idle).
  std::vector<std::string> processing_keys(std::string_view prefix = {}) {
    const auto r = run(stmt::processing, {prefix}, dibs::time_limit::max(), false, "list claims in progress");
    std::vector<std::string> out;
    for (int i = 0; i < ::PQntuples(r.get()); ++i) out.push_back(bytes(r.get(), i, 0));
    return out;
  }

  /// Returns: the keys of the live records that start with `prefix`.
  std::vector<std::string> keys(std::string_view prefix = {}) {
    const auto r = run(stmt::keys, {prefix}, dibs::time_limit::max(), false, "list keys");
    std::vector<std::string> out;
    for (int i = 0; i < ::PQntuples(r.get()); ++i) out.push_back(bytes(r.get(), i, 0));
    return out;
  }

  /// Effects: blocks until the record of `key` is erased (NOTIFY from the
  /// table's trigger) or `timeout` passes. A change just before the call can
  /// be missed; callers re-read after at most `timeout` anyway.
  /// Returns: true if an erase of the key was seen, or may have been: the
  /// listening session ended meanwhile (the server's idle_session_timeout,
  /// a restart) and was opened again, and a notification sent in between is
  /// lost; read the record again either way.
  bool wait_for_change(std::string_view key, std::chrono::nanoseconds timeout) const {
    return wait_notified(changes_, hex(key), timeout);
  }

  /// For dibs::worker_pool: blocks until an offer() or offer_n() of any
  /// process made a claimable item in the table (they NOTIFY dibs_<table>_offered
  /// in their statement) or `timeout` passes; an offer made before the first
  /// call may be missed, and a notification may be for an item taken since.
  /// Returns: true if an offer was seen.
  bool wait_for_offer(std::chrono::nanoseconds timeout) const { return wait_notified(offers_, {}, timeout); }

  const std::string& table() const noexcept { return opts_.table; }
  /// Returns: "host:port/database" of the server, for messages.
  const std::string& server() const noexcept { return server_; }
  /// Returns: "table 'T' on host:port/database", for messages.
  std::string where() const { return fmt::format("table '{}' on {}", opts_.table, server_); }

  /// Throws: errc::invalid_argument naming `table` if it is not a name this
  /// store takes.
  static void validate_table(std::string_view table) {
    auto fail = [&](std::string_view rule) {
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::postgres_store: invalid table name '{}': {}", table, rule));
    };
    if (table.empty()) fail("a table name must not be empty");
    if (table.size() > 48) fail("a table name must be at most 48 characters");
    if (table.front() >= '0' && table.front() <= '9') fail("a table name must not start with a digit");
    for (const char c : table)
      if (!(c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')))
        fail("only letters, digits and '_' are allowed");
    if (table.starts_with("pg_")) fail("names starting with 'pg_' belong to PostgreSQL");
  }

private:
  // A connection of the store, used by one thread at a time (its mutex).
  struct session {
    std::mutex m;
    PGconn* conn = nullptr;
    pid_t owner = 0;                  // the process that opened conn (a forked child never touches it)
    std::string pid, start;           // its server session
    std::string lost_pid, lost_start;  // a session that broke under a write
    bool ended = false;                // the server said it ends the session (postgres::detail::note_ending)
  };
  // Renewals (on the renewal keeper's threads) have a connection of their
  // own, so a statement of the application's that waits (a row lock held by
  // an open transaction, a table lock) never holds a lease's renewal up.
  enum class stmt {
    read,
    read_aged,
    now,
    create,
    create_or_read,
    replace,
    erase,
    keys,
    take,
    take_all,
    processing,
    create_n,
    replace_n
  };
  static constexpr std::chrono::milliseconds min_statement{250};
  using result = std::unique_ptr<PGresult, decltype(&::PQclear)>;
  static constexpr std::string_view schema_comment = "dibs-store 3";
  // A parameter of run() that is SQL NULL (by its address).
  static constexpr char null_text[] = "";
  static constexpr std::string_view null{null_text, 0};
  static constexpr std::string_view schema_1_comment = "dibs-store 1";
  static constexpr std::string_view schema_2_comment = "dibs-store 2";

  // A LISTEN connection and the waiters' turn on it; one per channel, so
  // that a lock waiter and a worker pool's fetcher do not wait for each other.
  struct listener {
    explicit listener(std::string c) : channel(std::move(c)) {}
    std::string channel;
    std::mutex m;
    PGconn* conn = nullptr;
    pid_t owner = 0;
  };

  // Requires: l.m held. Opens the LISTEN connection (again).
  // Returns: false if that failed (the waiter then polls).
  bool listen(listener& l) const {
    if (l.conn) ::PQfinish(l.conn);
    l.conn = postgres::detail::open(conninfo_, opts_.dead_peer);
    l.owner = ::getpid();
    if (!l.conn) return false;
    ::PQsetNoticeReceiver(l.conn, [](void*, const PGresult*) {}, nullptr);  // its end is seen by its status
    std::unique_ptr<PGresult, decltype(&::PQclear)> r{
        ::PQexec(l.conn, fmt::format("LISTEN \"{}\"", l.channel).c_str()), ::PQclear};
    if (::PQstatus(l.conn) == CONNECTION_OK && ::PQresultStatus(r.get()) == PGRES_COMMAND_OK) return true;
    ::PQfinish(l.conn);
    l.conn = nullptr;
    return false;
  }

  // Blocks until a notification on l's channel whose payload is `want`
  // (any, if `want` is empty) or until `timeout` passes. Returns: true if
  // one came.
  bool wait_notified(listener& l, std::string_view want, std::chrono::nanoseconds timeout) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    std::lock_guard g{l.m};
    if (l.conn && l.owner != ::getpid()) l.conn = nullptr;  // a forked child's copy: the parent's
    auto opened = std::chrono::steady_clock::time_point{};
    for (;;) {
      // The server may end the LISTEN session while it waits (it is idle to
      // the server: idle_session_timeout; a restart): listen on a new one,
      // at most every 200 ms (a server that ends every new session).
      if (!l.conn || ::PQstatus(l.conn) != CONNECTION_OK) {
        // A session that was listening and ended: a NOTIFY sent between its
        // end and the new LISTEN is lost, so once listening again this call
        // says "maybe changed" and the caller reads again.
        const bool lost = l.conn != nullptr;
        if (std::chrono::steady_clock::now() - opened < std::chrono::milliseconds{200})
          std::this_thread::sleep_until(std::min(end, opened + std::chrono::milliseconds{200}));
        if (std::chrono::steady_clock::now() >= end) return false;
        opened = std::chrono::steady_clock::now();
        if (!listen(l)) return sleep_until(end);
        if (lost) return true;
      }
      ::PQconsumeInput(l.conn);
      bool seen = false;
      while (PGnotify* n = ::PQnotifies(l.conn)) {
        seen = seen || want.empty() || want == n->extra;
        ::PQfreemem(n);
      }
      if (seen) return true;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      if (::PQstatus(l.conn) != CONNECTION_OK) continue;
      pollfd p{::PQsocket(l.conn), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count() + 1, 60'000))) < 0 && errno != EINTR)
        return sleep_until(end);
    }
  }

  static bool sleep_until(std::chrono::steady_clock::time_point end) {
    std::this_thread::sleep_until(end);
    return false;
  }

  static std::string hex(std::string_view s) {
    std::string out;
    out.reserve(s.size() * 2);
    for (const char c : s) out += detail::hex_digits(static_cast<unsigned char>(c), 2);
    return out;
  }

  // A one-dimensional array in PostgreSQL's binary format (what array_send
  // writes and array_recv reads): ndim, has-nulls, element type, then the
  // length and lower bound of the one dimension, then each element as its
  // length (-1: NULL) and bytes, every integer in network order.
  class pg_array {
  public:
    static constexpr std::uint32_t bool_oid = 16, bytea_oid = 17, int8_oid = 20, int4_oid = 23, text_oid = 25;
    pg_array(std::uint32_t element, std::size_t n) {
      put32(1);
      put32(0);
      put32(element);
      put32(static_cast<std::uint32_t>(n));
      put32(1);
    }
    void bytes(std::string_view b) {
      put32(static_cast<std::uint32_t>(b.size()));
      buf_ += b;
    }
    void null() {
      put32(0xffffffffu);
      buf_[7] = 1;  // has-nulls (the low byte of the second word)
    }
    void int4(std::int32_t v) {
      put32(4);
      put32(static_cast<std::uint32_t>(v));
    }
    void int8(std::int64_t v) {
      put32(8);
      const auto u = static_cast<std::uint64_t>(v);
      put32(static_cast<std::uint32_t>(u >> 32));
      put32(static_cast<std::uint32_t>(u));
    }
    void boolean(bool b) {
      put32(1);
      buf_ += b ? '\1' : '\0';
    }
    std::string_view data() const noexcept { return buf_; }

  private:
    void put32(std::uint32_t v) {
      const char b[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                         static_cast<char>(v)};
      buf_.append(b, 4);
    }
    std::string buf_;
  };

  // The arrays of a batch: keys, values and each value's queue columns (as
  // queue_row computes them for one record).
  struct batch_arrays {
    pg_array keys, values, states, attempts, priorities, not_befores, claimables;
    explicit batch_arrays(std::size_t n)
        : keys{pg_array::bytea_oid, n}, values{pg_array::bytea_oid, n}, states{pg_array::text_oid, n},
          attempts{pg_array::int4_oid, n}, priorities{pg_array::int8_oid, n}, not_befores{pg_array::int8_oid, n},
          claimables{pg_array::bool_oid, n} {}
    void add(std::string_view key, std::string_view value) {
      keys.bytes(key);
      values.bytes(value);
      const auto h = detail::claim_record::parse_head(value);
      if (h && !h->state_word.empty()) states.bytes(h->state_word);
      else states.null();
      attempts.int4(h && h->attempts ? static_cast<std::int32_t>(*h->attempts) : 0);
      priorities.int8(h ? h->priority : 0);
      if (h && h->not_before_ms) not_befores.int8(*h->not_before_ms);
      else not_befores.null();
      claimables.boolean(h && h->waiting());
    }
  };

  // A batch statement's rows (key, version) matched to its items by key
  // (the keys of a batch are distinct; RETURNING keeps no order).
  template <class Item>
  static std::vector<std::optional<dibs::version>> per_item(const PGresult* r, std::span<const Item> items) {
    std::vector<std::pair<std::string, dibs::version>> rows;
    for (int i = 0; i < ::PQntuples(r); ++i) rows.emplace_back(bytes(r, i, 0), integer(r, i, 1));
    std::sort(rows.begin(), rows.end());
    std::vector<std::optional<dibs::version>> out;
    out.reserve(items.size());
    for (const auto& it : items) {
      const auto f = std::lower_bound(rows.begin(), rows.end(), it.key,
                                      [](const auto& row, std::string_view k) { return row.first < k; });
      if (f != rows.end() && f->first == it.key) out.emplace_back(f->second);
      else out.emplace_back();
    }
    return out;
  }

  static std::string bytes(const PGresult* r, int row, int col) {
    return std::string(::PQgetvalue(r, row, col), static_cast<std::size_t>(::PQgetlength(r, row, col)));
  }
  static dibs::version integer(const PGresult* r, int row, int col) {
    std::uint64_t be = 0;
    if (::PQgetlength(r, row, col) == 8) std::memcpy(&be, ::PQgetvalue(r, row, col), 8);
    return static_cast<dibs::version>(be64toh(be));
  }

  // Requires: ses.m held. Connects `ses` (again), prepares the statements,
  // and ends a session lost in the middle of a write; `first`: also makes
  // sure the table is there (the constructor).
  void connect(session& ses, bool first = false) {
    if (ses.conn && ses.owner == ::getpid()) ::PQfinish(ses.conn);
    ses.conn = nullptr;
    PGconn* c = postgres::detail::open(conninfo_, opts_.dead_peer);
    if (first) server_ = postgres::detail::where(c);
    if (!c || ::PQstatus(c) != CONNECTION_OK) {
      const std::string msg = postgres::detail::one_line(c ? ::PQerrorMessage(c) : "out of memory");
      if (c) ::PQfinish(c);
      throw postgres::detail::connect_error("dibs::postgres_store", server_, msg);
    }
    ses.conn = c;
    ses.owner = ::getpid();
    ses.ended = false;
    // Notices ("already exists, skipping") are not for stderr; a FATAL one
    // marks the session ended.
    ::PQsetNoticeReceiver(c, &postgres::detail::note_ending, &ses.ended);
    try {
      if (first) setup_table(c);
      // The statements are prepared once and run many times; left to
      // choose, the server plans the claim statement again at every call
      // (its parameters look as if they mattered to the plan), which costs
      // more than running it. This session is the store's own.
      exec(c, "SET plan_cache_mode = force_generic_plan", "set up its session");
      prepare(c);
      // Its session, by pid and start time (as a number: text depends on
      // DateStyle and TimeZone).
      const result r{::PQexec(c, "SELECT pg_backend_pid(), extract(epoch FROM backend_start)::text "
                                 "FROM pg_stat_activity WHERE pid = pg_backend_pid()"),
                     ::PQclear};
      check(r.get(), c, "find its own session");
      ses.pid = ::PQgetvalue(r.get(), 0, 0);
      ses.start = ::PQgetvalue(r.get(), 0, 1);
      settle(ses);
    } catch (...) {
      ::PQfinish(ses.conn);
      ses.conn = nullptr;
      throw;
    }
  }

  // Throws naming the server, the table and `what`, unless `r` succeeded.
  void check(const PGresult* r, PGconn* c, std::string_view what) const {
    postgres::detail::check(r, c, fmt::format("dibs::postgres_store: cannot {} (table '{}' on {})", what, opts_.table,
                                              server_));
  }

  void exec(PGconn* c, const std::string& sql, std::string_view what) {
    const result r{::PQexec(c, sql.c_str()), ::PQclear};
    check(r.get(), c, what);
  }

  // The queue columns: what marker_claim's record says (its state and
  // attempts on lines 2 and 3; its priority and not_before lines), for the
  // claim statement and its index, and `claimable` (schema 3): the state is
  // offered or released (or a row without a record at version 0), the
  // condition of the partial index <table>_queue. The index names
  // `claimable` rather than `state` so that completing a claim (processing
  // to completed: neither claimable) changes no column an index names, and
  // the server can write it as a HOT update, without new index entries.
  // This dibs writes them with the record, in the same statement
  // (queue_row); `synced` is the version they were written for. Any other
  // writer (dibs of schema 1 or 2 still running, an application's own
  // INSERT) leaves `synced` behind the version, or a record erased under a
  // claimable state, or `claimable` apart from `state`, and the trigger
  // <table>_queue_fix computes them from the record in the same
  // transaction: no other session sees them disagree with what
  // marker_claim reads. (Generated columns would do that too, but the
  // server prepares their expressions again at every statement, which cost
  // more than the claim itself.)
  static constexpr std::string_view queue_column_defs =
      "state text, attempts integer NOT NULL DEFAULT 0, priority bigint NOT NULL DEFAULT 0, not_before bigint, "
      "synced bigint";
  static constexpr std::string_view claimable_def = "claimable boolean NOT NULL DEFAULT false";

  // The trigger that corrects the columns of rows written by others. An
  // AFTER trigger, which sets them by an UPDATE of its own: a BEFORE
  // trigger could set them in the row being written, but the server locks
  // every row it updates for a BEFORE trigger before it evaluates the
  // trigger's WHEN (one more WAL record, and 2-3 us, on every update of
  // this dibs, whose rows need nothing); an AFTER trigger's WHEN is
  // evaluated on the row as written, for nothing. Its parsing is
  // queue_row's. Replaces schema 2's BEFORE trigger <table>_queue_sync.
  static std::string queue_fix_sql(const std::string& t) {
    return fmt::format(
        "CREATE OR REPLACE FUNCTION \"{0}_queue_fix\"() RETURNS trigger LANGUAGE plpgsql AS $$"
        "DECLARE head text; st text; att integer := 0; pri bigint := 0; nb bigint; BEGIN "
        "IF NEW.value IS NULL THEN "
        "IF NEW.version = 0 THEN st := 'offered'; END IF; "
        "ELSIF substring(NEW.value FROM 1 FOR 13) = 'dibs-claim 1\n'::bytea THEN "
        "head := encode(NEW.value, 'escape'); "
        "st := substring(split_part(head, E'\\n', 2) FROM '^state ([a-z]{{1,20}})$'); "
        "att := coalesce(substring(split_part(head, E'\\n', 3) FROM '^attempts ([0-9]{{1,9}})$')::integer, 0); "
        "pri := coalesce(substring(head FROM E'(?:^|\\n)priority (-?[0-9]{{1,18}})(?:\\n|$)')::bigint, 0); "
        "nb := substring(head FROM E'(?:^|\\n)not_before ([0-9]{{1,18}})(?:\\n|$)')::bigint; "
        "END IF; "
        "UPDATE \"{0}\" SET state = st, attempts = att, priority = pri, not_before = nb, synced = NEW.version, "
        "claimable = coalesce(st IN ('offered', 'released'), false) WHERE key = NEW.key AND version = NEW.version; "
        "RETURN NULL; END$$; "
        "DROP TRIGGER IF EXISTS \"{0}_queue_sync\" ON \"{0}\"; DROP FUNCTION IF EXISTS \"{0}_queue_sync\"(); "
        "CREATE OR REPLACE TRIGGER \"{0}_queue_fix\" AFTER INSERT OR UPDATE ON \"{0}\" FOR EACH ROW "
        "WHEN (NEW.synced IS DISTINCT FROM NEW.version OR (NEW.value IS NULL AND NEW.state IS DISTINCT FROM "
        "CASE WHEN NEW.version = 0 THEN 'offered' END) OR "
        "NEW.claimable IS DISTINCT FROM coalesce(NEW.state IN ('offered', 'released'), false)) "
        "EXECUTE FUNCTION \"{0}_queue_fix\"()",
        t);
  }

  // The queue columns of a record, as the trigger computes them, as text
  // parameters (`null` for SQL NULL; text parameters end at a NUL, hence
  // the copies).
  class queue_row {
  public:
    std::string_view state() const noexcept { return state_null_ ? null : std::string_view{state_}; }
    std::string_view attempts() const noexcept { return attempts_; }
    std::string_view priority() const noexcept { return priority_; }
    std::string_view not_before() const noexcept { return not_before_null_ ? null : std::string_view{not_before_}; }
    std::string_view claimable() const noexcept {
      return !state_null_ && (state_ == "offered" || state_ == "released") ? "true" : "false";
    }

    explicit queue_row(std::string_view v) {
      const auto h = detail::claim_record::parse_head(v);
      if (!h) return;
      if (!h->state_word.empty()) {
        state_ = h->state_word;
        state_null_ = false;
      }
      if (h->attempts) attempts_ = std::to_string(*h->attempts);
      priority_ = std::to_string(h->priority);
      if (h->not_before_ms) {
        not_before_ = std::to_string(*h->not_before_ms);
        not_before_null_ = false;
      }
    }

  private:
    std::string state_, attempts_ = "0", priority_ = "0", not_before_;
    bool state_null_ = true, not_before_null_ = true;
  };

  // The rows claim_next may take: also the condition of the partial index,
  // written the same, so that the planner uses it.
  static constexpr std::string_view claimable = "claimable";

  // Returns: the table's comment (its schema), "" if it has none, nullopt if
  // there is no such table.
  std::optional<std::string> table_comment(PGconn* c) {
    const std::string& t = opts_.table;
    const result has{::PQexecParams(c,
                                    "SELECT coalesce(obj_description(c.oid, 'pg_class'), '') FROM pg_class c "
                                    "WHERE c.oid = to_regclass(quote_ident($1))",
                                    1, nullptr, std::array<const char*, 1>{t.c_str()}.data(), nullptr, nullptr, 0),
                     ::PQclear};
    check(has.get(), c, "look for the table");
    if (::PQntuples(has.get()) == 0) return std::nullopt;
    return std::string(::PQgetvalue(has.get(), 0, 0));
  }

  // Runs `body` in one transaction that holds the table's advisory lock
  // (two first users at once would collide in the catalog).
  template <class Body>
  void under_table_lock(PGconn* c, std::string_view what, Body body) {
    exec(c, "BEGIN", what);
    try {
      exec(c, fmt::format("SELECT pg_advisory_xact_lock(hashtext('dibs-store:{}'))", opts_.table), what);
      body();
      exec(c, "COMMIT", what);
    } catch (...) {
      const result r{::PQexec(c, "ROLLBACK"), ::PQclear};
      throw;
    }
  }

  // Creates the table if absent, migrates one of schema 1 to schema 2, then
  // checks its shape.
  void setup_table(PGconn* c) {
    const std::string& t = opts_.table;
    auto comment = table_comment(c);
    if (!comment) {
      under_table_lock(c, "create the table", [&] {
        exec(c, fmt::format("CREATE TABLE IF NOT EXISTS \"{0}\" (key bytea PRIMARY KEY, value bytea, "
                            "version bigint NOT NULL DEFAULT 0, written timestamptz NOT NULL DEFAULT clock_timestamp(), "
                            "{3}, {5}); {4}; "
                            "COMMENT ON TABLE \"{0}\" IS '{1}'; "
                            "CREATE OR REPLACE FUNCTION \"{0}_notify\"() RETURNS trigger LANGUAGE plpgsql AS "
                            "$$BEGIN PERFORM pg_notify('dibs_{0}', encode(NEW.key, 'hex')); RETURN NULL; END$$; "
                            "CREATE OR REPLACE TRIGGER \"{0}_erased\" AFTER UPDATE ON \"{0}\" FOR EACH ROW "
                            "WHEN (NEW.value IS NULL AND OLD.value IS NOT NULL) EXECUTE FUNCTION \"{0}_notify\"(); "
                            "CREATE INDEX IF NOT EXISTS \"{0}_queue\" ON \"{0}\" (priority DESC, key) WHERE {2}",
                            t, schema_comment, claimable, queue_column_defs, queue_fix_sql(t), claimable_def),
             "create the table");
      });
      comment = table_comment(c);
    }
    if (comment && (*comment == schema_1_comment || *comment == schema_2_comment)) migrate(c);
    comment = table_comment(c);
    // A newer dibs's table: what it keeps there this one cannot keep right.
    if (comment && comment->starts_with("dibs-store ") && *comment != schema_comment) {
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::postgres_store: table '{}' on {} has the schema '{}', which this "
                                          "dibs does not know (it knows '{}' and migrates '{}' and '{}'): use the "
                                          "newer dibs "
                                          "that made it, or name another table (postgres_store_options::table)",
                                          t, server_, *comment, schema_comment, schema_1_comment, schema_2_comment));
    }
    // The shape: exactly what dibs reads and writes, and its schema version.
    const result cols{
        ::PQexecParams(c,
                       "SELECT string_agg(column_name || ' ' || data_type, ', ' ORDER BY column_name), "
                       "obj_description(to_regclass(quote_ident($1)), 'pg_class') "
                       "FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = $1 "
                       "AND column_name IN ('key', 'value', 'version', 'written', 'state', 'attempts', 'priority', "
                       "'not_before', 'synced', 'claimable')",
                       1, nullptr, std::array<const char*, 1>{t.c_str()}.data(), nullptr, nullptr, 0),
        ::PQclear};
    check(cols.get(), c, "check the table's shape");
    const std::string shape = ::PQgetvalue(cols.get(), 0, 0), comment_now = ::PQgetvalue(cols.get(), 0, 1);
    constexpr std::string_view want =
        "attempts integer, claimable boolean, key bytea, not_before bigint, priority bigint, state text, "
        "synced bigint, value bytea, version bigint, written timestamp with time zone";
    if (shape != want || comment_now != schema_comment)
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::postgres_store: table '{}' on {} is not a dibs store table of this "
                                          "version (columns: '{}', comment: '{}'; dibs needs columns '{}' and the "
                                          "comment '{}'): name another table (postgres_store_options::table)",
                                          t, server_, shape, comment_now, want, schema_comment));
  }

  // Migrates a table of schema 1 or 2 to schema 3 in place, in one
  // transaction under the table's advisory lock (the first process of this
  // dibs to open it does; the others find it done). The columns are added
  // without a rewrite, but under an exclusive lock: workers wait for the
  // transaction, and then go on. A worker of an older schema that opened
  // before keeps working: its statements are planned again (without the
  // index, whose condition changed: a scan), its claim statement still
  // selects by the record (schema 1) or by `state` (schema 2), which the
  // trigger keeps right in the writer's own transaction, and takes a row
  // only under its row lock, so nothing is taken twice; a worker of schema
  // 1 ignores priorities and backoffs. One that opens after is refused by
  // the comment.
  void migrate(PGconn* c) {
    const std::string& t = opts_.table;
    under_table_lock(c, "migrate the table to schema 3", [&] {
      const auto now = table_comment(c);
      if (!now || (*now != schema_1_comment && *now != schema_2_comment)) return;  // another process did it meanwhile
      // Behind a long transaction of the application's that holds rows of
      // the table, the exclusive lock would queue every worker up behind
      // it: give up instead, and say so.
      exec(c, "SET LOCAL lock_timeout = '10s'", "migrate the table to schema 3");
      std::string add;
      if (*now == schema_1_comment)
        for (std::string_view defs = queue_column_defs; !defs.empty();) {
          const auto comma = defs.find(", ");
          add += fmt::format("ADD COLUMN {}, ", defs.substr(0, comma));
          defs = comma == std::string_view::npos ? std::string_view{} : defs.substr(comma + 2);
        }
      // The columns are added empty (no rewrite), then filled by the
      // trigger, row by row, from the records (schema 1); of schema 2 only
      // the claimable rows change.
      exec(c, fmt::format("ALTER TABLE \"{0}\" {1}ADD COLUMN {2}; {3}; {4}; "
                          "DROP INDEX IF EXISTS \"{0}_claimable\"; DROP INDEX IF EXISTS \"{0}_queue\"; "
                          "CREATE INDEX \"{0}_queue\" ON \"{0}\" (priority DESC, key) WHERE {5}; "
                          "COMMENT ON TABLE \"{0}\" IS '{6}'",
                          t, add, claimable_def, queue_fix_sql(t),
                          *now == schema_1_comment
                              ? fmt::format("UPDATE \"{}\" SET synced = -1", t)
                              : fmt::format("UPDATE \"{}\" SET claimable = true WHERE state IN ('offered', 'released')", t),
                          claimable, schema_comment),
           *now == schema_1_comment
               ? "migrate the table to schema 3 (columns state, attempts, priority, not_before, synced, claimable)"
               : "migrate the table to schema 3 (column claimable)");
    });
  }

  // The head of the value take_sql writes, from the attempts and priority it
  // returns: the same bytes, built here rather than sent back with the rest
  // the client already has (a take returned the whole record, ~200 bytes).
  static std::string claim_head(dibs::version attempts, std::int64_t priority) {
    return detail::claim_record::taken_head(attempts, priority);
  }

  // claim_next's statement: up to $4 claimable rows whose not_before has
  // come by the server's clock (with the key prefix $1, its range [$1, $2)
  // for the index, $2 empty: no end), highest priority first, locked while
  // other workers skip them, made processing with their attempt counted;
  // returns their keys, attempts, versions and priorities (not the values:
  // claim_head and the rest make them on the client).
  static std::string take_sql(const std::string& t, bool prefix) {
    return fmt::format(
        "UPDATE \"{0}\" r SET value = convert_to('dibs-claim 1' || E'\\n' || 'state processing' || E'\\n' || "
        "'attempts ' || (r.attempts + 1) || E'\\n' || CASE WHEN r.priority <> 0 THEN 'priority ' || r.priority || "
        "E'\\n' ELSE '' END, 'UTF8') || $3::bytea, version = r.version + 1, written = clock_timestamp(), "
        "state = 'processing', attempts = r.attempts + 1, not_before = NULL, synced = r.version + 1, claimable = false "
        "WHERE r.key = ANY (ARRAY(SELECT key FROM \"{0}\" WHERE ({1}) AND (not_before IS NULL OR "
        "not_before <= floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) {2} "
        "ORDER BY priority DESC, key LIMIT $4::integer FOR UPDATE SKIP LOCKED)) "
        "RETURNING r.key, r.attempts::bigint, r.version, r.priority",
        t, claimable,
        prefix ? "AND key >= $1::bytea AND ($2::bytea = ''::bytea OR key < $2::bytea) AND "
                 "substring(key FROM 1 FOR length($1::bytea)) = $1::bytea"
               : "AND $1::bytea = $2::bytea");
  }

  // The version of a record on a new row: the server's clock in
  // microseconds, the clock this store already trusts for leases. A row
  // deleted by hand takes its versions with it; they started at its own
  // creation and grew by one per write, and no row is written a million
  // times a second, so a row made again starts above every version the
  // deleted one had: tokens never repeat for a key, with no floor kept
  // anywhere and no race with the DELETE (never step the server's clock
  // back, as for leases). A row without a record (erased, or an
  // application's, at version 0) continues from the larger of its own
  // version and this.
  static constexpr const char* first_version = "(extract(epoch FROM statement_timestamp()) * 1000000)::bigint";

  // The condition of a create statement's result that also tells the
  // waiters of wait_for_offer(): NOTIFY dibs_<table>_offered once (pg_notify
  // in a subquery run once) if a claimable record was made; always true.
  static std::string offered_notify(const std::string& t) {
    return fmt::format("(SELECT count(*) FROM (SELECT pg_notify('dibs_{}_offered', '') FROM ins WHERE claimable "
                       "LIMIT 1) n) >= 0",
                       t);
  }

  void prepare(PGconn* c) {
    const std::string& t = opts_.table;
    const std::pair<stmt, std::string> all[] = {
        {stmt::read, fmt::format("SELECT value, version FROM \"{}\" WHERE key = $1", t)},
        {stmt::read_aged, fmt::format("SELECT value, version, (extract(epoch FROM clock_timestamp() - written) * 1000)::bigint "
                                      "FROM \"{}\" WHERE key = $1",
                                      t)},
        {stmt::now, "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"},
        {stmt::create, fmt::format("WITH ins AS (INSERT INTO \"{0}\" AS r (key, value, version, written, state, attempts, "
                                   "priority, not_before, synced, claimable) VALUES ($1, $2, {1}, clock_timestamp(), $3, "
                                   "$4::integer, $5::bigint, $6::bigint, {1}, $7::boolean) ON CONFLICT (key) DO UPDATE "
                                   "SET value = excluded.value, version = GREATEST(r.version + 1, excluded.version), "
                                   "written = clock_timestamp(), state = excluded.state, attempts = excluded.attempts, "
                                   "priority = excluded.priority, not_before = excluded.not_before, "
                                   "synced = GREATEST(r.version + 1, excluded.version), "
                                   "claimable = excluded.claimable WHERE r.value IS NULL "
                                   "RETURNING version, claimable) SELECT version FROM ins WHERE {2}",
                                   t, first_version, offered_notify(t))},
        {stmt::create_or_read,
         fmt::format("WITH ins AS (INSERT INTO \"{0}\" (key, value, version, written, state, attempts, priority, "
                     "not_before, synced, claimable) VALUES ($1, $2, {1}, clock_timestamp(), $3, $4::integer, "
                     "$5::bigint, $6::bigint, {1}, $7::boolean) ON CONFLICT (key) DO NOTHING RETURNING version) "
                     "SELECT version, NULL::bytea, 1::bigint FROM ins UNION ALL "
                     "SELECT version, value, 0::bigint FROM \"{0}\" WHERE key = $1 AND NOT EXISTS (SELECT FROM ins)",
                     t, first_version)},
        {stmt::replace, fmt::format("UPDATE \"{}\" SET value = $3, version = version + 1, written = clock_timestamp(), "
                                    "state = $4, attempts = $5::integer, priority = $6::bigint, not_before = $7::bigint, "
                                    "synced = version + 1, claimable = $8::boolean "
                                    "WHERE key = $1 AND version = $2::bigint AND value IS NOT NULL RETURNING version",
                                    t)},
        {stmt::erase, fmt::format("UPDATE \"{}\" SET value = NULL, written = clock_timestamp(), state = NULL, "
                                  "attempts = 0, priority = 0, not_before = NULL, synced = version, claimable = false "
                                  "WHERE key = $1 AND version = $2::bigint AND value IS NOT NULL RETURNING version",
                                  t)},
        {stmt::take, take_sql(t, true)},
        {stmt::take_all, take_sql(t, false)},
        // The batches: create's and replace's statements over the rows of
        // unnest(arrays), one statement for the whole batch.
        {stmt::create_n,
         fmt::format("WITH ins AS (INSERT INTO \"{0}\" AS r (key, value, version, written, state, attempts, priority, "
                     "not_before, synced, claimable) SELECT u.k, u.v, {1}, clock_timestamp(), u.st, u.att, u.pri, u.nb, {1}, u.cl "
                     "FROM unnest($1::bytea[], $2::bytea[], $3::text[], $4::integer[], $5::bigint[], $6::bigint[], "
                     "$7::boolean[]) AS u(k, v, st, att, pri, nb, cl) ON CONFLICT (key) DO UPDATE "
                     "SET value = excluded.value, version = GREATEST(r.version + 1, excluded.version), "
                     "written = clock_timestamp(), state = excluded.state, attempts = excluded.attempts, "
                     "priority = excluded.priority, not_before = excluded.not_before, "
                     "synced = GREATEST(r.version + 1, excluded.version), claimable = excluded.claimable "
                     "WHERE r.value IS NULL RETURNING key, version, claimable) SELECT key, version FROM ins WHERE {2}",
                     t, first_version, offered_notify(t))},
        {stmt::replace_n,
         fmt::format("UPDATE \"{}\" AS r SET value = u.v, version = r.version + 1, written = clock_timestamp(), "
                     "state = u.st, attempts = u.att, priority = u.pri, not_before = u.nb, synced = r.version + 1, "
                     "claimable = u.cl FROM unnest($1::bytea[], $2::bigint[], $3::bytea[], $4::text[], "
                     "$5::integer[], $6::bigint[], $7::bigint[], $8::boolean[]) AS u(k, ver, v, st, att, pri, nb, cl) "
                     "WHERE r.key = u.k AND r.version = u.ver AND r.value IS NOT NULL RETURNING r.key, r.version",
                     t)},
        {stmt::processing, fmt::format("SELECT key FROM \"{}\" WHERE state = 'processing' AND "
                                       "substring(key FROM 1 FOR length($1::bytea)) = $1::bytea",
                                       t)},
        {stmt::keys, fmt::format("SELECT key FROM \"{}\" WHERE value IS NOT NULL AND "
                                 "substring(key FROM 1 FOR length($1::bytea)) = $1::bytea",
                                 t)},
    };
    for (const auto& [s, sql] : all) {
      const result r{::PQprepare(c, name(s), sql.c_str(), 0, nullptr), ::PQclear};
      check(r.get(), c, "prepare its statements");
    }
  }

  static const char* name(stmt s) noexcept {
    switch (s) {
      case stmt::read: return "dibs_read";
      case stmt::read_aged: return "dibs_read_aged";
      case stmt::now: return "dibs_now";
      case stmt::create: return "dibs_create";
      case stmt::create_or_read: return "dibs_create_or_read";
      case stmt::replace: return "dibs_replace";
      case stmt::erase: return "dibs_erase";
      case stmt::keys: return "dibs_keys";
      case stmt::take: return "dibs_take";
      case stmt::take_all: return "dibs_take_all";
      case stmt::processing: return "dibs_processing";
      case stmt::create_n: return "dibs_create_n";
      case stmt::replace_n: return "dibs_replace_n";
    }
    return "";
  }

  // Ends the session whose write was lost, if it still runs (a cut network:
  // the server has not noticed yet), and waits until it is gone, so that its
  // write has landed or never will.
  void settle(session& ses) {
    if (ses.lost_pid.empty()) return;
    const char* params[] = {ses.lost_pid.c_str(), ses.lost_start.c_str()};
    for (int i = 0;; ++i) {
      const result r{::PQexecParams(ses.conn,
                                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                    "WHERE pid = $1::int AND extract(epoch FROM backend_start) = $2::numeric",
                                    2, nullptr, params, nullptr, nullptr, 0),
                     ::PQclear};
      check(r.get(), ses.conn, "end a session whose write was lost");
      if (::PQntuples(r.get()) == 0) break;
      if (i > 10 * 60 * 5)
        throw std::system_error(make_error_code(errc::timed_out),
                                fmt::format("dibs::postgres_store: session {} on {} does not end", ses.lost_pid,
                                            server_));
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
    }
    ses.lost_pid.clear();
  }

  // Runs a prepared statement with binary parameters and results, waiting
  // until `t` at most (then cancelling it). Reconnects first if needed.
  //
  // Every result is read, up to the server's ReadyForQuery: the statement's
  // own comes before its implicit COMMIT (at Sync), and a COMMIT that fails
  // (a deferred constraint or trigger, a serialization failure under
  // SERIALIZABLE, the session ended between the two) comes after it. The
  // first error is the statement's. An ERROR: the transaction rolled back,
  // nothing changed, whatever followed. A FATAL or a broken connection: a
  // write's fate is unknown (lost()), unless the server ended the session
  // for idling (57P05) before the statement came: then it never ran, and is
  // sent once more on a new session.
  result run(stmt s, std::initializer_list<std::string_view> params, dibs::time_limit t, bool write,
             std::string_view what) {
    session& ses = current();
    std::lock_guard g{ses.m};
    std::vector<const char*> values;
    std::vector<int> lengths, formats;
    std::size_t i = 0;
    for (const auto& p : params) {
      values.push_back(p.data());
      lengths.push_back(static_cast<int>(p.size()));
      // Versions go as text ($2 of replace and erase), and so do the
      // count of take ($4) and the queue columns; keys and values as bytes.
      const bool text = ((s == stmt::replace || s == stmt::erase) && i == 1) ||
                        ((s == stmt::take || s == stmt::take_all) && i == 3) || ((s == stmt::create || s == stmt::create_or_read) && i >= 2) ||
                        (s == stmt::replace && i >= 3);
      formats.push_back(text ? 0 : 1);
      ++i;
    }
    static const char empty = 0;
    for (auto& v : values)
      if (!v) v = &empty;
      else if (v == null.data()) v = nullptr;  // SQL NULL
    // A deadline is for waiting on what others hold (a row lock of a stopped
    // session), not for the statement's own work: on a loaded machine a few
    // round trips can take more than a "try"'s 20 ms, so a statement always
    // has at least min_statement before it is cancelled.
    const auto limit = t == dibs::time_limit::max() ? t : std::max(t, std::chrono::steady_clock::now() + min_statement);
    for (int attempt = 0;; ++attempt) {
      // A session the server ended while it waited (idle_session_timeout,
      // pg_terminate_backend) would never run the statement, and its fate
      // could only be reported unknown: a new one first.
      if (!ses.conn || ses.owner != detail::current_pid() || ::PQstatus(ses.conn) != CONNECTION_OK ||
          postgres::detail::ended_while_idle(ses.conn, ses.ended))
        connect(ses);
      PGconn* const conn = ses.conn;
      if (!::PQsendQueryPrepared(conn, name(s), static_cast<int>(values.size()), values.data(), lengths.data(),
                                 formats.data(), 1))
        lost(ses, false, what);  // nothing was sent
      reply rep = receive(conn, limit);
      const bool broken = rep.broken || ::PQstatus(conn) != CONNECTION_OK;
      if (::PQstatus(conn) == CONNECTION_BAD)  // libpq says why, without waiting
        while (PGresult* more = ::PQgetResult(conn)) rep.results.emplace_back(more, ::PQclear);
      const PGresult* first = rep.results.empty() ? nullptr : rep.results.front().get();
      const PGresult* failed = nullptr;
      for (const auto& r : rep.results) {
        const auto st = ::PQresultStatus(r.get());
        if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
          failed = r.get();
          break;
        }
      }
      const auto state = postgres::detail::field(failed, PG_DIAG_SQLSTATE);
      if (failed && !state.empty() && postgres::detail::field(failed, PG_DIAG_SEVERITY_NONLOCALIZED) == "ERROR") {
        // Rolled back. A connection left in the middle (no ReadyForQuery
        // in time) is dropped; the next operation opens another.
        std::optional<std::system_error> error;
        if (rep.cancelled && state == "57014")
          error.emplace(make_error_code(errc::timed_out),
                        fmt::format("dibs::postgres_store: {} on {} (table '{}') did not finish in the time given and "
                                    "was cancelled (nothing changed)",
                                    what, server_, opts_.table));
        else
          try {
            check(failed, conn, what);
          } catch (const std::system_error& e) {
            error.emplace(e);
          }
        // A serialization failure or a deadlock rolled the statement back:
        // nothing changed, and the server asks for it to be run again (under
        // SERIALIZABLE, a role's or a server's default, even a read can be
        // refused so). Done here a few times, with jittered pauses, within
        // the time given; then it is the caller's error (transient).
        if (!broken && !rep.cancelled && (state == "40001" || state == "40P01") && attempt < 8 &&
            std::chrono::steady_clock::now() < limit) {
          thread_local std::minstd_rand rng{std::random_device{}()};
          const auto cap = std::min<long>(50'000, 1'000L << attempt);  // microseconds
          std::this_thread::sleep_for(std::chrono::microseconds{std::uniform_int_distribution<long>{0, cap}(rng)});
          continue;
        }
        if (broken) drop(ses);
        throw *error;
      }
      if (failed && failed == first && state == "57P05") {
        drop(ses);
        if (attempt == 0) continue;
        lost(ses, false, what, failed);
      }
      if (failed || broken || !first) lost(ses, write, what, failed);
      return std::move(rep.results.front());
    }
  }

  // What came back for a statement: its results in order, and whether the
  // connection broke (or stopped answering) before the server was done.
  struct reply {
    std::vector<result> results;
    bool broken = false;
    bool cancelled = false;
  };

  // Reads every result of the statement sent on `conn`, until the server is
  // done with it; at `limit`, asks the server to cancel it, and gives up
  // (broken) if it does not answer that either within dead_peer.
  reply receive(PGconn* conn, dibs::time_limit limit) {
    reply rep;
    for (;;) {
      // What has arrived is taken first, and the socket read only after
      // poll says there is more: one recv per reply (reading at once after
      // sending, or again after the last result, finds nothing, and costs
      // a system call each time).
      if (!::PQisBusy(conn)) {
        PGresult* r = ::PQgetResult(conn);
        if (!r) return rep;
        rep.results.emplace_back(r, ::PQclear);
        continue;
      }
      if (::PQstatus(conn) == CONNECTION_BAD) {  // nothing more will come (its socket may be closed)
        rep.broken = true;
        return rep;
      }
      int wait_ms = -1;
      if (limit != dibs::time_limit::max()) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(limit - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
          // No answer to the cancel either: the server or the way to it is
          // gone (a partition).
          if (rep.cancelled) {
            rep.broken = true;
            return rep;
          }
          cancel(conn);
          rep.cancelled = true;
          limit = std::chrono::steady_clock::now() + opts_.dead_peer;
          continue;
        }
        wait_ms = static_cast<int>(std::min<std::int64_t>(left.count() + 1, 60'000));
      }
      pollfd p{::PQsocket(conn), POLLIN, 0};
      if (::poll(&p, 1, wait_ms) < 0 && errno != EINTR) {
        rep.broken = true;
        return rep;
      }
      if (::PQconsumeInput(conn) == 0) {
        rep.broken = true;
        return rep;
      }
    }
  }

  void drop(session& ses) {
    ::PQfinish(ses.conn);
    ses.conn = nullptr;
  }

  // Asks the server to cancel the running statement. PQcancel blocks until
  // the server closes its cancel connection, which behind a partition can
  // take as long as TCP does: it runs on a thread of its own, waited for a
  // moment, then left to finish alone (it owns what it uses).
  static void cancel(PGconn* conn) {
    std::shared_ptr<PGcancel> c{::PQgetCancel(conn), ::PQfreeCancel};
    if (!c) return;
    auto done = std::make_shared<std::promise<void>>();
    auto sent = done->get_future();
    std::thread([c, done] {
      char err[256];
      (void)::PQcancel(c.get(), err, sizeof err);
      done->set_value();
    }).detach();
    (void)sent.wait_for(std::chrono::seconds{2});
  }

  // The connection broke under a statement. Throws: errc::outcome_unknown
  // for a write that was sent (the next operation first ends that session),
  // errc::connection_lost otherwise.
  // `why`: what the server said, if it said something.
  [[noreturn]] void lost(session& ses, bool write, std::string_view what, const PGresult* why = nullptr) {
    std::string msg = why ? postgres::detail::one_line(::PQresultErrorMessage(why)) : std::string();
    if (ses.conn) {
      const std::string more = postgres::detail::one_line(::PQerrorMessage(ses.conn));
      if (more != msg) msg += msg.empty() || more.empty() ? more : "; " + more;
    }
    if (write) {
      ses.lost_pid = ses.pid;
      ses.lost_start = ses.start;
    }
    if (ses.conn) drop(ses);
    if (write)
      throw std::system_error(make_error_code(errc::outcome_unknown),
                              fmt::format("dibs::postgres_store: the connection to {} broke during {} (table '{}'): "
                                          "{}; the write may or may not have been applied",
                                          server_, what, opts_.table, msg));
    throw std::system_error(make_error_code(errc::connection_lost),
                            fmt::format("dibs::postgres_store: the connection to {} broke during {} (table '{}'): {} "
                                        "(transient: the next operation reconnects)",
                                        server_, what, opts_.table, msg));
  }

  // The calling thread's session: the renewals' on a renewal thread, else
  // the one this thread was given at its first call, so that a write whose
  // outcome is unknown and its read-back go through the same session (its
  // reconnect ends the lost server session first: settle()).
  session& current() {
    if (detail::renewal_keeper::in_task()) return renewals_;
    thread_local std::vector<std::pair<std::uint64_t, std::size_t>> given;  // (store id, session)
    for (const auto& [id, i] : given)
      if (id == id_) return *sessions_[i];
    if (given.size() > 64) given.clear();  // stores gone: given again at their next call
    const std::size_t i = next_session_.fetch_add(1, std::memory_order_relaxed) % sessions_.size();
    given.emplace_back(id_, i);
    return *sessions_[i];
  }
  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> n{0};
    return ++n;
  }

  std::string conninfo_;
  postgres_store_options opts_;
  std::vector<std::unique_ptr<session>> sessions_;  // opts_.sessions, each opened at its first use
  session renewals_;
  const std::uint64_t id_ = next_id();  // this store, for the threads' session of it (current())
  std::atomic<std::size_t> next_session_{0};
  // The LISTEN connections are the waiters', not the store's state.
  mutable listener changes_{fmt::format("dibs_{}", opts_.table)};
  mutable listener offers_{fmt::format("dibs_{}_offered", opts_.table)};
  std::string server_;  // set once, by the constructor
};

static_assert(listable_store<postgres_store>);
static_assert(timed_shared_store<postgres_store>);
static_assert(store_with_clock<postgres_store>);
static_assert(store_with_wall_clock<postgres_store>);
static_assert(create_or_read_store<postgres_store>);
static_assert(batch_store<postgres_store>);
static_assert(requires(const postgres_store& s) { s.wait_for_change("k", std::chrono::seconds{1}); });
static_assert(requires(const postgres_store& s) { s.wait_for_offer(std::chrono::seconds{1}); });

}  // namespace dibs
