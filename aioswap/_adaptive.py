"""Reads that adapt to where the bytes are: copied from the page cache, or read from the drive.

A range of a file that the page cache holds is copied faster by a few threads doing plain
``pread`` (the kernel's copy, the GIL released) than it is read again from the drive with
``O_DIRECT`` (which bypasses the cache, and for a host-cached virtual disk or a loaded model
goes back to the device). A range that is not cached is read direct: one deep queue, no
second copy, the page cache left alone. :func:`plan` decides per range, cheaply:
``cachestat(2)`` (Linux 6.5, one system call, nothing read) where the kernel has it, else
``mincore`` over a mapping that is never touched (``aioswap._aio.resident_prefix``).

The choice can be forced: ``read="direct"`` or ``"buffered"`` on the loaders, or the
``AIOSWAP_READ`` environment variable (``auto``, ``direct``, ``buffered``); the argument wins.
A file system without ``O_DIRECT`` (tmpfs...) is always read buffered. Each loader logs what
it did at DEBUG on the ``aioswap`` logger and counts it in :data:`stats`.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import platform
import threading
from collections.abc import Callable
from typing import Any

from aioswap import _aio
from aioswap.errors import ShortReadError

__all__ = ["MODES", "CopyPool", "Reader", "cached_bytes", "cached_runs", "choose", "copy_pool",
           "read_mode", "stats"]

_log = logging.getLogger("aioswap")

#: Values of ``read=`` and of ``AIOSWAP_READ``.
MODES = ("auto", "direct", "buffered")
ENV = "AIOSWAP_READ"
#: A range at least this much in the page cache is copied from it (auto).
CACHED_ENOUGH = 0.9
_CHUNK = 8 << 20            # bytes one copy thread reads at a time
#: A range partly cached is looked at in pieces of this size (cached ones copied, the others
#: read direct); smaller runs are not worth a request of their own.
_PROBE = 4 << 20
#: An uncached run of a range partly cached shorter than this is read through the cache too.
_HOLE = 32 << 20
_THREADS = 4                # copies in parallel (measured: 4 beat 2 even on 2 cores)

# cachestat(2): the same number on every architecture that has it (Linux 6.5)
_NR_CACHESTAT = 451 if platform.machine() in ("x86_64", "aarch64", "riscv64") else -1


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


_syscall: Any = None
_have_cachestat = _NR_CACHESTAT > 0
_page = os.sysconf("SC_PAGE_SIZE")


def _cachestat(fd: int, offset: int, nbytes: int) -> int | None:
    """Bytes of ``[offset, offset + nbytes)`` in the page cache by ``cachestat``, or None
    where the kernel lacks it."""
    global _syscall, _have_cachestat
    if not _have_cachestat:
        return None
    if _syscall is None:
        libc = ctypes.CDLL(None, use_errno=True)
        _syscall = libc.syscall
        _syscall.restype = ctypes.c_long
    rng, st = _Range(offset, nbytes), _Stat()
    if _syscall(ctypes.c_long(_NR_CACHESTAT), ctypes.c_uint(fd), ctypes.byref(rng),
                ctypes.byref(st), ctypes.c_uint(0)) != 0:
        e = ctypes.get_errno()
        if e in (errno.ENOSYS, errno.EPERM):        # no cachestat here (or seccomp)
            _have_cachestat = False
        return None
    lo = offset // _page * _page
    pages = -(-(offset + nbytes - lo) // _page)
    return min(nbytes, int(st.nr_cache * nbytes // max(pages, 1)))


def cached_bytes(fd: int, offset: int, nbytes: int) -> int:
    """About how many bytes of ``fd``'s range ``[offset, offset + nbytes)`` the page cache
    holds now, reading nothing and starting no read-ahead (``cachestat``; else ``mincore``,
    which sees the cached prefix only)."""
    if nbytes <= 0:
        return 0
    got = _cachestat(fd, offset, nbytes)
    if got is not None:
        return got
    return int(_aio.resident_prefix(fd, offset, nbytes))


def read_mode(read: str | None) -> str:
    """The read mode in force: ``read`` when given, else ``AIOSWAP_READ``, else ``"auto"``;
    a value not in :data:`MODES` raises ``ValueError`` naming where it came from."""
    if read is None:
        value = os.environ.get(ENV, "auto").strip().lower() or "auto"
        if value not in MODES:
            raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
        return value
    if read not in MODES:
        raise ValueError(f"read={read!r}: expected one of {', '.join(MODES)}")
    return read


def cached_runs(fd: int, offset: int, nbytes: int) -> list[tuple[int, int, bool]]:
    """``[offset, offset + nbytes)`` cut where the page cache's hold on it changes:
    ``(offset, nbytes, cached)`` runs in file order, looked at in :data:`_PROBE` pieces
    (aligned to it in the file; a piece at least :data:`CACHED_ENOUGH` cached counts as
    cached). One ``cachestat`` per piece: about 1 us per MiB."""
    runs: list[tuple[int, int, bool]] = []
    pos, end = offset, offset + nbytes
    while pos < end:
        stop = min(end, (pos // _PROBE + 1) * _PROBE)
        n = stop - pos
        cached = cached_bytes(fd, pos, n) >= CACHED_ENOUGH * n
        if runs and runs[-1][2] == cached:
            o, k, _ = runs[-1]
            runs[-1] = (o, k + n, cached)
        else:
            runs.append((pos, n, cached))
        pos = stop
    return runs


def _fill_holes(runs: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """Runs of :func:`cached_runs` with the uncached ones shorter than :data:`_HOLE` read
    through the page cache too (merged with their cached neighbours): the kernel's
    read-ahead fills such a hole while the copy threads work, which measured faster than a
    short direct read beside them (a file cached in alternate 16 MiB stretches: 3.5 GB/s
    all copied against 3.4 split, 2.0 all direct)."""
    out: list[tuple[int, int, bool]] = []
    for o, n, cached in runs:
        if not cached and n < _HOLE:
            cached = True
        if out and out[-1][2] == cached:
            po, pn, _ = out[-1]
            out[-1] = (po, pn + n, cached)
        else:
            out.append((o, n, cached))
    return out


def choose(mode: str, direct_ok: bool, fd: int, offset: int, nbytes: int) -> bool:
    """Whether to copy ``[offset, offset + nbytes)`` from the page cache (True) or read it
    direct (False), for ``mode`` from :func:`read_mode`; ``direct_ok``: the file takes
    ``O_DIRECT``."""
    if not direct_ok or mode == "buffered":
        return True
    if mode == "direct":
        return False
    return cached_bytes(fd, offset, nbytes) >= CACHED_ENOUGH * nbytes


class _Stats:
    """Bytes the loaders copied from the page cache and read direct, since the start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.buffered_bytes = 0
        self.direct_bytes = 0

    def add(self, buffered: int, direct: int) -> None:
        with self._lock:
            self.buffered_bytes += buffered
            self.direct_bytes += direct

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"buffered_bytes": self.buffered_bytes, "direct_bytes": self.direct_bytes}


