#!/usr/bin/env python3
"""Time aioswap's kernel AIO engine against fio's libaio engine on the same file.

The engine writes a file with O_DIRECT from a page-locked buffer and reads it back; where
``fio`` is installed, fio runs with the same parameters (``--ioengine=libaio --direct=1``,
same block size, queue depth, size and file) in the same run. Engine and fio alternate for
``--repeat`` rounds (who goes first alternates too), so drift and noise hit both alike, and
the best and median of the rounds are reported. Throughput is in GB/s = 10^9 bytes/s.

Before the timed rounds the file is written once, untimed, so that every timed write (ours
and fio's) overwrites allocated blocks. The file is removed at the end.

Example::

    python benchmarks/bench_engine.py --dir /mnt/nvme --size 1G --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from aioswap import AioContext, dio_alignment, open_direct
from aioswap._aio import LockedMemory

GB = 1e9
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_MAX_BUFFER = 1 << 30     # larger files cycle through a buffer of this size


def parse_size(text: str) -> int:
    """``4096``, ``512K``, ``1M``, ``1G``, ``1GiB``: powers of 1024."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 512K, 1M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def human(n: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        size = _UNITS[unit[0]]
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".", help="directory for the test file (default: .)")
    p.add_argument("--size", type=parse_size, default=parse_size("1G"),
                   help="file size, K/M/G suffixes are powers of 1024 (default: 1G)")
    p.add_argument("--block-size", type=parse_size, default=parse_size("1M"),
                   help="bytes per request (default: 1M)")
    p.add_argument("--queue-depth", type=int, default=32,
                   help="requests in flight (default: 32)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default: 3)")
    p.add_argument("--fio", default=shutil.which("fio"),
                   help="fio executable (default: fio on PATH)")
    p.add_argument("--no-fio", action="store_true", help="time the engine only")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of a table")
    args = p.parse_args(argv)
    if args.queue_depth < 1 or args.repeat < 1:
        p.error("--queue-depth and --repeat must be at least 1")
    if args.size % args.block_size:
        p.error(f"--size {args.size} is not a multiple of --block-size {args.block_size} "
                "(fio would round it down)")
    if not os.path.isdir(args.dir):
        p.error(f"--dir {args.dir!r} is not a directory")
    _, off_align = dio_alignment(args.dir)
    if args.block_size % off_align:
        p.error(f"--block-size {args.block_size} is not a multiple of the O_DIRECT alignment "
                f"{off_align} of {args.dir!r}")
    if args.no_fio:
        args.fio = None
    return args


class Engine:
    """aioswap's engine on one file, one context, one page-aligned (locked) buffer."""

    def __init__(self, path: str, size: int, block_size: int, queue_depth: int) -> None:
        self.path, self.size, self.bs, self.qd = path, size, block_size, queue_depth
        nbuf = min(size, max(_MAX_BUFFER - _MAX_BUFFER % block_size, block_size))
        try:
            self.mem = LockedMemory(nbuf)
        except OSError:                 # RLIMIT_MEMLOCK too small: aligned is what matters
            self.mem = LockedMemory(nbuf, lock=False)
        chunk = os.urandom(min(nbuf, 64 << 20))
        view = memoryview(self.mem)
        for start in range(0, nbuf, len(chunk)):
            view[start:start + len(chunk)] = chunk[:nbuf - start]
        view.release()
        self.ctx = AioContext(queue_depth)
        # one call for the whole file; a buffer smaller than the file is cycled through
        a = self.mem.address
        self.segments = [(a + off % nbuf, min(self.bs, size - off), off)
                         for off in range(0, size, self.bs)] if nbuf < size else None

    def run(self, op: str) -> float:
        """One timed pass over the whole file; returns GB/s."""
        fd = open_direct(self.path, write=op == "write", create=op == "write")
        knobs = dict(block_size=self.bs, queue_depth=self.qd, path=self.path)
        try:
            t0 = time.perf_counter()
            if self.segments is None:
                call = self.ctx.pwrite if op == "write" else self.ctx.pread
                n = call(fd, self.mem, 0, self.size, **knobs)
            else:
                call = self.ctx.pwritev if op == "write" else self.ctx.preadv
                n = call(fd, self.segments, **knobs)
            elapsed = time.perf_counter() - t0
        finally:
            os.close(fd)
        assert n == self.size, (n, self.size)
        return self.size / elapsed / GB

    def close(self) -> None:
        self.ctx.close()
        self.mem.release()


