"""AioHandle: tensor and buffer I/O to files through the shared kernel AIO queue.

A handle owns ``intra_op_parallelism`` lanes; each lane is one
:class:`~aioswap._aio.AioQueue` (a kernel context with ``queue_depth`` iocbs in flight
across every request of the lane), its bounce ring, and one completion thread. Every
request, sync or async, from any thread, becomes pieces in a lane's queue:

* **direct**: page-locked (``pinned.is_pinned``), aligned, contiguous host memory goes
  straight to the kernel with ``O_DIRECT``;
* **bounce**: other host memory (unpinned or misaligned) is staged through the lane's ring;
  the engine copies without the GIL, overlapped with the other buffers' I/O;
* **head/tail**: the unaligned edge blocks of any request are read (and, for writes,
  read-modify-written) through the ring with ``O_DIRECT`` as well, locked per block, so
  writes to one file never mix the page cache and ``O_DIRECT`` and neighbours never lose
  bytes; a file ends exactly where its data ends;
* **buffered**: a file system that refuses ``O_DIRECT`` is served with buffered I/O, with one
  :class:`~aioswap.errors.DirectIOFallbackWarning` per handle.

Non-contiguous tensors and arrays (and conjugate/negative views) are staged through a
contiguous copy; CUDA tensors through the ring in block-sized chunks.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import errno
import fcntl
import logging
import operator
import os
import queue
import threading
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Literal, overload

from aioswap import _aio, _bounce, _files, pinned
from aioswap._buffers import Buffer, resolve
from aioswap._files import AioFile, FileArg, PathLike, describe
from aioswap._future import ENGINE as _FUTURES
from aioswap._future import IOFuture
from aioswap._staging import stage
from aioswap._util import flat_bytes
from aioswap.config import AioConfig, runtime_settings
from aioswap.errors import DirectIOFallbackWarning, HandleClosedError, ShortReadError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import torch
    from typing_extensions import Self

    from aioswap.stripe import StripedFile     # types only: stripe imports this module

__all__ = ["AioFile", "AioHandle", "DeviceTransport", "HandleStats", "IOFuture",
           "shared_handle"]

_log = logging.getLogger("aioswap")

_MAX_FILES = 64             # files a handle keeps open for path and fd arguments

#: What :meth:`AioHandle.open` calls for a list of paths: :func:`aioswap.stripe.open_striped`,
#: handed in by :mod:`aioswap.stripe` when it is imported (the package imports it), so that
#: this module stays below the one that builds on it.
_striped_opener: Callable[..., StripedFile] | None = None


def set_striped_opener(opener: Callable[..., StripedFile]) -> None:
    """Make ``opener`` (the signature of :func:`aioswap.stripe.open_striped`) what
    :meth:`AioHandle.open` calls for a list or tuple of paths."""
    global _striped_opener
    _striped_opener = opener


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


class _Request:
    """One validated request, built once and passed down."""

    __slots__ = ("arg", "file", "fsync", "mem", "nbytes", "offset", "write")

    def __init__(self, write: bool, mem: Buffer, file: AioFile, offset: int, nbytes: int,
                 fsync: bool, arg: FileArg) -> None:
        self.write = write
        self.mem = mem
        self.file = file
        self.offset = offset
        self.nbytes = nbytes
        self.fsync = fsync
        self.arg = arg              # what the caller passed as ``file`` (for the future)

    @property
    def op(self) -> str:
        return "write" if self.write else "read"


class _Queued:
    """A one-slice request in a lane's queue: what finishing it needs."""

    __slots__ = ("hold", "lane", "req", "rq")

    def __init__(self, req: _Request, lane: _Lane, rq: _aio.Request,
                 hold: object | None) -> None:
        self.req = req
        self.lane = lane
        self.rq = rq
        self.hold = hold


# a sync short-path request in a batch (see _aio.short)
_ShortQueued = _aio.ShortQueued


class DeviceTransport:
    """What moves contiguous device memory for a handle (the seam ``GdsHandle`` uses).

    ``transfer(write, address, nbytes, file, offset)`` moves ``nbytes`` between device
    memory at ``address`` and the :class:`AioFile` ``file`` (counted in use for the call) at
    ``offset`` and returns ``(bytes moved, path)`` with path ``"direct"`` or ``"bounce"``
    (for :class:`HandleStats`); it raises on errors. What a transport registers per file
    (cuFile's file handle) lives with the file: :meth:`AioFile.device_handle`.
    """

    def transfer(self, write: bool, address: int, nbytes: int, file: AioFile,
                 offset: int) -> tuple[int, str]:
        raise NotImplementedError


class _Lane:
    """One kernel queue, its ring and its completion thread."""

    def __init__(self, cfg: AioConfig, ring_cap: int | None, index: int,
                 backend: str) -> None:
        self.queue = _aio.AioQueue(cfg.queue_depth, single_submit=cfg.single_submit,
                                   overlap_events=cfg.overlap_events, backend=backend,
                                   registry=pinned.registry)
        buf, n = _bounce.ring_shape(cfg.block_size, cfg.queue_depth, ring_cap)
        self.ring = _bounce.Ring(self.queue, buf, n)
        self.index = index
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        """Start the completion thread (on the first asynchronous request)."""
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    t = threading.Thread(target=self._serve, daemon=True,
                                         name=f"aioswap-lane{self.index}")
                    t.start()
                    self.thread = t

    def _serve(self) -> None:
        serve = self.queue.serve
        while True:
            batch = serve()
            if batch is None:
                return
            _aio.deliver(batch)
            # nothing of a finished batch stays referenced while this thread waits for the
            # next one: a dropped handle or buffer is freed now, not after the next request
            del batch

    def close(self) -> None:
        self.queue.shutdown()
        if self.thread is not None:
            self.thread.join()
        self.queue.close()
        self.ring.close()


