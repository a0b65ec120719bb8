#!/usr/bin/env python3
"""Training state streamed through memory (aioswap.stream) against the synchronous loops.

The state: ``--numel`` fp32 parameters with Adam's two moments (12 bytes per parameter), in
``--buckets`` buckets (default 8). The update is ``torch.optim.Adam``'s (``foreach=False``),
checked bit for bit against it at the start; the gradient is a stand-in (``sin(p) / 100``).

Offload + onload of the whole state (the state in page-locked memory, restored in place):

* aioswap: ``aioswap.offload`` (one packed, fsynced, crash-safe commit) / ``aioswap.onload``
  (checksums verified);
* sync staging (torch_memory_saver's algorithm): per bucket, each tensor through one
  ``--staging`` (256 MiB) page-locked buffer, buffered ``pwrite`` then ``fsync``; ``pread``
  back through the buffer;
* torch: ``torch.save`` + fsync / ``torch.load`` per bucket, copied into the state;
* direct: the same bytes as one page-locked buffer, ``AioHandle.pwrite(fsync=True)`` /
  ``pread`` (a reference: what one large transfer of the same bytes takes).

One optimizer step over the buckets on NVMe (read, update, write back each bucket):

* streamed: ``aioswap.stream`` (``--prefetch`` read ahead, write-back behind) over
  ``--steps`` steps in one stream (reading ahead across step boundaries), per step;
* its parts, measured apart: compute (the update on buckets in memory) and I/O (the same
  stream with no update, per step);
* sync staging and torch: read a bucket, update it, write it back, next bucket.

Before every read pass the files are fsynced and dropped from the page cache
(``posix_fadvise``). Resident memory (``/proc/self/statm``, sampled every 2 ms) is tracked
from before the first stream is made to the end of the streamed steps; its growth (the
largest of the rounds) is compared with the stream's stated bound (``Stream.memory_bytes``).
Figures are medians over ``--repeat`` rounds; GB/s = 10^9 bytes/s; a ratio is aioswap / other
as a speed (bigger is better), except ``streamed_step_vs_max_compute_io`` and
``rss_growth_vs_bound`` (time and memory: at most 1.15 and 1 are the aims).

    python benchmarks/bench_stream.py --dir /nvme --numel 128M --repeat 3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import torch
from _common import GB, UNITS_NOTE, dir_arg, format_size, print_table, ratio, size_arg
from _common import drop_cache as _drop_cache

import aioswap
from aioswap import AioHandle, TensorSwapper, offload, onload, pinned

KINDS = ("param", "exp_avg", "exp_avg_sq")
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- the update ------------------------------------------------------------------------------
def adam_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
          scratch: torch.Tensor, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
          eps: float = 1e-8) -> None:
    """torch.optim.Adam(foreach=False)'s update, in place, with one scratch tensor."""
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    torch.sqrt(v, out=scratch)
    scratch.div_((1 - beta2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m, scratch, value=-lr / (1 - beta1 ** step))


class Update:
    """The per-bucket work, with reused gradient and scratch buffers."""

    def __init__(self, numel: int) -> None:
        self.grad = torch.empty(numel)
        self.scratch = torch.empty(numel)
        self.step = 1

    def __call__(self, b: Any) -> None:
        p = b["param"]
        n = p.numel()
        g = torch.sin(p, out=self.grad[:n]).mul_(1e-2)
        adam_(p, g, b["exp_avg"], b["exp_avg_sq"], self.step, self.scratch[:n])


def check_adam() -> bool:
    """The update equals torch.optim.Adam's, bit for bit."""
    p = torch.randn(4099)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.Adam([ref], foreach=False)
    m, v, s = torch.zeros_like(p), torch.zeros_like(p), torch.empty_like(p)
    for step in (1, 2, 3):
        g = torch.sin(p) * 1e-2
        ref.grad = g.clone()
        opt.step()
        adam_(p, g, m, v, step, s)
    return bool(torch.equal(p.view(torch.int32), ref.detach().view(torch.int32)))


# -- helpers ---------------------------------------------------------------------------------
def drop(paths: list[str]) -> None:
    for p in paths:
        try:
            _drop_cache(p)
        except FileNotFoundError:
            pass        # a pack the swapper let go of after the listing: nothing to drop


def files_under(d: str) -> list[str]:
    out = []
    for root, _, names in os.walk(d):
        out += [os.path.join(root, n) for n in names if n.endswith(".bin") or n.endswith(".pt")]
    return sorted(out)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fingerprint(state: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int(t.view(torch.int32).sum(dtype=torch.int64)) for b in state for t in b.values()]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Highest resident set size seen while the block runs (sampled every 2 ms)."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        time.sleep(0.01)
        self.base = self.peak = rss()       # the sampler's own stack is not the stream's
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


# -- the synchronous baselines ---------------------------------------------------------------
class SyncStaging:
    """torch_memory_saver's algorithm: one page-locked staging buffer, buffered pwrite, fsync,
    pread back; one file per bucket."""

    def __init__(self, work: str, staging: int) -> None:
        self.work = work
        self.buf = pinned.empty(staging, torch.uint8, strict=False)
        self.mv = memoryview(self.buf.numpy())

    def path(self, i: int) -> str:
        return os.path.join(self.work, f"sync-{i}.bin")

    def write(self, i: int, b: dict[str, torch.Tensor]) -> None:
        fd = os.open(self.path(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            pos = 0
            for t in b.values():
                flat = t.reshape(-1).view(torch.uint8)
                for s in range(0, flat.numel(), self.buf.numel()):
                    k = min(self.buf.numel(), flat.numel() - s)
                    self.buf[:k].copy_(flat[s:s + k])
                    done = 0
                    while done < k:
                        done += os.pwrite(fd, self.mv[done:k], pos + done)
                    pos += k
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, i: int, b: dict[str, torch.Tensor]) -> None:
        fd = os.open(self.path(i), os.O_RDONLY)
        try:
            pos = 0
            for t in b.values():
                flat = t.reshape(-1).view(torch.uint8)
                for s in range(0, flat.numel(), self.buf.numel()):
                    k = min(self.buf.numel(), flat.numel() - s)
                    done = 0
                    while done < k:
                        n = os.preadv(fd, [self.mv[done:k]], pos + done)
                        if n == 0:
                            raise SystemExit(f"{self.path(i)}: short file")
                        done += n
                    flat[s:s + k].copy_(self.buf[:k])
                    pos += k
        finally:
            os.close(fd)


class TorchFiles:
    """torch.save + fsync / torch.load per bucket, copied into the state."""

    def __init__(self, work: str) -> None:
        self.work = work

    def path(self, i: int) -> str:
        return os.path.join(self.work, f"torch-{i}.pt")

    def write(self, i: int, b: dict[str, torch.Tensor]) -> None:
        with open(self.path(i), "wb") as f:
            torch.save(dict(b), f)
            f.flush()
            os.fsync(f.fileno())

    def read(self, i: int, b: dict[str, torch.Tensor]) -> None:
        got = torch.load(self.path(i), weights_only=True)
        for k, t in b.items():
            t.copy_(got[k])


# -- the run ---------------------------------------------------------------------------------
def make_state(numel: int, buckets: int) -> list[dict[str, torch.Tensor]]:
    """Page-locked fp32 params (random) and Adam moments (small random), per bucket."""
    per = math.ceil(numel / buckets)
    gen = torch.Generator().manual_seed(0)
    state = []
    for i in range(buckets):
        n = max(0, min(per, numel - i * per))
        b = {k: pinned.empty(n, torch.float32, strict=False) for k in KINDS}
        b["param"].copy_(torch.randn(n, generator=gen))
        b["exp_avg"].copy_(torch.randn(n, generator=gen)).mul_(1e-3)
        b["exp_avg_sq"].copy_(torch.rand(n, generator=gen)).mul_(1e-3)
        state.append(b)
    return state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=dir_arg, default=".",
                   help="directory on the disk to measure (default .)")
    p.add_argument("--numel", type=size_arg(1), default=1 << 20,
                   help="parameters, K/M/G = 2**10/20/30 (default 1M: 12 MiB of state; "
                        "128M: 1.5 GiB)")
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2,
                   help="optimizer steps per stream (default 2); figures are per step")
    p.add_argument("--staging", type=size_arg(4096), default=256 << 20,
                   help="staging buffer of the synchronous baseline (default 256M)")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the median is reported")
    p.add_argument("--block-size", type=size_arg(4096), default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    for flag in ("buckets", "prefetch", "steps", "repeat", "queue_depth"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if a.numel < a.buckets:
        p.error("--numel must be at least --buckets")

    def log(msg: str) -> None:
        if not a.json:
            print(msg, file=sys.stderr, flush=True)

    work = tempfile.mkdtemp(prefix="aioswap-bench-stream-", dir=a.dir)
    t: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        t.setdefault(key, []).append(v)

    try:
        adam_ok = check_adam()
        log("preparing the state...")
        state = make_state(a.numel, a.buckets)
        total = sum(x.numel() * x.element_size() for b in state for x in b.values())
        per = max(b["param"].numel() for b in state)
        update = Update(per)
        tags = [f"b{i}" for i in range(a.buckets)]
        whole = {f"{i}.{k}": x for i, b in enumerate(state) for k, x in b.items()}
        one = pinned.empty(total, torch.uint8, strict=False)
        sync = SyncStaging(work, a.staging)
        tf = TorchFiles(work)
        with AioHandle(block_size=a.block_size, queue_depth=a.queue_depth) as h, \
                TensorSwapper(os.path.join(work, "swap"), handle=h) as sw:
            for rnd in range(a.repeat):
                # -- offload + onload of the whole state --------------------------------
                ref = fingerprint(state)

                def zero() -> None:
                    for b in state:
                        for x in b.values():
                            x.zero_()

                add("aioswap_offload", timed(lambda: offload(sw, "all", whole)))
                drop(files_under(sw.directory))
                zero()
                add("aioswap_onload", timed(lambda: onload(sw, "all", into=whole)))
                assert fingerprint(state) == ref, "aioswap: different bytes came back"
                sw.remove_many(sw.names("all/"))

                for key, base in (("sync", sync), ("torch", tf)):
                    add(f"{key}_offload", timed(lambda: [base.write(i, b)
                                                         for i, b in enumerate(state)]))
                    drop([base.path(i) for i in range(a.buckets)])
                    zero()
                    add(f"{key}_onload", timed(lambda: [base.read(i, b)
                                                        for i, b in enumerate(state)]))
                    assert fingerprint(state) == ref, f"{key}: different bytes came back"

                direct = os.path.join(work, "direct.bin")
                add("direct_offload", timed(lambda: h.pwrite(one, direct, fsync=True)))
                drop([direct])
                add("direct_onload", timed(lambda: h.pread(one, direct)))
                os.unlink(direct)

                # -- one optimizer step over the buckets on NVMe ------------------------
                for tag, b in zip(tags, state):
                    offload(sw, tag, b)
                add("compute", timed(lambda: [update(b) for b in state]))
                update.step += 1

                def io_pass() -> None:
                    with aioswap.stream(sw, tags, prefetch=a.prefetch, steps=a.steps) as s:
                        for _ in s:
                            pass

                drop(files_under(work))
                with PeakRSS() as peak:
                    add("io", timed(io_pass) / a.steps)
                    drop(files_under(work))
                    s = aioswap.stream(sw, tags, prefetch=a.prefetch, steps=a.steps)
                    bound = s.memory_bytes
                    slots = s.slots
                    first = update.step

                    def streamed() -> None:
                        with s:
                            for bucket in s:
                                update.step = first + bucket.step
                                update(bucket)

                    add("streamed_step", timed(streamed) / a.steps)
                    del s
                update.step = first + a.steps
                add("rss_growth", float(peak.growth))

                drop(files_under(work))

                def sync_step(io: Any) -> None:
                    for i, b in enumerate(state):
                        io.read(i, b)
                        update(b)
                        io.write(i, b)

                add("sync_step", timed(lambda: sync_step(sync)))
                update.step += 1
                drop(files_under(work))
                add("torch_step", timed(lambda: sync_step(tf)))
                update.step += 1
                sw.clear()
                log(f"round {rnd + 1}/{a.repeat}: streamed step "
                    f"{t['streamed_step'][-1]:.3f} s, compute {t['compute'][-1]:.3f} s, "
                    f"I/O {t['io'][-1]:.3f} s, sync staging {t['sync_step'][-1]:.3f} s")
            sw.destroy()
    finally:
        shutil.rmtree(work, ignore_errors=True)     # the temporary directory made above

    med = {k: statistics.median(v) for k, v in t.items()}
    med["rss_growth"] = max(t["rss_growth"])    # memory: the worst round
    oo = {m: med[f"{m}_offload"] + med[f"{m}_onload"]
          for m in ("aioswap", "sync", "torch", "direct")}
    res: dict[str, Any] = {
        "bytes": total, "numel": a.numel, "buckets": a.buckets, "prefetch": a.prefetch,
        "steps": a.steps,
        "slots": slots, "staging_bytes": a.staging, "repeat": a.repeat,
        "block_size": a.block_size, "queue_depth": a.queue_depth,
        "adam_matches_torch": adam_ok, "seconds": med,
        "gbps": {f"{m}_{d}": total / med[f"{m}_{d}"] / GB
                 for m in ("aioswap", "sync", "torch", "direct") for d in ("offload", "onload")},
        "memory_bound_bytes": bound, "rss_growth_bytes": med["rss_growth"],
        "ratios": {
            "offload_onload_vs_sync_staging": ratio(oo["sync"], oo["aioswap"]),
            "offload_onload_vs_torch": ratio(oo["torch"], oo["aioswap"]),
            "offload_onload_vs_direct": ratio(oo["direct"], oo["aioswap"]),
            "streamed_step_vs_max_compute_io":
                med["streamed_step"] / max(med["compute"], med["io"]),
            "streamed_step_vs_sync_staging": ratio(med["sync_step"], med["streamed_step"]),
            "streamed_step_vs_torch": ratio(med["torch_step"], med["streamed_step"]),
            "rss_growth_vs_bound": max(med["rss_growth"], 1.0) / bound if bound else math.nan,
        },
    }
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    r = res["ratios"]
    g = res["gbps"]
    title = (f"{format_size(total)} ({total / GB:.2f} GB) of fp32 params + Adam state in "
             f"{a.buckets} buckets; median of {a.repeat} round(s); page cache dropped before "
             f"reads; {UNITS_NOTE}")
    print_table(["offload + onload of the whole state", "offload GB/s", "onload GB/s",
                 "seconds", "ratio"],
                [["aioswap offload/onload", g["aioswap_offload"], g["aioswap_onload"],
                  oo["aioswap"], 1.0],
                 [f"sync {format_size(a.staging)} staging, pwrite+fsync/pread",
                  g["sync_offload"], g["sync_onload"], oo["sync"],
                  r["offload_onload_vs_sync_staging"]],
                 ["torch.save/torch.load per bucket", g["torch_offload"], g["torch_onload"],
                  oo["torch"], r["offload_onload_vs_torch"]],
                 ["direct: 1 transfer, locked (reference)", g["direct_offload"],
                  g["direct_onload"], oo["direct"], r["offload_onload_vs_direct"]]],
                title=[title])
    print()
    print_table([f"one Adam step over the buckets ({a.steps} per stream)", "seconds", "ratio"],
                [["aioswap.stream (read ahead, write back)", med["streamed_step"], 1.0],
                 ["  compute alone (in memory)", med["compute"], math.nan],
                 ["  I/O alone (stream, no update)", med["io"], math.nan],
                 ["sync staging: read, update, write", med["sync_step"],
                  r["streamed_step_vs_sync_staging"]],
                 ["torch.load, update, torch.save", med["torch_step"],
                  r["streamed_step_vs_torch"]]],
                notes=[f"streamed step / max(compute, I/O) = "
                       f"{r['streamed_step_vs_max_compute_io']:.2f} (aim: <= 1.15)",
                       f"resident memory growth during the streamed step: "
                       f"{format_size(int(med['rss_growth']))}, stated bound "
                       f"{format_size(bound)} ({slots} buckets): "
                       f"{r['rss_growth_vs_bound']:.2f} of it (aim: <= 1)",
                       f"update == torch.optim.Adam(foreach=False) bit for bit: {adam_ok}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
