#!/usr/bin/env bats
# Exit codes and messages where a script decides by them: permanent errors
# are not 69 (a 'dibs retry --on 69' wrapper would retry them for ever), a
# status writes nothing, a failed write to standard output is an error, and
# a flock(1)-style empty lock file is named as such.
load helpers

@test "a file that is not a SQLite database: 65, not 69; untouched" {
  echo "precious text, not a database; precious text, not a database; precious text, not a database" > notdb.db
  before=$(md5sum notdb.db)
  run dibs claim sqlite:notdb.db k -- touch ran
  echo "$output" >&3
  [ "$status" -eq 65 ]
  [[ "$output" == *"not a database"* ]]
  run dibs status sqlite:notdb.db
  [ "$status" -eq 65 ]
  [ "$(md5sum notdb.db)" = "$before" ]
  [ ! -e ran ]
}

@test "dibs status sqlite:new.db creates no database: 66, nothing written" {
  run dibs status sqlite:new.db
  echo "$output" >&3
  [ "$status" -eq 66 ]
  [[ "$output" == *"new.db"* ]]
  [ -z "$(ls)" ]
}

@test "dibs retry --on takes exit codes 0-255 only: 256 and -1 are usage errors" {
  run dibs retry --on 256 -- true
  [ "$status" -eq 64 ]
  run dibs retry --on -1 -- true
  [ "$status" -eq 64 ]
  run dibs retry --on 75,300 -- true
  [ "$status" -eq 64 ]
  run dibs retry --on 0,255 -- true
  [ "$status" -eq 0 ]
}

@test "a failed write to standard output is an error: 'dibs status L >&-', 'dibs --help > /dev/full'" {
  echo 123 > p.lock  # a presence lock of another tool: status prints a line
  run sh -c 'dibs status p.lock >&-'
  echo "$output" >&3
  [ "$status" -ne 0 ]
  [[ "$output" == *"standard output"* ]]
  run sh -c 'dibs --help > /dev/full'
  [ "$status" -ne 0 ]
  run sh -c 'dibs status p.lock > /dev/full'
  [ "$status" -ne 0 ]
  run sh -c 'dibs status p.lock > /dev/null'
  [ "$status" -eq 0 ]
}

@test "an empty file at a lease lock's path (flock(1)'s lock file): says so and how to convert, not claim-record advice" {
  : > backup.lock
  run dibs lock -n backup.lock -- touch ran
  echo "$output" >&3
  # The library may take an empty file over (it holds no record); if it
  # does not, the message must say what the file is.
  if [ "$status" -ne 0 ]; then
    [ "$status" -eq 65 ]
    [[ "$output" == *"an empty file"* ]]
    [[ "$output" == *"--kernel"* ]]
    [[ "$output" != *"backup"*"restore"* ]]
    [ ! -e ran ]
  fi
}

@test "no password in any message: a store string with password=... or user:password@ is shown redacted" {
  run dibs claim 'nosuch:host=db password=s3cret' k -- true
  [ "$status" -eq 64 ]
  [[ "$output" != *s3cret* ]]
  [[ "$output" == *"password=***"* ]]
  run dibs claim "nosuch:password='s3 cret' host=db" k -- true
  [[ "$output" != *s3* ]]
  run dibs claim 'nosuch://bob:s3cret@db/x' k -- true
  [ "$status" -eq 64 ]
  [[ "$output" != *s3cret* ]]
  [[ "$output" == *"bob:***@db"* ]]
  run dibs claim 'postgres:postgresql://bob:s3cret@127.0.0.1:1/x?connect_timeout=1' k -- true
  echo "$output" >&3
  [[ "$output" != *s3cret* ]]
  run dibs claim 'postgres:host=127.0.0.1 port=1 password=s3cret connect_timeout=1' k -- true
  [[ "$output" != *s3cret* ]]
}

@test "dibs log on a nearly full filesystem says what needs the space and how much is free" {
  mkdir small
  mount -t tmpfs -o size=64k tmpfs small 2> /dev/null || skip "cannot mount a small tmpfs here (needs root)"
  run dibs log small/a.log hello
  umount small
  echo "$output" >&3
  [ "$status" -eq 74 ]
  [[ "$output" == *"lock file"*"needs "*" KiB"*" KiB free"* ]]
}

@test "messages name dibs, what failed and the file, never a C++ class of the library" {
  run dibs claim dir:no-such-dir/claims job-1 -- touch ran
  echo "$output" >&3
  [ "$status" -ne 0 ] && [ ! -e ran ]
  [[ "$output" == "dibs"* && "$output" == *"no-such-dir/claims"* ]]
  [[ "$output" != *"dibs::"* ]]
  run dibs log no-such-dir/app.log hello
  echo "$output" >&3
  [ "$status" -ne 0 ]
  [[ "$output" == *"no-such-dir/app.log"* && "$output" != *"dibs::"* ]]
  printf 'not a record\n' > x.lock
  run dibs lock x.lock touch ran
  echo "$output" >&3
  [ "$status" -eq 65 ] && [ ! -e ran ]
  [[ "$output" == *"x.lock"* && "$output" != *"dibs::"* ]]
}

@test "option values are named for what they take (DURATION, CODE, N), not CLI11's TEXT or INT ranges" {
  run dibs lock --help
  [[ "$output" == *"--wait,--timeout DURATION"* ]]
  [[ "$output" == *"--conflict-exit-code CODE"* ]]
  [[ "$output" == *"--lease DURATION=10s"* ]]
  # CLI11's own names, on an option's line: "  --keep INT", "  -E,--x INT:INT in [0 - 255]".
  for sub in lock log claim offer work retry once status; do
    if dibs "$sub" --help | grep -E -- '^ +-[^ ]+ (TEXT|INT|UINT|FLOAT|[A-Z]+:)'; then
      echo "dibs $sub --help names a value as CLI11 does" >&3
      false
    fi
  done
}
