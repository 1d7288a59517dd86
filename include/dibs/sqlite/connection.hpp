// dibs/sqlite/connection.hpp: a small RAII SQLite connection that models
// dibs::transactional, for dibs::transact.
//
// CMake target dibs::sqlite (links libsqlite3). The only dibs header that
// includes <sqlite3.h>.
//
//   dibs::sqlite::connection db{"orders.db"};
//   dibs::transact(policy, db, [&] { db.exec("UPDATE orders SET qty = qty + 1"); });
//
// Paths are std::filesystem::path; SQLite is given them as UTF-8 (on Windows
// the wide path converted, so any name works, not only the ANSI code page's,
// and a path near MAX_PATH or longer with the \\?\ prefix).
//
// Errors are std::system_error in dibs::sqlite::category(), carrying SQLite's
// extended result code. SQLITE_BUSY and SQLITE_LOCKED (and their extended
// variants) are dibs::is_transient; every other code is not. Messages name the
// database path, the statement, SQLite's own message and a hint.
#pragma once

#include <sqlite3.h>

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include <dibs/detail/sys.hpp>
#include <dibs/error.hpp>
#include <dibs/retry.hpp>

namespace dibs::sqlite {

namespace detail {

using dibs::detail::path_text;  // the path as UTF-8, as SQLite and the messages want it

class category_impl final : public std::error_category {
public:
  const char* name() const noexcept override { return "sqlite"; }
  std::string message(int rc) const override { return ::sqlite3_errstr(rc); }

  bool equivalent(int rc, const std::error_condition& cond) const noexcept override {
    if (cond == make_error_condition(condition::transient)) {
      const int primary = rc & 0xff;
      return primary == SQLITE_BUSY || primary == SQLITE_LOCKED;
    }
    return default_error_condition(rc) == cond;
  }
};

inline const char* hint(int rc) noexcept {
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED: return " (another connection holds the database's lock: transient, a retry of the whole transaction can succeed)";
    case SQLITE_CANTOPEN: return " (does the directory exist, and may this user write to it?)";
    case SQLITE_READONLY: return " (is the file, or its directory, read-only for this user?)";
    case SQLITE_PERM: return " (permission denied)";
    case SQLITE_NOTADB: return " (is this file a SQLite database?)";
    case SQLITE_CORRUPT: return " (the database file is damaged)";
    case SQLITE_FULL: return " (is the disk full?)";
    case SQLITE_IOERR: return " (an I/O error: check the disk and the filesystem)";
    default: return "";
  }
}

// Who uses a connection now: one thread at a time for a call, and which
// thread's transaction is open, so that a store's operation from another
// thread never slips into it. On the heap: a connection can move.
struct turn_state {
  std::mutex m;
  std::condition_variable cv;
  std::thread::id holder;     // the thread in a call
  int depth = 0;              // its calls in progress (a store's operation runs statements)
  bool in_tx = false;         // a transaction is open
  std::thread::id tx_thread;  // the thread that used it last
  bool rolled_back = false;   // set by SQLite's rollback hook during the open transaction
  std::uint64_t last_id = 0;
  std::map<std::uint64_t, std::function<void(bool)>> on_end;  // by after_transaction
  std::mutex running;        // held while callbacks run, so forget() never races one
};

/// Returns: the hint for a failed open of `path` with result code `rc`: what
/// about the path made it fail (a directory, a missing directory, a full
/// filesystem), else the hint for the code.
inline std::string open_hint(const std::filesystem::path& path, int rc) {
  std::error_code ec;
  const int primary = rc & 0xff;
  if (primary == SQLITE_CANTOPEN) {
    if (std::filesystem::is_directory(path, ec)) return " (it is a directory: give the path of a database file in it)";
    const auto dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path{"."};
    if (!std::filesystem::exists(dir, ec))
      return fmt::format(" (its directory '{}' does not exist)", path_text(dir));
  }
  if (primary == SQLITE_IOERR || primary == SQLITE_FULL) {
    const auto dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path{"."};
    const auto space = std::filesystem::space(dir, ec);
    // SQLite says "disk is full" for ENOSPC; on a full filesystem some
    // writes (the WAL's shared memory) come back as a plain I/O error.
    if (primary == SQLITE_FULL || (!ec && space.available == 0))
      return fmt::format(" (the filesystem of '{}' is full: free space on it, or give a path on another filesystem)",
                         path_text(dir));
  }
  return detail::hint(rc);
}

/// The name SQLite opens a database by, and the VFS it opens it with.
struct file_name {
  std::string utf8;
  const char* vfs = nullptr;  ///< nullptr: SQLite's default
};

/// Returns: the name of `path` for sqlite3_open_v2: UTF-8 on every
/// platform; on Windows a path near MAX_PATH or longer gets the \\?\ prefix
/// (detail/win32/sys.hpp, as file_mutex opens it), and SQLite's
/// "win32-longpath" VFS, whose names may be longer than its default's.
inline file_name sqlite_file_name(const std::filesystem::path& path) {
#ifdef _WIN32
  const std::wstring w = dibs::detail::win32_path(path);
  if (w.rfind(LR"(\\?\)", 0) == 0) return {dibs::detail::to_utf8(w), "win32-longpath"};
#endif
  return {path_text(path)};
}

}  // namespace detail

