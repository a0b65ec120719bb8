"""The safetensors format, read and written with batched direct I/O through an AioHandle.

Same calls as ``safetensors.torch``: :func:`load_file`, :func:`save_file`, :func:`load`,
:func:`save` and a lazy :func:`safe_open`. Files written here are read by the ``safetensors``
package unchanged and the other way round. Beyond them: :func:`iter_file` (and
:meth:`SafeOpen.iter_tensors`) hands tensors over as they land, :func:`load_checkpoint` and
:func:`iter_checkpoint` read a sharded Hugging Face checkpoint in one call, and
:func:`save_sharded` writes one over several drives.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian unsigned length
``N``, ``N`` bytes of UTF-8 JSON (padded with spaces), then the data region. The JSON is an
object: an optional ``"__metadata__"`` object of string to string, and for every tensor
``{"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}``, offsets relative to the
start of the data region (``8 + N``). The tensors' byte ranges must cover the data region
exactly: no gap, no overlap, nothing after the last one.

Reading: the header is checked completely before any memory is allocated for the data:
``N`` at most :data:`MAX_HEADER_BYTES` and inside the file, strict UTF-8 JSON, unique names,
known dtypes, non-negative integer shapes and offsets, ``end - begin`` equal to the element
count times the element size, offsets inside the file, exact coverage. Any violation raises
:class:`SafetensorsError` naming the file and what is wrong. Then the data region is read with
one batched submission: groups of consecutive tensors (4 MiB for the first, doubling up to
64 MiB) get one page-locked, page-aligned buffer apiece, holding the group's bytes from the
4096-aligned file offset before them, so every read is ``O_DIRECT`` straight into the
destination; all reads are submitted with ``async_op=True`` before the first is waited for,
so later groups' buffers are allocated (page faults, ``mlock``) while earlier groups are
read. Each tensor is a view of its group's
buffer with a storage of its own (``torch.frombuffer``): tensors never appear to share memory
(``safetensors.torch.save_file`` accepts them again), they are reported pinned by
:func:`aioswap.pinned.is_pinned`, and a group's memory is freed when its last tensor goes.

Streaming: :func:`iter_file` is that read as a generator, and :func:`load_file` collects it.
It yields ``(name, tensor)`` in file order (by data offset; an empty tensor at its offset,
before the tensor that begins there), a group's tensors once its read has ended, while the
later groups' reads are in flight (a group that has landed is handed over between two
submissions, so the first tensors may come before the last buffer is allocated).
``max_inflight_bytes`` bounds the bytes of groups submitted and not yet handed over in full
(default: none on the CPU, where the buffers are the result; 1 GiB of staging for a
device). Leaving the loop early, closing the generator or letting it be collected waits for
every read in flight before the file is closed.

Checkpoints: :func:`load_checkpoint` / :func:`iter_checkpoint` take a directory with
``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {tensor: shard}}``,
what :func:`save_sharded` and ``transformers`` write) or ``model.safetensors``, or the index
file itself. The index and every shard's header are checked before any data is allocated:
a shard name must be a plain file name of the index's directory (no separator, no ``..``;
links there are followed), and every tensor must be in exactly one shard, the one the
weight map names. Then all shards stream through one handle as one sequence of groups
(shards in file name order), so their reads are in flight together; the dict
:func:`load_checkpoint` returns is in weight-map order.
Both also take a list of shard files (what ``transformers`` resolves a checkpoint to): each
header checked the same way, a tensor in two of the files refused, the files read in the
order given.

Writing: the header (compact JSON, spaces up to a multiple of 8 bytes, tensors ordered by
dtype alignment then name: the bytes ``safetensors`` writes) and the tensors' bytes are staged
through a ring of page-locked 16 MiB slots written at aligned file offsets with ``O_DIRECT``,
the copy into one slot overlapping the writes of the others; then fsync, and the temporary
file is renamed over ``filename`` (a crash never leaves a half-written checkpoint there).

This module reads and exports every public name; the format (dtypes, header checks,
:class:`SafetensorsError`) is :mod:`aioswap._st_format`, the writer :mod:`aioswap._st_write`
and a checkpoint's index :mod:`aioswap._st_index`.
"""
from __future__ import annotations

