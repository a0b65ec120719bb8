"""Many small requests: aioswap against fio (libaio, io_uring) and os.preadv/os.pwritev.

Random O_DIRECT reads and writes of 4 KiB, 64 KiB and 256 KiB on one file into page-locked
memory, measured side by side (methods run in a new, seeded random order each round; the
median of the rounds is shown with its spread):

* ``sync file``: ``f.pread(view, off)`` one request at a time on ``h.open(path)``
* ``sync fd``: ``h.pread(view, fd, off)`` one at a time on an O_DIRECT fd
* ``os``: ``os.preadv``/``os.pwritev`` on the same O_DIRECT fd
* ``fio qd1``: fio's libaio engine, iodepth 1
* ``async x32``: 32 ``f.pread(..., async_op=True)`` in flight, then ``h.wait()``
* ``async fd x32`` / ``async path x32``: the same through an fd / a path argument
* ``window x32``: a sliding window of futures (wait for the oldest, submit the next)
* ``batch x32``: ``h.pread_many`` of 32 requests (no futures)
* ``fio qd32``: fio libaio, iodepth 32

Then the engine backends side by side (``--backends``, default every one that works here):
32 async requests through an open file on a handle of each backend, against fio's libaio
and io_uring engines (``fixedbufs``, ``registerfiles``, no sqpoll) at iodepth 32, with CPU
microseconds per I/O of each (aioswap: ``resource.getrusage``; fio: its usr+sys CPU).

Then large transfers (``--large``, bs 1 MiB, qd 32): direct (pinned) and bounce (unpinned,
misaligned tensor) against fio, with CPU seconds per GiB of each (``resource.getrusage``).

``--cpu-dir DIR`` (e.g. ``/dev/shm``, RAM that takes ``O_DIRECT`` here) prints the CPU
microseconds per 4 KiB read (``resource.getrusage`` of this process, every thread) of
``os.preadv``, sync through a file and an fd, 32 async through a file, and ``pread_many``
of 32: what a request costs with the drive out of the picture.

``--buffered SIZE`` adds cold-cache buffered random reads (a file of SIZE, page cache
dropped before each measurement: fsync + ``POSIX_FADV_DONTNEED``),
64 KiB and 1 MiB, 32 in flight: every backend with ``AIOSWAP_BUFFERED=1`` against fio
io_uring and libaio with ``--direct=0``. Each backend runs two patterns there: bursts of 32
and ``h.wait()`` (as in the O_DIRECT rows), and a sliding window (``window``: wait for the
oldest future, submit the next), which keeps 32 in flight as fio does. Cold buffered reads
vary in latency (a page-cache miss, readahead, io-wq), and a burst waits for its slowest.

Units: IOPS and GB/s (10^9 B/s); ratios are aioswap / other (bigger is better).
Tiny defaults make a smoke test; ``--file-size 256M --ops 20000 --large 1G`` are real sizes.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import aioswap
from _common import cpu_s, dir_arg
from aioswap import pinned
from aioswap.tune import drop_cache   # fsync + POSIX_FADV_DONTNEED, as every bench

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t and t[-1] in UNITS:
        return int(float(t[:-1]) * UNITS[t[-1]])
    return int(t)


def human(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def fio(path: str, rw: str, bs: int, qd: int, nbytes: int, file_size: int,
        engine: str = "libaio", direct: bool = True, cpu: list[float] | None = None
        ) -> float | None:
    """IOPS of one fio job (``engine``: libaio, or io_uring with fixed buffers and files),
    or None when fio is missing; ``cpu`` gets fio's CPU microseconds per I/O appended."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    cmd = [exe, "--name=b", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={qd}", f"--ioengine={engine}", f"--direct={int(direct)}",
           f"--size={file_size}", f"--io_size={nbytes}", "--norandommap", "--randrepeat=0",
           "--output-format=json", "--group_reporting"]
    if engine == "io_uring":
        cmd += ["--fixedbufs=1", "--registerfiles=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read" if "read" in rw else "write"]
    if cpu is not None and side["total_ios"]:
        busy = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3   # s
        cpu.append(busy / side["total_ios"] * 1e6)
    return float(side["iops"])