/// Returns: the category of SQLite result codes (a single object per program).
inline const std::error_category& category() noexcept {
  static const detail::category_impl c;
  return c;
}

inline std::error_code make_error_code(int rc) noexcept { return {rc, category()}; }

/// How a connection is opened.
struct options {
  /// SQLite's own busy handler. 0 by default: contention surfaces at once as
  /// SQLITE_BUSY, and dibs::transact retries the whole transaction with backoff
  /// and jitter instead of SQLite sleeping inside a statement.
  std::chrono::milliseconds busy_timeout{0};
  /// PRAGMA journal_mode set at open ("" leaves the database's own). WAL lets
  /// readers run while one writer commits.
  std::string journal_mode = "WAL";
  /// PRAGMA synchronous ("" leaves the default).
  std::string synchronous = "NORMAL";
  bool create = true;      ///< create the file if it does not exist
  bool read_only = false;  ///< open for reading only
};

class connection;

/// A prepared statement. Parameters are numbered from 1, columns from 0, as in
/// SQLite's C API.
class statement {
public:
  statement(connection& db, std::string_view sql);
  statement(const statement&) = delete;
  statement& operator=(const statement&) = delete;
  statement(statement&& o) noexcept : db_(o.db_), stmt_(std::exchange(o.stmt_, nullptr)), sql_(std::move(o.sql_)) {}
  ~statement() { ::sqlite3_finalize(stmt_); }

  statement& bind(int index, std::int64_t v);
  statement& bind(int index, double v);
  statement& bind(int index, std::string_view v);
  statement& bind(int index, std::nullptr_t);
  /// Binds bytes as a BLOB (NUL and high bytes kept); an empty value is a
  /// zero-length BLOB, not NULL.
  statement& bind_blob(int index, std::string_view bytes);
  template <std::integral I>
  statement& bind(int index, I v) {
    return bind(index, static_cast<std::int64_t>(v));
  }

  /// Effects: runs the statement to its next row.
  /// Returns: true if a row is there, false when done.
  /// Throws: std::system_error naming the statement and the database.
  bool step();

  /// Effects: makes the statement ready to run again; bindings are kept.
  void reset() noexcept;

  std::int64_t column_int64(int col) const noexcept { return ::sqlite3_column_int64(stmt_, col); }
  double column_double(int col) const noexcept { return ::sqlite3_column_double(stmt_, col); }
  bool column_is_null(int col) const noexcept { return ::sqlite3_column_type(stmt_, col) == SQLITE_NULL; }
  std::string column_text(int col) const {
    const auto* p = ::sqlite3_column_text(stmt_, col);
    return p ? std::string(reinterpret_cast<const char*>(p), static_cast<std::size_t>(::sqlite3_column_bytes(stmt_, col)))
             : std::string{};
  }

