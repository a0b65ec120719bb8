#!/usr/bin/env python3
"""Time aioswap's kernel AIO engine against fio's libaio engine on the same file.

aioswap (an ``AioHandle`` moving a page-locked buffer: the direct ``O_DIRECT`` path, straight
into the engine) writes a file and reads it back; where
``fio`` is installed, fio runs with the same parameters (``--ioengine=libaio --direct=1``,
same block size, queue depth, size and file) in the same run. Engine and fio alternate for
``--repeat`` rounds (who goes first alternates too), so drift and noise hit both alike, and
the best and median of the rounds are reported. Throughput is in GB/s = 10^9 bytes/s; a
ratio is aioswap / fio (bigger is better). Reads follow a page-cache drop, as fio's do.

Before the timed rounds the file is written once, untimed, so that every timed write (ours
and fio's) overwrites allocated blocks. The file is removed at the end.

Example::

    python benchmarks/bench_engine.py --dir /mnt/nvme --size 1G --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from _common import (UNITS_NOTE, dir_arg, drop_cache, format_size, fio_path, run_fio,
                     scratch_file, size_arg)
from aioswap import AioHandle, dio_alignment, pinned

GB = 1e9
_MAX_BUFFER = 1 << 30     # larger files cycle through a buffer of this size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=dir_arg, default=".",
                   help="directory for the test file (default: .)")
    p.add_argument("--size", type=size_arg(), default=1 << 30,
                   help="file size, K/M/G suffixes are powers of 1024 (default: 1G)")
    p.add_argument("--block-size", type=size_arg(), default=1 << 20,
                   help="bytes per request (default: 1M)")
    p.add_argument("--queue-depth", type=int, default=32,
                   help="requests in flight (default: 32)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default: 3)")
    p.add_argument("--fio", default=fio_path(),
                   help="fio executable (default: fio on PATH)")
    p.add_argument("--no-fio", action="store_true", help="time the engine only")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of a table")
    args = p.parse_args(argv)
    if args.queue_depth < 1 or args.repeat < 1:
        p.error("--queue-depth and --repeat must be at least 1")
    if args.size % args.block_size:
        p.error(f"--size {args.size} is not a multiple of --block-size {args.block_size} "
                "(fio would round it down)")
    _, off_align = dio_alignment(args.dir)
    if args.block_size % off_align:
        p.error(f"--block-size {args.block_size} is not a multiple of the O_DIRECT alignment "
                f"{off_align} of {args.dir!r}")
    if args.no_fio:
        args.fio = None
    return args


class Engine:
    """aioswap on one file: one handle, one page-locked buffer (the direct path)."""

    def __init__(self, path: str, size: int, block_size: int, queue_depth: int) -> None:
        self.path, self.size, self.bs, self.qd = path, size, block_size, queue_depth
        nbuf = min(size, max(_MAX_BUFFER - _MAX_BUFFER % block_size, block_size))
        # strict=False: without enough RLIMIT_MEMLOCK this is aligned unlocked memory (the
        # bounce path, reported below), which still runs.
        self.mem = pinned.empty(nbuf, torch.uint8, strict=False)
        self.mem.random_(0, 256)
        self.handle = AioHandle(block_size=block_size, queue_depth=queue_depth)
        self.chunks = [(off, min(nbuf, size - off)) for off in range(0, size, nbuf)]

    def run(self, op: str) -> float:
        """One timed pass over the whole file; returns GB/s."""
        if op == "read":
            drop_cache(self.path)
        call = self.handle.pwrite if op == "write" else self.handle.pread
        t0 = time.perf_counter()
        if len(self.chunks) == 1:
            n = call(self.mem, self.path, 0, nbytes=self.size)
        else:   # one batched submission: every chunk in flight on the handle's queue
            futures = [call(self.mem, self.path, off, nbytes=k, async_op=True)
                       for off, k in self.chunks]
            self.handle.wait()
            n = sum(f.result() for f in futures)
        elapsed = time.perf_counter() - t0
        assert n == self.size, (n, self.size)
        return self.size / elapsed / GB

    def close(self) -> None:
        self.handle.close()


def fio_version(fio: str) -> str:
    import subprocess
    return subprocess.run([fio, "--version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def summary(values: list[float]) -> dict[str, float]:
    return {"best": max(values), "median": statistics.median(values)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {"aioswap": {"write": [], "read": []}}
    if args.fio:
        results["fio"] = {"write": [], "read": []}
    engine = None
    with scratch_file(os.path.abspath(args.dir), "bench-engine") as path:
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
                            if op == "read":
                                drop_cache(path)
                            secs = run_fio(path, op, args.size, block_size=args.block_size,
                                           queue_depth=args.queue_depth, fio=args.fio,
                                           end_fsync=False)
                            results["fio"][op].append(args.size / secs / GB)
            stats = engine.handle.stats
        finally:
            if engine is not None:
                engine.close()

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
    report["aioswap_direct_bytes"] = stats.direct_bytes
    report["aioswap_bounce_bytes"] = stats.bounce_bytes
    if args.json:
        print(json.dumps(report, indent=2))
        return 0

    against = (f"vs {report['fio_version']} (ioengine=libaio, direct=1)" if args.fio
               else "(fio not run)")
    print(f"aioswap engine {against} on {os.path.dirname(path)}")
    print(f"file {format_size(args.size)}, block size {format_size(args.block_size)}, "
          f"queue depth {args.queue_depth}, {args.repeat} round(s); "
          f"best / median of the rounds; {UNITS_NOTE}")
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
    if stats.bounce_bytes:
        print(f"note: {stats.bounce_bytes} bytes went through the bounce path (the buffer could "
              f"not be page-locked: RLIMIT_MEMLOCK?)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
