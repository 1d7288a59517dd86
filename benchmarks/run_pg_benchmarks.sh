#!/usr/bin/env bash
# run_pg_benchmarks.sh: builds pg_claims and runs it against a throwaway
# PostgreSQL 15 (scripts/pg.sh, --durable: fsync and synchronous commit on),
# dibs and the hand-written libpq way interleaved, `runs` times each; prints
# the medians (docs/BENCHMARKS.md has the figures).
#
#   benchmarks/run_pg_benchmarks.sh [--quick] [--no-build]
#
# Environment: BUILD_DIR (default <repo>/build/bench-pg), OUT (default
# $BUILD_DIR/results).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-pg}
OUT=${OUT:-$BUILD_DIR/results}
quick=0 build=1
for a in "$@"; do
  case $a in
    --quick) quick=1 ;;
    --no-build) build=0 ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "run_pg_benchmarks.sh: unknown option $a (try --help)" >&2; exit 2 ;;
  esac
done
[[ $build == 1 ]] && bench_build "$BUILD_DIR" pg_claims
mkdir -p "$OUT"
bench_server pg --durable
B=$BUILD_DIR/benchmarks/pg_claims
runs=5 items1=1000 items8=4000 handoffs=300
[[ $quick == 1 ]] && runs=1 items1=200 items8=500 handoffs=50


: >"$OUT/pg.jsonl"
for bench in claim next; do
  for procs in 1 8; do
    for ((r = 1; r <= runs; r++)); do
      for way in hand dibs; do
        items=$items1
        [[ $procs == 8 ]] && items=$items8
        "$B" --bench $bench --way $way --procs $procs --items $items | tee -a "$OUT/pg.jsonl"
      done
    done
    declare -A med=()
    for way in hand dibs; do
      med[$way]=$(grep "\"bench\": \"$bench\"" "$OUT/pg.jsonl" | grep "\"way\": \"$way\"" | grep "\"procs\": $procs," |
        field items_per_s | median)
      echo "$bench, $procs processes, $way: median ${med[$way]} items/s"
    done
    echo "$bench, $procs processes: dibs / hand $(ratio "${med[dibs]}" "${med[hand]}")x"
  done
done
for ((r = 1; r <= runs; r++)); do
  for way in poll notify; do
    "$B" --bench handoff --way $way --items $handoffs | tee -a "$OUT/pg.jsonl"
  done
done
for way in poll notify; do
  p50=$(grep '"bench": "handoff"' "$OUT/pg.jsonl" | grep "\"way\": \"$way\"" | field p50_ms | median)
  p99=$(grep '"bench": "handoff"' "$OUT/pg.jsonl" | grep "\"way\": \"$way\"" | field p99_ms | median)
  echo "handoff, $way: median p50 $p50 ms, p99 $p99 ms"
done
