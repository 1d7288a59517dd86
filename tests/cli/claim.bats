#!/usr/bin/env bats
# dibs claim: exactly once under xargs -P4 and SIGKILL chaos; the exit codes.
load helpers

# Keys of the chaos run: 300, fewer under the default and sanitizer presets
# (DIBS_CLI_CLAIM_KEYS, a multiple of 50 up to 950).
keys=${DIBS_CLI_CLAIM_KEYS:-300}

@test "xargs -P4 dibs claim over $keys keys with SIGKILLs: each key completed once, by exactly one journaled run" {
  ((keys % 50 == 0 && keys >= 50 && keys < 1000))
  mkdir claims
  # The handler journals "key token" (one small O_APPEND write: whole).
  # Every 50th key's first run also SIGKILLs its own dibs (its parent): one
  # kill per 50 keys that happens however loaded the machine is, besides the random ones
  # below, which a busy machine can make rare.
  cat > handler <<'SH'
#!/bin/sh
echo "$DIBS_KEY $DIBS_TOKEN" >> journal
case $DIBS_KEY in
  *[05]0) if mkdir "killed.$DIBS_KEY" 2>/dev/null; then kill -KILL "$PPID"; fi ;;
esac
sleep 0.02
SH
  chmod +x handler
  # Each run's exit code, journaled by a wrapper around dibs.
  cat > worker <<'SH'