  /// Returns: the column's bytes (a BLOB or TEXT as stored; empty for NULL).
  std::string column_blob(int col) const {
    const void* p = ::sqlite3_column_blob(stmt_, col);
    return p ? std::string(static_cast<const char*>(p), static_cast<std::size_t>(::sqlite3_column_bytes(stmt_, col)))
             : std::string{};
  }

  ::sqlite3_stmt* native_handle() const noexcept { return stmt_; }

private:
  void check_bind(int rc, int index);

  connection* db_;
  ::sqlite3_stmt* stmt_ = nullptr;
  std::string sql_;
};

/// What a call of one thread does about a transaction that another thread
/// has open on the connection.
enum class other_transaction {
  join,   ///< the call is part of it, and the transaction is this thread's now (exec, step)
  wait,   ///< the call waits until it has ended (a store's operation)
  refuse  ///< the call is not made (a store's renewal: see sqlite_store)
};

/// One connection to a SQLite database file. Threads take turns: each call
/// (exec, prepare, a statement's step) waits until no other thread is in a
/// call. A transaction belongs to the thread that last ran a statement in
/// it; a store's operation from another thread waits for it to end instead
/// of slipping into it. Open a new connection in a child process after
/// fork() (SQLite forbids carrying a connection across fork): a call on a
/// connection a child inherited throws std::errc::operation_not_permitted,
/// saying so, and the child's destructor leaves the parent's database alone.
class connection {
public:
  /// A thread's turn on the connection (see take_turn()).
  class turn {
  public:
    turn() = default;
    turn(turn&& o) noexcept : db_(std::exchange(o.db_, nullptr)) {}
    turn& operator=(turn&&) = delete;
    ~turn() {
      if (db_) db_->end_turn();
    }
    /// Returns: false if the turn was not taken (take_turn(false) found a
    /// transaction of another thread open).
    explicit operator bool() const noexcept { return db_ != nullptr; }

  private:
    friend class connection;
    explicit turn(connection* db) noexcept : db_(db) {}
    connection* db_ = nullptr;
  };

  /// Effects: opens (or creates) the database and applies `opts`. Setting the
  /// journal mode needs a moment of exclusive access, so it is retried while
  /// other processes hold the database.
  /// Throws: std::system_error naming the path, e.g. for a missing directory,
  /// a file that is not a database, or a read-only file opened for writing.
  explicit connection(std::filesystem::path path, const options& opts = {})
      : path_(std::move(path)), turn_(std::make_unique<detail::turn_state>()) {
    int flags = SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_EXRESCODE;
    flags |= opts.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE;
    if (opts.create && !opts.read_only) flags |= SQLITE_OPEN_CREATE;
    // SQLite wants UTF-8 on every platform (path::c_str() is UTF-16 on Windows).
    const auto name = detail::sqlite_file_name(path_);
    const int rc = ::sqlite3_open_v2(name.utf8.c_str(), &db_, flags, name.vfs);
    if (rc != SQLITE_OK) {
      const std::string msg = db_ ? ::sqlite3_errmsg(db_) : ::sqlite3_errstr(rc);
      ::sqlite3_close_v2(db_);
      db_ = nullptr;
      throw std::system_error(make_error_code(rc),
                              fmt::format("sqlite: cannot open database '{}': {}{}", detail::path_text(path_), msg,
                                          detail::open_hint(path_, rc)));
    }
    try {
      ::sqlite3_extended_result_codes(db_, 1);
      // Only noted here: what a rollback means for the callbacks of
      // after_transaction() is worked out when the statement returns.
      ::sqlite3_rollback_hook(
          db_, [](void* t) { static_cast<detail::turn_state*>(t)->rolled_back = true; }, turn_.get());
      ::sqlite3_busy_timeout(db_, static_cast<int>(opts.busy_timeout.count()));
      if (!opts.read_only && ::sqlite3_db_readonly(db_, "main") == 1)
        throw std::system_error(make_error_code(SQLITE_READONLY),
                                fmt::format("sqlite: database '{}' can only be opened read-only{}",
                                            detail::path_text(path_), detail::hint(SQLITE_READONLY)));
      // Touch the file now, so that a file that is not a database is reported
      // here, by name, and not by the first statement of some transaction.
      // The journal mode is the first write (a full disk shows here): every
      // failure of these statements is reported as the open that failed, not
      // as a statement the caller never wrote.
      const auto setup = retry_policy{}.deadline(std::chrono::seconds{30}).unlimited_attempts();
      try {
        retry(setup, [&] { exec("SELECT count(*) FROM sqlite_schema"); });
        if (!opts.journal_mode.empty() && !opts.read_only)
          retry(setup, [&] { exec(fmt::format("PRAGMA journal_mode={}", opts.journal_mode)); });
        if (!opts.synchronous.empty()) exec(fmt::format("PRAGMA synchronous={}", opts.synchronous));
      } catch (const std::system_error& e) {
        const int code = e.code().category() == category() ? e.code().value() : SQLITE_ERROR;
        throw std::system_error(e.code(),
                                fmt::format("sqlite: cannot open database '{}': {}{}", detail::path_text(path_),
                                            ::sqlite3_errstr(code), detail::open_hint(path_, code)));
      }
    } catch (...) {
      ::sqlite3_close_v2(db_);
      db_ = nullptr;
      throw;
    }
  }

