#!/usr/bin/python3
"""py_filelock_uncontended: what one uncontended acquire + release costs in
Python's filelock (Debian's python3-filelock), next to a bare fcntl.flock pair
on an open descriptor (what the interpreter itself costs around the two
syscalls).

    filelock     filelock.FileLock(path): acquire() + release() (each acquire
                 opens the file with O_TRUNC and flocks it with LOCK_NB; each
                 release unlocks and closes it)
    py_flock     fcntl.flock(fd, LOCK_EX) + fcntl.flock(fd, LOCK_UN)

Each way runs --iterations times per run, timed with time.perf_counter; the
figure is the median of --runs runs, in ns per acquire+release. Runs of the
two ways alternate. Files go to a fresh directory under --dir (default
$DIBS_BENCH_DIR, else /var/tmp).

    /usr/bin/python3 py_filelock_uncontended.py [--iterations 100000] [--runs 7]
"""

import argparse
import fcntl
import os
import shutil
import statistics
import sys
import tempfile
import time

try:
    import filelock
except ImportError:
    sys.exit("py_filelock_uncontended: no filelock module: apt-get install python3-filelock "
             "(and run Debian's /usr/bin/python3)")


def time_filelock(path, iterations):
    lock = filelock.FileLock(path)
    acquire, release = lock.acquire, lock.release
    start = time.perf_counter()
    for _ in range(iterations):
        acquire()
        release()
    return (time.perf_counter() - start) / iterations * 1e9


def time_py_flock(path, iterations):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    flock, ex, un = fcntl.flock, fcntl.LOCK_EX, fcntl.LOCK_UN
    try:
        start = time.perf_counter()
        for _ in range(iterations):
            flock(fd, ex)
            flock(fd, un)
        return (time.perf_counter() - start) / iterations * 1e9
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dir", default=os.environ.get("DIBS_BENCH_DIR") or "/var/tmp")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="dibs-pylock-", dir=args.dir)
    try:
        ways = {"filelock": (time_filelock, os.path.join(work, "filelock.lock")),
                "py_flock": (time_py_flock, os.path.join(work, "py_flock.lock"))}
        figures = {name: [] for name in ways}
        for name, (fn, path) in ways.items():  # warm up
            fn(path, args.iterations // 10 or 1)
        for run in range(args.runs):
            for name, (fn, path) in ways.items():
                ns = fn(path, args.iterations)
                figures[name].append(ns)
                print(f"run {run} {name} {ns:.0f} ns/op", flush=True)
        print(f"\n# filelock {filelock.__version__}, Python {sys.version.split()[0]}, files in {work}")
        print(f"# medians of {args.runs} runs x {args.iterations} iterations")
        print("| way | ns/op (median) | min | max |")
        print("|---|---:|---:|---:|")
        for name, xs in figures.items():
            print(f"| {name} | {statistics.median(xs):.0f} | {min(xs):.0f} | {max(xs):.0f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
