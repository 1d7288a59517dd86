// dibs/stores/sqlite_store.hpp: a dibs::shared_store whose records are the rows of a
// table in a SQLite file that many processes share.
//
//   dibs::sqlite_store store{"/var/spool/app/queue.db"};          // table dibs_records
//   dibs::marker_claim<dibs::sqlite_store> claims{store};
//
// CMake target dibs::sqlite. The table has (at least) these columns; dibs
// creates it if it is missing:
//
//   key     TEXT PRIMARY KEY   the record's key: any bytes (a BLOB if they hold a NUL)
//   value   BLOB               the record's bytes; NULL means "no record"
//                              (stored as TEXT when they are UTF-8 text without
//                              NUL, so that LIKE and the sqlite3 shell see them)
//   version INTEGER NOT NULL   grows by one with every change of the row
//
// Beside it, dibs creates a view "<table>_claims" that shows marker_claim's
// records as columns (key, state, attempts, token, owner_host, owner_pid,
// lease_ms, error, result, version), for plain SQL:
//   SELECT key FROM dibs_records_claims WHERE state = 'processing'
//
// Other columns are allowed (nullable or with a default), so the records can
// live on rows an application already has, e.g. a claim marker on the row of
// the message it claims: insert the row with value NULL and the item reads as
// absent until someone claims it.
//
// Every operation is one autocommit statement, atomic for every connection to
// the file; marker_claim claims a fresh item with the create alone (see
// create_before_read_store). Erase sets value to NULL and keeps the row and its version, so a
// re-created record continues from there: versions grow per key across erase
// and re-create (they are fencing tokens). A row deleted by hand (DELETE)
// leaves its version in "<table>_version_floor" (by the trigger
// "<table>_deleted"), and a record made on a new row starts above it, so
// tokens never repeat for a key, also after a DELETE; a holder of the
// deleted row finds its hold lost at its next write. (DROP TABLE fires no
// trigger: drop the table only when no process uses it. A dibs before 0.4
// sharing the file starts a new row at version 1.)
//
// Contention: a statement that finds the write lock held fails with
// SQLITE_BUSY before it changes anything, and the store retries it with the
// jittered backoff of options::busy (by default for up to 30 s), so a store
// operation never fails because another process held the lock for a moment.
// The retry is done here and not by the policies above because only here is it
// known that the failed attempt changed nothing: retrying a compare-and-set
// after an ambiguous failure could misreport a won race as lost.
//
// Thread-safe: each operation takes its turn on the connection (see
// sqlite::connection), so an operation of another thread, such as a renewal,
// never slips into a transaction the application has open on connection();
// an operation called by the thread that has it open joins it (see
// in_transaction()). Open a new store in a child after fork(), as SQLite
// requires.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <algorithm>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <dibs/detail/digits.hpp>
#include <dibs/backoff.hpp>
#include <dibs/detail/claim_record.hpp>
#include <dibs/detail/renewal_keeper.hpp>
#include <dibs/detail/sys.hpp>
#include <dibs/error.hpp>
#include <dibs/retry.hpp>
#include <dibs/sqlite/connection.hpp>
#include <dibs/store.hpp>

namespace dibs {

struct sqlite_store_options {
  /// The table of the records: letters, digits and '_', not starting with a
  /// digit or "sqlite_", at most 64 characters.
  std::string table = "dibs_records";
  /// How a statement that met the write lock of another connection is
  /// retried. Its default: full jitter from 50 µs, doubling to 5 ms, for at
  /// most 30 s (then dibs::retry_error, whose last error is SQLITE_BUSY).
  retry_policy busy = retry_policy{}
                          .backoff(exponential_backoff{std::chrono::microseconds{50}, 2.0,
                                                       std::chrono::milliseconds{5}})
                          .deadline(std::chrono::seconds{30})
                          .unlimited_attempts();
  /// How the connection is opened: WAL and synchronous=NORMAL by default. Its
  /// busy_timeout stays 0: the retry above is the only wait.
  sqlite::options connection{};
};

class sqlite_store {
public:
  /// Effects: opens (or creates) the database at `path` and the table, and
  /// checks the table's shape. Nothing is written to a file that is not a
  /// database or whose table has another shape: the error comes first.
  /// Throws: std::system_error naming the path (and the table): a missing
  /// directory, a file that is not a database, a read-only file, a bad table
  /// name (errc::invalid_argument), a table of another shape
  /// (errc::corrupt_record).
  explicit sqlite_store(std::filesystem::path path, sqlite_store_options opts = {})
      : opts_(std::move(opts)), db_(open(path, opts_)) {
    dibs::retry(opts_.busy, [&] { prepare(); });  // preparing may read the schema, which may be locked
  }

