// dibs/postgres/connection.hpp: dibs's libpq layer: PostgreSQL's SQLSTATEs
// as a std::error_category (dibs::postgres::category(), "can a retry help"
// through dibs::is_transient), the helpers that open a connection with
// dibs's defaults and turn a failed result into an error naming the server,
// and dibs::postgres::connection, a connection that dibs::transact runs an
// application's transactions on.
//
// CMake target dibs::postgres (links libpq). postgres_store
// (<dibs/stores/postgres_store.hpp>) is built on this header; a program
// that only retries its own transactions needs only this one.
#pragma once

#ifdef _WIN32
#error "dibs/postgres/connection.hpp is not ported to Windows yet; docs/windows.md lists the headers that are"
#endif

#include <libpq-fe.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include <dibs/error.hpp>
#include <dibs/retry.hpp>

namespace dibs::postgres {

namespace detail {

// SQLSTATEs are five characters of [0-9A-Z]: as a base-36 number they fit
// an int, which is what a std::error_code carries.
inline int encode_state(std::string_view state) noexcept {
  int v = 0;
  for (const char c : state.substr(0, 5)) v = v * 36 + (c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'Z' ? c - 'A' + 10 : 0);
  return v;
}
inline std::string decode_state(int v) {
  std::string s(5, '0');
  for (int i = 4; i >= 0; --i, v /= 36) s[static_cast<std::size_t>(i)] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"[v % 36];
  return s;
}

inline bool transient_state(std::string_view s) noexcept {
  return s.starts_with("08") || s == "57P01" || s == "57P02" || s == "57P03" || s == "40001" || s == "40P01" ||
         s == "53300" || s == "55P03";
}

class category_impl final : public std::error_category {
public:
  const char* name() const noexcept override { return "postgres"; }
  std::string message(int v) const override {
    const std::string s = decode_state(v);
    const char* what = s == "28P01"          ? "password authentication failed"
                       : s == "28000"        ? "invalid authorization"
                       : s == "3D000"        ? "no such database"
                       : s == "42501"        ? "permission denied"
                       : s == "57P01"        ? "the server is shutting down (admin shutdown)"
                       : s == "57014"        ? "statement cancelled"
                       : s == "40001"        ? "serialization failure"
                       : s == "40P01"        ? "deadlock detected"
                       : s == "53300"        ? "too many connections"
                       : s.starts_with("08") ? "connection failure"
                       : s.starts_with("23") ? "constraint violation"
                                             : "error";
    return fmt::format("SQLSTATE {}: {}", s, what);
  }
  bool equivalent(int v, const std::error_condition& cond) const noexcept override {
    if (cond == make_error_condition(condition::transient)) return transient_state(decode_state(v));
    return default_error_condition(v) == cond;
  }
};

}  // namespace detail

/// Returns: the category of PostgreSQL SQLSTATEs (one object per program).
inline const std::error_category& category() noexcept {
  static const detail::category_impl c;
  return c;
}
/// Returns: the error code of a SQLSTATE such as "40001".
inline std::error_code make_error_code(std::string_view sqlstate) noexcept {
  return {detail::encode_state(sqlstate), category()};
}

namespace detail {

// Opens a connection with dibs's defaults before the user's settings (which
// win): how long to wait for a connection and for a dead peer.
inline PGconn* open(const std::string& conninfo, std::chrono::seconds dead_peer) {
  const std::string connect_timeout = std::to_string(std::max<std::int64_t>(2, dead_peer.count()));
  const std::string idle = std::to_string(std::max<std::int64_t>(1, dead_peer.count() / 3));
  const std::string user_timeout = std::to_string(dead_peer.count() * 1000);
  std::vector<const char*> keys = {"connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval",
                                   "keepalives_count", "tcp_user_timeout", "application_name"};
  std::vector<const char*> values = {connect_timeout.c_str(), "1", idle.c_str(), "1", "3", user_timeout.c_str(), "dibs"};
  if (!conninfo.empty()) {
    keys.push_back("dbname");
    values.push_back(conninfo.c_str());
  }
  keys.push_back(nullptr);
  values.push_back(nullptr);
  return ::PQconnectdbParams(keys.data(), values.data(), 1);
}

// Returns: "host:port/database" of a connection, for messages.
inline std::string where(PGconn* c) {
  const char* host = c ? ::PQhost(c) : nullptr;
  const char* port = c ? ::PQport(c) : nullptr;
  const char* db = c ? ::PQdb(c) : nullptr;
  return fmt::format("{}:{}/{}", host && *host ? host : "?", port && *port ? port : "?", db && *db ? db : "?");
}

inline std::string one_line(const char* text) {
  std::string s = text ? text : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  for (char& c : s)
    if (c == '\n') c = ' ';
  return s;
}

// The error of a connection that could not be made, naming the server.
inline std::system_error connect_error(std::string_view who, const std::string& server, const std::string& msg) {
  // libpq reports a refused login in text only.
  const bool login = msg.find("password authentication failed") != std::string::npos ||
                     msg.find("no password supplied") != std::string::npos;
  const bool no_role = msg.find("role \"") != std::string::npos && msg.find("does not exist") != std::string::npos;
  const bool no_db = msg.find("database \"") != std::string::npos && msg.find("does not exist") != std::string::npos;
  // libpq's words for a connection string it cannot parse (a misspelt key,
  // a bad value or URI): the caller's error, which no retry mends.
  bool bad_conninfo = false;
  for (const char* says : {"invalid connection option", "in connection info string", "for connection option",
                           "invalid URI", "in URI", "invalid percent-encoded token"})
    bad_conninfo = bad_conninfo || msg.find(says) != std::string::npos;
  const std::error_code code = login          ? make_error_code("28P01")
                               : no_role      ? make_error_code("28000")
                               : no_db        ? make_error_code("3D000")
                               : bad_conninfo ? dibs::make_error_code(errc::invalid_argument)
                                              : dibs::make_error_code(errc::connection_lost);
  const char* hint = login || no_role ? " (check the user and password in the connection string or PGPASSWORD)"
                     : no_db          ? " (create the database, or name another)"
                     : bad_conninfo   ? " (check the connection string: key=value pairs or a postgresql:// URI)"
                                      : " (is the server running and reachable? transient: a retry can succeed)";
  return std::system_error(code, fmt::format("{}: cannot connect to {}: {}{}", who, server, msg, hint));
}

// Throws unless `r` succeeded: the SQLSTATE as the code (connection_lost if
// there is none), the message after `context`.
inline void check(const PGresult* r, PGconn* c, const std::string& context) {
  const auto st = ::PQresultStatus(r);
  if (r && (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK)) return;
  const char* state = r ? ::PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
  const std::string msg = one_line(r ? ::PQresultErrorMessage(r) : ::PQerrorMessage(c));
  const std::error_code code = state ? make_error_code(state) : dibs::make_error_code(errc::connection_lost);
  const std::string s = state ? state : "";
  const char* hint = s == "42501"                 ? " (the role may not do this: grant it, or use another role)"
                     : dibs::is_transient(code)   ? " (transient: a retry can succeed)"
                                                  : "";
  throw std::system_error(code, fmt::format("{}: {}{}", context, msg, hint));
}

// A notice receiver that marks `*ended` when the server says it is ending
// the session (FATAL): what it sends a session that waits for a command
// (idle_session_timeout, pg_terminate_backend, a shutdown) arrives as a
// notice, not as a statement's result, and nothing else would say so.
inline void note_ending(void* ended, const PGresult* r) {
  const char* severity = ::PQresultErrorField(r, PG_DIAG_SEVERITY_NONLOCALIZED);
  if (severity && (std::string_view(severity) == "FATAL" || std::string_view(severity) == "PANIC"))
    *static_cast<bool*>(ended) = true;
}

// Requires: `c` waits for a command (no statement of ours runs), with
// note_ending(&ended) as its notice receiver. Effects: reads what the server
// sent meanwhile. Returns: true if it ended the session: a statement sent
// now would never run, yet its fate could only be reported unknown.
inline bool ended_while_idle(PGconn* c, const bool& ended) {
  for (int i = 0; i < 16 && !ended; ++i) {  // bounded: a stream of notifications is no reason to wait
    pollfd p{::PQsocket(c), POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) break;
    if (::PQconsumeInput(c) == 0) return true;
  }
  return ended || ::PQstatus(c) != CONNECTION_OK;
}

inline std::string_view field(const PGresult* r, int code) {
  const char* f = r ? ::PQresultErrorField(r, code) : nullptr;
  return f ? f : "";
}

}  // namespace detail

/// A PostgreSQL connection that dibs::transact runs transactions on (it
/// models dibs::transactional), for the application's own statements:
///
///   dibs::postgres::connection db{conninfo, {.begin = "BEGIN ISOLATION LEVEL SERIALIZABLE"}};
///   dibs::transact(policy, db, [&] { db.exec("UPDATE stock SET qty = qty - $1 WHERE item = $2", {"3", "figs"}); });
///
/// A serialization failure, a deadlock or a lost connection inside the
/// transaction is transient: transact rolls back and runs the whole unit
/// again (a lost connection rolled it back on the server; the next begin()
/// reconnects). A COMMIT whose reply was lost is errc::outcome_unknown:
/// never retried blindly (make the work idempotent or check for its effect).
/// Parameters and results are text. Not thread-safe; after fork(), open a
/// new one in the child.
struct connection_options {
  std::string begin = "BEGIN";  ///< how a transaction starts (its isolation level)
  std::chrono::seconds dead_peer{10};
};

class connection {
public:
  using options = connection_options;
  using row = std::vector<std::optional<std::string>>;

