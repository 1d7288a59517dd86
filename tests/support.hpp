// Helpers shared by the tests: temporary directories and child processes.
#pragma once

#include <catch2/catch.hpp>

#include <pwd.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <string>
#include <thread>

namespace dibs_test {

namespace fs = std::filesystem;

/// A fresh directory under the system temp dir, removed at scope exit.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::string tmpl = (fs::temp_directory_path() / "dibs-test-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

/// Returns: the whole content of the file at `p` ("" if it cannot be read).
inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Effects: replaces the content of the file at `p` with `s`.
inline void spit(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary | std::ios::trunc) << s; }

/// Effects: forks; the child runs `body` and exits with its return value (1 if
/// it throws, after printing what). Never returns in the child.
inline pid_t spawn(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 1;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), e.what());
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  return pid;
}

/// Returns: the child's exit code, or 128 + signal if it was killed.
inline int wait_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

/// Returns: the uid and gid of an unprivileged account ("nobody"), for tests
/// of permission errors: root ignores file permissions.
inline bool unprivileged_ids(uid_t& uid, gid_t& gid) {
  const passwd* pw = ::getpwnam("nobody");
  if (!pw) return false;
  uid = pw->pw_uid;
  gid = pw->pw_gid;
  return true;
}

/// Effects: in a child process, drops to the unprivileged account and runs body.
/// Returns: body's exit code (77 if no unprivileged account exists).
inline int run_unprivileged(const std::function<int()>& body) {
  uid_t uid;
  gid_t gid;
  if (!unprivileged_ids(uid, gid)) return 77;
  return wait_exit(spawn([&] {
    if (::getuid() == 0 && (::setgid(gid) != 0 || ::setuid(uid) != 0)) return 78;
    return body();
  }));
}

/// Effects: polls `pred` until it holds or `timeout` passes. Returns: pred().
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds{10}) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  return true;
}

}  // namespace dibs_test
