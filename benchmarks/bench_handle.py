#!/usr/bin/env python3
"""AioHandle paths side by side on one file: pinned direct, unpinned bounce, fio's libaio
engine (when installed) and DeepSpeed's DeepNVMe aio_handle (when importable).

Every method writes then reads the same file with the same block size and queue depth; the
rounds alternate between methods so a noisy neighbour hurts them alike. Reported: the best
and the median GB/s (decimal, 10^9 bytes/s) of each, and ratios to aioswap direct.

    python benchmarks/bench_handle.py --dir /nvme --size 1G --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import aioswap
from aioswap import pinned
from _common import dir_arg, drop_cache, format_size, parse_size


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_aioswap(h: aioswap.AioHandle, src: torch.Tensor, dst: torch.Tensor,
                path: str) -> tuple[float, float]:
    w = timed(lambda: h.pwrite(src, path, fsync=True))
    drop_cache(path)
    r = timed(lambda: h.pread(dst, path))
    if not torch.equal(src, dst):
        raise SystemExit("aioswap read back different bytes")
    return w, r


def run_fio(path: str, size: int, bs: int, qd: int) -> tuple[float, float]:
    out = []
    for rw in ("write", "read"):
        cmd = ["fio", "--name=aioswap-cmp", f"--filename={path}", "--ioengine=libaio",
               "--direct=1", f"--bs={bs}", f"--iodepth={qd}", f"--rw={rw}", f"--size={size}",
               "--numjobs=1", "--output-format=json", "--end_fsync=1" if rw == "write" else
               "--invalidate=1"]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        job = res["jobs"][0][rw]
        # fio's runtime (ms) covers the I/O; bytes / runtime like the others
        out.append(job["io_bytes"] / (job["runtime"] / 1000.0) if job["runtime"] else 0.0)
        if rw == "write":
            drop_cache(path)
    return size / out[0], size / out[1]


def load_deepspeed():
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[import-not-found]
    except Exception as exc:   # not installed: skip, say why
        return None, f"deepspeed not importable ({type(exc).__name__}: {exc})"
    try:
        return AsyncIOBuilder().load(verbose=False), ""
    except Exception as exc:
        return None, f"DeepSpeed aio op did not build ({type(exc).__name__}: {exc})"


def run_deepspeed(ops, src, dst, path, bs, qd) -> tuple[float, float]:
    h = ops.aio_handle(bs, qd, False, True, 1)
    def write() -> None:
        h.sync_pwrite(src, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    w = timed(write)
    drop_cache(path)
    r = timed(lambda: h.sync_pread(dst, path))
    if not torch.equal(src, dst):
        raise SystemExit("DeepSpeed read back different bytes")
    return w, r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=dir_arg, default=".",
                   help="directory for the scratch file (default .)")
    p.add_argument("--size", type=parse_size, default=parse_size("1G"))
    p.add_argument("--block-size", type=parse_size, default=parse_size("1M"))
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    size, bs, qd = a.size, a.block_size, a.queue_depth
    path = os.path.join(a.dir, f".aioswap-bench-handle-{os.getpid()}.bin")

    src = pinned.empty(size, torch.uint8)
    src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    dst = pinned.empty(size, torch.uint8)
    plain_src, plain_dst = src.clone(), torch.empty(size, dtype=torch.uint8)

    methods = {}
    notes = []
    h = aioswap.AioHandle(block_size=bs, queue_depth=qd)
    methods["aioswap direct (pinned)"] = lambda: run_aioswap(h, src, dst, path)
    methods["aioswap bounce (unpinned)"] = lambda: run_aioswap(h, plain_src, plain_dst, path)
    if not a.no_fio:
        if shutil.which("fio"):
            methods["fio libaio"] = lambda: run_fio(path, size, bs, qd)
        else:
            notes.append("fio not installed (apt-get install fio)")
    if not a.no_deepspeed:
        ops, why = load_deepspeed()
        if ops is not None:
            methods["deepspeed aio_handle"] = lambda: run_deepspeed(ops, src, dst, path, bs, qd)
        else:
            notes.append(why)

    times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    try:
        for rnd in range(a.repeat):
            for name, fn in methods.items():
                times[name].append(fn())
                os.unlink(path)
                print(f"round {rnd + 1}/{a.repeat} {name} done", file=sys.stderr)
    finally:
        h.close()
        if os.path.exists(path):
            os.unlink(path)

    rows = []
    for name, ts in times.items():
        w = [size / t[0] / 1e9 for t in ts]
        r = [size / t[1] / 1e9 for t in ts]
        rows.append({"method": name, "write_best": max(w), "write_median": statistics.median(w),
                     "read_best": max(r), "read_median": statistics.median(r)})
    ref = rows[0]
    for row in rows:
        row["write_ratio"] = row["write_median"] / ref["write_median"]
        row["read_ratio"] = row["read_median"] / ref["read_median"]
    if a.json:
        print(json.dumps({"size": size, "block_size": bs, "queue_depth": qd, "rows": rows,
                          "notes": notes}, indent=2))
        return 0
    print(f"{format_size(size)}, block {format_size(bs)}, queue depth {qd}, {a.repeat} rounds "
          f"(GB/s = 10^9 B/s; writes end with fsync; page cache dropped before reads)")
    print(f"{'method':<28}{'write med':>10}{'best':>8}{'read med':>10}{'best':>8}"
          f"{'w/direct':>10}{'r/direct':>10}")
    for row in rows:
        print(f"{row['method']:<28}{row['write_median']:>10.2f}{row['write_best']:>8.2f}"
              f"{row['read_median']:>10.2f}{row['read_best']:>8.2f}"
              f"{row['write_ratio']:>10.2f}{row['read_ratio']:>10.2f}")
    for n in notes:
        print(f"note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
