// dibs::lease_mutex on Windows, over a memory_store shared by the threads of
// this process: exclusion with fencing tokens, and the proof rule deciding
// for a hold taken on behalf of another process (CreateProcessW), which is
// broken at once once that process is terminated, never while it runs.
#include "win_support.hpp"

#include <dibs/lease_mutex.hpp>
#include <dibs/stores/memory_store.hpp>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lease_win_test {
namespace {

using namespace win_test;

const register_role wait_role{"--wait", [](int, char**) {
  ::Sleep(120'000);
  return 0;
}};

}  // namespace

TEST_CASE("Windows lease_mutex: 4 threads, 4 x 300 holds, no overlap, fencing tokens strictly increasing") {
  dibs::memory_store store;
  std::atomic<int> inside{0}, overlaps{0};
  std::mutex tokens_mutex;
  std::vector<dibs::version> tokens;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      dibs::lease_mutex<dibs::memory_store> m{store, "job", {.lease = 5s}};
      for (int i = 0; i < 300; ++i) {
        std::lock_guard g{m};
        if (inside.fetch_add(1) != 0) ++overlaps;
        {
          std::lock_guard lk{tokens_mutex};
          tokens.push_back(m.token());
        }
        inside.fetch_sub(1);
      }
    });
  for (auto& th : threads) th.join();
  CHECK(overlaps == 0);
  REQUIRE(tokens.size() == 1200);
  // Recorded under the lock, in the order the holds came: each token larger than the last.
  bool increasing = true;
  for (std::size_t i = 1; i < tokens.size(); ++i) increasing = increasing && tokens[i] > tokens[i - 1];
  CHECK(increasing);
}

TEST_CASE("Windows lease_mutex: a hold on behalf of a running process stays, and once that process is terminated it is broken at once") {
  dibs::memory_store store;
  child c{{L"--wait"}};
  dibs::lease_mutex<dibs::memory_store> launcher{store, "job", {.lease = 60s, .on_behalf_of = c.pi.dwProcessId}};
  REQUIRE(launcher.try_lock());
  const auto held = launcher.holder();
  REQUIRE(held);
  CHECK(held->pid == static_cast<long>(c.pi.dwProcessId));
  CHECK(held->host == dibs::detail::host_name());
  CHECK(fmt::format("{}", *held).find(fmt::format("pid {} on ", c.pi.dwProcessId)) != std::string::npos);

  dibs::lease_mutex<dibs::memory_store> other{store, "job", {.lease = 60s}};
  CHECK_FALSE(other.try_lock());  // alive: only the lease (60 s) could free it

  c.kill();
  const auto before = std::chrono::steady_clock::now();
  REQUIRE(other.try_lock());  // proof: the process is gone, long before the lease runs out
  CHECK(std::chrono::steady_clock::now() - before < 5s);
  CHECK(other.token() > launcher.token());
  other.unlock();
}

TEST_CASE("Windows lease_mutex: on_behalf_of an id no process has is refused by name") {
  const long free_id = free_process_id();
  REQUIRE(free_id != 0);
  dibs::memory_store store;
  try {
    dibs::lease_mutex<dibs::memory_store> m{store, "job", {.on_behalf_of = static_cast<dibs::process_id>(free_id)}};
    FAIL("no error");
  } catch (const std::system_error& e) {
    CHECK(e.code() == std::errc::no_such_process);
    CHECK(std::string{e.what()}.find(fmt::format("dibs::lease_mutex 'job': on_behalf_of names pid {}", free_id)) != std::string::npos);
  }
}

}  // namespace lease_win_test
