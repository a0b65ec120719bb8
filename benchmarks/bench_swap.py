#!/usr/bin/env python3
"""TensorSwapper against torch.save/torch.load and against one direct transfer, same run.

A state dict of ``--tensors`` float32 tensors, ``--size`` bytes in all, is

* written and read as ONE transfer of the same total size from page-locked memory with
  ``AioHandle.pwrite(fsync=True)`` / ``pread``: the ceiling of this disk and handle;
* swapped out and in with ``TensorSwapper.swap_out_state_dict`` / ``swap_in_state_dict``
  (fsync, manifest commit and checksum included; ``swap_in`` verifies the checksum), once from
  plain CPU tensors (swapped in to new plain tensors: the usual case, staged through the
  handle's bounce pool) and once from page-locked tensors (``aioswap.pinned.empty``, swapped
  in to page-locked tensors: direct I/O);
* saved with ``torch.save`` to a file, flushed and fsynced, and loaded with ``torch.load``.

Before every read the page cache of the files is dropped (``posix_fadvise(DONTNEED)`` after
fsync, or also ``/proc/sys/vm/drop_caches`` with ``--drop-caches sysctl``, as root), so reads
come from the disk. Rounds alternate between methods; the best round of each is reported
(GB/s = 10^9 bytes/s), with the ratios swap/torch and swap/direct.

    python benchmarks/bench_swap.py --dir /nvme --size 1G --tensors 64
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import torch

import aioswap
from aioswap import pinned
from aioswap.cli import drop_cache as _drop_cache
from aioswap.cli import format_size, parse_size

try:
    from aioswap import TensorSwapper
except ImportError:             # exported from aioswap.swap only
    from aioswap.swap import TensorSwapper


def drop_cache(paths: list[str], how: str) -> None:
    """Make sure the next reads of ``paths`` come from the disk."""
    for p in paths:
        _drop_cache(p)
    if how == "sysctl":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def make_state_dict(total: int, count: int, locked: bool) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of about ``total / count`` bytes each, random contents."""
    per = max(1, total // count // 4)
    noise = torch.frombuffer(bytearray(os.urandom(min(per * 4, 16 << 20))), dtype=torch.uint8)
    sd = {}
    for i in range(count):
        n = per if i < count - 1 else max(1, (total - per * 4 * (count - 1)) // 4)
        t = pinned.empty(n, torch.float32) if locked else torch.empty(n, dtype=torch.float32)
        raw = t.view(torch.uint8)
        for s in range(0, raw.numel(), noise.numel()):
            k = min(noise.numel(), raw.numel() - s)
            raw[s:s + k].copy_(noise[:k])
        raw[:8].copy_(torch.tensor([i] * 8, dtype=torch.uint8))    # distinct tensors
        cols = 1024 if n % 1024 == 0 else 1
        sd[f"layer{i}.weight"] = t.view(-1, cols)
    return sd


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-exact equality (random bytes as float32 include NaNs, which == rejects)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def nbytes_of(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def run_direct(h: aioswap.AioHandle, buf: torch.Tensor, out: torch.Tensor, work: str,
               drop: str) -> tuple[float, float]:
    path = os.path.join(work, "direct.bin")
    w, _ = timed(lambda: h.pwrite(buf, path, fsync=True))
    drop_cache([path], drop)
    r, _ = timed(lambda: h.pread(out, path))
    if not torch.equal(buf, out):
        raise SystemExit("direct transfer read back different bytes")
    os.unlink(path)
    return w, r


def run_swap(h: aioswap.AioHandle, sd: dict[str, torch.Tensor], work: str, drop: str,
             locked: bool, verify: bool) -> tuple[float, float]:
    d = os.path.join(work, "swap-pinned" if locked else "swap")
    with TensorSwapper(d, handle=h, verify=verify) as sw:
        w, _ = timed(lambda: sw.swap_out_state_dict("bench/", sd))
        drop_cache([sw.info(n).file for n in sw.names()], drop)
        if locked:      # page-locked destinations: O_DIRECT straight into them
            outs = {k: pinned.empty(v.shape, v.dtype) for k, v in sd.items()}
            r, got = timed(lambda: sw.swap_in_state_dict("bench/", state_dict=outs))
        else:           # the usual case: swap_in allocates plain tensors
            r, got = timed(lambda: sw.swap_in_state_dict("bench/"))
        for k, v in sd.items():
            if not same(got[k], v):
                raise SystemExit(f"TensorSwapper read back different bytes for {k}")
        del got
        sw.destroy()
    return w, r


def run_torch(sd: dict[str, torch.Tensor], work: str, drop: str) -> tuple[float, float]:
    path = os.path.join(work, "torch.pt")

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    w, _ = timed(save)
    drop_cache([path], drop)
    r, got = timed(lambda: torch.load(path, weights_only=True))
    for k, v in sd.items():
        if not same(got[k], v):
            raise SystemExit(f"torch.load read back different bytes for {k}")
    del got
    os.unlink(path)
    return w, r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=".", help="directory on the disk to measure")
    p.add_argument("--size", type=parse_size, default=parse_size("1G"),
                   help="total bytes of the state dict (default 1G)")
    p.add_argument("--tensors", type=int, default=64, help="tensors in the state dict")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the best is reported")
    p.add_argument("--block-size", type=parse_size, default=parse_size("1M"))
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--intra-op-parallelism", type=int, default=1,
                   help="handle lanes; each lane adds a bounce stream for plain tensors")
    p.add_argument("--no-verify", action="store_true", help="swap_in without checksum checks")
    p.add_argument("--drop-caches", choices=["fadvise", "sysctl"], default="fadvise",
                   help="fadvise: posix_fadvise(DONTNEED) per file after fsync; sysctl: also "
                        "echo 1 > /proc/sys/vm/drop_caches (root)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.tensors < 1:
        p.error("--tensors must be >= 1")
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="aioswap-bench-swap-", dir=a.dir)
    drop_how = ("posix_fadvise(POSIX_FADV_DONTNEED) after fsync" if a.drop_caches == "fadvise"
                else "posix_fadvise(DONTNEED) + echo 1 > /proc/sys/vm/drop_caches")

    def log(msg: str) -> None:
        if not a.json:
            print(msg, file=sys.stderr, flush=True)

    try:
        log("preparing tensors...")
        plain = make_state_dict(a.size, a.tensors, locked=False)
        locked = {k: pinned.empty(v.shape, v.dtype) for k, v in plain.items()}
        for k, v in plain.items():
            locked[k].copy_(v)
        total = nbytes_of(plain)
        one = pinned.empty(total, torch.uint8)
        off = 0
        for v in plain.values():
            n = v.numel() * v.element_size()
            one[off:off + n].copy_(v.reshape(-1).view(torch.uint8))
            off += n
        one_out = pinned.empty(total, torch.uint8)

        methods: dict[str, Callable[[], tuple[float, float]]] = {}
        verify = not a.no_verify
        with aioswap.AioHandle(block_size=a.block_size, queue_depth=a.queue_depth,
                               intra_op_parallelism=a.intra_op_parallelism) as h:
            methods["direct"] = lambda: run_direct(h, one, one_out, work, a.drop_caches)
            methods["swap"] = lambda: run_swap(h, plain, work, a.drop_caches, False, verify)
            methods["swap_pinned"] = lambda: run_swap(h, locked, work, a.drop_caches, True,
                                                      verify)
            methods["torch"] = lambda: run_torch(plain, work, a.drop_caches)
            best: dict[str, list[float]] = {}
            for rnd in range(a.repeat):
                for name, fn in methods.items():
                    w, r = fn()
                    b = best.setdefault(name, [w, r])
                    b[0], b[1] = min(b[0], w), min(b[1], r)
                    log(f"round {rnd + 1}/{a.repeat}: {name} write {total / w / 1e9:.2f} GB/s, "
                        f"read {total / r / 1e9:.2f} GB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)     # the temporary directory made above

    labels = {"direct": "direct: 1 transfer, locked (ceiling)",
              "swap": "TensorSwapper, plain (in: new tensors)",
              "swap_pinned": "TensorSwapper, locked (in: into locked)",
              "torch": "torch.save+fsync / torch.load"}
    res: dict[str, Any] = {"bytes": total, "tensors": a.tensors, "block_size": a.block_size,
                           "queue_depth": a.queue_depth,
                           "intra_op_parallelism": a.intra_op_parallelism,
                           "verify": not a.no_verify, "repeat": a.repeat,
                           "page_cache": drop_how}
    for name, (w, r) in best.items():
        res[name] = {"label": labels[name], "write_s": w, "read_s": r,
                     "write_gbps": total / w / 1e9, "read_gbps": total / r / 1e9}
    ratios = {}
    for sw in ("swap", "swap_pinned"):
        for ref in ("torch", "direct"):
            for op in ("write", "read"):
                ratios[f"{sw}/{ref} {op}"] = (res[sw][f"{op}_gbps"] / res[ref][f"{op}_gbps"])
    res["ratios"] = ratios
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{format_size(total)} in {a.tensors} tensors of {format_size(total // a.tensors)}, "
          f"block {format_size(a.block_size)}, queue depth {a.queue_depth}, "
          f"intra_op_parallelism {a.intra_op_parallelism}, swap_in verify "
          f"{'off' if a.no_verify else 'on'}, best of {a.repeat}; page cache dropped before "
          f"reads with {drop_how}; GB/s = 10^9 B/s")
    print(f"{'method':<42}{'write GB/s':>11}{'read GB/s':>11}")
    for name in methods:
        print(f"{labels[name]:<42}{res[name]['write_gbps']:>11.2f}"
              f"{res[name]['read_gbps']:>11.2f}")
    for sw in ("swap", "swap_pinned"):
        print(f"{labels[sw]}: x{ratios[f'{sw}/torch write']:.2f} / "
              f"x{ratios[f'{sw}/torch read']:.2f} of torch (write/read), "
              f"x{ratios[f'{sw}/direct write']:.2f} / x{ratios[f'{sw}/direct read']:.2f} of "
              f"direct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