import concurrent.futures
import operator
import os
import sys
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from aioswap import _adaptive, pinned
from aioswap._aio import DEFAULT_ALIGNMENT as _ALIGN
from aioswap._files import AioFile
from aioswap._st_format import (DTYPES, MAX_HEADER_BYTES, Header, PathLike, SafetensorsError,
                                TensorInfo, dtype_of, header_length, open_data, parse_header,
                                read_header, read_header_fd)
from aioswap._st_index import check_index, checkpoint_files, given_files
from aioswap._st_write import save, save_file, save_sharded
from aioswap._util import round_up, wait_all
from aioswap.handle import AioHandle, shared_handle

__all__ = [
    "MAX_HEADER_BYTES",
    "DTYPES",
    "Header",
    "SafeOpen",
    "SafetensorsError",
    "TensorInfo",
    "iter_checkpoint",
    "iter_file",
    "load",
    "load_checkpoint",
    "load_file",
    "read_header",
    "safe_open",
    "save",
    "save_file",
    "save_sharded",
]

_GROUP_BYTES = 64 << 20       # read: bytes of consecutive tensors per buffer (one request)
_FIRST_GROUP_BYTES = 4 << 20  # read: the first group; each next one twice the last, up to 64 MiB
_DEVICE_WINDOW_BYTES = 1 << 30   # read to a device: host staging bytes in flight at most


# ---------------------------------------------------------------------------------- tensors

def _view(buf: Any, offset: int, info: TensorInfo, dtype: torch.dtype,
          shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``info``'s bytes at ``offset`` of ``buf``, with its own storage."""
    n = info.nbytes
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset)
    if raw.data_ptr() % dtype.itemsize:     # misaligned in the file: give it its own memory
        t = torch.empty(shape, dtype=dtype)
        t.view(-1).view(torch.uint8).copy_(raw)
        return t
    return torch.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize,
                            offset=offset).view(shape)


def _device(device: str | int | torch.device) -> torch.device:
    dev = torch.device(device)   # int -> cuda:N, "cuda" -> cuda
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"cannot load to {dev}: torch finds no CUDA device")
    return dev


def _phys_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 34


@dataclass(frozen=True)
class _Source:
    """A file to load from: its header checked, a torch dtype for every tensor, its file
    adopted by the handle that reads it."""

    path: str
    header: Header
    file: AioFile
    types: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]

    @property
    def size(self) -> int:
        return self.header.data_offset + self.header.data_bytes


