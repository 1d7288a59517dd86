// dibs/error.hpp: the error model.
//
// Every failure dibs reports is a std::system_error. Whether a retry can help
// is not a list of numbers scattered through the code but one error condition,
// dibs::condition::transient, tested with dibs::is_transient(ec). Each error
// category says which of its own codes are transient:
//
//   category           transient                                     not transient
//   dibs::errc          contended, timed_out, connection_lost         everything else (outcome_unknown too)
//   system / generic    EAGAIN/EWOULDBLOCK, EBUSY, EINTR, ETIMEDOUT,   EACCES, EPERM, ENOENT, ENOTDIR,
//                       EDEADLK, ENOLCK, ETXTBSY, EINPROGRESS,        EEXIST, EINVAL, ENOSPC, EDQUOT,
//                       EALREADY, ECONNREFUSED, ECONNRESET,           EROFS, EIO, ENOMEM, EBADF, ...
//                       ECONNABORTED, ENOTCONN, ENETDOWN,
//                       ENETUNREACH, ENETRESET, EHOSTDOWN,
//                       EHOSTUNREACH, ENOBUFS
//   dibs::sqlite        SQLITE_BUSY, SQLITE_LOCKED (all extended       every other result code
//                       variants)
//   system, on Windows  ERROR_SHARING_VIOLATION, ERROR_LOCK_VIOLATION,  ERROR_ACCESS_DENIED,
//                       ERROR_BUSY, ERROR_NETWORK_BUSY,                ERROR_FILE_NOT_FOUND,
//                       ERROR_NETNAME_DELETED, timeouts, the WSA        ERROR_PATH_NOT_FOUND,
//                       twins of the network codes above                ERROR_DISK_FULL, ...
//
// Why these: a transient code means the same operation, repeated unchanged a
// moment later, can succeed because someone else will have let go (a lock, a
// busy file, a server that restarts). ENOSPC, EDQUOT and ENOMEM are left out on
// purpose: a full disk rarely empties within a backoff schedule, and retrying
// hides the real problem from the operator. EIO is left out because it
// reports damage, not contention. ECONNREFUSED is in because the usual cause
// is a server that is restarting.
//
// Adapters with their own category (SQLite, PostgreSQL, ...) override
// std::error_category::equivalent(int, const std::error_condition&) to claim
// their transient codes, so is_transient() needs no knowledge of them.
#pragma once

#include <cerrno>
#include <string>
#include <system_error>

namespace dibs {

/// The library's own error codes, in dibs::error_category().
enum class errc {
  contended = 1,        ///< lost a race for a lock or record that someone else holds (transient)
  timed_out,            ///< a wait ran out of time (transient: the holder may let go)
  connection_lost,      ///< the medium went away mid-operation (transient: reconnect and retry)
  retries_exhausted,    ///< retry gave up after its maximum number of attempts
  deadline_exceeded,    ///< retry gave up because its deadline passed
  retry_budget_exhausted,  ///< retry gave up because the shared retry budget was spent
  cancelled,            ///< a stop was requested through a std::stop_token
  rollback_failed,      ///< a transaction could not be rolled back; the connection is unusable
  invalid_argument,     ///< a key, value or option broke a documented rule
  corrupt_record,       ///< a stored record failed its checksum or could not be parsed
  lease_lost,           ///< a lease was taken over while it was held
  /// A write was sent and its reply never came (the connection broke): it
  /// may or may not have been applied. Not transient: repeating it blindly
  /// could apply it twice, and reporting it as a lost race could be a lie.
  /// Resolve it by reading back (the policies recognise their own records).
  outcome_unknown,
};

namespace detail {

class dibs_category final : public std::error_category {
public:
  const char* name() const noexcept override { return "dibs"; }

