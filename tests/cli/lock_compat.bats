#!/usr/bin/env bats
# dibs lock --kernel as a drop-in for flock(1) where scripts notice: the same
# lines run against flock(1) and against dibs, with the same exit codes and
# effects (a daemon started under the lock keeps it, a directory as the lock
# file, silence on a conflict, 66 for a file it may not open, the last of
# -s/-x/-u and of -w wins, -V).
load helpers

teardown() {
  touch "$BATS_TEST_TMPDIR/release"
}

# A COMMAND that leaves a background child holding the lock's descriptor,
# and ends at once: 'flock F sh -c "daemon &"'. The child makes ./held and
# ends once ./release exists; its output goes nowhere, so nobody waits for it.
DAEMON='(touch held; while [ ! -e release ]; do sleep 0.05; done) > /dev/null 2>&1 &'

# daemon_keeps_lock LOCKER...: after COMMAND ends, its background child
# still holds the lock; only its end frees it.
daemon_keeps_lock() {
  rm -f held release
  run "$@" d.lock sh -c "$DAEMON"
  [ "$status" -eq 0 ]
  wait_for_file held
  run flock -n d.lock true
  [ "$status" -eq 1 ]
  run dibs lock --kernel -n d.lock true
  [ "$status" -eq 1 ]
  touch release
  wait_for_kernel_free d.lock
}

@test "a background child of COMMAND keeps the kernel lock after COMMAND ends (flock(1) closes, never unlocks)" {
  daemon_keeps_lock flock
  daemon_keeps_lock dibs lock --kernel
  daemon_keeps_lock dibs lock --kernel -s
}

# dir_lock LOCKER...: a directory as the lock file.
dir_lock() {
  rm -f held release
  mkdir -p app
  run "$@" app sh -c 'echo ran'
  [ "$status" -eq 0 ]
  [ "$output" = ran ]
  flock app sh -c "$HOLD" &
  wait_for_file held
  run "$@" -n app true
  [ "$status" -eq 1 ]
  run "$@" -w 0.2 -E 3 app true
  [ "$status" -eq 3 ]
  touch release
  wait
  run "$@" -n app -c 'echo free'
  [ "$status" -eq 0 ]
  [ "$output" = free ]
}

@test "a directory as the lock file ('flock /var/lib/app -c ...'): locked, read-only, as by flock(1)" {
  dir_lock flock
  dir_lock dibs lock --kernel
}

@test "a conflict with -n or -w is silent, as with flock(1); --verbose says it on standard error" {
  flock x.lock sh -c "$HOLD" &
  wait_for_file held
  for locker in "flock" "dibs lock --kernel"; do
    run $locker -n x.lock true
    [ "$status" -eq 1 ]
    [ -z "$output" ]
    run $locker -w 0.1 x.lock true
    [ "$status" -eq 1 ]
    [ -z "$output" ]
  done
  run dibs lock --kernel --verbose -n x.lock true
  [ "$status" -eq 1 ]
  [[ "$output" == *"locked by another process"* ]]
  touch release
  wait
  rm held release
  dibs lock y.lock sh -c "$HOLD" &
  wait_for_file held
  run dibs lock -n y.lock true
  [ "$status" -eq 1 ]
  [ -z "$output" ]
  run dibs lock -w 0.1 y.lock true
  [ "$status" -eq 1 ]
  [ -z "$output" ]
  run dibs lock --verbose -n y.lock true
  [ "$status" -eq 1 ]
  [[ "$output" == *"is held by pid"* ]]
  touch release
  wait
}

# as_other_user COMMAND...: runs COMMAND as nobody when the tests run as
# root (root may open any file), else as is.
as_other_user() {
  if [ "$(id -u)" -eq 0 ]; then
    setpriv --reuid=65534 --regid=65534 --clear-groups env PATH="$PATH" "$@"
  else
    "$@"
  fi
}

@test "a lock file this user may not open: 66, as flock(1) (EX_NOINPUT)" {
  chmod 755 "$BATS_TEST_TMPDIR"
  touch secret.lock
  chmod 000 secret.lock
  [ "$(id -u)" -eq 0 ] || chmod 000 secret.lock
  run as_other_user flock secret.lock true
  [ "$status" -eq 66 ]
  run as_other_user dibs lock --kernel secret.lock true
  echo "$output" >&3
  [ "$status" -eq 66 ]
  [[ "$output" == *"secret.lock"* ]]
}

@test "the last of -s, -x (-e) and -u wins, and the last -w and -E, as with flock(1); -V prints the version" {
  for locker in "flock" "dibs lock --kernel"; do
    rm -f held release
    $locker -x -s x.lock sh -c "$HOLD" &  # shared: -s came last
    wait_for_file held
    run $locker -n -s x.lock true
    [ "$status" -eq 0 ]
    run $locker -n -s -x x.lock true  # exclusive: -x came last
    [ "$status" -eq 1 ]
    run $locker -n -x -u x.lock true  # -u last: nothing to wait for
    [ "$status" -eq 0 ]
    run $locker -w 60 -w 0.2 -E 9 -E 5 -x x.lock true
    [ "$status" -eq 5 ]
    touch release
    wait
  done
  run dibs lock -V
  [ "$status" -eq 0 ]
  [[ "$output" =~ ^dibs\ lock\ from\ dibs\ [0-9]+\.[0-9]+\.[0-9]+$ ]]
  run dibs --version
  [ "$status" -eq 0 ]
  [[ "$output" =~ ^dibs\ [0-9]+\.[0-9]+\.[0-9]+$ ]]
}
