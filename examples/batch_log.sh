#!/usr/bin/env bash
# batch_log.sh: the batch jobs' log, the old way and with `dibs log`, under
# the same load, with the line counts of both.
#
#   examples/batch_log.sh [JOBS] [LINES] [TIMEOUT_MS]     (8 jobs x 200 lines, 500 ms)
#
# The old way (dibs's third problem): each job takes an exclusive lock file
# (created with noclobber, i.e. O_EXCL), sleeps 50 ms between tries, and
# after TIMEOUT_MS gives up and drops the line; a job killed while it holds
# the lock file leaves it behind, and every later line is dropped.
# The dibs way is one line: every line is appended whole and once, however
# many jobs write, and a killed writer blocks nobody.
set -euo pipefail
jobs=${1:-8}
lines=${2:-200}
timeout_ms=${3:-500}
dibs=${DIBS:-dibs}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# --- the old way: 12 lines ---------------------------------------------------
old_log() {  # LOG LINE: returns 1 if the line was dropped
  local waited=0
  until (set -C; : > "$1.lock") 2>/dev/null; do
    sleep 0.05
    waited=$((waited + 50))
    if ((waited >= timeout_ms)); then return 1; fi  # timed out: the line is lost
  done
  printf '%s\n' "$2" >> "$1"
  rm -f "$1.lock"
}

# --- the dibs way: 1 line ----------------------------------------------------
new_log() { "$dibs" log "$1" "$2"; }

run() {  # WAY LOG
  local j
  for ((j = 1; j <= jobs; j++)); do
    (
      for ((i = 1; i <= lines; i++)); do
        "$1" "$2" "job $j line $i: $(date +%T.%N)" || true
      done
    ) &
  done
  wait
}

expected=$((jobs * lines))
start=$EPOCHREALTIME
run old_log "$dir/old.log"
old_s=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
start=$EPOCHREALTIME
run new_log "$dir/new.log"
new_s=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
old_n=$(wc -l < "$dir/old.log")
new_n=$(wc -l < "$dir/new.log")
printf '%d jobs x %d lines = %d lines expected\n' "$jobs" "$lines" "$expected"
printf '  lock file + 50 ms sleeps + %d ms timeout: %5d lines (%d dropped) in %s s\n' "$timeout_ms" "$old_n" \
  $((expected - old_n)) "$old_s"
printf '  dibs log:                                %5d lines (%d dropped) in %s s\n' "$new_n" $((expected - new_n)) "$new_s"
if [ "$new_n" -eq "$expected" ]; then echo "dibs log: all $expected lines present"; else exit 1; fi
