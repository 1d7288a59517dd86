#!/usr/bin/env bash
# run_redis_benchmarks.sh: dibs's Redis store beside what a user would take
# instead, on one throwaway Redis server (scripts/redis.sh: appendonly yes,
# appendfsync always unless --fsync says otherwise), in one run: each round
# runs every way once, `runs` rounds; prints the medians and the ratios of
# the medians (and the median of the per-round ratios).
#
#   benchmarks/run_redis_benchmarks.sh [--quick] [--no-build] [--runs N] [--fsync always|everysec]
#
# lock: 2,000 lock + unlock of one lock, by 1 and by 8 processes.
#   dibs: lease_mutex<redis_store> (waiters woken by PUBLISH). redlock 4.2.0
#   (npm's latest) on ioredis, retrying without limit every 5 ms (+ up to
#   5 ms of jitter: tuned for it; its default is 200 + 200 ms).
# queue: 20,000 no-op items queued beforehand (not timed). dibs: 8
#   processes of claim_next_n(100) + complete_n, and a worker_pool (1
#   process, 50 threads, prefetch 100; and 2 processes x 25). BullMQ 6.7.6:
#   one Worker of concurrency 50 (its docs' example), and 2 processes x 50
#   (its docs recommend more workers over more concurrency).
# claim: 5,000 keys, each claimed and completed by one process: dibs's
#   marker_claim try_claim + complete, against SET NX PX + a compare-and-set
#   EVAL written by hand with hiredis.
#
# --quick: one round of a tenth of the sizes (a check that it all runs).
# --no-build: use the redis_bench and the npm install already in BUILD_DIR.
# Environment: BUILD_DIR (default <repo>/build/bench-redis), OUT (default
# $BUILD_DIR/results).
# Needs Node.js and npm (scripts/install-deps.sh peers installs them where
# there are none); npm fetches redlock, ioredis and BullMQ at the versions
# of benchmarks/peers/redis/package-lock.json into BUILD_DIR/peers/redis.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-redis}
OUT=${OUT:-$BUILD_DIR/results}
quick=0 build=1 runs=${RUNS:-3} runs_given=0 fsync=always
while (($#)); do
  case $1 in
    --quick) quick=1 ;;
    --no-build) build=0 ;;
    --runs)
      runs=${2:?--runs needs a number}
      [[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "run_redis_benchmarks.sh: --runs takes a positive number, not $runs" >&2; exit 2; }
      runs_given=1
      shift
      ;;
    --fsync)
      fsync=${2:?--fsync needs always or everysec}
      [[ $fsync == always || $fsync == everysec ]] || { echo "run_redis_benchmarks.sh: --fsync always|everysec" >&2; exit 2; }
      shift
      ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "run_redis_benchmarks.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
locks=2000 drain_items=20000 claim_items=5000
if [[ $quick == 1 ]]; then
  locks=200 drain_items=2000 claim_items=500
  [[ $runs_given == 1 || -n ${RUNS:-} ]] || runs=1
fi
B=$BUILD_DIR/benchmarks/redis_bench
PEERS=$BUILD_DIR/peers/redis
NPM_DIR=$ROOT/benchmarks/peers/redis

