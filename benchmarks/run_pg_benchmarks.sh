#!/usr/bin/env bash
# run_pg_benchmarks.sh: builds pg_claims and runs it against a throwaway
# PostgreSQL 15 (scripts/pg.sh, --durable: fsync and synchronous commit on),
# dibs, the hand-written libpq way and the floor (the hand-written statements
# on dibs's table, writing rows of dibs's size and shape) interleaved, `runs`
# times each; prints the medians, the ratios of the medians and the medians
# of the per-round ratios (docs/BENCHMARKS.md has the figures).
#
#   benchmarks/run_pg_benchmarks.sh [--quick] [--no-build] [--before PG_CLAIMS] [--only claim|next] [--fsync-off]
#
# --before: a pg_claims binary built from an earlier commit, run as one more
# way ("before") interleaved with the others, for a before/after within one
# run on a noisy machine. --only: that benchmark alone (no handoff).
# --fsync-off: the server without --durable (fsync off): the statements'
# work and the round trips without the disk's commits, which on a shared
# disk vary tenfold within minutes.
# A --before binary without the floor way (built before it) still works: it
# is only ever run as dibs.
# Environment: BUILD_DIR (default <repo>/build/bench-pg), OUT (default
# $BUILD_DIR/results), RUNS (default 5: runs of each way, interleaved),
# WAYS (default 'hand floor dibs'; pg_claims's `shape` may be added).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-pg}
OUT=${OUT:-$BUILD_DIR/results}
quick=0 build=1 before='' benches='claim next' durable=--durable
while (($#)); do
  case $1 in
    --quick) quick=1 ;;
    --no-build) build=0 ;;
    --fsync-off) durable='' ;;
    --before)
      before=${2:?--before needs a pg_claims binary}
      [[ -x $before ]] || { echo "run_pg_benchmarks.sh: --before $before: not an executable" >&2; exit 2; }
      shift
      ;;
    --only)
      benches=${2:?--only needs claim or next}
      [[ $benches == claim || $benches == next ]] || { echo "run_pg_benchmarks.sh: --only takes claim or next, not $benches" >&2; exit 2; }
      shift
      ;;
    -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "run_pg_benchmarks.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
ways=${WAYS:-hand floor dibs}
if [[ -n $before ]]; then ways="$ways before"; fi
[[ $build == 1 ]] && bench_build "$BUILD_DIR" pg_claims
mkdir -p "$OUT"
bench_server pg $durable
B=$BUILD_DIR/benchmarks/pg_claims
runs=${RUNS:-5} items1=1000 items8=4000 handoffs=300
[[ $quick == 1 ]] && runs=1 items1=200 items8=500 handoffs=50


: >"$OUT/pg.jsonl"
for bench in $benches; do
  for procs in 1 8; do
    for ((r = 1; r <= runs; r++)); do
      for way in $ways; do
        items=$items1
        [[ $procs == 8 ]] && items=$items8
        if [[ $way == before ]]; then
          "$before" --bench $bench --way dibs --procs $procs --items $items | sed 's/"way": "dibs"/"way": "before"/'
        else
          "$B" --bench $bench --way $way --procs $procs --items $items
        fi | sed "s/}\$/, \"round\": $r}/" | tee -a "$OUT/pg.jsonl"
      done
    done
    declare -A med=()
    for way in $ways; do
      med[$way]=$(grep "\"bench\": \"$bench\"" "$OUT/pg.jsonl" | grep "\"way\": \"$way\"" | grep "\"procs\": $procs," |
        field items_per_s | median)
      echo "$bench, $procs processes, $way: median ${med[$way]} items/s"
    done
    # a / b: the ratio of the medians, then the median of the ratios within
    # each round (the ways of one round ran minutes apart at most).
    pair() {
      local per
      per=$(grep "\"bench\": \"$bench\"" "$OUT/pg.jsonl" | grep "\"procs\": $procs," |
        sed -n "s/.*\"way\": \"\([a-z]*\)\".*\"items_per_s\": \([0-9.]*\).*\"round\": \([0-9]*\).*/\3 \1 \2/p" |
        awk -v a="$1" -v b="$2" '$2 == a { x[$1] = $3 } $2 == b { y[$1] = $3 }
          END { for (r in x) if (r in y && y[r] > 0) print x[r] / y[r] }' | median)
      echo "$bench, $procs processes: $1 / $2 $(ratio "${med[$1]}" "${med[$2]}")x (median of per-round ratios $(ratio "$per" 1)x)"
    }
    pair dibs hand
    pair floor hand
    pair dibs floor
    if [[ " $ways " == *' shape '* ]]; then pair shape hand; fi
    if [[ -n $before ]]; then
      pair before hand
      pair dibs before
    fi
  done
done
if [[ $benches != 'claim next' ]]; then exit 0; fi
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
