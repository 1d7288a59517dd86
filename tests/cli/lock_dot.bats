#!/usr/bin/env bats
# dibs lock --dot: the presence lock against dotlockfile(1) and lockfile(1)
# (procmail), both ways and under SIGKILLs of dibs; lockfile(1)'s options.
load helpers

# A failed check must not leave a HOLD holder running: bats would wait for it.
teardown() {
  touch "$BATS_TEST_TMPDIR/release"
}

@test "--dot and dotlockfile, lockfile(1) exclude each other both ways; their exit codes and dibs's (-E to match)" {
  dibs lock --dot x.lock sh -c "$HOLD" &
  wait_for_file held
  run dotlockfile -p -r 0 x.lock
  [ "$status" -eq 4 ]  # L_MAXTRYS: held
  run lockfile -r 0 x.lock
  [ "$status" -eq 73 ]
  touch release
  wait
  [ ! -e x.lock ]  # removed once COMMAND ended

  dotlockfile -p -r 0 x.lock
  run dibs lock --dot --verbose -n x.lock true
  [ "$status" -eq 1 ]
  [[ "$output" == *"'x.lock' is held (its lock file exists, pid $$)"* ]]
  run dibs lock --dot -r 0 -E 4 x.lock true
  [ "$status" -eq 4 ]
  dotlockfile -u x.lock
  lockfile -r 0 x.lock
  run dibs lock --dot -n -E 73 x.lock true
  [ "$status" -eq 73 ]
  rm -f x.lock
  run dibs lock --dot -n x.lock sh -c 'head -n 1 x.lock; echo "${DIBS_TOKEN:-no token}"'
  [ "$status" -eq 0 ]
  [ "${lines[1]}" = "no token" ]
  [[ "${lines[0]}" =~ ^[0-9]+$ ]]
}

@test "--dot -r N -i PAUSE: N retries PAUSE apart, then exit 1; -r -1 waits until the lock is free" {
  echo 0 > x.lock  # a foreign lock, held (dotlockfile without -p writes 0)
  start=$(date +%s%N)
  run dibs lock --dot -r 2 -i 0.4 x.lock echo never
  [ "$status" -eq 1 ]
  [ "$output" != never ]
  [ $(( ($(date +%s%N) - start) / 1000000 )) -ge 800 ]
  run dibs lock --dot -r 3 -i5 -w 0.3 x.lock true  # -w bounds the retries too
  [ "$status" -eq 1 ]
  dibs lock --dot -pi 0.1 -r -1 x.lock sh -c 'echo ran > ran' &
  waiter=$!
  sleep 0.3
  [ ! -e ran ]
  rm x.lock
  wait "$waiter"
  [ "$(cat ran)" = ran ]
}

@test "--dot -l: a foreign lock older than -l is broken; a live dibs holder's is not, however old its file looks" {
  echo 0 > x.lock
  touch -d '10 seconds ago' x.lock
  run dibs lock --dot -l 5 -n x.lock echo broke
  [ "$status" -eq 0 ]
  [ "$output" = broke ]
  dibs lock --dot x.lock sh -c "$HOLD" &
  wait_for_file held
  touch -d '1 minute ago' x.lock  # as if its holder were paused; it is alive
  run dibs lock --dot -l 1 -n x.lock true
  [ "$status" -eq 1 ]
  touch release
  wait
}

@test "--dot: a SIGKILLed dibs leaves the lock with COMMAND (dotlockfile -p sees it live); once COMMAND ends it is broken on proof" {
  dibs lock --dot x.lock sh -c "echo \$\$ > cpid; $HOLD" &
  dpid=$!
  wait_for_file held
  [ "$(head -n 1 x.lock)" = "$(cat cpid)" ]
  kill -KILL "$dpid"
  wait "$dpid" || true
  run dotlockfile -p -r 0 x.lock
  [ "$status" -eq 4 ]
  run dibs lock --dot -n x.lock true
  [ "$status" -eq 1 ]
  touch release
  start=$SECONDS
  run dibs lock --dot -w 10s x.lock echo next
  [ "$status" -eq 0 ]
  [ "$output" = next ]
  [ $((SECONDS - start)) -le 8 ]
}