  /// The same, with the table named.
  sqlite_store(std::filesystem::path path, std::string table)
      : sqlite_store(std::move(path), sqlite_store_options{.table = std::move(table)}) {}

  /// A create() that finds the key taken is one statement, as a read is,
  /// so marker_claim claims fresh items with the create alone (see
  /// create_before_read_store).
  static constexpr bool create_before_read = true;

  sqlite_store(const sqlite_store&) = delete;
  sqlite_store& operator=(const sqlite_store&) = delete;
  sqlite_store(sqlite_store&&) = delete;
  sqlite_store& operator=(sqlite_store&&) = delete;

  std::optional<record> read(std::string_view key) {
    validate_key(key, "dibs::sqlite_store::read");
    const auto turn = take_turn();
    return dibs::retry(opts_.busy, [&]() -> std::optional<record> {
      auto& s = *read_;
      bind_key(s, 1, key);
      if (!s.step() || s.column_is_null(0)) {
        s.reset();
        return std::nullopt;
      }
      record r{s.column_blob(0), static_cast<dibs::version>(s.column_int64(1))};
      s.reset();
      return r;
    });
  }

  std::optional<dibs::version> create(std::string_view key, std::string_view value) {
    validate_key(key, "dibs::sqlite_store::create");
    validate_value(key, value);
    const auto turn = take_turn();
    return dibs::retry(opts_.busy, [&]() -> std::optional<dibs::version> {
      auto& s = *create_;
      bind_key(s, 1, key);
      bind_value(s, 2, value);
      if (!s.step()) return std::nullopt;  // the key holds a record
      const auto v = static_cast<dibs::version>(s.column_int64(0));
      while (s.step()) {
      }  // runs the statement to its end, which commits it
      return v;
    });
  }

  std::optional<dibs::version> replace(std::string_view key, dibs::version expected, std::string_view value) {
    validate_key(key, "dibs::sqlite_store::replace");
    validate_value(key, value);
    const auto turn = take_turn();
    return dibs::retry(opts_.busy, [&]() -> std::optional<dibs::version> {
      auto& s = *replace_;
      bind_key(s, 1, key);
      s.bind(2, to_column(expected));
      bind_value(s, 3, value);
      (void)s.step();
      if (db_.changes() != 1) return std::nullopt;
      return expected + 1;
    });
  }

  bool erase(std::string_view key, dibs::version expected) {
    validate_key(key, "dibs::sqlite_store::erase");
    const auto turn = take_turn();
    return dibs::retry(opts_.busy, [&] {
      auto& s = *erase_;
      bind_key(s, 1, key);
      s.bind(2, to_column(expected));
      (void)s.step();
      return db_.changes() == 1;
    });
  }

  /// Returns: the keys of the live records that start with `prefix` (the
  /// prefix is matched here, byte for byte, as SQLite compares TEXT by
  /// characters).
  std::vector<std::string> keys(std::string_view prefix = {}) {
    const auto turn = take_turn();
    return dibs::retry(opts_.busy, [&] {
      std::vector<std::string> out;
      auto s = db_.prepare(fmt::format("SELECT key FROM \"{}\" WHERE value IS NOT NULL", opts_.table));
      while (s.step())
        if (auto k = s.column_blob(0); std::string_view(k).starts_with(prefix)) out.push_back(std::move(k));
      return out;
    });
  }

  /// Returns: every record whose key starts with `prefix`, in one statement
  /// (a dibs::snapshot_store: marker_claim's claim_next and list() read the
  /// queue so, instead of key by key).
  std::vector<std::pair<std::string, record>> records(std::string_view prefix = {}) {
    const auto turn = take_turn();
    return dibs::retry(opts_.busy, [&] {
      std::vector<std::pair<std::string, record>> out;
      auto s = db_.prepare(fmt::format("SELECT key, value, version FROM \"{}\" WHERE value IS NOT NULL", opts_.table));
      while (s.step())
        if (auto k = s.column_blob(0); std::string_view(k).starts_with(prefix))
          out.emplace_back(std::move(k), record{s.column_blob(1), static_cast<dibs::version>(s.column_int64(2))});
      return out;
    });
  }