class _Stager:
    """One thread for the asynchronous requests the queue cannot take as they are (strided,
    conjugate or negative views, CUDA memory, empty requests with fsync): their copies and
    their I/O run there, so ``async_op=True`` never blocks the caller; started on first use.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, job: Any) -> None:
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    t = threading.Thread(target=self._run, daemon=True, name="aioswap-stage")
                    t.start()
                    self.thread = t
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException:       # never let one job stop the others
                _log.exception("aioswap: a staged request failed")
            del job

    def current(self) -> bool:
        return self.thread is threading.current_thread()

    def close(self) -> None:
        """Let the thread end (after the jobs queued before); joined unless it is this one."""
        with self.lock:
            t, self.thread = self.thread, None
        if t is None:
            return
        self.jobs.put(None)
        if t is not threading.current_thread():
            t.join()


class _Async:
    """The bookkeeping of one asynchronous request (the token its pieces come back with)."""

    __slots__ = ("done", "errors", "fut", "handle", "lock", "outcome", "parts", "post", "req")

    def __init__(self, handle: AioHandle, req: _Request, fut: IOFuture, parts: int,
                 post: Any) -> None:
        self.handle = handle
        self.req = req
        self.fut = fut
        self.parts = parts
        self.done = 0
        self.errors: list[BaseException] = []
        self.post = post
        self.lock = threading.Lock() if parts > 1 else None
        self.outcome: _aio.Ticket | None = None

    def part_done(self, rq: _aio.Request) -> None:
        done = rq.done
        exc = self.handle._slice_error(self.req, rq)
        if self.lock is not None:
            with self.lock:
                self.done += done
                if exc is not None:
                    self.errors.append(exc)
                self.parts -= 1
                if self.parts:
                    return
        else:
            self.done = done
            if exc is not None:
                self.errors.append(exc)
        self.handle._finish_async(self)


class AioHandle:
    """Reads and writes tensors and buffers to files with kernel AIO (or io_uring).

    Parameters
    ----------
    block_size : int
        Bytes per AIO request (iocb); any positive size (rounded down to each file's
        ``O_DIRECT`` alignment internally, at least one aligned block). Default 1 MiB.
    queue_depth : int
        Most iocbs in flight per lane, across all requests of the handle. Default 32.

    Knobs left out (None) come from the ``AIOSWAP_*`` environment variables, else from
    :data:`aioswap.config.DEFAULT_CONFIG`; ``AIOSWAP_BUFFERED=1`` serves every file with
    buffered I/O and ``AIOSWAP_POOL_SIZE`` sets ``bounce_bytes``.
    single_submit : bool
        Submit one iocb per ``io_submit`` call instead of batches.
    overlap_events : bool
        Sliding window (top up after each completion) instead of submit-batch-reap-batch.
    intra_op_parallelism : int
        Lanes (kernel contexts) a large request is split across in contiguous slices.
    bounce_bytes : int, optional
        Most bytes of one lane's bounce ring; default ``min(2 * queue_depth * block_size,
        64 MiB)`` (buffers of ``block_size`` rounded up to pages; at least one).
    device_transport : DeviceTransport, optional
        What moves contiguous CUDA tensors (``GdsHandle`` passes cuFile); without one they
        are staged through the bounce ring.
    backend : {"auto", "io_uring", "aio", "threads"}, optional
        The kernel interface (default ``AIOSWAP_BACKEND``, else "auto"): see :attr:`backend`.

    Notes
    -----
    Alignment: ``O_DIRECT`` memory and offset alignment come from ``statx`` per file
    (fallback 4096). Requests may have any size and offset.

    Lifetime: a buffer passed to an asynchronous request is referenced by the handle until
    the request finishes; do not modify (writes) or read (reads) it before the future is
    done. A sync call returns or raises only after the kernel is done with its memory, also
    when a signal handler raises (KeyboardInterrupt): the request is cancelled and what is
    in flight is drained first.

    Thread safety: any number of threads may submit requests on one handle. A handle cannot
    be used in a child process after ``fork()``; make a new one there.
    """

    def __init__(self, block_size: int | None = None, queue_depth: int | None = None,
                 single_submit: bool | None = None, overlap_events: bool | None = None,
                 intra_op_parallelism: int | None = None,
                 *, bounce_bytes: int | None = None,
                 device_transport: DeviceTransport | None = None,
                 backend: str | None = None) -> None:
        self._device_transport = device_transport
        env = runtime_settings()        # AIOSWAP_* variables for what is not given
        d = env.aio
        cfg = AioConfig(
            block_size=d.block_size if block_size is None else block_size,
            queue_depth=d.queue_depth if queue_depth is None else queue_depth,
            single_submit=d.single_submit if single_submit is None else single_submit,
            overlap_events=d.overlap_events if overlap_events is None else overlap_events,
            intra_op_parallelism=(d.intra_op_parallelism if intra_op_parallelism is None
                                  else intra_op_parallelism))
        self._buffered_only = env.buffered
        backend = env.backend if backend is None else backend
        if bounce_bytes is None:
            bounce_bytes = env.pool_size
        if bounce_bytes is not None:
            bounce_bytes = operator.index(bounce_bytes)
            if bounce_bytes <= 0:
                raise ValueError(f"bounce_bytes must be positive, got {bounce_bytes}")
        self._cfg = cfg
        self._pid = os.getpid()
        self._generation = _aio.fork_generation()
        self._warned_buffered = False
        self._stager = _Stager()
        self._opens = 0
        self._file_uses: dict[AioFile, tuple[int, float]] = {}     # see _sweep_files
        lanes: list[_Lane] = []
        try:
            for i in range(cfg.intra_op_parallelism):
                lanes.append(_Lane(cfg, bounce_bytes, i, backend))
        except BaseException:
            for lane in lanes:
                lane.close()
            raise
        # the state every request shares (lanes, open files, the ledger of asynchronous
        # requests, statistics, closed and active counts): C fields of the engine's Core
        self._core = _aio.Core(lanes, cfg.block_size, pinned.registry, _FUTURES, _GENERAL)
        self._lock = self._core.lock

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
    def _closed(self) -> bool:
        return bool(self._core.closed)

    @_closed.setter
    def _closed(self, value: bool) -> None:
        self._core.closed = value

    @property
    def _lanes(self) -> list[_Lane]:
        return self._core.lanes

    @property
    def config(self) -> AioConfig:
        return self._cfg

    @property
    def backend(self) -> str:
        """The kernel interface the lanes run on: ``"io_uring"``, ``"aio"`` or ``"threads"``.

        ``backend="auto"`` (the default, or ``AIOSWAP_BACKEND``) is io_uring, else kernel
        AIO (io_uring refused: ``kernel.io_uring_disabled``, a seccomp profile), else worker
        threads doing ``pread``/``pwrite`` (``aio-max-nr`` exhausted too);
        :attr:`backend_reason` says why.
        """
        return str(self._lanes[0].queue.backend)

    @property
    def backend_reason(self) -> str:
        """Why :attr:`backend` is what it is ("" for kernel AIO chosen by "auto", "asked for"
        when named)."""
        return str(self._lanes[0].queue.why)

    @property
    def bounce_pool_bytes(self) -> int:
        """Bytes of the bounce rings of all lanes (allocated on first use)."""
        return sum(lane.ring.nbytes for lane in self._lanes)

    @property
    def stats(self) -> HandleStats:
        """A snapshot of the bytes moved by each path."""
        return HandleStats(*self._core.counters())

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
        """Give up a tensor from :meth:`new_cpu_locked_tensor` (see ``pinned.free``).

        The memory goes when its last reference (the tensor and every view) goes; the call
        is refused (BufferError) while requests of any handle use the memory.
        """
        pinned.free(tensor)

    def is_pinned(self, buffer: Any) -> bool:
        """Whether ``buffer``'s whole extent is page-locked (see ``pinned.is_pinned``)."""
        return pinned.is_pinned(buffer)

    # -- files -----------------------------------------------------------------------------
    @overload
    def open(self, path: PathLike, mode: str = ..., *, perm: int = ...,
             stripe: None = ..., follow_symlinks: bool = ...) -> AioFile: ...

    @overload
    def open(self, path: list[PathLike] | tuple[PathLike, ...], mode: str = ..., *,
             perm: int = ..., stripe: int | None = ...,
             follow_symlinks: bool = ...) -> StripedFile: ...

    def open(self, path: Any, mode: str = "r", *, perm: int = _files.DEFAULT_FILE_MODE,
             stripe: int | None = None, follow_symlinks: bool = True) -> AioFile | StripedFile:
        """Open ``path`` once for many requests.

        A list or tuple of paths (one part file per drive) opens one striped file over
        them: :func:`aioswap.stripe.open_striped` (``stripe``: bytes per stripe unit).

        Parameters
        ----------
        path : str or path-like
        mode : {"r", "r+", "w", "w+", "x", "a+"}
            ``"r"`` read-only; ``"r+"`` read/write, must exist; ``"w"``/``"w+"`` create or
            truncate; ``"x"`` create, must not exist; ``"a+"`` create if missing, keep the
            contents (writes are still positional).
        perm : int
            Mode bits of a created file; default 0o600 (private).
        follow_symlinks : bool
            False: a symbolic link at ``path`` (at each part, for a striped file) is refused
            (``O_NOFOLLOW``), never followed.

        Returns
        -------
        AioFile or StripedFile
            A context manager with ``pread``/``pwrite``/``fsync``/``fileno``/``close``;
            ``open``/``fstat``/``statx`` are paid once.
        """
        if isinstance(path, (list, tuple)):
            if _striped_opener is None:
                raise RuntimeError("striped files need aioswap.stripe, which is not imported")
            return _striped_opener(self, path, mode, stripe=stripe, perm=perm,
                                   follow_symlinks=follow_symlinks)
        self._check(f"open of {describe(path)}")
        return _files.open_path(self, path, mode, perm=perm, on_buffered=self._buffered_warn,
                                direct=not self._buffered_only,
                                follow_symlinks=follow_symlinks, core=self._core)

    def adopt(self, fd: int, *, name: str | None = None) -> AioFile:
        """Take over ``fd``, a regular file or block device the caller opened (with flags of
        its choosing: ``O_NOFOLLOW``, ``O_EXCL``, ``O_TMPFILE``, a directory fd), as an
        :class:`AioFile` with the same access mode.

        The file keeps a descriptor of its own (``O_DIRECT`` where the file system allows
        it; a write-only fd is reopened read/write where permissions allow, for the edge
        blocks of unaligned writes) and ``fd`` is closed on return. On an exception ``fd``
        stays the caller's, open. Requests on the result take the handle's short path: no
        ``fcntl``/``fstat`` per request, as an fd argument pays.

        Parameters
        ----------
        fd : int
            An open descriptor; not ``O_APPEND`` when it is writable.
        name : str, optional
            How errors name the file (default: its path, quoted).

        Raises
        ------
        OSError, PermissionError, ValueError
            ``fd`` is not open, is a FIFO, socket or directory, or is ``O_APPEND``.
        HandleClosedError
            The handle is closed.
        """
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"adopt takes an int fd, got {type(fd).__name__}")
        self._check(f"adopt of fd {fd}")
        try:
            acc = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        except (OSError, ValueError) as exc:
            raise OSError(getattr(exc, "errno", None) or errno.EBADF,
                          f"fd {fd} is not an open file descriptor") from None
        f = _files.open_fd(self, fd, acc != os.O_RDONLY, on_buffered=self._buffered_warn,
                           direct=not self._buffered_only, core=self._core)
        if name is not None:
            f.name = name
        os.close(fd)
        return f

    # -- requests --------------------------------------------------------------------------
    @overload
    def pread(self, buffer: Any, file: FileArg, offset: int = ..., *,
              nbytes: int | None = ..., async_op: Literal[False] = ...) -> int: ...

    @overload
    def pread(self, buffer: Any, file: FileArg, offset: int = ..., *,
              nbytes: int | None = ..., async_op: Literal[True]) -> IOFuture: ...

    @overload
    def pread(self, buffer: Any, file: FileArg, offset: int = ..., *,
              nbytes: int | None = ..., async_op: bool = ...) -> int | IOFuture: ...

    def pread(self, buffer: Any, file: FileArg, offset: int = 0, *,
              nbytes: int | None = None, async_op: bool = False) -> int | IOFuture:
        """Read ``nbytes`` (default: the buffer's size) from ``file`` at ``offset``.

        Parameters
        ----------
        buffer : torch.Tensor, numpy.ndarray or writable buffer
            Destination; CPU or CUDA tensors of any dtype, contiguous or not.
        file : path, int or AioFile
            A path, an open fd (its access mode is respected; the caller may close it while
            an asynchronous request is queued) or a file from :meth:`open`.
        offset : int
            File offset in bytes, any integer >= 0.
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
            The file cannot be read (FIFOs and sockets are refused).
        ValueError, TypeError, BufferError
            Negative or non-integer offset, read-only buffer, ``nbytes`` beyond the buffer.
        HandleClosedError
            The handle is closed.
        """
        return self._core.request(self, False, buffer, file, offset, nbytes, async_op, False)

    @overload
    def pwrite(self, buffer: Any, file: FileArg, offset: int = ..., *,
               nbytes: int | None = ..., async_op: Literal[False] = ...,
               fsync: bool = ...) -> int: ...

    @overload
    def pwrite(self, buffer: Any, file: FileArg, offset: int = ..., *,
               nbytes: int | None = ..., async_op: Literal[True],
               fsync: bool = ...) -> IOFuture: ...

    @overload
    def pwrite(self, buffer: Any, file: FileArg, offset: int = ..., *,
               nbytes: int | None = ..., async_op: bool = ...,
               fsync: bool = ...) -> int | IOFuture: ...

    def pwrite(self, buffer: Any, file: FileArg, offset: int = 0, *,
               nbytes: int | None = None, async_op: bool = False,
               fsync: bool = False) -> int | IOFuture:
        """Write ``nbytes`` (default: the whole buffer) to ``file`` at ``offset``.

        A path is created if missing (mode 0600) and never truncated: bytes past the request
        stay as they were. ``fsync=True`` makes data and size durable before the request
        completes. Fds opened with ``O_APPEND`` are refused. Same parameters, returns and
        errors as :meth:`pread`.
        """
        return self._core.request(self, True, buffer, file, offset, nbytes, async_op, fsync)

    def pread_many(self, requests: Iterable[Sequence[Any]], *,
                   async_op: bool = False) -> list[int] | list[IOFuture]:
        """Submit many reads at once: ``[(buffer, file, offset), ...]``.

        All requests are queued before the first is waited for, so they share the kernel
        queue. Returns the bytes read per request (after all finished; the first error is
        raised after every request finished), or their futures with ``async_op=True``.
        """
        return self._many(False, requests, async_op)

    def pwrite_many(self, requests: Iterable[Sequence[Any]], *,
                    async_op: bool = False) -> list[int] | list[IOFuture]:
        """Submit many writes at once: ``[(buffer, file, offset), ...]`` (see
        :meth:`pread_many`)."""
        return self._many(True, requests, async_op)

    def _many(self, write: bool, requests: Iterable[Sequence[Any]],
              async_op: bool) -> list[int] | list[IOFuture]:
        if async_op:
            futs: list[IOFuture] = []
            try:
                self._core.many_async(self, write, requests, futs)
            except BaseException:
                concurrent.futures.wait(futs)
                self._core.forget(futs)
                raise
            return futs
        # sync: every request is queued before the first is waited for; no futures, no
        # completion thread (each is reaped by this thread)
        queued: list[_Queued | _ShortQueued | _Request] = []
        # every request queued, recorded by the queue itself: a signal handler can raise
        # between a submission and the append to `queued`
        subs: list[_aio.Request] = []
        try:
            self._core.many_queue(self, write, requests, queued, subs)
        except Exception:
            # a bad item: what was queued before it is valid and runs to the end
            self._abandon(queued, cancel=False)
            raise
        except BaseException:
            self._abandon(queued)               # a signal: stop as soon as possible
            # one submitted but not in `queued` yet: nothing may write its memory after
            # this raises (its file stays counted as in use: a signal's narrow window)
            known = {id(q.rq) for q in queued if not isinstance(q, _Request)}
            _drain([rq for rq in subs if id(rq) not in known])
            raise
        out, first = self._core.many_finish(self, queued)
        if first is not None:
            raise first
        return out

    @staticmethod
    def _many_unpack(item: Sequence[Any]) -> tuple[Any, Any, Any]:
        """``(buffer, file[, offset])`` of one batch item (a tuple of 2 or 3 is unpacked in C)."""
        buf, file, *rest = item
        return buf, file, rest[0] if rest else 0

    def _many_slow(self, write: bool, buf: Any, file: FileArg, offset: Any,
                   subs: list[_aio.Request]) -> _Queued | _Request:
        """A batch item the short path does not take: queued now when it is one slice,
        else validated and run in turn by :meth:`_many_finish_slow`."""
        req = self._prepare(write, buf, file, offset, None, False)
        if not self._is_one(req):
            return req
        try:
            return self._queue_one(req, True, None, subs)
        except BaseException:
            self._release(req)
            raise

    def _many_finish_slow(self, q: _Queued | _Request) -> int:
        """Finish (or run) a batch item from :meth:`_many_slow`; its bytes moved."""
        req = q.req if isinstance(q, _Queued) else q
        try:
            return self._finish_one(q) if isinstance(q, _Queued) else self._run_sync(q)
        finally:
            self._release(req)

    def _abandon(self, queued: Sequence[_Queued | _ShortQueued | _Request],
                 cancel: bool = True) -> None:
        """Cancel (unless not ``cancel``) and drain queued requests (an error or a signal
        stops a batch); requests not queued yet are dropped."""
        for q in queued:
            if cancel and not isinstance(q, _Request):
                q.rq.cancel()
        for q in queued:
            if isinstance(q, _ShortQueued):
                try:
                    self._short_finish(q, drain=True)
                except Exception:
                    pass
            elif isinstance(q, _Queued):
                try:
                    self._finish_one(q, drain=True)
                except Exception:
                    pass
                self._release(q.req)
            else:
                self._release(q)

    def wait(self) -> int:
        """Finish every outstanding asynchronous request; return how many there were.

        Returns 0 when none were pending. Every request pending when ``wait`` was called
        runs to the end; then the first error (in submission order) is raised. An
        interrupted wait (KeyboardInterrupt) leaves them pending for the next ``wait``.
        """
        if self._generation != _aio.fork_generation():
            self._check("wait()")               # a forked child: nothing completes here
        own = (any(lane.thread is threading.current_thread() for lane in self._lanes)
               or self._stager.current())
        return self._core.wait(own)

    def close(self) -> None:
        """Refuse new requests, finish those in flight, then free lanes, threads and rings.

        Idempotent. Errors of unfinished asynchronous requests stay in their futures.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._generation != _aio.fork_generation() or self._pid != os.getpid():
                return              # a forked child: the parent's lanes and requests
            if (any(lane.thread is threading.current_thread() for lane in self._lanes)
                    or self._stager.current()):
                # from a completion (a future's callback, or the handle's last reference
                # dropped there): this thread still has requests to finish, so another one
                # waits for them and frees the lanes
                threading.Thread(target=self._close_lanes, daemon=True,
                                 name="aioswap-close").start()
                return
        self._close_lanes()

    def _close_lanes(self) -> None:
        """Wait until no request is active, then free the lanes (threads, contexts, rings)."""
        with self._lock:
            while self._core.active:
                self._core.idle.wait(0.01)     # (a wake a signal handler cut short)
            files = list(self._core.files.values())
            self._core.files.clear()
        _files.sweeper.forget(self)
        for f in files:
            f.close()
        for lane in self._lanes:
            lane.close()
        self._stager.close()

    def __enter__(self) -> Self:
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
    def _check(self, what: str) -> None:
        if self._closed:
            raise HandleClosedError(f"{what} on a closed AioHandle")
        if self._generation != _aio.fork_generation() or self._pid != os.getpid():
            raise RuntimeError(f"{what}: this AioHandle was created in process {self._pid} "
                               f"and cannot be used after fork(); create a new AioHandle in "
                               f"the child")

    def _buffered_warn(self, name: str) -> None:
        if not self._warned_buffered:
            self._warned_buffered = True
            warnings.warn(f"the file system of {name} refuses O_DIRECT; this handle uses "
                          f"buffered I/O for such files", DirectIOFallbackWarning,
                          stacklevel=5)

    def _request(self, write: bool, buffer: Any, file: FileArg, offset: Any,
                 nbytes: Any, async_op: bool, fsync: bool) -> int | IOFuture:
        """The general path of a request (:func:`_aio.request` tries the short one)."""
        req = self._prepare(write, buffer, file, offset, nbytes, fsync)
        if async_op:
            return self._start_async(req)
        try:
            return self._run_sync(req)
        finally:
            self._release(req)

    def _short_file(self, file: FileArg, write: bool) -> AioFile | None:
        """The file a short-path request runs on: an AioFile as it is, the handle's own
        file behind a path or fd; None where the general path decides (and raises)."""
        tf = type(file)
        if tf is AioFile:
            return file                         # type: ignore[return-value]
        if self._closed or self._generation != _aio.fork_generation():
            return None
        if tf is int or tf is str or tf is bytes or isinstance(file, os.PathLike):
            return self._cached(file, write)    # type: ignore[arg-type]
        return None

    def _short_finish(self, q: _aio.ShortQueued, drain: bool = False) -> int:
        """Reap a queued request of the compiled path (``drain``: without looking at
        signals)."""
        return self._core.short_finish(q, drain)

    def _error(self, write: bool, f: AioFile, offset: int, n: int, done: int, err: int,
               eoff: int, en: int) -> BaseException:
        """The exception of a failed request (an errno, or else the end of the file)."""
        return _aio.failure(f.name, write, offset, n, done, err, eoff, en)

    def _prepare(self, write: bool, buffer: Any, file: FileArg, offset: Any, nbytes: Any,
                 fsync: bool) -> _Request:
        """Validate a request and open its file; it counts as active until released."""
        op = "write" if write else "read"
        if self._closed or self._generation != _aio.fork_generation():
            self._check(f"{op} of {describe(file)}")
        if type(offset) is not int:
            offset = _integer(offset, "offset", file)
        if offset < 0:
            raise ValueError(f"negative file offset {offset} for {describe(file)}")
        mem = resolve(buffer)
        n = mem.nbytes if nbytes is None else _integer(nbytes, "nbytes", file)
        if n < 0:
            raise ValueError(f"negative nbytes {n} for {describe(file)}")
        if n > mem.nbytes:
            raise ValueError(f"{op} of {n} bytes at offset {offset} of {describe(file)}: the "
                             f"buffer holds only {mem.nbytes} bytes")
        if not write:
            if not mem.writable:
                raise ValueError(f"read of {n} bytes from {describe(file)} into a read-only "
                                 f"buffer ({type(buffer).__name__})")
            if not mem.contiguous and n % mem.itemsize:
                raise ValueError(f"read of {n} bytes from {describe(file)} into a "
                                 f"non-contiguous buffer must cover whole elements of "
                                 f"{mem.itemsize} bytes")
        f = self._file(file, write) if type(file) is not AioFile or file.closed else file
        if f is file and not (f.writable if write else f.readable):
            f = self._file(file, write)         # raises the access error
        try:
            if not write and n and offset + n > (size := f.size()):
                raise ShortReadError(
                    f"read of {n} bytes at offset {offset} from {f.name} goes past the end "
                    f"of the file ({size} bytes)", path=f.name, offset=offset, nbytes=n,
                    file_size=size)
            req = _Request(write, mem, f, offset, n, fsync, file)
            with self._lock:
                if not self._core.enter():
                    raise HandleClosedError(f"{op} of {describe(file)} on a closed AioHandle")
        except BaseException:
            if f is not file:
                f.unuse()                       # unpinned (see _cached)
            raise
        return req

    def _file(self, file: FileArg, write: bool) -> AioFile:
        if isinstance(file, AioFile):
            if file.closed:
                raise ValueError(f"I/O on closed file {file.name}")
            if write and not file.writable:
                raise PermissionError(f"{file.name} is not open for writing")
            if not write and not file.readable:
                raise PermissionError(f"{file.name} is not open for reading")
            return file
        if isinstance(file, bool) or (not isinstance(file, int) and hasattr(file, "__index__")
                                      and not isinstance(file, (str, bytes))):
            raise TypeError(f"file must be a path, an fd or an AioFile, got "
                            f"{type(file).__name__}")
        return self._cached(file, write)

    def _cached(self, file: int | PathLike, write: bool) -> AioFile:
        """The handle's own open file behind a path or fd argument.

        One ``stat`` (path) or ``fcntl`` + ``fstat`` (fd) per request says which file it is
        now (device, inode) and whether the caller's fd allows the request; the handle keeps
        one descriptor per file (``O_DIRECT`` where allowed, the last :data:`_MAX_FILES`
        used), so a file replaced by rename, a truncated file or an fd number reused for
        another file is seen, and the caller may close its fd at any time. The file comes
        back pinned (counted as in use, so neither an eviction nor ``close()`` closes its
        descriptor under the request); the request's end unpins it (``unuse``).
        """
        f: AioFile | None = self._core.cached_hit(file, write)     # one C call, usually
        if f is not None:
            return f
        # not open yet, or unusual: asked again the slow way, which raises the errors
        checked = None
        if isinstance(file, int):
            checked = _files.check_fd(file, write)
        else:
            try:
                st = os.stat(file)
            except FileNotFoundError:
                if not write:
                    raise
                st = None                       # a write creates it
            if st is not None:
                _files.check_kind(st, describe(file))
        files = self._core.files
        if isinstance(file, int):
            f = _files.open_fd(self, file, write, on_buffered=self._buffered_warn,
                               direct=not self._buffered_only,
                               checked=checked, core=self._core)
        else:
            f = _files.open_path(self, file, "a+" if write else "r",
                                 on_buffered=self._buffered_warn,
                                 direct=not self._buffered_only, core=self._core)
        # files deleted or replaced since (unlinked) are let go, so their space is freed: looked
        # for at every 8th open (an fstat per kept file), so a working set of more files than
        # are kept does not pay that scan per request
        with self._lock:
            self._opens += 1
            kept = list(files.values()) if self._opens % 8 == 0 or len(files) <= 8 else []
        gone = {k.key for k in kept if _files.deleted(k)}
        evicted: list[AioFile] = []
        with self._lock:
            closed = self._closed
            if not closed:
                won = files.get(f.key)
                if (won is not None and not won.closed and won.key not in gone
                        and (won.writable or not write)):
                    evicted.append(f)           # another thread opened it first: use that
                    f = won
                else:
                    for key in gone | {f.key}:
                        old = files.pop(key, None)
                        if old is not None:
                            evicted.append(old)
                    files[f.key] = f
                    while len(files) > _MAX_FILES:
                        evicted.append(files.popitem(last=False)[1])
                    _files.sweeper.watch(self._sweep_files)
                f.use()                         # pinned: unpinned by the request's end
        for e in evicted:
            e.close()                           # after the requests in flight on it
        if closed:
            f.close()
            raise HandleClosedError(f"I/O on {describe(file)} on a closed AioHandle")
        return f

    def _sweep_files(self, now: float) -> bool:
        """Close the descriptors kept for path and fd arguments whose file was deleted, or
        that no request used for :data:`aioswap._files.IDLE_CLOSE_S` seconds (called about
        once a second by :data:`aioswap._files.sweeper`); whether any is still kept."""
        with self._lock:
            if self._closed:
                return False
            kept = list(self._core.files.items())
        seen = self._file_uses
        drop = []
        for key, f in kept:
            uses = f.uses
            last = seen.get(f)
            if last is None or last[0] != uses:
                seen[f] = (uses, now)
                last = seen[f]
            if not f.busy and (now - last[1] >= _files.IDLE_CLOSE_S or _files.deleted(f)):
                drop.append((key, f))
        closing = []
        with self._lock:
            for key, f in drop:
                if self._core.files.get(key) is f and not f.busy:
                    del self._core.files[key]
                    closing.append(f)
            left = bool(self._core.files)
            live = set(self._core.files.values())
        for f in list(seen):
            if f not in live:
                del seen[f]
        for f in closing:
            f.close()
        return left

    def close_files(self) -> int:
        """Close the descriptors the handle keeps for path and fd arguments (each once the
        requests in flight on it are finished); returns how many. A later request on such a
        path or fd opens the file again. The handle also closes one by itself when its file
        is deleted, or after :data:`aioswap._files.IDLE_CLOSE_S` seconds unused."""
        with self._lock:
            files = list(self._core.files.values())
            self._core.files.clear()
        for f in files:
            f.close()
        return len(files)

    def _release(self, req: _Request) -> None:
        """A request is over: give back its file and let close() go on."""
        if req.file is not req.arg:
            req.file.unuse()                    # unpinned (see _cached)
        self._core.leave()

    # -- planning --------------------------------------------------------------------------
    def _block(self, f: AioFile) -> int:
        """Piece size on ``f``: the block size rounded down to its alignment (at least one)."""
        return self._core.piece(f)

    def _slices(self, req: _Request) -> list[tuple[int, int]]:
        """``(start, nbytes)`` of the lanes' contiguous slices of a request."""
        k = len(self._lanes)
        if k == 1:
            return [(0, req.nbytes)]
        n, block = req.nbytes, self._block(req.file)
        if n < 2 * block:
            return [(0, n)]
        # cut at file offsets that are multiples of the block: no slice boundary is an edge
        per = -(-n // k)
        cuts = [0]
        for i in range(1, k):
            c = -(-(req.offset + i * per) // block) * block - req.offset
            if cuts[-1] < c < n:
                cuts.append(c)
        cuts.append(n)
        return list(zip(cuts, (b - a for a, b in zip(cuts, cuts[1:]))))

    def _mode(self, req: _Request, held: bool = False) -> tuple[int, int, int]:
        """How the pieces of a contiguous host request run (see ``_aio.plan``). ``held``: the
        memory is known to be pinned (a registry hold is out)."""
        return self._core.plan(req.file, req.mem.address, req.nbytes,
                               req.offset, True if held else None)

    def _count_paths(self, mode: int, edges: int, middle: int) -> None:
        """Bytes per path into the stats."""
        self._core.count_paths(mode, edges, middle)

    def _count_outcome(self, write: bool, done: int, failed: bool) -> None:
        """A finished request into the stats."""
        self._core.count_outcome(write, done, failed)

    def _submit_parts(self, req: _Request, slices: list[tuple[int, int]], sync: bool,
                      token: Any) -> list[_aio.Request]:
        """Queue the slices of a contiguous host request on the lanes (holding the file).

        On an error part-way, what was queued stays queued (sync callers drain it) and the
        error propagates.
        """
        f, mem = req.file, req.mem
        mode, edges, middle = self._mode(req)
        block = self._block(f)
        fsync = req.fsync and len(slices) == 1
        if len(slices) == 1:
            lanes = [self._core.next_lane()]
        else:
            lanes = self._lanes
        submitted: list[_aio.Request] = []
        fd = f.use()
        try:
            for lane, (start, nbytes) in zip(lanes, slices):
                if mode == _aio.MODE_BOUNCE or edges:     # direct and aligned: no ring
                    lane.ring.ensure()
                if not sync:
                    lane.start()
                # appended by submit itself: a signal handler may raise the moment it returns
                lane.queue.submit(fd, req.write, mem.address + start, nbytes,
                                  req.offset + start, mode, f.off_align, block, f.state, fsync,
                                  sync, token, f.name, mem.owner, submitted)
        except BaseException as exc:
            exc.__aioswap_submitted__ = submitted      # type: ignore[attr-defined]
            if not submitted:
                f.unuse()
            raise
        finally:
            if submitted:
                with self._lock:
                    self._count_paths(mode, edges, middle)
        return submitted

    # -- sync ------------------------------------------------------------------------------
    def _run_sync(self, req: _Request) -> int:
        if self._is_one(req):
            return self._run_one(req)       # counts itself
        try:
            done = self._execute_sync(req)
        except BaseException:
            with self._lock:
                self._count_outcome(req.write, 0, True)
            raise
        with self._lock:
            self._count_outcome(req.write, done, False)
        return done

    def _execute_sync(self, req: _Request) -> int:
        mem, n = req.mem, req.nbytes
        if n == 0:
            if req.fsync:
                os.fsync(req.file.fileno())
            return 0
        if not mem.contiguous:
            return self._staged(req)
        if mem.device == "cuda":
            if self._device_transport is not None:
                req.file.use()
                try:
                    done, path = self._device_transport.transfer(
                        req.write, mem.address, n, req.file, req.offset)
                finally:
                    req.file.unuse()
                self._core.count_path(path, done)
                if req.fsync:
                    os.fsync(req.file.fileno())
                return done
            return self._cuda(req)
        slices = self._slices(req)
        hold = pinned.registry.hold(mem.address, n)
        try:
            subs = self._submit_parts(req, slices, True, None)
        except BaseException as exc:
            queued = getattr(exc, "__aioswap_submitted__", [])
            _drain(queued)
            if queued:
                req.file.unuse()
            if hold is not None:
                pinned.registry.unhold(hold)
            raise
        waited = 0
        try:
            for rq in subs:
                rq.wait(False)                  # errors are gathered below
                waited += 1
        except BaseException:
            # a signal handler raised in wait(), which drained its own slice: cancel and
            # drain the others before unwinding, so nothing writes the caller's memory later
            _drain(subs[waited + 1:])
            raise
        finally:
            req.file.unuse()
            if hold is not None:
                pinned.registry.unhold(hold)
        done = 0
        first: BaseException | None = None
        for rq in subs:
            done += rq.done
            err = self._slice_error(req, rq)
            if err is not None and first is None:
                first = err
        if first is not None:
            raise first
        if req.fsync and len(subs) > 1:
            os.fsync(req.file.fileno())
        return done

    def _is_one(self, req: _Request) -> bool:
        """Whether a request runs as one queued piece list (contiguous host memory, one
        slice): the hot path of small requests."""
        mem = req.mem
        return (req.nbytes > 0 and mem.contiguous and mem.device == "cpu"
                and len(self._slices(req)) == 1)

    def _take_lane(self, req: _Request, sync: bool) -> tuple[Any, int, int, int, _Lane, int]:
        """For a one-slice request: hold its memory, choose its mode and lane (ring attached,
        completion thread started unless ``sync``) and count a use of its file. Returns
        ``(hold, mode, edges, middle, lane, fd)``; on an error nothing is left held."""
        hold = pinned.registry.hold(req.mem.address, req.nbytes)
        try:
            mode, edges, middle = self._mode(req, hold is not None)
            lane = self._core.next_lane()
            if (mode == _aio.MODE_BOUNCE or edges) and not lane.ring.attached:
                lane.ring.ensure()
            if not sync and lane.thread is None:
                lane.start()
            fd = req.file.use()
        except BaseException:
            if hold is not None:
                pinned.registry.unhold(hold)
            raise
        return hold, mode, edges, middle, lane, fd

    def _run_one(self, req: _Request) -> int:
        """A sync request of one slice, kept short: submitted and waited for in one call
        into the queue (:meth:`AioQueue.run`), so a signal handler that raises finds the
        request drained, never queued and forgotten."""
        f, mem, n = req.file, req.mem, req.nbytes
        hold, mode, edges, middle, lane, fd = self._take_lane(req, True)
        try:
            with self._lock:
                self._count_paths(mode, edges, middle)
            done = lane.queue.run(fd, req.write, mem.address, n, req.offset, mode,
                                  f.off_align, self._block(f), f.state, req.fsync, f.name)
        except (OSError, EOFError) as exc:      # the request's own error (see _aio.failure)
            with self._lock:
                self._count_outcome(req.write, int(getattr(exc, "done", 0) or 0), True)
            raise
        finally:
            f.unuse()
            if hold is not None:
                pinned.registry.unhold(hold)
        with self._lock:
            self._count_outcome(req.write, done, False)
        return int(done)

    def _queue_one(self, req: _Request, sync: bool, token: Any,
                   sink: list[_aio.Request] | None = None) -> _Queued:
        """Queue a one-slice request on a lane (holding its memory and file)."""
        f, mem, n = req.file, req.mem, req.nbytes
        hold, mode, edges, middle, lane, fd = self._take_lane(req, sync)
        try:
            rq = lane.queue.submit(fd, req.write, mem.address, n, req.offset, mode,
                                   f.off_align, self._block(f), f.state, req.fsync, sync,
                                   token, f.name, mem.owner, sink)
        except BaseException:
            f.unuse()
            if hold is not None:
                pinned.registry.unhold(hold)
            raise
        with self._lock:
            self._count_paths(mode, edges, middle)
        return _Queued(req, lane, rq, hold)

    def _finish_one(self, q: _Queued, drain: bool = False) -> int:
        """Wait for (``drain``: without looking at signals) and account a sync request
        from _queue_one."""
        req, rq = q.req, q.rq
        try:
            # only a signal handler's exception comes out here (the queue drained the
            # request first); the request's own error is raised below
            rq.drain(False) if drain else rq.wait(False)
        finally:
            req.file.unuse()
            if q.hold is not None:
                pinned.registry.unhold(q.hold)
        exc = rq.error()
        with self._lock:
            self._count_outcome(req.write, rq.done, exc is not None)
        if exc is not None:
            raise exc
        return int(rq.done)

    def _slice_error(self, req: _Request, rq: _aio.Request) -> BaseException | None:
        """The error of one slice of ``req`` (None if it succeeded), naming the request."""
        if not (rq.errno or rq.eof):
            return None
        eoff, en = rq.failed_at
        return self._error(req.write, req.file, req.offset, req.nbytes, rq.done, rq.errno,
                           eoff, en)

    def _staged(self, req: _Request) -> int:
        """A non-contiguous (or conjugate/negative) buffer through a contiguous copy."""
        tmp, back = stage(req.mem, req.write, req.nbytes)
        inner = _Request(req.write, resolve(tmp), req.file, req.offset, req.nbytes,
                         req.fsync, req.arg)
        done = self._execute_sync(inner)
        if back is not None:
            back()
        return done

    def _cuda(self, req: _Request) -> int:
        """A CUDA tensor on an AIO handle: block-sized chunks through lane 0's ring."""
        lane = self._lanes[0]
        ring = lane.ring
        ring.register_cuda()
        chunk = ring.nbytes
        flat = flat_bytes(req.mem.tensor)
        done = 0
        with lane.lock:                         # the ring is lent whole to this request
            host = ring.host_tensor(chunk)
            while done < req.nbytes:
                k = min(chunk, req.nbytes - done)
                if req.write:
                    host[:k].copy_(flat[done:done + k])
                sub = _Request(req.write, resolve(host[:k]), req.file, req.offset + done, k,
                               False, req.arg)
                moved = self._execute_sync(sub)
                if not req.write:
                    flat[done:done + k].copy_(host[:k])
                done += moved
        if req.fsync:
            os.fsync(req.file.fileno())
        return done

    # -- async -----------------------------------------------------------------------------
    def _start_async(self, req: _Request) -> IOFuture:
        fut = IOFuture(req.op, req.arg, req.nbytes, req.offset)
        outcome = self._core.open_async(fut)
        mem = req.mem
        if req.nbytes == 0 or not mem.contiguous or mem.device == "cuda":
            # what goes through a contiguous copy (or cuFile, or is only an fsync): the sync
            # path, on the handle's staging thread, so that the caller is not held up
            def staged() -> None:
                error: BaseException | None = None
                done = 0
                try:
                    done = self._run_sync(req)
                except BaseException as exc:
                    error = exc
                self._release(req)
                self._core.end(outcome, done, error)
            try:
                self._stager.submit(staged)
            except BaseException:               # no thread could be started
                self._core.end(outcome, 0, HandleClosedError("request was not submitted"),
                               counted=False)
                self._release(req)
                raise
            return fut
        slices = self._slices(req)
        if len(slices) == 1:
            token = _Async(self, req, fut, 1, None)
            token.outcome = outcome
            try:
                token.post = self._queue_one(req, False, token).hold
            except BaseException:
                self._forget_failed(token)
                raise
            return fut
        token = _Async(self, req, fut, len(slices),
                       pinned.registry.hold(mem.address, req.nbytes))
        token.outcome = outcome
        try:
            self._submit_parts(req, slices, False, token)
        except BaseException as exc:
            queued = len(getattr(exc, "__aioswap_submitted__", ()))
            if queued == 0:
                # nothing reached the queue: the request ends here, with this error
                self._forget_failed(token)
                raise
            # some slices run (so there are several, and a lock): the future fails with this
            # error once they are done
            assert token.lock is not None
            with token.lock:
                token.errors.append(exc)
                token.parts -= len(slices) - queued
                last = token.parts == 0
            if last:
                self._finish_async(token)
        return fut

    def _forget_failed(self, token: _Async) -> None:
        if token.post is not None:
            pinned.registry.unhold(token.post)
            token.post = None
        assert token.outcome is not None
        self._core.end(token.outcome, 0, HandleClosedError("request was not submitted"),
                       counted=False)
        self._release(token.req)

    def _finish_async(self, token: _Async, exc: BaseException | None = None) -> None:
        req, fut = token.req, token.fut
        if token.post is not None:
            pinned.registry.unhold(token.post)
            token.post = None
        first = exc if exc is not None else (token.errors[0] if token.errors else None)
        if first is None and req.fsync and token.lock is not None:      # several slices
            try:
                os.fsync(req.file.fileno())
            except OSError as e:
                first = e
        req.file.unuse()
        if req.file is not req.arg:
            req.file.unuse()                    # unpinned (see _cached)
        with self._lock:
            self._count_outcome(req.write, token.done, first is not None)
            self._core.leave(True)
        assert token.outcome is not None
        self._core.end(token.outcome, token.done, first)


_shared: AioHandle | None = None
_shared_lock = threading.Lock()


def shared_handle() -> AioHandle:
    """The process-wide handle that functions given no ``handle=`` use (made on first use).

    Making and closing a handle costs a kernel context each time (``io_destroy`` waits for
    an RCU grace period, tens of milliseconds); one shared handle makes a loop over many
    small files as cheap as one call. It is thread-safe like any handle, closed at exit,
    and made again after ``fork()`` or after someone closed it.
    """
    global _shared
    h = _shared
    if h is not None and not h._closed and h._generation == _aio.fork_generation():
        return h
    with _shared_lock:
        h = _shared
        if h is None or h._closed or h._generation != _aio.fork_generation():
            if h is not None:
                h._closed = True        # the parent's (after fork): nothing to free here
            h = _shared = AioHandle()
        return h


def _close_shared() -> None:
    h = _shared
    if h is not None and h._generation == _aio.fork_generation():
        h.close()


atexit.register(_close_shared)




def _integer(value: Any, what: str, file: Any) -> int:
    """Offsets and sizes are integers: ``1.5`` or ``"3"`` is an error, never truncated."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got the boolean {value} for "
                        f"{describe(file)}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r} "
                        f"for {describe(file)}") from None


def _drain(subs: Sequence[_aio.Request]) -> None:
    """Cancel queued slices and wait for what of them is in flight."""
    for rq in subs:
        rq.cancel()
    for rq in subs:
        rq.drain(False)


class _GeneralPath:
    """What the engine's compiled path (``_aio.Core``) hands to Python: every request it
    does not take, with the handle as the first argument (the Core keeps no reference to
    its handle)."""

    @staticmethod
    def request(h: AioHandle, write: bool, buffer: Any, file: FileArg, offset: Any,
                nbytes: Any, async_op: bool, fsync: bool) -> int | IOFuture:
        return h._request(write, buffer, file, offset, nbytes, async_op, fsync)

    @staticmethod
    def short_file(h: AioHandle, file: FileArg, write: bool) -> AioFile | None:
        return h._short_file(file, write)

    @staticmethod
    def many_slow(h: AioHandle, write: bool, buf: Any, file: FileArg, offset: Any,
                  subs: list[_aio.Request]) -> _Queued | _Request:
        return h._many_slow(write, buf, file, offset, subs)

    @staticmethod
    def many_finish_slow(h: AioHandle, q: _Queued | _Request) -> int:
        return h._many_finish_slow(q)

    @staticmethod
    def abandon(h: AioHandle, queued: Sequence[_Queued | _ShortQueued | _Request]) -> None:
        h._abandon(queued)

    @staticmethod
    def unpack(item: Sequence[Any]) -> tuple[Any, Any, Any]:
        return AioHandle._many_unpack(item)


_GENERAL = _GeneralPath()
