// What dibs::retry adds to a call that succeeds at once, against calling the
// function directly: for a trivial function and for one that costs ~100 ns.
//
//   build/default/benchmarks/retry_overhead --benchmark_repetitions=10 \
//       --benchmark_report_aggregates_only=true
#include <dibs/retry.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>

namespace {

// A trivial function whose result the optimiser cannot precompute.
std::uint64_t trivial(std::uint64_t x) { return x * 2654435761u + 1; }

// About 100 ns of dependent arithmetic: each round is one shift-xor and one
// multiply on the critical path. 71 rounds measured ~100 ns on a 2.6 GHz AMD
// EPYC (g++ 12, default preset; see docs/BENCHMARKS.md); 60 gave 86-92 ns.
std::uint64_t work_100ns(std::uint64_t x) {
  for (int i = 0; i < 71; ++i) {
    x ^= x >> 13;
    x *= 0x9E3779B97F4A7C15ull;
    benchmark::DoNotOptimize(x);
  }
  return x;
}

const dibs::retry_policy policy;  // the default policy, as most callers use it

void BM_direct_trivial(benchmark::State& state) {
  std::uint64_t x = 1;
  for (auto _ : state) {
    x = trivial(x);
    benchmark::DoNotOptimize(x);
  }
}
void BM_retry_trivial(benchmark::State& state) {
  std::uint64_t x = 1;
  for (auto _ : state) {
    x = dibs::retry(policy, [&] { return trivial(x); });
    benchmark::DoNotOptimize(x);
  }
}
void BM_direct_100ns(benchmark::State& state) {
  std::uint64_t x = 1;
  for (auto _ : state) {
    x = work_100ns(x);
    benchmark::DoNotOptimize(x);
  }
}
void BM_retry_100ns(benchmark::State& state) {
  std::uint64_t x = 1;
  for (auto _ : state) {
    x = dibs::retry(policy, [&] { return work_100ns(x); });
    benchmark::DoNotOptimize(x);
  }
}

BENCHMARK(BM_direct_trivial);
BENCHMARK(BM_retry_trivial);
BENCHMARK(BM_direct_100ns);
BENCHMARK(BM_retry_100ns);

}  // namespace

BENCHMARK_MAIN();
