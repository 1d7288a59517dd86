// dibs/detail/win32/socket.hpp: the TCP calls of dibs's IMAP client on
// Windows (Winsock 2), the twin of detail/posix/socket.hpp. Winsock is
// started once per process (WSAStartup, never cleaned up: a session may be
// closed by a static destructor). Errors are WSAGetLastError() codes in
// std::system_category(), which error.hpp classes: WSAECONNREFUSED,
// WSAECONNRESET, WSAETIMEDOUT and the other network codes are transient, as
// ECONNREFUSED and ECONNRESET are on Linux. Waiting is select(): WSAPoll
// does not report a failed connect on Windows before 10 2004, select() does
// (in its exception set). Windows has no SIGPIPE, so send() needs no flag.
//
// Link ws2_32 (dibs::imap does). Standard C++20 and the Win32 API only, so
// that MSVC builds it too; verified with mingw-w64 (g++ 12) under Wine 8.
#pragma once

#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <winsock2.h>
#include <ws2tcpip.h>
#include <windows.h>

#ifdef _MSC_VER
#pragma comment(lib, "ws2_32")
#endif

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>

#include <fmt/format.h>

namespace dibs::detail {

using socket_handle = SOCKET;
inline constexpr socket_handle no_socket = INVALID_SOCKET;
using socket_pid = DWORD;

/// Returns: the id of this process (Windows has no fork(): a session is
/// always this process's own).
inline socket_pid socket_owner() noexcept { return ::GetCurrentProcessId(); }

/// Effects: starts Winsock 2.2 once per process. Throws: std::system_error
/// (not transient) if it cannot be started.
inline void socket_startup() {
  static const int rc = [] {
    WSADATA data;
    return ::WSAStartup(MAKEWORD(2, 2), &data);
  }();
  if (rc != 0)
    throw std::system_error(std::error_code(rc, std::system_category()),
                            "dibs::imap: cannot start Winsock 2.2 (WSAStartup)");
}

/// Returns: the error of the last socket call of this thread.
inline std::error_code last_socket_error() noexcept { return {::WSAGetLastError(), std::system_category()}; }

/// Returns: the last socket call's error as text ("... (WSA 10061)"), for messages.
inline std::string last_socket_error_text() {
  const int e = ::WSAGetLastError();
  return fmt::format("{} (WSA {})", std::system_category().message(e), e);
}

/// Returns: `ec` (from connect_socket()) as text, with its WSA code, for messages.
inline std::string socket_error_text(const std::error_code& ec) {
  if (ec.category() != std::system_category()) return ec.message();
  return fmt::format("{} (WSA {})", ec.message(), ec.value());
}

/// Returns: true if `host` is an IPv4 or IPv6 address (not a name).
inline bool is_ip_address(const std::string& host) noexcept {
  unsigned char buf[sizeof(IN6_ADDR)];
  return ::inet_pton(AF_INET, host.c_str(), buf) == 1 || ::inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

/// Returns: getaddrinfo()'s error `rc` (a WSA code) as text.
inline std::string resolve_error_text(int rc) {
  return fmt::format("{} (WSA {})", std::system_category().message(rc), rc);
}

// select() for one socket. Returns: > 0 ready (or failed: the next call
// says how), 0 if `wait` passed, < 0 if select() failed.
inline int select_socket(socket_handle s, bool write, std::chrono::milliseconds wait) noexcept {
  fd_set ready, failed;
  FD_ZERO(&ready);
  FD_ZERO(&failed);
  FD_SET(s, &ready);
  FD_SET(s, &failed);
  const auto ms = std::clamp<std::int64_t>(wait.count(), 0, INT_MAX);
  timeval tv{static_cast<long>(ms / 1000), static_cast<long>(ms % 1000 * 1000)};
  const int rc = ::select(0, write ? nullptr : &ready, write ? &ready : nullptr, &failed, &tv);
  return rc == SOCKET_ERROR ? -1 : rc;
}

/// Connects a new non-blocking socket (not inherited by child processes)
/// to `a`, waiting at most `wait`. Returns: no error and `out` the socket,
/// or the error (the socket closed): std::errc::timed_out if no answer came
/// in time; WSAECONNREFUSED (transient) for a closed port.
inline std::error_code connect_socket(const addrinfo* a, std::chrono::nanoseconds wait, socket_handle& out) {
  out = no_socket;
  const SOCKET s = ::WSASocketW(a->ai_family, a->ai_socktype, a->ai_protocol, nullptr, 0, WSA_FLAG_NO_HANDLE_INHERIT);
  if (s == INVALID_SOCKET) return last_socket_error();
  int e = 0;
  u_long nonblocking = 1;
  if (::ioctlsocket(s, FIONBIO, &nonblocking) != 0) e = ::WSAGetLastError();
  if (e == 0 && ::connect(s, a->ai_addr, static_cast<int>(a->ai_addrlen)) != 0) {
    e = ::WSAGetLastError();
    if (e == WSAEWOULDBLOCK) {  // Winsock's EINPROGRESS
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(wait);
      const int ready = ms.count() > 0 ? select_socket(s, true, ms) : 0;
      int len = sizeof e;
      if (ready <= 0) e = WSAETIMEDOUT;
      else if (::getsockopt(s, SOL_SOCKET, SO_ERROR, reinterpret_cast<char*>(&e), &len) != 0) e = ::WSAGetLastError();
    }
  }
  if (e == 0) {
    out = s;
    return {};
  }
  ::closesocket(s);
  if (e == WSAETIMEDOUT) return std::make_error_code(std::errc::timed_out);
  return {e, std::system_category()};
}

/// Waits until `s` can be written (`write`) or read, or `wait` passes.
/// Returns: > 0 ready (or an error the next call reports), 0 if the time
/// passed, < 0 if waiting failed.
inline int wait_socket(socket_handle s, bool write, std::chrono::milliseconds wait) noexcept {
  return select_socket(s, write, wait);
}

/// Sends what it can of `data`. Returns: the bytes sent, or -1 (last_socket_error()).
inline std::ptrdiff_t send_socket(socket_handle s, const char* data, std::size_t n) noexcept {
  const int r = ::send(s, data, static_cast<int>(std::min<std::size_t>(n, INT_MAX)), 0);
  return r == SOCKET_ERROR ? -1 : r;
}

/// Effects: sends `data` if it fits at once (the socket is non-blocking);
/// never waits, never fails.
inline void send_socket_nowait(socket_handle s, const char* data, std::size_t n) noexcept {
  (void)send_socket(s, data, n);
}

/// Returns: the bytes read into `buf`, 0 if the server closed the
/// connection, or -1 (last_socket_error()).
inline std::ptrdiff_t recv_socket(socket_handle s, char* buf, std::size_t n) noexcept {
  const int r = ::recv(s, buf, static_cast<int>(std::min<std::size_t>(n, INT_MAX)), 0);
  return r == SOCKET_ERROR ? -1 : r;
}

/// Returns: true if the last socket call failed only because it would
/// have had to wait.
inline bool socket_would_block() noexcept { return ::WSAGetLastError() == WSAEWOULDBLOCK; }

inline void close_socket(socket_handle s) noexcept { ::closesocket(s); }

}  // namespace dibs::detail