def _types(header: Header, path: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The torch dtype and shape of every tensor; raises before anything is read."""
    return {name: dtype_of(info, path) for name, info in header.tensors.items()}


def _open_source(path: str, handle: AioHandle | None) -> _Source:
    """Open ``path`` and check its header and dtypes; nothing is allocated for the data."""
    fd = open_data(path)
    try:
        header = read_header_fd(fd, path)
        types = _types(header, path)
        file = (shared_handle() if handle is None else handle).adopt(fd)
        fd = -1                             # the handle's own file from here on
    finally:
        if fd >= 0:
            os.close(fd)
    return _Source(path, header, file, types)


@dataclass
class _Group:
    """Consecutive tensors of one source read with one request into one buffer (``nbytes``
    0: empty tensors only, nothing to read)."""

    source: _Source
    infos: list[TensorInfo]
    file_start: int           # aligned file offset the buffer starts at
    nbytes: int
    buf: Any = None
    future: Any = None
    locked: bool = False      # buf counts against the page-locked budget


def _group_sizes(first: int, most: int) -> Iterator[int]:
    """``first``, ``2 * first``... up to ``most``, then ``most`` for ever."""
    size = first
    while True:
        yield size
        size = min(most, 2 * size)


def _groups(src: _Source, sizes: Iterator[int]) -> list[_Group]:
    """``src``'s tensors in file order, cut into groups of the byte counts ``sizes`` gives.

    Small groups first, so the first read starts early and the allocation of the later,
    larger buffers overlaps the reads of the earlier ones. An empty tensor keeps its place
    (at its offset, before a tensor that begins there; ties in header order).
    """
    header = src.header
    order = sorted(header.tensors.values(), key=lambda i: (i.begin, i.end))
    out: list[_Group] = []
    cur: list[TensorInfo] = []
    size = 0
    for i, info in enumerate(order):
        if not cur:
            size = next(sizes)
        cur.append(info)
        if cur[-1].end - cur[0].begin >= size or i == len(order) - 1:
            full = [x for x in cur if x.nbytes]
            if not full:                    # empty tensors at the end of the file
                out.append(_Group(src, cur, 0, 0))
            else:
                start = (header.data_offset + full[0].begin) // _ALIGN * _ALIGN
                stop = min(round_up(header.data_offset + full[-1].end, _ALIGN), src.size)
                out.append(_Group(src, cur, start, stop - start))
            cur = []
    return out


def _stream(sources: Sequence[_Source], dev: torch.device, limit: int, window: int | None,
            read: str | None = None) -> Generator[tuple[str, torch.Tensor], None, None]:
    """``(name, tensor)`` of every source in turn, each in file order, a group's tensors as
    soon as its read has ended.

    Reads are submitted ahead, without waiting, as far as ``window`` allows (bytes of groups
    submitted and not yet handed over in full; None: no bound); a group lands in
    page-locked memory while ``limit`` allows. Every read has ended when this returns,
    raises or is closed; the sources stay open. ``read``: a group whose range the page cache
    holds is copied from it, the others read direct (:class:`aioswap._adaptive.Reader`).
    """
    sizes = _group_sizes(_FIRST_GROUP_BYTES, _GROUP_BYTES)
    plan = [g for src in sources for g in _groups(src, sizes)]
    futures: list[Any] = []
    reader = _adaptive.Reader(read, f"load of {', '.join(s.path for s in sources[:3])}"
                              + (" ..." if len(sources) > 3 else ""))
    # Host memory: on the CPU it is the result, so the first `limit` bytes of the call are
    # page-locked. For a device it is staging: a group's buffer goes once its tensors are
    # on the device, and its bytes count against `limit` no more.
    inflight = locked = 0
    ahead = 0                               # plan[ahead]: the next group to submit
    try:
        for i, g in enumerate(plan):
            while ahead < len(plan):
                nxt = plan[ahead]
                # g has landed and a later read is on its way (the drive stays busy while
                # the caller works): hand g over before the next allocation
                if ahead > i + 1 and (g.future is None or g.future.done()):
                    break
                if ahead > i and window is not None and inflight + nxt.nbytes > window:
                    break
                if nxt.nbytes:              # allocate and submit: later allocations overlap
                    if locked + nxt.nbytes <= limit:
                        # unlocked where mlock is refused: the read still goes direct into
                        # it (the registry's own memory), so only a device copy warns
                        nxt.buf = memoryview(pinned.allocate(nxt.nbytes, strict=False,
                                                             warn=dev.type != "cpu"))
                        nxt.locked = True
                        locked += nxt.nbytes
                    else:
                        nxt.buf = np.empty(nxt.nbytes, dtype=np.uint8).data
                    nxt.future = reader.pread(
                        nxt.source.file, torch.frombuffer(nxt.buf, dtype=torch.uint8),
                        nxt.file_start)
                    futures.append(nxt.future)
                    inflight += nxt.nbytes
                ahead += 1
            if g.future is not None:
                concurrent.futures.wait([g.future])
                if g.future.exception() is not None:
                    wait_all(futures)               # every read ends; the first error raises
            for info in g.infos:        # no local keeps a view (and the buffer) after this
                yield info.name, _tensor(g, info, dev)
            g.buf = None
            inflight -= g.nbytes
            if dev.type != "cpu" and g.locked:
                locked -= g.nbytes
    finally:
        concurrent.futures.wait(futures)            # never leave the kernel writing
        reader.close()


def _tensor(g: _Group, info: TensorInfo, dev: torch.device) -> torch.Tensor:
    """Tensor ``info`` of group ``g`` (landed) on ``dev``."""
    dtype, shape = g.source.types[info.name]
    if not info.nbytes:
        return torch.empty(shape, dtype=dtype, device=dev)
    t = _view(g.buf, g.source.header.data_offset + info.begin - g.file_start, info, dtype,
              shape)
    return t if dev.type == "cpu" else t.to(dev)


def _owned_stream(opener: Callable[[], list[_Source]], dev: torch.device, limit: int,
                  window: int | None, read: str | None) -> Generator[Any, None, None]:
    """:func:`_stream` over the sources ``opener`` opens, closed with it. Its first item is a
    marker (None, see :func:`_started`)."""
    sources = opener()
    try:
        yield None
        yield from _stream(sources, dev, limit, window, read)
    finally:
        for src in sources:
            src.file.close()


def _started(gen: Generator[Any, None, None]) -> Generator[tuple[str, torch.Tensor], None, None]:
    """``gen`` run up to its marker: what it opens is opened and checked now (errors raise
    here, not at the caller's first ``next``), and a started generator's ``finally`` runs
    when it is closed or collected, so what it opened is closed then."""
    next(gen)
    return gen


def _load_args(device: str | int | torch.device, max_pinned_bytes: int | None,
               max_inflight_bytes: int | None, path: str, read: str | None = None
               ) -> tuple[torch.device, int, int | None]:
    """The device, the page-locked budget and the window of a load (``read`` checked)."""
    if read is not None:
        _adaptive.read_mode(read)           # a bad value: ValueError before anything
    dev = _device(device)
    if sys.byteorder != "little":
        raise SafetensorsError("safetensors data is little-endian; this machine is not",
                               path=path)
    limit = _phys_bytes() // 2 if max_pinned_bytes is None else operator.index(
        max_pinned_bytes)
    if max_inflight_bytes is not None:
        if operator.index(max_inflight_bytes) < 0:
            raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
        return dev, limit, operator.index(max_inflight_bytes)
    return dev, limit, None if dev.type == "cpu" else min(limit, _DEVICE_WINDOW_BYTES)


def iter_file(filename: PathLike, device: str | int | torch.device = "cpu", *,
              handle: AioHandle | None = None, max_pinned_bytes: int | None = None,
              max_inflight_bytes: int | None = None, read: str | None = None
              ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(name, tensor)`` for every tensor of a safetensors file as its bytes land.

    Tensors come in file order (by data offset; an empty tensor at its offset, before the
    tensor that begins there). Reads are those of :func:`load_file`, submitted ahead
    without waiting: the caller gets the first tensors while later reads are in flight.

    Parameters
    ----------
    filename : str or os.PathLike
        The file.
    device : str, int or torch.device
        As for :func:`load_file`.
    handle : AioHandle, optional
        The handle to read through; default :func:`aioswap.handle.shared_handle`.
    max_pinned_bytes : int, optional
        As for :func:`load_file`.
    max_inflight_bytes : int, optional
        Bytes of read buffers submitted and not yet handed over in full, at most (at least
        one group is always in flight, whatever its size). Default: no bound on the CPU
        (the buffers are the result), 1 GiB (at most ``max_pinned_bytes``) of staging for a
        device. It bounds memory when the caller lets each tensor go (moves it elsewhere):
        CPU tensors are views of their group's buffer and keep it alive.
    read : {"auto", "direct", "buffered"}, optional
        As for :func:`load_file`.

    Returns
    -------
    generator of (str, torch.Tensor)
        The file is opened and its header checked by this call; the reads start at the
        first ``next``.

    Raises
    ------
    SafetensorsError, OSError, ShortReadError, RuntimeError
        As for :func:`load_file`; a malformed header raises here, before anything is read.
    ValueError
        ``max_inflight_bytes`` is negative.

    Notes
    -----
    Leaving early (``break``, ``close()``, an exception in the loop, the generator being
    collected) waits for every read in flight, then closes the file: the kernel never
    writes into memory that was let go.
    """
    path = os.fspath(filename)
    dev, limit, window = _load_args(device, max_pinned_bytes, max_inflight_bytes, path, read)
    return _started(_owned_stream(lambda: [_open_source(path, handle)], dev, limit, window,
                                  read))


def load_file(filename: PathLike, device: str | int | torch.device = "cpu", *,
              handle: AioHandle | None = None, max_pinned_bytes: int | None = None,
              read: str | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file: what the page cache holds is copied from it,
    the rest read with direct I/O.

    Parameters
    ----------
    filename : str or os.PathLike
        The file.
    device : str, int or torch.device
        Where the tensors go: ``"cpu"`` (default), or a CUDA device (``"cuda"``, ``0``...):
        the file is read into page-locked host memory, then each tensor is copied to the
        device as soon as its group has arrived.
    handle : AioHandle, optional
        The handle to read through; default :func:`aioswap.handle.shared_handle`.
        Only the requests of this call are waited for.
    max_pinned_bytes : int, optional
        Page-locked memory this call may allocate for the data (default: half the physical
        memory). Groups past it go to plain memory, read through the handle's bounce pool.
    read : {"auto", "direct", "buffered"}, optional
        ``"auto"``: each group of tensors whose range the page cache holds (a file loaded
        again, ``cachestat``) is copied from it by a few threads, the others are read direct
        from the drive; a file system without ``O_DIRECT`` (tmpfs) is read buffered.
        ``"direct"`` or ``"buffered"`` force either. Default: ``AIOSWAP_READ``, else auto.
        What was done is logged at DEBUG (``aioswap`` logger).

    Returns
    -------
    dict of str to torch.Tensor
        Names in the header's order. CPU tensors are views of page-locked memory, each with
        its own storage (see the module notes), writable, and freed with the last view.

    Raises
    ------
    SafetensorsError
        A malformed header (before any data is allocated or read), or a dtype this torch
        lacks (``F6_*``).
    OSError, ShortReadError
        The file cannot be read (or shrank while being read).
    RuntimeError
        ``device`` is a CUDA device and there is none.

    Notes
    -----
    ``pinned.allocate(strict=False)`` is used: where the memory cannot be locked
    (RLIMIT_MEMLOCK) it is page-aligned unlocked memory of aioswap's own, which the reads
    still fill with direct I/O (the kernel pins its pages for each read), so no bounce copy
    and, on the CPU, no warning; for a CUDA device (host memory as staging, whose copies
    are slower from unlocked memory) one warning per process. The tensors are those
    :func:`iter_file` yields, collected.
    """
    path = os.fspath(filename)
    dev, limit, window = _load_args(device, max_pinned_bytes, None, path, read)
    src = _open_source(path, handle)
    try:
        got = dict(_stream([src], dev, limit, window, read))
    finally:
        src.file.close()
    return {name: got[name] for name in src.header.tensors}


# ---------------------------------------------------------------------------------- checkpoints

def _open_checkpoint(path: str | list[str], handle: AioHandle | None
                     ) -> tuple[list[_Source], Mapping[str, Any]]:
    """The checkpoint's shards, opened and checked (headers, dtypes, index), and the order
    of its tensors (the weight map's, the one file's header's, or the files' headers' in the
    order given)."""
    if isinstance(path, list):
        return _open_files(path, handle)
    index, weight_map, files = checkpoint_files(path)
    h = shared_handle() if handle is None else handle
    sources: list[_Source] = []
    try:
        for f in files:
            try:
                sources.append(_open_source(f, h))
            except FileNotFoundError as exc:
                if index is None:
                    raise
                raise SafetensorsError(f"{index!r}: shard {os.path.basename(f)!r} is "
                                       f"missing ({exc.strerror}: {f!r})", path=index) from exc
        if index is None:
            return sources, sources[0].header.tensors
        assert weight_map is not None
        check_index(index, weight_map, [s.header for s in sources])
        return sources, weight_map
    except BaseException:
        for src in sources:
            src.file.close()
        raise


def _open_files(files: list[str], handle: AioHandle | None
                ) -> tuple[list[_Source], Mapping[str, Any]]:
    """Shard files given as a list, opened and checked; a tensor in two of them is refused."""
    h = shared_handle() if handle is None else handle
    sources: list[_Source] = []
    order: dict[str, str] = {}
    try:
        for f in files:
            src = _open_source(f, h)
            sources.append(src)
            for name in src.header.tensors:
                if name in order:
                    raise SafetensorsError(f"tensor {name!r} is in more than one of the files "
                                           f"given: {order[name]!r} and {f!r}", path=f)
                order[name] = f
        return sources, order
    except BaseException:
        for src in sources:
            src.file.close()
        raise


def iter_checkpoint(path: PathLike | Sequence[PathLike],
                    device: str | int | torch.device = "cpu", *,
                    handle: AioHandle | None = None, max_pinned_bytes: int | None = None,
                    max_inflight_bytes: int | None = None, read: str | None = None
                    ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(name, tensor)`` for every tensor of a (sharded) checkpoint as its bytes land.

    Shards in file name order (a list: in its order), each shard's tensors in file order (as
    :func:`iter_file`).
    The reads of every shard go through one handle and are submitted one after the other
    without waiting, so all shards are in flight together.

    Parameters
    ----------
    path : str, os.PathLike, or a sequence of them
        A directory holding ``model.safetensors.index.json`` (the Hugging Face layout that
        :func:`save_sharded` and ``save_pretrained`` write) or, without one,
        ``model.safetensors``; or an index file (``*.json``); or one safetensors file; or a
        list of safetensors files, read as the shards of one checkpoint in the order given
        (no index: a tensor in two of them is refused).
    device, handle, max_pinned_bytes, max_inflight_bytes, read
        As for :func:`iter_file`; the page-locked budget and the window are for the whole
        checkpoint.

    Returns
    -------
    generator of (str, torch.Tensor)
        The index and every shard's header are read and checked by this call, before any
        memory is allocated for data; the reads start at the first ``next``.

    Raises
    ------
    SafetensorsError
        A malformed header in any shard; an index that is not JSON, has no
        ``"weight_map"`` or one that is not of string to string; a shard file name with a
        path separator or ``..``; a shard that is missing; a tensor in another shard than
        the weight map says, in a shard but not in the weight map, in the weight map but in
        no shard, or in two shards.
    FileNotFoundError
        ``path`` (or a file of the list) does not exist, or is a directory with neither
        file.
    OSError, ShortReadError, RuntimeError, ValueError
        As for :func:`iter_file`; ValueError also for an empty list.

    Notes
    -----
    Only the shards the weight map names are read; a symbolic link in the directory is
    followed (:func:`save_sharded` links shards on other drives so). Leaving early waits for
    every read in flight, then closes every shard.
    """
    p = given_files(path)
    where = p if isinstance(p, str) else p[0]
    dev, limit, window = _load_args(device, max_pinned_bytes, max_inflight_bytes, where, read)
    return _started(_owned_stream(lambda: _open_checkpoint(p, handle)[0], dev, limit,
                                  window, read))


def load_checkpoint(path: PathLike | Sequence[PathLike],
                    device: str | int | torch.device = "cpu", *,
                    handle: AioHandle | None = None, max_pinned_bytes: int | None = None,
                    read: str | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of a (sharded) checkpoint in one call, all shards read together.

    Parameters
    ----------
    path : str, os.PathLike, or a sequence of them
        As for :func:`iter_checkpoint`.
    device, handle, max_pinned_bytes, read
        As for :func:`load_file`, for the whole checkpoint.

    Returns
    -------
    dict of str to torch.Tensor
        Names in the weight map's order (the header's for a checkpoint of one file, the
        headers' in the order given for a list of files); the tensors are those
        :func:`iter_checkpoint` yields, like :func:`load_file`'s.

    Raises
    ------
    SafetensorsError, FileNotFoundError, OSError, ShortReadError, RuntimeError
        As for :func:`iter_checkpoint`; every check is made before any data is read.
    """
    p = given_files(path)
    where = p if isinstance(p, str) else p[0]
    dev, limit, window = _load_args(device, max_pinned_bytes, None, where, read)
    sources, order = _open_checkpoint(p, handle)
    try:
        got = dict(_stream(sources, dev, limit, window, read))
    finally:
        for src in sources:
            src.file.close()
    return {name: got[name] for name in order}


def load(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in memory (copied: they do not share ``data``).

    Raises
    ------
    SafetensorsError
        Malformed data (same checks as :func:`load_file`).
    """
    mv = memoryview(data).cast("B")
    n = header_length(bytes(mv[:8]), len(mv), None)
    header = parse_header(bytes(mv[8:8 + n]), len(mv) - 8 - n, None)
    out = {}
    for name, info in header.tensors.items():
        dtype, shape = dtype_of(info, None)
        lo = header.data_offset + info.begin
        buf = bytearray(mv[lo:lo + info.nbytes])
        out[name] = (_view(buf, 0, info, dtype, shape) if buf
                     else torch.empty(shape, dtype=dtype))
    return out


# ---------------------------------------------------------------------------------- lazy

class SafeOpen:
    """A safetensors file opened for reading tensors one at a time (see :func:`safe_open`)."""

    def __init__(self, filename: PathLike, framework: str = "pt",
                 device: str | int | torch.device = "cpu", *,
                 handle: AioHandle | None = None) -> None:
        if framework not in ("pt", "torch"):
            raise ValueError(f"framework {framework!r} is not supported: aioswap loads torch "
                             f"tensors (framework='pt')")
        self._path = os.fspath(filename)
        self._device = _device(device)
        self._file: AioFile | None = None
        fd = open_data(self._path)
        try:
            self._header = read_header_fd(fd, self._path)
            self._file = (shared_handle() if handle is None else handle).adopt(fd)
        except BaseException:
            os.close(fd)
            raise

    @property
    def header(self) -> Header:
        return self._header

    @property
    def closed(self) -> bool:
        return self._file is None

    def keys(self) -> list[str]:
        """Tensor names, sorted (as ``safetensors`` lists them)."""
        return sorted(self._header.tensors)

    def metadata(self) -> dict[str, str] | None:
        """The ``"__metadata__"`` of the file, or None."""
        md = self._header.metadata
        return None if md is None else dict(md)

    def __contains__(self, name: object) -> bool:
        return name in self._header.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor into new memory on the device given at open.

        Raises
        ------
        KeyError
            No tensor of that name.
        ValueError
            The file is closed.
        """
        file = self._file
        if file is None:
            raise ValueError(f"{self._path!r} is closed")
        try:
            info = self._header.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self._path!r}") from None
        dtype, shape = dtype_of(info, self._path)
        t = torch.empty(shape, dtype=dtype)
        if info.nbytes:
            file.pread(t.view(-1).view(torch.uint8), self._header.data_offset + info.begin)
        return t if self._device.type == "cpu" else t.to(self._device)

    def iter_tensors(self, *, max_pinned_bytes: int | None = None,
                     max_inflight_bytes: int | None = None, read: str | None = None
                     ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yield ``(name, tensor)`` for every tensor, in file order, as its bytes land.

        As :func:`iter_file` on the open file, to the device given at open: groups of
        consecutive tensors read ahead, leaving early waits for every read in flight. The
        file stays open (closing it while iterating lets the reads in flight finish; the
        next submission raises).

        Raises
        ------
        ValueError
            The file is closed, or ``max_inflight_bytes`` is negative.
        SafetensorsError
            A tensor has a dtype this torch lacks (``F6_*``).
        """
        file = self._file
        if file is None:
            raise ValueError(f"{self._path!r} is closed")
        dev, limit, window = _load_args(self._device, max_pinned_bytes, max_inflight_bytes,
                                        self._path, read)
        src = _Source(self._path, self._header, file, _types(self._header, self._path))
        return _stream([src], dev, limit, window, read)

    def close(self) -> None:
        """Close the file. Idempotent."""
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def safe_open(filename: PathLike, framework: str = "pt",
              device: str | int | torch.device = "cpu", *,
              handle: AioHandle | None = None) -> SafeOpen:
    """Open a safetensors file for lazy access, like ``safetensors.safe_open``.

    Use as a context manager: ``keys()``, ``metadata()``, ``get_tensor(name)``. The header
    is read and validated at open (:class:`SafetensorsError` when malformed); each
    ``get_tensor`` is one read through the handle.
    """
    return SafeOpen(filename, framework, device, handle=handle)
