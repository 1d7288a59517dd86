# Shared by the benchmark runners (run_*_benchmarks.sh): source it, after
# `set -euo pipefail`.
#
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#   bench_build "$BUILD_DIR" pg_claims            # Release build of the targets
#   bench_server pg --durable                     # throwaway server, stopped at exit
#   ... | field items_per_s | median
#   ratio "$dibs" "$hand"                         # dibs/hand, 2 decimals
#   results=FILE; run NAME ROUND COMMAND...; med NAME; per A B   # rounds of ways

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# median: the median of the numbers on standard input, one per line (the
# mean of the middle two if their count is even).
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# field NAME: the value of "NAME": in each JSON line on standard input (the
# benchmarks print one flat object per run).
field() { sed -n "s/.*\"$1\": \"\{0,1\}\([0-9.a-z-]*\).*/\1/p"; }

# ratio A B: A / B with two decimals ("-" if either is missing or B is 0).
ratio() { awk -v a="${1:-}" -v b="${2:-}" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "-"; else printf "%.2f\n", a / b }'; }

# bench_build DIR TARGET...: configures DIR as a Release build of the
# benchmarks only (no tests, examples or consumers) and builds the targets,
# installing missing Debian packages first.
bench_build() {
  local dir=$1
  shift
  "$ROOT/scripts/install-deps.sh"
  cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDIBS_BUILD_BENCHMARKS=ON -DDIBS_BUILD_TESTS=OFF \
    -DDIBS_BUILD_EXAMPLES=OFF -DDIBS_TEST_CONSUMERS=OFF >/dev/null
  cmake --build "$dir" --target "$@"
}

# bench_server pg|imap|redis [ARGS...]: starts a throwaway server of
# scripts/pg.sh, scripts/imap.sh or scripts/redis.sh on loopback, exports how
# to reach it (DIBS_PG_CONNINFO, the DIBS_IMAP_* variables, DIBS_REDIS_URL), and stops and removes it when the shell exits.
bench_server() {
  local kind=$1
  shift
  BENCH_SERVER_DIR=$(mktemp -d "${TMPDIR:-/tmp}/dibs-bench-$kind.XXXXXX")
  BENCH_SERVER_KIND=$kind
  trap '"$ROOT/scripts/$BENCH_SERVER_KIND.sh" stop "$BENCH_SERVER_DIR" >/dev/null 2>&1; rm -rf "$BENCH_SERVER_DIR"' EXIT
  "$ROOT/scripts/$kind.sh" start "$BENCH_SERVER_DIR" "$@" >/dev/null
  case $kind in
    pg) DIBS_PG_CONNINFO=$(cat "$BENCH_SERVER_DIR/conninfo"); export DIBS_PG_CONNINFO ;;
    redis) DIBS_REDIS_URL=$(cat "$BENCH_SERVER_DIR/url"); export DIBS_REDIS_URL ;;
    imap)
      set -a
      # shellcheck disable=SC1091
      . "$BENCH_SERVER_DIR/env"
      set +a
      ;;
  esac
}

# The rounds of a runner that runs each way once a round (run_queue_peers.sh,
# run_redis_benchmarks.sh). Set `results` to a file first.
# run NAME ROUND COMMAND...: runs one way, checks it printed its object
# (with "items_per_s"), tags it with the row name and round, and keeps it
# in $results.
run() {
  local name=$1 round=$2 line
  shift 2
  line=$("$@")
  [[ $line == *'"items_per_s"'* ]] || { echo "$(basename "$0"): $name printed no result: $line" >&2; exit 1; }
  line=${line%\}}", \"name\": \"$name\", \"round\": $round}"
  echo "$line" | tee -a "$results"
}
# med NAME: the median items_per_s of NAME's rounds.
med() { grep "\"name\": \"$1\"" "$results" | field items_per_s | median; }
# per A B: the median over rounds of A / B within a round (the two ran
# seconds apart, so the machine's load drifts less between them).
per() {
  grep -E "\"name\": \"($1|$2)\"" "$results" |
    sed -n 's/.*"items_per_s": \([0-9.]*\).*"name": "\([a-z_0-9]*\)", "round": \([0-9]*\).*/\3 \2 \1/p' |
    awk -v a="$1" -v b="$2" '$2 == a { x[$1] = $3 } $2 == b { y[$1] = $3 }
      END { for (r in x) if (r in y && y[r] > 0) print x[r] / y[r] }' | median
}