  /// For marker_claim::claim_next and claim_next_n (dibs::claim_queue_store):
  /// in one write transaction, claims up to `n` claimable items whose key
  /// starts with `prefix` (offered or released claim records whose
  /// not_before has come by this machine's clock), the highest priority
  /// first, then in key order, found through the partial index
  /// "<table>_queue" (which holds only the claimable rows, so completed items
  /// cost nothing here). The new value of each is the processing head with
  /// the attempt counted and the priority kept
  /// (detail::claim_record::taken_head), then `rest`. Each candidate is read
  /// by the record codec before it is taken: a record the index holds that
  /// the codec does not read as claimable (damaged by hand) is left alone.
  /// Called by a thread with a transaction open on connection(), it is part
  /// of that transaction.
  /// Returns: their keys and new records, highest priority first.
  std::vector<std::pair<std::string, record>> take_claimable(std::string_view prefix, std::string_view rest,
                                                             std::uint32_t n,
                                                             dibs::time_limit = dibs::time_limit::max()) {
    validate_value(prefix, rest);
    const auto turn = take_turn();
    // The key range [prefix, upper): upper is prefix with its last byte that
    // is not 0xff increased and the rest cut; none if there is no such byte.
    // Keys stored as BLOBs (they hold a NUL) sort after all text: they pass
    // the range test and are matched below, byte for byte.
    std::string upper(prefix);
    while (!upper.empty() && static_cast<unsigned char>(upper.back()) == 0xff) upper.pop_back();
    if (!upper.empty()) upper.back() = static_cast<char>(static_cast<unsigned char>(upper.back()) + 1);
    return in_write_transaction([&] {
      std::vector<std::pair<std::string, record>> out;
      const auto now = detail::wall_ms();
      // The candidates first, then the updates: a statement that walks an
      // index while the same connection changes it sees an undefined mix.
      struct candidate {
        std::string key;
        dibs::version version;
        std::int64_t rowid;
        std::string head;
      };
      std::vector<candidate> got;
      auto& s = *take_;
      // (An empty view may have no data, which SQLite would bind as NULL.)
      s.bind(1, prefix.empty() ? std::string_view{""} : prefix).bind(2, now);
      if (upper.empty()) s.bind(3, nullptr);
      else s.bind(3, std::string_view{upper});
      while (got.size() < n && s.step()) {
        std::string k = s.column_blob(0);
        if (!std::string_view(k).starts_with(prefix)) continue;
        const std::string v = s.column_blob(1);
        const auto h = detail::claim_record::parse_head(v);
        if (!h || !h->attempts || !h->claimable_at(now)) continue;
        got.push_back({std::move(k), static_cast<dibs::version>(s.column_int64(2)), s.column_int64(3),
                       detail::claim_record::taken_head(*h->attempts + std::uint64_t{1}, h->priority)});
      }
      s.reset();
      out.reserve(got.size());
      for (auto& c : got) {
        std::string value = std::move(c.head);
        value += rest;
        auto& u = *take_row_;
        u.bind(1, c.rowid);
        u.bind(2, to_column(c.version));
        bind_value(u, 3, value);
        (void)u.step();
        // Under the write lock since the read: the version cannot have moved.
        if (db_.changes() != 1)
          throw std::logic_error(fmt::format("dibs::sqlite_store: record '{}' changed inside a write transaction",
                                             detail::show_key(c.key)));
        out.emplace_back(std::move(c.key), record{std::move(value), c.version + 1});
      }
      return out;
    });
  }

  /// For marker_claim's offer_n (dibs::batch_store): creates each absent key
  /// as create() does, all in one write transaction (or in the calling
  /// thread's open one). Returns: per item its version, or nothing if the
  /// key had a record. Throws: errc::invalid_argument, before anything is
  /// written, for a bad key or value or a key given twice.
  std::vector<std::optional<dibs::version>> create_n(std::span<const key_value> items,
                                                     dibs::time_limit = dibs::time_limit::max()) {
    detail::check_batch(items, "dibs::sqlite_store::create_n");
    const auto turn = take_turn();
    return in_write_transaction([&] {
      std::vector<std::optional<dibs::version>> out;
      out.reserve(items.size());
      for (const auto& it : items) {
        auto& s = *create_;
        bind_key(s, 1, it.key);
        bind_value(s, 2, it.value);
        if (!s.step()) {
          out.emplace_back();  // the key holds a record
          continue;
        }
        out.emplace_back(static_cast<dibs::version>(s.column_int64(0)));
        while (s.step()) {
        }
      }
      return out;
    });
  }

