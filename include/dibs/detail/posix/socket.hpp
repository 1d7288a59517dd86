// dibs/detail/posix/socket.hpp: the TCP calls of dibs's IMAP client on
// POSIX, the twin of detail/win32/socket.hpp: a non-blocking connect with a
// deadline, waiting for a socket with a deadline, send without SIGPIPE,
// recv, close, name resolution, and errors as errno values in
// std::generic_category() (a refused or reset connection is transient, see
// error.hpp). The client's policy (deadlines, reconnecting, messages) is in
// imap/client.hpp and reads the same on both systems.
#pragma once

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>

namespace dibs::detail {

using socket_handle = int;
inline constexpr socket_handle no_socket = -1;
using socket_pid = pid_t;

/// Returns: the id of this process: a session made before fork() is the
/// parent's in the child, which never writes to it.
inline socket_pid socket_owner() noexcept { return ::getpid(); }

/// Effects: nothing on POSIX (Windows starts Winsock here).
inline void socket_startup() {}

/// Returns: the error of the last socket call of this thread.
inline std::error_code last_socket_error() noexcept { return {errno, std::generic_category()}; }

/// Returns: the last socket call's error as text, for messages.
inline std::string last_socket_error_text() { return std::strerror(errno); }

/// Returns: `ec` (from connect_socket()) as text, for messages.
inline std::string socket_error_text(const std::error_code& ec) { return ec.message(); }

/// Returns: true if `host` is an IPv4 or IPv6 address (not a name).
inline bool is_ip_address(const std::string& host) noexcept {
  unsigned char buf[sizeof(in6_addr)];
  return ::inet_pton(AF_INET, host.c_str(), buf) == 1 || ::inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

/// Returns: getaddrinfo()'s error `rc` as text.
inline std::string resolve_error_text(int rc) { return ::gai_strerror(rc); }

/// Connects a new non-blocking socket (close-on-exec) to `a`, waiting at
/// most `wait`. Returns: no error and `out` the socket, or the error (the
/// socket closed): std::errc::timed_out if no answer came in time.
inline std::error_code connect_socket(const addrinfo* a, std::chrono::nanoseconds wait, socket_handle& out) {
  out = no_socket;
  const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
  int e = fd < 0 ? errno : 0;
  if (fd >= 0 && ::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
    e = errno;
    if (e == EINPROGRESS) {
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(wait).count();
      pollfd p{fd, POLLOUT, 0};
      int ready = 0;
      while (ms > 0 && (ready = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(ms, INT_MAX)))) < 0 &&
             errno == EINTR) {
      }
      socklen_t len = sizeof e;
      if (ready <= 0) e = ETIMEDOUT;
      else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
    }
  }
  if (fd >= 0 && e == 0) {
    out = fd;
    return {};
  }
  if (fd >= 0) ::close(fd);
  return {e, std::generic_category()};
}

/// Waits until `s` can be written (`write`) or read, or `wait` passes.
/// Returns: > 0 ready (or an error the next call reports), 0 if the time
/// passed, < 0 if waiting failed.
inline int wait_socket(socket_handle s, bool write, std::chrono::milliseconds wait) noexcept {
  pollfd p{s, static_cast<short>(write ? POLLOUT : POLLIN), 0};
  int rc;
  while ((rc = ::poll(&p, 1, static_cast<int>(std::clamp<std::int64_t>(wait.count(), 0, INT_MAX)))) < 0 &&
         errno == EINTR) {
  }
  return rc;
}

/// Sends what it can of `data` (MSG_NOSIGNAL: a server that has gone is an
/// error, not SIGPIPE). Returns: the bytes sent, or -1 (last_socket_error()).
inline std::ptrdiff_t send_socket(socket_handle s, const char* data, std::size_t n) noexcept {
  ssize_t r;
  while ((r = ::send(s, data, n, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
  }
  return r;
}

/// Effects: sends `data` if it fits at once; never waits, never fails.
inline void send_socket_nowait(socket_handle s, const char* data, std::size_t n) noexcept {
  (void)::send(s, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/// Returns: the bytes read into `buf`, 0 if the server closed the
/// connection, or -1 (last_socket_error()).
inline std::ptrdiff_t recv_socket(socket_handle s, char* buf, std::size_t n) noexcept {
  ssize_t r;
  while ((r = ::recv(s, buf, n, 0)) < 0 && errno == EINTR) {
  }
  return r;
}

/// Returns: true if the last socket call failed only because it would
/// have had to wait.
inline bool socket_would_block() noexcept { return errno == EAGAIN || errno == EWOULDBLOCK; }

inline void close_socket(socket_handle s) noexcept { ::close(s); }

}  // namespace dibs::detail
