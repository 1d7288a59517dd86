#!/usr/bin/env bats
# dibs under the names flock, lockfile and dotlockfile (tools/compat_names.hpp)
# against the real util-linux flock(1), procmail lockfile(1) and liblockfile
# dotlockfile: the same script lines run against both, comparing exit codes
# and effects (the files left, their first line and mode), and each tool
# against the other on one lock file. The build makes the names as links to
# dibs in compat/ beside it. Where dibs differs on purpose
# (docs/guide-shell.md), the test says so.
load helpers

COMPAT="$(dirname "$(command -v dibs)")/compat"

setup() {
  cd "$BATS_TEST_TMPDIR"
  for n in flock lockfile dotlockfile; do
    [ -x "$COMPAT/$n" ] || { echo "no $COMPAT/$n: the build makes it (tools/CMakeLists.txt)" >&2; return 1; }
  done
}

teardown() {
  touch "$BATS_TEST_TMPDIR/release"
}

# need_real NAME: skips the test unless the system's own NAME is in
# /usr/bin (and is not dibs).
need_real() {
  [ -x "/usr/bin/$1" ] || skip "no /usr/bin/$1 to compare with"
  [ "$(readlink -f "/usr/bin/$1")" != "$(readlink -f "$(command -v dibs)")" ] || skip "/usr/bin/$1 is dibs"
}

# effect TOOL SETUP ARGS...: in a fresh directory prepared by the shell
# snippet SETUP, runs TOOL ARGS and prints its exit code and, for each file
# left, its name, mode and first line.
effect() {
  local tool=$1 setup=$2 d
  shift 2
  d=$(mktemp -d "$BATS_TEST_TMPDIR/run.XXXXXX")
  (
    cd "$d" || exit 99
    eval "$setup"
    "$tool" "$@" > /dev/null 2>&1
    echo "exit $?"
    for f in $(ls -A | sort); do
      echo "$f $(stat -c %a "$f") $(head -n 1 "$f" | head -c 40)"
    done
  )
}

# same_effect NAME SETUP ARGS...: the real NAME and dibs as NAME leave the
# same exit code and the same files.
same_effect() {
  local name=$1 setup=$2 real mine
  shift 2
  real=$(effect "/usr/bin/$name" "$setup" "$@")
  mine=$(effect "$COMPAT/$name" "$setup" "$@")
  if [ "$real" != "$mine" ]; then
    printf '%s %s (set-up: %s)\n--- real:\n%s\n--- dibs:\n%s\n' "$name" "$*" "$setup" "$real" "$mine" >&2
    return 1
  fi
}

# ms: now in milliseconds.
ms() { echo $(($(date +%s%N) / 1000000)); }

@test "flock: the same command lines exit with flock(1)'s codes (conflict, usage 64, bad descriptor 65, exec 69)" {
  need_real flock
  # A real flock holder of x in the run's directory, until the test ends.
  local held='flock x sh -c "touch held; while [ ! -e ../release ]; do sleep 0.05; done" > /dev/null 2>&1 &
    while [ ! -e held ]; do sleep 0.01; done'
  same_effect flock '' x true
  same_effect flock '' x sh -c 'exit 7'
  same_effect flock '' x -c 'exit 5'
  same_effect flock '' x --command 'exit 5'
  same_effect flock '' x -c
  same_effect flock '' x -c a b
  same_effect flock '' -c true x
  same_effect flock '' x
  same_effect flock '' 12abc
  same_effect flock '' 99
  same_effect flock ''
  same_effect flock '' -z x true
  same_effect flock '' -w abc x true
  same_effect flock '' -w 1s x true
  same_effect flock '' -w -1 x true
  same_effect flock '' -E abc x true
  same_effect flock '' -E 256 x true
  same_effect flock '' -o -F x true
  same_effect flock '' x nonexistent-command
  same_effect flock '' -F x nonexistent-command
  same_effect flock '' x -- true
  same_effect flock '' -- x true
  same_effect flock '' --nb x true
  same_effect flock '' --non x true
  same_effect flock '' --ver
  same_effect flock '' -h
  same_effect flock '' /nonexistent/x true
  same_effect flock "$held" -n x true
  same_effect flock "$held" -n -E 7 x true
  same_effect flock "$held" -w 0.2 x true
  same_effect flock "$held" -nw 3 x true
  same_effect flock "$held" -w0 -E 3 x true
  same_effect flock "$held" -n -u x true
  touch release
}

