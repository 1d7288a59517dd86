#!/usr/bin/env bats
# dibs lock as a drop-in for flock(1): util-linux's own flock test cases
# (tests/ts/flock/{flock,close,unlock}), adapted to hold until released
# instead of sleeping, with their expectations, run against `dibs lock
# --kernel` and against flock(1) itself (so the expectations are flock's);
# then flock(1)'s options and the forms the lease lock refuses.
load helpers

# A failed check must not leave a HOLD holder running: bats would wait for it.
teardown() {
  touch "$BATS_TEST_TMPDIR/release"
}

# flock_cases LOCKER...: util-linux's flock cases (the flock(2) API) against
# LOCKER ("flock" or "dibs lock --kernel"). A shared holder holds lockfile
# until ./release exists; each case checks its exit code, as do_lock does.
flock_cases() {
  : > out
  "$@" --shared lockfile bash -c "echo 'Locking'; $HOLD; echo 'Unlocking'" >> out 2>&1 &
  holder=$!
  wait_for_file held

  # non-block: an exclusive lock over a shared one is refused with -E's code.
  run "$@" --nonblocking --conflict-exit-code 123 lockfile echo "You will never see this!"
  [ "$status" -eq 123 ]
  [[ "$output" != *"never see"* ]]
  # no-fork: the same, without a child.
  run "$@" --no-fork --nonblocking --conflict-exit-code 123 lockfile echo "You will never see this!"
  [ "$status" -eq 123 ]
  # shared: a second shared holder gets it.
  run "$@" --shared lockfile echo "Have shared lock"
  [ "$status" -eq 0 ]
  [ "$output" = "Have shared lock" ]
  # exclusive: as non-block, with -x written out (and --nb).
  run "$@" --nb --exclusive --conflict-exit-code 123 lockfile echo "You will never see this!"
  [ "$status" -eq 123 ]
  # fd: the descriptor form, on a descriptor of the calling shell (one bash
  # chooses free, not a number assumed free); no file of its number is made.
  exec {fd}<> lockfile
  run "$@" --nonblocking --exclusive --conflict-exit-code 123 "$fd"
  exec {fd}>&-
  [ "$status" -eq 123 ]
  [ ! -e "$fd" ]
  # timeout: -w waits for the shared holder to end, then runs. Its COMMAND
  # says whether the holder was already told to end when it ran: only a
  # locker that waited can see ./release.
  "$@" --timeout 20 --conflict-exit-code 5 lockfile sh -c '[ -e release ] && echo "After timeout."' >> out 2>&1 &
  waiter=$!
  # The waiter is blocked in flock(2) behind the holder before the holder is
  # told to end (a fixed pause could end before a loaded machine started it).
  wait_until "the -w locker did not wait in flock(2)" flock_waiter lockfile
  touch release
  rc=0
  wait "$waiter" || rc=$?
  [ "$rc" -eq 0 ]
  wait "$holder"
  # time-check, as an order: the waiter ran after the holder unlocked.
  echo "Unlocked" >> out
  run cat out
  [ "$output" = $'Locking\nUnlocking\nAfter timeout.\nUnlocked' ]
}

@test "util-linux's flock cases (shared, non-block, no-fork, exclusive, fd, timeout) against flock(1) itself" {
  flock_cases flock
}

@test "util-linux's flock cases (shared, non-block, no-fork, exclusive, fd, timeout) against dibs lock --kernel" {
  flock_cases dibs lock --kernel
}

@test "util-linux's close case: with -o COMMAND does not inherit the descriptor (EX_DATAERR, 65), without it does (0)" {
  exec {fd}<> lock
  run dibs lock --kernel --exclusive --close --fd "$fd" --command "dibs lock --kernel --exclusive --nonblock --fd $fd true"
  [ "$status" -eq 65 ]
  [[ "$output" == "dibs lock: descriptor $fd: Bad file descriptor"* ]]
  run dibs lock --kernel --exclusive --fd "$fd" --command "dibs lock --kernel --exclusive --nonblock --fd $fd true"
  [ "$status" -eq 0 ]
  exec {fd}>&-
}

# unlock_case LOCKER...: util-linux's unlock case; prints its output with
# the times and the program's name taken out.
# The descriptor cases let bash choose the descriptor ({fd}), not util-linux's
# fixed 10: bash keeps its own saved descriptors at 10 and up ("may conflict
# with file descriptors the shell uses internally", bash(1)), and in a CI run
# fd 10 came out wrong for flock(1) itself; a fixed 9 assumes bats left it free.
unlock_case() {
  local fd
  exec {fd}<> lock
  {
    "$@" --exclusive --nonblock --verbose "$fd"
    "$@" --unlock "$fd"
    # -w 0 is -n: it gets the lock only because -u unlocked the descriptor.
    "$@" --exclusive --wait 0 --verbose lock true
  } > out 2>&1
  exec {fd}>&-
  sed -E -e 's/took [0-9]+\.[0-9]{6} seconds/took <n> seconds/' -e 's/^(flock|dibs lock): /LOCKER: /' out
}

@test "util-linux's unlock case: -u unlocks the descriptor, -w 0 is -n, --verbose says the same as flock(1)" {
  expected=$'LOCKER: getting lock took <n> seconds\nLOCKER: getting lock took <n> seconds\nLOCKER: executing true'
  run unlock_case flock
  [ "$output" = "$expected" ]
  run unlock_case dibs lock --kernel
  [ "$output" = "$expected" ]
}

@test "options end at COMMAND, as with flock(1): 'dibs lock PATH ls -la' runs ls -la, for every lock" {
  mkdir d
  touch d/.hidden
  for mode in "" --kernel --dot; do
    run dibs lock $mode "x$mode.lock" ls -la d
    [ "$status" -eq 0 ]
    [[ "$output" == *" .hidden"* ]]
  done
}

