#include <dibs/marker_claim.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/stores/sqlite_store.hpp>
#include <dibs/worker_pool.hpp>

#include <catch2/catch.hpp>

#include "exactly_once.hpp"
#include "support.hpp"

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>

using namespace std::chrono_literals;
using dibs_test::temp_dir;

namespace {
std::vector<std::string> numbered(const std::string& prefix, int n) {
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(fmt::format("{}{:04}", prefix, i));
  return keys;
}
}  // namespace

TEST_CASE("worker_pool drains a queue: each item handled once by 4 threads, completed in batches") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  dibs::marker_claim<dibs::sqlite_store> claims{s};
  REQUIRE(claims.offer_n(numbered("job-", 300)) == 300);
  std::mutex m;
  std::map<std::string, int> handled;
  dibs::worker_pool pool{claims, [&](const auto& c) {
                           std::lock_guard g{m};
                           ++handled[c.key()];
                         },
                         {.concurrency = 4, .prefetch = 16}};
  const auto st = pool.drain();
  CHECK(st.completed == 300);
  CHECK(st.lost == 0);
  CHECK(st.released == 0);
  CHECK(st.errors == 0);
  CHECK(st.batches >= 1);
  CHECK(st.batches <= 300);
  CHECK(handled.size() == 300);
  CHECK(std::all_of(handled.begin(), handled.end(), [](const auto& h) { return h.second == 1; }));
  for (const auto& item : claims.list("job-")) CHECK(item.status.state == dibs::claim_state::completed);
}

TEST_CASE("worker_pool: a handler that throws gives its item back with the error, and it runs again") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  dibs::marker_claim<dibs::sqlite_store> claims{s, {.retry_backoff = std::nullopt}};
  REQUIRE(claims.offer_n(numbered("job-", 40)) == 40);
  std::atomic<int> runs{0};
  dibs::worker_pool pool{claims, [&](const auto& c) {
                           ++runs;
                           if (c.attempts() == 1 && c.key().back() % 2 == 1) throw std::runtime_error("odd, first try");
                         },
                         {.concurrency = 3}};
  const auto st = pool.drain();
  CHECK(st.released == 20);
  CHECK(st.completed == 40);
  CHECK(runs == 60);
  const auto again = claims.status("job-0001");
  CHECK(again.state == dibs::claim_state::completed);
  CHECK(again.attempts == 2);
  CHECK(again.error.empty());
}

TEST_CASE("worker_pool stops gracefully: running items finish and are completed, prefetched ones go back at once") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  dibs::marker_claim<dibs::sqlite_store> claims{s};
  REQUIRE(claims.offer_n(numbered("job-", 50)) == 50);
  std::mutex m;
  std::condition_variable cv;
  int started = 0;
  bool go = false;
  std::stop_source stop;
  dibs::worker_pool pool{claims, [&](const auto&) {
                           std::unique_lock g{m};
                           ++started;
                           cv.notify_all();
                           cv.wait(g, [&] { return go; });
                         },
                         {.concurrency = 2, .prefetch = 10}};
  std::thread stopper{[&] {
    std::unique_lock g{m};
    cv.wait(g, [&] { return started == 2; });  // both handlers are running an item
    stop.request_stop();
    go = true;
    cv.notify_all();
  }};
  const auto st = pool.run(stop.get_token());
  stopper.join();
  CHECK(st.completed == 2);
  CHECK(st.returned >= 1);
  CHECK(st.returned <= 10);
  int completed = 0, waiting = 0, other = 0;
  for (const auto& item : claims.list("job-")) {
    if (item.status.state == dibs::claim_state::completed) ++completed;
    else if ((item.status.state == dibs::claim_state::offered || item.status.state == dibs::claim_state::released) &&
             item.status.not_before <= std::chrono::system_clock::now())
      ++waiting;
    else ++other;
  }
  CHECK(completed == 2);
  CHECK(waiting == 48);  // claimable at once, none left processing
  CHECK(other == 0);
  // The items given back were never started: their attempt is not counted.
  for (const auto& item : claims.list("job-"))
    if (item.status.state != dibs::claim_state::completed) CHECK(item.status.attempts == 0);
}

TEST_CASE("give_back_unstarted: an item claimed on its last attempt and never started is not failed, and is claimable at once") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  dibs::marker_claim<dibs::sqlite_store> claims{s, {.max_attempts = 2, .retry_backoff = std::nullopt}};
  REQUIRE(claims.offer("job"));
  claims.claim_next()->release("first try failed");
  auto c = claims.claim_next();
  REQUIRE(c);
  CHECK(c->attempts() == 2);  // the last
  CHECK(c->give_back_unstarted());
  const auto st = claims.status("job");
  CHECK(st.state == dibs::claim_state::released);
  CHECK(st.attempts == 1);
  auto again = claims.claim_next();
  REQUIRE(again);
  CHECK(again->attempts() == 2);
  CHECK(again->token() > c->token());
  again->complete();
}

TEST_CASE("worker_pool refuses a concurrency of 0 or a prefetch above 10,000, saying so") {
  temp_dir dir;
  dibs::sqlite_store s{dir.path / "q.db"};
  dibs::marker_claim<dibs::sqlite_store> claims{s};
  auto noop = [](const auto&) {};
  CHECK_THROWS_WITH((dibs::worker_pool{claims, noop, {.concurrency = 0}}), Catch::Contains("concurrency must be 1"));
  CHECK_THROWS_WITH((dibs::worker_pool{claims, noop, {.prefetch = 10'001}}), Catch::Contains("prefetch must be at most"));
}

#ifndef _WIN32
TEST_CASE("worker_pool on SQLite: 6 pool processes take 2,000 items, 12 SIGKILLs mid-batch, each completed once with its fenced effect", "[chaos]") {
  temp_dir dir;
  const auto items = dir.path / "items.db", journal = dir.path / "journal.db";
  { dibs::sqlite_store init{items}; }
  { dibs::sqlite_store init{journal}; }
  dibs_test::check_pool_exactly_once([&] { return dibs::sqlite_store{items}; },
                                     [&] { return dibs::sqlite_store{journal}; }, 6, 2000, 12, 2s);
}

TEST_CASE("worker_pool on files: 4 pool processes take 600 items through file_store's queue view, 8 SIGKILLs mid-batch, each completed once with its fenced effect", "[chaos]") {
  temp_dir items, journal;
  dibs_test::check_pool_exactly_once([&] { return dibs::file_store{items.path}; },
                                     [&] { return dibs::file_store{journal.path}; }, 4, 600, 8, 2s);
}
#endif
