"""Measuring a sweep point on real files, honestly.

Each round writes the point's bytes with ``fsync`` (the time includes it), drops the file from
the page cache, then reads them back: a write is timed until the data is durable and a read
comes from the drive, as in ``aioswap bench``. The buffers are page-locked, so the handle moves
them with ``O_DIRECT``. Scratch files are created exclusively (``tempfile``: unique name,
``O_EXCL``, mode 0600) and removed afterwards.
"""
from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from aioswap import _scratch
from aioswap._aio import DEFAULT_ALIGNMENT
from aioswap._units import format_size, short_size
from aioswap.errors import TuneError
from aioswap.tune.points import Direction, Measured, SweepPoint, check_direction, wanted
from aioswap.tune.results import PathArg, Result

if TYPE_CHECKING:
    import torch

__all__ = ["SharedBuffers", "cap_ipc_lock", "cgroup_memory_limit", "check_environment",
           "drop_cache", "meminfo_available", "memory_available", "read_text", "run_point",
           "scratch_files", "split"]


def drop_cache(path: str) -> None:
    """fsync ``path`` and evict its pages (``posix_fadvise(DONTNEED)``), so the next read
    comes from the drive."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_text(path: str) -> str | None:
    """A small /proc or /sys file, stripped; ``None`` when it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_memory_limit() -> int | None:
    """The smallest memory limit of this process's cgroup and its ancestors (cgroup v1
    ``memory.limit_in_bytes``, v2 ``memory.max``), or None."""
    best: int | None = None
    for line in (read_text("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            name = "memory.max"
            base = ("/sys/fs/cgroup" if os.path.exists("/sys/fs/cgroup/cgroup.controllers")
                    else "/sys/fs/cgroup/unified")
        elif "memory" in controllers.split(","):
            base, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        while True:
            value = (read_text(os.path.join(base + path.rstrip("/"), name)) or "").strip()
            if value.isdigit():
                best = int(value) if best is None else min(best, int(value))
            if path in ("/", ""):
                break
            path = os.path.dirname(path)
    return best


def meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None."""
    for line in (read_text("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def memory_available() -> tuple[int | None, str]:
    """Bytes this process may still allocate, and what limits it.

    The smallest of ``MemAvailable`` (``/proc/meminfo``), the cgroup's ``memory.max`` less its
    ``memory.current`` (cgroup v2), and ``RLIMIT_AS`` less the current virtual size.
    ``(None, "")`` when none of them can be read.
    """
    found: list[tuple[int, str]] = []
    avail = meminfo_available()
    if avail is not None:
        found.append((avail, "MemAvailable in /proc/meminfo"))
    cg = (read_text("/proc/self/cgroup") or "").strip().splitlines()
    for line in cg:
        if line.startswith("0::"):
            base = "/sys/fs/cgroup" + line[3:].rstrip("/")
            limit, used = read_text(base + "/memory.max"), read_text(base + "/memory.current")
            if limit and used and limit.strip().isdigit() and used.strip().isdigit():
                found.append((int(limit) - int(used), f"the cgroup memory limit "
                              f"({format_size(int(limit))})"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        vm = 0
        for line in (read_text("/proc/self/status") or "").splitlines():
            if line.startswith("VmSize:"):
                vm = int(line.split()[1]) * 1024
        found.append((soft - vm, f"RLIMIT_AS (ulimit -v, {format_size(soft)})"))
    if not found:
        return None, ""
    return min(found)


@contextlib.contextmanager
def scratch_files(dirs: Sequence[str], stem: str) -> Iterator[list[str]]:
    """One fresh file per directory (unique name with our pid, ``O_EXCL``, 0600), removed
    afterwards (one that cannot be stays on :mod:`aioswap._scratch`'s record, for the tool to
    name); files of this naming whose process is gone are removed first."""
    paths: list[str] = []
    try:
        for d in dirs:
            _scratch.remove_stale(d, f".aioswap-{stem}-", ".bin")   # left by a killed run
            fd, path = _scratch.create(d, f".aioswap-{stem}-", ".bin")
            os.close(fd)
            paths.append(path)
        yield paths
    finally:
        for p in paths:
            _scratch.remove(p)


def split(io_size: int, n: int) -> list[int]:
    """Split ``io_size`` into ``n`` parts, each a multiple of 4096 (the O_DIRECT unit)."""
    unit = DEFAULT_ALIGNMENT
    blocks = max(n, -(-io_size // unit))
    base, extra = divmod(blocks, n)
    return [(base + (1 if i < extra else 0)) * unit for i in range(n)]


def _new_handle(point: SweepPoint, use_gds: bool) -> Any:
    """An AioHandle (or GdsHandle) for ``point``; imported here so that the package imports
    without torch."""
    from aioswap.gds import GdsHandle
    from aioswap.handle import AioHandle
    cls: Any = GdsHandle if use_gds else AioHandle
    return cls(block_size=point.block_size, queue_depth=point.queue_depth,
               single_submit=point.single_submit, overlap_events=point.overlap_events,
               intra_op_parallelism=point.intra_op_parallelism)


def _buffers(sizes: Sequence[int], use_gds: bool) -> list[torch.Tensor]:
    """One buffer per file: page-locked host memory, or device memory for GDS."""
    import torch

    from aioswap import pinned
    if use_gds:
        bufs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    else:
        bufs = [pinned.empty(n, torch.uint8) for n in sizes]
    for b in bufs:
        b.random_(0, 256)  # incompressible: some drives compress or dedupe zeros
    return bufs


class SharedBuffers:
    """Buffers reused by every point of a sweep (locking and filling hundreds of MB per
    point would cost more than measuring it)."""

    def __init__(self, sizes: Sequence[int], use_gds: bool) -> None:
        self.sizes = list(sizes)
        self.use_gds = use_gds
        self._bufs: list[Any] | None = None

    def get(self) -> list[Any]:
        if self._bufs is None:
            self._bufs = _buffers(self.sizes, self.use_gds)
        return self._bufs

    def close(self) -> None:
        self._bufs = None  # the registry frees locked memory with its last view


def cap_ipc_lock() -> bool:
    """Whether this process may lock any amount of memory (CAP_IPC_LOCK, bit 14)."""
    for line in (read_text("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 14 & 1)
    return False


def check_environment(io_size: int, *, use_gds: bool = False) -> None:
    """Refuse, before measuring anything, what would fail every point.

    Raises
    ------
    TuneError
        torch is missing; ``use_gds`` without a CUDA device or cuFile; page-locked memory
        for ``io_size`` bytes cannot be had (RLIMIT_MEMLOCK without CAP_IPC_LOCK); or there
        is not enough memory. The message says why and what to do, in one line.
    """
    try:
        import torch
    except ImportError:
        raise TuneError("tune needs torch: pip install torch (the CPU build is enough: "
                        "--index-url https://download.pytorch.org/whl/cpu)") from None
    avail, why = memory_available()
    if avail is not None and io_size + (64 << 20) > avail:
        raise TuneError(f"tune needs {format_size(io_size)} of memory for its buffers plus "
                        f"64 MiB; {format_size(max(avail, 0))} is available ({why}): use a "
                        f"smaller --io-size")
    if use_gds:
        if not torch.cuda.is_available():
            raise TuneError(f"--gds needs a CUDA device; torch {torch.__version__} sees none")
        from aioswap.gds import GdsHandle
        try:
            GdsHandle().close()
        except Exception as exc:  # CuFileUnavailable, CuFileError: the reason is the message
            raise TuneError(f"--gds needs cuFile: {exc}") from None
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = io_size + (1 << 20)      # the buffers, and room for the handle's own locked ring
    if soft != resource.RLIM_INFINITY and soft < need and not cap_ipc_lock():
        fits = soft - (1 << 20)
        smaller = (f", or use --io-size {short_size(fits)} or less"
                   if fits >= DEFAULT_ALIGNMENT else "")
        raise TuneError(f"tune needs {format_size(need)} of page-locked memory "
                        f"({format_size(io_size)} of buffers, pinned for O_DIRECT, plus 1 MiB), "
                        f"{format_size(need - soft)} more than RLIMIT_MEMLOCK allows "
                        f"({format_size(soft)}, no CAP_IPC_LOCK); nothing falls back to "
                        f"unlocked memory in a sweep: raise it (ulimit -l unlimited; docker "
                        f"--ulimit memlock=-1), run as root{smaller}")


def _transfer(handle: Any, op: Measured, bufs: Sequence[Any], paths: Sequence[str],
              sizes: Sequence[int]) -> int:
    """Move every buffer to/from its file (writes fsync'd), concurrently when several."""
    if op == "write":
        if len(paths) == 1:
            return int(handle.pwrite(bufs[0], paths[0], nbytes=sizes[0], fsync=True))
        futures = [handle.pwrite(b, p, nbytes=n, async_op=True, fsync=True)
                   for b, p, n in zip(bufs, paths, sizes)]
    else:
        if len(paths) == 1:
            return int(handle.pread(bufs[0], paths[0], nbytes=sizes[0]))
        futures = [handle.pread(b, p, nbytes=n, async_op=True)
                   for b, p, n in zip(bufs, paths, sizes)]
    handle.wait()
    return sum(int(f.result()) for f in futures)


def describe_error(exc: BaseException) -> str:
    """``"OSError: [Errno 28] No space left on device"``: the type and the message."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def run_point(point: SweepPoint, dirs: Sequence[PathArg], io_size: int,
              direction: Direction = "both", *, use_gds: bool = False,
              buffers: Sequence[Any] | None = None, repeat: int = 1) -> list[Result]:
    """Measure one point: ``repeat`` rounds of an fsync'd write, a cache drop and a read.

    The bytes are split across one file per directory (each part a multiple of 4096), and
    the files of several directories are moved concurrently on one handle. The buffers are
    page-locked, so the transfers go straight to the drive with ``O_DIRECT``; with
    ``use_gds`` they are CUDA buffers on a ``GdsHandle``. The files are removed afterwards.

    Parameters
    ----------
    point : SweepPoint
    dirs : sequence of paths
        Directories on the drives to measure.
    io_size : int
        Total bytes per direction per round.
    direction : {"read", "write", "both"}
        What to report. ``"read"`` still writes the files first, untimed.
    use_gds : bool
        Measure the cuFile path.
    buffers : sequence of tensors, optional
        One buffer per directory of at least its share of ``io_size``, reused across points
        by :func:`~aioswap.tune.tune`; by default the point allocates its own.
    repeat : int
        Rounds; the result keeps every round's time and reports the median.

    Returns
    -------
    list of Result
        ``[write, read]`` for ``"both"``, else one. Any exception (no GPU, full disk, a
        refused parameter) gives failed results carrying its text; nothing is raised except
        ``KeyboardInterrupt``/``SystemExit``.
    """
    check_direction(direction)
    if not dirs:
        raise ValueError("run_point needs at least one directory")
    if io_size <= 0:
        raise ValueError(f"io_size must be positive, got {io_size}")
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    want = wanted(direction)
    dir_names = tuple(os.fspath(d) for d in dirs)
    sizes = split(io_size, len(dir_names))
    total = sum(sizes)
    samples: dict[str, list[float]] = {"write": [], "read": []}
    try:
        with scratch_files(dir_names, "tune") as paths, _new_handle(point, use_gds) as handle:
            bufs = _buffers(sizes, use_gds) if buffers is None else list(buffers)
            if len(bufs) != len(sizes):
                raise ValueError(f"{len(bufs)} buffers for {len(sizes)} directories")
            for _ in range(repeat):
                for op in ("write", "read"):
                    if op == "read" and "read" not in want:
                        break
                    if op == "read":
                        for p in paths:
                            drop_cache(p)
                    t0 = time.perf_counter()
                    moved = _transfer(handle, op, bufs, paths, sizes)
                    seconds = time.perf_counter() - t0
                    if moved != total:
                        raise OSError(f"{op} moved {moved} of {total} bytes")
                    samples[op].append(seconds)
    except Exception as exc:  # a failed point is reported, not raised
        error = describe_error(exc)
        return [Result.failed(point, op, io_size, error, use_gds=use_gds, dirs=dir_names)
                for op in want]
    return [Result.timed(point, op, io_size, total, samples[op], use_gds=use_gds,
                         dirs=dir_names) for op in want]
