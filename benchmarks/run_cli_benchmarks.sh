#!/usr/bin/env bash
# Per-invocation cost of the dibs command against the shell's own tools,
# measured side by side: each round runs every variant once, in turn, so
# that the machine's load falls on all of them alike. Reports the median
# milliseconds per invocation and the ratios.
#
#   benchmarks/run_cli_benchmarks.sh [N] [DIBS]   (N = 500 rounds; DIBS = build/default/tools/dibs)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

n=${1:-500}
dibs=${2:-$(dirname "$0")/../build/default/tools/dibs}
dibs=$(realpath "$dibs")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir"

variants=(flock dibs_kernel dibs_lease echo_append dibs_log)
run() {
  case $1 in
    flock) flock k.lock true ;;
    dibs_kernel) "$dibs" lock --kernel k.lock -- true ;;
    dibs_lease) "$dibs" lock l.lock -- true ;;
    echo_append) sh -c 'echo text >> a.log' ;;
    dibs_log) "$dibs" log d.log text ;;
  esac
}

for v in "${variants[@]}"; do : > "t.$v"; run "$v"; done  # warm the page cache
for ((i = 0; i < n; i++)); do
  for v in "${variants[@]}"; do
    t0=$EPOCHREALTIME
    run "$v"
    t1=$EPOCHREALTIME
    echo "$t0 $t1" | awk '{ printf "%.4f\n", ($2 - $1) * 1000 }' >> "t.$v"
  done
done

declare -A m
for v in "${variants[@]}"; do m[$v]=$(median < "t.$v"); done
echo "rounds: $n (median ms per invocation, each variant run once per round in turn)"
printf '%-40s %8.2f ms\n' "flock k.lock true" "${m[flock]}"
printf '%-40s %8.2f ms  %5.2fx flock\n' "dibs lock --kernel k.lock -- true" "${m[dibs_kernel]}" \
  "$(ratio "${m[dibs_kernel]}" "${m[flock]}")"
printf '%-40s %8.2f ms  %5.2fx flock\n' "dibs lock l.lock -- true (lease)" "${m[dibs_lease]}" \
  "$(ratio "${m[dibs_lease]}" "${m[flock]}")"
printf '%-40s %8.2f ms\n' "sh -c 'echo text >> a.log'" "${m[echo_append]}"
printf '%-40s %8.2f ms  %5.2fx echo\n' "dibs log d.log text" "${m[dibs_log]}" \
  "$(ratio "${m[dibs_log]}" "${m[echo_append]}")"