@test "flock: dibs as flock and flock(1) exclude each other; a conflict is silent; shared holders share" {
  need_real flock
  for holder in /usr/bin/flock "$COMPAT/flock"; do
    for other in /usr/bin/flock "$COMPAT/flock"; do
      rm -f held release
      "$holder" x.lock sh -c "$HOLD" &
      wait_for_file held
      run "$other" -n x.lock true
      [ "$status" -eq 1 ]
      [ -z "$output" ]
      run "$other" -w 0.2 -E 9 x.lock true
      [ "$status" -eq 9 ]
      run "$other" -n -s x.lock true
      [ "$status" -eq 1 ]
      touch release
      wait
      rm -f held release
      "$holder" -s x.lock sh -c "$HOLD" &
      wait_for_file held
      run "$other" -n -s x.lock true
      [ "$status" -eq 0 ]
      run "$other" -n x.lock true
      [ "$status" -eq 1 ]
      touch release
      wait
    done
  done
}

@test "flock NUMBER locks the shell's own descriptor, which keeps the lock after flock ends; -u frees it" {
  need_real flock
  for tool in /usr/bin/flock "$COMPAT/flock"; do
    exec 9> fd.lock
    run "$tool" -n 9
    [ "$status" -eq 0 ]
    run /usr/bin/flock -n fd.lock true
    [ "$status" -eq 1 ]
    run "$COMPAT/flock" -n fd.lock true
    [ "$status" -eq 1 ]
    run "$tool" -u 9
    [ "$status" -eq 0 ]
    run /usr/bin/flock -n fd.lock true
    [ "$status" -eq 0 ]
    exec 9>&-
  done
}

@test "flock --verbose and -c say and run what flock(1) does" {
  need_real flock
  for tool in /usr/bin/flock "$COMPAT/flock"; do
    run "$tool" --verbose v.lock true
    [ "$status" -eq 0 ]
    [[ "${lines[0]}" =~ ^flock:\ getting\ lock\ took\ [0-9]+\.[0-9]{6}\ seconds$ ]]
    [ "${lines[1]}" = "flock: executing true" ]
    run "$tool" v.lock -c 'echo "$0 ran"; exit 4'
    [ "$status" -eq 4 ]
    [[ "$output" == *" ran" ]]
  done
}

@test "lockfile: the same lines leave the same files (read-only, \"0\") with lockfile(1)'s codes" {
  need_real lockfile
  local held='echo 0 > held.lock' old='echo 0 > old.lock; touch -d "-60 seconds" old.lock'
  same_effect lockfile '' a.lock
  same_effect lockfile '' a.lock b.lock
  same_effect lockfile "$held" -r 0 held.lock
  same_effect lockfile "$held" -r0 held.lock
  same_effect lockfile "$held" -r 0 c.lock held.lock  # c.lock made, then removed
  same_effect lockfile "$held" -! -r 0 held.lock
  same_effect lockfile '' -! -r 0 free.lock  # made, and exit 73
  same_effect lockfile '' -r0 -! -! e.lock
  same_effect lockfile '' -r 0 /nonexistent/x.lock
  same_effect lockfile '' -! -r 0 /nonexistent/x.lock  # 69 is not inverted
  same_effect lockfile ''
  same_effect lockfile '' -r 0
  same_effect lockfile '' -z x.lock
  same_effect lockfile '' -r
  same_effect lockfile '' -r abc d.lock
  same_effect lockfile '' f.lock -z  # f.lock made, then removed
  same_effect lockfile '' -v
  same_effect lockfile '' -r 0 ./-dash.lock
  same_effect lockfile "$old" -l 10 -s 0 -r 0 old.lock  # forced: older than -l
  same_effect lockfile "$old" -l 100 -s 0 -r 0 old.lock  # not forced: younger
  same_effect lockfile "$old" -r 0 old.lock  # no -l: never forced
}

