#!/usr/bin/env bats
# dibs lock: mutual exclusion under SIGKILL chaos, flock(1) interop, the
# lock's life tied to COMMAND's.
load helpers

# A failed check must not leave the loops running (bats would wait for them).
teardown() {
  touch "$BATS_TEST_TMPDIR/stop"
}

# The critical section, shell builtins only: checks that nobody else is
# inside (the marker is empty), marks itself, increments, checks the mark is
# still its own, journals the increment, clears the mark.
crit='read o < marker; [ -z "$o" ] || echo "enter $$ saw $o" >> overlaps
echo $$ > marker
read n < counter; echo $((n + 1)) > counter
read o < marker; [ "$o" = $$ ] || echo "leave $$ saw $o" >> overlaps
echo $$ >> journal
: > marker'

# Runs of each loop at least: 100, fewer under the default and sanitizer presets
# (DIBS_CLI_LOCK_RUNS); the loops go on until the killer is done anyway.
runs_min=${DIBS_CLI_LOCK_RUNS:-100}

@test "8 loops x $runs_min+ 'dibs lock' increments with SIGKILLs of dibs: counter = increments done, no overlap" {
  echo 0 > counter
  : > marker
  : > overlaps
  : > journal
  pids=()
  # Each loop runs at least runs_min times, and on until the killer is done: the
  # kills land while the loops work, however fast the machine gets through
  # them (a fixed 1,600 could be over before 11 kills).
  for l in 1 2 3 4 5 6 7 8; do
    (
      acked=0
      for ((i = 0; ; i++)); do
        ((i < runs_min)) || [ ! -e stop ] || break
        if dibs lock -w 60s counter.lock -- sh -c "$crit"; then acked=$((acked + 1)); fi
      done
      echo "$acked" > "acked.$l"
      echo "$i" > "runs.$l"
    ) &
    pids+=($!)
  done
  killed=$(kill_random_dibs 20 0.05 "${pids[@]}")
  touch stop
  wait "${pids[@]}"
  echo "killed $killed dibs processes" >&3
  [ "$killed" -ge 20 ]
  # COMMAND is never killed with dibs (it holds the lock itself), so every
  # section that began also finished: the counter counts them exactly.
  read n < counter
  lines=$(wc -l < journal)
  acked=$(cat acked.* | awk '{ s += $1 } END { print s }')
  runs=$(cat runs.* | awk '{ s += $1 } END { print s }')
  echo "counter $n journal $lines acknowledged $acked of $runs runs" >&3
  [ "$n" -eq "$lines" ]
  [ "$acked" -le "$n" ]
  [ "$n" -le "$runs" ]
  [ $((acked + killed)) -ge "$n" ]
  [ ! -s overlaps ]
}

@test "a SIGKILLed dibs leaves the lock with COMMAND until it ends, then the next taker breaks it at once" {
  dibs lock x.lock -- sh -c "$HOLD" &
  wait_for_file held
  kill -KILL $!
  run dibs lock --verbose -n x.lock -- true
  [ "$status" -eq 1 ]
  [[ "$output" == *"is held by pid"* ]]
  touch release
  # Once COMMAND has ended (and been reaped) its pid is gone: the lock is
  # broken on that proof, long before the 10 s lease would run out.
  start=$SECONDS
  run dibs lock -w 8s x.lock -- sh -c 'echo "token $DIBS_TOKEN"'
  echo "$output" >&3
  [ "$status" -eq 0 ]
  [[ "$output" =~ token\ [0-9]+ ]]
  [ $((SECONDS - start)) -le 6 ]
}

@test "COMMAND's status is dibs's; -E sets the conflict code; a signal-killed COMMAND gives 128+N" {
  run dibs lock x.lock -- sh -c 'exit 7'
  [ "$status" -eq 7 ]
  run dibs lock x.lock -- sh -c 'kill -TERM $$'
  [ "$status" -eq 143 ]
  dibs lock x.lock -- sh -c "$HOLD" &
  wait_for_file held
  run dibs lock -n -E 42 x.lock -- true
  [ "$status" -eq 42 ]
  run dibs lock --verbose -w 200ms x.lock -- true
  [ "$status" -eq 1 ]
  [[ "$output" == *"--wait ran out"* ]]
  touch release
  wait
}

@test "SIGTERM to dibs lock is forwarded to COMMAND" {
  # Short foreground sleeps: the trap runs within 0.1 s and leaves no child
  # holding bats's output (as in retry.bats).
  dibs lock x.lock -- sh -c 'trap "echo got > t; exit 3" TERM; touch held; while :; do sleep 0.1; done' &
  pid=$!
  wait_for_file held
  kill -TERM $pid
  rc=0
  wait $pid || rc=$?
  [ "$rc" -eq 3 ]
  [ "$(cat t)" = got ]
}

