#!/usr/bin/env bats
# Bad input: clear messages, the documented exit codes, nothing written.
load helpers

@test "unknown store scheme: 64, names the scheme and lists the stores; nothing run" {
  run dibs claim nosuch:/x k -- touch ran
  [ "$status" -eq 64 ]
  [[ "$output" == *"scheme 'nosuch'"* ]]
  [[ "$output" == *"dir:/path"* ]]
  [ ! -e ran ]
}

@test "missing directory: 66, names it; nothing created" {
  run dibs claim dir:"$PWD/missing" k -- touch ran
  [ "$status" -eq 66 ]
  [[ "$output" == *"$PWD/missing"* ]]
  run dibs lock "$PWD/missing/x.lock" -- touch ran
  [ "$status" -eq 66 ]
  run dibs log "$PWD/missing/x.log" text
  [ "$status" -eq 66 ]
  [ ! -e missing ] && [ ! -e ran ]
}

@test "a non-dibs file at the lock path: 65, says so; the file is untouched" {
  echo "precious data" > data.lock
  before=$(md5sum data.lock)
  run dibs lock data.lock -- touch ran
  [ "$status" -eq 65 ]
  [[ "$output" == *"not a dibs record"* ]]
  [ "$(md5sum data.lock)" = "$before" ]
  [ ! -e ran ]
  run dibs status data.lock
  [ "$status" -eq 65 ]
}

@test "no COMMAND, bad options, bad durations: 64 with a hint; nothing written" {
  run dibs lock x.lock
  [ "$status" -eq 64 ]
  [[ "$output" == *"no COMMAND"* ]]
  run dibs claim dir:. k
  [ "$status" -eq 64 ]
  run dibs retry
  [ "$status" -eq 64 ]
  run dibs lock -w soon x.lock -- true
  [ "$status" -eq 64 ]
  [[ "$output" == *"not a duration"* ]]
  run dibs lock --bogus x.lock -- true
  [ "$status" -eq 64 ]
  [[ "$output" == *"--help"* ]]
  run dibs
  [ "$status" -eq 64 ]
  [ -z "$(ls)" ]
}

@test "--help of each subcommand shows an example; dibs --help the exit codes" {
  for sub in lock log claim retry status; do
    run dibs "$sub" --help
    [ "$status" -eq 0 ]
    [[ "$output" == *"Examples:"* ]]
  done
  run dibs --help
  [[ "$output" == *"Exit codes"* ]]
  [[ "$output" == *"sqlite:/path/file.db"* ]]
}
@test "a FIFO as the lock file, status target, log or SQLite file: refused at once with a clear message, not a wait forever" {
  mkfifo pipe
  run timeout 10 dibs lock --kernel pipe true
  [ "$status" -eq 65 ]
  [[ "$output" == *"FIFO"* ]]
  run timeout 10 dibs lock --dot pipe true
  [ "$status" -eq 65 ]
  run timeout 10 dibs status pipe
  [ "$status" -eq 65 ]
  [[ "$output" == *"FIFO"* ]]
  run timeout 10 dibs log pipe text
  [ "$status" -eq 65 ]
  [[ "$output" == *"FIFO"* ]]
  run timeout 10 dibs claim sqlite:pipe k -- true
  [ "$status" -eq 65 ]
}
