#!/usr/bin/env bash
# Runs a preset's tests N times in a row with the machine loaded, and prints
# each failure with its test and run: flakes are found here, before CI
# finds them.
#
#   scripts/soak.sh [-n RUNS] [-p PRESET] [-t TESTPRESET] [--no-load] [-- CTEST_ARGS...]
#
#   -n RUNS     how many runs (default 20)
#   -p PRESET   the workflow preset whose build and tests are used (default
#               default); it is configured and built first if needed
#   -t TESTPRESET  the test preset, if not PRESET's own: `-t full` runs the
#               default build's tests in full, the chaos runs with them
#   --no-load   run on a quiet machine
#   CTEST_ARGS  passed to ctest, e.g. -L unit, -LE chaos, -R 'lock_test'
#
# The load is what CI's neighbours do to a test: `stress-ng --cpu 2 --io 1`
# (all cores busy, and a writer that syncs the disk), or, without stress-ng,
# two busy loops and a `dd ... conv=fsync` loop. It is stopped when the
# script ends, however it ends.
#
# Output: one line per run (its failures), then a table of every test that
# failed at least once: how many runs it failed and which. Exit 0 when every
# run passed, 1 otherwise. Each run's ctest log is kept in
# build/PRESET/soak/run-K.log.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=20
preset=default
test_preset=
load=1
ctest_args=()
while (($#)); do
  case $1 in
    -n) runs=$2; shift ;;
    -p) preset=$2; shift ;;
    -t) test_preset=$2; shift ;;
    --no-load) load=0 ;;
    --) shift; ctest_args=("$@"); break ;;
    -h | --help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "soak.sh: unknown argument '$1' (see --help)" >&2; exit 64 ;;
  esac
  shift
done
if ! [[ $runs =~ ^[1-9][0-9]*$ ]]; then
  echo "soak.sh: -n takes a number of runs, not '$runs'" >&2
  exit 64
fi

scripts/install-deps.sh --preset "$preset"
build=build/$preset
# Configured every time, not only when the build directory is new: a
# preset whose cache variables changed (an optimisation level) is soaked as
# the preset now says, not as it was first built.
cmake --preset "$preset" > /dev/null
cmake --build --preset "$preset"

load_pids=()
stop_load() {
  if ((${#load_pids[@]})); then kill "${load_pids[@]}" 2>/dev/null || true; fi
  wait 2>/dev/null || true
  rm -f "$build/soak/dd.out"
}
trap stop_load EXIT
mkdir -p "$build/soak"
if ((load)); then
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu 2 --io 1 --timeout 0 --quiet &
    load_pids+=($!)
    echo "soak: load: stress-ng --cpu 2 --io 1"
  else
    for _ in 1 2; do (while :; do :; done) & load_pids+=($!); done
    (while :; do dd if=/dev/zero of="$build/soak/dd.out" bs=1M count=64 conv=fsync status=none; done) &
    load_pids+=($!)
    echo "soak: load: two busy loops and a dd ... conv=fsync loop"
  fi
fi

declare -A failed_runs=()
bad=0
start=$SECONDS
for ((k = 1; k <= runs; ++k)); do
  log=$build/soak/run-$k.log
  t0=$SECONDS
  if ctest --preset "${test_preset:-$preset}" "${ctest_args[@]}" > "$log" 2>&1; then
    echo "soak: run $k/$runs passed ($((SECONDS - t0)) s)"
    continue
  fi
  bad=$((bad + 1))
  # ctest's summary lists each failed test as "  NUMBER - NAME (Failed|Timeout|...)".
  failures=$(sed -n '/The following tests FAILED:/,$p' "$log" | grep -E '^[[:space:]]+[0-9]+ - ' |
             sed -E 's/^[[:space:]]+[0-9]+ - //' || true)
  if [ -z "$failures" ]; then failures="(ctest failed without a failed test: see $log)"; fi
  echo "soak: run $k/$runs FAILED ($((SECONDS - t0)) s):"
  while IFS= read -r f; do
    echo "  $f"
    failed_runs[$f]+=" $k"
  done <<<"$failures"
done

echo
echo "soak: $((runs - bad)) of $runs runs passed in $((SECONDS - start)) s (preset ${test_preset:-$preset}${ctest_args[*]:+, ctest ${ctest_args[*]}}$( ((load)) && echo ", loaded"))"
if ((bad)); then
  echo "soak: tests that failed, with the runs they failed in (logs in $build/soak/):"
  for f in "${!failed_runs[@]}"; do
    printf '  %s: runs%s\n' "$f" "${failed_runs[$f]}"
  done
  exit 1
fi
