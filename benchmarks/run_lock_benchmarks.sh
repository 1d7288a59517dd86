#!/usr/bin/env bash
# run_lock_benchmarks.sh: builds and runs the dibs::file_mutex and
# dibs::shared_log benchmarks (docs/BENCHMARKS.md has the figures):
#
#   1. uncontended lock+unlock (Google Benchmark, file_mutex_uncontended) and
#      Python filelock (py_filelock_uncontended.py)
#   2. contended: 2, 4, 8 processes (file_mutex_contended, py_filelock_contended.py)
#   3. shared_log: 8 processes appending 100-byte records (shared_log_throughput)
#
#   benchmarks/run_lock_benchmarks.sh [--quick] [--tmpfs] [--syscalls] [--no-build]
#
#   --quick      small counts, for a smoke test (the figures mean little)
#   --tmpfs      also run 1 and 3 with the files on /dev/shm
#   --syscalls   also count syscalls (strace -c) and ext4 inode dirtying
#                (perf stat tracepoints) per variant
#   --no-build   use the binaries already in the build directory
#
# Environment: BUILD_DIR (default <repo>/build/bench-locks), DIBS_BENCH_DIR
# (where the files go; default /var/tmp, on disk), PYTHON (default
# /usr/bin/python3, Debian's, which sees python3-filelock), OUT (default
# $BUILD_DIR/results: every output is kept there too).
# Missing Debian packages are installed with apt-get (as root).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build/bench-locks}
BENCH_DIR=${DIBS_BENCH_DIR:-/var/tmp}
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${OUT:-$BUILD_DIR/results}

quick=0 tmpfs=0 syscalls=0 build=1
for a in "$@"; do
  case $a in
    --quick) quick=1 ;;
    --tmpfs) tmpfs=1 ;;
    --syscalls) syscalls=1 ;;
    --no-build) build=0 ;;
    -h | --help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "run_lock_benchmarks.sh: unknown option $a (try --help)" >&2; exit 2 ;;
  esac
done

if ((quick)); then
  UNC_REPS=3 UNC_MIN_TIME=0.05 PY_ITER=20000 PY_RUNS=3
  CYCLES=5000 PY_CYCLES=2000 CONT_REPEAT=1
  LOG_RECORDS=10000 SEED_RECORDS=50 LOG_REPEAT=1
else
  UNC_REPS=10 UNC_MIN_TIME=0.2 PY_ITER=100000 PY_RUNS=7
  CYCLES=100000 PY_CYCLES=15000 CONT_REPEAT=5
  LOG_RECORDS=100000 SEED_RECORDS=200 LOG_REPEAT=5
fi

# --- packages -----------------------------------------------------------------
need=(cmake ninja-build g++ libbenchmark-dev libboost-dev libfmt-dev python3-filelock)
((syscalls)) && need+=(strace)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "== installing missing packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
"$PYTHON" -c 'import filelock' 2>/dev/null || {
  echo "run_lock_benchmarks.sh: $PYTHON cannot import filelock (python3-filelock is for Debian's /usr/bin/python3)" >&2
  exit 1
}

# --- build --------------------------------------------------------------------
if ((build)); then
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDIBS_BUILD_TESTS=OFF \
    -DDIBS_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$BUILD_DIR" --target file_mutex_uncontended file_mutex_contended shared_log_throughput
fi
BIN=$BUILD_DIR/benchmarks
mkdir -p "$OUT"

# Runs a command, printing it and keeping its output in $OUT/<name>.txt.
run() {
  local name=$1
  shift
  echo
  echo "== $name"
  echo "\$ $*"
  "$@" 2>&1 | tee "$OUT/$name.txt"
}

# --- the machine --------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "nproc: $(nproc)"
  echo "kernel: $(uname -r)"
  echo "g++: $(g++ --version | head -1)"
  echo "python: $("$PYTHON" --version 2>&1), filelock $("$PYTHON" -c 'import filelock; print(filelock.__version__)')"
  echo "boost: $(dpkg-query -W -f='${Version}' libboost-dev 2>/dev/null), google benchmark: $(dpkg-query -W -f='${Version}' libbenchmark-dev 2>/dev/null)"
  echo "bench dir: $BENCH_DIR on $(findmnt -n -o FSTYPE,SOURCE,OPTIONS -T "$BENCH_DIR")"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/machine.txt"

# --- 1. uncontended -----------------------------------------------------------
uncontended() {  # $1: suffix, $2: directory
  DIBS_BENCH_DIR=$2 run "uncontended$1" "$BIN/file_mutex_uncontended" --benchmark_repetitions=$UNC_REPS \
    --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
    --benchmark_min_time=$UNC_MIN_TIME --benchmark_out="$OUT/uncontended$1.json" --benchmark_out_format=json
  run "py_uncontended$1" "$PYTHON" "$ROOT/benchmarks/py_filelock_uncontended.py" --iterations $PY_ITER \
    --runs $PY_RUNS --dir "$2"
  # Ratios to the raw flock pair, from the medians.
  "$PYTHON" - "$OUT/uncontended$1.json" "$OUT/py_uncontended$1.txt" <<'EOF' | tee "$OUT/uncontended$1-summary.txt"
import json, re, sys
data = json.load(open(sys.argv[1]))
med = {b["run_name"]: b["real_time"] for b in data["benchmarks"] if b.get("aggregate_name") == "median"}
for line in open(sys.argv[2]):
    m = re.match(r"\| (filelock|py_flock) \| (\d+) \|", line)
    if m:
        med["python " + m.group(1)] = float(m.group(2))
floor = med["BM_raw_flock"]
print(f"\n# medians, ns per lock+unlock, ratio to BM_raw_flock ({floor:.0f} ns); goal for file_mutex: <= 1.5x")
print("| variant | ns/op | vs raw flock |")
print("|---|---:|---:|")
order = ["BM_raw_flock", "BM_raw_flock_pwrite", "BM_raw_ofd", "BM_raw_fcntl", "BM_file_mutex_flock",
         "BM_file_mutex_flock_no_owner", "BM_file_mutex_flock_scoped", "BM_file_mutex_posix",
         "BM_file_mutex_posix_no_owner", "BM_boost_file_lock", "python filelock", "python py_flock"]
for name in order + sorted(set(med) - set(order)):
    if name in med:
        print(f"| {name} | {med[name]:.0f} | {med[name] / floor:.2f}x |")
EOF
}
uncontended "" "$BENCH_DIR"

