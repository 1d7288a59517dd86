#!/usr/bin/env bash
# The lock_file handoff figure of issue 21, side by side with a baseline:
# 8 processes each asking again at once after their unlock
# (store_lock_contended), built against the headers of BASE and of the
# work tree, run alternately REPS times in one session; and, in the same
# rounds, the floors a handoff is made of: an uncontended lock+unlock
# (store_lock_loop, the two record writes of a handoff) and a bare futex
# handoff between processes (handoff_floor). Prints the medians over the
# rounds and keeps every output (docs/benchmarks-history.md records sessions):
#
#   benchmarks/run_handoff_benchmarks.sh [BASE]      (default BASE: 3d40969, before the queue)
#
# Environment: OUT (default build/bench-handoff), REPS (default 7), PROCS
# (default 8), CYCLES (per process, default 2000), DIR (where the lock
# files go, default /var/tmp).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=${1:-3d40969}
OUT=${OUT:-$ROOT/build/bench-handoff}
REPS=${REPS:-7}
PROCS=${PROCS:-8}
CYCLES=${CYCLES:-2000}
DIR=${DIR:-/var/tmp}
mkdir -p "$OUT/base"

# --- build: the same benchmark sources against either set of headers ---------
rm -rf "$OUT/base/include"
git -C "$ROOT" archive "$BASE" include | tar -x -C "$OUT/base"
cxx() { g++ -std=c++20 -O2 -DNDEBUG -DDIBS_BENCH_HAVE_LIBLOCKFILE=0 "$@" -lfmt -pthread; }
for b in store_lock_contended store_lock_loop; do
  cxx -I"$OUT/base/include" "$ROOT/benchmarks/$b.cpp" -o "$OUT/$b.base"
  cxx -I"$ROOT/include" "$ROOT/benchmarks/$b.cpp" -o "$OUT/$b.new"
done
g++ -std=c++20 -O2 "$ROOT/benchmarks/handoff_floor.cpp" -o "$OUT/handoff_floor"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ), base $BASE, work tree $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- include/ || echo ' with uncommitted changes')"
  echo "nproc: $(nproc), kernel $(uname -r), $DIR on $(findmnt -n -o FSTYPE -T "$DIR")"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/machine.txt"

# --- the rounds ---------------------------------------------------------------
: >"$OUT/contended.jsonl"
: >"$OUT/floors.txt"
for r in $(seq "$REPS"); do
  for v in base new; do
    "$OUT/store_lock_contended.$v" --impl dibs --procs "$PROCS" --cycles "$CYCLES" --dir "$DIR" |
      sed "s/^{/{\"build\": \"$v\", \"round\": $r, /" >>"$OUT/contended.jsonl"
  done
  "$OUT/handoff_floor" --procs "$PROCS" --rounds "$CYCLES" | sed "s/^{/{\"round\": $r, /" >>"$OUT/floors.txt"
  for v in base new; do
    d=$(mktemp -d "$DIR/dibs-loop.XXXXXX")
    echo "round $r $v $("$OUT/store_lock_loop.$v" dibs 5000 "$d")" >>"$OUT/floors.txt"
    rm -rf "$d"
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"

python3 - "$OUT" <<'EOF'
import json, re, statistics, sys
out = sys.argv[1]
runs = [json.loads(l) for l in open(f"{out}/contended.jsonl")]
fields = [("cycles_per_s", 1, "cycles/s"), ("handoff_share", 1, "handoff share"),
          ("handoff_p50_ns", 1e3, "handoff p50 µs"), ("handoff_p90_ns", 1e3, "p90 µs"),
          ("handoff_p99_ns", 1e3, "p99 µs"), ("handoff_max_ns", 1e3, "max µs"),
          ("wait_p50_ns", 1e3, "wait p50 µs"), ("wait_p99_ns", 1e3, "wait p99 µs"),
          ("passed_over_max", 1, "passed over (max)"), ("passed_over_more_than_8", 1, "requests passed > 8 times")]
print(f"\nmedians of {len(runs) // 2} rounds (each round: base, then work tree)")
print("| build | " + " | ".join(f[2] for f in fields) + " | counter right |")
print("|---|" + "---:|" * (len(fields) + 1))
for b in ("base", "new"):
    rs = [r for r in runs if r["build"] == b]
    cells = []
    for key, div, _ in fields:
        m = statistics.median(r[key] for r in rs) / div
        cells.append(f"{m:.3f}" if key == "handoff_share" else f"{m:,.1f}" if div != 1 else f"{m:,.0f}")
    print(f"| {b} | " + " | ".join(cells) + f" | {sum(r['ok'] for r in rs)}/{len(rs)} |")
fl = open(f"{out}/floors.txt").read()
fut = [json.loads(l) for l in fl.splitlines() if l.startswith("{")]
loops = {"base": [], "new": []}
for m in re.finditer(r"round \d+ (base|new) dibs: \d+ rounds, (\d+) ns/op", fl):
    loops[m.group(1)].append(int(m.group(2)))
print(f"\nfloors, medians: futex handoff between {fut[0]['procs']} processes p50 "
      f"{statistics.median(f['p50_ns'] for f in fut) / 1e3:.1f} µs, p99 {statistics.median(f['p99_ns'] for f in fut) / 1e3:.1f} µs; "
      f"uncontended lock+unlock {statistics.median(loops['base']) / 1e3:.1f} µs (base), "
      f"{statistics.median(loops['new']) / 1e3:.1f} µs (work tree)")
EOF
echo "outputs in $OUT"
