#!/usr/bin/env bash
# run_queue_peers.sh: dibs's PostgreSQL queue (marker_claim<postgres_store>)
# beside graphile-worker, the Node.js job queue a user might take instead,
# on one throwaway durable PostgreSQL 15 (scripts/pg.sh --durable), in one
# run: each round runs dibs drain, graphile-worker drain, dibs enqueue,
# graphile-worker enqueue, `runs` rounds; prints the medians, the ratio
# dibs / graphile-worker of the medians (and the median of the per-round
# ratios), the versions and the settings.
#
#   benchmarks/run_queue_peers.sh [--quick] [--no-build] [--runs N]
#
# drain: 20,000 no-op items queued beforehand (not timed). dibs: P worker
#   processes (pg_claims --bench drain), each looping claim_next_n(N) +
#   complete(), and once more with complete_n of each batch; then
#   dibs::worker_pool drained, as graphile-worker is set up (1 process, 24
#   handler threads, a local queue of 500) and as 2 processes x 12; from
#   the first claim to the last completion (the pool: to drain()'s return,
#   one empty claim later). graphile-
#   worker: one Node.js runner with its docs' throughput settings
#   (benchmarks/peers/graphile/bench.js says which and why); from the first
#   job's start to an empty jobs table.
# enqueue: 10,000 new items from one process. dibs: offer() one by one,
#   and marker_claim::offer_n in calls of 1,000 and of all 10,000.
#   graphile-worker: addJobs, one call of all 10,000 (its docs' figure) and
#   calls of 1,000.
# Every run uses a table (dibs) or schema (graphile-worker) of its own,
# dropped at its end.
#
# --quick: one round of 2,000 and 1,000 items (a check that it all runs).
# --no-build: use the pg_claims and the graphile-worker install already in
#   BUILD_DIR. --runs N: rounds (default 3).
# Environment: BUILD_DIR (default <repo>/build/bench-pg), OUT (default
# $BUILD_DIR/results), PROCS (dibs drain workers, default 8), BATCH (dibs
# drain's N, default 100).
# Needs Node.js and npm (scripts/install-deps.sh peers installs them where
# there are none); npm fetches graphile-worker, at the version of
# benchmarks/peers/graphile/package-lock.json, into BUILD_DIR/peers/graphile.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-pg}
OUT=${OUT:-$BUILD_DIR/results}
quick=0 build=1 runs=${RUNS:-3} runs_given=0
while (($#)); do
  case $1 in
    --quick) quick=1 ;;
    --no-build) build=0 ;;
    --runs)
      runs=${2:?--runs needs a number}
      [[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "run_queue_peers.sh: --runs takes a positive number, not $runs" >&2; exit 2; }
      runs_given=1
      shift
      ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "run_queue_peers.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
procs=${PROCS:-8} batch=${BATCH:-100} drain_items=20000 enqueue_items=10000 chunk=1000
if [[ $quick == 1 ]]; then
  drain_items=2000 enqueue_items=1000 chunk=100
  [[ $runs_given == 1 || -n ${RUNS:-} ]] || runs=1
fi
B=$BUILD_DIR/benchmarks/pg_claims
PEERS=$BUILD_DIR/peers/graphile
GW=$ROOT/benchmarks/peers/graphile

if [[ $build == 1 ]]; then
  echo "== building pg_claims (Release) in $BUILD_DIR"
  bench_build "$BUILD_DIR" pg_claims
  "$ROOT/scripts/install-deps.sh" peers
  echo "== installing graphile-worker from $GW/package-lock.json into $PEERS (npm ci)"
  mkdir -p "$PEERS"
  cp "$GW/package.json" "$GW/package-lock.json" "$PEERS/"
  (cd "$PEERS" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
[[ -x $B ]] || { echo "run_queue_peers.sh: no $B (run without --no-build)" >&2; exit 1; }
[[ -d $PEERS/node_modules/graphile-worker ]] || { echo "run_queue_peers.sh: no graphile-worker in $PEERS (run without --no-build)" >&2; exit 1; }
mkdir -p "$OUT"

echo "== starting a throwaway PostgreSQL server (durable: fsync and synchronous commit on)"
bench_server pg --durable

results=$OUT/queue_peers.jsonl  # run, med and per (lib.sh) keep and read the rounds there
: >"$results"
gw() { node "$GW/bench.js" --modules "$PEERS/node_modules" "$@"; }

echo "== $runs round(s): drain $drain_items items, enqueue $enqueue_items items"
for ((r = 1; r <= runs; r++)); do
  run dibs_drain $r "$B" --bench drain --way dibs --procs "$procs" --items $drain_items --batch "$batch"
  run gw_drain $r gw --bench drain --items $drain_items
  run dibs_drain_complete_n $r "$B" --bench drain --way complete_n --procs "$procs" --items $drain_items --batch "$batch"
  run dibs_pool $r "$B" --bench drain --way pool --procs 1 --threads 24 --items $drain_items --batch 500
  run dibs_pool_renew $r "$B" --bench drain --way pool_renew --procs 1 --threads 24 --items $drain_items --batch 500
  run dibs_pool_two $r "$B" --bench drain --way pool --procs 2 --threads 12 --items $drain_items --batch 250
  run dibs_offer $r "$B" --bench enqueue --way dibs --items $enqueue_items
  run dibs_offer_n_chunk $r "$B" --bench enqueue --way offer_n --items $enqueue_items --batch $chunk
  run dibs_offer_n_all $r "$B" --bench enqueue --way offer_n --items $enqueue_items
  run gw_add_all $r gw --bench enqueue --items $enqueue_items
  run gw_add_chunk $r gw --bench enqueue --items $enqueue_items --batch $chunk
done

row() {  # FIGURE DIBS_LABEL DIBS_NAME GW_LABEL GW_NAME
  local d g
  d=$(med "$3") g=$(med "$5")
  printf '%-30s %-34s %9s   %-30s %9s   %7s   %s\n' "$1" "$2" "${d:--}" "$4" "${g:--}" \
    "$(ratio "$d" "$g")" "$(ratio "$(per "$3" "$5")" 1)"
}
gw_version=$(node -p "require('$PEERS/node_modules/graphile-worker/package.json').version")
pg_version=$(node -p "require('$PEERS/node_modules/pg/package.json').version")
server=$(psql "$DIBS_PG_CONNINFO" -tAc 'SHOW server_version')
dibs_commit=$(git -C "$ROOT" rev-parse --short HEAD)
git -C "$ROOT" diff --quiet HEAD -- include benchmarks 2>/dev/null || dibs_commit="$dibs_commit (with uncommitted changes)"

echo
echo "Medians of $runs round(s), items (jobs) per second; ratio: dibs / graphile-worker"
echo "(of the medians, then the median of the per-round ratios)"
printf '%-30s %-34s %9s   %-30s %9s   %7s   %s\n' figure dibs items/s graphile-worker jobs/s ratio per-round
row "drain $drain_items no-op items" "$procs procs, claim_next_n($batch)" dibs_drain \
  "1 proc, 24 at once, local 500" gw_drain
row "drain, completions batched" "$procs procs, + complete_n" dibs_drain_complete_n \
  "1 proc, 24 at once, local 500" gw_drain
row "drain, worker_pool" "1 proc, 24 threads, prefetch 500" dibs_pool \
  "1 proc, 24 at once, local 500" gw_drain
row "drain, worker_pool, renewing" "the same, claims renewed" dibs_pool_renew \
  "1 proc, 24 at once, local 500" gw_drain
row "drain, worker_pool x 2" "2 procs x 12 threads, prefetch 250" dibs_pool_two \
  "1 proc, 24 at once, local 500" gw_drain
row "enqueue $enqueue_items items" "offer() one by one" dibs_offer "addJobs, one call" gw_add_all
row "enqueue $enqueue_items, batches" "offer_n, $chunk a call" dibs_offer_n_chunk "addJobs, $chunk a call" gw_add_chunk
row "enqueue $enqueue_items, one batch" "offer_n, one call" dibs_offer_n_all "addJobs, one call" gw_add_all
echo
echo "Versions: dibs $dibs_commit; graphile-worker $gw_version (node-postgres $pg_version) on Node.js $(node --version);"
echo "  PostgreSQL $server (scripts/pg.sh --durable); results in $results"
echo "Settings: dibs: marker_claim<postgres_store>, renew off (on in the renewing row), claim_next_n($batch) per worker process;"
echo "  graphile-worker: concurrentJobs 24, maxPoolSize 25, localQueue.size 500, completeJobBatchDelay 0,"
echo "  failJobBatchDelay 0, prepared statements on (its default): the configuration of its docs' figures"
echo "  (worker.graphile.org/docs/performance)"
