"""AioHandle: tensor and buffer I/O to files through the kernel AIO engine.

Every request is planned by :func:`_plan` into up to three parts:

* head / tail: bytes before the first and after the last ``O_DIRECT``-aligned file offset
  of the request; moved with plain buffered ``pread``/``pwrite`` so any byte size and offset
  works and the file ends exactly where the data ends;
* middle, **direct**: page-locked (``pinned.is_pinned``), aligned, contiguous host memory goes
  straight to the kernel with ``O_DIRECT``;
* middle, **bounce**: anything else (unpinned or misaligned host memory, CUDA tensors) is
  staged through a pool of page-locked, aligned buffers owned by the handle and reused by
  every request, with the copies pipelined against the I/O (double buffering).

A file system that refuses ``O_DIRECT`` is served entirely with buffered I/O, with one
:class:`~aioswap.errors.DirectIOFallbackWarning` per handle.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import stat
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from aioswap import _aio, pinned
from aioswap.config import AioConfig
from aioswap.errors import (DirectIOFallbackWarning, DirectIOUnsupportedError,
                            HandleClosedError, ShortReadError)

if TYPE_CHECKING:
    import torch

__all__ = ["AioHandle", "HandleStats", "IOFuture"]

_log = logging.getLogger("aioswap")

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
FileArg = Union[PathLike, int]

_DEFAULTS = AioConfig()


def _torch() -> Any:
    """torch if the caller has imported it (never imported here on its own)."""
    import sys
    return sys.modules.get("torch")


class IOFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The future of one asynchronous request; ``result()`` is the number of bytes moved.

    A real :class:`concurrent.futures.Future`: callbacks, ``wait``/``as_completed`` and
    ``asyncio.wrap_future`` work. ``op`` is ``"read"`` or ``"write"``, ``file`` the path or
    fd, ``nbytes`` and ``offset`` the request.
    """

    def __init__(self, op: str, file: FileArg, nbytes: int, offset: int) -> None:
        super().__init__()
        self.op = op
        self.file = file
        self.nbytes = nbytes
        self.offset = offset

    def __repr__(self) -> str:
        return (f"<IOFuture {self.op} {self.nbytes} bytes at {self.offset} of {self.file!r} "
                f"{self._state.lower()}>")


@dataclass
class HandleStats:
    """Bytes moved by each path, and request counts. ``handle.stats`` returns a copy."""

    direct_bytes: int = 0
    bounce_bytes: int = 0
    head_tail_bytes: int = 0
    buffered_bytes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    reads: int = 0
    writes: int = 0
    async_ops: int = 0
    failed: int = 0

    def copy(self) -> HandleStats:
        return HandleStats(**{f.name: getattr(self, f.name) for f in fields(self)})


# ----------------------------------------------------------------------------------------
# Buffers


@dataclass
class _Mem:
    """A caller's buffer resolved to raw memory; ``keep`` holds it alive."""

    addr: int
    nbytes: int
    cuda: bool
    contiguous: bool
    writable: bool
    keep: Any
    tensor: Any = None          # torch.Tensor when the buffer is one
    array: Any = None           # numpy.ndarray otherwise

    def flat_tensor(self) -> Any:
        """A flat uint8 tensor over a contiguous tensor buffer."""
        t = self.tensor.detach()
        # as_strided, not reshape: a 1-element tensor may be "contiguous" with any stride
        return t.as_strided((t.numel(),), (1,)).view(_torch().uint8)