@test "lockfile: dibs as lockfile and lockfile(1) exclude each other; rm -f frees the lock" {
  need_real lockfile
  for holder in /usr/bin/lockfile "$COMPAT/lockfile"; do
    for other in /usr/bin/lockfile "$COMPAT/lockfile"; do
      run "$holder" -r 0 m.lock
      [ "$status" -eq 0 ]
      [ "$(cat m.lock)" = 0 ]
      run "$other" -r 0 m.lock
      [ "$status" -eq 73 ]
      [[ "$output" == *'Sorry, giving up on "m.lock"'* ]]
      run "$other" -! -r 0 m.lock
      [ "$status" -eq 0 ]
      [ -e m.lock ]
      rm -f m.lock
      run "$other" -r 0 m.lock
      [ "$status" -eq 0 ]
      rm -f m.lock
    done
  done
}

@test "lockfile: the retries run out after the pauses (-1 -r 1: one pause of 1 s) with 73, or 0 with -!" {
  need_real lockfile
  echo 0 > held.lock
  for tool in /usr/bin/lockfile "$COMPAT/lockfile"; do
    local start
    start=$(ms)
    run "$tool" -1 -r 1 held.lock
    [ "$status" -eq 73 ]
    (($(ms) - start >= 1000))
    run "$tool" -1 -r 1 -! held.lock
    [ "$status" -eq 0 ]
    [ "$(cat held.lock)" = 0 ]
  done
}

@test "lockfile -ml and -mu: refused by dibs with a message saying what to use" {
  run "$COMPAT/lockfile" -ml
  [ "$status" -eq 69 ]
  [[ "$output" == *"setgid"* ]]
  run "$COMPAT/lockfile" -r 0 a.lock -mu
  [ "$status" -eq 69 ]
  [ ! -e a.lock ]  # what was made before it is removed
}

@test "dotlockfile: the same lines leave the same files with dotlockfile's codes" {
  need_real dotlockfile
  local held='printf "0\n" > held.lock'
  same_effect dotlockfile '' a.lock
  same_effect dotlockfile '' -l a.lock
  same_effect dotlockfile "$held" -r 0 held.lock
  same_effect dotlockfile "$held" -i 0 -r 1 held.lock
  same_effect dotlockfile "$held" -c held.lock
  same_effect dotlockfile '' -c nope.lock
  same_effect dotlockfile '' -t nope.lock
  same_effect dotlockfile "$held" -t held.lock
  same_effect dotlockfile "$held" -u held.lock
  same_effect dotlockfile '' -u nope.lock
  same_effect dotlockfile ''
  same_effect dotlockfile '' -l
  same_effect dotlockfile '' -z a.lock
  same_effect dotlockfile '' -h
  same_effect dotlockfile '' -r abc a.lock
  same_effect dotlockfile '' -r -2 a.lock
  same_effect dotlockfile '' -i -1 a.lock
  same_effect dotlockfile '' /nonexistent/a.lock
  same_effect dotlockfile '' -q /nonexistent/a.lock
  same_effect dotlockfile '' -l -u d.lock
  same_effect dotlockfile "$held" -u held.lock b.lock
  same_effect dotlockfile '' c.lock sh -c 'exit 3'
  same_effect dotlockfile '' -P c.lock sh -c 'exit 3'
  same_effect dotlockfile '' c.lock nonexistent-command
  same_effect dotlockfile '' -P c.lock nonexistent-command
  same_effect dotlockfile "$held" -P -r 0 held.lock sh -c 'exit 0'
  same_effect dotlockfile '' -P -r 0 e.lock sh -c 'exit 4'
}

