#!/usr/bin/python3
"""py_filelock_contended: the Python side of file_mutex_contended. P processes
take turns at one lock, each doing N cycles of: acquire; read a 64-bit counter
from a file, add one, write it back; release.

    filelock         filelock.FileLock(path) with its default poll_interval
                     (0.05 s): a waiter retries flock(LOCK_NB) after sleeping
    filelock_1ms     the same with poll_interval=0.001
    py_flock         blocking fcntl.flock(LOCK_EX) / LOCK_UN on an open fd:
                     the interpreter's own floor

Measured as in file_mutex_contended.cpp: throughput is P*N cycles over the
time from the starting gun to the last process's last release; handoff
latency is the time from a holder's CLOCK_MONOTONIC stamp (time.monotonic_ns,
stored in a shared anonymous mmap page just before it releases) to the next
acquirer's reading of it just after it acquires; "cross" handoffs go to another
process, "self" ones back to the one that released. The counter must equal P*N
after every run, or the script aborts.

    /usr/bin/python3 py_filelock_contended.py [--procs 2,4,8] [--cycles 5000]
        [--repeat 3] [--locks filelock,filelock_1ms,py_flock] [--dir D]
"""

import argparse
import array
import fcntl
import mmap
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time

try:
    import filelock
except ImportError:
    sys.exit("py_filelock_contended: no filelock module: apt-get install python3-filelock "
             "(and run Debian's /usr/bin/python3)")

# Shared page layout: last_unlock_ns (q) at 0, last_holder (i) at 8,
# ready flags (one byte per process) from 64, finish_ns (q per process) from 1024.
READY, FINISH = 64, 1024
MAX_PROCS = 64


class PyFlock:
    def __init__(self, path):
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def acquire(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self):
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class FileLockWay:
    def __init__(self, path, poll):
        self.lock = filelock.FileLock(path)
        self.poll = poll

    def acquire(self):
        self.lock.acquire(poll_interval=self.poll)

    def release(self):
        self.lock.release()


LOCKS = {
    "filelock": lambda p: FileLockWay(p, 0.05),
    "filelock_1ms": lambda p: FileLockWay(p, 0.001),
    "py_flock": PyFlock,
}


def child(i, make, lock_path, counter_path, out_path, cycles, page, go_r):
    lock = make(lock_path)
    cfd = os.open(counter_path, os.O_RDWR | os.O_CLOEXEC)
    cross, self_ = array.array("q"), array.array("q")
    page[READY + i] = 1
    os.read(go_r, 1)
    now = time.monotonic_ns
    unpack_from, pack_into = struct.unpack_from, struct.pack_into
    for _ in range(cycles):
        lock.acquire()
        t = now()
        last, who = unpack_from("<qi", page, 0)
        if last:
            (self_ if who == i else cross).append(t - last)
        (v,) = struct.unpack("<Q", os.pread(cfd, 8, 0))
        if os.pwrite(cfd, struct.pack("<Q", v + 1), 0) != 8:
            raise OSError("short pwrite of the counter")
        pack_into("<qi", page, 0, now(), i)
        lock.release()
    pack_into("<q", page, FINISH + 8 * i, now())
    with open(out_path, "wb") as f:
        f.write(struct.pack("<QQ", len(cross), len(self_)))
        cross.tofile(f)
        self_.tofile(f)


def percentile(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, int(q * len(xs)))])