#: What the loaders did, process-wide: ``stats.snapshot()``.
stats = _Stats()


class CopyPool:
    """A few threads that copy ranges of files from the page cache with ``pread`` (started on
    first use; the GIL is released during each copy)."""

    def __init__(self, threads: int = _THREADS) -> None:
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._pool = None               # its threads stayed in the parent
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        self._threads, thread_name_prefix="aioswap-copy")
        return self._pool

    def read(self, fd: int, mem: memoryview, offset: int, name: str,
             done: Callable[[concurrent.futures.Future[int]], None] | None = None
             ) -> concurrent.futures.Future[int]:
        """Copy ``len(mem)`` bytes of ``fd`` at ``offset`` into ``mem`` in chunks on the pool;
        a future of the bytes copied. ``fd`` stays the caller's and must stay open until the
        future is done. A read that ends early raises
        :class:`~aioswap.errors.ShortReadError` naming ``name``."""
        total = len(mem)
        out: concurrent.futures.Future[int] = concurrent.futures.Future()
        out.set_running_or_notify_cancel()
        if done is not None:
            out.add_done_callback(done)
        if total == 0:
            out.set_result(0)
            return out
        chunks = [(o, min(_CHUNK, total - o)) for o in range(0, total, _CHUNK)]
        left = [len(chunks)]
        errors: list[BaseException] = []
        lock = threading.Lock()

        def one(o: int, n: int) -> None:
            try:
                got = 0
                while got < n:
                    k = os.preadv(fd, [mem[o + got:o + n]], offset + o + got)
                    if k <= 0:
                        raise ShortReadError(
                            f"{name}: the file ends at byte {offset + o + got}, before the "
                            f"{total} bytes read at offset {offset}", path=name,
                            offset=offset, nbytes=total, file_size=offset + o + got)
                    got += k
            except BaseException as exc:        # handed to the future
                with lock:
                    errors.append(exc)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                if errors:
                    out.set_exception(errors[0])
                else:
                    out.set_result(total)

        ex = self._executor()
        for o, n in chunks:
            ex.submit(one, o, n)
        return out