  std::string message(int value) const override {
    switch (static_cast<errc>(value)) {
      case errc::contended: return "held by someone else";
      case errc::timed_out: return "timed out";
      case errc::connection_lost: return "connection lost";
      case errc::retries_exhausted: return "gave up after the maximum number of attempts";
      case errc::deadline_exceeded: return "gave up at the retry deadline";
      case errc::retry_budget_exhausted: return "gave up: the shared retry budget is spent";
      case errc::cancelled: return "cancelled";
      case errc::rollback_failed: return "rollback failed";
      case errc::invalid_argument: return "invalid argument";
      case errc::corrupt_record: return "corrupt record";
      case errc::lease_lost: return "lease lost";
      case errc::outcome_unknown: return "outcome unknown: the write may or may not have been applied";
    }
    std::string m = "unknown dibs error ";  // not "..." + std::string&&: GCC bug 105651
    m += std::to_string(value);
    return m;
  }
};

}  // namespace detail

/// Returns: the category of dibs::errc codes (a single object per program).
inline const std::error_category& error_category() noexcept {
  static const detail::dibs_category category;
  return category;
}

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

/// Error conditions that group codes of many categories.
enum class condition {
  transient = 1,  ///< the same operation, repeated a moment later, can succeed
};

namespace detail {

inline bool is_transient_errno(int e) noexcept {
  switch (e) {
    case EAGAIN:
#if EWOULDBLOCK != EAGAIN
    case EWOULDBLOCK:
#endif
    case EBUSY:
    case EINTR:
    case ETIMEDOUT:
    case EDEADLK:
    case ENOLCK:
    case ETXTBSY:
    case EINPROGRESS:
    case EALREADY:
    case ECONNREFUSED:
    case ECONNRESET:
    case ECONNABORTED:
    case ENOTCONN:
    case ENETDOWN:
    case ENETUNREACH:
    case ENETRESET:
#ifdef EHOSTDOWN  // not in Windows's errno.h
    case EHOSTDOWN:
#endif
    case EHOSTUNREACH:
    case ENOBUFS:
      return true;
    default:
      return false;
  }
}

// On Windows, std::system_category() holds GetLastError() and WSAGetLastError()
// codes, not errno values. These are transient (numbers from winerror.h,
// so that this header needs no <windows.h>); the rest are judged by the errno
// their category maps them to.
inline bool is_transient_win32(int e) noexcept {
  switch (e) {
    case 32:     // ERROR_SHARING_VIOLATION: antivirus, an indexer or a backup has the file open for a moment
    case 33:     // ERROR_LOCK_VIOLATION: a byte-range lock in the way
    case 170:    // ERROR_BUSY
    case 54:     // ERROR_NETWORK_BUSY
    case 64:     // ERROR_NETNAME_DELETED: an SMB session dropped
    case 121:    // ERROR_SEM_TIMEOUT
    case 258:    // WAIT_TIMEOUT
    case 1460:   // ERROR_TIMEOUT
    case 10035:  // WSAEWOULDBLOCK
    case 10036:  // WSAEINPROGRESS
    case 10050:  // WSAENETDOWN
    case 10051:  // WSAENETUNREACH
    case 10052:  // WSAENETRESET
    case 10053:  // WSAECONNABORTED
    case 10054:  // WSAECONNRESET
    case 10055:  // WSAENOBUFS
    case 10057:  // WSAENOTCONN
    case 10060:  // WSAETIMEDOUT
    case 10061:  // WSAECONNREFUSED
    case 10064:  // WSAEHOSTDOWN
    case 10065:  // WSAEHOSTUNREACH
      return true;
    default:
      return false;
  }
}

class condition_category final : public std::error_category {
public:
  const char* name() const noexcept override { return "dibs.condition"; }

  std::string message(int value) const override {
    if (static_cast<condition>(value) == condition::transient) return "a retry can help";
    std::string m = "unknown dibs condition ";  // not "..." + std::string&&: GCC bug 105651
    m += std::to_string(value);
    return m;
  }

  // Categories that do not know dibs are judged here; categories that do
  // (dibs's own, its adapters') answer for themselves through their own
  // equivalent(int, const error_condition&).
  bool equivalent(const std::error_code& code, int value) const noexcept override {
    if (static_cast<condition>(value) != condition::transient) return false;
#ifdef _WIN32
    if (code.category() == std::system_category()) {
      if (is_transient_win32(code.value())) return true;
      const std::error_condition mapped = code.default_error_condition();
      return mapped.category() == std::generic_category() && is_transient_errno(mapped.value());
    }
    if (code.category() == std::generic_category()) return is_transient_errno(code.value());
#else
    if (code.category() == std::generic_category() || code.category() == std::system_category())
      return is_transient_errno(code.value());
#endif
    if (code.category() == dibs::error_category()) {
      switch (static_cast<errc>(code.value())) {
        case errc::contended:
        case errc::timed_out:
        case errc::connection_lost:
          return true;
        default:
          return false;
      }
    }
    // Any other category that maps its codes onto errno values (through
    // default_error_condition) is judged by the errno it maps to.
    const std::error_condition portable = code.default_error_condition();
    return portable.category() == std::generic_category() && is_transient_errno(portable.value());
  }
};

}  // namespace detail

/// Returns: the category of dibs::condition (a single object per program).
inline const std::error_category& condition_category() noexcept {
  static const detail::condition_category category;
  return category;
}

inline std::error_condition make_error_condition(condition c) noexcept {
  return {static_cast<int>(c), condition_category()};
}

/// Returns: true if `ec` means that repeating the same operation a moment later
/// can succeed (see the table at the top of this header). A default-constructed
/// (success) code is not transient.
inline bool is_transient(const std::error_code& ec) noexcept {
  return ec == make_error_condition(condition::transient);
}

}  // namespace dibs

template <>
struct std::is_error_code_enum<dibs::errc> : std::true_type {};
template <>
struct std::is_error_condition_enum<dibs::condition> : std::true_type {};
