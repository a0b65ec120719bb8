#!/usr/bin/env python3
"""GPU checks, for a machine with CUDA, torch and the nvidia-cufile wheel (well under 5 min).

Checks byte-exact round trips of CUDA tensors through
  * GdsHandle with a cuFile-registered buffer (pin_device_tensor),
  * GdsHandle with an unregistered buffer (cuFile's own staging),
  * AioHandle's bounce path (device -> pinned host -> file and back),
and prints GB/s (10^9 B/s) for each next to a CPU-pinned direct transfer of the same size.
Exit status 0 when every check that could run passed; a missing cuFile is reported and its
checks are skipped (status 0 only if --allow-no-cufile), a wrong byte is status 1.

    python benchmarks/gpu_check.py --dir /nvme --size 1G
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

import aioswap
from aioswap import pinned
from _common import dir_arg, drop_cache, format_size, parse_size


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def round_trip(name, h, src, dst, path, size, rows, failures, offset=0):
    dst.zero_()
    w = timed(lambda: h.pwrite(src, path, offset, fsync=True))
    drop_cache(path)
    r = timed(lambda: h.pread(dst, path, offset))
    ok = torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
    if not ok:
        failures.append(name)
    rows.append((name, size / w / 1e9, size / r / 1e9, "ok" if ok else "MISMATCH"))
    os.unlink(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=dir_arg, default=".",
                   help="directory for the scratch file (default .)")
    p.add_argument("--size", type=parse_size, default=parse_size("1G"))
    p.add_argument("--allow-no-cufile", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False")
        return 2
    size = a.size
    fd, path = tempfile.mkstemp(prefix=".aioswap-gpu-check-", suffix=".bin", dir=a.dir)
    os.close(fd)                # a unique name made with O_EXCL, mode 0600
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"size {format_size(size)}")
    rows, failures, notes = [], [], []
    gen = torch.Generator(device="cuda").manual_seed(7)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.empty_like(src)

    # reference: CPU pinned direct
    with aioswap.AioHandle() as h:
        hs, hd = pinned.empty(size, torch.uint8), pinned.empty(size, torch.uint8)
        hs.copy_(src.cpu())
        w = timed(lambda: h.pwrite(hs, path, fsync=True))
        drop_cache(path)
        r = timed(lambda: h.pread(hd, path))
        rows.append(("CPU pinned direct (AioHandle)", size / w / 1e9, size / r / 1e9,
                     "ok" if torch.equal(hs, hd) else "MISMATCH"))
        if not torch.equal(hs, hd):
            failures.append("cpu direct")
        os.unlink(path)
        # CUDA through the bounce pool
        round_trip("CUDA bounce (AioHandle)", h, src, dst, path, size, rows, failures)
        odd = src[: size - 3]
        round_trip("CUDA bounce, odd size+offset", h, odd, torch.empty_like(odd), path,
                   size - 3, rows, failures, offset=4097)
        assert h.stats.bounce_bytes > 0

    try:
        from aioswap.gds import GdsHandle
        g = GdsHandle()
    except aioswap.CuFileUnavailable as exc:
        notes.append(f"cuFile unavailable, GDS checks skipped: {exc}")
        g = None
    if g is not None:
        with g:
            round_trip("CUDA via cuFile, unregistered", g, src, dst, path, size, rows, failures)
            reg_src = g.new_pinned_device_tensor(size, torch.uint8)
            reg_dst = g.new_pinned_device_tensor(size, torch.uint8)
            reg_src.copy_(src)
            round_trip("CUDA via cuFile, registered", g, reg_src, reg_dst, path, size, rows,
                       failures)
            view = reg_src[4096: size - 4096]        # inside a registered range
            round_trip("CUDA via cuFile, registered view", g, view,
                       reg_dst[4096: size - 4096], path, view.numel(), rows, failures)
            g.unpin_device_tensor(reg_src)
            g.unpin_device_tensor(reg_dst)
            cpu = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
            round_trip("CPU tensor via GdsHandle (AIO)", g, cpu, torch.empty_like(cpu), path,
                       1 << 20, rows, failures)

    ref_w, ref_r = rows[0][1], rows[0][2]
    print(f"{'path':<36}{'write GB/s':>11}{'read GB/s':>11}{'w/cpu':>8}{'r/cpu':>8}  check")
    for name, w, r, ok in rows:
        print(f"{name:<36}{w:>11.2f}{r:>11.2f}{w / ref_w:>8.2f}{r / ref_r:>8.2f}  {ok}")
    for n in notes:
        print("note:", n)
    if failures:
        print("FAILED:", ", ".join(failures))
        return 1
    if g is None and not a.allow_no_cufile:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
