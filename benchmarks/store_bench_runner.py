#!/usr/bin/python3
"""Runs the multi-process store benchmarks side by side, several times, and
prints tables of medians (Markdown). Used by run_store_benchmarks.sh.

    store_bench_runner.py contended --bin DIR [--reps 5] [--procs 2,4,8]
        [--impls dibs,dibs-norenew,floor,liblockfile,softfilelock]
        [--cycles 10000] [--cycles-for softfilelock=2000,...] [--json out.jsonl]
    store_bench_runner.py claims --bin DIR [--reps 5] [--procs 1,8]
        [--stores file,file-inplace,shm] [--items 20000] [--json out.jsonl]
    store_bench_runner.py syscalls --bin DIR [--rounds 2000]
        [--impls floor,liblockfile,dibs-norenew,dibs] [--keep DIR]

"syscalls" runs store_lock_loop once per lock under `strace -f -c` and once
plain (for its ns/op and rusage: voluntary context switches, user and system
CPU time), and prints system calls per lock+unlock round.

Each repetition runs every configuration once, in an order rotated from one
repetition to the next, so slow drift of the machine's load spreads over all
of them. Every raw result (one JSON object per run) is appended to --json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# python3-filelock is a Debian package: use Debian's interpreter, not one on $PATH.
DEBIAN_PYTHON = "/usr/bin/python3"


def run_json(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    try:
        result = json.loads(line)
    except json.JSONDecodeError:
        result = {"ok": False, "error": f"no JSON from {' '.join(cmd)}: rc {p.returncode}: {p.stderr.strip()[:300]}"}
    if p.stderr.strip():
        result["stderr"] = p.stderr.strip()[:300]
    result["rc"] = p.returncode
    result["cmd"] = " ".join(cmd)
    return result


def rotated(items, k):
    k %= len(items)
    return items[k:] + items[:k]


def med(values):
    values = [v for v in values if v is not None and v >= 0]
    return statistics.median(values) if values else None


def fmt_num(v, unit=""):
    if v is None:
        return "n/a"
    if unit == "ms":
        return f"{v / 1e6:.3f} ms" if v < 1e8 else f"{v / 1e6:.0f} ms"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}"


def parse_kv(text):
    out = {}
    for part in filter(None, (text or "").split(",")):
        k, v = part.split("=")
        out[k] = int(v)
    return out


def contended(args):
    impls = args.impls.split(",")
    procs = [int(p) for p in args.procs.split(",")]
    per_impl = parse_kv(args.cycles_for)
    configs = [(i, n) for n in procs for i in impls]
    results = {c: [] for c in configs}
    out = open(args.json, "a") if args.json else None
    for rep in range(args.reps):
        for impl, n in rotated(configs, rep * 3):
            cycles = per_impl.get(impl, args.cycles)
            if impl == "softfilelock":
                cmd = [args.python, os.path.join(HERE, "store_filelock_contended.py"), "--procs", str(n),
                       "--cycles", str(cycles)]
            else:
                cmd = [os.path.join(args.bin, "store_lock_contended"), "--impl", impl, "--procs", str(n),
                       "--cycles", str(cycles)]
            r = run_json(cmd)
            r["rep"] = rep
            results[(impl, n)].append(r)
            if out:
                out.write(json.dumps(r) + "\n")
                out.flush()
            print(f"rep {rep} {impl:13} {n} procs: {r.get('cycles_per_s', 'n/a')} cycles/s, "
                  f"handoff p50 {r.get('handoff_p50_ns', 'n/a')} ns, ok {r.get('ok')}"
                  + (f" lost {r['lost']}" if r.get("lost") else "")
                  + (f" ({r['error']})" if "error" in r else ""), file=sys.stderr, flush=True)

    print(f"\nMedians of {args.reps} runs each (cycles per process in the second column).\n")
    print("| procs | lock | cycles/proc | cycles/s | handoffs/run | handoff p50 | handoff p99 | own re-lock p50 "
          "| counter right | holds lost (all runs) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    summary = {}
    for n in procs:
        for impl in impls:
            rs = results[(impl, n)]
            cyc = med([r.get("cycles_per_s") for r in rs])
            summary[(impl, n)] = cyc
            right = sum(1 for r in rs if r.get("counter") == r.get("expected") and r.get("counter") is not None)
            lost = sum(r.get("lost", 0) or 0 for r in rs)
            print(f"| {n} | {impl} | {rs[0].get('cycles', 'n/a') if rs else 'n/a'} | {fmt_num(cyc)} | "
                  f"{fmt_num(med([r.get('handoffs') for r in rs]))} | "
                  f"{fmt_num(med([r.get('handoff_p50_ns') for r in rs]), 'ms')} | "
                  f"{fmt_num(med([r.get('handoff_p99_ns') for r in rs]), 'ms')} | "
                  f"{fmt_num(med([r.get('self_p50_ns') for r in rs]), 'ms')} | {right}/{len(rs)} | {lost} |")
    if "softfilelock" in impls:
        print("\nThroughput relative to SoftFileLock (ratio of the medians):\n")
        others = [i for i in impls if i != "softfilelock"]
        print("| procs | " + " | ".join(others) + " |")
        print("| ---: |" + " ---: |" * len(others))
        for n in procs:
            base = summary.get(("softfilelock", n))
            cells = [f"{summary[(i, n)] / base:.2f}x" if base and summary.get((i, n)) else "n/a" for i in others]
            print(f"| {n} | " + " | ".join(cells) + " |")


def claims(args):
    stores = args.stores.split(",")
    procs = [int(p) for p in args.procs.split(",")]
    configs = [(s, n) for s in stores for n in procs]
    results = {c: [] for c in configs}
    out = open(args.json, "a") if args.json else None
    for rep in range(args.reps):
        for store, n in rotated(configs, rep):
            r = run_json([os.path.join(args.bin, "store_marker_claim"), "--store", store, "--procs", str(n),
                          "--items", str(args.items)])
            r["rep"] = rep
            results[(store, n)].append(r)
            if out:
                out.write(json.dumps(r) + "\n")
                out.flush()
            print(f"rep {rep} {store} {n} procs: {r.get('claims_per_s', 'n/a')} claims/s, ok {r.get('ok')}"
                  + (f" ({r['error']})" if "error" in r else ""), file=sys.stderr, flush=True)
    print(f"\nMedians of {args.reps} runs each, {args.items} items per run.\n")
    print("| store | procs | claim+complete/s | wall time | items won per process (min-max, median run) "
          "| every item completed once |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for store, n in configs:
        rs = results[(store, n)]
        ok = sum(1 for r in rs if r.get("ok"))
        lo = med([r.get("won_min") for r in rs])
        hi = med([r.get("won_max") for r in rs])
        print(f"| {store}_store | {n} | {fmt_num(med([r.get('claims_per_s') for r in rs]))} | "
              f"{med([r.get('seconds') for r in rs]):.3f} s | {fmt_num(lo)}-{fmt_num(hi)} | {ok}/{len(rs)} |")


def strace_counts(path):
    """Returns {syscall: (calls, errors)} from a `strace -c` summary."""
    counts = {}
    for line in open(path):
        f = line.split()
        if len(f) < 5 or not f[0][0].isdigit() or f[-1] == "total":
            continue
        # % time, seconds, usecs/call, calls, [errors,] syscall
        calls = int(f[3])
        errors = int(f[4]) if len(f) == 6 else 0
        counts[f[-1]] = (calls, errors)
    return counts


def syscalls(args):
    import resource
    import shutil
    import tempfile
    impls = args.impls.split(",")
    n = args.rounds
    per_round, plain = {}, {}
    keep = args.keep
    for impl in impls:
        d = tempfile.mkdtemp(prefix="dibs-syscalls.")
        loop = [os.path.join(args.bin, "store_lock_loop"), impl, str(n), d]
        # Plain run: ns/op and rusage of the child.
        pid = os.fork()
        if pid == 0:
            os.execv(loop[0], loop)
        _, status, ru = os.wait4(pid, 0)
        plain[impl] = (ru.ru_nvcsw, ru.ru_nivcsw, ru.ru_utime, ru.ru_stime)
        shutil.rmtree(d, ignore_errors=True)
        d = tempfile.mkdtemp(prefix="dibs-syscalls.")
        loop[-1] = d
        out = os.path.join(keep, f"strace-c-{impl}.txt") if keep else os.path.join(d, "strace.txt")
        subprocess.run(["strace", "-f", "-c", "-o", out] + loop, check=True, stdout=subprocess.DEVNULL)
        per_round[impl] = strace_counts(out)
        shutil.rmtree(d, ignore_errors=True)
    # The process's start-up and exit calls are in the totals too: over n
    # rounds they add well under 0.05 per round, except where noted.
    names = sorted({s for c in per_round.values() for s, (calls, _) in c.items() if calls >= n // 2},
                   key=lambda s: -max(per_round[i].get(s, (0, 0))[0] for i in impls))
    print(f"\nSystem calls per lock+unlock round ({n} rounds plus one warm-up; strace -f -c, divided by {n + 1}; "
          "errors in brackets).\n")
    print("| syscall | " + " | ".join(impls) + " |")
    print("| --- |" + " ---: |" * len(impls))
    for s in names:
        cells = []
        for i in impls:
            calls, errors = per_round[i].get(s, (0, 0))
            cell = f"{calls / (n + 1):.2f}" if calls else "0"
            if errors / (n + 1) >= 0.005:
                cell += f" ({errors / (n + 1):.2f})"
            cells.append(cell)
        print(f"| {s} | " + " | ".join(cells) + " |")
    totals = [sum(c for s, (c, _) in per_round[i].items() if s in names) / (n + 1) for i in impls]
    print("| **total of these** | " + " | ".join(f"**{t:.1f}**" for t in totals) + " |")
    print("| voluntary context switches (plain run) | "
          + " | ".join(f"{plain[i][0] / (n + 1):.2f}" for i in impls) + " |")
    print("| user + system CPU per round (plain run) | "
          + " | ".join(f"{(plain[i][2] + plain[i][3]) / (n + 1) * 1e6:.0f} us" for i in impls) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("contended")
    c.add_argument("--bin", required=True, help="directory holding store_lock_contended")
    c.add_argument("--reps", type=int, default=5)
    c.add_argument("--procs", default="2,4,8")
    c.add_argument("--impls", default="dibs,dibs-norenew,floor,liblockfile,softfilelock")
    c.add_argument("--cycles", type=int, default=10000)
    c.add_argument("--cycles-for", default="", help="per-lock cycle counts, e.g. softfilelock=2000")
    c.add_argument("--json")
    c.add_argument("--python", default=DEBIAN_PYTHON, help="interpreter for the SoftFileLock harness")
    m = sub.add_parser("claims")
    m.add_argument("--bin", required=True, help="directory holding store_marker_claim")
    m.add_argument("--reps", type=int, default=5)
    m.add_argument("--procs", default="1,8")
    m.add_argument("--stores", default="file,file-inplace,shm")
    m.add_argument("--items", type=int, default=20000)
    m.add_argument("--json")
    y = sub.add_parser("syscalls")
    y.add_argument("--bin", required=True, help="directory holding store_lock_loop")
    y.add_argument("--rounds", type=int, default=2000)
    y.add_argument("--impls", default="floor,liblockfile,dibs-norenew,dibs")
    y.add_argument("--keep", help="directory to keep the strace -c outputs in")
    args = ap.parse_args()
    {"contended": contended, "claims": claims, "syscalls": syscalls}[args.what](args)


if __name__ == "__main__":
    main()