@test "--kernel and flock(1) exclude each other, both ways" {
  flock x.lock sh -c "$HOLD" &
  wait_for_file held
  run dibs lock --kernel -n x.lock -- true
  [ "$status" -eq 1 ]
  touch release
  wait
  rm held release
  run dibs lock --kernel -n x.lock -- true
  [ "$status" -eq 0 ]

  dibs lock --kernel x.lock -- sh -c "$HOLD" &
  wait_for_file held
  run flock -n x.lock true
  [ "$status" -eq 1 ]
  touch release
  wait
  run flock -n x.lock true
  [ "$status" -eq 0 ]
}

@test "--kernel: as with flock(1), COMMAND keeps the lock if dibs is SIGKILLed" {
  dibs lock --kernel x.lock -- sh -c "$HOLD" &
  wait_for_file held
  kill -KILL $!
  wait $! || true
  run flock -n x.lock true
  [ "$status" -eq 1 ]
  touch release
  wait_for_kernel_free x.lock
}

@test "dibs status of a lock file: table and --json while held, free after" {
  dibs lock x.lock -- sh -c "$HOLD" &
  wait_for_file held
  run dibs status x.lock
  [ "$status" -eq 0 ]  # held
  [[ "${lines[0]}" == *HOST*PID*SINCE*LEASE*LEFT*TOKEN* ]]
  run dibs status --json x.lock
  [ "$status" -eq 0 ]
  [[ "$output" == *'"held": true'*'"token": '* ]]
  touch release
  wait
  run dibs status x.lock
  [ "$output" = "x.lock: free" ]
  [ "$status" -eq 1 ]  # free
  run dibs status --json x.lock
  [ "$status" -eq 1 ]
}

@test "a COMMAND that ends at once leaves the lock free (dibs removes the record even then)" {
  # 20 times, fewer where the loops are shorter (8 under the sanitizers).
  for ((i = 0; i < (runs_min < 20 ? runs_min : 20); i++)); do
    dibs lock x.lock -- true
    run dibs status x.lock
    [ "$output" = "x.lock: free" ]
  done
}

@test "dibs status of a kernel lock file says what it cannot tell, and where to look" {
  dibs lock --kernel k.lock -- true
  run dibs status k.lock
  [ "$status" -eq 65 ]
  [[ "$output" == *"fuser -v k.lock"* ]]
}

# status_is FILE STATE: dibs status shows FILE's holder in STATE (the table's last column).
status_is() { dibs status "$1" | sed -n 2p | grep -q " $2\$"; }

@test "dibs status says what the next taker would do: free if the holder is gone, held with pid/host/token, expired if stopped" {
  host=$(hostname)
  # Held: a live COMMAND holds it (the record names COMMAND's pid).
  # COMMAND writes its own pid, then holds until ./release: a `sleep 30`
  # could end before a loaded machine looked, and a pgrep for it could run
  # before sh had exec'd it.
  dibs lock --lease 30s x.lock -- sh -c "echo \$\$ > cpid.new; mv cpid.new cpid; $HOLD" &
  dpid=$!
  wait_for_file held
  cpid=$(cat cpid)
  run dibs status x.lock
  [ "$status" -eq 0 ]
  echo "$output" >&3
  [[ "${lines[1]}" =~ ^$host\ +$cpid\ +.*\ +[0-9]+\ +held$ ]]
  run dibs status --json x.lock
  [[ "$output" == *'"state": "held", "held": true, "gone": false'*"\"pid\": $cpid"* ]]
  # Gone: dibs and COMMAND SIGKILLed; the record stays, naming a dead pid.
  kill -KILL "$dpid" "$cpid"
  wait "$dpid" || true
  grep -qx "pid $cpid" x.lock
  run dibs status x.lock
  echo "$output" >&3
  [[ "$output" == "x.lock: free: its holder, pid $cpid on $host (token "*"), is gone; the next lock breaks it at once" ]]
  [ "$status" -eq 1 ]  # free: its holder is gone
  run dibs status --json x.lock
  [[ "$output" == *'"state": "free", "held": false, "gone": true'* ]]
  # Expired: the renewing dibs is stopped (its COMMAND lives on), past its lease.
  rm held cpid
  # A lease of 3 s: dibs renews it every second, so it holds until stopped
  # even where every dibs is slow (the tsan preset; a 1 s lease was lost
  # there before the stop, and the record was gone).
  dibs lock --lease 3s y.lock -- sh -c "echo \$\$ > cpid.new; mv cpid.new cpid; $HOLD" &
  dpid=$!
  wait_for_file held
  cpid=$(cat cpid)
  kill -STOP "$dpid"
  # Past the lease: waited for by its evidence, the status saying so.
  wait_until "y.lock was never shown expired" status_is y.lock expired
  run dibs status y.lock
  echo "$output" >&3
  code=$status
  kill -CONT "$dpid"
  # Continued, dibs may find its lease lost and end on its own (stopping
  # COMMAND) before this SIGTERM comes.
  kill -TERM "$dpid" 2>/dev/null || true
  wait "$dpid" || true
  touch release  # a COMMAND the SIGTERM missed
  [[ "${lines[1]}" == *" expired" ]]
  [[ "${lines[2]}" == "y.lock: expired: pid $cpid on $host stopped renewing"* ]]
  [ "$code" -eq 2 ]  # expired
}
