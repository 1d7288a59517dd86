#include <dibs/dibs.hpp>
#include <dibs/sqlite/connection.hpp>
#include <dibs/sqlite_store.hpp>  // a path of 0.1: it forwards to <dibs/stores/sqlite_store.hpp> for a release

#include <cstdio>
#include <system_error>

int main() {
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
  std::puts("consumer: ok");
}
