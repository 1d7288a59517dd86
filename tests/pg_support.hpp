// The PostgreSQL server of the tests (started by scripts/pg.sh through a
// ctest fixture, its directory in DIBS_PG_DIR), fresh tables, and a TCP
// proxy that can lose a reply or a request on purpose.
#pragma once

#include <dibs/stores/postgres_store.hpp>

#include <arpa/inet.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

namespace dibs_test::pg {

inline std::string dir() {
  const char* d = std::getenv("DIBS_PG_DIR");
  if (!d) throw std::runtime_error("DIBS_PG_DIR is not set: run the PostgreSQL tests through ctest (fixture pg)");
  return d;
}
inline std::string file(const std::string& name) {
  std::ifstream in(dir() + "/" + name);
  std::string s;
  std::getline(in, s);
  return s;
}
inline std::string conninfo() { return file("conninfo"); }
inline int port() { return std::stoi(file("port")); }

/// Runs scripts/pg.sh `cmd` on the tests' server (kill, restart).
inline void script(const std::string& cmd) {
  const std::string line = std::string(DIBS_SOURCE_DIR) + "/scripts/pg.sh " + cmd + " " + dir();
  if (std::system(line.c_str()) != 0) throw std::runtime_error("failed: " + line);
}

/// Returns: a table name no test used before.
inline std::string fresh_table(const std::string& stem) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{}_{:x}", stem, rng() & 0xffffffffffull);
}

/// Runs SQL as the tests' superuser; returns the first column of the first row.
inline std::string sql(const std::string& statement, const std::string& info = conninfo()) {
  std::unique_ptr<PGconn, decltype(&::PQfinish)> c{::PQconnectdb(info.c_str()), ::PQfinish};
  if (::PQstatus(c.get()) != CONNECTION_OK) throw std::runtime_error(::PQerrorMessage(c.get()));
  std::unique_ptr<PGresult, decltype(&::PQclear)> r{::PQexec(c.get(), statement.c_str()), ::PQclear};
  const auto st = ::PQresultStatus(r.get());
  if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
    throw std::runtime_error(statement + ": " + ::PQresultErrorMessage(r.get()));
  return st == PGRES_TUPLES_OK && ::PQntuples(r.get()) > 0 ? ::PQgetvalue(r.get(), 0, 0) : "";
}

/// A TCP proxy on 127.0.0.1 in front of the server. Normally it passes
/// everything. lose_reply(): the next reply from the server is swallowed
/// and the client's side closed, while the server's side stays open (the
/// server's session lives on, as behind a cut network): a write is applied
/// and its writer never hears. lose_request(): the same, but the request is
/// swallowed instead: nothing is applied, and its writer cannot know that.
class proxy {
public:
  proxy() : target_(port()) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listen_, 64) != 0 ||
        ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error(os_error("proxy"));
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~proxy() {
    stop_ = true;
    ::shutdown(listen_, SHUT_RDWR);
    acceptor_.join();
    for (auto& t : pipes_) t.join();
    ::close(listen_);
  }
  /// Returns: the tests' conninfo with this proxy's port.
  std::string conninfo() const {
    std::string c = pg::conninfo();
    const auto at = c.find("port=");
    const auto end = c.find(' ', at);
    return c.replace(at, end - at, "port=" + std::to_string(port_));
  }
  void lose_reply() { mode_ = 1; }
  void lose_request() { mode_ = 2; }
  /// A partition: nothing passes either way, and nobody is told (the
  /// connections stay open; what is sent waits, as behind a cut cable).
  void cut() { cut_ = true; }
  /// The partition heals: what waited is delivered.
  void heal() { cut_ = false; }
  /// Returns: how many replies or requests were lost so far.
  int lost() const { return lost_; }

private:
  void accept_loop() {
    for (;;) {
      const int client = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0 || stop_) {
        if (client >= 0) ::close(client);
        return;
      }
      const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<std::uint16_t>(target_));
      if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        ::close(client);
        ::close(server);
        continue;
      }
      std::lock_guard g{m_};
      pipes_.emplace_back([this, client, server] { pipe(client, server); });
    }
  }

  // Forwards both ways; in a losing mode, the first request (client to
  // server) or reply (server to client) after it was set is dropped and the
  // client's side closed. The server's side stays open until the end.
  void pipe(int client, int server) {
    char buf[65536];
    bool client_open = true;
    while (!stop_) {
      if (cut_) {
        std::this_thread::sleep_for(std::chrono::milliseconds{5});
        continue;
      }
      pollfd p[2] = {{client_open ? client : -1, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 50) <= 0) continue;
      if (client_open && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
        const ssize_t n = ::read(client, buf, sizeof buf);
        if (n <= 0) break;
        if (mode_ == 2 && mode_.exchange(0) == 2) {
          ++lost_;
          ::shutdown(client, SHUT_RDWR);
          client_open = false;
          continue;
        }
        if (::write(server, buf, static_cast<std::size_t>(n)) != n) break;
      }
      if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
        const ssize_t n = ::read(server, buf, sizeof buf);
        if (n <= 0) break;
        if (!client_open) continue;  // the session goes on; nobody hears it
        if (mode_ == 1 && mode_.exchange(0) == 1) {
          ++lost_;
          ::shutdown(client, SHUT_RDWR);
          client_open = false;
          continue;
        }
        if (::write(client, buf, static_cast<std::size_t>(n)) != n) break;
      }
    }
    ::close(client);
    ::close(server);
  }

  int target_, port_ = 0, listen_ = -1;
  std::atomic<bool> stop_{false}, cut_{false};
  std::atomic<int> mode_{0}, lost_{0};
  std::mutex m_;
  std::thread acceptor_;
  std::vector<std::thread> pipes_;
};

}  // namespace dibs_test::pg
