#!/usr/bin/env bats
# dibs once: a crontab line on every host, COMMAND run once per slot.
load helpers

teardown() {
  touch "$BATS_TEST_TMPDIR/stop"
}

# The slots' records of schedule $1, as "SLOT STATE TOKEN" lines (JSON to lines).
slots_of() {
  dibs status --json --once "$1" --last "${2:-1000}" "dir:$PWD/s" |
    sed -n 's/.*"slot": "\([^"]*\)", "state": "\([a-z]*\)".*/\1 \2/p'
}
token_of() {
  dibs status --json --once "$1" --last 1000 "dir:$PWD/s" | grep "\"slot\": \"$2\"" | sed -n 's/.*"token": \([0-9]*\).*/\1/p'
}

@test "dibs once from 4 cron-like loops with SIGKILLs of dibs: each slot's effect once at most, fenced by its token, exits 0, 10, 11 or killed" {
  mkdir s
  : > ran
  pids=()
  for l in 1 2 3 4; do
    (
      while [ ! -e stop ]; do
        code=0
        dibs once -q --every 500ms --store "dir:$PWD/s" tick -- sh -c 'echo "$DIBS_SLOT $DIBS_TOKEN" >> ran; sleep 0.1' ||
          code=$?
        echo "$code" >> "codes.$l"
        sleep 0.05
      done
    ) &
    pids+=($!)
  done
  # The kills land while the loops run; then the loops go on for 8 slots
  # more (4 s), so that the schedule has slots on both sides of them.
  killed=$(kill_random_dibs 6 0.3 "${pids[@]}")
  end=$((SECONDS + 4))
  while ((SECONDS < end)); do sleep 0.2; done
  touch stop
  wait "${pids[@]}"
  echo "killed $killed dibs" >&3
  [ "$killed" -ge 6 ]
  # The exits: ran (0), another ran it (10), another runs it (11), killed (137).
  bad=$(cat codes.* | grep -vx '0\|10\|11\|137' || true)
  [ -z "$bad" ] || { echo "unexpected exit codes: $bad" >&2; false; }
  # Every slot since the first that ran is completed, or missed (no loop's
  # dibs got to it within its 500 ms: a sanitizer build on a loaded machine
  # starts slowly) or interrupted (below), but for the last ones at the stop; a completed slot's
  # effect is in `ran` once, with the completing run's token, and any other
  # line of the slot is of an earlier run (a smaller token) that was killed.
  first=$(head -1 ran | cut -d' ' -f1)
  slots_of tick > slots
  last_two=$(head -2 slots | cut -d' ' -f1)  # newest first
  echo "$(wc -l < slots) slots, $(grep -c completed slots) completed, $(grep -c missed slots) missed" >&3
  n=0
  while read -r slot state; do
    [[ "$slot" < "$first" ]] && continue
    # A run killed with its dibs whose slot no other loop reached in time
    # (and whose next slot was missed, so no run finished it) is left
    # interrupted; takeovers are checked exactly in once_test's chaos run.
    [ "$state" = missed ] || [ "$state" = interrupted ] && continue
    if grep -qx "$slot" <<< "$last_two"; then continue; fi  # running, interrupted or due at the stop
    [ "$state" = completed ] || { echo "slot $slot: $state" >&2; false; }
    t=$(token_of tick "$slot")
    [ "$(grep -cx "$slot $t" ran)" -eq 1 ] || { echo "slot $slot: token $t ran $(grep -c "^$slot " ran) times" >&2; false; }
    while read -r _ other; do
      [ "$other" -le "$t" ] || { echo "slot $slot: a run with token $other after the completing $t" >&2; false; }
    done < <(grep "^$slot " ran)
    n=$((n + 1))
  done < slots
  [ "$n" -ge 4 ]
}

@test "dibs once: a failed COMMAND's status passes through and the slot runs again (DIBS_ATTEMPT 2), until --max-attempts fails it (12)" {
  mkdir s
  run dibs once --slot 2026-12-06 --max-attempts 2 --store "dir:$PWD/s" nightly -- sh -c 'echo "try $DIBS_ATTEMPT"; exit 3'
  [ "$status" -eq 3 ]
  [[ "$output" == *"try 1"* ]]
  [[ "$output" == *"COMMAND exited 3; the slot was given back"* ]]
  run dibs once --slot 2026-12-06 --max-attempts 2 --store "dir:$PWD/s" nightly -- sh -c 'echo "try $DIBS_ATTEMPT"; exit 4'
  [ "$status" -eq 4 ]
  [[ "$output" == *"try 2"* ]]
  run dibs once --slot 2026-12-06 --max-attempts 2 --store "dir:$PWD/s" nightly -- echo never
  [ "$status" -eq 12 ]
  [[ "$output" != *never* ]]
  [[ "$output" == *"failed for good after 2 runs"*"COMMAND exited 4"* ]]
  # Another slot of the same schedule is not affected; a done one exits 10.
  dibs once --slot 2026-12-07 --store "dir:$PWD/s" nightly -- true
  run dibs once --slot 2026-12-07 --store "dir:$PWD/s" nightly -- echo never
  [ "$status" -eq 10 ]
  run dibs status --once nightly "dir:$PWD/s"
  echo "$output" >&3
  [[ "$output" == *"2026-12-06"*failed*"COMMAND exited 4"* ]]
  [[ "$output" == *"2026-12-07"*completed* ]]
}

@test "dibs once: a slot no one ran is shown missed, and --catch-up latest runs it first" {
  mkdir s
  dibs once --every 1s --store "dir:$PWD/s" hourly -- true
  # Two slots later (by the clock), the one between is missed.
  missed_shown() { slots_of hourly 5 | grep -q ' missed$'; }
  wait_until "no missed slot shown" missed_shown
  run dibs once --every 1s --catch-up latest --store "dir:$PWD/s" hourly -- sh -c 'echo "$DIBS_SLOT"'
  [ "$status" -eq 0 ]
  echo "$output" >&3
  [ "${#lines[@]}" -eq 2 ]  # the latest missed one, then the current one
  [[ "${lines[0]}" < "${lines[1]}" ]]
  slots_of hourly 1000 | grep -q "^${lines[0]} completed$"
}

@test "dibs once: bad input is refused with what to do (no period or slot, period 0, a name with '/', another period), nothing run" {
  mkdir s
  run dibs once --store "dir:$PWD/s" job -- echo never
  [ "$status" -eq 64 ]
  [[ "$output" == *"give --every PERIOD"* ]]
  run dibs once --every 0 --store "dir:$PWD/s" job -- echo never
  [ "$status" -eq 64 ]
  run dibs once --every 1h --store "dir:$PWD/s" a/b -- echo never
  [ "$status" -eq 64 ]
  [[ "$output" == *"without '/'"* ]]
  run dibs once --every 1h --store "dir:$PWD/s" job
  [ "$status" -eq 64 ]
  [[ "$output" == *"no COMMAND"* ]]
  dibs once --every 1h --store "dir:$PWD/s" job -- true
  run dibs once --every 2h --store "dir:$PWD/s" job -- echo never
  [ "$status" -eq 64 ]
  [[ "$output" == *"opened with a period of 7200000 ms, but the schedule has a period of 3600000 ms"* ]]
  [[ "$output" != *never* ]]
  run dibs once --every 1h --store "dir:$PWD/nonexistent" job -- echo never
  [ "$status" -eq 66 ]
  run dibs status --once nosuch "dir:$PWD/s"
  [ "$status" -eq 66 ]
}