  /// For marker_claim's complete_n (dibs::batch_store): each item's
  /// compare-and-set as replace() does it, all in one write transaction (or
  /// in the calling thread's open one). Returns: per item its new version,
  /// or nothing if its version had moved. Throws: as create_n.
  std::vector<std::optional<dibs::version>> replace_n(std::span<const replace_item> items,
                                                      dibs::time_limit = dibs::time_limit::max()) {
    detail::check_batch(items, "dibs::sqlite_store::replace_n");
    const auto turn = take_turn();
    return in_write_transaction([&] {
      std::vector<std::optional<dibs::version>> out;
      out.reserve(items.size());
      for (const auto& it : items) {
        auto& s = *replace_;
        bind_key(s, 1, it.key);
        s.bind(2, to_column(it.expected));
        bind_value(s, 3, it.value);
        (void)s.step();
        if (db_.changes() == 1) out.emplace_back(it.expected + 1);
        else out.emplace_back();
      }
      return out;
    });
  }

  /// For marker_claim's sweeps (dibs::claim_queue_store), which run while
  /// nothing is claimable, at most every third of a lease. Returns: the keys
  /// that start with `prefix` whose record is a processing claim (a scan of
  /// the table).
  std::vector<std::string> processing_keys(std::string_view prefix = {}) {
    const auto turn = take_turn();
    return dibs::retry(opts_.busy, [&] {
      std::vector<std::string> out;
      auto& s = *processing_;
      while (s.step())
        if (auto k = s.column_blob(0); std::string_view(k).starts_with(prefix)) out.push_back(std::move(k));
      return out;
    });
  }

  const std::filesystem::path& path() const noexcept { return db_.path(); }
  const std::string& table() const noexcept { return opts_.table; }
  /// Returns: "table 'T' in database 'P'", for messages.
  std::string where() const { return fmt::format("table '{}' in database '{}'", opts_.table, detail::path_text(path())); }

  /// The store's connection, for the application's own statements on the
  /// same file (e.g. inserting message rows, or a transaction that writes a
  /// claimed item's effects and completes it: see in_transaction()). Its
  /// calls take turns with the store's own operations, whatever the thread.
  sqlite::connection& connection() noexcept { return db_; }

  /// The name of the view that shows marker_claim's records as columns.
  std::string claims_view() const { return opts_.table + "_claims"; }

  /// Returns: true if the calling thread has a transaction open on
  /// connection(). The store's operations it calls then are part of that
  /// transaction: they commit with it, or are rolled back with it
  /// (marker_claim learns which through after_transaction()).
  bool in_transaction() const { return db_.in_transaction_of_this_thread(); }
  /// Requires: in_transaction(). Effects, Returns: as
  /// sqlite::connection::after_transaction.
  std::uint64_t after_transaction(std::function<void(bool committed)> f) { return db_.after_transaction(std::move(f)); }
  /// Effects: as sqlite::connection::forget_after_transaction.
  void forget_after_transaction(std::uint64_t id) noexcept { db_.forget_after_transaction(id); }

  /// Throws: std::system_error(errc::invalid_argument) naming `table` if it
  /// is not a name a sqlite_store accepts.
  static void validate_table(std::string_view table) {
    auto fail = [&](std::string_view rule) {
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("dibs::sqlite_store: invalid table name '{}': {}", table, rule));
    };
    if (table.empty()) fail("a table name must not be empty");
    if (table.size() > 64) fail("a table name must be at most 64 characters");
    if (table.front() >= '0' && table.front() <= '9') fail("a table name must not start with a digit");
    for (const char c : table)
      if (!(c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')))
        fail("only letters, digits and '_' are allowed");
    if (table.size() >= 7) {
      std::string head(table.substr(0, 7));
      for (char& c : head) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
      if (head == "sqlite_") fail("names starting with 'sqlite_' belong to SQLite");
    }
  }

  /// Throws: std::system_error(errc::invalid_argument) if `path` cannot name
  /// a database that processes share: empty (SQLite would open a private
  /// temporary file), ":memory:", or a directory.
  static void validate_path(const std::filesystem::path& path) {
    auto fail = [&](std::string_view rule) {
      throw std::system_error(
          make_error_code(errc::invalid_argument),
          fmt::format("dibs::sqlite_store: invalid database path '{}': {}", detail::path_text(path), rule));
    };
    if (path.empty()) fail("a path must not be empty (SQLite would open a private temporary database)");
    if (detail::path_text(path).starts_with(":memory:"))
      fail("an in-memory database is private to one connection; give the path of a file");
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) fail("it is a directory; give the path of a database file in it");
  }

private:
  // Runs `f` in one write transaction (BEGIN IMMEDIATE ... COMMIT), or in
  // the calling thread's open transaction; a busy write lock is retried
  // like every statement (nothing was written yet), and a failure rolls
  // the store's own transaction back. Requires: the caller has its turn.
  template <class F>
  auto in_write_transaction(F f) -> decltype(f()) {
    const bool own = !db_.in_transaction_of_this_thread();
    return dibs::retry(opts_.busy, [&] {
      if (own) (void)begin_->step();
      try {
        auto out = f();
        if (own) (void)commit_->step();
        return out;
      } catch (...) {
        if (own) db_.rollback();
        throw;
      }
    });
  }

