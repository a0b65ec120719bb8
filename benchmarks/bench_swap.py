#!/usr/bin/env python3
"""TensorSwapper state dicts against safetensors, torch.save/load and one direct transfer.

The state dict is GPT-like with Adam state: ``--layers`` layers of hidden size ``--hidden``
(q/k/v/o weights and biases, fc1/fc2 weights (``--ffn`` x hidden) and biases, two layer norms'
weight and bias), each tensor as ``--states`` copies (param, adam m, adam v), float32, random
bytes. ``--layers 12 --hidden 1024`` is the 576-tensor, 1.69 GiB (1.81 GB) case, tensors from
4 KiB to 16 MiB; the default is tiny, for the smoke test.

Methods, in one run, alternating (the starting method rotates each round):

* aioswap: ``TensorSwapper.swap_out_state_dict`` (packed, fsynced, manifest committed) /
  ``swap_in_state_dict`` (checksums verified; fresh tensors page-locked within the default
  budget), on one swap directory kept open for the run, as a swapping job keeps it (cleared
  after each round, outside the timing, as the other methods delete their files); also
  loaded with ``verify=False`` to show what verification costs;
* safetensors (when importable): ``save_file`` + fsync / ``load_file``;
* torch: ``torch.save`` + fsync / ``torch.load(weights_only=True)``;
* direct: the same bytes as one page-locked buffer, ``AioHandle.pwrite(fsync=True)`` / ``pread``
  (a reference: one transfer of the same bytes, which a packed swap can beat).

Warm rounds run each method in this process, on memory the process already used (freed
locked memory is kept for reuse); the first ``--warmup`` round(s) (default 1) of every method
run but are not counted, since a method's first load in the process is the one that has
not used its memory yet (that load is what the cold rounds measure). Then come ``--cold``
rounds (default: ``--repeat``): each load in a fresh process (``benchmarks/_cold.py``), the
clock covering the loader, allocating fresh memory, reading, touching and freeing, which is
what a user who loads a state dict once pays. ``direct``'s warm load reads into a buffer
allocated up front (no allocation, no free); its cold load allocates one locked buffer of the
whole size.

Before every load, the files are fsynced and dropped from the page cache
(``posix_fadvise(DONTNEED)``; ``--drop-caches sysctl`` also writes ``/proc/sys/vm/drop_caches``,
as root). After every load, one byte of every page of every tensor is read (inside the
timing), so lazily mapped loads pay for their reads; then the bytes are compared (outside it).
Figures: median over ``--repeat`` rounds, GB/s = 10^9 bytes/s. Ratios aioswap/other (bigger is
better: above 1, aioswap is faster) are the median of the ratios within each round (the two
methods ran back to back there), so a drive whose speed drifts between rounds (this VM's
moves by ±30%) does not decide them; the ratio of the two medians is in the JSON too
(``ratios_of_medians``).

"device reads/warm load" (JSON: ``load_device_reads``) is the median count of read requests
the drive completed during a warm load (``/sys/dev/block/MAJ:MIN/stat``; every process's I/O,
so run it on a quiet machine; "-" where the directory has no block device). The same bytes
can take a few hundred requests or several thousand: the kernel splits a read whose memory
has more scattered pages than the device takes in one request (``max_segments``), so the
count depends on where each method's memory happens to lie. It is there to be looked at, not
a verdict: on a 2-core VM with a virtio disk (254 segments) one run had the direct transfer
at 3,459 requests and 2.07 GB/s against aioswap's 795 and 1.53 GB/s, while replays of the
swap-in's reads into one buffer (505 requests) ran 1.16x faster than into one buffer per
tensor (1,340).

    python benchmarks/bench_swap.py --dir /nvme --layers 12 --hidden 1024 --repeat 3
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

import torch
from _common import (GB, UNITS_NOTE, device_reads, dir_arg, format_size, freed, orders,
                     print_table)
import _cold as cold
from _common import drop_cache as _drop_cache

import aioswap
from aioswap import TensorSwapper, pinned

try:
    import safetensors.torch as st_torch
except ImportError:             # optional
    st_torch = None


def drop_cache(paths: list[str], how: str) -> None:
    """Make sure the next reads of ``paths`` come from the disk (fsync, then evict)."""
    for p in paths:
        _drop_cache(p)
    if how == "sysctl":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def files_under(d: str) -> list[str]:
    return [os.path.join(d, f) for f in sorted(os.listdir(d))
            if os.path.isfile(os.path.join(d, f))]


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_state_dict(layers: int, hidden: int, ffn: int, states: int) -> dict[str, torch.Tensor]:
    """The GPT-like dict with Adam state; random bytes, every tensor distinct."""
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        p = f"layers.{i}."
        for w in ("q", "k", "v", "o"):
            shapes += [(p + f"attn.{w}.weight", (hidden, hidden)),
                       (p + f"attn.{w}.bias", (hidden,))]
        shapes += [(p + "mlp.fc1.weight", (ffn, hidden)), (p + "mlp.fc1.bias", (ffn,)),
                   (p + "mlp.fc2.weight", (hidden, ffn)), (p + "mlp.fc2.bias", (hidden,))]
        for ln in ("ln1", "ln2"):
            shapes += [(p + f"{ln}.weight", (hidden,)), (p + f"{ln}.bias", (hidden,))]
    kinds = ["param", "adam_m", "adam_v"][:states] + [f"state{k}" for k in range(3, states)]
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=gen)
    sd: dict[str, torch.Tensor] = {}
    pos = 0
    for kind in kinds:
        for name, shape in shapes:
            t = torch.empty(shape, dtype=torch.float32)
            raw = t.view(-1).view(torch.uint8)
            for s in range(0, raw.numel(), noise.numel()):
                k = min(noise.numel(), raw.numel() - s)
                start = (pos + s) % (noise.numel() - k + 1)
                raw[s:s + k].copy_(noise[start:start + k])
            raw[:4].copy_(torch.tensor(list(len(sd).to_bytes(4, "little")), dtype=torch.uint8))
            pos += 4099
            sd[f"{kind}.{name}"] = t
    return sd


def nbytes_of(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def touch(sd: dict[str, torch.Tensor]) -> int:
    """Read one byte of every page of every tensor."""
    s = 0
    for t in sd.values():
        if t.numel():
            s += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return s


def same(sd: dict[str, torch.Tensor], got: dict[str, torch.Tensor], who: str) -> None:
    if list(got) != list(sd):
        raise SystemExit(f"{who}: keys differ")
    for k, v in sd.items():
        g = got[k]
        if g.shape != v.shape or not torch.equal(g.reshape(-1).view(torch.uint8),
                                                 v.reshape(-1).view(torch.uint8)):
            raise SystemExit(f"{who} read back different bytes for {k}")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


class Methods:
    """Each method: one save and one load of ``sd`` in ``work``; returns (save_s, load_s)."""

    def __init__(self, h: aioswap.AioHandle, sd: dict[str, torch.Tensor], work: str,
                 drop: str) -> None:
        self.h, self.sd, self.work, self.drop = h, sd, work, drop
        self.reads: int | None = None       # device read requests of the last load
        total = nbytes_of(sd)
        # one swap area, as a swapping job keeps it: each save replaces the previous one
        self.swapper = TensorSwapper(os.path.join(work, "aioswap"), handle=h)
        self.one = pinned.empty(total, torch.uint8)
        self.one_out = pinned.empty(total, torch.uint8)
        off = 0
        for v in sd.values():
            n = v.numel() * v.element_size()
            self.one[off:off + n].copy_(v.reshape(-1).view(torch.uint8))
            off += n

    def _load(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """``timed(fn)``, counting the read requests the drive completed meanwhile."""
        before = device_reads(self.work)
        r, got = timed(fn)
        after = device_reads(self.work)
        self.reads = None if before is None or after is None else after - before
        return r, got

    def _aioswap(self, verify: bool) -> tuple[float, float]:
        sw = self.swapper
        w, _ = timed(lambda: sw.swap_out_state_dict("", self.sd))
        drop_cache(files_under(sw.directory), self.drop)

        def load() -> dict[str, torch.Tensor]:
            got = sw.swap_in_state_dict("", verify=verify)
            touch(got)
            return got

        r, got = self._load(load)
        same(self.sd, got, "aioswap")
        r += freed(got)
        sw.clear()      # outside the timing, as the other methods delete their files
        return w, r

    def close(self) -> None:
        self.swapper.destroy()

    def cold_files(self, name: str) -> tuple[str, str, str, list[str]]:
        """Write ``name``'s files for the cold loads: (child method, path, digest of what it
        must load, files to drop from the page cache)."""
        sd, path = self.sd, os.path.join(self.work, f"cold-{name}")
        if name == "aioswap":
            with TensorSwapper(path, handle=self.h) as sw:
                sw.swap_out_state_dict("", sd)
            return "aioswap-swap", path, cold.digest(sd), files_under(path)
        if name == "safetensors":
            assert st_torch is not None
            st_torch.save_file(sd, path)
            return "safetensors", path, cold.digest(sd), [path]
        if name == "torch":
            torch.save(sd, path)
            return "torch", path, cold.digest(sd), [path]
        self.h.pwrite(self.one, path, fsync=True)
        return "direct", path, cold.digest({"x": self.one}), [path]

    def aioswap(self) -> tuple[float, float]:
        return self._aioswap(True)

    def aioswap_noverify(self) -> tuple[float, float]:
        return self._aioswap(False)

    def safetensors(self) -> tuple[float, float]:
        assert st_torch is not None
        path = os.path.join(self.work, "model.safetensors")

        def save() -> None:
            st_torch.save_file(self.sd, path)
            fsync_path(path)

        def load() -> dict[str, torch.Tensor]:
            got = st_torch.load_file(path)
            touch(got)
            return got

        w, _ = timed(save)
        drop_cache([path], self.drop)
        r, got = self._load(load)
        same(self.sd, {k: got[k] for k in self.sd}, "safetensors")
        r += freed(got)
        os.unlink(path)
        return w, r

    def torch(self) -> tuple[float, float]:
        path = os.path.join(self.work, "model.pt")

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(self.sd, f)
                f.flush()
                os.fsync(f.fileno())

        def load() -> dict[str, torch.Tensor]:
            got = torch.load(path, weights_only=True)
            touch(got)
            return got

        w, _ = timed(save)
        drop_cache([path], self.drop)
        r, got = self._load(load)
        same(self.sd, got, "torch.load")
        r += freed(got)
        os.unlink(path)
        return w, r

    def direct(self) -> tuple[float, float]:
        path = os.path.join(self.work, "direct.bin")
        w, _ = timed(lambda: self.h.pwrite(self.one, path, fsync=True))
        drop_cache([path], self.drop)
        r, _ = self._load(lambda: (self.h.pread(self.one_out, path),
                                   touch({"x": self.one_out})))
        if not torch.equal(self.one, self.one_out):
            raise SystemExit("direct transfer read back different bytes")
        os.unlink(path)
        return w, r


LABELS = {"aioswap": "aioswap swap_out/in_state_dict",
          "aioswap_noverify": "aioswap, load with verify=False",
          "safetensors": "safetensors save_file/load_file",
          "torch": "torch.save/torch.load(weights_only)",
          "direct": "direct: 1 locked transfer (warm load: preallocated, no alloc/free)"}
#: methods with a cold load (a fresh process each; see benchmarks/_cold.py)
COLD = ("aioswap", "safetensors", "torch", "direct")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=dir_arg, default=".", help="directory on the disk to measure")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--ffn", type=int, default=None, help="fc1/fc2 width (default 4 x hidden)")
    p.add_argument("--states", type=int, default=3,
                   help="copies of every tensor: param, adam m, adam v (default 3)")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the median is reported")
    p.add_argument("--warmup", type=int, default=1,
                   help="warm rounds run first and not counted (default 1)")
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--methods", default="aioswap,aioswap_noverify,safetensors,torch,direct",
                   help="comma-separated subset of: " + ", ".join(LABELS))
    p.add_argument("--drop-caches", choices=["fadvise", "sysctl"], default="fadvise",
                   help="fadvise: posix_fadvise(DONTNEED) per file after fsync; sysctl: also "
                        "echo 1 > /proc/sys/vm/drop_caches (root)")
    p.add_argument("--cold", type=int, default=None,
                   help="cold loads per method, each in a fresh process (default: --repeat; "
                        "0: none)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    for flag in ("layers", "hidden", "states", "repeat"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be >= 1")
    if a.cold is None:
        a.cold = a.repeat
    if a.cold < 0:
        p.error("--cold must be >= 0")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    names = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in LABELS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {', '.join(LABELS)}")
    if st_torch is None and "safetensors" in names:
        names.remove("safetensors")
    ffn = a.ffn or 4 * a.hidden
    work = tempfile.mkdtemp(prefix="aioswap-bench-swap-", dir=a.dir)

    def log(msg: str) -> None:
        if not a.json:
            print(msg, file=sys.stderr, flush=True)

    times: dict[str, list[tuple[float, float]]] = {m: [] for m in names}
    reads: dict[str, list[int | None]] = {m: [] for m in names}
    colds: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
    try:
        log("preparing tensors...")
        sd = make_state_dict(a.layers, a.hidden, ffn, a.states)
        total = nbytes_of(sd)
        sizes = [v.numel() * v.element_size() for v in sd.values()]
        with aioswap.AioHandle(block_size=a.block_size, queue_depth=a.queue_depth) as h:
            ms = Methods(h, sd, work, a.drop_caches)
            try:
                for rnd, order in enumerate(orders(names, a.warmup + a.repeat)):
                    for name in order:
                        w, r = getattr(ms, name)()
                        what = (f"warm-up {rnd + 1}/{a.warmup} (not counted)" if rnd < a.warmup
                                else f"round {rnd + 1 - a.warmup}/{a.repeat}")
                        if rnd >= a.warmup:
                            times[name].append((w, r))
                            reads[name].append(ms.reads)
                        log(f"{what}: {name}: save {total / w / GB:.2f} GB/s, warm load "
                            f"{total / r / GB:.2f} GB/s"
                            + ("" if ms.reads is None else f" ({ms.reads} device reads)"))
                cold_names = [n for n in names if n in COLD] if a.cold else []
                files = {n: ms.cold_files(n) for n in cold_names}
                for rnd, order in enumerate(orders(cold_names, a.cold)):
                    for name in order:
                        method, path, want, paths = files[name]
                        drop_cache(paths, a.drop_caches)
                        got = cold.run_cold(method, path)
                        if got["digest"] != want:
                            raise SystemExit(f"cold {method} load read back different bytes")
                        colds[name].append(got)
                        gbps = total / got["total_s"] / GB
                        log(f"cold {rnd + 1}/{a.cold}: {name}: load {gbps:.2f} GB/s (fresh "
                            f"process; allocation and freeing included)")
            finally:
                ms.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)     # the temporary directory made above

    res: dict[str, Any] = {"bytes": total, "tensors": len(sd), "min_tensor": min(sizes),
                           "max_tensor": max(sizes), "layers": a.layers, "hidden": a.hidden,
                           "ffn": ffn, "states": a.states, "repeat": a.repeat,
                           "warmup": a.warmup,
                           "block_size": a.block_size, "queue_depth": a.queue_depth,
                           "page_cache": a.drop_caches, "cold_rounds": a.cold, "methods": {}}
    for name in names:
        w = statistics.median(t[0] for t in times[name])
        r = statistics.median(t[1] for t in times[name])
        m = res["methods"][name] = {"label": LABELS[name], "save_s": w, "load_s": r,
                                    "save_gbps": total / w / GB, "load_gbps": total / r / GB}
        counted = [n for n in reads[name] if n is not None]
        m["load_device_reads"] = statistics.median(counted) if counted else None
        if colds[name]:
            c = statistics.median(x["total_s"] for x in colds[name])
            m.update(cold_load_s=c, cold_load_gbps=total / c / GB,
                     cold_load_gbps_all=[total / x["total_s"] / GB for x in colds[name]],
                     cold_maxrss_kib=max(x["maxrss_kib"] for x in colds[name]))
    ratios: dict[str, float] = {}
    of_medians: dict[str, float] = {}
    if "aioswap" in names:
        me = res["methods"]["aioswap"]
        for other in names:
            if other != "aioswap":
                o = res["methods"][other]
                # paired: other's time / aioswap's time within each round, then the median
                ratios[f"save vs {other}"] = statistics.median(
                    b[0] / m[0] for m, b in zip(times["aioswap"], times[other]))
                ratios[f"warm load vs {other}"] = statistics.median(
                    b[1] / m[1] for m, b in zip(times["aioswap"], times[other]))
                of_medians[f"save vs {other}"] = me["save_gbps"] / o["save_gbps"]
                of_medians[f"warm load vs {other}"] = me["load_gbps"] / o["load_gbps"]
                if "cold_load_gbps" in me and "cold_load_gbps" in o:
                    ratios[f"cold load vs {other}"] = statistics.median(
                        b["total_s"] / m["total_s"]
                        for m, b in zip(colds["aioswap"], colds[other]))
                    of_medians[f"cold load vs {other}"] = (me["cold_load_gbps"]
                                                           / o["cold_load_gbps"])
    res["ratios"] = ratios
    res["ratios_of_medians"] = of_medians
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    title = (f"{len(sd)} tensors ({format_size(min(sizes))} .. {format_size(max(sizes))}), "
             f"{format_size(total)} ({total / GB:.2f} GB) in all; {a.layers} layers, hidden "
             f"{a.hidden}, ffn {ffn}, {a.states} states; median of {a.repeat} warm (after "
             f"{a.warmup} warm-up) and {a.cold} cold round(s), methods alternating, ratios "
             f"the median of each round's; page cache dropped before loads "
             f"({a.drop_caches}); every page touched after loading, freeing included; warm: "
             f"in this process (memory it already used); cold: a fresh process per load, "
             f"allocation included; {UNITS_NOTE}")
    nan = float("nan")
    rows = []
    for name in names:
        m = res["methods"][name]
        rows.append([m["label"], m["save_gbps"], m["load_gbps"], m.get("cold_load_gbps", nan),
                     ratios.get(f"save vs {name}", nan), ratios.get(f"warm load vs {name}", nan),
                     ratios.get(f"cold load vs {name}", nan),
                     "-" if m["load_device_reads"] is None else round(m["load_device_reads"])])
    print_table(["method", "save GB/s", "warm load GB/s", "cold load GB/s", "ratio save",
                 "ratio warm", "ratio cold", "device reads/warm load"], rows, title=[title])
    return 0


if __name__ == "__main__":
    sys.exit(main())