def _resolve(buffer: Any) -> _Mem:
    torch = _torch()
    if torch is not None and isinstance(buffer, torch.Tensor):
        dev = buffer.device.type
        if dev not in ("cpu", "cuda"):
            raise TypeError(f"cannot do I/O on a tensor on device {buffer.device}; "
                            f"use a CPU or CUDA tensor")
        nbytes = buffer.numel() * buffer.element_size()
        return _Mem(buffer.data_ptr(), nbytes, dev == "cuda", buffer.is_contiguous(),
                    True, buffer, tensor=buffer)
    if isinstance(buffer, np.ndarray):
        arr = buffer
    else:
        try:
            mv = memoryview(buffer)
        except TypeError:
            raise TypeError(f"buffer must be a torch tensor, a numpy array or support the "
                            f"buffer protocol, got {type(buffer).__name__}") from None
        if mv.c_contiguous:
            arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
        else:
            arr = np.asarray(mv)
        if mv.readonly and arr.flags.writeable:
            arr.flags.writeable = False
    addr = arr.__array_interface__["data"][0]
    return _Mem(addr, arr.nbytes, False, bool(arr.flags.c_contiguous),
                bool(arr.flags.writeable), buffer, array=arr)


def _host_view(addr: int, nbytes: int) -> memoryview:
    """A writable byte memoryview over raw host memory the caller keeps alive."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


# ----------------------------------------------------------------------------------------
# Files


@dataclass
class _File:
    """A file opened for one request: a direct fd (or None) and a buffered fd."""

    name: str
    direct_fd: int | None
    buffered_fd: int
    size: int
    mem_align: int
    off_align: int
    owned: list[int] = field(default_factory=list)

    def close(self) -> None:
        for fd in self.owned:
            try:
                os.close(fd)
            except OSError:
                pass
        self.owned.clear()


def _describe(file: FileArg) -> str:
    if isinstance(file, int):
        return f"fd {file}"
    return repr(os.fsdecode(file))


# ----------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class _Plan:
    """How one request runs: byte ranges relative to the request start."""

    path: str                    # "direct" | "bounce" | "buffered"
    head: tuple[int, int]        # (start, end) moved with buffered I/O
    middle: tuple[int, int]      # moved by `path`
    tail: tuple[int, int]


def _plan(mem: _Mem, offset: int, nbytes: int, f: _File, is_pinned: bool) -> _Plan:
    """Decide how a request of ``nbytes`` at file ``offset`` from ``mem`` runs."""
    if f.direct_fd is None:
        return _Plan("buffered", (0, 0), (0, nbytes), (nbytes, nbytes))
    a = f.off_align
    head_end = min(nbytes, (-offset) % a)
    tail_start = max(head_end, nbytes - (offset + nbytes) % a)
    direct = (not mem.cuda and mem.contiguous and is_pinned
              and (mem.addr + head_end) % f.mem_align == 0)
    return _Plan("direct" if direct else "bounce", (0, head_end), (head_end, tail_start),
                 (tail_start, nbytes))


# ----------------------------------------------------------------------------------------
# The bounce pool


class _BouncePool:
    """Page-locked, aligned staging buffers shared by all requests of one handle.

    ``nbufs`` buffers of ``buf_bytes`` each live in one allocation; a request takes two
    (double buffering), so at most ``nbufs // 2`` bounce streams run at once and memory
    stays bounded however many requests are queued.
    """

    def __init__(self, nbufs: int, buf_bytes: int) -> None:
        self.nbufs = nbufs
        self.buf_bytes = buf_bytes
        self._mem: Any = None
        self._free: list[int] = []
        self._cond = threading.Condition()
        self._cuda_registered = False

    @property
    def nbytes(self) -> int:
        return self.nbufs * self.buf_bytes

    def _ensure(self) -> None:
        if self._mem is None:
            # strict=False: without CAP_IPC_LOCK and a large RLIMIT_MEMLOCK the pool is
            # aligned but unlocked (one warning); O_DIRECT needs alignment, not locking.
            self._mem = pinned.allocate(self.nbytes, strict=False)
            self._free = list(range(self.nbufs))

    def register_cuda(self) -> None:
        """Page-lock the pool for CUDA too, so device copies run at full speed."""
        with self._cond:
            self._ensure()
            if self._cuda_registered:
                return
            torch = _torch()
            try:
                rc = torch.cuda.cudart().cudaHostRegister(self._mem.address, self.nbytes, 0)
                self._cuda_registered = int(rc) == 0
            except Exception as exc:    # a slower pageable copy still works
                _log.debug("cudaHostRegister of the bounce pool failed: %s", exc)

    @contextmanager
    def pair(self) -> Iterator[tuple[int, int]]:
        """Borrow two buffers; yields their addresses."""
        with self._cond:
            self._ensure()
            while len(self._free) < 2:
                self._cond.wait()
            a, b = self._free.pop(), self._free.pop()
        base = self._mem.address
        try:
            yield base + a * self.buf_bytes, base + b * self.buf_bytes
        finally:
            with self._cond:
                self._free += [a, b]
                self._cond.notify_all()

    def host_tensor(self, addr: int, nbytes: int) -> Any:
        """A uint8 tensor over part of the pool (for CUDA copies)."""
        torch = _torch()
        off = addr - self._mem.address
        return torch.frombuffer(self._mem, dtype=torch.uint8, count=nbytes, offset=off)

    def close(self) -> None:
        with self._cond:
            mem, self._mem = self._mem, None
            if mem is not None and self._cuda_registered:
                try:
                    _torch().cuda.cudart().cudaHostUnregister(mem.address)
                except Exception as exc:
                    _log.debug("cudaHostUnregister of the bounce pool failed: %s", exc)
                self._cuda_registered = False
            if mem is not None:
                try:
                    pinned.free(mem)
                except BufferError:
                    pass    # a view of the pool is still alive: it goes with the last view


# ----------------------------------------------------------------------------------------
# The handle


class AioHandle:
    """Reads and writes tensors and buffers to files with kernel AIO.

    Parameters
    ----------
    block_size : int
        Bytes per AIO request (iocb). Default 1 MiB.
    queue_depth : int
        Most requests in flight per worker. Default 32.
    single_submit : bool
        Submit one iocb per ``io_submit`` call instead of batches.
    overlap_events : bool
        Sliding window (top up after each completion) instead of submit-batch-reap-batch.
    intra_op_parallelism : int
        Worker contexts a single request is split across (contiguous slices).
    bounce_bytes : int, optional
        Size of the bounce pool; default ``queue_depth * block_size`` (at least two
        buffers of ``block_size`` per worker).
    async_workers : int, optional
        Threads that run ``async_op=True`` requests; default 4.

    Notes
    -----
    Alignment: ``O_DIRECT`` memory and offset alignment come from ``statx`` per file
    (fallback 4096). Requests may have any size and offset; the unaligned head and tail go
    through buffered I/O.

    Lifetime: a buffer passed to an asynchronous request is referenced by the handle until
    the request finishes; do not modify (writes) or read (reads) it before the future is done.

    Thread safety: any number of threads may submit requests on one handle.
    """

    def __init__(self, block_size: int = _DEFAULTS.block_size,
                 queue_depth: int = _DEFAULTS.queue_depth,
                 single_submit: bool = _DEFAULTS.single_submit,
                 overlap_events: bool = _DEFAULTS.overlap_events,
                 intra_op_parallelism: int = _DEFAULTS.intra_op_parallelism,
                 *, bounce_bytes: int | None = None, async_workers: int = 4) -> None:
        cfg = AioConfig(block_size=block_size, queue_depth=queue_depth,
                        single_submit=single_submit, overlap_events=overlap_events,
                        intra_op_parallelism=intra_op_parallelism)
        if async_workers < 1:
            raise ValueError(f"async_workers must be >= 1, got {async_workers}")
        self._cfg = cfg
        lanes = cfg.intra_op_parallelism
        pool_bytes = queue_depth * block_size if bounce_bytes is None else int(bounce_bytes)
        # Buffers of up to 4 MiB: a request pipelines several chunks, and several requests
        # (async ops, lanes) bounce at once; at least one pair per lane.
        buf_bytes = max(block_size, min(4 << 20, pool_bytes // max(2, 2 * lanes))
                        // block_size * block_size)
        nbufs = max(2 * lanes, 2, pool_bytes // buf_bytes // 2 * 2)
        self._pool = _BouncePool(nbufs, buf_bytes)
        self._lock = threading.Lock()
        self._stats = HandleStats()
        self._contexts: list[_aio.AioContext] = []
        self._all_contexts: list[_aio.AioContext] = []
        self._pending: list[IOFuture] = []
        self._closed = False
        self._warned_buffered = False
        self._ops = concurrent.futures.ThreadPoolExecutor(
            async_workers, thread_name_prefix="aioswap-op")
        self._lanes = (concurrent.futures.ThreadPoolExecutor(
            lanes, thread_name_prefix="aioswap-lane") if lanes > 1 else None)
        self._io = concurrent.futures.ThreadPoolExecutor(
            max(2, 2 * lanes), thread_name_prefix="aioswap-io")

    @classmethod
    def from_config(cls, config: AioConfig, **kwargs: Any) -> AioHandle:
        """Build a handle from an :class:`~aioswap.config.AioConfig` (``use_gds`` ignored)."""
        return cls(config.block_size, config.queue_depth, config.single_submit,
                   config.overlap_events, config.intra_op_parallelism, **kwargs)

    # -- knobs ---------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._cfg.block_size

    @property
    def queue_depth(self) -> int:
        return self._cfg.queue_depth

    @property
    def single_submit(self) -> bool:
        return self._cfg.single_submit

    @property
    def overlap_events(self) -> bool:
        return self._cfg.overlap_events

    @property
    def intra_op_parallelism(self) -> int:
        return self._cfg.intra_op_parallelism

    @property
    def config(self) -> AioConfig:
        return self._cfg

    @property
    def bounce_pool_bytes(self) -> int:
        """Bytes of the bounce pool (allocated on first use)."""
        return self._pool.nbytes

    @property
    def stats(self) -> HandleStats:
        """A snapshot of the bytes moved by each path."""
        with self._lock:
            return self._stats.copy()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        c = self._cfg
        return (f"<AioHandle block_size={c.block_size} queue_depth={c.queue_depth} "
                f"single_submit={c.single_submit} overlap_events={c.overlap_events} "
                f"intra_op_parallelism={c.intra_op_parallelism}"
                f"{' closed' if self._closed else ''}>")

    # -- pinned memory ---------------------------------------------------------------------
    def new_cpu_locked_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements over page-locked memory (direct I/O capable)."""
        return pinned.empty(numel, dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> None:
        """Release a tensor from :meth:`new_cpu_locked_tensor` (see ``pinned.free``)."""
        pinned.free(tensor)

    def is_pinned(self, buffer: Any) -> bool:
        """Whether ``buffer``'s whole extent is page-locked (see ``pinned.is_pinned``)."""
        return pinned.is_pinned(buffer)

    # -- requests --------------------------------------------------------------------------
    def pread(self, buffer: Any, file: FileArg, offset: int = 0, *,
              nbytes: int | None = None, async_op: bool = False) -> int | IOFuture:
        """Read ``nbytes`` (default: the buffer's size) from ``file`` at ``offset``.

        Parameters
        ----------
        buffer : torch.Tensor, numpy.ndarray or writable buffer
            Destination; CPU or CUDA tensors of any dtype, contiguous or not.
        file : path or int
            A path, or an open fd (its access mode is respected).
        offset : int
            File offset in bytes, any value >= 0.
        nbytes : int, optional
            Bytes to read into the start of the buffer.
        async_op : bool
            Return an :class:`IOFuture` at once instead of blocking.

        Returns
        -------
        int or IOFuture
            Bytes read.

        Raises
        ------
        ShortReadError
            The file is shorter than ``offset + nbytes`` (checked before any I/O).
        FileNotFoundError, IsADirectoryError, PermissionError, OSError
            The file cannot be read.
        ValueError, BufferError
            Negative offset, read-only buffer, ``nbytes`` beyond the buffer.
        HandleClosedError
            The handle is closed.
        """
        return self._request("read", buffer, file, offset, nbytes, async_op, False)

    def pwrite(self, buffer: Any, file: FileArg, offset: int = 0, *,
               nbytes: int | None = None, async_op: bool = False,
               fsync: bool = False) -> int | IOFuture:
        """Write ``nbytes`` (default: the whole buffer) to ``file`` at ``offset``.

        A path is created if missing (mode 0644) and never truncated: bytes past the request
        stay as they were. ``fsync=True`` makes data and size durable before returning.
        Same parameters, returns and errors as :meth:`pread`.
        """
        return self._request("write", buffer, file, offset, nbytes, async_op, fsync)

    def wait(self) -> int:
        """Finish every outstanding asynchronous request; return how many there were.

        Returns 0 when none were pending. All requests run to the end; then the first
        error (in submission order) is raised.
        """
        count = 0
        first: BaseException | None = None
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                break
            concurrent.futures.wait(batch)
            count += len(batch)
            for fut in batch:
                exc = fut.exception()
                if exc is not None and first is None:
                    first = exc
        if first is not None:
            raise first
        return count

    def close(self) -> None:
        """Finish in-flight requests, then free contexts, threads and the bounce pool.

        Idempotent. Errors of unfinished asynchronous requests stay in their futures.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        self._ops.shutdown(wait=True)
        if self._lanes is not None:
            self._lanes.shutdown(wait=True)
        self._io.shutdown(wait=True)
        with self._lock:
            contexts, self._all_contexts, self._contexts = self._all_contexts, [], []
        for ctx in contexts:
            ctx.close()
        self._pool.close()

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            try:
                self.close()
            except Exception:
                pass

    # -- internals -------------------------------------------------------------------------
    def _request(self, op: str, buffer: Any, file: FileArg, offset: int,
                 nbytes: int | None, async_op: bool, fsync: bool) -> int | IOFuture:
        if self._closed:
            raise HandleClosedError(f"{op} of {_describe(file)} on a closed AioHandle")
        offset = int(offset)
        if offset < 0:
            raise ValueError(f"negative file offset {offset} for {_describe(file)}")
        mem = _resolve(buffer)
        n = mem.nbytes if nbytes is None else int(nbytes)
        if n < 0:
            raise ValueError(f"negative nbytes {n} for {_describe(file)}")
        if n > mem.nbytes:
            raise ValueError(f"{op} of {n} bytes at offset {offset} of {_describe(file)}: the "
                             f"buffer holds only {mem.nbytes} bytes")
        if op == "read" and not mem.writable:
            raise ValueError(f"read of {n} bytes from {_describe(file)} into a read-only "
                             f"buffer ({type(buffer).__name__})")
        f = self._open(file, op)
        try:
            if op == "read" and offset + n > f.size:
                raise ShortReadError(
                    f"read of {n} bytes at offset {offset} from {f.name} goes past the end of "
                    f"the file ({f.size} bytes)", path=f.name, offset=offset, nbytes=n,
                    file_size=f.size)
        except BaseException:
            f.close()
            raise
        if not async_op:
            return self._run(op, mem, f, offset, n, fsync)
        fut = IOFuture(op, file, n, offset)
        with self._lock:
            if self._closed:
                f.close()
                raise HandleClosedError(f"{op} of {f.name} on a closed AioHandle")
            self._pending.append(fut)
            self._stats.async_ops += 1

        def job() -> None:
            if not fut.set_running_or_notify_cancel():
                f.close()
                return
            try:
                fut.set_result(self._run(op, mem, f, offset, n, fsync))
            except BaseException as exc:
                fut.set_exception(exc)

        self._ops.submit(job)
        return fut

    def _open(self, file: FileArg, op: str) -> _File:
        write = op == "write"
        owned: list[int] = []
        try:
            if isinstance(file, int):
                name = f"fd {file}"
                mode = _fd_mode(file, name, write)
                # requests own their descriptors, so the caller may close ``file`` while an
                # asynchronous request is queued
                if mode & os.O_DIRECT:
                    direct_fd: int | None = _own(os.dup(file), owned)
                    buffered_fd = _reopen(file, mode & ~os.O_DIRECT, owned)
                else:
                    buffered_fd = _own(os.dup(file), owned)
                    direct_fd = self._try_direct(lambda: _reopen(file, mode | os.O_DIRECT,
                                                                 owned), name)
            else:
                name = os.fsdecode(file)
                flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
                buffered_fd = os.open(file, flags | os.O_CLOEXEC, 0o644)
                owned.append(buffered_fd)
                _check_regular(buffered_fd, name)
                direct_fd = self._try_direct(
                    lambda: _own(_aio.open_direct(file, write=write), owned), name)
            st = os.fstat(buffered_fd)
            _check_regular_st(st, name)
            if direct_fd is not None:
                mem_align, off_align = _aio.dio_alignment(direct_fd)
            else:
                mem_align = off_align = 1
            return _File(repr(name) if not name.startswith("fd ") else name, direct_fd,
                         buffered_fd, st.st_size, mem_align, off_align, owned)
        except BaseException:
            for fd in owned:
                os.close(fd)
            raise

    def _try_direct(self, opener: Callable[[], int], name: str) -> int | None:
        try:
            return opener()
        except DirectIOUnsupportedError:
            if not self._warned_buffered:
                self._warned_buffered = True
                warnings.warn(f"the file system of {name} refuses O_DIRECT; this handle uses "
                              f"buffered I/O for such files", DirectIOFallbackWarning,
                              stacklevel=5)
            return None

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _run(self, op: str, mem: _Mem, f: _File, offset: int, n: int, fsync: bool) -> int:
        """Execute one validated request; always closes ``f``."""
        try:
            done = self._execute(op, mem, f, offset, n)
            if fsync and op == "write":
                os.fsync(f.buffered_fd)
            if op == "read":
                self._count(read_bytes=done, reads=1)
            else:
                self._count(write_bytes=done, writes=1)
            return done
        except BaseException:
            self._count(failed=1)
            raise
        finally:
            f.close()

    def _execute(self, op: str, mem: _Mem, f: _File, offset: int, n: int) -> int:
        if n == 0:
            return 0
        if not mem.contiguous:
            return self._noncontiguous(op, mem, f, offset, n)
        if mem.cuda:
            self._pool.register_cuda()
        plan = _plan(mem, offset, n, f, not mem.cuda and pinned.is_pinned((mem.addr, n)))
        write = op == "write"
        # head and tail first: a later O_DIRECT write flushes and invalidates any cached page
        # it shares with them, so the file is right whichever lands on disk first.
        for lo, hi in (plan.head, plan.tail):
            if hi > lo:
                self._buffered(write, mem, lo, hi - lo, f.buffered_fd, offset + lo, f.name)
                self._count(head_tail_bytes=hi - lo)
        lo, hi = plan.middle
        if hi > lo:
            if plan.path == "buffered":
                self._buffered(write, mem, lo, hi - lo, f.buffered_fd, offset + lo, f.name)
                self._count(buffered_bytes=hi - lo)
            else:
                assert f.direct_fd is not None
                self._split(plan.path, write, mem, lo, hi - lo, f, offset + lo)
                key = "direct_bytes" if plan.path == "direct" else "bounce_bytes"
                self._count(**{key: hi - lo})
        return n

    def _noncontiguous(self, op: str, mem: _Mem, f: _File, offset: int, n: int) -> int:
        """Stage a non-contiguous buffer through a contiguous copy of it."""
        itemsize = mem.nbytes // max(1, mem.tensor.numel() if mem.tensor is not None
                                     else mem.array.size)
        if op == "read" and n % itemsize:
            raise ValueError(f"read of {n} bytes from {f.name} into a non-contiguous buffer "
                             f"must cover whole elements of {itemsize} bytes")
        if mem.tensor is not None:
            src = mem.tensor.detach()
            tmp = src.contiguous() if op == "write" else _torch().empty_like(
                src, memory_format=_torch().contiguous_format)
        else:
            tmp = np.ascontiguousarray(mem.array) if op == "write" else np.empty_like(
                mem.array, order="C")
        done = self._execute(op, _resolve(tmp), f, offset, n)
        if op == "read":
            if mem.tensor is not None:
                if n == mem.nbytes:
                    mem.tensor.detach().copy_(tmp)
                else:   # partial read: only the leading n bytes of the logical order
                    _copy_prefix_tensor(mem.tensor, tmp, n)
            else:
                if n == mem.nbytes:
                    np.copyto(mem.array, tmp)
                else:
                    _copy_prefix_array(mem.array, tmp, n)
        return done

    def _split(self, path: str, write: bool, mem: _Mem, lo: int, n: int, f: _File,
               file_off: int) -> None:
        """Run an aligned middle part, split into contiguous slices across lanes."""
        lanes = self._cfg.intra_op_parallelism
        bs = self._cfg.block_size
        unit = max(bs, f.off_align)
        if lanes == 1 or n <= unit or self._lanes is None:
            self._lane(path, write, mem, lo, n, f, file_off)
            return
        units = -(-n // unit)
        per = -(-units // lanes) * unit
        jobs = []
        start = 0
        while start < n:
            size = min(per, n - start)
            jobs.append(self._lanes.submit(self._lane, path, write, mem, lo + start, size, f,
                                           file_off + start))
            start += size
        _join(jobs)

    def _lane(self, path: str, write: bool, mem: _Mem, lo: int, n: int, f: _File,
              file_off: int) -> None:
        if path == "direct":
            with self._context() as ctx:
                self._engine(ctx, write, mem.addr + lo, n, f, file_off)
        else:
            self._bounce(write, mem, lo, n, f, file_off)

    def _engine(self, ctx: _aio.AioContext, write: bool, addr: int, n: int, f: _File,
                file_off: int) -> None:
        c = self._cfg
        call = ctx.pwrite if write else ctx.pread
        assert f.direct_fd is not None
        call(f.direct_fd, addr, file_off, n, block_size=c.block_size,
             queue_depth=min(c.queue_depth, max(1, -(-n // c.block_size))),
             single_submit=c.single_submit, overlap_events=c.overlap_events, path=f.name)

    def _bounce(self, write: bool, mem: _Mem, lo: int, n: int, f: _File,
                file_off: int) -> None:
        """Stage ``n`` aligned bytes through two pool buffers, copies overlapping I/O."""
        chunk = self._pool.buf_bytes
        pieces = [(s, min(chunk, n - s)) for s in range(0, n, chunk)]
        with self._pool.pair() as bufs, self._context() as ctx:
            pending: concurrent.futures.Future[None] | None = None
            try:
                if write:
                    for i, (s, size) in enumerate(pieces):
                        buf = bufs[i % 2]
                        self._copy_out(mem, lo + s, buf, size)   # caller memory -> pool
                        if pending is not None:
                            pending.result()
                        pending = self._io.submit(self._engine, ctx, True, buf, size, f,
                                                  file_off + s)
                    assert pending is not None
                    pending.result()
                else:
                    pending = self._io.submit(self._engine, ctx, False, bufs[0],
                                              pieces[0][1], f, file_off)
                    for i, (s, size) in enumerate(pieces):
                        current, pending = pending, None
                        assert current is not None
                        current.result()
                        if i + 1 < len(pieces):
                            s2, size2 = pieces[i + 1]
                            pending = self._io.submit(self._engine, ctx, False,
                                                      bufs[(i + 1) % 2], size2, f,
                                                      file_off + s2)
                        self._copy_in(mem, lo + s, bufs[i % 2], size)  # pool -> caller
            finally:
                if pending is not None:       # never leave the kernel writing into the pool
                    concurrent.futures.wait([pending])

    def _copy_out(self, mem: _Mem, off: int, dst: int, n: int) -> None:
        if mem.cuda:
            self._pool.host_tensor(dst, n).copy_(mem.flat_tensor()[off:off + n])
        else:
            ctypes.memmove(dst, mem.addr + off, n)

    def _copy_in(self, mem: _Mem, off: int, src: int, n: int) -> None:
        if mem.cuda:
            mem.flat_tensor()[off:off + n].copy_(self._pool.host_tensor(src, n))
        else:
            ctypes.memmove(mem.addr + off, src, n)

    def _buffered(self, write: bool, mem: _Mem, lo: int, n: int, fd: int, file_off: int,
                  name: str) -> None:
        """Plain pread/pwrite of part of the buffer, short counts continued."""
        if mem.cuda:
            host = mem.flat_tensor()[lo:lo + n].cpu() if write else None
            tmp = bytearray(n) if host is None else bytearray(host.numpy().tobytes())
            view = memoryview(tmp)
        else:
            view = _host_view(mem.addr + lo, n)
        done = 0
        while done < n:
            part = view[done:]
            if write:
                k = os.pwrite(fd, part, file_off + done)
                if k == 0:
                    raise OSError(errno.EIO, f"pwrite wrote nothing at offset "
                                  f"{file_off + done}", name)
            else:
                k = os.preadv(fd, [part], file_off + done)
                if k == 0:
                    raise ShortReadError(
                        f"read of {n} bytes at offset {file_off} from {name} reached end of "
                        f"file at offset {file_off + done}", path=name, offset=file_off,
                        nbytes=n)
            done += k
        if mem.cuda and not write:
            torch = _torch()
            mem.flat_tensor()[lo:lo + n].copy_(torch.frombuffer(tmp, dtype=torch.uint8))

    @contextmanager
    def _context(self) -> Iterator[_aio.AioContext]:
        with self._lock:
            ctx = self._contexts.pop() if self._contexts else None
        if ctx is None:
            ctx = _aio.AioContext(self._cfg.queue_depth)
            with self._lock:
                self._all_contexts.append(ctx)
        try:
            yield ctx
        finally:
            with self._lock:
                if not ctx.closed:
                    self._contexts.append(ctx)


def _join(jobs: list[concurrent.futures.Future[None]]) -> None:
    """Wait for every job, then raise the first error."""
    concurrent.futures.wait(jobs)
    for j in jobs:
        exc = j.exception()
        if exc is not None:
            raise exc


def _own(fd: int, owned: list[int]) -> int:
    owned.append(fd)
    return fd


def _reopen(fd: int, flags: int, owned: list[int]) -> int:
    """Open the file behind ``fd`` again with other flags (own offset, own O_DIRECT)."""
    flags &= ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL | os.O_APPEND)
    path = f"/proc/self/fd/{fd}"
    if flags & os.O_DIRECT:
        new = _aio.open_direct(path, write=(flags & os.O_ACCMODE) != os.O_RDONLY)
    else:
        new = os.open(path, flags | os.O_CLOEXEC)
    owned.append(new)
    return new


def _fd_mode(fd: int, name: str, write: bool) -> int:
    import fcntl
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as exc:
        raise OSError(exc.errno, f"{name} is not an open file descriptor") from None
    acc = flags & os.O_ACCMODE
    if write and acc == os.O_RDONLY:
        raise PermissionError(errno.EBADF, f"{name} is not open for writing")
    if not write and acc == os.O_WRONLY:
        raise PermissionError(errno.EBADF, f"{name} is not open for reading")
    return flags & (os.O_ACCMODE | os.O_DIRECT)


def _check_regular(fd: int, name: str) -> None:
    _check_regular_st(os.fstat(fd), name)


def _check_regular_st(st: os.stat_result, name: str) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", name)
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISBLK(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file or block device", name)


def _copy_prefix_tensor(dst: Any, src: Any, n: int) -> None:
    """Copy the first ``n`` bytes (in logical element order) of ``src`` into ``dst``."""
    k = n // dst.element_size()             # whole elements: checked by the caller
    target = dst.detach()
    flat = target.flatten()                 # a copy, since dst is not contiguous
    flat[:k] = src.reshape(-1)[:k]
    target.copy_(flat.view_as(target))


def _copy_prefix_array(dst: np.ndarray, src: np.ndarray, n: int) -> None:
    k = n // dst.itemsize
    flat = dst.reshape(-1)                  # a copy when dst is not contiguous
    flat[:k] = src.reshape(-1)[:k]
    if not np.shares_memory(flat, dst):
        np.copyto(dst, flat.reshape(dst.shape))