if [[ $build == 1 ]]; then
  echo "== building redis_bench (Release) in $BUILD_DIR"
  "$ROOT/scripts/install-deps.sh" redis
  bench_build "$BUILD_DIR" redis_bench
  "$ROOT/scripts/install-deps.sh" peers
  echo "== installing redlock, ioredis and BullMQ from $NPM_DIR/package-lock.json into $PEERS (npm ci)"
  mkdir -p "$PEERS"
  cp "$NPM_DIR/package.json" "$NPM_DIR/package-lock.json" "$PEERS/"
  (cd "$PEERS" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
[[ -x $B ]] || { echo "run_redis_benchmarks.sh: no $B (run without --no-build)" >&2; exit 1; }
[[ -d $PEERS/node_modules/bullmq ]] || { echo "run_redis_benchmarks.sh: no BullMQ in $PEERS (run without --no-build)" >&2; exit 1; }
mkdir -p "$OUT"

echo "== starting a throwaway Redis server (appendonly yes, appendfsync $fsync)"
bench_server redis --fsync "$fsync"

results=$OUT/redis.jsonl  # run, med and per (lib.sh) keep and read the rounds there
: >"$results"
peer() { node "$NPM_DIR/bench.js" --modules "$PEERS/node_modules" "$@"; }

echo "== $runs round(s): lock $locks, queue $drain_items items, claim $claim_items keys"
for ((r = 1; r <= runs; r++)); do
  run dibs_lock_1 $r "$B" --bench lock --procs 1 --items $locks
  run redlock_1 $r peer --bench lock --procs 1 --items $locks --retry-delay 5
  run dibs_lock_8 $r "$B" --bench lock --procs 8 --items $locks
  run redlock_8 $r peer --bench lock --procs 8 --items $locks --retry-delay 5
  run dibs_drain $r "$B" --bench drain --way complete_n --procs 8 --items $drain_items --batch 100
  run dibs_pool $r "$B" --bench drain --way pool --procs 1 --threads 50 --items $drain_items --batch 100
  run dibs_pool_two $r "$B" --bench drain --way pool --procs 2 --threads 25 --items $drain_items --batch 100
  run bullmq_1 $r peer --bench drain --procs 1 --items $drain_items --concurrency 50
  run bullmq_2 $r peer --bench drain --procs 2 --items $drain_items --concurrency 50
  run dibs_claim $r "$B" --bench claim --way dibs --items $claim_items
  run hand_claim $r "$B" --bench claim --way hand --items $claim_items
done

best() {  # NAMES...: the name whose median is highest
  local n best_name= best_v=0 v
  for n in "$@"; do
    v=$(med "$n")
    if [[ -n $v ]] && awk -v a="$v" -v b="$best_v" 'BEGIN { exit !(a > b) }'; then best_name=$n best_v=$v; fi
  done
  echo "$best_name"
}
row() {  # FIGURE DIBS_LABEL DIBS_NAME PEER_LABEL PEER_NAME
  local d p
  d=$(med "$3") p=$(med "$5")
  printf '%-28s %-34s %9s   %-30s %9s   %7s   %s\n' "$1" "$2" "${d:--}" "$4" "${p:--}" \
    "$(ratio "$d" "$p")" "$(ratio "$(per "$3" "$5")" 1)"
}
server=$(REDISCLI_AUTH=$(cat "$BENCH_SERVER_DIR/password") redis-cli -p "$(cat "$BENCH_SERVER_DIR/port")" INFO server |
  sed -n 's/^redis_version:\([0-9.]*\).*/\1/p')
dibs_commit=$(git -C "$ROOT" rev-parse --short HEAD)
git -C "$ROOT" diff --quiet HEAD -- include benchmarks 2>/dev/null || dibs_commit="$dibs_commit (with uncommitted changes)"
bull=$(best bullmq_1 bullmq_2)

echo
echo "Medians of $runs round(s), per second; ratio: dibs / the other (of the medians, then the median of the per-round ratios)"
printf '%-28s %-34s %9s   %-30s %9s   %7s   %s\n' figure dibs per-s other per-s ratio per-round
row "lock + unlock, 1 process" "lease_mutex<redis_store>" dibs_lock_1 "redlock, retry every 5 ms" redlock_1
row "lock + unlock, 8 processes" "lease_mutex<redis_store>" dibs_lock_8 "redlock, retry every 5 ms" redlock_8
row "queue, $drain_items no-op items" "8 procs, claim_next_n(100)+complete_n" dibs_drain "BullMQ, best of its two" "$bull"
row "queue, worker_pool" "1 proc, 50 threads, prefetch 100" dibs_pool "BullMQ, best of its two" "$bull"
row "queue, worker_pool x 2" "2 procs x 25 threads" dibs_pool_two "BullMQ, best of its two" "$bull"
row "queue, BullMQ's other setup" "-" none "BullMQ 1 x 50, 2 x 50" "$( [[ $bull == bullmq_1 ]] && echo bullmq_2 || echo bullmq_1)"
row "claim + complete per item" "marker_claim try_claim+complete" dibs_claim "SET NX PX + EVAL, hiredis" hand_claim
echo
echo "Versions: dibs $dibs_commit; redlock $(node -p "require('$PEERS/node_modules/redlock/package.json').version"),"
echo "  ioredis $(node -p "require('$PEERS/node_modules/ioredis/package.json').version"), BullMQ $(node -p "require('$PEERS/node_modules/bullmq/package.json').version") on Node.js $(node --version);"
echo "  Redis $server (scripts/redis.sh: appendonly yes, appendfsync $fsync); results in $results"