  connection(const connection&) = delete;
  connection& operator=(const connection&) = delete;
  /// Requires (both moves): no call on `o` in progress and no transaction open.
  connection(connection&& o) noexcept
      : path_(std::move(o.path_)), opened_by_(o.opened_by_), db_(std::exchange(o.db_, nullptr)),
        turn_(std::move(o.turn_)) {}
  connection& operator=(connection&& o) noexcept {
    if (this != &o) {
      close();
      path_ = std::move(o.path_);
      opened_by_ = o.opened_by_;
      db_ = std::exchange(o.db_, nullptr);
      turn_ = std::move(o.turn_);
    }
    return *this;
  }
  /// Effects: closes the connection; an open transaction is rolled back by
  /// SQLite, and the callbacks of after_transaction() are told so.
  ~connection() { close(); }

  /// Effects: waits for this thread's turn on the connection: until no
  /// other thread is in a call (a thread in a call takes it again at once),
  /// and, as `other` says, for a transaction of another thread.
  /// Returns: the turn (the call ends when it is destroyed); an empty one
  /// if `other` is refuse and another thread has a transaction open.
  [[nodiscard]] turn take_turn(other_transaction other = other_transaction::join) {
    // Before the turn's mutex, which a thread of the parent may have held
    // at the fork (it would then never be released here).
    if (opened_by_ != dibs::detail::current_pid()) refuse_forked();
    std::unique_lock g{turn_->m};
    const auto me = std::this_thread::get_id();
    auto others_tx = [&] { return other != other_transaction::join && turn_->in_tx && turn_->tx_thread != me; };
    while ((turn_->depth > 0 && turn_->holder != me) || others_tx()) {
      if (other == other_transaction::refuse && others_tx()) return turn{};
      turn_->cv.wait(g);
    }
    turn_->holder = me;
    ++turn_->depth;
    if (turn_->in_tx) turn_->tx_thread = me;
    return turn{this};
  }

  /// Returns: true if the calling thread has a transaction open on this
  /// connection (so its statements are part of it).
  bool in_transaction_of_this_thread() const {
    std::lock_guard g{turn_->m};
    return turn_->in_tx && turn_->tx_thread == std::this_thread::get_id();
  }

