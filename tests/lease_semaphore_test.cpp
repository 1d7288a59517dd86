#include <dibs/lease_semaphore.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/stores/memory_store.hpp>
#include <dibs/stores/shm_store.hpp>
#include <dibs/stores/sqlite_store.hpp>

#include <catch2/catch.hpp>

#include "lease_semaphore_checks.hpp"
#include "support.hpp"

#include <unistd.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using dibs_test::temp_dir;

namespace {

// The checks every store runs (lease_semaphore_checks.hpp).
namespace checks = dibs_test::semaphore_checks;

// The stores the unit tests run on. Each opens the same medium again in a
// forked child (`open()`), as another process would.
struct memory_fixture {
  using store_type = dibs::memory_store;
  dibs::memory_store store;
};
struct file_fixture {
  using store_type = dibs::file_store;
  temp_dir dir;
  dibs::file_store store{dir.path};
  dibs::file_store open() const { return dibs::file_store{dir.path}; }
};
struct sqlite_fixture {
  using store_type = dibs::sqlite_store;
  temp_dir dir;
  dibs::sqlite_store store{dir.path / "records.db"};
  dibs::sqlite_store open() const { return dibs::sqlite_store{dir.path / "records.db"}; }
};

struct shm_fixture {
  using store_type = dibs::shm_store;
  std::string name = fmt::format("dibs-test-sem-{}-{}", ::getpid(), std::random_device{}());
  bool removed = dibs::shm_store::remove(name);
  dibs::shm_store store{name};
  ~shm_fixture() { dibs::shm_store::remove(name); }
  dibs::shm_store open() const { return dibs::shm_store{name}; }
};

}  // namespace

TEMPLATE_TEST_CASE("lease_semaphore: N=3 lets three hold, the fourth only after a release", "", memory_fixture,
                   file_fixture, sqlite_fixture, shm_fixture) {
  TestType f;
  checks::three_hold(f);
}

TEMPLATE_TEST_CASE("lease_semaphore: another N, N=0, bad names: a clear error and nothing written", "", memory_fixture,
                   file_fixture, sqlite_fixture, shm_fixture) {
  TestType f;
  checks::bad_input(f);
}

TEMPLATE_TEST_CASE("lease_semaphore: resize grows at once, shrinking leaves holders above N their permits", "",
                   memory_fixture, file_fixture, sqlite_fixture, shm_fixture) {
  TestType f;
  checks::resize(f);
}

TEMPLATE_TEST_CASE("lease_semaphore: a wait ends with errc::cancelled at a stop request, holding nothing", "",
                   memory_fixture, file_fixture, sqlite_fixture, shm_fixture) {
  TestType f;
  checks::cancelled_wait(f);
}

TEMPLATE_TEST_CASE("lease_semaphore: a SIGKILLed holder's permit comes back at once on proof", "", file_fixture,
                   sqlite_fixture, shm_fixture) {
  TestType f;
  checks::killed_holder(f);
}

TEST_CASE("lease_semaphore: threads of one process share one object, never more than N inside") {
  temp_dir dir;
  dibs::file_store store{dir.path};
  dibs::lease_semaphore<dibs::file_store> sem{store, "pool", 2, {.lease = 30s}};
  std::atomic<int> inside{0}, most{0}, done{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        auto p = sem.acquire();
        const int now = ++inside;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::yield();
        --inside;
        p.release();
        ++done;
      }
    });
  for (auto& t : threads) t.join();
  CHECK(done == 400);
  CHECK(most.load() <= 2);
  CHECK(sem.holders().empty());
}

TEST_CASE("lease_semaphore chaos: N=3 on a file_store, 8 processes x 300, 20 SIGKILLs, 2 SIGSTOPs", "[chaos]") {
  temp_dir dir;
  checks::chaos([&] { return dibs::file_store{dir.path}; });
}

TEST_CASE("lease_semaphore chaos: N=3 on a sqlite_store, 8 processes x 300, 20 SIGKILLs, 2 SIGSTOPs", "[chaos]") {
  temp_dir dir;
  checks::chaos([&] { return dibs::sqlite_store{dir.path / "records.db"}; });
}