@test "dotlockfile: -t renews the mtime, -c sees the lock, -u removes it, for a lock of either tool" {
  need_real dotlockfile
  for maker in /usr/bin/dotlockfile "$COMPAT/dotlockfile"; do
    for tool in /usr/bin/dotlockfile "$COMPAT/dotlockfile"; do
      run "$tool" -c t.lock
      [ "$status" -eq 1 ]
      run "$maker" t.lock
      [ "$status" -eq 0 ]
      run "$tool" -c t.lock
      [ "$status" -eq 0 ]
      touch -d '-2 minutes' t.lock
      run "$tool" -t t.lock
      [ "$status" -eq 0 ]
      [ -n "$(find t.lock -newermt '-1 minute')" ]
      run "$tool" -u t.lock
      [ "$status" -eq 0 ]
      [ ! -e t.lock ]
    done
  done
}

@test "dotlockfile -p: the caller's pid; the lock outlives dotlockfile until -u in another call" {
  need_real dotlockfile
  for tool in /usr/bin/dotlockfile "$COMPAT/dotlockfile"; do
    # Not under `run`: the caller is this test's shell, alive throughout.
    "$tool" -p p.lock
    [ "$(head -n 1 p.lock)" = "$BASHPID" ]
    for other in /usr/bin/dotlockfile "$COMPAT/dotlockfile"; do
      run "$other" -r 0 p.lock
      [ "$status" -eq 4 ]
      run "$other" -p -r 0 p.lock
      [ "$status" -eq 4 ]
      run "$other" -p -c p.lock
      [ "$status" -eq 0 ]
    done
    "$tool" -u p.lock
    [ ! -e p.lock ]
  done
}

@test "dotlockfile -p: once its caller has ended, the lock is broken at once by dotlockfile -p, and by dibs on proof" {
  need_real dotlockfile
  # The caller: a shell that ends after dotlockfile (not exec'd: two commands).
  sh -c '"$0" -p gone.lock; true' "$COMPAT/dotlockfile"
  [ -e gone.lock ]
  run /usr/bin/dotlockfile -r 0 gone.lock  # without -p it goes by age alone
  [ "$status" -eq 4 ]
  run /usr/bin/dotlockfile -p -r 0 gone.lock
  [ "$status" -eq 0 ]
  /usr/bin/dotlockfile -u gone.lock
  sh -c '"$0" -p gone.lock; true' "$COMPAT/dotlockfile"
  run "$COMPAT/dotlockfile" -r 0 gone.lock  # its record proves the caller gone
  [ "$status" -eq 0 ]
}

@test "dotlockfile with COMMAND: held while COMMAND runs, against the other tool; removed after" {
  need_real dotlockfile
  for holder in /usr/bin/dotlockfile "$COMPAT/dotlockfile"; do
    for other in /usr/bin/dotlockfile "$COMPAT/dotlockfile"; do
      rm -f held release
      "$holder" h.lock sh -c "$HOLD" &
      wait_for_file held
      [ -e h.lock ]
      run "$other" -r 0 h.lock
      [ "$status" -eq 4 ]
      run "$other" -P -r 0 h.lock true
      [ "$status" -eq 4 ]
      run "$other" -c h.lock
      [ "$status" -eq 0 ]
      touch release
      wait
      [ ! -e h.lock ]
    done
  done
}

@test "dotlockfile: the retries run out after the pauses (-i 1 -r 1: one pause of 1 s) with 4" {
  need_real dotlockfile
  printf '0\n' > held.lock
  for tool in /usr/bin/dotlockfile "$COMPAT/dotlockfile"; do
    local start
    start=$(ms)
    run "$tool" -i 1 -r 1 held.lock
    [ "$status" -eq 4 ]
    (($(ms) - start >= 1000))
    [ "$(cat held.lock)" = 0 ]
  done
}