def run_backends(path: str, backends: list[str], sizes: list[int], ops: int, qd: int,
                 file_size: int, ops_list: tuple[str, ...], rounds: int, buffered: bool
                 ) -> list[dict[str, object]]:
    """32 async requests through an open file on each backend, and fio's engines: IOPS and
    CPU microseconds per I/O, medians of ``rounds`` (methods in a new order each round)."""
    rows: list[dict[str, object]] = []
    handles = {}
    old = os.environ.get("AIOSWAP_BUFFERED")
    if buffered:
        os.environ["AIOSWAP_BUFFERED"] = "1"
    try:
        for b in backends:
            handles[b] = aioswap.AioHandle(block_size=1 << 20, queue_depth=qd, backend=b)
    finally:
        if buffered:
            if old is None:
                del os.environ["AIOSWAP_BUFFERED"]
            else:
                os.environ["AIOSWAP_BUFFERED"] = old
    try:
        for op in ops_list:
            write = op == "write"
            rw = "randwrite" if write else "randread"
            for bs in sizes:
                buf = pinned.empty(qd * bs, torch.uint8, strict=False)
                buf.fill_(0x5A)
                views = [buf[i * bs:(i + 1) * bs] for i in range(qd)]
                iops: dict[str, list[float]] = {}
                cpu: dict[str, list[float]] = {}
                names = [f"aioswap {b}" for b in backends] + ["fio libaio", "fio io_uring"]
                if buffered:
                    names += [f"aioswap {b} window" for b in backends]
                files = {b: h.open(path, "r+") for b, h in handles.items()}
                try:
                    for r in range(rounds):
                        order = list(names)
                        random.Random(104729 * r + bs).shuffle(order)
                        for k, name in enumerate(order):
                            offs = offsets(ops, bs, file_size, 7000 * r + 31 * k + bs)
                            if buffered:
                                drop_cache(path)
                            if name.startswith("fio "):
                                c: list[float] = []
                                v = fio(path, rw, bs, qd, ops * bs, file_size, name[4:],
                                        not buffered, c)
                                if v is not None:
                                    iops.setdefault(name, []).append(v)
                                    cpu.setdefault(name, []).extend(c)
                                continue
                            b = name.split()[1]
                            h, f = handles[b], files[b]
                            call = f.pwrite if write else f.pread
                            c0, t0 = cpu_s(), time.perf_counter()
                            if name.endswith(" window"):
                                window: list[concurrent.futures.Future[int]] = []
                                for i, off in enumerate(offs):
                                    if len(window) == qd:
                                        window.pop(0).result()
                                    wf = call(views[i % qd], off, async_op=True)
                                    assert isinstance(wf, concurrent.futures.Future)
                                    window.append(wf)
                                for wf in window:
                                    wf.result()
                            else:
                                for start in range(0, len(offs), qd):
                                    for i, off in enumerate(offs[start:start + qd]):
                                        call(views[i], off, async_op=True)
                                    h.wait()
                            dt, dc = time.perf_counter() - t0, cpu_s() - c0
                            iops.setdefault(name, []).append(ops / dt)
                            cpu.setdefault(name, []).append(dc / ops * 1e6)
                finally:
                    for f in files.values():
                        f.close()
                med = {k: statistics.median(v) for k, v in iops.items()}
                cmed = {k: statistics.median(v) for k, v in cpu.items()}
                best_fio = max((med[k] for k in ("fio libaio", "fio io_uring") if k in med),
                               default=None)
                ratios: dict[str, float] = {}
                for b in backends:
                    k = f"aioswap {b}"
                    if best_fio:
                        ratios[f"{k} / best fio"] = med[k] / best_fio
                    if b != "aio" and "aioswap aio" in cmed and cmed["aioswap aio"]:
                        ratios[f"cpu {k} / cpu aioswap aio"] = cmed[k] / cmed["aioswap aio"]
                    if buffered and b != "aio" and "aioswap aio" in med:
                        ratios[f"{k} / aioswap aio"] = med[k] / med["aioswap aio"]
                if buffered and "fio io_uring" in med:
                    for b in backends:
                        for who in (f"aioswap {b}", f"aioswap {b} window"):
                            ratios[f"{who} / fio io_uring"] = med[who] / med["fio io_uring"]
                        if b != "aio" and "aioswap aio window" in med:
                            ratios[f"aioswap {b} window / aioswap aio window"] = (
                                med[f"aioswap {b} window"] / med["aioswap aio window"])
                rows.append({"op": op, "size": bs, "buffered": buffered, "iops": med,
                             "cpu_us_per_io": cmed, "ratios": ratios})
                del buf, views
    finally:
        for h in handles.values():
            h.close()
    return rows