def fio_version(fio: str) -> str:
    return subprocess.run([fio, "--version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def run_fio(fio: str, path: str, op: str, size: int, block_size: int, queue_depth: int) -> float:
    """fio with the engine's parameters on the same file; returns GB/s."""
    cmd = [fio, "--name=aioswap-bench", f"--filename={path}", "--ioengine=libaio",
           "--direct=1", f"--bs={block_size}", f"--iodepth={queue_depth}", f"--rw={op}",
           f"--size={size}", "--numjobs=1", "--output-format=json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr.strip()}\n"
                           f"{' '.join(cmd)}")
    out = proc.stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}: {' '.join(cmd)}")
    stats = job[op]
    if stats["io_bytes"] != size:
        raise RuntimeError(f"fio moved {stats['io_bytes']} bytes, expected {size}")
    bw = stats["bw_bytes"] if "bw_bytes" in stats else stats["bw"] * 1024
    return bw / GB


def summary(values: list[float]) -> dict[str, float]:
    return {"best": max(values), "median": statistics.median(values)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = os.path.join(os.path.abspath(args.dir), f"aioswap-bench-{os.getpid()}.bin")
    results: dict[str, dict[str, list[float]]] = {"aioswap": {"write": [], "read": []}}
    if args.fio:
        results["fio"] = {"write": [], "read": []}
    engine = None
    try:
        engine = Engine(path, args.size, args.block_size, args.queue_depth)
        engine.run("write")                                  # untimed: allocate the blocks
        os.sync()
        for rnd in range(args.repeat):
            for op in ("write", "read"):
                order = ["aioswap", "fio"] if rnd % 2 == 0 else ["fio", "aioswap"]
                for who in order:
                    if who == "aioswap":
                        results["aioswap"][op].append(engine.run(op))
                    elif args.fio:
                        results["fio"][op].append(run_fio(args.fio, path, op, args.size,
                                                          args.block_size, args.queue_depth))
    finally:
        if engine is not None:
            engine.close()
        if os.path.exists(path):
            os.unlink(path)

    report = {
        "path": path, "size": args.size, "block_size": args.block_size,
        "queue_depth": args.queue_depth, "repeat": args.repeat, "unit": "GB/s (1e9 B/s)",
        "fio_version": fio_version(args.fio) if args.fio else None,
        "aioswap": results["aioswap"], "fio": results.get("fio"),
        "ratio": None,
    }
    if args.fio:
        report["ratio"] = {}
        for op in ("write", "read"):
            ours, theirs = results["aioswap"][op], results["fio"][op]
            ratio = {k: summary(ours)[k] / summary(theirs)[k] for k in ("best", "median")}
            # each round's pair ran back to back: their ratio is the least exposed to drift
            ratio["paired"] = statistics.median(a / b for a, b in zip(ours, theirs))
            report["ratio"][op] = ratio
    if args.json:
        print(json.dumps(report, indent=2))
        return 0

    against = (f"vs {report['fio_version']} (ioengine=libaio, direct=1)" if args.fio
               else "(fio not run)")
    print(f"aioswap engine {against} on {os.path.dirname(path)}")
    print(f"file {human(args.size)}, block size {human(args.block_size)}, "
          f"queue depth {args.queue_depth}, {args.repeat} round(s); "
          f"GB/s = 10^9 bytes/s, best / median of the rounds")
    if args.fio:
        print("ratio = aioswap / fio: of the bests, of the medians, and the median of each "
              "round's back-to-back pair (paired)")
    print(f"{'op':<6} {'aioswap best':>12} {'median':>8} {'fio best':>10} {'median':>8} "
          f"{'ratio best':>11} {'median':>8} {'paired':>8}")
    for op in ("write", "read"):
        ours = summary(results["aioswap"][op])
        line = f"{op:<6} {ours['best']:>12.3f} {ours['median']:>8.3f}"
        if args.fio:
            theirs = summary(results["fio"][op])
            ratio = report["ratio"][op]
            line += (f" {theirs['best']:>10.3f} {theirs['median']:>8.3f}"
                     f" {ratio['best']:>11.3f} {ratio['median']:>8.3f}"
                     f" {ratio['paired']:>8.3f}")
        else:
            line += f" {'-':>10} {'-':>8} {'-':>11} {'-':>8} {'-':>8}"
        print(line)
    if not args.fio:
        print("fio not found: install fio (e.g. apt-get install fio) to compare")
    return 0


if __name__ == "__main__":
    sys.exit(main())
