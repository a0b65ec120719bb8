"""What every script in ``benchmarks/`` shares: arguments, scratch files, the page cache, timing,
fio, and tables in one unit convention.

Import it as ``from _common import ...`` (scripts run as ``python benchmarks/bench_x.py`` have
this directory on ``sys.path``). It uses aioswap's public API only.

Units everywhere: GB/s = 10^9 bytes per second; a ratio is aioswap / other, so above 1 means
aioswap is faster (:data:`UNITS_NOTE`, printed under every table by :func:`print_table`).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import math
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

from aioswap.cli import GB, UNITS_NOTE, format_size, parse_size, short_size
from aioswap.tune import drop_cache as _drop_cache

__all__ = [
    "CACHE_NOTE", "GB", "UNITS_NOTE", "Summary", "add_common_args", "check_common_args",
    "dir_arg",
    "drop_cache", "fio_path", "format_size", "freed",
    "orders", "print_table", "ratio", "resident_fraction", "run_fio", "scratch_file",
    "short_size", "size_arg", "summarize", "timed",
]


# -- arguments ---------------------------------------------------------------------------------
def size_arg(minimum: int = 1) -> Callable[[str], int]:
    """An argparse ``type=`` for sizes (``4K``, ``1M``, ``1.5G``; powers of 1024)."""
    def parse(text: str) -> int:
        try:
            return parse_size(text, minimum=minimum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = "size"
    return parse


def dir_arg(text: str) -> str:
    """An argparse ``type=`` for ``--dir``: an existing, writable directory, made absolute.

    Anything else is a one-line usage error (exit status 2) before any work, where the
    scripts used to fail with a traceback at their first file.
    """
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"directory {text!r} does not exist")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {text!r} is not writable")
    return os.path.abspath(text)


def add_common_args(p: argparse.ArgumentParser, *, size: str = "1G", repeat: int = 3) -> None:
    """``--dir``, ``--size``, ``--repeat`` and ``--json``, the same in every script."""
    p.add_argument("--dir", type=dir_arg, default=".",
                   help="directory for the scratch files (default: .)")
    p.add_argument("--size", type=size_arg(), default=parse_size(size),
                   help=f"bytes per transfer, K/M/G are powers of 1024 (default: {size})")
    p.add_argument("--repeat", type=int, default=repeat,
                   help=f"rounds; figures are the median of the rounds (default: {repeat})")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of a table")


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Refuse a bad ``--repeat`` with a one-line usage error (``--dir`` was checked by
    :func:`dir_arg`); return the directory."""
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    return str(args.dir)


