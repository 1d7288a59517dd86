#include <dibs/dibs.hpp>
#include <dibs/sqlite/connection.hpp>

const std::error_category* category_seen_by_b() { return &dibs::error_category(); }
const std::error_category* sqlite_category_seen_by_b() { return &dibs::sqlite::category(); }

int retried_in_b() {
  int calls = 0;
  dibs::retry(dibs::retry_policy{}.sleeper([](auto, auto) {}), [&] {
    if (++calls == 1) throw std::system_error(dibs::errc::contended);
  });
  return calls;
}
