#!/usr/bin/env bash
# run_imap_benchmarks.sh: builds imap_claims and runs it against a throwaway
# Dovecot (scripts/imap.sh: sdbox, mail_fsync=always, loopback), dibs and the
# hand-written floor side by side: in every round each pair runs once, dibs
# and floor in turn, `runs` rounds; prints the medians and dibs/floor
# (docs/BENCHMARKS.md has the figures).
#
#   benchmarks/run_imap_benchmarks.sh [--quick] [--no-build] [--runs N] [--only mailbox]
#
# --only mailbox: the mailbox rows alone (and the ops row). The last row
# compares imap_mailbox with a floor that also keeps a completion record
# (floor-mailbox --complete), the durable writes its guarantees need.
#
# Environment: BUILD_DIR (default <repo>/build/bench-imap), OUT (default
# $BUILD_DIR/results).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-imap}
OUT=${OUT:-$BUILD_DIR/results}
quick=0 build=1 runs=5 only=
while (($#)); do
  case $1 in
    --quick) quick=1 ;;
    --no-build) build=0 ;;
    --runs) runs=$2; shift ;;
    --only)
      only=${2:?--only needs mailbox}
      [[ $only == mailbox ]] || { echo "run_imap_benchmarks.sh: --only takes mailbox, not $only" >&2; exit 2; }
      shift ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "run_imap_benchmarks.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ $build == 1 ]] && bench_build "$BUILD_DIR" imap_claims
mkdir -p "$OUT"
bench_server imap
B=$BUILD_DIR/benchmarks/imap_claims
items=400
[[ $quick == 1 ]] && runs=1 items=60


log=$OUT/imap.jsonl
: >"$log"
"$B" --mode ops --items $((items / 2)) | tee -a "$log"
# name|dibs arguments|floor arguments
pairs=(
  "claim, own keys|--mode dibs-own|--mode floor-own"
  "claim, shared keys|--mode dibs-shared|--mode floor-shared"
  "claim + complete, own keys|--mode dibs-own --complete|--mode floor-own --complete"
  "mailbox: next + complete|--mode dibs-mailbox|--mode floor-mailbox"
  "mailbox, processing_keyword empty|--mode dibs-mailbox --no-processing|--mode floor-mailbox"
  "mailbox, against the floor with a completion record|--mode dibs-mailbox|--mode floor-mailbox --complete"
)
table="| what | workers | floor items/s | dibs items/s | dibs / floor | median of the rounds' ratios |
| --- | ---: | ---: | ---: | ---: | ---: |"
for pair in "${pairs[@]}"; do
  IFS='|' read -r name dibs floor <<<"$pair"
  [[ -n $only && $dibs != *-$only* ]] && continue
  for procs in 1 4; do
    : >"$OUT/dibs.tmp"
    : >"$OUT/floor.tmp"
    for ((r = 1; r <= runs; r++)); do
      # shellcheck disable=SC2086
      "$B" $dibs --procs $procs --items $items | tee -a "$log" "$OUT/dibs.tmp"
      # shellcheck disable=SC2086
      "$B" $floor --procs $procs --items $items | tee -a "$log" "$OUT/floor.tmp"
    done
    d=$(field items_per_s <"$OUT/dibs.tmp" | median)
    f=$(field items_per_s <"$OUT/floor.tmp" | median)
    ratio=$(awk -v d="$d" -v f="$f" 'BEGIN { printf "%.2fx", d / f }')
    rounds=$(paste <(field items_per_s <"$OUT/dibs.tmp") <(field items_per_s <"$OUT/floor.tmp") |
      awk '{ printf "%.3f\n", $1 / $2 }' | median)
    table+=$'\n'"| $name | $procs | $f | $d | $ratio | ${rounds}x |"
  done
done
rm -f "$OUT/dibs.tmp" "$OUT/floor.tmp"
echo
echo "Medians of $runs runs, $items items each (all runs: $log)"
echo "$table"