@test "-c STRING runs through the shell, after PATH (flock's form) or before it; the lease lock's token is in it" {
  run dibs lock x.lock -c 'echo $((6 * 7)) ${DIBS_TOKEN:+token}'
  [ "$status" -eq 0 ]
  [ "$output" = "42 token" ]
  run dibs lock -c 'exit 9' x.lock
  [ "$status" -eq 9 ]
  run dibs lock --kernel x.lock --command 'echo "$DIBS_LOCK_FD" | grep -qx "[0-9][0-9]*"'
  [ "$status" -eq 0 ]
  run dibs lock x.lock -c echo two words
  [ "$status" -eq 64 ]
  [[ "$output" == *"exactly one argument"* ]]
}

@test "-s: shared kernel holders together, an exclusive one waits; the lease lock refuses -s and names --kernel -s" {
  dibs lock --kernel -s x.lock sh -c "$HOLD" &
  wait_for_file held
  run dibs lock --kernel -s -n x.lock echo second
  [ "$status" -eq 0 ]
  [ "$output" = second ]
  run flock -s -n x.lock true
  [ "$status" -eq 0 ]
  run dibs lock --kernel -x -n x.lock true
  [ "$status" -eq 1 ]
  run flock -x -n x.lock true
  [ "$status" -eq 1 ]
  touch release
  wait
  run dibs lock -s x.lock true
  [ "$status" -eq 64 ]
  [[ "$output" == *"dibs lock --kernel -s"* ]]
  # -s means --shared and nothing else: with --dot it is refused, naming the
  # pause's own options, and nothing runs.
  run dibs lock --dot -s 1 dot.lock touch ran
  [ "$status" -eq 64 ]
  [[ "$output" == *"-s is --shared"* && "$output" == *"-i SECS or --sleep SECS"* ]]
  [ ! -e ran ] && [ ! -e dot.lock ]
  run dibs lock --dot -i 1 dot.lock true
  [ "$status" -eq 0 ]
}

@test "-o: the lock ends with dibs, not with COMMAND (kernel: no descriptor; lease: the record names dibs)" {
  dibs lock --kernel -o x.lock sh -c "echo \${DIBS_LOCK_FD:-none} > fd; $HOLD" &
  dpid=$!
  wait_for_file held
  [ "$(cat fd)" = none ]
  run flock -n x.lock true
  [ "$status" -eq 1 ]
  kill -KILL "$dpid"
  wait "$dpid" || true
  run flock -n x.lock true  # COMMAND runs on, without the lock
  [ "$status" -eq 0 ]
  touch release
  wait_for_kernel_free x.lock
  rm held release

  dibs lock -o y.lock sh -c "$HOLD" &
  dpid=$!
  wait_for_file held
  grep -qx "pid $dpid" y.lock
  kill -KILL "$dpid"
  wait "$dpid" || true
  run dibs lock -n y.lock echo taken
  [ "$status" -eq 0 ]
  [ "$output" = taken ]
  touch release
}

@test "-F: dibs becomes COMMAND, which holds the kernel lock; the lease lock refuses -F, and -F with -o is refused as by flock(1)" {
  dibs lock --kernel -F x.lock sh -c "echo \$\$ > pid; $HOLD" &
  dpid=$!
  wait_for_file held
  [ "$(cat pid)" = "$dpid" ]
  run flock -n x.lock true
  [ "$status" -eq 1 ]
  touch release
  wait "$dpid"
  run flock -n x.lock true
  [ "$status" -eq 0 ]
  run dibs lock -F x.lock true
  [ "$status" -eq 64 ]
  [[ "$output" == *"dibs lock --kernel -F"* ]]
  run dibs lock --kernel -F -o x.lock true
  [ "$status" -eq 64 ]
  [[ "$output" == *"incompatible"* ]]
}

@test "the descriptor form: -s, -x, -n, -w and -E apply; the shell keeps the lock after dibs ends; the lease lock refuses it" {
  exec {fd}> k.lock
  run dibs lock --kernel -n "$fd"
  [ "$status" -eq 0 ]
  run flock -n k.lock true
  [ "$status" -eq 1 ]
  run dibs lock --kernel -s "$fd"  # converts the shell's lock to shared
  [ "$status" -eq 0 ]
  run flock -s -n k.lock true
  [ "$status" -eq 0 ]
  exec {fd}>&-
  flock -x k.lock sh -c "$HOLD" &
  wait_for_file held
  exec {fd2}> k.lock
  run dibs lock --kernel --verbose -w 0.3 -E 7 "$fd2"
  [ "$status" -eq 7 ]
  [[ "$output" == *"--wait ran out"* ]]
  touch release
  wait
  run dibs lock --kernel -x -w 10 "$fd2"
  [ "$status" -eq 0 ]
  exec {fd2}>&-
  exec {fd}> k.lock
  run dibs lock "$fd"
  [ "$status" -eq 64 ]
  [[ "$output" == *"dibs lock --kernel $fd"* ]]
  run dibs lock -u "$fd"
  [ "$status" -eq 64 ]
  [[ "$output" == *"--kernel -u"* ]]
  exec {fd}>&-
}

@test "bad flock-style input: -E outside 0-255, lockfile options without --dot" {
  run dibs lock -E 256 x.lock true
  [ "$status" -eq 64 ]
  run dibs lock -r 3 x.lock true
  [ "$status" -eq 64 ]
  [[ "$output" == *"add --dot"* ]]
  run dibs lock --kernel --dot x.lock true
  [ "$status" -eq 64 ]
}