  // A key goes in as TEXT, as every key did before keys could hold any
  // bytes, unless it holds a NUL, which SQLite's TEXT does not keep apart
  // reliably: then as a BLOB, which never equals a TEXT. So each key has one
  // row, and a person finds the usual ones with WHERE key = '...'.
  static void bind_key(sqlite::statement& s, int index, std::string_view key) {
    if (key.find('\0') == std::string_view::npos) s.bind(index, key);
    else s.bind_blob(index, key);
  }

  // A renewal (it runs on a renewal thread) does not wait for a transaction
  // that another thread has open on the connection: that thread may be
  // waiting for the renewal to stop, or for the claim it renews. It fails at
  // once, as transient, and is tried again at the next renewal; the lease's
  // end still decides whether the hold is lost. Every other caller waits for
  // the transaction to end, as it would wait for SQLite's write lock.
  sqlite::connection::turn take_turn() {
    const bool renewal = detail::renewal_keeper::in_task();
    auto turn = db_.take_turn(renewal ? sqlite::other_transaction::refuse : sqlite::other_transaction::wait);
    if (!turn)
      throw std::system_error(make_error_code(errc::contended),
                              fmt::format("dibs::sqlite_store: database '{}' is in a transaction of another thread on "
                                          "the store's connection; a renewal does not wait for it (tried again later)",
                                          detail::path_text(db_.path())));
    return turn;
  }

  // Text that SQLite can show and LIKE can match goes in as TEXT, anything
  // else as a BLOB; column_blob() reads both back byte for byte.
  static void bind_value(sqlite::statement& s, int index, std::string_view value) {
    if (is_plain_text(value) && !value.empty()) s.bind(index, value);
    else s.bind_blob(index, value);
  }

  static bool is_plain_text(std::string_view v) noexcept {
    std::size_t i = 0;
    // Eight bytes at a time while they are ASCII without NUL, as dibs's own
    // records are: the byte loop below cost more than a claim's own work.
    constexpr std::uint64_t ones = 0x0101010101010101u, highs = 0x8080808080808080u;
    for (; i + 8 <= v.size(); i += 8) {
      std::uint64_t w;
      std::memcpy(&w, v.data() + i, 8);
      if (((w - ones) & ~w & highs) != 0 || (w & highs) != 0) break;  // a NUL, or a byte of a multibyte character
    }
    while (i < v.size()) {
      const auto c = static_cast<unsigned char>(v[i]);
      if (c == 0) return false;
      if (c < 0x80) {
        ++i;
        continue;
      }
      const std::size_t n = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
      if (n == 0 || (n == 3 && c >= 0xf0) || i + n > v.size()) return false;
      for (std::size_t k = 1; k < n; ++k)
        if ((static_cast<unsigned char>(v[i + k]) & 0xc0) != 0x80) return false;
      i += n;
    }
    return true;
  }

  static std::int64_t to_column(dibs::version v) {
    // Versions above 2^63 - 1 do not exist in SQLite's INTEGER: no row has one.
    return v > static_cast<dibs::version>(INT64_MAX) ? -1 : static_cast<std::int64_t>(v);
  }

