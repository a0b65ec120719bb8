#!/usr/bin/env python3
"""aioswap.safetensors against safetensors.torch and against one direct transfer, same run.

The state dict is GPT-like: ``--layers`` blocks of hidden size ``--hidden``, each with
q/k/v/o projections, fc1/fc2 (4 x hidden) and their biases, and two layer norms (weight and
bias): 16 tensors, each present three times (the parameter and Adam's m and v), float32.
``--layers 12 --hidden 1024`` is the 576-tensor, 1.69 GiB (1.81 GB) dict of the swapper issue; the
default is a tiny one for the smoke test.

Each round runs, in turn:

* **aioswap**: ``aioswap.safetensors.save_file`` (fsync and rename included) and
  ``load_file`` (page-locked tensors, direct I/O);
* **safetensors**: ``safetensors.torch.save_file`` followed by an fsync of the file, and
  ``safetensors.torch.load_file`` (mmap);
* **direct**: the same number of bytes written and read as ONE transfer of one page-locked
  buffer with ``AioHandle.pwrite(fsync=True)`` / ``pread``: a reference for this disk.

Loads read the same file (written by safetensors). Before every load the file's page cache is
dropped (``posix_fadvise(DONTNEED)``, or also ``/proc/sys/vm/drop_caches`` with
``--drop-caches sysctl``, as root) and after it every page of the result is touched, so the
time includes reading every byte from the disk; freeing the result is on the clock too.
Warm loads run in this process (memory it already used); then ``--cold`` rounds (default
``--repeat``) load in a fresh process each (``benchmarks/_cold.py``: allocation included).
Methods alternate within each round; the table gives the median of the rounds with the
spread (min-max), GB/s = 10^9 B/s, and ratios aioswap/other (bigger is better): the median of
the ratios within each round (the methods ran back to back there), so a drive whose speed
drifts between rounds does not decide them (the ratio of the medians: ``ratios_of_medians``
in the JSON).

    python benchmarks/bench_safetensors.py --dir /nvme --layers 12 --hidden 1024 --repeat 5
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import _cold as cold
import torch

import aioswap
import aioswap.safetensors as ast
from aioswap import pinned
from _common import drop_cache as _drop_cache
from _common import dir_arg, format_size, freed, gpt_state_dict

try:
    import safetensors.torch as st
except ImportError:                    # the comparison row is left out
    st = None


def drop_cache(path: str, how: str) -> None:
    """Make sure the next read of ``path`` comes from the disk."""
    _drop_cache(path)
    if how == "sysctl":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def state_dict(layers: int, hidden: int) -> dict[str, torch.Tensor]:
    """16 tensors per layer, each as param, exp_avg and exp_avg_sq; random bytes."""
    return gpt_state_dict(layers, hidden)


def touch(tensors: Any) -> None:
    """Read one byte of every page of every tensor."""
    for t in tensors:
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def touched(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``d``, after every page of its tensors was read."""
    touch(d.values())
    return d


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)