#!/bin/sh
dibs claim -q dir:claims "$1" -- ./handler
echo "$1 $?" >> codes
SH
  chmod +x worker
  # Passes until every key is done: a key whose dibs was killed is claimable
  # again at once (its worker is provably gone).
  total_killed=0
  for pass in 1 2 3 4 5; do
    seq -f 'key-%03g' 1 "$keys" | xargs -P4 -n1 ./worker &
    xpid=$!
    if [ "$pass" -eq 1 ]; then
      # dibs runs as a child of a worker, itself a child of xargs.
      while kill -0 "$xpid" 2>/dev/null && [ "$total_killed" -lt 25 ]; do
        sleep 0.05
        workers=$(pgrep -P "$xpid" | paste -sd, -)
        [ -n "$workers" ] || continue
        mapfile -t victims < <(pgrep -x dibs -P "$workers")
        ((${#victims[@]})) || continue
        if kill -KILL "${victims[RANDOM % ${#victims[@]}]}" 2>/dev/null; then total_killed=$((total_killed + 1)); fi
      done
    fi
    wait "$xpid" || true
    done_count=$(dibs status --json dir:claims | grep -c '"state": "completed"' || true)
    [ "$done_count" -eq "$keys" ] && break
  done
  own_kills=$(find . -maxdepth 1 -name 'killed.*' | wc -l)
  echo "killed $total_killed dibs processes at random and $own_kills from their handlers; $pass passes" >&3
  [ "$own_kills" -eq $((keys / 50)) ]
  total_killed=$((total_killed + own_kills))
  [ "$done_count" -eq "$keys" ]
  # Each key's completion names its token; exactly one journal line has it.
  dibs status --json dir:claims | sed -n 's/.*"key": "\([^"]*\)".*"result": "exit 0, token \([0-9]*\)".*/\1 \2/p' | sort > completed
  [ "$(wc -l < completed)" -eq "$keys" ]
  sort journal | uniq -d > dup_lines
  [ ! -s dup_lines ]
  sort journal > journal.sorted
  [ "$(comm -12 completed journal.sorted | wc -l)" -eq "$keys" ]
  # Runs whose dibs was killed may have journaled too, with older tokens: at
  # most one per kill.
  extra=$(($(wc -l < journal) - keys))
  echo "journal: $keys completed runs, $extra runs of killed workers" >&3
  [ "$extra" -le "$total_killed" ]
  # Exit codes: 0 (ran and completed), 10 (already completed), 11 (held by
  # another worker), 137 (this dibs was SIGKILLed); at most one 0 per key.
  [ -z "$(awk '$2 != 0 && $2 != 10 && $2 != 11 && $2 != 137' codes)" ]
  [ -z "$(awk '$2 == 0 { print $1 }' codes | sort | uniq -d)" ]
}

@test "claim exit codes: completed 10, held 11, failed for good 12, damaged 13, nothing under --next 14" {
  mkdir c
  run dibs claim dir:c a -- true
  [ "$status" -eq 0 ]
  run dibs claim dir:c a -- true
  [ "$status" -eq 10 ]
  [[ "$output" == *"already completed"* ]]
  dibs claim dir:c b -- sh -c "$HOLD" &
  wait_for_file held
  run dibs claim dir:c b -- true
  [ "$status" -eq 11 ]
  touch release
  wait
  # A failed item waits out its backoff (--retry-after here; by default
  # 0.5-1 s after the first failure): held (11) until then, nothing run.
  run dibs claim --retry-after 1h dir:c w -- sh -c 'exit 3'
  [ "$status" -eq 3 ]
  run dibs claim dir:c w -- sh -c 'echo ran; exit 3'
  [ "$status" -eq 11 ]
  [[ "$output" == *"not claimable for another"* ]]
  [[ "$output" != *"ran"* ]]
  run dibs claim --retry-after 0 --max-attempts 2 dir:c f -- sh -c 'exit 3'
  [ "$status" -eq 3 ]
  run dibs claim --max-attempts 2 dir:c f -- sh -c 'exit 3'
  [ "$status" -eq 3 ]
  run dibs claim --max-attempts 2 dir:c f -- true
  [ "$status" -eq 12 ]
  [[ "$output" == *"failed for good"* ]]
  echo garbage > c/d.rec
  run dibs claim dir:c d -- true
  [ "$status" -eq 13 ]
  run dibs claim --next zzz dir:c -- true
  [ "$status" -eq 14 ]
  run dibs status dir:c
  [[ "$output" == *"5 item(s)"* ]]
}

@test "claim --next hands the key to COMMAND; sqlite: store" {
  mkdir q
  run dibs claim --next job- dir:q -- echo
  [ "$status" -eq 14 ]
  run dibs claim sqlite:"$PWD/q.db" job-1 -- sh -c 'echo "$DIBS_KEY $DIBS_ATTEMPT"'
  [ "$status" -eq 0 ]
  [ "$output" = "job-1 1" ]
  run dibs claim sqlite:"$PWD/q.db" job-1 -- true
  [ "$status" -eq 10 ]
}

@test "a COMMAND that exits 10 is told apart from 'already completed': --exit-base moves dibs's own codes" {
  mkdir c
  # Default codes: the collision is said on standard error; the item was
  # given back, not completed.
  run dibs claim --retry-after 0 dir:c t -- sh -c 'echo ran >> runs; exit 10'
  [ "$status" -eq 10 ]
  [[ "$output" == *"--exit-base"* ]]
  [[ "$(dibs status --json dir:c)" == *'"state": "released", "attempts": 1'* ]]
  # Moved: COMMAND's 10 stays 10, dibs's "already completed" is 200.
  run dibs claim --retry-after 0 --exit-base 200 dir:c t -- sh -c 'echo ran >> runs; exit 10'
  [ "$status" -eq 10 ]
  run dibs claim --exit-base 200 dir:c t -- sh -c 'echo ran >> runs'
  [ "$status" -eq 0 ]
  run dibs claim --exit-base 200 dir:c t -- sh -c 'echo ran >> runs; exit 10'
  [ "$status" -eq 200 ]
  [ "$(wc -l < runs)" -eq 3 ]
  dibs claim dir:c h -- sh -c "$HOLD" &
  wait_for_file held
  run dibs claim --exit-base 200 dir:c h -- true
  [ "$status" -eq 201 ]
  touch release
  wait
  run dibs claim --exit-base 200 --next zzz dir:c -- true
  [ "$status" -eq 204 ]
  # A base whose range meets dibs's errors is refused, naming the range.
  run dibs claim --exit-base 60 dir:c u -- touch ran
  [ "$status" -eq 64 ]
  [[ "$output" == *"60-65"* ]]
  [ ! -e ran ]
}
