#!/usr/bin/env python3
"""aioswap against the other ways to put a tensor on disk: buffered Python I/O, torch.save and
fio's libaio engine (when installed), on the same data in one run.

Each round writes then reads one file per method, and the rounds alternate between methods
(the starting method rotates) so a noisy neighbour hurts them alike:

  * aioswap: a page-locked uint8 tensor, ``AioHandle.pwrite(..., fsync=True)`` / ``pread``
    (the direct ``O_DIRECT`` path; the path actually taken is reported),
  * buffered: ``open(path, "wb").write`` + ``fsync`` / ``open(path, "rb").readinto``,
  * torch.save: ``torch.save`` + ``fsync`` / ``torch.load(..., weights_only=True)`` of a single
    uint8 tensor of the given size (the file also holds torch's small zip header),
  * fio: ``--ioengine=libaio --direct=1 --bs=1M --iodepth=32``, write then read, same size.

Before every read the file is fsynced and its pages are dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)``; what stayed resident is measured with ``mincore`` and
reported. Data read back by aioswap, buffered I/O and torch.load is compared with what was
written. Figures: the median over the rounds, in decimal GB/s (10^9 bytes per second), and
the ratio aioswap / method (above 1: aioswap is faster). Every file created is removed.

    python benchmarks/bench_formats.py --dir /nvme --size 1G --repeat 3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

import aioswap
from _common import (GB, UNITS_NOTE, dir_arg, drop_cache, fio_path, format_size, orders,
                     scratch_file, size_arg, summarize, timed)
from aioswap import pinned

FIO_BS, FIO_QD = 1 << 20, 32
CACHE_NOTE = ("before every read the file is fsynced and dropped from the page cache with "
              "posix_fadvise(POSIX_FADV_DONTNEED); aioswap and fio read with O_DIRECT, "
              "bypassing it anyway")


class Bench:
    """The data, the handle and the scratch files of one run."""

    def __init__(self, path: str, size: int) -> None:
        self.size = size
        self.path = path
        gen = torch.Generator().manual_seed(20240601)
        self.plain = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        # strict=False: without CAP_IPC_LOCK / enough RLIMIT_MEMLOCK this falls back to
        # unlocked memory with a warning, and the path report below shows the bounce path.
        self.src = pinned.empty(size, torch.uint8, strict=False)
        self.src.copy_(self.plain)
        self.dst = pinned.empty(size, torch.uint8, strict=False)
        self.out = torch.empty(size, dtype=torch.uint8)
        self.handle = aioswap.AioHandle()
        self.max_resident = 0.0

    def close(self) -> None:
        self.handle.close()

    def _before_read(self) -> None:
        r = drop_cache(self.path)
        if not math.isnan(r):
            self.max_resident = max(self.max_resident, r)

    def _check(self, got: torch.Tensor, method: str) -> None:
        if got.dtype != torch.uint8 or got.shape != self.plain.shape \
                or not torch.equal(got, self.plain):
            raise SystemExit(f"bench_formats: {method} read back different bytes")

    # Each method writes, drops the cache, reads, checks, removes: (write s, read s).
    def aioswap(self) -> tuple[float, float]:
        self.dst.zero_()
        w = timed(lambda: self.handle.pwrite(self.src, self.path, fsync=True))
        self._before_read()
        r = timed(lambda: self.handle.pread(self.dst, self.path))
        self._check(self.dst, "aioswap")
        return w, r

    def buffered(self) -> tuple[float, float]:
        src = self.plain.numpy().data
        self.out.zero_()
        dst = self.out.numpy().data

        def write() -> None:
            with open(self.path, "wb") as f:
                f.write(src)
                f.flush()
                os.fsync(f.fileno())

        def read() -> None:
            with open(self.path, "rb", buffering=0) as f:
                done = 0
                while done < self.size:  # read(2) may return less than asked
                    n = f.readinto(dst[done:])
                    if not n:
                        raise SystemExit("bench_formats: buffered read hit EOF early")
                    done += n

        w = timed(write)
        self._before_read()
        r = timed(read)
        self._check(self.out, "buffered")
        return w, r

    def torch_save(self) -> tuple[float, float]:
        def write() -> None:
            with open(self.path, "wb") as f:
                torch.save(self.plain, f)
                f.flush()
                os.fsync(f.fileno())

        loaded: list[torch.Tensor] = []
        w = timed(write)
        self._before_read()
        r = timed(lambda: loaded.append(torch.load(self.path, weights_only=True)))
        self._check(loaded.pop(), "torch.load")
        return w, r

    def fio(self) -> tuple[float, float]:
        secs = []
        for rw in ("write", "read"):
            cmd = ["fio", "--name=aioswap-bench-formats", f"--filename={self.path}",
                   "--ioengine=libaio", "--direct=1", f"--bs={FIO_BS}",
                   f"--iodepth={FIO_QD}", f"--rw={rw}", f"--size={self.size}",
                   "--numjobs=1", "--output-format=json"]
            cmd.append("--end_fsync=1" if rw == "write" else "--invalidate=1")
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"fio {rw} failed: {done.stderr.strip() or done.stdout}")
            job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0][rw]
            if job["io_bytes"] != self.size:
                raise RuntimeError(f"fio {rw} moved {job['io_bytes']} of {self.size} bytes")
            # fio's own runtime (ms) counts the I/O, not its start-up; bw_bytes when < 1 ms
            if job["runtime"] > 0:
                secs.append(job["runtime"] / 1000.0)
            elif job.get("bw_bytes"):
                secs.append(self.size / job["bw_bytes"])
            else:
                secs.append(float("nan"))
            if rw == "write":
                self._before_read()
        return secs[0], secs[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=dir_arg, default=".",
                   help="directory for the scratch file (default .)")
    p.add_argument("--size", type=size_arg(), default=1 << 30,
                   help="tensor size, K/M/G suffixes are powers of 1024 (default 1G)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--no-fio", action="store_true", help="leave fio out")
    p.add_argument("--json", action="store_true", help="print JSON")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    size, directory = a.size, os.path.abspath(a.dir)

    notes: list[str] = []
    with scratch_file(directory, "bench-formats") as path:
        return _run(a, size, directory, path, notes)


def _run(a: argparse.Namespace, size: int, directory: str, path: str, notes: list[str]) -> int:
    bench = Bench(path, size)
    methods: dict[str, Callable[[], tuple[float, float]]] = {
        "aioswap (pinned, direct)": bench.aioswap,
        "python buffered": bench.buffered,
        "torch.save / torch.load": bench.torch_save,
    }
    if a.no_fio:
        notes.append("fio left out (--no-fio)")
    elif size % FIO_BS:
        notes.append(f"fio left out: the size is not a multiple of its {format_size(FIO_BS)} "
                     f"block size")
    elif fio_path():
        methods[f"fio libaio (bs {format_size(FIO_BS)}, qd {FIO_QD})"] = bench.fio
    else:
        notes.append("fio not installed (apt-get install fio): left out")

    names = list(methods)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in names}
    try:
        for rnd, order in enumerate(orders(names, a.repeat)):
            for name in order:
                times[name].append(methods[name]())
                os.truncate(bench.path, 0)
                print(f"round {rnd + 1}/{a.repeat}: {name} done", file=sys.stderr)
        stats = bench.handle.stats
    finally:
        bench.close()

    rows: list[dict[str, Any]] = []
    for name in names:
        w = [size / t[0] / GB for t in times[name]]
        r = [size / t[1] / GB for t in times[name]]
        sw, sr = summarize(w), summarize(r)
        rows.append({"method": name, "write_GBps": sw.median, "read_GBps": sr.median,
                     "write_GBps_all": w, "read_GBps_all": r, "write_spread": sw.spread,
                     "read_spread": sr.spread})
    ref = rows[0]
    for row in rows:
        row["aioswap_vs_write"] = ref["write_GBps"] / row["write_GBps"]
        row["aioswap_vs_read"] = ref["read_GBps"] / row["read_GBps"]
    # Bytes that fill no aligned block (odd sizes) go through the head/tail path by design.
    aligned = stats.read_bytes + stats.write_bytes - stats.head_tail_bytes
    direct_share = stats.direct_bytes / aligned if aligned else 1.0
    if direct_share < 0.99:
        notes.append(f"aioswap moved only {direct_share:.0%} of its aligned bytes on the direct "
                     f"path ({stats}); is RLIMIT_MEMLOCK too small?")
    cache = (f"{CACHE_NOTE}; at most {bench.max_resident:.1%} of a file was still cached "
             f"at a read")
    result = {"directory": directory, "size_bytes": size, "size": format_size(size),
              "repeat": a.repeat, "units": "GB/s = 10^9 bytes per second, median of rounds",
              "writes": "each write ends with fsync (fio: end_fsync=1)", "cache": cache,
              "aioswap_direct_share": direct_share, "rows": rows, "notes": notes}
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"bench_formats: one {format_size(size)} uint8 tensor in {directory}, "
          f"{a.repeat} round(s), methods alternating")
    print(f"({result['writes']}; {cache})")
    print(f"median over rounds; {UNITS_NOTE}: above 1, aioswap is faster\n")
    print(f"{'method':<32}{'write GB/s':>11}{'read GB/s':>11}{'aioswap/w':>11}{'aioswap/r':>11}")
    for row in rows:
        print(f"{row['method']:<32}{row['write_GBps']:>11.2f}{row['read_GBps']:>11.2f}"
              f"{row['aioswap_vs_write']:>11.2f}{row['aioswap_vs_read']:>11.2f}")
    print(f"\naioswap path: {direct_share:.0%} of the aligned bytes direct (O_DIRECT from "
          f"page-locked memory), {stats.head_tail_bytes} B head/tail")
    for n in notes:
        print(f"note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