def run_once(name, procs, cycles, base):
    d = os.path.join(base, f"{name}-{procs}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    lock_path, counter_path = os.path.join(d, "lock"), os.path.join(d, "counter")
    open(lock_path, "wb").close()
    with open(counter_path, "wb") as f:
        f.write(struct.pack("<Q", 0))
    page = mmap.mmap(-1, 4096)  # anonymous and MAP_SHARED: the children see one page
    go_r, go_w = os.pipe()
    pids = []
    for i in range(procs):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            rc = 0
            try:
                os.close(go_w)
                child(i, LOCKS[name], lock_path, counter_path, os.path.join(d, f"lat-{i}"), cycles, page, go_r)
            except BaseException as e:  # noqa: BLE001 - report anything, then exit non-zero
                print(f"py_filelock_contended: child {i}: {e!r}", file=sys.stderr, flush=True)
                rc = 1
            os._exit(rc)
        pids.append(pid)
    os.close(go_r)
    while sum(page[READY:READY + procs]) < procs:
        time.sleep(0.001)
    t0 = time.monotonic_ns()
    os.close(go_w)  # the starting gun
    failed = False
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed |= not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
    if failed:
        sys.stderr.write(f"py_filelock_contended: FATAL: {name} with {procs} processes: a child failed\n")
        os.abort()
    with open(counter_path, "rb") as f:
        (total,) = struct.unpack("<Q", f.read(8))
    if total != procs * cycles:
        sys.stderr.write(f"py_filelock_contended: FATAL: {name} with {procs} processes: counter is {total}, "
                         f"expected {procs * cycles}: the lock did not exclude\n")
        os.abort()
    t1 = max(struct.unpack_from("<q", page, FINISH + 8 * i)[0] for i in range(procs))
    cross, every = [], []
    for i in range(procs):
        with open(os.path.join(d, f"lat-{i}"), "rb") as f:
            nc, ns = struct.unpack("<QQ", f.read(16))
            c, s = array.array("q"), array.array("q")
            c.fromfile(f, nc)
            s.fromfile(f, ns)
        cross.extend(c)
        every.extend(c)
        every.extend(s)
    page.close()
    shutil.rmtree(d, ignore_errors=True)
    return {
        "cycles_per_s": procs * cycles / ((t1 - t0) / 1e9),
        "p50_all": percentile(every, 0.50), "p99_all": percentile(every, 0.99),
        "p50_cross": percentile(cross, 0.50), "p99_cross": percentile(cross, 0.99),
        "cross_share": len(cross) / len(every) if every else 0.0,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="2,4,8")
    ap.add_argument("--cycles", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--locks", default=",".join(LOCKS))
    ap.add_argument("--dir", default=os.environ.get("DIBS_BENCH_DIR") or "/var/tmp")
    args = ap.parse_args()
    procs = [int(p) for p in args.procs.split(",") if p]
    locks = [name for name in args.locks.split(",") if name]
    for name in locks:
        if name not in LOCKS:
            sys.exit(f"py_filelock_contended: unknown lock {name}")
    if any(p < 1 or p > MAX_PROCS for p in procs):
        sys.exit("py_filelock_contended: process count out of range")

    work = tempfile.mkdtemp(prefix="dibs-pylock-contended-", dir=args.dir)
    print(f"# py_filelock_contended: filelock {filelock.__version__}, {args.cycles} cycles per process, "
          f"{args.repeat} repeats, files in {work}")
    print("# run lock procs cycles_per_s p50_all_ns p99_all_ns p50_cross_ns p99_cross_ns cross_share", flush=True)
    results = {}
    try:
        for r in range(args.repeat):
            for p in procs:
                for name in locks:
                    x = run_once(name, p, args.cycles, work)
                    results.setdefault((name, p), []).append(x)
                    print(f"run {r} {name} {p} {x['cycles_per_s']:.0f} {x['p50_all']:.0f} {x['p99_all']:.0f} "
                          f"{x['p50_cross']:.0f} {x['p99_cross']:.0f} {x['cross_share']:.3f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(name, p, key):
        return statistics.median(x[key] for x in results[(name, p)])

    print(f"\n# medians over {args.repeat} repeats (latencies in microseconds; counter verified after every run)")
    print("| lock | procs | cycles/s | handoff p50 all | p99 all | p50 cross | p99 cross | cross share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in procs:
        for name in locks:
            print(f"| {name} | {p} | {med(name, p, 'cycles_per_s'):.0f} | {med(name, p, 'p50_all') / 1e3:.1f} | "
                  f"{med(name, p, 'p99_all') / 1e3:.1f} | {med(name, p, 'p50_cross') / 1e3:.1f} | "
                  f"{med(name, p, 'p99_cross') / 1e3:.1f} | {med(name, p, 'cross_share'):.3f} |")


if __name__ == "__main__":
    main()
