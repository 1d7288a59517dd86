#!/usr/bin/env bats
# dibs log: many writers, long lines, SIGKILLs: every acknowledged line once,
# none torn.
load helpers

# The I-th line of job J is "job J line I", and every 25th has 5,000 x's more
# (over 4 KiB: written by its own writer, not through a slot).
pad=$(printf '%5000s' '' | tr ' ' x)
line() {
  if (($2 % 25 == 0)); then l="job $1 line $2 $pad"; else l="job $1 line $2"; fi
}

# Lines per job: 500 (ctest --preset full); the other test presets set
# DIBS_CLI_LOG_LINES to 250, the sanitizer presets lower
# (every line is a dibs process, which a sanitizer makes tens of times slower
# to start; the invariants checked are the same).
n=${DIBS_CLI_LOG_LINES:-500}

# A failed check must not leave the writers looping (bats would wait for
# them until ctest's timeout): they stop once ./stop exists, and the jobs
# reading standard input are killed.
teardown() {
  touch "$BATS_TEST_TMPDIR/stop"
  kill -KILL "${stdin_jobs[@]}" 2>/dev/null || true
}

@test "8 jobs x $n lines through dibs log, some over 4 KiB, with SIGKILLs: acknowledged lines once, none torn" {
  pids=()
  # Each job writes at least n lines, and on until the killer is done: the
  # kills land while the jobs write, however fast the machine is.
  for j in 1 2 3 4 5 6 7 8; do
    (
      for ((i = 1; ; i++)); do
        ((i <= n)) || [ ! -e stop ] || break
        line "$j" "$i"
        if dibs log out.log "$l"; then printf '%s\n' "$l" >> "acked.$j"; fi
      done
    ) &
    pids+=($!)
  done
  # Two more jobs write lines through standard input until they are
  # SIGKILLed midway (their lines are acknowledged by nobody): their dibs
  # log reads until its input ends, which nothing ends before the kill.
  stdin_jobs=()
  for j in 9 10; do
    (for ((i = 1; ; i++)); do line "$j" "$i"; printf '%s\n' "$l" || break; nap 0.002; done) |
      dibs log out.log 2> "stdin_err.$j" &
    stdin_jobs+=($!)
  done
  killed=$(kill_dibs_while_running 60 0.005 "${pids[@]}")
  # Both are still reading: a dibs log that gave up under the kills of the
  # others fails the test, saying why.
  for j in 0 1; do
    if ! kill -KILL "${stdin_jobs[j]}"; then
      wait "${stdin_jobs[j]}" && rc=0 || rc=$?
      echo "dibs log reading standard input (job $((j + 9))) had ended, exit $rc: $(cat "stdin_err.$((j + 9))")" >&3
      false
    fi
  done
  touch stop
  # The lines each job still owes are written on (a hang fails, naming
  # what the stuck dibs processes wait for).
  wait_while_growing out.log 60 "${pids[@]}"
  wait
  echo "killed $killed per-line dibs processes and 2 reading standard input" >&3
  [ "$killed" -gt 10 ]
  # Every line is one of ours, whole: exactly the text of line J I.
  run awk '{ if (!($1 == "job" && $3 == "line" && NF >= 4 && ($4 % 25 == 0 ? length($5) == 5000 : NF == 4))) { print "torn or foreign: " substr($0, 1, 80); bad = 1 } } END { exit bad }' out.log
  echo "$output" >&3
  [ "$status" -eq 0 ]
  # None twice.
  [ -z "$(sort out.log | uniq -d | head -c 200)" ]
  # Every acknowledged line present.
  cat acked.* | sort > acked
  sort out.log > present
  missing=$(comm -23 acked present | wc -l)
  echo "$(wc -l < acked) acknowledged, $(wc -l < present) present, $missing missing" >&3
  [ "$missing" -eq 0 ]
  # Each job wrote lines 1 to n at least, and a line goes unacknowledged
  # only if its dibs was killed: at most one per kill. (Not "7 jobs' worth":
  # 60 kills are more than a job's lines at the sanitizer presets' 50.)
  [ "$(wc -l < acked)" -ge $((8 * n - killed)) ]
}

@test "dibs log: TEXT words joined, standard input line by line, rotation by size" {
  dibs log a.log hello world
  printf 'one\ntwo\n' | dibs log a.log
  [ "$(cat a.log)" = "$(printf 'hello world\none\ntwo')" ]
  for i in $(seq 1 40); do dibs log --rotate-size 100 --keep 2 r.log "line $i of the rotating log"; done
  [ -f r.log.1 ] && [ -f r.log.2 ] && [ ! -f r.log.3 ]
}
