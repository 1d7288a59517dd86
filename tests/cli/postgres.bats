#!/usr/bin/env bats
# dibs claim and status on PostgreSQL (the postgres: scheme, run by
# dibs-postgres), on the tests' throwaway server (DIBS_PG_DIR, set by ctest).
load helpers

teardown() {
  touch "$BATS_TEST_TMPDIR/release"  # the holders of a test that failed midway end
}

@test "postgres: claim, exit codes, --next and status, on a table of this test's own" {
  [ -n "${DIBS_PG_DIR:-}" ] || skip "no DIBS_PG_DIR: run through ctest, which starts the server"
  table="cli_$$_$RANDOM"
  store="postgres:$(cat "$DIBS_PG_DIR/conninfo")#$table"
  run dibs claim "$store" job-1 -- sh -c 'echo "$DIBS_KEY $DIBS_TOKEN"'
  echo "$output" >&3
  [ "$status" -eq 0 ]
  [[ "$output" =~ ^job-1\ [0-9]+$ ]]
  run dibs claim "$store" job-1 -- true
  [ "$status" -eq 10 ]
  run dibs claim --max-attempts 1 "$store" job-2 -- sh -c 'exit 4'
  [ "$status" -eq 4 ]
  run dibs claim "$store" job-2 -- true
  [ "$status" -eq 12 ]
  run dibs claim --next job- "$store" -- echo
  [ "$status" -eq 14 ]
  run dibs status --json "$store"
  [[ "$output" == *'"key": "job-1", "state": "completed"'* ]]
  [[ "$output" == *'"key": "job-2", "state": "failed"'* ]]
}

@test "postgres: a server that cannot be reached is 69, and says so" {
  run dibs claim "postgres:host=127.0.0.1 port=1 connect_timeout=2" k -- touch ran
  echo "$output" >&3
  [ "$status" -eq 69 ]
  [[ "$output" == *"cannot connect"* ]]
  [ ! -e ran ]
}

@test "postgres: a wrong password is permanent (77), a misspelt option a usage error (64), never 69; no password in any output" {
  [ -n "${DIBS_PG_DIR:-}" ] || skip "no DIBS_PG_DIR: run through ctest, which starts the server"
  conninfo=$(cat "$DIBS_PG_DIR/conninfo")
  secret=$(sed -E 's/.*password=([^ ]*).*/\1/' <<< "$conninfo")
  [ -n "$secret" ]
  table="cli_$$_$RANDOM"
  # Nothing claimable: the message names the store, without its password.
  run dibs claim --next none/ "postgres:$conninfo#$table" -- true
  echo "$output" >&3
  [ "$status" -eq 14 ]
  [[ "$output" == *"password=***"* ]]
  [[ "$output" != *"$secret"* ]]
  # The URI form, user:password@host.
  host=$(sed -E 's/.*host=([^ ]*).*/\1/' <<< "$conninfo")
  port=$(sed -E 's/.*port=([^ ]*).*/\1/' <<< "$conninfo")
  run dibs claim --next none/ "postgres:postgresql://dibs:$secret@$host:$port/dibs#$table" -- true
  echo "$output" >&3
  [ "$status" -eq 14 ]
  [[ "$output" != *"$secret"* ]]
  # A wrong password: refused by the server, for good.
  run dibs claim "postgres:${conninfo/password=$secret/password=wrong$secret}#$table" k -- true
  echo "$output" >&3
  [ "$status" -eq 77 ]
  [[ "$output" != *"$secret"* ]]
  run dibs status "postgres:postgresql://dibs:wrong$secret@$host:$port/dibs#$table"
  [ "$status" -eq 77 ]
  [[ "$output" != *"$secret"* ]]
  # A misspelt option: a usage error, found before any connection.
  run dibs claim "postgres:$conninfo passwrd=x#$table" k -- true
  echo "$output" >&3
  [ "$status" -eq 64 ]
  [[ "$output" == *"passwrd"* ]]
  [[ "$output" != *"$secret"* ]]
}