def print_backends(rows: list[dict[str, object]]) -> None:
    for row in rows:
        kind = "buffered, cold cache" if row["buffered"] else "O_DIRECT"
        print(f"\n{row['op']} {human(int(row['size']))} ({kind}), 32 in flight")  # type: ignore
        iops, cpu = row["iops"], row["cpu_us_per_io"]
        for k in iops:                                      # type: ignore[attr-defined]
            unit = (f"{iops[k] * int(row['size']) / 1e9:7.2f} GB/s"   # type: ignore[index]
                    if row["buffered"] or int(row["size"]) >= 1 << 20    # type: ignore
                    else f"{iops[k]:9.0f} IOPS")                          # type: ignore
            print(f"  {k:<25}{unit:>16}  {cpu.get(k, float('nan')):7.1f} us CPU/IO")  # type: ignore
        for k, v in row["ratios"].items():                  # type: ignore[attr-defined]
            print(f"    {k:<44}{v:6.2f}x")


def offsets(n: int, bs: int, file_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    slots = file_size // bs
    return [rng.randrange(slots) * bs for _ in range(n)]


def run_small(h: aioswap.AioHandle, path: str, fd: int, bs: int, ops: int, qd: int,
              file_size: int, write: bool, rounds: int) -> dict[str, list[float]]:
    buf = pinned.empty(qd * bs, torch.uint8, strict=False)
    buf.copy_(torch.randint(0, 256, (qd * bs,), dtype=torch.uint8))
    views = [buf[i * bs:(i + 1) * bs] for i in range(qd)]
    mv = memoryview(buf.numpy())
    mvs = [mv[i * bs:(i + 1) * bs] for i in range(qd)]
    res: dict[str, list[float]] = {k: [] for k in
                                   METHODS}
    f = h.open(path, "r+")
    call = f.pwrite if write else f.pread
    hcall = h.pwrite if write else h.pread
    many = h.pwrite_many if write else h.pread_many
    rw = "randwrite" if write else "randread"

    def sync_file(offs: list[int]) -> None:
        for i, off in enumerate(offs):
            call(views[i % qd], off)

    def sync_fd(offs: list[int]) -> None:
        for i, off in enumerate(offs):
            hcall(views[i % qd], fd, off)

    def plain(offs: list[int]) -> None:
        if write:
            for i, off in enumerate(offs):
                os.pwritev(fd, [mvs[i % qd]], off)
        else:
            for i, off in enumerate(offs):
                os.preadv(fd, [mvs[i % qd]], off)

    def async32(offs: list[int]) -> None:
        for start in range(0, len(offs), qd):
            for i, off in enumerate(offs[start:start + qd]):
                call(views[i], off, async_op=True)
            h.wait()

    def async32_on(route: int | str) -> object:
        def run(offs: list[int]) -> None:
            for start in range(0, len(offs), qd):
                for i, off in enumerate(offs[start:start + qd]):
                    hcall(views[i], route, off, async_op=True)
                h.wait()
        return run

    def window32(offs: list[int]) -> None:
        futs: list[object] = []
        for i, off in enumerate(offs):
            if len(futs) == qd:
                futs.pop(0).result()                    # type: ignore[attr-defined]
            futs.append(call(views[i % qd], off, async_op=True))
        for fu in futs:
            fu.result()                                 # type: ignore[attr-defined]

    def batch32(offs: list[int]) -> None:
        for start in range(0, len(offs), qd):
            many([(views[i], f, off) for i, off in enumerate(offs[start:start + qd])])

    methods = {"sync file": sync_file, "sync fd": sync_fd, "os": plain, "async x32": async32,
               "async fd x32": async32_on(fd), "async path x32": async32_on(path),
               "window x32": window32, "batch x32": batch32, "fio qd1": None, "fio qd32": None}
    names = list(methods)
    try:
        for r in range(rounds):
            # each method its own offsets (a virtual disk caches what it just served, which
            # would favour whichever method ran second on the same ones), and a new order
            # each round: a rotated one keeps every method behind the same neighbour, and a
            # virtual disk's write-back state after one method shifts the next one's figure
            order = list(names)
            random.Random(7919 * r + 1).shuffle(order)
            for k, name in enumerate(order):
                offs = offsets(ops, bs, file_size, 1000 * r + k)
                fn = methods[name]
                if fn is None:
                    v = fio(path, rw, bs, 1 if name == "fio qd1" else qd, ops * bs, file_size)
                    if v is not None:
                        res[name].append(v)
                    continue
                t0 = time.perf_counter()
                fn(offs)
                res[name].append(ops / (time.perf_counter() - t0))
    finally:
        f.close()
    return res


METHODS = ("sync file", "sync fd", "os", "fio qd1", "async x32", "async fd x32",
           "async path x32", "window x32", "batch x32", "fio qd32")
# what each method is compared with
VERSUS = {"sync file": "os", "sync fd": "os", "async x32": "fio qd32",
          "async fd x32": "fio qd32", "async path x32": "fio qd32", "window x32": "async x32",
          "batch x32": "fio qd32"}


def fmt(vals: list[float]) -> str:
    if not vals:
        return "-"
    m = statistics.median(vals)
    spread = (max(vals) - min(vals)) / m * 100 if m else 0.0
    return f"{m:,.0f} ±{spread / 2:.0f}%"


def ratio(a: list[float], b: list[float]) -> str:
    if not a or not b:
        return "-"
    return f"{statistics.median(a) / statistics.median(b):.2f}x"


CPU_METHODS = ("os.preadv", "sync file", "sync fd", "async x32", "batch x32")


def run_cpu(h: aioswap.AioHandle, d: str, ops: int, qd: int,
            rounds: int) -> dict[str, float]:
    """CPU microseconds per 4 KiB read on a file in ``d`` (best of ``rounds``)."""
    bs, fsize = 4096, 64 << 20
    fdp, path = tempfile.mkstemp(prefix="aioswap-bench-cpu-", dir=d)
    try:
        os.write(fdp, os.urandom(fsize))
        os.close(fdp)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)     # raises where d refuses O_DIRECT
        f = h.open(path, "r")
        buf = pinned.empty(qd * bs, torch.uint8, strict=False)
        views = [buf[i * bs:(i + 1) * bs] for i in range(qd)]
        mv = memoryview(buf.numpy())[:bs]
        offs = offsets(ops, bs, fsize, 5)

        def preadv() -> None:
            for off in offs:
                os.preadv(fd, [mv], off)

        def sync_file() -> None:
            for off in offs:
                f.pread(views[0], off)

        def sync_fd() -> None:
            for off in offs:
                h.pread(views[0], fd, off)

        def async32() -> None:
            for start in range(0, len(offs), qd):
                for i, off in enumerate(offs[start:start + qd]):
                    f.pread(views[i], off, async_op=True)
                h.wait()

        def batch32() -> None:
            for start in range(0, len(offs), qd):
                h.pread_many([(views[i], f, off) for i, off in
                              enumerate(offs[start:start + qd])])

        fns = dict(zip(CPU_METHODS, (preadv, sync_file, sync_fd, async32, batch32)))
        best: dict[str, float] = {}
        for _ in range(rounds):
            for name, fn in fns.items():
                c0 = cpu_s()
                fn()
                us = (cpu_s() - c0) / ops * 1e6
                best[name] = min(best.get(name, us), us)
        f.close()
        os.close(fd)
        return best
    finally:
        os.unlink(path)