  /// Requires: in_transaction_of_this_thread().
  /// Effects: calls `f(committed)` once, on this thread, when the open
  /// transaction ends: true if it committed, false if it was rolled back (by
  /// ROLLBACK, by SQLite after an error, or by closing the connection). A
  /// ROLLBACK TO a savepoint ends no transaction and is not reported.
  /// `f` must not use this connection and should not throw (what it throws
  /// is dropped). Returns: an id for forget_after_transaction().
  std::uint64_t after_transaction(std::function<void(bool committed)> f) {
    std::lock_guard g{turn_->m};
    if (!turn_->in_tx || turn_->tx_thread != std::this_thread::get_id())
      throw std::logic_error(fmt::format("sqlite: after_transaction on database '{}' outside a transaction of this thread",
                                         detail::path_text(path_)));
    turn_->on_end.emplace(++turn_->last_id, std::move(f));
    return turn_->last_id;
  }

  /// Effects: the callback `id` of after_transaction() will not be called;
  /// when this returns, it is not running.
  void forget_after_transaction(std::uint64_t id) noexcept {
    std::lock_guard r{turn_->running};
    std::lock_guard g{turn_->m};
    turn_->on_end.erase(id);
  }

  /// Effects: runs one or more statements that return no rows of interest.
  /// Throws: std::system_error naming the statement and the database.
  void exec(std::string_view sql) {
    const auto t = take_turn();
    const std::string text(sql);
    char* err = nullptr;
    const int rc = ::sqlite3_exec(db_, text.c_str(), nullptr, nullptr, &err);
    if (rc != SQLITE_OK) {
      const std::string msg = err ? err : ::sqlite3_errmsg(db_);
      ::sqlite3_free(err);
      fail(rc, text, msg);
    }
  }

  /// Effects: BEGIN IMMEDIATE: takes the write lock up front. A deferred
  /// transaction that reads and then writes can fail on its upgrade in a way
  /// no retry of the statement fixes (SQLITE_BUSY_SNAPSHOT in WAL mode); taking
  /// the lock first makes every failure a clean "retry the whole unit".
  void begin() { exec("BEGIN IMMEDIATE"); }
  void commit() { exec("COMMIT"); }
  /// Effects: rolls back the open transaction, if any (a no-op if SQLite has
  /// already rolled it back, as it does after some errors).
  void rollback() {
    if (in_transaction()) exec("ROLLBACK");
  }
  bool in_transaction() const noexcept { return ::sqlite3_get_autocommit(db_) == 0; }

  statement prepare(std::string_view sql) { return statement{*this, sql}; }


  /// Returns: the first column of the first row of `sql`, or nullopt if there
  /// is no row or it is NULL.
  std::optional<std::int64_t> query_int64(std::string_view sql) {
    statement s{*this, sql};
    if (!s.step() || s.column_is_null(0)) return std::nullopt;
    return s.column_int64(0);
  }

  std::int64_t changes() const noexcept { return ::sqlite3_changes64(db_); }
  const std::filesystem::path& path() const noexcept { return path_; }
  ::sqlite3* native_handle() const noexcept { return db_; }

  /// Throws: std::system_error for result code `rc` of statement `sql`.
  [[noreturn]] void fail(int rc, std::string_view sql, std::string_view message) const {
    throw std::system_error(make_error_code(rc), fmt::format("sqlite: '{}' on database '{}' failed: {}{}", sql,
                                                             detail::path_text(path_), message, detail::hint(rc)));
  }

private:
  friend class statement;

  // Ends the calling thread's call, noting a transaction it opened or ended.
  // The callbacks of after_transaction() run before the transaction is
  // marked ended, so that a renewal coming meanwhile is still refused and
  // does not wait for a turn whose callbacks may wait for it.
  void end_turn() noexcept {
    const bool open = db_ && ::sqlite3_get_autocommit(db_) == 0;
    std::map<std::uint64_t, std::function<void(bool)>> ended;
    bool committed = false, end = false;
    {
      std::lock_guard g{turn_->m};
      if (open && !turn_->in_tx) {
        turn_->in_tx = true;
        turn_->tx_thread = std::this_thread::get_id();
        turn_->rolled_back = false;
      } else if (!open && turn_->in_tx) {
        end = true;
        committed = !turn_->rolled_back;
      }
    }
    if (end) {
      std::lock_guard r{turn_->running};
      {
        std::lock_guard g{turn_->m};
        ended.swap(turn_->on_end);
      }
      for (auto& [id, f] : ended) {
        try {
          f(committed);
        } catch (...) {
        }
      }
    }
    std::lock_guard g{turn_->m};
    if (end) {
      turn_->in_tx = false;
      turn_->tx_thread = {};
      turn_->rolled_back = false;
    }
    if (--turn_->depth == 0) {
      turn_->holder = {};
      turn_->cv.notify_all();
    }
  }