# The critical section: checks nobody else is inside, increments, journals
# its side ($1), clears its mark. It lasts 30 ms or more, so that a lock lost
# while COMMAND runs (a killed dibs's, if it named dibs) shows as an overlap.
crit() {
  cat > crit.sh << 'EOF'
read o < marker; [ -z "$o" ] || echo "enter $$ saw $o" >> overlaps
echo $$ > marker
read n < counter
sleep 0.03
echo $((n + 1)) > counter
read o < marker; [ "$o" = $$ ] || echo "leave $$ saw $o" >> overlaps
echo "$1" >> journal
: > marker
EOF
}

@test "dotlockfile and dibs lock --dot loops increment one counter under SIGKILLs of dibs: counter = sections run, no overlap" {
  crit
  echo 0 > counter
  : > marker
  : > overlaps
  : > journal
  dots=()
  for l in 1 2; do
    (
      for ((i = 0; i < 8; i++)); do
        # No -p: a dead dibs holder's lock is left to the dibs waiters, which
        # break it on proof (dotlockfile -p would unlink it, a race the
        # dot_lock header describes).
        dotlockfile -r 200 -i 1 counter.lock sh crit.sh dotlockfile || echo "dotlockfile failed: $?" >> failures
      done
    ) &
    dots+=($!)
  done
  pids=()
  # Each dibs loop runs at least 25 times (DIBS_CLI_DOT_RUNS: fewer under the
  # sanitizer presets), and on until the killer is done: the kills land
  # while they work, however fast the machine is.
  local runs_min=${DIBS_CLI_DOT_RUNS:-25}
  for l in 1 2 3 4; do
    (
      acked=0
      for ((i = 0; ; i++)); do
        ((i < runs_min)) || [ ! -e stop ] || break
        if dibs lock --dot -w 60s counter.lock sh crit.sh dibs; then acked=$((acked + 1)); fi
      done
      echo "$acked" > "acked.$l"
    ) &
    pids+=($!)
  done
  killed=$(kill_random_dibs 6 0.1 "${pids[@]}")
  touch stop
  wait "${pids[@]}"
  # A record of a dibs killed late names a COMMAND that has ended: a dibs
  # breaks it on proof, so that the dotlockfile loops can finish.
  dibs lock --dot -w 20s counter.lock true
  wait "${dots[@]}"
  read n < counter
  lines=$(wc -l < journal)
  acked=$(cat acked.* | awk '{ s += $1 } END { print s }')
  by_dot=$(grep -c dotlockfile journal || true)
  echo "killed $killed, counter $n, journal $lines, dibs acknowledged $acked, dotlockfile sections $by_dot" >&3
  [ "$killed" -ge 6 ]
  [ ! -e failures ]
  [ "$by_dot" -eq 16 ]
  [ "$n" -eq "$lines" ]
  [ "$acked" -le $((n - by_dot)) ]
  [ $((acked + killed)) -ge $((n - by_dot)) ]
  [ ! -s overlaps ]
  [ ! -e counter.lock ]
}

@test "dibs status of a presence lock: held by COMMAND's pid, free once that is gone, another tool's held" {
  host=$(hostname)
  dibs lock --dot x.lock sh -c "echo \$\$ > cpid; $HOLD" &
  dpid=$!
  wait_for_file held
  cpid=$(cat cpid)
  run dibs status x.lock
  [ "$status" -eq 0 ]
  [ "$output" = "x.lock: held: a presence lock (dibs lock --dot) of pid $cpid on $host" ]
  kill -KILL "$dpid"
  wait "$dpid" || true
  touch release
  # COMMAND ends once it sees ./release (a zombie counts as gone).
  for ((i = 0; i < 400; i++)); do
    run dibs status --json x.lock
    [[ "$output" == *'"state": "free"'* ]] && break
    sleep 0.05
  done
  [[ "$output" == *'"state": "free", "held": false, "gone": true, "dibs": true'*"\"pid\": $cpid"* ]]
  [ "$status" -eq 1 ]  # free
  run dibs lock --dot -n x.lock true
  [ "$status" -eq 0 ]
  dotlockfile -p -r 0 x.lock
  run dibs status x.lock
  [ "$output" = "x.lock: held: a presence lock of another tool (dotlockfile, lockfile(1), O_EXCL), pid $$; dibs lock --dot breaks it only once it is older than -l (5m by default)" ]
  [ "$status" -eq 0 ]  # held
  dotlockfile -u x.lock
}