  // Opens the connection without changing the file, checks (or creates) the
  // table, and only then switches the journal mode.
  static sqlite::connection open(const std::filesystem::path& path, const sqlite_store_options& opts) {
    validate_path(path);
    validate_table(opts.table);
    sqlite::options first = opts.connection;
    first.journal_mode.clear();
    first.busy_timeout = std::chrono::milliseconds{0};
    sqlite::connection db{path, first};
    const auto setup = retry_policy{opts.busy}.deadline(std::chrono::seconds{30});
    // Reading the schema can meet a lock too (another process recovering the
    // WAL of one that was killed): retried like every statement.
    auto shape = [&] { return dibs::retry(setup, [&] { return check_shape(db, opts.table); }); };
    if (!shape()) {
      if (opts.connection.read_only)
        throw std::system_error(make_error_code(errc::invalid_argument),
                                fmt::format("dibs::sqlite_store: database '{}' has no table '{}' and is opened read-only",
                                            detail::path_text(path), opts.table));
      // A rowid table, not WITHOUT ROWID: there a large value sits in the
      // key's b-tree, and SQLite reads a whole overflowing record to compare
      // keys, so one 1 MiB value made every lookup near it read 1 MiB
      // (measured: 8 x 200 increments 0.05 s -> 0.48 s).
      as_open_error(path, opts.table, [&] {
        dibs::retry(setup, [&] {
          db.exec(fmt::format("CREATE TABLE IF NOT EXISTS \"{}\" (key TEXT PRIMARY KEY NOT NULL, value BLOB, "
                              "version INTEGER NOT NULL DEFAULT 0)",
                              opts.table));
        });
      });
      (void)shape();  // another process may have created another shape meanwhile
    }
    if (!opts.connection.read_only) {
      as_open_error(path, opts.table, [&] {
        dibs::retry(setup, [&] { create_version_floor(db, opts.table); });
        dibs::retry(setup, [&] { create_claims_view(db, opts.table); });
        dibs::retry(setup, [&] { create_queue_index(db, opts.table); });
        if (!opts.connection.journal_mode.empty())
          dibs::retry(setup, [&] { db.exec(fmt::format("PRAGMA journal_mode={}", opts.connection.journal_mode)); });
      });
    }
    return db;
  }

  // Runs `f`; a failure of SQLite in it (a full disk, say) is reported as the
  // open that failed, naming the table and the file, not as a statement of
  // dibs's own that the caller never wrote.
  template <class F>
  static void as_open_error(const std::filesystem::path& path, const std::string& table, F&& f) {
    try {
      f();
    } catch (const std::system_error& e) {
      if (e.code().category() != sqlite::category()) throw;
      throw std::system_error(e.code(), fmt::format("dibs::sqlite_store: cannot open table '{}' in database '{}': {}{}",
                                                    table, detail::path_text(path), ::sqlite3_errstr(e.code().value()),
                                                    sqlite::detail::open_hint(path, e.code().value())));
    }
  }

  // The version floor: a row deleted by hand (DELETE) takes its versions
  // with it, so the trigger "<table>_deleted" keeps the highest version of any
  // deleted row in "<table>_version_floor" (one row), and a record made on
  // a new row starts above it: versions, which are fencing tokens, never
  // repeat for a key. SQLite runs one writer at a time, so a create never
  // reads a floor that a DELETE has not yet raised.
  static void create_version_floor(sqlite::connection& db, const std::string& table) {
    db.exec(fmt::format("CREATE TABLE IF NOT EXISTS \"{0}_version_floor\" (id INTEGER PRIMARY KEY CHECK (id = 1), "
                        "floor INTEGER NOT NULL); "
                        "CREATE TRIGGER IF NOT EXISTS \"{0}_deleted\" AFTER DELETE ON \"{0}\" BEGIN "
                        "INSERT INTO \"{0}_version_floor\" (id, floor) VALUES (1, old.version) "
                        "ON CONFLICT (id) DO UPDATE SET floor = max(floor, excluded.floor); END",
                        table));
  }

