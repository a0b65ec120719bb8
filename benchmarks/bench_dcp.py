#!/usr/bin/env python3
"""torch.distributed.checkpoint: aioswap's AioWriter/AioReader against FileSystemWriter/Reader.

The state dict is GPT-like: ``--layers`` blocks of hidden size ``--hidden``, each with
q/k/v/o projections, fc1/fc2 (4 x hidden) and their biases, and two layer norms (weight and
bias): 16 tensors, each present three times (the parameter and Adam's m and v), float32.
``--layers 12 --hidden 1024`` is the 576-tensor, 1.73 GiB dict; the default is a tiny one for
the smoke test. With R ranks (``--ranks 1,2``: one gloo process group of R processes on this
machine each) the tensors are dealt round-robin to the ranks, as a sharded optimizer state is,
so every rank count moves the same bytes.

Each round runs, in turn, for every method:

* **aioswap**: ``dcp.save(sd, storage_writer=AioWriter(d))`` and
  ``dcp.load(sd, storage_reader=AioReader(d))``;
* **stock**: ``FileSystemWriter(d)`` / ``FileSystemReader(d)`` with default knobs;
* **stock, N threads**: ``FileSystemWriter(d, thread_count=N)`` (N = the cores) / the reader.

All writers fsync (``sync_files=True``, the default). Loads go into preallocated plain CPU
tensors (as ``dcp.load`` into a model's state dict does) and are checked byte for byte once.
Before every load the page cache of every checkpoint file is dropped
(``posix_fadvise(DONTNEED)``, or also ``/proc/sys/vm/drop_caches`` with ``--drop-caches
sysctl``, as root). Times run from a barrier before the call to a barrier after it on every
rank. The table gives the median of ``--repeat`` rounds with the spread (min-max), GB/s = 10^9
B/s of state dict bytes, and ratios aioswap/other (bigger is better).

    python benchmarks/bench_dcp.py --dir /nvme --layers 12 --hidden 1024 --ranks 1,2 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from _common import drop_cache as _drop_cache
from _common import dir_arg, format_size, gpt_shapes, gpt_state_dict

METHODS = ("aioswap", "stock", "stock, N threads")


def shapes_of(layers: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return gpt_shapes(layers, hidden)


def state_dict(layers: int, hidden: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's share (round-robin) of the GPT-like dict; random bytes."""
    return gpt_state_dict(layers, hidden, rank, world)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def drop_dir(path: str, how: str) -> None:
    """Make sure the next reads of every file under ``path`` come from the disk."""
    for name in os.listdir(path):
        _drop_cache(os.path.join(path, name))
    if how == "sysctl":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def worker(a: argparse.Namespace) -> int:
    """One rank: every round, every method: save, drop the cache, load; rank 0 reports."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from aioswap.dcp import AioReader, AioWriter

    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + a.store, rank=rank,
                            world_size=world)
    cores = os.cpu_count() or 1
    sd = state_dict(a.layers, a.hidden, rank, world)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}

    def writer(method: str, d: str) -> Any:
        if method == "aioswap":
            return AioWriter(d)
        return FileSystemWriter(d, thread_count=cores if method != "stock" else 1)

    def reader(method: str, d: str) -> Any:
        return AioReader(d) if method == "aioswap" else FileSystemReader(d)

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in METHODS}
    checked: set[str] = set()
    for r in range(a.repeat):
        for i, method in enumerate(METHODS):
            d = os.path.join(a.work, f"ckpt-{world}-{r}-{i}")
            times[method]["save"].append(timed(
                lambda: dcp.save(sd, storage_writer=writer(method, d))))
            if rank == 0:
                drop_dir(d, a.drop_caches)
            for t in out.values():
                t.zero_()
            times[method]["load"].append(timed(
                lambda: dcp.load(out, storage_reader=reader(method, d))))
            if method not in checked:
                if not same(sd, out):
                    raise SystemExit(f"rank {rank}: {method} loaded different bytes")
                checked.add(method)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d)
    if rank == 0:
        print(json.dumps({"world": world, "times": times}), flush=True)
    dist.destroy_process_group()
    return 0


def run_ranks(a: argparse.Namespace, world: int, work: str) -> dict[str, Any]:
    store = os.path.join(work, f"store-{world}")
    args = [sys.executable, os.path.abspath(__file__), "--worker", "--store", store,
            "--work", work, "--layers", str(a.layers), "--hidden", str(a.hidden),
            "--repeat", str(a.repeat), "--drop-caches", a.drop_caches]
    procs = [subprocess.Popen(args, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world)),
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise SystemExit(f"rank {r} of {world} failed with exit status {p.returncode}")
    result: dict[str, Any] = json.loads(outs[0].strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=dir_arg, default=".", help="directory on the disk to measure")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--ranks", default="1,2", help="rank counts to run (default 1,2)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3); median shown")
    p.add_argument("--drop-caches", choices=["fadvise", "sysctl"], default="fadvise",
                   help="fadvise: posix_fadvise(DONTNEED) on every file; sysctl: also "
                        "echo 1 > /proc/sys/vm/drop_caches (root)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.layers < 1 or a.hidden < 1 or a.repeat < 1:
        p.error("--layers, --hidden and --repeat must be >= 1")
    if a.worker:
        return worker(a)
    try:
        ranks = [int(x) for x in a.ranks.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ranks takes comma-separated integers, got {a.ranks!r}")
    if not ranks or min(ranks) < 1:
        p.error(f"--ranks takes rank counts >= 1, got {a.ranks!r}")

    total = sum(torch.Size(s).numel() * 4 for s in shapes_of(a.layers, a.hidden).values())
    count = len(shapes_of(a.layers, a.hidden))
    work = tempfile.mkdtemp(prefix="aioswap-bench-dcp-", dir=a.dir)
    results = []
    try:
        for world in ranks:
            print(f"running {world} rank(s)...", file=sys.stderr, flush=True)
            results.append(run_ranks(a, world, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for res in results:
        for method in METHODS:
            row: dict[str, Any] = {"method": method, "ranks": res["world"]}
            for op in ("save", "load"):
                ts = res["times"][method][op]
                row[op] = {"median_gbps": total / statistics.median(ts) / 1e9,
                           "min_gbps": total / max(ts) / 1e9,
                           "max_gbps": total / min(ts) / 1e9}
            rows.append(row)
    for row in rows:
        ours = next(r for r in rows if r["ranks"] == row["ranks"] and r["method"] == "aioswap")
        for op in ("save", "load"):
            row[op]["ratio"] = ours[op]["median_gbps"] / row[op]["median_gbps"]
    if a.json:
        print(json.dumps({"bytes": total, "tensors": count, "cores": os.cpu_count(),
                          "rows": rows}, indent=2))
        return 0
    cores = os.cpu_count()
    print(f"torch.distributed.checkpoint save/load of a {count}-tensor state dict, "
          f"{format_size(total)} ({total} bytes), dealt over the ranks; dir {a.dir}")
    print(f"GB/s = 10^9 bytes per second, median of {a.repeat} round(s) (min-max); ratio = "
          f"aioswap/other, bigger is better; 'N threads' = thread_count={cores} (the cores); "
          f"page cache dropped before loads ({a.drop_caches}); saves fsync")
    head = f"{'method':<18}{'ranks':>6}  {'save GB/s':>22}  {'load GB/s':>22}  " \
           f"{'save ratio':>10}  {'load ratio':>10}"
    print(head)
    print("-" * len(head))
    for row in rows:
        cells = []
        for op in ("save", "load"):
            f = row[op]
            cells.append(f"{f['median_gbps']:.2f} ({f['min_gbps']:.2f}-{f['max_gbps']:.2f})")
        print(f"{row['method']:<18}{row['ranks']:>6}  {cells[0]:>22}  {cells[1]:>22}  "
              f"{row['save']['ratio']:>10.2f}  {row['load']['ratio']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
