#!/usr/bin/env bats
# dibs offer and dibs work: a queue from the shell. Offers checked before
# anything is written; each item's COMMAND run once under -j 4; exit codes;
# signals; 4 workers under SIGKILLs, each item completed once with its
# fenced effect.
load helpers

# Items of the chaos run: 240, fewer under the default and sanitizer presets
# (DIBS_CLI_WORK_ITEMS, a multiple of 30).
items=${DIBS_CLI_WORK_ITEMS:-240}

# Background loops and workers a test starts: ended by teardown, also when
# a check failed half-way.
bg=()

teardown() {
  touch stop
  local victims=()
  ((${#bg[@]})) && mapfile -t victims < <(dibs_children "${bg[@]}")
  ((${#bg[@]})) && kill -KILL "${bg[@]}" 2>/dev/null
  ((${#victims[@]})) && kill -KILL "${victims[@]}" 2>/dev/null
  return 0
}

# count STATE STORE: how many items of STORE are in STATE.
count() { dibs status --json "$2" | grep -c "\"state\": \"$1\"" || true; }

# all_completed N STORE: every one of the N items of STORE is completed.
all_completed() { [ "$(count completed "$2")" -eq "$1" ]; }

@test "offer: counts from standard input; the same keys again are not new; CRLF lines; -q, -v" {
  mkdir q
  run dibs offer dir:q < <(seq -f 'k%g' 1 5)
  [ "$status" -eq 0 ]
  [ "$output" = "5 offered, 0 already had a record" ]
  run dibs offer dir:q < <(seq -f 'k%g' 1 7)
  [ "$status" -eq 0 ]
  [ "$output" = "2 offered, 5 already had a record" ]
  # A file written on Windows: the CR is not part of the key.
  run dibs offer dir:q < <(printf 'k1\r\nk8\r\n')
  [ "$output" = "1 offered, 1 already had a record" ]
  run dibs offer -q dir:q < <(echo k9)
  [ "$status" -eq 0 ]
  [ -z "$output" ]
  [ "$(count offered dir:q)" -eq 9 ]
  # No keys: nothing to do, said only with -v.
  run dibs offer dir:q < /dev/null
  [ "$status" -eq 0 ]
  [ -z "$output" ]
  run dibs offer -v dir:q < /dev/null
  [ "$status" -eq 0 ]
  [[ "$output" == "0 offered"* ]]
  # Keys come on standard input, not as arguments.
  run dibs offer dir:q k10
  [ "$status" -eq 64 ]
  [[ "$output" == *"standard input"* ]]
  # More than a batch of 1,000, on SQLite.
  run dibs offer sqlite:"$PWD/q.db" < <(seq -f 'job-%g' 1 2500)
  [ "$status" -eq 0 ]
  [ "$output" = "2500 offered, 0 already had a record" ]
  run dibs offer sqlite:"$PWD/q.db" < <(seq -f 'job-%g' 2001 3000)
  [ "$output" = "500 offered, 500 already had a record" ]
  [ "$(count offered sqlite:"$PWD/q.db")" -eq 3000 ]
}

@test "offer: an empty line, a key too long, a key given twice: 65 naming the line(s), nothing written" {
  mkdir q
  run dibs offer dir:q < <(printf 'a\nb\n\nc\n')
  [ "$status" -eq 65 ]
  [[ "$output" == *"line 3 "*"empty"* ]]
  run dibs offer dir:q < <(printf 'a\nb\na\n')
  [ "$status" -eq 65 ]
  [[ "$output" == *"line 3 "*"'a' of line 1"* ]]
  run dibs offer dir:q < <(echo a; head -c 1025 /dev/zero | tr '\0' x; echo)
  [ "$status" -eq 65 ]
  [[ "$output" == *"line 2 "*"1025 bytes"* ]]
  # The bad line is the last of 1,500: the first batch was not written either.
  run dibs offer sqlite:"$PWD/q.db" < <(seq -f 'k%g' 1 1499; echo k7)
  [ "$status" -eq 65 ]
  [[ "$output" == *"line 1500 "*"line 7"* ]]
  [ -z "$(ls q)" ]
  [ ! -e q.db ] || [ "$(dibs status --json sqlite:"$PWD/q.db")" = "[
]" ]
}

# Items of the -j 4 runs: 200, fewer where the chaos run has fewer.
once_items=$((items < 200 ? items : 200))

# work_once STORE: dibs work -j 4 over $once_items items of STORE; each item's
# COMMAND runs once, at most 4 at a time, and every item is completed by
# the claim whose token its COMMAND got.
work_once() {
  local store=$1
  cat > handler <<'SH'
#!/bin/sh
# At most 4 at once: each run counts the runs that are in at its start.
mkdir "in.$1"
n=0
for d in in.*; do n=$((n + 1)); done
echo "$n" >> at_once
echo "$1 $DIBS_TOKEN $DIBS_KEY $DIBS_ATTEMPT" >> journal
sleep 0.02
rmdir "in.$1"
SH
  chmod +x handler
  run dibs offer "$store" < <(seq -f 'item-%03g' 1 "$once_items")
  [ "$output" = "$once_items offered, 0 already had a record" ]
  run dibs work -j 4 "$store" -- ./handler
  [ "$status" -eq 0 ]
  [ -z "$output" ]
  # Each item run once: a line and a key each, the key as the last argument
  # and in DIBS_KEY, the first attempt.
  [ "$(wc -l < journal)" -eq "$once_items" ]
  [ "$(cut -d' ' -f1 journal | sort -u | wc -l)" -eq "$once_items" ]
  [ -z "$(awk '$1 != $3 || $4 != 1' journal)" ]
  sort -n at_once | tail -1 > most
  echo "at most $(cat most) at once" >&3
  [ "$(cat most)" -le 4 ]
  [ "$(cat most)" -ge 2 ]
  all_completed "$once_items" "$store"
  # Completed by the claim whose token COMMAND got.
  dibs status --json "$store" | sed -n 's/.*"key": "\([^"]*\)".*"state": "completed".*"token": \([0-9]*\).*/\1 \2/p' | sort > completed
  [ "$(wc -l < completed)" -eq "$once_items" ]
  diff completed <(cut -d' ' -f1,2 journal | sort)
  # Nothing left: 14.
  run dibs work -j 4 "$store" -- ./handler
  [ "$status" -eq 14 ]
  [[ "$output" == *"nothing claimable"* ]]
  [ "$(wc -l < journal)" -eq "$once_items" ]
}

@test "work -j 4 over $once_items items on dir:: each COMMAND run once, every item completed with its token" {
  mkdir q
  work_once dir:q
}

@test "work -j 4 over $once_items items on sqlite:: each COMMAND run once, every item completed with its token" {
  work_once sqlite:"$PWD/q.db"
}

@test "work: a failing COMMAND gives its item back; the exit code is the last failure's; --prefix; priorities" {
  mkdir q
  dibs offer -q --priority 2 dir:q < <(echo a-first)
  dibs offer -q --priority 1 dir:q < <(echo a-second)
  dibs offer -q dir:q < <(printf 'a-ok\nb-other\n')
  # -j 1 and the priorities make the order a-first (3), a-second (7), a-ok.
  run dibs work --prefix a- --retry-after 1h dir:q -- sh -c 'echo "$1" >> ran; case $1 in a-first) exit 3;; a-second) exit 7;; esac' sh
  [ "$status" -eq 7 ]
  [ "$(cat ran)" = "a-first
a-second
a-ok" ]
  [[ "$output" == *"'a-first': COMMAND exited 3; given back (attempt 1 of 5)"* ]]
  local st
  st=$(dibs status --json dir:q)
  [[ "$st" == *'"key": "a-first", "state": "released", "attempts": 1'*'"error": "COMMAND exited 3"'* ]]
  [[ "$st" == *'"key": "a-ok", "state": "completed"'* ]]
  [[ "$st" == *'"key": "b-other", "state": "offered"'* ]]
  # Given back for 1 h: not claimable; nothing else under the prefix.
  run dibs work --prefix a- dir:q -- true
  [ "$status" -eq 14 ]
  run dibs work -q --exit-base 200 --prefix a- dir:q -- true
  [ "$status" -eq 204 ]
  [ -z "$output" ]
  # The last attempt fails it for good.
  dibs offer -q dir:q < <(echo c)
  run dibs work --max-attempts 1 --prefix c dir:q -- false
  [ "$status" -eq 1 ]
  [[ "$output" == *"'c' failed for good"* ]]
  [[ "$(dibs status --json dir:q)" == *'"key": "c", "state": "failed"'* ]]
}

@test "work: -j 0 and -j 1025 refused; no COMMAND; a COMMAND that cannot run: nothing claimed" {
  mkdir q
  dibs offer -q dir:q < <(echo x)
  run dibs work -j 0 dir:q -- touch ran
  [ "$status" -eq 64 ]
  [[ "$output" == *"-j 0"*"1 to 1,024"* ]]
  run dibs work -j 1025 dir:q -- touch ran
  [ "$status" -eq 64 ]
  [[ "$output" == *"1 to 1,024"* ]]
  run dibs work dir:q
  [ "$status" -eq 64 ]
  [[ "$output" == *"no COMMAND"* ]]
  run -127 dibs work dir:q -- ./no-such-handler
  [ "$status" -eq 127 ]
  [[ "$output" == *"nothing was claimed"* ]]
  [ ! -e ran ]
  [[ "$(dibs status --json dir:q)" == *'"state": "offered", "attempts": 0'* ]]
}

@test "work on an empty queue exits 14; --wait runs what is offered later, forwards signals, and a TERM stops it (143)" {
  mkdir q
  run dibs work dir:q -- true
  [ "$status" -eq 14 ]
  [[ "$output" == *"nothing claimable under prefix '' in dir:q"* ]]
  # The slow item holds until it gets TERM (forwarded by dibs), then ends by it.
  cat > handler <<'SH'
#!/bin/sh
echo "$1" >> ran
case $1 in
  slow) trap 'echo "$1 USR1" >> got' USR1
        trap 'echo "$1 TERM" >> got; trap - TERM; kill -TERM $$' TERM
        touch held
        while :; do sleep 0.05; done ;;
esac
SH
  chmod +x handler
  dibs work --wait -j 2 dir:q -- ./handler 2> err &
  bg+=($!)
  local w=$!
  dibs offer -q dir:q < <(echo fast)
  wait_until "fast was not completed" all_completed 1 dir:q
  dibs offer -q dir:q < <(echo slow)
  wait_for_file held
  kill -USR1 "$w"
  wait_until "USR1 was not forwarded" grep -q 'slow USR1' got
  kill -TERM "$w"
  local rc=0
  wait "$w" || rc=$?
  [ "$rc" -eq 143 ]
  grep -q 'slow TERM' got
  # Ended by the stop: given back at once, its attempt counted.
  [[ "$(dibs status --json dir:q)" == *'"key": "slow", "state": "released", "attempts": 1'*'"error": "COMMAND exited 143"'* ]]
  grep -q "claiming nothing more" err
  run dibs work dir:q -- true
  [ "$status" -eq 0 ]
  all_completed 2 dir:q
}

@test "4 dibs work -j 3 over $items items with SIGKILLs: each item completed once, by the claim of its last journaled run" {
  ((items % 30 == 0 && items >= 30))
  local store=sqlite:$PWD/q.db
  # The handler journals "key token" (one small O_APPEND write: whole).
  # Every 30th key's first run also SIGKILLs its own dibs (its parent), two
  # other runs of it with it: kills that land mid-item however loaded the
  # machine is, besides the random ones.
  cat > handler <<'SH'
#!/bin/sh
echo "$1 $DIBS_TOKEN" >> journal
if [ $((${1#item-} % 30)) -eq 0 ] && mkdir "killed.$1" 2>/dev/null; then kill -KILL "$PPID"; fi
sleep 0.05
SH
  chmod +x handler
  run dibs offer "$store" < <(seq -f 'item-%g' 1 "$items")
  [ "$status" -eq 0 ]
  # 4 workers, each restarted when it is killed, until ./stop (the test's
  # errexit must not end a loop at a worker's first non-zero exit).
  for w in 1 2 3 4; do
    (while [ ! -e stop ]; do
      rc=0
      dibs work --wait -q -j 3 --retry-after 0 "$store" -- ./handler || rc=$?
      echo "$rc" >> codes
    done) &
    bg+=($!)
  done
  killed=$(kill_random_dibs 10 0.1 "${bg[@]}")
  # Then until every item is completed (a killed worker's items are
  # claimable again at once), as long as the journal grows.
  local end=$((SECONDS + 120))
  until all_completed "$items" "$store"; do
    ((SECONDS < end)) || { echo "not all completed after 120 s: $(count completed "$store")" >&2; false; }
    sleep 0.1
  done
  # Stopped as a service is: TERM to each worker, until the loops, which
  # start none after ./stop, have ended.
  touch stop
  stopped() {
    local p alive=0
    for p in "${bg[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    mapfile -t workers < <(dibs_children "${bg[@]}")
    ((${#workers[@]})) && kill -TERM "${workers[@]}" 2>/dev/null
    return 1
  }
  wait_until "the workers did not stop on TERM" stopped
  wait "${bg[@]}" 2>/dev/null || true
  own=$(find . -maxdepth 1 -name 'killed.*' | wc -l)
  echo "killed $killed dibs at random and $own from their handlers" >&3
  [ "$killed" -eq 10 ]
  [ "$own" -eq $((items / 30)) ]
  # Exit codes of the workers: 137 (killed) or 143 (stopped at the end).
  [ -z "$(grep -vxE '137|143' codes)" ]
  all_completed "$items" "$store"
  # Each item's completing token is journaled once, and is its last
  # journaled token: the fenced effect of the completing claim won.
  dibs status --json "$store" | sed -n 's/.*"key": "\([^"]*\)".*"state": "completed".*"token": \([0-9]*\).*/\1 \2/p' | sort > completed
  [ "$(wc -l < completed)" -eq "$items" ]
  [ -z "$(sort journal | uniq -d)" ]
  awk '{ last[$1] = $2 } END { for (k in last) print k, last[k] }' journal | sort > last
  diff completed last
  # Runs of killed workers journaled too, with older tokens: at most 3 per kill.
  extra=$(($(wc -l < journal) - items))
  echo "journal: $items completing runs, $extra runs of killed workers" >&3
  [ "$extra" -le $((3 * (killed + own))) ]
}
