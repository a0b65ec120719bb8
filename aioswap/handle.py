"""AioHandle: tensor and buffer I/O to files through the shared kernel AIO queue.

A handle owns ``intra_op_parallelism`` lanes; each lane is one
:class:`~aioswap._aio.AioQueue` (a kernel context with ``queue_depth`` iocbs in flight
across every request of the lane), its bounce ring, and one completion thread. Every
request, sync or async, from any thread, becomes pieces in a lane's queue:

* **direct**: page-locked or aioswap-allocated (``pinned.is_direct``), aligned, contiguous
  host memory goes straight to the kernel with ``O_DIRECT``;
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
        queued: list[_aio.Ticket | Callable[[], int]] = []
        # every queue request, recorded by the queue itself: a signal handler can raise
        # between a submission and the append to `queued`
        subs: list[_aio.Request] = []
        try:
            self._core.many_queue(self, write, requests, queued, subs)
        except Exception:
            # a bad item: what was queued before it is valid and runs to the end
            self._core.abandon(queued, False)
            raise
        except BaseException:
            self._core.abandon(queued)          # a signal: stop as soon as possible
            # one submitted but not in `queued` yet: nothing may write its memory after
            # this raises (its file stays counted as in use: a signal's narrow window)
            known = {id(rq) for q in queued if isinstance(q, _aio.Ticket) for rq in q.parts}
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
                   subs: list[_aio.Request]) -> _aio.Ticket | Callable[[], int]:
        """A batch item the Core did not take as it came: checked now (its error raised),
        then queued through the Core when it is contiguous host memory, else run in turn
        (staged) when the batch is reaped."""
        mem, f, n, offset = self._prepare(write, buf, file, offset, None)
        try:
            if n and mem.contiguous and mem.device == "cpu":
                return self._core.submit(write, mem.address, n, _keeper(mem), f, offset,
                                         queue=True, arg=file, sink=subs)
        finally:
            if f is not file:
                f.unuse()                       # unpinned (see _cached)

        def later() -> int:
            done = self._request(write, buf, file, offset, None, False, False)
            assert isinstance(done, int)        # (sync)
            return done
        return later

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
        """The general path of a request (:meth:`_aio.Core.request` takes the others as they
        come): it raises what is wrong, stages what is not contiguous host memory, and
        submits through the Core."""
        mem, f, n, offset = self._prepare(write, buffer, file, offset, nbytes)
        try:
            if n and mem.contiguous and mem.device == "cpu":
                return self._core.submit(write, mem.address, n, _keeper(mem), f, offset,
                                         fsync=fsync, async_op=async_op, arg=file)
            if async_op:
                return self._start_cold(write, mem, f, offset, n, fsync, file)
            self._enter(write, file)
            try:
                return self._cold(write, mem, f, offset, n, fsync)
            finally:
                self._core.leave()
        finally:
            if f is not file:
                f.unuse()                       # unpinned (see _cached)

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

    def _prepare(self, write: bool, buffer: Any, file: FileArg, offset: Any,
                 nbytes: Any) -> tuple[Buffer, AioFile, int, int]:
        """Check a request (raising what is wrong, before any I/O): its buffer resolved, its
        file (pinned when it is the handle's own behind a path or fd: the caller unpins it),
        its size and offset."""
        op = "write" if write else "read"
        if self._closed or self._generation != _aio.fork_generation():
            self._check(f"{op} of {describe(file)}")
        if type(offset) is not int:
            offset = _integer(offset, "offset", file)
        if offset < 0:
            raise ValueError(f"negative file offset {offset} for {describe(file)}")
        if offset > _aio.MAX_OFFSET:
            raise ValueError(f"file offset {offset} of {describe(file)} is beyond the largest "
                             f"one aioswap takes ({_aio.MAX_OFFSET})")
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
        except BaseException:
            if f is not file:
                f.unuse()                       # unpinned (see _cached)
            raise
        return mem, f, n, offset

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

    def _enter(self, write: bool, file: FileArg) -> None:
        """Count a request of the general path in (close() waits for it)."""
        with self._lock:
            if not self._core.enter():
                raise HandleClosedError(f"{'write' if write else 'read'} of "
                                        f"{describe(file)} on a closed AioHandle")

    # -- what the Core does not take as it is ------------------------------------------------
    def _cold(self, write: bool, mem: Buffer, f: AioFile, offset: int, n: int,
              fsync: bool) -> int:
        """A request that is not contiguous host memory, run in this thread (counted in by
        the caller): an fsync alone, a strided/conjugate/negative buffer through a
        contiguous copy (:func:`~aioswap._staging.stage`), CUDA memory through the device
        transport or the bounce ring. The contiguous part goes through the Core."""
        if n and mem.device == "cpu":
            tmp, back = stage(mem, write, n)
            t = resolve(tmp)
            done = int(self._core.submit(write, t.address, n, tmp, f, offset, fsync=fsync,
                                         entered=True))
            if back is not None:
                back()
            return done
        try:
            if n == 0:
                if fsync:
                    os.fsync(f.fileno())
                done = 0
            else:
                done = self._cuda(write, mem, f, offset, n)
                if fsync:
                    os.fsync(f.fileno())
        except BaseException:
            with self._lock:
                self._core.count_outcome(write, 0, True)
            raise
        with self._lock:
            self._core.count_outcome(write, done, False)
        return done

    def _cuda(self, write: bool, mem: Buffer, f: AioFile, offset: int, n: int) -> int:
        """CUDA memory: the device transport (cuFile), else block-sized chunks through lane
        0's ring."""
        if self._device_transport is not None:
            f.use()
            try:
                done, path = self._device_transport.transfer(write, mem.address, n, f, offset)
            finally:
                f.unuse()
            self._core.count_path(path, done)
            return int(done)
        lane = self._lanes[0]
        ring = lane.ring
        ring.register_cuda()
        chunk = ring.nbytes
        flat = flat_bytes(mem.tensor)
        done = 0
        with lane.lock:                         # the ring is lent whole to this request
            host = ring.host_tensor(chunk)
            while done < n:
                k = min(chunk, n - done)
                if write:
                    host[:k].copy_(flat[done:done + k])
                moved = int(self._core.submit(write, host.data_ptr(), k, host, f,
                                              offset + done, count=False, entered=True))
                if not write:
                    flat[done:done + k].copy_(host[:k])
                done += moved
        return done

    def _start_cold(self, write: bool, mem: Buffer, f: AioFile, offset: int, n: int,
                    fsync: bool, arg: FileArg) -> IOFuture:
        """:meth:`_cold` of an asynchronous request, on the handle's staging thread, so that
        the caller is not held up; the request counts as active from now."""
        self._enter(write, arg)
        fut = IOFuture("write" if write else "read", arg, n, offset)
        ticket = self._core.open_async(fut)
        f.use()

        def staged() -> None:
            error: BaseException | None = None
            done = 0
            try:
                done = self._cold(write, mem, f, offset, n, fsync)
            except BaseException as exc:
                error = exc
            f.unuse()
            self._core.leave()
            self._core.end(ticket, done, error)
        try:
            self._stager.submit(staged)
        except BaseException:                   # no thread could be started
            f.unuse()
            self._core.leave()
            self._core.end(ticket, 0, HandleClosedError("request was not submitted"),
                           counted=False)
            raise
        return fut


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


def _keeper(mem: Buffer) -> Any:
    """What keeps a resolved buffer's memory valid while a request uses it (for a
    buffer-protocol object, the array holding its export: a bytearray cannot be resized
    under the request)."""
    if mem.tensor is not None:
        return mem.tensor
    return mem.array if mem.array is not None else mem.owner


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
                  subs: list[_aio.Request]) -> _aio.Ticket | Callable[[], int]:
        return h._many_slow(write, buf, file, offset, subs)

    @staticmethod
    def many_finish_slow(h: AioHandle, q: Callable[[], int]) -> int:
        return q()

    @staticmethod
    def unpack(item: Sequence[Any]) -> tuple[Any, Any, Any]:
        return AioHandle._many_unpack(item)


_GENERAL = _GeneralPath()