# --- 2. contended -------------------------------------------------------------
run contended "$BIN/file_mutex_contended" --procs 2,4,8 --cycles $CYCLES --repeat $CONT_REPEAT --dir "$BENCH_DIR"
run py_contended "$PYTHON" "$ROOT/benchmarks/py_filelock_contended.py" --procs 2,4,8 --cycles $PY_CYCLES \
  --repeat $CONT_REPEAT --dir "$BENCH_DIR"

# --- 3. shared_log ------------------------------------------------------------
run shared_log "$BIN/shared_log_throughput" --procs 8 --records $LOG_RECORDS --seed-records $SEED_RECORDS \
  --repeat $LOG_REPEAT --dir "$BENCH_DIR"
run shared_log_1proc "$BIN/shared_log_throughput" --procs 1 --records $((LOG_RECORDS * 2)) \
  --ways shared_log,raw_append,flock_append,fstat_append,lseek_append --repeat $LOG_REPEAT --dir "$BENCH_DIR"

# --- tmpfs --------------------------------------------------------------------
if ((tmpfs)); then
  uncontended "_tmpfs" /dev/shm
  run shared_log_tmpfs "$BIN/shared_log_throughput" --procs 8 --records $LOG_RECORDS --seed-records $SEED_RECORDS \
    --repeat $LOG_REPEAT --dir /dev/shm
fi

# --- syscalls -----------------------------------------------------------------
if ((syscalls)); then
  # strace -c: syscalls per cycle. One process, so every count is per cycle
  # times 20000 (plus a few for setup); each cycle also does one pread and one
  # pwrite of the counter.
  for l in raw_flock file_mutex file_mutex_no_owner file_mutex_posix raw_ofd boost_file_lock; do
    echo
    echo "== strace -c: $l, 1 process x 20000 cycles"
    strace -f -c -o "$OUT/strace-$l.txt" "$BIN/file_mutex_contended" --procs 1 --cycles 20000 --repeat 1 \
      --locks $l --dir "$BENCH_DIR" >/dev/null
    awk 'NR <= 2 || $4 + 0 >= 10000' "$OUT/strace-$l.txt"
  done
  echo
  echo "== strace -c: python filelock, 20000 acquire+release (plus 2000 of warm-up, and as many py_flock pairs)"
  strace -f -c -o "$OUT/strace-py.txt" "$PYTHON" "$ROOT/benchmarks/py_filelock_uncontended.py" --iterations 20000 \
    --runs 1 --dir "$BENCH_DIR" >/dev/null
  awk 'NR <= 2 || $4 + 0 >= 10000' "$OUT/strace-py.txt"
  for w in shared_log raw_append flock_append; do
    echo
    echo "== strace -c: $w, 8 processes x 20000 records"
    strace -f -c -o "$OUT/strace-log-$w.txt" "$BIN/shared_log_throughput" --procs 8 --records 20000 --repeat 1 \
      --ways $w --dir "$BENCH_DIR" >/dev/null
    awk 'NR <= 2 || $4 + 0 >= 1000' "$OUT/strace-log-$w.txt"
  done
  # perf stat on tracepoints counts syscalls without slowing them as strace does.
  if command -v perf >/dev/null && perf stat -e ext4:ext4_mark_inode_dirty,syscalls:sys_enter_futex true >/dev/null 2>&1; then
    for w in shared_log raw_append flock_append fstat_append lseek_append; do
      for p in 1 8; do
        echo
        echo "== perf stat: $w, $p process(es) x 100000 records"
        perf stat -e ext4:ext4_mark_inode_dirty,syscalls:sys_enter_newfstatat,syscalls:sys_enter_writev \
          -e syscalls:sys_enter_write,syscalls:sys_enter_lseek,syscalls:sys_enter_flock,syscalls:sys_enter_futex \
          -e context-switches \
          "$BIN/shared_log_throughput" --procs $p --records 100000 --repeat 1 --ways $w --dir "$BENCH_DIR" 2>&1 |
          grep -E '^\| '"$w"' |ext4|sys_enter|context' | tee -a "$OUT/perf-log.txt"
      done
    done
    for l in raw_flock file_mutex file_mutex_no_owner file_mutex_posix boost_file_lock; do
      for p in 1 8; do
        echo
        echo "== perf stat: $l, $p process(es) x 100000 cycles"
        perf stat -e ext4:ext4_mark_inode_dirty,syscalls:sys_enter_pwrite64,syscalls:sys_enter_flock \
          -e syscalls:sys_enter_fcntl,syscalls:sys_enter_futex,context-switches \
          "$BIN/file_mutex_contended" --procs $p --cycles 100000 --repeat 1 --locks $l --dir "$BENCH_DIR" 2>&1 |
          grep -E '^\| '"$l"' |ext4|sys_enter|context' | tee -a "$OUT/perf-lock.txt"
      done
    done
  else
    echo "(perf or its ext4 tracepoints are not available: inode dirtying not counted)"
  fi
fi

echo
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
echo "outputs in $OUT"