  explicit connection(std::string conninfo = {}, options opts = {})
      : conninfo_(std::move(conninfo)), opts_(std::move(opts)), pid_(::getpid()) {
    connect();
  }
  connection(const connection&) = delete;
  connection& operator=(const connection&) = delete;
  ~connection() {
    if (conn_ && ::getpid() == pid_) ::PQfinish(conn_);
  }

  void begin() {
    if (!usable()) connect();
    exec(opts_.begin);
    in_transaction_ = true;
  }
  void commit() {
    try {
      exec("COMMIT");
    } catch (const std::system_error& e) {
      in_transaction_ = false;
      // An ERROR (a deferred constraint, a serialization failure) with the
      // session still there: rolled back. The session gone (a FATAL, a
      // broken connection) after COMMIT was sent: committed or not.
      if (e.code() != dibs::make_error_code(errc::connection_lost) && conn_ && ::PQstatus(conn_) == CONNECTION_OK)
        throw;
      if (lost_before_sent_) throw;
      throw std::system_error(dibs::make_error_code(errc::outcome_unknown),
                              fmt::format("dibs::postgres::connection: the connection to {} broke during COMMIT: the "
                                          "transaction may or may not have been committed ({})",
                                          server_, e.what()));
    }
    in_transaction_ = false;
  }
  void rollback() {
    in_transaction_ = false;
    if (conn_ && ::getpid() != pid_) {  // a forked child: the transaction is the parent's, never touched here
      conn_ = nullptr;
      return;
    }
    if (!conn_ || ::PQstatus(conn_) != CONNECTION_OK) return;  // the server rolled it back
    const std::unique_ptr<PGresult, decltype(&::PQclear)> r{::PQexec(conn_, "ROLLBACK"), ::PQclear};
    detail::check(r.get(), conn_, fmt::format("dibs::postgres::connection: ROLLBACK on {}", server_));
  }