def run_large(h: aioswap.AioHandle, d: str, nbytes: int, rounds: int) -> None:
    path = os.path.join(d, "aioswap-bench-large.bin")
    pinned_t = pinned.empty(nbytes, torch.uint8, strict=False)
    pinned_t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    base = torch.empty(nbytes + 64, dtype=torch.uint8)
    unpinned = base[3:3 + nbytes]                      # misaligned, not page-locked
    unpinned.copy_(pinned_t)
    res: dict[str, list[tuple[float, float]]] = {}
    try:
        h.pwrite(pinned_t, path, fsync=True)
        for _ in range(rounds):
            for name, t in (("direct", pinned_t), ("bounce", unpinned)):
                for op in ("write", "read"):
                    c0, t0 = cpu_s(), time.perf_counter()
                    if op == "write":
                        h.pwrite(t, path, fsync=True)
                    else:
                        h.pread(t, path)
                    dt, dc = time.perf_counter() - t0, cpu_s() - c0
                    res.setdefault(f"{name} {op}", []).append((nbytes / dt / 1e9,
                                                               dc / (nbytes / (1 << 30))))
            for op, rw in (("write", "write"), ("read", "read")):
                v = fio(path, rw, 1 << 20, 32, nbytes, nbytes)
                if v is not None:
                    res.setdefault(f"fio {op}", []).append((v * (1 << 20) / 1e9, 0.0))
    finally:
        os.unlink(path)
    print(f"\nLarge transfers: {human(nbytes)} at bs 1M qd 32 (GB/s = 10^9 B/s, median; "
          f"ratio = aioswap / other, bigger is better; CPU = seconds of CPU per GiB)")
    print(f"{'path':<14}{'op':<7}{'GB/s':>8}{'CPU s/GiB':>11}{'vs fio':>9}{'vs direct':>11}")

    def med(key: str, i: int) -> float | None:
        v = res.get(key)
        return statistics.median(x[i] for x in v) if v else None

    for op in ("write", "read"):
        f = med(f"fio {op}", 0)
        d_ = med(f"direct {op}", 0)
        for name in ("direct", "bounce", "fio"):
            g = med(f"{name} {op}", 0)
            if g is None:
                continue
            c = med(f"{name} {op}", 1) if name != "fio" else None
            vs_fio = f"{g / f:.2f}x" if f and name != "fio" else "-"
            vs_d = f"{g / d_:.2f}x" if d_ and name == "bounce" else "-"
            print(f"{name:<14}{op:<7}{g:>8.2f}{(f'{c:.3f}' if c is not None else '-'):>11}"
                  f"{vs_fio:>9}{vs_d:>11}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=dir_arg, default=".",
                    help="directory on the drive to test (default .)")
    ap.add_argument("--file-size", type=size, default=size("16M"),
                    help="size of the test file (default 16M; real: 256M)")
    ap.add_argument("--sizes", default="4K,64K,256K", help="request sizes (default 4K,64K,256K)")
    ap.add_argument("--ops", type=int, default=256, help="requests per measurement (default 256)")
    ap.add_argument("--qd", type=int, default=32, help="requests in flight for async (default 32)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds, methods alternating")
    ap.add_argument("--large", type=size, default=size("32M"),
                    help="size of the large-transfer test (default 32M; real: 1G; 0 skips)")
    ap.add_argument("--no-write", action="store_true", help="reads only")
    ap.add_argument("--backends", default=None,
                    help="engine backends to compare (default: every one that works here; "
                         "'none' skips the comparison)")
    ap.add_argument("--backend-sizes", default="4K,64K,1M",
                    help="request sizes of the backend comparison (default 4K,64K,1M)")
    ap.add_argument("--buffered", type=size, default=0,
                    help="also cold-cache buffered random reads on a file of this size "
                         "(real: 1G; default 0: skipped)")
    ap.add_argument("--cpu-dir", type=dir_arg, default=None,
                    help="also CPU per 4 KiB read on a RAM-backed file in this directory "
                         "(e.g. /dev/shm; it must take O_DIRECT)")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (median IOPS and ratios) instead of tables")
    a = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed: its columns are skipped", file=sys.stderr)
    fd_path = tempfile.mkstemp(prefix="aioswap-bench-small-", dir=a.dir)
    os.close(fd_path[0])
    path = fd_path[1]
    try:
        with aioswap.AioHandle(block_size=1 << 20, queue_depth=a.qd) as h:
            fill = pinned.empty(min(a.file_size, 64 << 20), torch.uint8, strict=False)
            fill.copy_(torch.randint(0, 256, (fill.numel(),), dtype=torch.uint8))
            for off in range(0, a.file_size, fill.numel()):
                h.pwrite(fill[:min(fill.numel(), a.file_size - off)], path, off)
            del fill
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            try:
                backend = getattr(h, "backend", "aio")      # (older versions: kernel AIO)
                if not a.json:
                    print(f"Random O_DIRECT requests on a {human(a.file_size)} file in {a.dir}"
                          f", {a.ops} per measurement, {a.repeat} round(s), backend "
                          f"{backend}. IOPS: median ±half the spread; ratio = aioswap / "
                          f"the method named (bigger is better)")
                out: dict[str, object] = {"file_size": a.file_size, "ops": a.ops,
                                          "rounds": a.repeat, "backend": backend,
                                          "results": []}
                for op in ("read",) if a.no_write else ("read", "write"):
                    for bs in (size(s) for s in a.sizes.split(",")):
                        r = run_small(h, path, fd, bs, a.ops, a.qd, a.file_size,
                                      op == "write", a.repeat)
                        row = {"op": op, "size": bs,
                               "iops": {k: statistics.median(v) for k, v in r.items() if v},
                               "ratios": {f"{k} / {v}": statistics.median(r[k])
                                          / statistics.median(r[v])
                                          for k, v in VERSUS.items() if r[k] and r[v]}}
                        out["results"].append(row)      # type: ignore[attr-defined]
                        if a.json:
                            continue
                        print(f"\n{op} {human(bs)}")
                        for k in METHODS:
                            vs = VERSUS.get(k)
                            rel = f"{ratio(r[k], r[vs]):>7} vs {vs}" if vs else ""
                            print(f"  {k:<16}{fmt(r[k]):>18}  {rel}", flush=True)
                if a.backends is None:
                    backends = [b for b in ("io_uring", "aio", "threads")
                                if aioswap.aio_available(b)[0]]
                elif a.backends == "none":
                    backends = []
                else:
                    backends = a.backends.split(",")
                if backends:
                    rows = run_backends(path, backends, [size(x) for x in
                                                         a.backend_sizes.split(",")],
                                        a.ops, a.qd, a.file_size,
                                        ("read",) if a.no_write else ("read", "write"),
                                        a.repeat, False)
                    out["backends"] = rows
                    if not a.json:
                        print("\nBackends (CPU per I/O: aioswap from getrusage of this "
                              "process, fio from its usr+sys)")
                        print_backends(rows)
                if a.buffered and backends:
                    bpath = path + ".buffered"
                    try:
                        with aioswap.AioHandle(block_size=1 << 20) as hb:
                            fill = pinned.empty(64 << 20, torch.uint8, strict=False)
                            fill.fill_(0x33)
                            for off in range(0, a.buffered, fill.numel()):
                                hb.pwrite(fill[:min(fill.numel(), a.buffered - off)], bpath,
                                          off)
                            del fill
                        rows = run_backends(bpath, backends, [64 << 10, 1 << 20],
                                            max(a.ops // 4, 32), a.qd, a.buffered,
                                            ("read",), a.repeat, True)
                    finally:
                        os.unlink(bpath)
                    out["buffered"] = rows
                    if not a.json:
                        print_backends(rows)
                if a.cpu_dir:
                    cpu = run_cpu(h, a.cpu_dir, max(a.ops, 2000), a.qd, max(a.repeat, 3))
                    out["cpu_us_per_request"] = cpu
                    if not a.json:
                        print(f"\nCPU per 4 KiB read on a file in {a.cpu_dir} (us, all "
                              f"threads, best of {max(a.repeat, 3)})")
                        for k, v in cpu.items():
                            print(f"  {k:<16}{v:8.2f}")
                if a.json:
                    print(json.dumps(out))
            finally:
                os.close(fd)
            if a.large and not a.json:
                run_large(h, a.dir, a.large, a.repeat)
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