@test "postgres: offer, then work -j 4 over 100 items: each run once, completed by the claim whose token it got" {
  [ -n "${DIBS_PG_DIR:-}" ] || skip "no DIBS_PG_DIR: run through ctest, which starts the server"
  table="cli_$$_$RANDOM"
  store="postgres:$(cat "$DIBS_PG_DIR/conninfo")#$table"
  run dibs offer "$store" < <(seq -f 'item-%g' 1 100)
  [ "$status" -eq 0 ]
  [ "$output" = "100 offered, 0 already had a record" ]
  run dibs offer "$store" < <(seq -f 'item-%g' 91 110)
  [ "$output" = "10 offered, 10 already had a record" ]
  run dibs work -j 4 "$store" -- sh -c 'echo "$1 $DIBS_TOKEN" >> journal' sh
  [ "$status" -eq 0 ]
  [ "$(wc -l < journal)" -eq 110 ]
  dibs status --json "$store" | sed -n 's/.*"key": "\([^"]*\)".*"state": "completed".*"token": \([0-9]*\).*/\1 \2/p' | sort > completed
  [ "$(wc -l < completed)" -eq 110 ]
  diff completed <(sort journal)
  run dibs work "$store" -- true
  [ "$status" -eq 14 ]
}

@test "postgres: dibs lock --max 2 --store: at most 2 across the hosts that share the server; status --semaphore lists the holders" {
  [ -n "${DIBS_PG_DIR:-}" ] || skip "no DIBS_PG_DIR: run through ctest, which starts the server"
  store="postgres:$(cat "$DIBS_PG_DIR/conninfo")#cli_$$_$RANDOM"
  hold='echo "$DIBS_PERMIT $DIBS_TOKEN" > got.$$; until [ -e release ]; do sleep 0.05; done'
  dibs lock --max 2 --store "$store" exports -- sh -c "$hold" &
  a=$!
  dibs lock --max 2 --store "$store" exports -- sh -c "$hold" &
  b=$!
  wait_until "two holders never got in" eval '[ "$(cat got.* 2>/dev/null | wc -l)" -eq 2 ]'
  [ "$(cut -d' ' -f1 got.* | sort | tr '\n' ' ')" = "0 1 " ]
  run dibs lock --max 2 --store "$store" -n --verbose exports -- touch third
  [ "$status" -eq 1 ]
  [ ! -e third ]
  # What dibs prints names the store, never its password.
  secret=$(sed -E 's/.*password=([^ ]*).*/\1/' "$DIBS_PG_DIR/conninfo")
  [ -n "$secret" ]
  [[ "$output" == *"all 2 permits of 'exports in postgres:"*"password=***"* ]]
  [[ "$output" != *"$secret"* ]]
  run dibs status --json --semaphore exports "$store"
  [[ "$output" == *'"kind": "semaphore", "permits": 2, "held": 2'* ]]
  [[ "$output" != *"$secret"* ]]
  run dibs status "$store"
  [[ "$output" == *"semaphore exports: 2 of 2 permits held (dibs status --semaphore exports 'postgres:"*"password=***"* ]]
  [[ "$output" != *"$secret"* ]]
  # A waiter gets the first permit given back.
  dibs lock --max 2 -w 60s --store "$store" exports -- sh -c 'echo $DIBS_PERMIT > third' &
  c=$!
  touch release
  wait "$a" "$b" "$c"
  grep -qx '[01]' third
}

@test "postgres: dibs once numbers slots by the server's clock: a host a day ahead (faketime) runs today's slot, and the others find it done" {
  [ -n "${DIBS_PG_DIR:-}" ] || skip "no DIBS_PG_DIR: run through ctest, which starts the server"
  store="postgres:$(cat "$DIBS_PG_DIR/conninfo")#cli_$$_$RANDOM"
  # Run again if the day ended between the first look and the last (the
  # slots are days).
  for try in 1 2; do
    today=$(date -u +%F)
    tomorrow=$(date -u -d "$today + 1 day" +%F)
    # Under faketime, dibs-postgres and COMMAND see tomorrow's clock
    # (COMMAND's date shows it); the slot is still the server's today.
    run faketime -f '+1d' dibs once --every 24h --store "$store" "nightly-$try" -- sh -c 'echo "$DIBS_SLOT $(date -u +%F)"'
    echo "$output" >&3
    [ "$status" -eq 0 ]
    ran_as=$output
    run dibs once --every 24h --store "$store" "nightly-$try" -- touch ran
    [ "$(date -u +%F)" = "$today" ] && break
  done
  [[ "$ran_as" == *"${today}T00:00:00Z $tomorrow"* ]]
  [ "$status" -eq 10 ]
  [ ! -e ran ]
  run dibs status --json --once "nightly-$try" --last 1 "$store"
  [[ "$output" == *"\"slot\": \"${today}T00:00:00Z\", \"state\": \"completed\""* ]]
}