# -- scratch files and the page cache ------------------------------------------------------------
@contextlib.contextmanager
def scratch_file(directory: str, stem: str) -> Iterator[str]:
    """A fresh file (unique name, ``O_EXCL``, mode 0600) in ``directory``, removed afterwards.

    ``tempfile.mkstemp`` creates it exclusively, so a planted file or symlink of the same name
    is never followed or overwritten.
    """
    fd, path = tempfile.mkstemp(prefix=f".aioswap-{stem}-", suffix=".bin", dir=directory)
    os.close(fd)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(path: str) -> float:
    """Fraction of the file's pages in the page cache (``mincore``; faults nothing in); NaN
    when it cannot be told."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return math.nan
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return math.nan
            return sum(v & 1 for v in vec) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


#: How the scripts keep the page cache out of read figures.
CACHE_NOTE = ("before every read the file is fsynced and dropped from the page cache with "
              "posix_fadvise(POSIX_FADV_DONTNEED)")


def drop_cache(path: str) -> float:
    """fsync ``path``, evict its pages; return the fraction still resident (NaN: unknown)."""
    _drop_cache(path)
    return resident_fraction(path)


# -- timing --------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took (``time.perf_counter``)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def device_reads(path: str) -> int | None:
    """Read requests the block device holding ``path`` has completed so far (field 1 of
    ``/sys/dev/block/MAJ:MIN/stat``; every process's, so compare on a quiet machine), or None
    where the file system has no such device (tmpfs, overlay, btrfs)."""
    dev = os.stat(path).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_s() -> float:
    """CPU seconds this process has used so far, every thread, user and system
    (``resource.getrusage``)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def freed(d: dict[Any, Any]) -> float:
    """Seconds to free what ``d`` holds by dropping the caller's last references
    (``d.clear()``), as a program does when it is done with a state dict.

    Then a full ``gc.collect()`` runs, so that nothing a method left in reference cycles
    outlives its round: its time is charged too, but only when it found garbage (a method
    whose result frees by reference counting is not charged a collection of the whole
    interpreter, which costs ~50 ms with torch loaded and frees nothing of it).
    """
    import gc
    t0 = time.perf_counter()
    d.clear()
    t1 = time.perf_counter()
    found = gc.collect()
    t2 = time.perf_counter()
    return (t2 - t0) if found else (t1 - t0)


def orders(names: Sequence[str], rounds: int) -> Iterator[list[str]]:
    """The order of the methods in each round: rotated by one per round, so each method goes
    first in turn and drift or a noisy neighbour hurts them alike."""
    names = list(names)
    for r in range(rounds):
        k = r % len(names) if names else 0
        yield names[k:] + names[:k]


@dataclass(frozen=True)
class Summary:
    """The rounds of one figure: median, min, max and the spread ``(max - min) / median``."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def lo(self) -> float:
        return min(self.values) if self.values else math.nan

    @property
    def hi(self) -> float:
        return max(self.values) if self.values else math.nan

    @property
    def spread(self) -> float:
        m = self.median
        return (self.hi - self.lo) / m if m and math.isfinite(m) else math.nan

    def to_json_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "spread": self.spread,
                "all": list(self.values)}


def summarize(values: Sequence[float]) -> Summary:
    """A :class:`Summary` of the rounds."""
    return Summary(tuple(float(v) for v in values))


def ratio(ours: float, theirs: float) -> float:
    """aioswap / other (above 1: aioswap is faster); NaN when either is missing."""
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs <= 0:
        return math.nan
    return ours / theirs


# -- fio -------------------------------------------------------------------------------------------
def fio_path() -> str | None:
    """The fio executable on PATH, or None."""
    return shutil.which("fio")


def run_fio(path: str, rw: str, size: int, *, block_size: int = 1 << 20, queue_depth: int = 32,
            fio: str | None = None, end_fsync: bool = True) -> float:
    """fio's libaio engine with ``O_DIRECT`` on ``path``; returns fio's own runtime in seconds.

    Raises
    ------
    RuntimeError
        fio failed, or moved a different number of bytes.
    """
    exe = fio or fio_path()
    if exe is None:
        raise RuntimeError("fio is not installed")
    cmd = [exe, "--name=aioswap-bench", f"--filename={path}", "--ioengine=libaio", "--direct=1",
           f"--bs={block_size}", f"--iodepth={queue_depth}", f"--rw={rw}", f"--size={size}",
           "--numjobs=1", "--output-format=json"]
    if rw == "write" and end_fsync:
        cmd.append("--end_fsync=1")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fio {rw} failed: {done.stderr.strip() or done.stdout.strip()}")
    job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio {rw}: job error {job['error']}")
    stats = job[rw]
    if stats["io_bytes"] != size:
        raise RuntimeError(f"fio {rw} moved {stats['io_bytes']} of {size} bytes")
    if stats.get("runtime", 0) > 0:
        return float(stats["runtime"]) / 1000.0
    bw = stats.get("bw_bytes") or stats.get("bw", 0) * 1024
    return size / bw if bw else math.nan


# -- tables ----------------------------------------------------------------------------------------
def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.2f}"
    return str(v)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
                title: Sequence[str] = (), notes: Sequence[str] = (),
                file: IO[str] | None = None) -> None:
    """A plain-text table: first column left-aligned, numbers right-aligned with 2 decimals
    (NaN shows as ``-``), the title lines above and :data:`UNITS_NOTE` plus ``notes`` below."""
    out = sys.stdout if file is None else file
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for line in title:
        print(line, file=out)
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                    for i, (h, w) in enumerate(zip(headers, widths))), file=out)
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))), file=out)
    print(f"({UNITS_NOTE})", file=out)
    for n in notes:
        print(f"note: {n}", file=out)


def gpt_shapes(layers: int, hidden: int, ffn: int | None = None,
               kinds: Sequence[str] = ("param", "exp_avg", "exp_avg_sq")
               ) -> dict[str, tuple[int, ...]]:
    """The GPT-like state dict the issues measure: per layer q/k/v/o, fc1/fc2 (``ffn``,
    default 4 x hidden), their biases and two layer norms, each once per optimizer ``kind``
    (12 layers, hidden 1024: 576 tensors from 4 KiB to 16 MiB, 1.69 GiB in float32)."""
    ffn = 4 * hidden if ffn is None else ffn
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"layers.{i}."
        for m in ("q", "k", "v", "o"):
            shapes[p + f"attn.{m}_proj.weight"] = (hidden, hidden)
            shapes[p + f"attn.{m}_proj.bias"] = (hidden,)
        shapes[p + "mlp.fc1.weight"] = (ffn, hidden)
        shapes[p + "mlp.fc1.bias"] = (ffn,)
        shapes[p + "mlp.fc2.weight"] = (hidden, ffn)
        shapes[p + "mlp.fc2.bias"] = (hidden,)
        for ln in ("ln1", "ln2"):
            shapes[p + f"{ln}.weight"] = (hidden,)
            shapes[p + f"{ln}.bias"] = (hidden,)
    return {f"{kind}.{name}": shape for kind in kinds for name, shape in shapes.items()}


def gpt_state_dict(layers: int, hidden: int, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """:func:`gpt_shapes` as float32 tensors of random bytes (every tensor distinct: its
    index in its first 4 bytes); with ``world`` > 1, this rank's round-robin share."""
    import torch

    noise = torch.frombuffer(bytearray(os.urandom(1 << 20)), dtype=torch.uint8)
    sd: dict[str, Any] = {}
    for k, (name, shape) in enumerate(gpt_shapes(layers, hidden).items()):
        if k % world != rank:
            continue
        t = torch.empty(shape, dtype=torch.float32)
        raw = t.view(-1).view(torch.uint8)
        for s in range(0, raw.numel(), noise.numel()):
            n = min(noise.numel(), raw.numel() - s)
            raw[s:s + n].copy_(noise[:n])
        raw[:4].copy_(torch.tensor(list(k.to_bytes(4, "little")), dtype=torch.uint8))
        sd[name] = t
    return sd
