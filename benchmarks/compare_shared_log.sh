#!/usr/bin/env bash
# compare_shared_log.sh: dibs::shared_log at two commits, side by side.
#
#   benchmarks/compare_shared_log.sh OLD_COMMIT [RUNS] [RECORDS]
#
# Builds shared_log_throughput (Release) from OLD_COMMIT (in a git worktree
# under build/compare-<commit>) and from the working tree (build/bench-locks),
# then alternates them RUNS times (default 9): each run is one invocation with
# 8 processes x RECORDS records (default 100,000) of shared_log and of the raw
# O_APPEND loop, so every shared_log figure has a ceiling measured next to it.
# Prints each run's records/s and ratio to raw, then the medians. Needs what
# run_lock_benchmarks.sh needs (cmake, ninja, g++, libfmt-dev, libboost-dev,
# libbenchmark-dev); it does not install them.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
old=${1:?usage: compare_shared_log.sh OLD_COMMIT [RUNS] [RECORDS]}
runs=${2:-9}
records=${3:-100000}
dir=${DIBS_BENCH_DIR:-/var/tmp}
old_sha=$(git -C "$ROOT" rev-parse --short "$old")
old_src=$ROOT/build/compare-$old_sha

build() {  # source dir, build dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDIBS_BUILD_TESTS=OFF -DDIBS_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$2" --target shared_log_throughput >/dev/null
}
[[ -d $old_src ]] || git -C "$ROOT" worktree add -f --detach "$old_src" "$old_sha" >/dev/null
build "$old_src" "$old_src/build"
build "$ROOT" "$ROOT/build/bench-locks"

# One invocation: prints "<shared_log records/s> <ratio to raw>".
one() {
  "$1" --procs 8 --records "$records" --repeat 1 --ways shared_log,raw_append --dir "$dir" |
    awk -F'|' '/^\| shared_log /{gsub(/ /,"",$4); gsub(/[ x]/,"",$5); print $4, $5}'
}
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }

declare -a old_rate old_ratio new_rate new_ratio
echo "run  old records/s  old/raw  new records/s  new/raw"
for ((r = 1; r <= runs; r++)); do
  read -r a b < <(one "$old_src/build/benchmarks/shared_log_throughput")
  read -r c d < <(one "$ROOT/build/bench-locks/benchmarks/shared_log_throughput")
  old_rate+=("$a") old_ratio+=("$b") new_rate+=("$c") new_ratio+=("$d")
  printf '%3d  %13s  %7s  %13s  %7s\n' "$r" "$a" "$b" "$c" "$d"
done
printf 'median  %s  %s  %s  %s\n' \
  "$(printf '%s\n' "${old_rate[@]}" | median)" "$(printf '%s\n' "${old_ratio[@]}" | median)" \
  "$(printf '%s\n' "${new_rate[@]}" | median)" "$(printf '%s\n' "${new_ratio[@]}" | median)"
echo "(old: $old_sha; new: the working tree at $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet || echo ', with changes'))"