  // The view "<table>_claims": marker_claim's records ("dibs-claim 1\n"
  // then "name value" lines, see marker_claim.hpp) cut into columns with
  // SQLite's string functions; a NULL value is an absent item. Other records
  // (a lease's, say) are not in it. Its SQL carries "dibs claims view 1": a
  // dibs that changes the record's format changes that number.
  static void create_claims_view(sqlite::connection& db, const std::string& table) {
    const std::string view = table + "_claims";
    auto exists = db.prepare("SELECT count(*) FROM sqlite_schema WHERE name = ?1");
    exists.bind(1, view);
    const bool there = exists.step() && exists.column_int64(0) > 0;
    exists.reset();
    if (there) return;
    // t is the value with a newline in front, so that every field is found
    // as "\nname " and "pid" never matches "pid_ns".
    auto field = [](std::string_view name) {
      return fmt::format("CASE WHEN instr(t, char(10) || '{0} ') > 0 THEN substr(t, instr(t, char(10) || '{0} ') + {1}, "
                         "instr(substr(t, instr(t, char(10) || '{0} ') + {1}), char(10)) - 1) END",
                         name, name.size() + 2);
    };
    auto number = [&](std::string_view name) { return fmt::format("CAST({} AS INTEGER)", field(name)); };
    db.exec(fmt::format("CREATE VIEW IF NOT EXISTS \"{0}\" AS SELECT /* dibs claims view 1 */ key, "
                        "CASE WHEN t IS NULL THEN 'absent' ELSE {2} END AS state, "
                        "CASE WHEN t IS NULL THEN 0 ELSE {3} END AS attempts, {4} AS token, "
                        "{5} AS owner_host, {6} AS owner_pid, {7} AS lease_ms, {8} AS error, {9} AS result, version "
                        "FROM (SELECT key, version, char(10) || CAST(value AS TEXT) AS t FROM \"{1}\") "
                        "WHERE t IS NULL OR substr(t, 1, 14) = char(10) || 'dibs-claim 1' || char(10)",
                        view, table, field("state"), number("attempts"), number("token"), field("host"),
                        number("pid"), number("lease_ms"), field("error"), field("result")));
  }

  // The queue index: marker_claim's records read in SQL by the rules of the
  // record codec (detail/claim_record.hpp), so that the index holds exactly
  // the rows the codec reads as waiting. Lines 1 and 2 are compared as
  // bytes (a value holding bytes that are not text is a BLOB; CAST makes
  // both kinds compare alike); priority and not_before are the first line
  // with their name, as the codec reads them. Indexes of expressions, not
  // columns: SQLite keeps them up to date on every write, whoever writes
  // (a dibs before 0.5 that has no idea of them, an application's own
  // UPDATE), so the table needs no new column and no trigger, and an older
  // dibs on the same file keeps working beside this one (see docs/stores.md).
  static std::string head_bytes(claim_state s) {
    std::string h;
    detail::claim_record::append_head(h, s, 0);
    h.resize(h.find("attempts "));  // "dibs-claim 1\nstate <s>\n"
    return h;
  }
  static std::string head_is(claim_state s) {
    const std::string h = head_bytes(s);
    std::string hex;
    for (const char c : h) hex += detail::hex_digits(static_cast<unsigned char>(c), 2);
    return fmt::format("CAST(substr(value, 1, {}) AS BLOB) = X'{}'", h.size(), hex);
  }
  static std::string queue_condition() {
    return "(" + head_is(claim_state::offered) + " OR " + head_is(claim_state::released) + ")";
  }
  // The first "<name> " line's number (CAST reads the digits up to the
  // newline); NULL if there is none.
  static std::string number_line(std::string_view name) {
    return fmt::format("CAST(substr(value, nullif(instr(value, char(10) || '{0} '), 0) + {1}, 20) AS INTEGER)", name,
                       name.size() + 2);
  }
  static std::string priority_expression() { return "coalesce(" + number_line("priority") + ", 0)"; }

  // Creates the queue's partial index if it is missing: on a table of an
  // older dibs this is its migration, one CREATE INDEX under the write lock
  // (which the other processes' statements wait for, as for any write). Its
  // name stands for the format: a dibs that reads the record differently
  // gives its index another name. No index of the processing records: one
  // costs a page write at every claim and completion, and processing_keys
  // runs only while the queue is idle, at most every third of a lease.
  static void create_queue_index(sqlite::connection& db, const std::string& table) {
    db.exec(fmt::format("CREATE INDEX IF NOT EXISTS \"{0}_queue\" ON \"{0}\" ({1} DESC, key) WHERE {2}", table,
                        priority_expression(), queue_condition()));
  }

