#include <dibs/stores/memory_store.hpp>
#include <dibs/lock_holder.hpp>
#include <dibs/store.hpp>
#include <dibs/text.hpp>
#include <dibs/testing/store_conformance.hpp>

#include <catch2/catch.hpp>

#include <optional>
#include <string>
#include <string_view>

namespace {

// Each of these misses one part of the concept.
struct no_erase {
  std::optional<dibs::record> read(std::string_view);
  std::optional<dibs::version> create(std::string_view, std::string_view);
  std::optional<dibs::version> replace(std::string_view, dibs::version, std::string_view);
};
struct erase_returns_void {
  std::optional<dibs::record> read(std::string_view);
  std::optional<dibs::version> create(std::string_view, std::string_view);
  std::optional<dibs::version> replace(std::string_view, dibs::version, std::string_view);
  void erase(std::string_view, dibs::version);
};
struct create_returns_bool {
  std::optional<dibs::record> read(std::string_view);
  bool create(std::string_view, std::string_view);
  std::optional<dibs::version> replace(std::string_view, dibs::version, std::string_view);
  bool erase(std::string_view, dibs::version);
};
struct replace_without_version {
  std::optional<dibs::record> read(std::string_view);
  std::optional<dibs::version> create(std::string_view, std::string_view);
  std::optional<dibs::version> replace(std::string_view, std::string_view);
  bool erase(std::string_view, dibs::version);
};

static_assert(dibs::shared_store<dibs::testing::store_archetype>);
static_assert(dibs::shared_store<dibs::memory_store>);
static_assert(!dibs::shared_store<no_erase>);
static_assert(!dibs::shared_store<erase_returns_void>);
static_assert(!dibs::shared_store<create_returns_bool>);
static_assert(!dibs::shared_store<replace_without_version>);

// A broken store (versions restart after erase) that the suite must catch.
class forgetful_store {
public:
  std::optional<dibs::record> read(std::string_view k) { return inner_.read(k); }
  std::optional<dibs::version> create(std::string_view k, std::string_view v) {
    auto r = inner_.create(k, v);
    return r ? std::optional<dibs::version>{1} : std::nullopt;  // every new key starts again at 1
  }
  std::optional<dibs::version> replace(std::string_view k, dibs::version e, std::string_view v) {
    auto cur = inner_.read(k);
    if (!cur) return std::nullopt;
    return inner_.replace(k, e == 1 ? cur->version : e + 1000, v);
  }
  bool erase(std::string_view k, dibs::version e) {
    auto cur = inner_.read(k);
    return cur && inner_.erase(k, cur->version) && (e == 1 || true);
  }

private:
  dibs::memory_store inner_;
};

}  // namespace

TEST_CASE("memory_store passes the conformance suite", "[conformance]") {
  dibs::memory_store s;
  REQUIRE_NOTHROW(dibs::testing::check_semantics(s, "sem-"));
  REQUIRE_NOTHROW(dibs::testing::check_bad_input(s, "bad-"));
  REQUIRE_NOTHROW(dibs::testing::check_any_keys(s, "any-"));
  REQUIRE_NOTHROW(dibs::testing::check_races_threads(s, 8, 1000, "race-"));
}

TEST_CASE("the conformance suite catches a store whose versions restart after erase", "[conformance]") {
  forgetful_store s;
  CHECK_THROWS_AS(dibs::testing::check_semantics(s, "f-"), dibs::testing::conformance_failure);
}

TEST_CASE("a refused key is named in the message with the call, the rule and what to do, control bytes escaped") {
  dibs::memory_store s;
  try {
    (void)s.read(std::string("a\x01z") + std::string(2000, 'k'));
    FAIL("accepted");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dibs::errc::invalid_argument);
    CHECK_THAT(e.what(), Catch::StartsWith("dibs::memory_store::read: invalid key 'a\\x01zkkk") &&
                             Catch::Contains("at most 1024 bytes (it has 2003)") && Catch::Contains("digest"));
  }
  CHECK_THROWS_WITH(s.create("", "v"), Catch::StartsWith("dibs::memory_store::create: invalid key ''") &&
                                           Catch::Contains("must not be empty"));
}

TEST_CASE("show_key and show_time write keys and times for people as dibs's own messages do") {
  CHECK(dibs::show_key("mail/4711") == "mail/4711");
  CHECK(dibs::show_key(std::string("a\x01\\b\x7f", 5)) == "a\\x01\\x5cb\\x7f");
  CHECK(dibs::show_key("é") == "é");  // UTF-8 text as it is
  CHECK(dibs::show_key(std::string(100, 'k')) == std::string(80, 'k') + "... (100 bytes)");
  const auto now = std::chrono::system_clock::now();
  const std::string today = dibs::show_time(now);
  CHECK_THAT(today, Catch::Matches("[0-2][0-9]:[0-5][0-9]:[0-6][0-9]"));
  CHECK_THAT(dibs::show_time(now - std::chrono::hours{24 * 3}),
             Catch::Matches("20[0-9][0-9]-[01][0-9]-[0-3][0-9] [0-2][0-9]:[0-5][0-9]:[0-6][0-9]"));
}

TEST_CASE("a Message-ID, a URL and bytes that are not text are keys like any other") {
  dibs::memory_store s;
  const std::string keys[] = {"<abc/def+123@mail.example.com>", "https://example.com/a?b=%20", std::string("\0\xff", 2)};
  for (const auto& k : keys) REQUIRE(s.create(k, k));
  for (const auto& k : keys) CHECK(s.read(k)->value == k);
}

TEST_CASE("memory_store passes the queue checks: priorities, schedules, backoffs, claim_next_n, each item once", "[conformance]") {
  dibs::memory_store s;
  REQUIRE_NOTHROW(dibs::testing::check_queue(s, "q-"));
  REQUIRE_NOTHROW(dibs::testing::check_queue_race_threads(s, 8, 400, "race-"));
}
