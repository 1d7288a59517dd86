#!/usr/bin/env bats
# dibs retry: transient exits retried with backoff, others not; deadline; signals.
load helpers

@test "a command that exits 75 three times, then 0: four runs, exit 0" {
  run dibs retry --initial 10ms -- sh -c 'n=$(cat n 2>/dev/null || echo 0); n=$((n + 1)); echo $n > n; [ $n -ge 4 ] || exit 75'
  [ "$status" -eq 0 ]
  [ "$(cat n)" -eq 4 ]
}

@test "a command that exits 1 is not retried; its status is dibs's" {
  run dibs retry --initial 10ms -- sh -c 'echo x >> runs; exit 1'
  [ "$status" -eq 1 ]
  [ "$(wc -l < runs)" -eq 1 ]
}

@test "--on picks the retried codes; --attempts bounds the runs; the last status is returned" {
  run dibs retry --on 3,4 --attempts 3 --initial 10ms -- sh -c 'echo x >> runs; exit 4'
  [ "$status" -eq 4 ]
  [ "$(wc -l < runs)" -eq 3 ]
}

@test "the deadline is respected" {
  start=$(date +%s%N)
  run dibs retry --attempts 1000 --deadline 1s --initial 100ms --cap 200ms -- sh -c 'exit 75'
  ms=$((($(date +%s%N) - start) / 1000000))
  echo "took $ms ms" >&3
  [ "$status" -eq 75 ]
  [ "$ms" -ge 900 ]
  [ "$ms" -le 20000 ]  # the deadline, plus the last run (a loaded sanitizer run starts sh slowly): wide; 1000 unbounded attempts would take minutes
}

@test "SIGTERM is forwarded to the running command" {
  # COMMAND waits in short foreground sleeps, so that its trap runs within
  # 0.1 s of the signal and leaves no child behind. (It waited on a
  # background 'sleep 30' before: a TERM landing between that fork and $!
  # left the sleep alive, holding bats's output open for 30 s.)
  dibs retry -- sh -c 'trap "echo got > t; exit 3" TERM; touch held; while :; do sleep 0.1; done' &
  pid=$!
  wait_for_file held
  kill -TERM $pid
  rc=0
  wait $pid || rc=$?
  [ "$rc" -eq 3 ]
  [ "$(cat t)" = got ]
}
