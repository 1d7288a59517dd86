// Two translation units of one program include every dibs header; the linker
// and this test check there is one definition of each, and one category object.
#include <dibs/dibs.hpp>
#include <dibs/sqlite/connection.hpp>

const std::error_category* category_seen_by_b();
const std::error_category* sqlite_category_seen_by_b();
int retried_in_b();

int main() {
  if (category_seen_by_b() != &dibs::error_category()) return 1;
  if (sqlite_category_seen_by_b() != &dibs::sqlite::category()) return 2;
  if (!dibs::is_transient(dibs::sqlite::make_error_code(SQLITE_BUSY))) return 3;
  if (retried_in_b() != 2) return 4;
  return 0;
}
