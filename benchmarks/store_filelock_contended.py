#!/usr/bin/python3
"""The contended lock benchmark of store_lock_contended.cpp, for Python's
filelock.SoftFileLock (Debian python3-filelock), with the same protocol:

N forked processes each do C rounds of
    acquire; read the stamp; read a plain counter file, add 1, write it back;
    write the stamp; release
where the stamp (CLOCK_MONOTONIC ns and the holder's number) lives in a
shared anonymous mmap page, written just before release and read right after
acquire. An acquisition whose stamp came from another process is a handoff.

    store_filelock_contended.py --procs N --cycles C [--dir D] [--poll S]

acquire() uses filelock's own waiting: it retries every poll_interval
seconds (0.05 s by default, which --poll changes). Prints one JSON object with
the same fields as store_lock_contended; exit status 1 if the counter is wrong.
"""
import argparse
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
import time

import filelock

COUNTER_WIDTH = 24
PAGE = struct.Struct("=qi")  # released_ns, holder
SAMPLE = struct.Struct("=qi")  # wait_ns, handoff


def now_ns():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def add_one(fd):
    value = int(os.pread(fd, COUNTER_WIDTH, 0)) + 1
    data = b"%0*d\n" % (COUNTER_WIDTH - 1, value)
    if os.pwrite(fd, data, 0) != COUNTER_WIDTH:
        raise OSError("short write to the counter")


def child(me, args, directory, shared, ready_w, start_r):
    lock = filelock.SoftFileLock(os.path.join(directory, "the.lock"))
    counter = os.open(os.path.join(directory, "counter"), os.O_RDWR | os.O_CLOEXEC)
    base = 4096 + me * args.cycles * SAMPLE.size
    os.write(ready_w, b"r")
    os.close(ready_w)
    os.read(start_r, 1)  # returns b"" when the parent closes the pipe
    for i in range(args.cycles):
        lock.acquire(poll_interval=args.poll)
        t = now_ns()
        released, last = PAGE.unpack_from(shared, 0)
        SAMPLE.pack_into(shared, base + i * SAMPLE.size, -1 if last < 0 else t - released,
                         1 if last >= 0 and last != me else 0)
        add_one(counter)
        PAGE.pack_into(shared, 0, now_ns(), me)
        lock.release()
    os.close(counter)


def percentile(values, p):
    if not values:
        return -1
    values = sorted(values)
    return values[int(p / 100.0 * (len(values) - 1) + 0.5)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--dir", default=None, help="parent of the run's fresh directory (default: $TMPDIR or /tmp)")
    ap.add_argument("--poll", type=float, default=0.05, help="SoftFileLock poll_interval in seconds (default 0.05)")
    args = ap.parse_args()

    directory = tempfile.mkdtemp(prefix="dibs-filelock.", dir=args.dir)
    with open(os.path.join(directory, "counter"), "wb") as f:
        f.write(b"%0*d\n" % (COUNTER_WIDTH - 1, 0))
    n_samples = args.procs * args.cycles
    shared = mmap.mmap(-1, 4096 + n_samples * SAMPLE.size)  # MAP_SHARED | MAP_ANONYMOUS
    PAGE.pack_into(shared, 0, 0, -1)

    start_r, start_w = os.pipe()
    ready_r, ready_w = os.pipe()
    kids = []
    for me in range(args.procs):
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                os.close(start_w)
                os.close(ready_r)
                child(me, args, directory, shared, ready_w, start_r)
            except BaseException as e:  # report and leave without running the parent's cleanup
                print(f"process {me}: {e!r}", file=sys.stderr)
                status = 3
            finally:
                os._exit(status)
        kids.append(pid)
    os.close(start_r)
    os.close(ready_w)
    for _ in range(args.procs):
        if os.read(ready_r, 1) != b"r":
            raise SystemExit("a child died before the start")
    t0 = now_ns()
    os.close(start_w)
    kids_ok = True
    for pid in kids:
        _, status = os.waitpid(pid, 0)
        kids_ok = kids_ok and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    t1 = now_ns()

    with open(os.path.join(directory, "counter"), "rb") as f:
        counter = int(f.read(COUNTER_WIDTH))
    handoff, own = [], []
    for i in range(n_samples):
        wait, is_handoff = SAMPLE.unpack_from(shared, 4096 + i * SAMPLE.size)
        if wait >= 0:
            (handoff if is_handoff else own).append(wait)
    seconds = (t1 - t0) / 1e9
    ok = kids_ok and counter == n_samples
    print(json.dumps({
        "impl": "softfilelock", "procs": args.procs, "cycles": args.cycles, "poll_s": args.poll,
        "filelock_version": filelock.__version__, "seconds": round(seconds, 6),
        "cycles_per_s": round(n_samples / seconds, 1), "handoffs": len(handoff),
        "handoff_p50_ns": percentile(handoff, 50), "handoff_p90_ns": percentile(handoff, 90),
        "handoff_p99_ns": percentile(handoff, 99), "handoff_max_ns": percentile(handoff, 100),
        "self_reacquires": len(own), "self_p50_ns": percentile(own, 50),
        "counter": counter, "expected": n_samples, "ok": ok,
    }))
    shutil.rmtree(directory, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
