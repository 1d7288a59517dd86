// A user's program: built by tests/CMakeLists.txt's consumer tests in
// Release (-O3) with -Wall -Wextra -Werror, by g++ in the default preset and
// clang++ in the clang one. It goes through the code that GCC 12 once warned
// about inside dibs's headers (a queue's offer, a log's rotation, a lock
// file's messages through fmt), which
// broke users' -Werror builds: a header that warns fails this build.
#include <dibs/dibs.hpp>
#include <dibs/sqlite/connection.hpp>
#include <dibs/sqlite_store.hpp>  // a path of 0.1: it forwards to <dibs/stores/sqlite_store.hpp> for a release

#include <cstdio>
#include <filesystem>
#include <mutex>
#include <system_error>

int main(int, char** argv) {
  int calls = 0;
  dibs::retry_policy policy;
  policy.backoff({std::chrono::microseconds{1}, 2.0, std::chrono::microseconds{10}});
  const int v = dibs::retry(policy, [&] {
    if (++calls < 3) throw std::system_error(make_error_code(std::errc::resource_unavailable_try_again));
    return 42;
  });
  dibs::sqlite::connection db{":memory:", {.journal_mode = ""}};
  const auto one = db.query_int64("SELECT 1");
  if (v != 42 || calls != 3 || one != 1) return 1;

  // Beside the program: each consumer test builds its own, side by side.
  const auto dir = std::filesystem::absolute(argv[0]).parent_path() / "consumer-data";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  bool queue_ok = false;
  bool log_ok = false;
  {
    dibs::sqlite_store store{(dir / "queue.db").string(), "items"};
    dibs::marker_claim<dibs::sqlite_store> claims{store};
    claims.offer("item-1");
    if (auto c = claims.claim_next()) {
      queue_ok = c->key() == "item-1";
      c->complete();
    }
    dibs::lock_file lock{dir / "app.lock"};
    { std::scoped_lock hold{lock}; }
    dibs::shared_log log{dir / "app.log", {.rotate_size = 64}};
    for (int i = 0; i < 4; ++i) log.append("a line long enough that four of them rotate the log");
    log_ok = std::filesystem::exists(dir / "app.log.1");
  }
  std::filesystem::remove_all(dir);
  if (!queue_ok || !log_ok) return 2;
  std::puts("consumer: ok");
}
