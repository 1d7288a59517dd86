#!/usr/bin/env bash
# run_queue_scaling.sh: what a claim costs as the queue grows, on the local
# stores (docs/BENCHMARKS.md has the figures):
#
#   1. sqlite_store: marker_claim claim_next + complete per item with 1,000,
#      10,000 and 100,000 items queued (half of them completed), beside a
#      hand-written indexed SQLite queue of the same size and that queue
#      writing records as long as dibs's (the floor); the sizes and ways
#      interleaved at random, `reps` repetitions each (sqlite_queue_scaling)
#   2. file_store: the same per item at the three sizes, each size in a
#      process of its own (file_claim_next; see its header for why)
#
#   benchmarks/run_queue_scaling.sh [--quick] [--no-build]
#
# Prints each median (µs per item, wall clock) and the ratios the goals
# name: each size against 1,000 items, dibs against the hand-written queue
# and against the floor.
# Environment: BUILD_DIR (default <repo>/build/bench-queue), DIBS_BENCH_DIR
# (where the databases and directories go; default /var/tmp, on disk), OUT
# (default $BUILD_DIR/results).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-queue}
export DIBS_BENCH_DIR=${DIBS_BENCH_DIR:-/var/tmp}
OUT=${OUT:-$BUILD_DIR/results}

quick=0 build=1
for a in "$@"; do
  case $a in
    --quick) quick=1 ;;
    --no-build) build=0 ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "run_queue_scaling.sh: unknown option $a (try --help)" >&2; exit 2 ;;
  esac
done
[[ $build == 1 ]] && bench_build "$BUILD_DIR" sqlite_queue_scaling file_claim_next
mkdir -p "$OUT"
B=$BUILD_DIR/benchmarks
reps=9
[[ $quick == 1 ]] && reps=2

# median_us NAME FILE: the median real time (µs) of the benchmark NAME in a
# Google Benchmark JSON FILE.
median_us() {
  python3 - "$1" "$2" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
runs = [b["real_time"] for b in json.load(open(path))["benchmarks"]
        if b.get("run_type") == "iteration" and b["run_name"].startswith(name)]
runs.sort()
n = len(runs)
print("" if n == 0 else (runs[n // 2] if n % 2 else (runs[n // 2 - 1] + runs[n // 2]) / 2))
PY
}

echo "== sqlite_store: $reps repetitions of each size and way, interleaved"
"$B/sqlite_queue_scaling" --benchmark_repetitions=$reps --benchmark_enable_random_interleaving=true \
  --benchmark_out="$OUT/sqlite_queue_scaling.json" --benchmark_out_format=json >/dev/null 2>"$OUT/sqlite_queue_scaling.log"
printf '%-8s %12s %12s %12s %10s %10s %10s\n' queued "hand µs" "floor µs" "dibs µs" "dibs/hand" "dibs/floor" "vs 1,000"
for n in 1000 10000 100000; do
  f=$OUT/sqlite_queue_scaling.json
  h=$(median_us "BM_hand_written_indexed_queue/$n/" "$f")
  fl=$(median_us "BM_hand_written_dibs_records/$n/" "$f")
  d=$(median_us "BM_marker_claim_sqlite_store/$n/" "$f")
  [[ $n == 1000 ]] && d1=$d
  # Speed ratios: the baseline's time over dibs's (above 1: dibs is faster).
  printf '%-8s %12.1f %12.1f %12.1f %10s %10s %10s\n' "$n" "$h" "$fl" "$d" "$(ratio "$h" "$d")" "$(ratio "$fl" "$d")" \
    "$(ratio "$d" "$d1")"
done

echo
echo "== file_store in $DIBS_BENCH_DIR: $reps repetitions per size, a process each"
printf '%-8s %12s %10s\n' queued "dibs µs" "vs 1,000"
for n in 1000 10000 100000; do
  "$B/file_claim_next" --benchmark_filter="/$n/" --benchmark_repetitions=$reps \
    --benchmark_out="$OUT/file_claim_next_$n.json" --benchmark_out_format=json >/dev/null 2>"$OUT/file_claim_next_$n.log"
  d=$(median_us "" "$OUT/file_claim_next_$n.json")
  [[ $n == 1000 ]] && f1=$d
  printf '%-8s %12.1f %10s\n' "$n" "$d" "$(ratio "$d" "$f1")"
done
echo
echo "sqlite $(sqlite3 --version 2>/dev/null | cut -d' ' -f1 || echo '?'); dibs $(git -C "$ROOT" rev-parse --short HEAD); results in $OUT"
