#!/usr/bin/env bash
# Builds and runs the lock_file / marker_claim / store benchmarks and writes
# every raw result and a summary to one directory (docs/benchmarks-history.md
# describes them and records one session):
#
#   benchmarks/run_store_benchmarks.sh [output-dir]
#
# Environment: BUILD (build dir, default build/bench-store), REPS (runs per
# configuration, default 5), GB_REPS (Google Benchmark repetitions, default 10),
# CYCLES (contended cycles per process, default 10000), ITEMS (marker_claim
# items, default 20000), ROUNDS (rounds under strace, default 2000),
# TMPDIR (where the lock files go; default /tmp).
# Installs liblockfile-dev, python3-filelock and strace with apt-get where
# missing (as root, or through sudo).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build/bench-store}
OUT=${1:-$BUILD/store-results}
REPS=${REPS:-5}
GB_REPS=${GB_REPS:-10}
CYCLES=${CYCLES:-10000}
ITEMS=${ITEMS:-20000}
ROUNDS=${ROUNDS:-2000}
export TMPDIR=${TMPDIR:-/tmp}
BIN=$BUILD/benchmarks
RUNNER=$ROOT/benchmarks/store_bench_runner.py

# --- packages -----------------------------------------------------------------
missing=()
for pkg in liblockfile-dev python3-filelock strace; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  SUDO=
  [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update
  $SUDO apt-get install -y "${missing[@]}"
fi

# --- build --------------------------------------------------------------------
# The headers are compiled in: what the binaries measure is the tree at this moment.
build_commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
if git -C "$ROOT" diff --quiet HEAD -- include/ 2>/dev/null; then build_tree="as committed"; else build_tree="with uncommitted changes"; fi
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDIBS_BUILD_TESTS=OFF -DDIBS_BUILD_EXAMPLES=OFF
cmake --build "$BUILD" --target store_lock_uncontended store_lock_loop store_lock_contended store_marker_claim

mkdir -p "$OUT"
SUMMARY=$OUT/summary.md
: >"$SUMMARY"
say() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
load() { say "load average before this step: $(cut -d' ' -f1-3 /proc/loadavg)"; }

# Is the liblockfile comparison built?
probe=$(mktemp -d)
if "$BIN/store_lock_loop" liblockfile 1 "$probe" >/dev/null 2>&1; then have_llf=1; else have_llf=0; fi
rm -rf "$probe"
lock_impls=floor$([[ $have_llf == 1 ]] && echo ,liblockfile),dibs-norenew,dibs
contended_impls=dibs,dibs-norenew,floor$([[ $have_llf == 1 ]] && echo ,liblockfile),softfilelock

# --- machine ------------------------------------------------------------------
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
say "# store benchmarks, $(date -u '+%Y-%m-%d %H:%M UTC')"
say ""
say "- nproc: $(nproc); CPU: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
say "- kernel: $(uname -sr)"
say "- compiler: $("$cxx" --version | head -1) (CMAKE_BUILD_TYPE=Release)"
say "- lock files in: $TMPDIR, $(findmnt -n -o FSTYPE,SOURCE,OPTIONS -T "$TMPDIR")"
say "- filelock: $(/usr/bin/python3 -c 'import filelock; print(filelock.__version__)'), python $(/usr/bin/python3 -c 'import platform; print(platform.python_version())')"
say "- liblockfile: $(dpkg-query -W -f='${Version}' liblockfile1 2>/dev/null || echo 'not installed') (comparison built: $have_llf)"
say "- dibs commit: $build_commit; include/ at build time: $build_tree"
say ""

# --- 1. uncontended lock+unlock -----------------------------------------------
# Repetitions of all benchmarks are run in random interleaved order, so load
# that comes and goes hits every one of them alike.
say "## 1. uncontended lock+unlock (Google Benchmark, $GB_REPS repetitions, interleaved)"
load
"$BIN/store_lock_uncontended" --benchmark_repetitions="$GB_REPS" --benchmark_report_aggregates_only=true \
  --benchmark_enable_random_interleaving=true \
  --benchmark_out="$OUT/uncontended.json" --benchmark_out_format=json | tee "$OUT/uncontended.txt"
grep -E '_(median|mean|stddev|cv) ' "$OUT/uncontended.txt" | grep median >>"$SUMMARY" || true

say ""
say "### 1b. diagnostic: the same on tmpfs (/dev/shm), $((GB_REPS / 2)) repetitions"
load
TMPDIR=/dev/shm "$BIN/store_lock_uncontended" --benchmark_repetitions="$((GB_REPS / 2))" \
  --benchmark_report_aggregates_only=true --benchmark_enable_random_interleaving=true | tee "$OUT/uncontended-tmpfs.txt"
grep median "$OUT/uncontended-tmpfs.txt" >>"$SUMMARY" || true

say ""
say "### 1c. system calls per round"
load
mkdir -p "$OUT/strace"
/usr/bin/python3 "$RUNNER" syscalls --bin "$BIN" --rounds "$ROUNDS" --impls "$lock_impls" --keep "$OUT/strace" |
  tee -a "$SUMMARY"

if command -v perf >/dev/null 2>&1; then
  say ""
  say "### 1d. where dibs-norenew blocks and spends CPU (perf; see $OUT/perf-*.txt)"
  d=$(mktemp -d)
  if perf record -q -o "$d/sched.data" -e sched:sched_switch -g "$BIN/store_lock_loop" dibs-norenew 1000 "$d" \
      >/dev/null 2>&1; then
    perf report -i "$d/sched.data" --stdio --no-children -G 2>/dev/null >"$OUT/perf-sched-dibs-norenew.txt" || true
  fi
  rm -f "$d"/*.lock
  if perf record -q -o "$d/cpu.data" -e cpu-clock -F 10000 -g "$BIN/store_lock_loop" dibs-norenew 2000 "$d" \
      >/dev/null 2>&1; then
    perf report -i "$d/cpu.data" --stdio --children --sort sym 2>/dev/null |
      grep -E '^ +[0-9]' | head -80 >"$OUT/perf-cpu-dibs-norenew.txt" || true
  fi
  rm -rf "$d"
  # Disk requests the process itself queues, by kind (W write, DS discard+sync, ...).
  say ""
  say "block requests queued per lock+unlock round (perf block:block_bio_queue, 1000 rounds plus one warm-up):"
  for impl in ${lock_impls//,/ }; do
    d=$(mktemp -d)
    if perf record -q -o "$d/bio.data" -e block:block_bio_queue "$BIN/store_lock_loop" "$impl" 1000 "$d" \
        >/dev/null 2>&1; then
      kinds=$(perf script -i "$d/bio.data" 2>/dev/null |
        awk '{for (i = 1; i < NF; i++) if ($i ~ /^[0-9]+,[0-9]+$/) { n[$(i + 1)]++; break }}
             END { for (k in n) printf "%s %.2f  ", k, n[k] / 1001 }')
      say "- $impl: ${kinds:-none}"
    fi
    rm -rf "$d"
  done
fi

# --- 2. contended -------------------------------------------------------------
say ""
say "## 2. contended: 2, 4, 8 processes, $CYCLES cycles each, $REPS runs per configuration"
load
/usr/bin/python3 "$RUNNER" contended --bin "$BIN" --reps "$REPS" --cycles "$CYCLES" --impls "$contended_impls" \
  ${CONTENDED_CYCLES_FOR:+--cycles-for "$CONTENDED_CYCLES_FOR"} --json "$OUT/contended.jsonl" | tee -a "$SUMMARY"

say ""
say "### 2b. diagnostic: system calls of one contended run of dibs-norenew (8 processes x 250 cycles, strace -f -c)"
strace -f -c -o "$OUT/strace/strace-c-contended-dibs-norenew-8x250.txt" \
  "$BIN/store_lock_contended" --impl dibs-norenew --procs 8 --cycles 250 | tee -a "$SUMMARY"

# --- 3. marker_claim ----------------------------------------------------------
say ""
say "## 3. marker_claim claim+complete, $ITEMS items, $REPS runs per configuration"
load
/usr/bin/python3 "$RUNNER" claims --bin "$BIN" --reps "$REPS" --items "$ITEMS" --json "$OUT/claims.jsonl" |
  tee -a "$SUMMARY"
d=$(mktemp -d)
strace -f -c -o "$OUT/strace/strace-c-marker-claim-file.txt" \
  "$BIN/store_marker_claim" --store file --procs 1 --items 2000 --check 0 --dir "$d" >/dev/null
rm -rf "$d"
say ""
say "(system calls of 2000 file_store claim+complete in one process: $OUT/strace/strace-c-marker-claim-file.txt)"
load
echo "== done: $OUT"
