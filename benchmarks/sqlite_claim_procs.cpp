// P processes claim from one shared mailbox table of M rows, with
// marker_claim<sqlite_store> (--way dibs) or the hand-written loop
// (--way hand, bench::hand_claims). Process p walks all M keys once, starting
// at key p*M/P and wrapping around, and claims and completes what it can.
//
//   sqlite_claim_procs --way <dibs|hand> --procs P --items M [--dir D]
//
// Prints one JSON object: wall time from the start barrier to the last exit,
// completed items per second, claim attempts that failed (the item was taken
// or done) as a share of all attempts, and the check that the won counts add
// up to M and every row ends completed. Exit status 1 if the check fails.
#include <dibs/marker_claim.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "procs.hpp"
#include "sqlite_claim_common.hpp"

namespace {

struct shared {
  std::atomic<long> won[64];
};

long walk(const std::string& way, const std::filesystem::path& path, long items, long first, dibs_bench::gate& g) {
  long won = 0;
  if (way == "dibs") {
    dibs::sqlite_store store{path, "mailbox"};
    dibs::marker_claim<dibs::sqlite_store> claims{store};
    g.wait();
    for (long k = 0; k < items; ++k)
      if (auto c = claims.try_claim(bench::key_of((first + k) % items))) {
        c->complete();
        ++won;
      }
  } else {
    bench::hand_claims claims{path};
    g.wait();
    for (long k = 0; k < items; ++k) won += claims.claim_and_complete(bench::key_of((first + k) % items));
  }
  return won;
}

}  // namespace

int main(int argc, char** argv) {
  std::string way = "dibs";
  int procs = 8;
  long items = 20'000;
  std::string dir = std::getenv("DIBS_BENCH_DIR") ? std::getenv("DIBS_BENCH_DIR") : "/var/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--way") way = argv[i + 1];
    else if (a == "--procs") procs = std::atoi(argv[i + 1]);
    else if (a == "--items") items = std::atol(argv[i + 1]);
    else if (a == "--dir") dir = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: sqlite_claim_procs --way <dibs|hand> --procs P --items M [--dir D]\n");
      return 2;
    }
  }
  if ((way != "dibs" && way != "hand") || procs < 1 || procs > 64 || items < 1) {
    std::fprintf(stderr, "sqlite_claim_procs: bad arguments\n");
    return 2;
  }
  const auto path = std::filesystem::path(dir) / fmt::format("dibs-bench-procs-{}.db", ::getpid());
  bench::make_mailbox(path, items);

  auto* sh = dibs_bench::shared_new<shared>();
  int failed = 0;
  double secs = 0;
  try {
    secs = dibs_bench::run_procs(procs, [&](int p, dibs_bench::gate& g) {
      sh->won[p] = walk(way, path, items, p * items / procs, g);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sqlite_claim_procs: %s\n", e.what());
    failed = 1;
  }
  long won = 0;
  for (int p = 0; p < procs; ++p) won += sh->won[p];
  dibs::sqlite::connection db{path};
  const long completed = static_cast<long>(
      db.query_int64("SELECT count(*) FROM mailbox WHERE value = 'completed' OR value LIKE '%state completed%'").value_or(0));
  const long attempts = static_cast<long>(procs) * items;  // every process tries every key once
  const bool ok = failed == 0 && won == items && completed == items;
  if (!ok) std::fprintf(stderr, "check: workers failed: %d, %ld won, %ld rows completed, of %ld\n", failed, won, completed, items);
  std::printf("{\"way\": \"%s\", \"procs\": %d, \"items\": %ld, \"seconds\": %.4f, \"items_per_s\": %.0f, "
              "\"claim_attempts\": %ld, \"failed_attempts\": %ld, \"failed_share\": %.4f, \"check\": \"%s\"}\n",
              way.c_str(), procs, items, secs, static_cast<double>(won) / secs, attempts, attempts - won,
              static_cast<double>(attempts - won) / static_cast<double>(attempts), ok ? "ok" : "FAILED");
  std::filesystem::remove(path);
  std::filesystem::remove(path.string() + "-wal");
  std::filesystem::remove(path.string() + "-shm");
  return ok ? 0 : 1;
}