  void close() noexcept {
    if (!db_) return;
    if (opened_by_ != dibs::detail::current_pid()) {
      // A child's copy: closing would act on the parent's database (its
      // journal, its locks' state). The handle is left to the process's end.
      db_ = nullptr;
      return;
    }
    const bool open = ::sqlite3_get_autocommit(db_) == 0;
    ::sqlite3_close_v2(db_);  // rolls an open transaction back, without calling the rollback hook
    db_ = nullptr;
    if (!open || !turn_) return;
    std::lock_guard r{turn_->running};
    std::map<std::uint64_t, std::function<void(bool)>> ended;
    {
      std::lock_guard g{turn_->m};
      ended.swap(turn_->on_end);
    }
    for (auto& [id, f] : ended) {
      try {
        f(false);
      } catch (...) {
      }
    }
  }

  [[noreturn]] void refuse_forked() const {
    throw std::system_error(std::make_error_code(std::errc::operation_not_permitted),
                            fmt::format("sqlite: database '{}': this connection was opened by process {}, and this is "
                                        "a child made from it by fork(): open the store (or connection) after fork, "
                                        "in the process that uses it",
                                        detail::path_text(path_), opened_by_));
  }

  std::filesystem::path path_;
  dibs::detail::process_id opened_by_ = dibs::detail::current_pid();
  ::sqlite3* db_ = nullptr;
  std::unique_ptr<detail::turn_state> turn_;
};

static_assert(dibs::transactional<connection>);

inline statement::statement(connection& db, std::string_view sql) : db_(&db), sql_(sql) {
  const auto t = db.take_turn();
  const int rc = ::sqlite3_prepare_v2(db.native_handle(), sql_.data(), static_cast<int>(sql_.size()), &stmt_, nullptr);
  if (rc != SQLITE_OK) db.fail(rc, sql_, ::sqlite3_errmsg(db.native_handle()));
}

inline void statement::check_bind(int rc, int index) {
  if (rc != SQLITE_OK)
    db_->fail(rc, sql_, fmt::format("cannot bind parameter {}: {}", index, ::sqlite3_errmsg(db_->native_handle())));
}

inline statement& statement::bind(int index, std::int64_t v) {
  check_bind(::sqlite3_bind_int64(stmt_, index, v), index);
  return *this;
}
inline statement& statement::bind(int index, double v) {
  check_bind(::sqlite3_bind_double(stmt_, index, v), index);
  return *this;
}
inline statement& statement::bind(int index, std::string_view v) {
  check_bind(::sqlite3_bind_text(stmt_, index, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT), index);
  return *this;
}
inline statement& statement::bind_blob(int index, std::string_view bytes) {
  const int rc = bytes.empty() ? ::sqlite3_bind_zeroblob(stmt_, index, 0)
                               : ::sqlite3_bind_blob64(stmt_, index, bytes.data(), bytes.size(), SQLITE_TRANSIENT);
  check_bind(rc, index);
  return *this;
}
inline statement& statement::bind(int index, std::nullptr_t) {
  check_bind(::sqlite3_bind_null(stmt_, index), index);
  return *this;
}

inline void statement::reset() noexcept {
  const auto t = db_->take_turn();
  ::sqlite3_reset(stmt_);
}

inline bool statement::step() {
  const auto t = db_->take_turn();
  const int rc = ::sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) {
    ::sqlite3_reset(stmt_);
    return false;
  }
  const std::string msg = ::sqlite3_errmsg(db_->native_handle());
  ::sqlite3_reset(stmt_);
  db_->fail(rc, sql_, msg);
}

}  // namespace dibs::sqlite
