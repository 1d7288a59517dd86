// dibs/detail/tcp.hpp: a TCP connection to a server by name or address,
// with a deadline, over this platform's socket calls (detail/posix/socket.hpp
// or detail/win32/socket.hpp): name resolution that gives up at the deadline,
// and each address tried in turn. dibs's IMAP client and redis_store connect
// with it; what they say when it fails is theirs.
#pragma once

#ifdef _WIN32
#include <dibs/detail/win32/socket.hpp>
#else
#include <dibs/detail/posix/socket.hpp>
#endif

#include <chrono>
#include <condition_variable>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>

#include <fmt/format.h>

namespace dibs::detail {

// Resolves host and port for TCP by `until`. getaddrinfo() cannot be
// given a deadline, so a name (not an address) is resolved on a thread of
// its own that is left behind if it takes too long: it frees what it finds
// once it is done. Returns: getaddrinfo()'s result, or nullopt if `until`
// passed first.
inline std::optional<int> resolve(const std::string& host, const std::string& port,
                                  std::chrono::steady_clock::time_point until, addrinfo** found) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  if (is_ip_address(host)) {
    hints.ai_flags = AI_NUMERICHOST;
    return ::getaddrinfo(host.c_str(), port.c_str(), &hints, found);
  }
  struct lookup {
    std::mutex m;
    std::condition_variable cv;
    bool done = false, abandoned = false;
    int rc = 0;
    addrinfo* found = nullptr;
  };
  auto job = std::make_shared<lookup>();
  std::thread resolver;
  try {
    resolver = std::thread([job, host, port, hints] {
      addrinfo* f = nullptr;
      const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &f);
      std::lock_guard lock{job->m};
      if (job->abandoned) {
        if (rc == 0) ::freeaddrinfo(f);
        return;
      }
      job->rc = rc;
      job->found = f;
      job->done = true;
      job->cv.notify_one();
    });
  } catch (const std::system_error&) {  // no thread to be had: resolve here, unbounded
    return ::getaddrinfo(host.c_str(), port.c_str(), &hints, found);
  }
  std::unique_lock lock{job->m};
  if (!job->cv.wait_until(lock, until, [&] { return job->done; })) {
    job->abandoned = true;  // it frees what it finds, and the lookup, on its own
    lock.unlock();
    resolver.detach();
    return std::nullopt;
  }
  lock.unlock();
  // Done: the thread is ending. Joined, so that the lookup (its condition
  // variable) is freed here, after the wait, and never by the thread while
  // this one may still be inside the wait's return (ThreadSanitizer saw
  // that as a race, through libstdc++'s uninstrumented thread exit).
  resolver.join();
  *found = job->found;
  return job->rc;
}

// Returns: the address `a` as text ("127.0.0.1", "::1"), for messages.
inline std::string address_text(const addrinfo* a) {
  char host[NI_MAXHOST] = "?";
  (void)::getnameinfo(a->ai_addr, static_cast<socklen_t>(a->ai_addrlen), host, sizeof host, nullptr, 0, NI_NUMERICHOST);
  return host;
}


/// What connect_tcp() did.
struct tcp_connect_result {
  socket_handle socket = no_socket;  ///< connected (non-blocking), or no_socket
  bool resolved = true;              ///< false: the name was not resolved by the deadline
  int resolve_error = 0;             ///< getaddrinfo()'s error, if it failed (resolve_error_text())
  std::error_code error;             ///< the last connect's error, if none connected
  bool timed_out = false;            ///< some address did not answer in time
  std::string tried;                 ///< "127.0.0.1: Connection refused, ::1: no answer in time"
};

/// Connects to the first address of host:port that answers by `until`,
/// each address tried getting an equal share of the time left.
inline tcp_connect_result connect_tcp(const std::string& host, const std::string& port,
                                      std::chrono::steady_clock::time_point until) {
  tcp_connect_result out;
  addrinfo* found = nullptr;
  const auto rc = resolve(host, port, until, &found);
  if (!rc) {
    out.resolved = false;
    return out;
  }
  if (*rc != 0) {
    out.resolve_error = *rc;
    return out;
  }
  std::size_t left = 0;
  for (const addrinfo* a = found; a; a = a->ai_next) ++left;
  for (const addrinfo* a = found; a && out.socket == no_socket; a = a->ai_next, --left) {
    const auto share = (until - std::chrono::steady_clock::now()) / static_cast<int>(left);
    const auto e = connect_socket(a, share, out.socket);
    if (!e) break;
    out.error = e;
    const bool late = e == std::errc::timed_out;
    out.timed_out = out.timed_out || late;
    fmt::format_to(std::back_inserter(out.tried), "{}{}: {}", out.tried.empty() ? "" : ", ", address_text(a),
                   late ? std::string("no answer in time") : socket_error_text(e));
  }
  ::freeaddrinfo(found);
  return out;
}

}  // namespace dibs::detail