  /// Runs one statement with text parameters ($1, $2, ...; std::nullopt: NULL),
  /// or, without parameters, one or more statements. Returns: the rows (of the last). Throws: std::system_error with the SQLSTATE, naming
  /// the statement and the server.
  std::vector<row> query(std::string_view sql, std::initializer_list<std::optional<std::string_view>> params = {}) {
    lost_before_sent_ = false;
    if (!usable()) {
      if (in_transaction_) {
        lost_before_sent_ = true;
        throw std::system_error(dibs::make_error_code(errc::connection_lost),
                                fmt::format("dibs::postgres::connection: the connection to {} was lost in a "
                                            "transaction (rolled back by the server)",
                                            server_));
      }
      connect();
    }
    std::vector<std::string> owned;
    owned.reserve(params.size());
    std::vector<const char*> values;
    for (const auto& p : params) {
      if (p) owned.emplace_back(*p);
      values.push_back(p ? owned.back().c_str() : nullptr);
    }
    const std::string text(sql);
    // Without parameters several statements may be given at once (PQexec).
    // Both return the last result: an autocommit statement's COMMIT, which
    // follows its own result, fails the call.
    auto send = [&] {
      return std::unique_ptr<PGresult, decltype(&::PQclear)>{
          values.empty() ? ::PQexec(conn_, text.c_str())
                         : ::PQexecParams(conn_, text.c_str(), static_cast<int>(values.size()), nullptr, values.data(),
                                          nullptr, nullptr, 0),
          ::PQclear};
    };
    auto r = send();
    // The server ended the session for idling just as the statement came:
    // it never ran. Outside a transaction, send it once more on a new one.
    if (!in_transaction_ && detail::field(r.get(), PG_DIAG_SQLSTATE) == "57P05") {
      connect();
      r = send();
    }
    detail::check(r.get(), conn_, fmt::format("dibs::postgres::connection: '{}' on {} failed", text, server_));
    std::vector<row> rows;
    for (int i = 0; i < ::PQntuples(r.get()); ++i) {
      row out;
      for (int j = 0; j < ::PQnfields(r.get()); ++j)
        out.push_back(::PQgetisnull(r.get(), i, j) ? std::nullopt : std::optional<std::string>{::PQgetvalue(r.get(), i, j)});
      rows.push_back(std::move(out));
    }
    return rows;
  }
  void exec(std::string_view sql, std::initializer_list<std::optional<std::string_view>> params = {}) {
    (void)query(sql, params);
  }
  /// Returns: the first column of the first row as a number, if there is one.
  std::optional<std::int64_t> query_int64(std::string_view sql,
                                          std::initializer_list<std::optional<std::string_view>> params = {}) {
    const auto rows = query(sql, params);
    if (rows.empty() || rows[0].empty() || !rows[0][0]) return std::nullopt;
    return std::stoll(*rows[0][0]);
  }
  /// Returns: "host:port/database", for messages.
  const std::string& server() const noexcept { return server_; }

private:
  // A session the server ended while it waited (idle_session_timeout,
  // pg_terminate_backend) is not used: a statement sent to it never runs.
  bool usable() {
    return conn_ && ::getpid() == pid_ && ::PQstatus(conn_) == CONNECTION_OK && !detail::ended_while_idle(conn_, ended_);
  }

  void connect() {
    if (conn_ && ::getpid() == pid_) ::PQfinish(conn_);
    conn_ = nullptr;
    ended_ = false;
    pid_ = ::getpid();
    PGconn* c = detail::open(conninfo_, opts_.dead_peer);
    server_ = detail::where(c);
    if (!c || ::PQstatus(c) != CONNECTION_OK) {
      const std::string msg = detail::one_line(c ? ::PQerrorMessage(c) : "out of memory");
      if (c) ::PQfinish(c);
      throw detail::connect_error("dibs::postgres::connection", server_, msg);
    }
    ::PQsetNoticeReceiver(c, &detail::note_ending, &ended_);
    conn_ = c;
  }

  std::string conninfo_;
  options opts_;
  pid_t pid_;
  PGconn* conn_ = nullptr;
  std::string server_;
  bool in_transaction_ = false;
  bool ended_ = false;             // the server said it ends the session (note_ending)
  bool lost_before_sent_ = false;  // the last statement was not sent: its session had ended
};

}  // namespace dibs::postgres

namespace dibs {
static_assert(transactional<postgres::connection>);
}  // namespace dibs
