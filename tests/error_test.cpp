#include <dibs/error.hpp>

#include <catch2/catch.hpp>

#include <cerrno>
#include <string>
#include <system_error>

namespace {

// On POSIX the system category holds errno values; on Windows it holds
// GetLastError() codes, so errno values are checked in the generic one only.
#ifndef _WIN32
std::error_code sys(int e) { return {e, std::system_category()}; }
#else
std::error_code sys(int e) { return {e, std::generic_category()}; }
#endif
std::error_code gen(int e) { return {e, std::generic_category()}; }

// A third-party category that knows nothing of dibs but maps its codes to errno.
class legacy_category final : public std::error_category {
public:
  const char* name() const noexcept override { return "legacy"; }
  std::string message(int) const override { return "legacy"; }
  std::error_condition default_error_condition(int v) const noexcept override {
    return v == 1 ? std::error_condition{EBUSY, std::generic_category()}
                  : std::error_condition{EACCES, std::generic_category()};
  }
};
const legacy_category legacy;

}  // namespace

TEST_CASE("errno values that mean contention or a passing fault are transient") {
  for (int e : {EAGAIN, EWOULDBLOCK, EBUSY, EINTR, ETIMEDOUT, EDEADLK, ENOLCK, ECONNRESET, ECONNREFUSED,
                ENETUNREACH, EHOSTUNREACH}) {
    INFO("errno " << e);
    CHECK(dibs::is_transient(sys(e)));
    CHECK(dibs::is_transient(gen(e)));
  }
}

TEST_CASE("errno values that a retry cannot fix are not transient") {
  for (int e : {EACCES, EPERM, ENOENT, ENOTDIR, EISDIR, EEXIST, EINVAL, ENOSPC,
#ifdef EDQUOT  // not in Windows's errno.h
                EDQUOT,
#endif
                EROFS, EIO, ENOMEM, EBADF}) {
    INFO("errno " << e);
    CHECK_FALSE(dibs::is_transient(sys(e)));
    CHECK_FALSE(dibs::is_transient(gen(e)));
  }
}

TEST_CASE("success is not transient") { CHECK_FALSE(dibs::is_transient(std::error_code{})); }

TEST_CASE("dibs's own codes: only contention, timeouts and lost connections are transient") {
  CHECK(dibs::is_transient(dibs::errc::contended));
  CHECK(dibs::is_transient(dibs::errc::timed_out));
  CHECK(dibs::is_transient(dibs::errc::connection_lost));
  for (auto e : {dibs::errc::retries_exhausted, dibs::errc::deadline_exceeded, dibs::errc::retry_budget_exhausted,
                 dibs::errc::cancelled, dibs::errc::rollback_failed, dibs::errc::invalid_argument,
                 dibs::errc::corrupt_record, dibs::errc::lease_lost}) {
    INFO(make_error_code(e).message());
    CHECK_FALSE(dibs::is_transient(e));
  }
}

TEST_CASE("the transient condition compares with ==, as any std::error_condition") {
  const std::error_code busy = sys(EBUSY);
  CHECK(busy == dibs::condition::transient);
  CHECK(sys(EACCES) != dibs::condition::transient);
}

TEST_CASE("a foreign category is judged by the errno it maps to") {
  CHECK(dibs::is_transient(std::error_code{1, legacy}));
  CHECK_FALSE(dibs::is_transient(std::error_code{2, legacy}));
}

TEST_CASE("dibs codes have a name and a message") {
  const std::error_code ec = dibs::errc::retries_exhausted;
  CHECK(std::string(ec.category().name()) == "dibs");
  CHECK(ec.message() == "gave up after the maximum number of attempts");
  CHECK(&ec.category() == &dibs::error_category());
  CHECK_THAT(std::error_code(99, dibs::error_category()).message(), Catch::Contains("99"));
}

#ifdef _WIN32
TEST_CASE("Windows: a sharing or lock violation is transient (antivirus, indexers), access denied and not found are not") {
  for (int e : {32 /* ERROR_SHARING_VIOLATION */, 33 /* ERROR_LOCK_VIOLATION */, 170 /* ERROR_BUSY */,
                64 /* ERROR_NETNAME_DELETED */, 10054 /* WSAECONNRESET */, 10061 /* WSAECONNREFUSED */}) {
    INFO("GetLastError " << e);
    CHECK(dibs::is_transient(std::error_code{e, std::system_category()}));
  }
  for (int e : {5 /* ERROR_ACCESS_DENIED */, 2 /* ERROR_FILE_NOT_FOUND */, 3 /* ERROR_PATH_NOT_FOUND */,
                112 /* ERROR_DISK_FULL */, 87 /* ERROR_INVALID_PARAMETER */, 19 /* ERROR_WRITE_PROTECT */}) {
    INFO("GetLastError " << e);
    CHECK_FALSE(dibs::is_transient(std::error_code{e, std::system_category()}));
  }
}
#endif