def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=dir_arg, default=".", help="directory on the disk to measure")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3); median shown")
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--drop-caches", choices=["fadvise", "sysctl"], default="fadvise",
                   help="fadvise: posix_fadvise(DONTNEED) on the file; sysctl: also "
                        "echo 1 > /proc/sys/vm/drop_caches (root)")
    p.add_argument("--cold", type=int, default=None,
                   help="cold loads per method, each in a fresh process (default: --repeat)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    a = p.parse_args(argv)
    if a.layers < 1 or a.hidden < 1 or a.repeat < 1:
        p.error("--layers, --hidden and --repeat must be >= 1")
    if a.cold is None:
        a.cold = a.repeat
    if a.cold < 0:
        p.error("--cold must be >= 0")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = tempfile.mkdtemp(prefix="aioswap-bench-safetensors-", dir=a.dir)
    times: dict[str, dict[str, list[float]]] = {}
    try:
        log("preparing tensors...")
        sd = state_dict(a.layers, a.hidden)
        total = sum(t.numel() * t.element_size() for t in sd.values())
        ref = os.path.join(work, "reference.safetensors")
        if st is not None:
            st.save_file(sd, ref)
        else:
            ast.save_file(sd, ref)
        fsize = os.path.getsize(ref)
        one = pinned.empty(fsize, torch.uint8)
        with open(ref, "rb") as f:
            f.readinto(memoryview(one.numpy()))
        one_out = pinned.empty(fsize, torch.uint8)

        with aioswap.AioHandle(block_size=a.block_size, queue_depth=a.queue_depth) as h:
            def aio_save() -> float:
                out = os.path.join(work, "aioswap.safetensors")
                dt, _ = timed(lambda: ast.save_file(sd, out, handle=h))
                os.unlink(out)
                return dt

            def aio_load() -> float:
                drop_cache(ref, a.drop_caches)
                dt, got = timed(lambda: touched(ast.load_file(ref, handle=h)))
                return dt + freed(got)

            def st_save() -> float:
                out = os.path.join(work, "st.safetensors")

                def save() -> None:
                    st.save_file(sd, out)
                    fd = os.open(out, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                dt, _ = timed(save)
                os.unlink(out)
                return dt

            def st_load() -> float:
                drop_cache(ref, a.drop_caches)
                dt, got = timed(lambda: touched(st.load_file(ref)))
                return dt + freed(got)

            def direct_save() -> float:
                out = os.path.join(work, "direct.bin")
                dt, _ = timed(lambda: h.pwrite(one, out, fsync=True))
                os.unlink(out)
                return dt

            def direct_load() -> float:
                drop_cache(ref, a.drop_caches)
                dt, _ = timed(lambda: (h.pread(one_out, ref), touch([one_out])))
                return dt

            methods: dict[str, tuple[Callable[[], float], Callable[[], float]]] = {
                "aioswap": (aio_save, aio_load)}
            if st is not None:
                methods["safetensors"] = (st_save, st_load)
            methods["direct"] = (direct_save, direct_load)

            # correctness first (untimed): each writer's file loads back identically
            if not same(ast.load_file(ref, handle=h), sd):
                raise SystemExit("aioswap.safetensors.load_file read back different tensors")
            chk = os.path.join(work, "check.safetensors")
            ast.save_file(sd, chk, handle=h)
            back = st.load_file(chk) if st is not None else ast.load_file(chk, handle=h)
            if not same(back, sd):
                raise SystemExit("a file from aioswap.safetensors.save_file loads differently")
            del back
            os.unlink(chk)
            h.pread(one_out, ref)
            if not torch.equal(one, one_out):
                raise SystemExit("the direct read returned different bytes")

            for rnd in range(a.repeat):
                for name, (save, load) in methods.items():
                    w, r = save(), load()
                    t = times.setdefault(name, {"save": [], "load": [], "cold": []})
                    t["save"].append(w)
                    t["load"].append(r)
                    log(f"round {rnd + 1}/{a.repeat}: {name} save {total / w / 1e9:.2f} GB/s, "
                        f"warm load {total / r / 1e9:.2f} GB/s")
            # cold: each load in a fresh process, allocation and freeing on the clock
            cold_of = {"aioswap": ("aioswap-safetensors", want := cold.digest(sd)),
                       "safetensors": ("safetensors", want),
                       "direct": ("direct", cold.digest({"x": one}))}
            for rnd in range(a.cold):
                for name in methods:
                    method, digest = cold_of[name]
                    drop_cache(ref, a.drop_caches)
                    got = cold.run_cold(method, ref)
                    if got["digest"] != digest:
                        raise SystemExit(f"cold {method} load read back different bytes")
                    times[name]["cold"].append(got["total_s"])
                    log(f"cold {rnd + 1}/{a.cold}: {name} load "
                        f"{total / got['total_s'] / 1e9:.2f} GB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)     # the temporary directory made above

    labels = {"aioswap": "aioswap.safetensors", "safetensors": "safetensors.torch (+fsync)",
              "direct": "direct: 1 locked transfer (warm: no alloc/free)"}
    res: dict[str, Any] = {
        "bytes": total, "file_bytes": fsize, "tensors": len(sd), "layers": a.layers,
        "hidden": a.hidden, "repeat": a.repeat, "block_size": a.block_size,
        "queue_depth": a.queue_depth, "drop_caches": a.drop_caches, "methods": {}}
    # no cold column (nor NaN, which is not JSON) with --cold 0
    ops = ("save", "load", "cold") if a.cold else ("save", "load")
    for name, t in times.items():
        row: dict[str, Any] = {"label": labels[name]}
        for op in ops:
            gbps = [total / s / 1e9 for s in t[op]]
            row[f"{op}_GBps"] = statistics.median(gbps)
            row[f"{op}_GBps_all"] = gbps
        res["methods"][name] = row
    ratios = {}
    of_medians = {}
    for other in res["methods"]:
        if other != "aioswap":
            for op in ops:
                # paired: the other's time / aioswap's in the same round, then the median
                pairs = [b / m for m, b in zip(times["aioswap"][op], times[other][op])]
                ratios[f"aioswap/{other} {op}"] = statistics.median(pairs)
                of_medians[f"aioswap/{other} {op}"] = (res["methods"]["aioswap"][f"{op}_GBps"]
                                                       / res["methods"][other][f"{op}_GBps"])
    res["ratios"] = ratios
    res["ratios_of_medians"] = of_medians
    if st is None:
        res["notes"] = ["safetensors is not installed: its row is left out"]
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    how = ("posix_fadvise(DONTNEED)" if a.drop_caches == "fadvise"
           else "posix_fadvise(DONTNEED) + drop_caches")
    print(f"{len(sd)} tensors, {format_size(total)} ({a.layers} layers, hidden {a.hidden}, "
          f"float32, param + Adam m/v); median of {a.repeat} rounds (spread min-max); page "
          f"cache dropped before loads with {how}, every page of the result touched; "
          f"GB/s = 10^9 B/s; ratios aioswap/other, bigger is better")
    print("load = warm: in this process, on memory it already used; cold: a fresh process "
          "per load, allocating and freeing on the clock")
    print(f"{'method':<48}{'save GB/s':>10}{'spread':>12}{'load GB/s':>11}{'spread':>12}"
          + (f"{'cold GB/s':>11}{'spread':>12}" if a.cold else ""))
    for name, row in res["methods"].items():
        cells = []
        for op in ops:
            v = row[f"{op}_GBps_all"]
            spread = f"{min(v):.2f}-{max(v):.2f}" if v else "-"
            cells.append(f"{row[f'{op}_GBps']:>10.2f}{spread:>12}")
        print(f"{row['label']:<48}{' '.join(cells)}")
    for key, v in ratios.items():
        print(f"ratio {key}: x{v:.2f}")
    for note in res.get("notes", []):
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
