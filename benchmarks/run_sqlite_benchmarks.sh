#!/usr/bin/env bash
# run_sqlite_benchmarks.sh: builds and runs the marker_claim<sqlite_store>
# benchmarks against the same work written by hand (docs/BENCHMARKS.md has
# the figures):
#
#   1. claim+complete, 1 process (Google Benchmark, sqlite_claim_single):
#      10 repetitions of 20,000 items each way, and of the hand-written loop
#      writing marker_claim's own records (the floor for records that long);
#      medians and ratios of CPU and real time
#   2. 8 processes claiming from one table of 20,000 rows (sqlite_claim_procs):
#      5 runs each way, interleaved; medians of items/s
#
#   benchmarks/run_sqlite_benchmarks.sh [--quick] [--no-build]
#
# Environment: BUILD_DIR (default <repo>/build/bench-sqlite), DIBS_BENCH_DIR
# (where the databases go; default /var/tmp, on disk), OUT (default
# $BUILD_DIR/results: every output is kept there too).
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-sqlite}
export DIBS_BENCH_DIR=${DIBS_BENCH_DIR:-/var/tmp}
OUT=${OUT:-$BUILD_DIR/results}

quick=0 build=1
for a in "$@"; do
  case $a in
    --quick) quick=1 ;;
    --no-build) build=0 ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "run_sqlite_benchmarks.sh: unknown option $a (try --help)" >&2; exit 2 ;;
  esac
done

[[ $build == 1 ]] && bench_build "$BUILD_DIR" sqlite_claim_single sqlite_claim_procs
mkdir -p "$OUT"
B=$BUILD_DIR/benchmarks
reps=10 runs=5 items=20000 procs=8
[[ $quick == 1 ]] && reps=2 runs=1 items=2000

echo "== 1. claim+complete, 1 process ($reps repetitions)"
"$B/sqlite_claim_single" --benchmark_repetitions=$reps --benchmark_report_aggregates_only=true \
  --benchmark_out="$OUT/single.json" --benchmark_out_format=json | tee "$OUT/single.txt"
# median_of NAME COLUMN: the median line's real (2) or CPU (4) time of benchmark NAME.
median_of() { awk -v n="^BM_$1/iterations:[0-9]+_median$" -v c="$2" '$1 ~ n { print $c }' "$OUT/single.txt"; }
{
  for col in 4 2; do
    [[ $col == 4 ]] && what=CPU || what=real
    hand=$(median_of hand_written_loop $col) floor=$(median_of hand_written_loop_dibs_records $col)
    dibs=$(median_of marker_claim_sqlite_store $col)
    echo "$what time per item: hand $hand, hand with dibs's records $floor, dibs $dibs; speed dibs/hand $(ratio "$hand" "$dibs"), floor/hand $(ratio "$hand" "$floor"), dibs/floor $(ratio "$floor" "$dibs")"
  done
} | tee "$OUT/single-summary.txt"


echo "== 2. $procs processes, one table of $items rows ($runs runs each way)"
: >"$OUT/procs.jsonl"
for ((r = 1; r <= runs; r++)); do
  for way in hand dibs; do
    "$B/sqlite_claim_procs" --way $way --procs $procs --items $items | tee -a "$OUT/procs.jsonl"
  done
done
for way in hand dibs; do
  rate=$(grep "\"way\": \"$way\"" "$OUT/procs.jsonl" | field items_per_s | median)
  share=$(grep "\"way\": \"$way\"" "$OUT/procs.jsonl" | field failed_share | median)
  echo "$way: median $rate items/s, failed claim attempts $share"
done | tee "$OUT/procs-summary.txt"