  // Returns: false if the table does not exist. Throws errc::corrupt_record
  // naming the table and the file if it exists with another shape.
  static bool check_shape(sqlite::connection& db, const std::string& table) {
    auto info = db.prepare(fmt::format("PRAGMA table_info(\"{}\")", table));
    bool any = false, has_key = false, has_value = false, has_version = false;
    int pk_columns = 0;
    std::string problem;
    auto lower = [](std::string s) {
      for (char& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
      return s;
    };
    while (info.step()) {
      any = true;
      const std::string name = lower(info.column_text(1)), type = lower(info.column_text(2));
      const bool not_null = info.column_int64(3) != 0, has_default = !info.column_is_null(4);
      const auto pk = info.column_int64(5);
      if (pk != 0) ++pk_columns;
      if (name == "key") {
        has_key = true;
        if (type != "text" || pk != 1) problem = "column 'key' must be TEXT PRIMARY KEY";
      } else if (name == "value") {
        has_value = true;
        if (type != "blob" && !type.empty()) problem = "column 'value' must be a BLOB";
        else if (not_null) problem = "column 'value' must allow NULL (NULL is an erased record)";
      } else if (name == "version") {
        has_version = true;
        if (type != "integer") problem = "column 'version' must be an INTEGER";
      } else if (not_null && !has_default && pk == 0) {
        problem = fmt::format("column '{}' is NOT NULL without a default, so dibs cannot insert a record",
                              info.column_text(1));
      }
    }
    if (!any) return false;
    if (!has_key || !has_value || !has_version) problem = "it needs the columns key, value and version";
    else if (pk_columns != 1 && problem.empty()) problem = "its primary key must be the column 'key' alone";
    if (!problem.empty())
      throw std::system_error(make_error_code(errc::corrupt_record),
                              fmt::format("dibs::sqlite_store: table '{}' in database '{}' is not a dibs store table: {}",
                                          table, detail::path_text(db.path()), problem));
    return true;
  }

  void prepare() {
    const std::string& t = opts_.table;
    read_.emplace(db_, fmt::format("SELECT value, version FROM \"{}\" WHERE key = ?1", t));
    // A new row starts above the version floor (create_version_floor); a row
    // without a record continues from its own version, or from the floor
    // where an application inserted it (version 0) after a DELETE.
    // Read-only, the floor may not exist, and a create fails anyway.
    const std::string first =
        opts_.connection.read_only ? "1" : fmt::format("(SELECT coalesce(max(floor), 0) + 1 FROM \"{}_version_floor\")", t);
    create_.emplace(db_, fmt::format("INSERT INTO \"{0}\" (key, value, version) VALUES (?1, ?2, {1}) "
                                     "ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
                                     "version = max(\"{0}\".version + 1, excluded.version) "
                                     "WHERE \"{0}\".value IS NULL RETURNING version",
                                     t, first));
    replace_.emplace(db_, fmt::format("UPDATE \"{}\" SET value = ?3, version = version + 1 "
                                      "WHERE key = ?1 AND version = ?2 AND value IS NOT NULL",
                                      t));
    erase_.emplace(db_, fmt::format("UPDATE \"{}\" SET value = NULL WHERE key = ?1 AND version = ?2 AND value IS NOT NULL", t));
    // claim_next's candidates: the claimable rows in the queue index's
    // order; the WHERE names the index's condition as it is written there,
    // so that the planner uses it.
    take_.emplace(db_, fmt::format("SELECT key, value, version, rowid FROM \"{0}\" WHERE {1} "
                                   "AND ({2} IS NULL OR {2} <= ?2) "
                                   "AND (typeof(key) = 'blob' OR (key >= ?1 AND (?3 IS NULL OR key < ?3))) "
                                   "ORDER BY {3} DESC, key",
                                   t, queue_condition(), number_line("not_before"), priority_expression()));
    take_row_.emplace(db_, fmt::format("UPDATE \"{}\" SET value = ?3, version = version + 1 WHERE rowid = ?1 AND "
                                       "version = ?2",
                                       t));
    processing_.emplace(db_, fmt::format("SELECT key FROM \"{}\" WHERE {}", t, head_is(claim_state::processing)));
    begin_.emplace(db_, "BEGIN IMMEDIATE");
    commit_.emplace(db_, "COMMIT");
  }

  sqlite_store_options opts_;
  sqlite::connection db_;
  std::optional<sqlite::statement> read_, create_, replace_, erase_, take_, take_row_, processing_, begin_, commit_;
};

static_assert(listable_store<sqlite_store>);
static_assert(snapshot_store<sqlite_store>);
static_assert(batch_store<sqlite_store>);

}  // namespace dibs
