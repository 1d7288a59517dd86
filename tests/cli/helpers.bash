# Shared by the dibs command's bats tests. The dibs under test is the one on
# PATH (ctest puts the build's first).

# Under the asan preset, no leak check at each dibs's exit: LeakSanitizer
# stops the exiting process's threads with a ptrace tracer, and amid the
# chaos tests' SIGKILLs that tracer fails ("Unable to get registers from
# thread N") and leaves the dibs spinning at its exit (state R) for good, as
# CI saw. The library's leaks are checked by the unit tests; later keys of
# ASAN_OPTIONS win over earlier ones; without ASan this changes nothing.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"

setup() {
  cd "$BATS_TEST_TMPDIR"
}

# nap SECONDS: a pause that starts no process. sleep(1) is a process: in the
# loops that pause a few milliseconds between steps, its starts cost more
# CPU than the test's own work (dibs log's test spent most of its 44 s of
# CPU starting sleep and pkill). A read that times out on a FIFO this shell
# holds open for both reading and writing, which nothing ever writes to.
nap() {
  if [ -z "${_dibs_nap_fd:-}" ]; then
    local fifo
    fifo=$(mktemp -u "${BATS_TEST_TMPDIR:-${TMPDIR:-/tmp}}/nap.XXXXXX")
    mkfifo "$fifo"
    exec {_dibs_nap_fd}<>"$fifo"
    rm -f "$fifo"
  fi
  read -r -t "$1" -u "$_dibs_nap_fd" _ || :
}

# Prints the pids of the dibs processes that are children of the given pids
# (the test's own loops), so a chaos killer never touches another test's.
dibs_children() {
  local IFS=,
  pgrep -x dibs -P "$*" 2>/dev/null || true
}

# kill_random_dibs TARGET PERIOD PID...: about every PERIOD seconds,
# SIGKILLs a random dibs child of the PIDs, until TARGET kills have landed
# (or 120 s have passed, or all the PIDs have ended); prints how many it
# killed. The PIDs' loops should run until the test says stop after this
# returns, so that the kills do not depend on how fast the machine works
# through a fixed amount of work.
kill_random_dibs() {
  local target=$1 period=$2 killed=0 p alive end=$((SECONDS + 120))
  shift 2
  while ((killed < target && SECONDS < end)); do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    nap "$period"
    mapfile -t victims < <(dibs_children "$@")
    ((${#victims[@]})) || continue
    kill -KILL "${victims[RANDOM % ${#victims[@]}]}" 2>/dev/null && killed=$((killed + 1))
  done
  echo "$killed"
}

# kill_dibs_while_running TARGET PERIOD PID...: every PERIOD seconds,
# SIGKILLs the dibs children of the PIDs running at that instant, until
# TARGET were killed, all the PIDs have ended or 120 s have passed; prints
# how many it killed. For dibs processes that live a millisecond or two:
# pkill kills what it finds as it finds it, where a pgrep-then-kill often
# finds its victim gone.
kill_dibs_while_running() {
  local target=$1 period=$2 killed=0 p alive n end=$((SECONDS + 120))
  shift 2
  local IFS=,
  local parents="$*"
  unset IFS
  while ((killed < target && SECONDS < end)); do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    nap "$period"
    n=$(pkill -KILL -e -x dibs -P "$parents" 2>/dev/null | wc -l)
    killed=$((killed + n))
  done
  echo "$killed"
}

# wait_until WHAT COMMAND...: runs COMMAND every 50 ms until it succeeds, for
# up to 20 s; says WHAT on standard error and fails if it never does. A
# fixed sleep is not enough where every dibs start is slow (a sanitizer build).
wait_until() {
  local what=$1
  shift
  for ((i = 0; i < 400; i++)); do
    "$@" && return 0
    sleep 0.05
  done
  echo "$what after 20 s" >&2
  return 1
}

kernel_lock_held() { ! flock -n "$1" true; }

# wait_for_record FILE: until a lease lock's record is in FILE, that is until
# dibs lock holds it.
wait_for_record() { wait_until "no lock record in $1" test -s "$1"; }

# wait_for_kernel_lock FILE: until FILE's kernel lock is held by someone.
wait_for_kernel_lock() { wait_until "nobody took the kernel lock of $1" kernel_lock_held "$1"; }

# A COMMAND for a holder that must hold until the test says so, however slow
# the machine: it creates ./held once it runs, and ends once ./release exists.
# A fixed `sleep N` holder can end before a loaded sanitizer run has looked.
HOLD='touch held; while [ ! -e release ]; do sleep 0.05; done'

# wait_for_file FILE: until FILE exists.
wait_for_file() { wait_until "no $1" test -e "$1"; }

# wait_for_kernel_free FILE: until nobody holds FILE's kernel lock.
wait_for_kernel_free() { wait_until "the kernel lock of $1 was still held" flock -n "$1" true; }

# queued PID QUEUE: PID holds a ticket in a lock_file's waiter queue (the
# file .dibs-queue.NAME beside lock file NAME): it has queued, and a waiter
# that queues after it is behind it. The page's layout is that of
# include/dibs/detail/posix/waiter_queue.hpp: a 64-byte header, then slots
# of 64 bytes: ticket (8 bytes, 0 if free), wake (4), pid (4).
queued() {
  od -An -v -t d4 -w64 -j 64 "$2" 2>/dev/null | awk -v p="$1" '$4 == p && ($1 != 0 || $2 != 0) { f = 1 } END { exit !f }'
}

# flock_waiter FILE: someone is blocked in flock(2) on FILE (a "->" line
# of /proc/locks on its inode): a -w locker is waiting, not yet running.
flock_waiter() {
  local ino
  ino=$(stat -c %i "$1") || return 1
  grep -Eq -- "-> FLOCK .*:$ino " /proc/locks
}

# wait_while_growing FILE SECONDS PID...: waits until the PIDs have ended,
# as long as FILE keeps growing: if it stays the same size for SECONDS while
# some still run, they are stuck (a dibs waiting for something that never
# comes): prints what each of their dibs children is doing (its state and
# kernel wait channel), kills them, and fails, so a hang is a failure that
# says where, not a ctest timeout.
wait_while_growing() {
  local file=$1 quiet=$2 size last_size=-1 since=$SECONDS p alive d
  shift 2
  for (( ; ; )); do
    alive=()
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
    ((${#alive[@]})) || break
    size=$(stat -c %s "$file" 2>/dev/null || echo 0)
    if [ "$size" != "$last_size" ]; then
      last_size=$size
      since=$SECONDS
    elif ((SECONDS - since >= quiet)); then
      echo "$file did not grow for $quiet s while ${#alive[@]} loops still ran; their dibs processes:" >&2
      for d in $(dibs_children "${alive[@]}"); do
        echo "  pid $d: $(tr '\0' ' ' < "/proc/$d/cmdline" 2>/dev/null | head -c 120)" \
          "state $(awk '{ print $3 }' "/proc/$d/stat" 2>/dev/null) wchan $(cat "/proc/$d/wchan" 2>/dev/null)" >&2
      done
      kill -KILL "${alive[@]}" $(dibs_children "${alive[@]}") 2>/dev/null
      return 1
    fi
    sleep 0.2
  done
  wait "$@" 2>/dev/null || true
}
