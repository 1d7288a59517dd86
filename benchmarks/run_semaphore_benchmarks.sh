#!/usr/bin/env bash
# run_semaphore_benchmarks.sh: issue 33's throughput goal, lease_semaphore
# with 8 processes and N = 4 permits at least 2x lock_file's on the same
# store (docs/BENCHMARKS.md has the figures, docs/benchmarks-history.md the
# sessions). Each round runs, one after the other (the order turned round
# every other round, so that load that comes and goes falls on all alike),
# semaphore_contended with PROCS processes each doing CYCLES rounds of
# acquire, a HOLD_US µs hold (a sleep: the work the permit guards), release:
#
#   file store:   lock_file (the lock file), lease_mutex<file_store>, and
#                 lease_semaphore<file_store> with PERMITS permits
#   sqlite store: lease_mutex<sqlite_store> and lease_semaphore<sqlite_store>
#
#   benchmarks/run_semaphore_benchmarks.sh [--quick] [--no-build]
#
# Prints the medians over the rounds (ops/s, wait p50/p99, how many held at
# once at most and on average) and the ratios semaphore / lock, of the
# medians and (in brackets) the median of the rounds' ratios; a semaphore
# whose holders never reached PERMITS at once, or a run over its limit, is
# said so. Keeps every run's JSON in $OUT/runs.jsonl.
# Environment: BUILD_DIR (default <repo>/build/bench-sem), REPS (rounds,
# default 5), PROCS (8), PERMITS (4), CYCLES (per process, 100), HOLD_US
# (2000), DIR (where the stores go, default /var/tmp), STORES ("file
# sqlite"), OUT (default $BUILD_DIR/semaphore-results).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-sem}
REPS=${REPS:-5}
PROCS=${PROCS:-8}
PERMITS=${PERMITS:-4}
CYCLES=${CYCLES:-100}
HOLD_US=${HOLD_US:-2000}
DIR=${DIR:-/var/tmp}
STORES=${STORES:-file sqlite}
OUT=${OUT:-$BUILD_DIR/semaphore-results}

build=1
for a in "$@"; do
  case $a in
    --quick) REPS=1 CYCLES=20 ;;
    --no-build) build=0 ;;
    -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "run_semaphore_benchmarks.sh: unknown option $a (try --help)" >&2; exit 2 ;;
  esac
done
[[ $build == 1 ]] && bench_build "$BUILD_DIR" semaphore_contended
BIN=$BUILD_DIR/benchmarks/semaphore_contended
mkdir -p "$OUT"

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), dibs $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- include/ || echo ' (include/ with uncommitted changes)')"
  echo "nproc: $(nproc), kernel $(uname -r), $DIR on $(findmnt -n -o FSTYPE -T "$DIR")"
  echo "$PROCS processes x $CYCLES rounds, hold $HOLD_US µs, $PERMITS permits, $REPS rounds"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/machine.txt"

ways() {  # the ways of one store, lock(s) first
  case $1 in
    file) echo "lock_file lease_mutex semaphore" ;;
    sqlite) echo "lease_mutex semaphore" ;;
  esac
}
: >"$OUT/runs.jsonl"
failed=0
for r in $(seq "$REPS"); do
  for store in $STORES; do
    order=$(ways "$store")
    ((r % 2 == 0)) && order=$(echo "$order" | tr ' ' '\n' | tac | tr '\n' ' ')
    for impl in $order; do
      line=$("$BIN" --impl "$impl" --store "$store" --procs "$PROCS" --permits "$PERMITS" --cycles "$CYCLES" \
        --hold-us "$HOLD_US" --dir "$DIR") || failed=$((failed + 1))
      if [[ $line == "{"* ]]; then echo "{\"round\": $r, ${line#\{}" >>"$OUT/runs.jsonl"; fi
    done
  done
  echo "round $r done, load average $(cut -d' ' -f1-3 /proc/loadavg)"
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"

python3 - "$OUT/runs.jsonl" "$PERMITS" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
permits = int(sys.argv[2])
med = statistics.median
def pick(store, impl):
    return [r for r in runs if r["store"] == store and r["impl"] == impl]
print(f"\nmedians of {max(r['round'] for r in runs)} rounds")
print("| store | way | ops/s | ideal ops/s | wait p50 µs | wait p99 µs | hold p50 µs | max inside (min-max over rounds) | mean inside | ok |")
print("|---|---|---:|---:|---:|---:|---:|---|---:|---|")
for store in dict.fromkeys(r["store"] for r in runs):
    for impl in dict.fromkeys(r["impl"] for r in runs if r["store"] == store):
        rs = pick(store, impl)
        mi = [r["max_inside"] for r in rs]
        print(f"| {store} | {impl} | {med(r['ops_per_s'] for r in rs):,.1f} | {rs[0]['ideal_ops_per_s']:,.0f} | "
              f"{med(r['wait_p50_us'] for r in rs):,.0f} | {med(r['wait_p99_us'] for r in rs):,.0f} | "
              f"{med(r['hold_p50_us'] for r in rs):,.0f} | {min(mi)}-{max(mi)} | "
              f"{med(r['mean_inside'] for r in rs):.2f} | {sum(r['ok'] for r in rs)}/{len(rs)} |")
print("\nsemaphore / lock, throughput (goal: semaphore / lock_file >= 2x)")
for store, lock in (("file", "lock_file"), ("file", "lease_mutex"), ("sqlite", "lease_mutex")):
    s, l = pick(store, "semaphore"), pick(store, lock)
    if not s or not l:
        continue
    ratio = med(r["ops_per_s"] for r in s) / med(r["ops_per_s"] for r in l)
    per_round = med(a["ops_per_s"] / b["ops_per_s"] for a in s for b in l if a["round"] == b["round"])
    reached = sum(r["max_inside"] == permits for r in s)
    verdict = "" if lock != "lock_file" else ("  goal met" if ratio >= 2 else "  goal NOT met")
    print(f"  {store}: semaphore / {lock}: {ratio:.2f}x ({per_round:.2f}x); "
          f"the semaphore's holders reached {permits} at once in {reached} of {len(s)} runs{verdict}")
bad = [r for r in runs if not r["ok"]]
if bad:
    print(f"\n{len(bad)} run(s) NOT ok (over the limit, a permit held twice, a lost hold or a failed worker):")
    for r in bad:
        print("  ", json.dumps(r))
EOF
echo "outputs in $OUT"
exit $((failed > 0))
