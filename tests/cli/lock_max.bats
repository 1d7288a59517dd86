#!/usr/bin/env bats
# dibs lock --max N: at most N at a time (dibs::lease_semaphore in a
# directory), as a drop-in for GNU parallel's `sem -j N`.
load helpers

teardown() {
  touch "$BATS_TEST_TMPDIR/stop" "$BATS_TEST_TMPDIR/release"
}

# The section, shell builtins only, under permit $DIBS_PERMIT: checks that
# the permit's marker is empty (nobody else holds this permit), marks it,
# journals the permit's token, counts who is inside (a file each in in/),
# clears the mark. With at most 2 permits, 0 and 1, no 3 are ever inside.
crit='case $DIBS_PERMIT in 0|1) ;; *) echo "permit $DIBS_PERMIT" >> overlaps ;; esac
m=marker.$DIBS_PERMIT
read o < $m; [ -z "$o" ] || echo "enter $$ saw $o" >> overlaps
echo $$ > $m
: > in/$$
set -- in/*; echo $# >> inside
echo $DIBS_TOKEN >> journal.$DIBS_PERMIT
rm -f in/$$
read o < $m; [ "$o" = $$ ] || echo "leave $$ saw $o" >> overlaps
: > $m'

runs=${DIBS_CLI_LOCK_RUNS:-30}

# The files $crit uses, empty.
crit_files() {
  mkdir in
  : > marker.0
  : > marker.1
  : > overlaps
  : > inside
}

# holders_in N: N sections have said they got in (a got.PID file each).
holders_in() { [ "$(cat got.* 2>/dev/null | wc -l)" -eq "$1" ]; }

@test "dibs lock --max 2 from 6 shells x $runs runs with SIGKILLs of dibs: never 3 inside, one holder per permit, tokens rising per permit, every permit back" {
  crit_files
  pids=()
  for l in 1 2 3 4 5 6; do
    (
      for ((i = 0; ; i++)); do
        ((i < runs)) || [ ! -e stop ] || break
        dibs lock --max 2 -w 60s sem -- sh -c "$crit" || true
      done
    ) &
    pids+=($!)
  done
  killed=$(kill_random_dibs 10 0.05 "${pids[@]}")
  touch stop
  wait "${pids[@]}"
  echo "killed $killed dibs processes; $(wc -l < inside) sections" >&3
  [ "$killed" -ge 10 ]
  [ ! -s overlaps ] || { cat overlaps >&2; false; }
  # Never 3 inside (each section counted itself and whoever else was in).
  max=$(sort -n inside | tail -1)
  [ "$max" -le 2 ]
  # A permit's tokens only rise: each hold's is above every earlier one's.
  for p in 0 1; do
    [ -s journal.$p ]
    sort -n -c journal.$p
    [ "$(sort -n -u journal.$p | wc -l)" -eq "$(wc -l < journal.$p)" ]
  done
  # Every COMMAND has ended: the permits of killed dibs are free on proof.
  run dibs status sem
  echo "$output" >&3
  [ "$status" -eq 0 ]
  [[ "${lines[0]}" == "sem: 0 of 2 permits held" ]]
  dibs lock --max 2 -n sem -- true
}

@test "dibs lock --max 2: two holders fill it, a third waits (-n: exit 1), dibs status lists both, a permit given back is taken at once" {
  hold='echo "$DIBS_PERMIT $DIBS_TOKEN" > got.$$; until [ -e release ]; do sleep 0.05; done'
  dibs lock --max 2 sem -- sh -c "$hold" &
  a=$!
  dibs lock --max 2 sem -- sh -c "$hold" &
  b=$!
  wait_until "two holders never got in" holders_in 2
  # One each of permits 0 and 1.
  [ "$(cut -d' ' -f1 got.* | sort | tr '\n' ' ')" = "0 1 " ]
  run dibs lock --max 2 -n sem -- true
  [ "$status" -eq 1 ]
  run dibs lock --max 2 -n -E 9 --verbose sem -- true
  [ "$status" -eq 9 ]
  [[ "$output" == *"all 2 permits of 'sem' are held"* ]]
  run dibs status sem
  echo "$output" >&3
  [[ "${lines[0]}" == "sem: 2 of 2 permits held" ]]
  [ "${#lines[@]}" -eq 4 ]
  [[ "${lines[2]}" == "0 "*" held" ]]
  [[ "${lines[3]}" == "1 "*" held" ]]
  run dibs status --json sem
  [[ "$output" == *'"kind": "semaphore", "permits": 2, "held": 2'* ]]
  # A waiter gets the first permit given back.
  dibs lock --max 2 -w 60s sem -- sh -c 'echo $DIBS_PERMIT > third' &
  c=$!
  touch release
  wait "$a" "$b" "$c"
  grep -qx '[01]' third
}

@test "dibs lock --max: bad input is refused with what to do, and nothing is changed" {
  run dibs lock --max 0 sem -- true
  [ "$status" -eq 64 ]
  [ ! -e sem ]
  run dibs lock --max 2 --kernel sem -- true
  [ "$status" -eq 64 ]
  [[ "$output" == *"--max is N permits of the lease lock; it has no --kernel form"* ]]
  run dibs lock --resize sem -- true
  [ "$status" -eq 64 ]
  : > afile
  run dibs lock --max 2 afile -- true
  [ "$status" -eq 65 ]
  [[ "$output" == *"'afile' is a file"* ]]
  run dibs lock --max 2 nodir/sem -- true
  [ "$status" -eq 66 ]
  # Opened with another N: refused, saying how many it has and how to change it.
  dibs lock --max 2 sem -- true
  run dibs lock --max 3 sem -- true
  [ "$status" -eq 64 ]
  [[ "$output" == *"'sem' has 2 permits, not 3"*"--resize"* ]]
  [[ "$(dibs status sem)" == "sem: 0 of 2 permits held" ]]
  # --resize changes it for every user.
  dibs lock --max 3 --resize sem -- true
  [[ "$(dibs status sem)" == "sem: 0 of 3 permits held" ]]
  run dibs lock --max 2 sem -- true
  [ "$status" -eq 64 ]
  # A directory without a semaphore is said to be one.
  mkdir empty
  run dibs status empty
  [ "$status" -eq 66 ]
  [[ "$output" == *"no semaphore"* ]]
}

@test "dibs lock --max 2 --store: the semaphore kept in a store, named; two hold, a third is refused (-n), status --semaphore and status STORE list it; 4 shells x $runs runs never 3 inside" {
  store="sqlite:$PWD/sem.db"
  hold='echo "$DIBS_PERMIT $DIBS_TOKEN" > got.$$; until [ -e release ]; do sleep 0.05; done'
  dibs lock --max 2 --store "$store" exports -- sh -c "$hold" &
  a=$!
  dibs lock --max 2 --store "$store" exports -- sh -c "$hold" &
  b=$!
  wait_until "two holders never got in" holders_in 2
  [ "$(cut -d' ' -f1 got.* | sort | tr '\n' ' ')" = "0 1 " ]
  run dibs lock --max 2 --store "$store" -n --verbose exports -- true
  [ "$status" -eq 1 ]
  [[ "$output" == *"all 2 permits of 'exports in $store' are held"*"dibs status --semaphore exports '$store'"* ]]
  run dibs status --semaphore exports "$store"
  echo "$output" >&3
  [ "$status" -eq 0 ]
  [[ "${lines[0]}" == "exports in $store: 2 of 2 permits held" ]]
  [ "${#lines[@]}" -eq 4 ]
  # The store's listing: its items (none: a semaphore's records are not
  # items), then the semaphore by name.
  run dibs status "$store"
  echo "$output" >&3
  [ "$status" -eq 0 ]
  [[ "$output" != *"dibs-semaphore"* ]]
  [[ "$output" == *"0 item(s)"* ]]
  [[ "$output" == *"semaphore exports: 2 of 2 permits held (dibs status --semaphore exports $store)"* ]]
  touch release
  wait "$a" "$b"
  [[ "$(dibs status --semaphore exports "$store")" == "exports in $store: 0 of 2 permits held" ]]
  # Shells taking turns: never 3 inside, tokens rising per permit.
  crit_files
  pids=()
  for l in 1 2 3 4; do
    (for ((i = 0; i < runs; i++)); do dibs lock --max 2 -w 60s --store "$store" exports -- sh -c "$crit"; done) &
    pids+=($!)
  done
  wait "${pids[@]}"
  [ ! -s overlaps ] || { cat overlaps >&2; false; }
  [ "$(wc -l < inside)" -eq $((4 * runs)) ]
  [ "$(sort -n inside | tail -1)" -le 2 ]
  for p in 0 1; do
    [ -s journal.$p ]
    sort -n -c journal.$p
  done
}

@test "dibs lock --store: bad input is refused with what to do, and nothing is made" {
  run dibs lock --store "sqlite:$PWD/sem.db" exports -- true
  [ "$status" -eq 64 ]
  [[ "$output" == *"give --max N (--max 1: one holder at a time)"* ]]
  [ ! -e sem.db ]
  run dibs lock --max 2 --store "$PWD/sem.db" exports -- true
  [ "$status" -eq 64 ]
  [[ "$output" == *"is not a store"* ]]
  run dibs lock --max 2 --store "sqlite:$PWD/sem.db" '' -- true
  [ "$status" -eq 64 ]
  dibs lock --max 2 --store "sqlite:$PWD/sem.db" exports -- true
  run dibs lock --max 3 --store "sqlite:$PWD/sem.db" exports -- true
  [ "$status" -eq 64 ]
  [[ "$output" == *"'exports in sqlite:$PWD/sem.db' has 2 permits, not 3"*"--resize --store 'sqlite:$PWD/sem.db' exports"* ]]
  run dibs status --semaphore nothing "sqlite:$PWD/sem.db"
  [ "$status" -eq 66 ]
  [[ "$output" == *"has no semaphore 'nothing'"* ]]
  run dibs status --semaphore exports "$PWD"
  [ "$status" -eq 64 ]
}