#: The process's copy threads.
copy_pool = CopyPool()


class Reader:
    """The reads of one load: each range copied from the page cache or read direct.

    ``read``: the mode (see :func:`read_mode`). :meth:`pread` decides per request (one
    ``cachestat``) and returns a future of the bytes read; a cached range is copied by
    :data:`copy_pool` through a descriptor of the file without ``O_DIRECT``, opened once per
    file. :meth:`close` (after every future is done) closes those descriptors, adds what was
    done to :data:`stats` and logs it at DEBUG as ``what``.
    """

    def __init__(self, read: str | None, what: str) -> None:
        try:
            self.mode = read_mode(read)
        except ValueError as exc:       # a bad AIOSWAP_READ (callers check their argument)
            _log.warning("%s; reading with auto", exc)
            self.mode = "auto"
        self.what = what
        self.copied = 0
        self.direct = 0
        self._plain: dict[int, int] = {}
        self._lock = threading.Lock()

    def _plain_fd(self, f: Any) -> int:
        fileno = f.fileno()
        with self._lock:
            fd = self._plain.get(fileno)
            if fd is None:
                fd = self._plain[fileno] = os.open(f"/proc/self/fd/{fileno}",
                                                   os.O_RDONLY | os.O_CLOEXEC)
            return fd

    def copies(self, f: Any, offset: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``offset`` of the open file ``f`` (an
        :class:`~aioswap.AioFile`) are to be copied from the page cache."""
        return choose(self.mode, f.direct, f.fileno(), offset, nbytes)

    def pread(self, f: Any, target: Any, offset: int, nbytes: int | None = None, *,
              copy: bool | None = None) -> concurrent.futures.Future[int]:
        """Read ``nbytes`` (default: all of ``target``, a contiguous CPU uint8-viewable
        tensor) of ``f`` at ``offset`` into ``target``; ``copy`` overrides the decision.

        In auto mode a range the page cache holds only in part is cut where that changes
        (:func:`cached_runs`): its cached runs are copied while the others are read direct,
        at the same time; the future is of all of it."""
        n = target.numel() * target.element_size() if nbytes is None else nbytes
        runs: list[tuple[int, int, bool]] | None = None
        if copy is None:
            if self.mode == "auto" and f.direct and n >= 2 * _PROBE:
                held = cached_bytes(f.fileno(), offset, n)
                if held >= CACHED_ENOUGH * n:
                    copy = True
                elif held < _PROBE // 2:
                    copy = False
                else:
                    runs = _fill_holes(cached_runs(f.fileno(), offset, n))
                    if len(runs) == 1:
                        copy, runs = runs[0][2], None
            else:
                copy = self.copies(f, offset, n)
        flat = target.reshape(-1).view(dtype=_uint8())[:n]
        if runs is None:
            return self._one(f, flat, offset, n, bool(copy))
        parts = [self._one(f, flat[o - offset:o - offset + k], o, k, c) for o, k, c in runs]
        return _all_of(parts, n)

    def _one(self, f: Any, flat: Any, offset: int, n: int,
             copy: bool) -> concurrent.futures.Future[int]:
        with self._lock:
            if copy:
                self.copied += n
            else:
                self.direct += n
        if not copy:
            fut: concurrent.futures.Future[int] = f.pread(flat, offset, nbytes=n,
                                                          async_op=True)
            return fut
        return copy_pool.read(self._plain_fd(f), memoryview(flat.numpy()), offset, f.name)

    def close(self) -> None:
        with self._lock:
            fds, self._plain = list(self._plain.values()), {}
            copied, direct = self.copied, self.direct
            self.copied = self.direct = 0
        for fd in fds:
            os.close(fd)
        if copied or direct:
            stats.add(copied, direct)
            _log.debug("%s (%s): %d bytes copied from the page cache, %d read direct",
                       self.what, self.mode, copied, direct)


def _all_of(parts: list[concurrent.futures.Future[int]],
            total: int) -> concurrent.futures.Future[int]:
    """One future for ``parts``: ``total`` once every part is done, else the first error
    (in the parts' order) once every part is done."""
    out: concurrent.futures.Future[int] = concurrent.futures.Future()
    out.set_running_or_notify_cancel()
    left = [len(parts)]
    lock = threading.Lock()

    def one(_: concurrent.futures.Future[int]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for p in parts:
            exc = p.exception()
            if exc is not None:
                out.set_exception(exc)
                return
        out.set_result(total)
    for p in parts:
        p.add_done_callback(one)
    return out


def _uint8() -> Any:
    import torch
    return torch.uint8
