"""accelerate's disk offload, read through the page cache ahead of use or with batched direct I/O.

After :func:`install`, every ``OffloadedWeightsLoader`` that accelerate builds (in
``dispatch_model`` for ``device_map`` entries ``"disk"``, as transformers' ``from_pretrained``
does, and in ``disk_offload``) is an :class:`AioswapWeightsLoader`: the same ``Mapping`` of
weight name to tensor, over the same files, read differently.

How it reads
------------
The stock loader opens and maps a safetensors shard (or a ``.dat`` file) for every weight on
every forward and lets page faults bring the bytes in, one weight at a time. Here:

* The key set is built in O(n) and nothing is opened at construction.
* Each file is opened once per loader and checked the first time it is used: a safetensors
  shard must have a valid header (:func:`aioswap.safetensors.read_header`: a truncated file
  is refused) that names the weight the index points at; a ``.dat`` file must hold exactly
  the bytes its ``dtype``/``shape`` in ``index.json`` take. Anything else raises
  :class:`OffloadFileError`.
* Weights are read in *groups*: the keys of one decoder layer (a key's prefix up to its
  first numeric component, ``model.layers.7``) or of one module, neighbouring tensors of a
  file in one extent. The order in which groups are used is recorded as they are used, and
  the groups that come next (last time; on the first forward, layer ``N + 1`` after layer
  ``N``) are read ahead while this one computes.
* Embedding tables (:func:`embedding_key`, or the loader's ``sparse`` test) are handed out
  as private file mappings, as stock does, so a forward reads only the rows it touches.
* Two ways to read, chosen once per loader at its first read (``page_cache``): when the
  offloaded weights take at most half the memory there is for them
  (:func:`memory_for_cache`: ``MemAvailable``, capped by the process's cgroup memory
  limit), *through the page cache*; else, or on request, *direct*. The page cache is what
  lets every forward after the first run at memory speed; when the model does not fit, it
  thrashes, and direct reads, which fill no cache, do better.

Through the page cache:

* A group's tensors are views of one private (copy-on-write) mapping per extent, as the
  stock loader maps shards. An extent the page cache does not hold is faulted in with one
  ``MADV_POPULATE_READ`` call (the GIL released): one wait for the extent instead of a
  page fault per 4 KiB; one it holds (8 pages sampled with ``cachestat``) is left to the
  faults of its use.
* When a group is mapped, the groups that follow it, up to ``read_ahead`` bytes (by
  default 1 GiB, at most a quarter of :func:`memory_for_cache`), are read into the page
  cache by four read-ahead threads, 32 MiB at a time, while this group computes (nothing
  for a range the cache holds). They read by faulting in a shared mapping, so the kernel's
  read-ahead fills the cache with large folios: ``posix_fadvise(WILLNEED)`` would fill it
  with 4 KiB pages, and mapping, faulting and unmapping those on every later forward costs
  about 14 times more.
* A tensor keeps its mapping alive; the mapping goes with the last tensor, and its pages
  stay in the cache for the next forward.

Direct:

* Files are opened with ``O_DIRECT`` (one :class:`~aioswap.AioHandle` per loader). The
  first request for a key of a group reads the whole group, plus the groups that follow it
  up to ``batch_bytes``, in one batched submission into one page-locked buffer; when a
  batch is first asked for, before it is waited for, the batches that follow it are
  submitted, up to ``read_ahead`` bytes (one batch by default).
* Every batch buffer has one size (the largest group's, or ``batch_bytes``), so the buffer
  freed with the last tensor of a batch is the one a later batch gets back from the
  locked-memory cache: fresh memory is faulted in for the first few batches only, and what
  stays resident is a few buffers, not one of each size ever read.
* What of a request's range is in the page cache is copied from it (``mincore`` says
  which part, without reading anything); only the rest is read with ``O_DIRECT``, which
  fills no cache.
* Every tensor handed out is a view of its batch's buffer with a storage of its own; the
  buffer is never reused while any such tensor lives (it is freed, back into the
  locked-memory cache, with the last one), so a tensor the caller keeps is never
  overwritten.

How it writes
-------------
:func:`install` also replaces accelerate's ``offload_weight`` and ``offload_state_dict``
(``disk_offload``, ``dispatch_model`` with an ``offload_dir``): the same ``.dat`` files
(bytes, names, ``index.json``), created 0600, written with an ``AioHandle`` (a state dict's
files all submitted at once) and fsynced as stock's ``np.memmap.flush`` syncs them.
transformers' own ``offload_weight`` (safetensors files) is not replaced.

Without accelerate installed, importing this module works and :func:`install` raises
:class:`ImportError`.
"""
from __future__ import annotations

import importlib
import json
import logging
import math
import mmap
import os
import sys
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from aioswap import _aio, pinned
from aioswap._aio import DEFAULT_ALIGNMENT as _ALIGN
from aioswap._adaptive import cached_bytes
from aioswap._util import dist_version, first_error, round_up
from aioswap.errors import AioswapError, AioswapWarning
from aioswap.handle import AioFile, AioHandle, IOFuture
from aioswap.safetensors import Header, SafetensorsError, read_header
from aioswap.tune.measure import cgroup_memory_limit, meminfo_available

__all__ = [
    "AioswapWeightsLoader",
    "LoaderStats",
    "OffloadFileError",
    "embedding_key",
    "memory_for_cache",
    "install",
    "installed",
    "uninstall",
]

_log = logging.getLogger("aioswap")

PathLike = Union[str, "os.PathLike[str]"]

_NAME = "OffloadedWeightsLoader"
# Modules of accelerate 1.x that bind the loader's name (big_modeling builds it by that name).
_EXPECTED = ("accelerate.utils.offload", "accelerate.utils", "accelerate.big_modeling")
_MERGE_GAP = 64 << 10         # neighbouring tensors of a file this close share one request
_BATCH_BYTES = 16 << 20       # default: a batch grows by following groups up to this
_KEPT_BATCHES = 2             # batches begun and not handed out kept beside the read-ahead
_CACHE_SHARE = 0.5            # through the page cache while the weights take at most this
#                               share of the memory there is for them
_CACHE_AHEAD = 1 << 30        # default read-ahead through the page cache, bytes
_KEPT_GROUPS = 2              # groups mapped and not all handed out, kept (page-cache way)


class OffloadFileError(AioswapError, ValueError):
    """An offload file is not what the offload index says (truncated, replaced, swapped)."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


@dataclass
class LoaderStats:
    """What an :class:`AioswapWeightsLoader` has done so far (direct / through the page
    cache: a batch is a batched submission / a group mapped, a request an O_DIRECT request
    / a mapped extent)."""

    batches: int = 0          # batched submissions / groups mapped
    requests: int = 0         # read requests in them / extents mapped
    bytes_read: int = 0       # bytes read into batches / bytes mapped and faulted in
    cached_bytes: int = 0     # direct: of those, copied from the page cache
    mapped: int = 0           # sparse weights handed out as file mappings
    hits: int = 0             # tensors served from a batch (or group) already there
    misses: int = 0           # tensors whose batch was read (or group mapped) on demand
    files_opened: int = 0
    advised_bytes: int = 0    # bytes asked into the page cache ahead of use (page-cache way;
    #                           ranges the cache holds already are not asked for)


@dataclass(frozen=True)
class _Entry:
    """Where one weight's bytes are, and what they are."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    cast: torch.dtype | None      # safetensors entries: the index's dtype, as stock applies it
    to_device: bool               # safetensors entries go to the loader's device (stock)


@dataclass
class _Batch:
    """One batched read: extents of files into one locked buffer."""

    groups: list[str]
    # key -> (entry, byte position of its data in buf)
    places: dict[str, tuple[_Entry, int]]
    buf: memoryview | None
    futures: list[IOFuture] = field(default_factory=list)
    nbytes: int = 0
    used: bool = False            # a tensor of it was handed out (the next one is submitted)
    left: int = 0                 # keys of it still in the loader's ready set
    done: bool = False            # its reads finished without error


def _dat_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``.dat`` entry (accelerate stores bf16/fp8 as int16/int8)."""
    if name == "bfloat16" or name.startswith("float8_"):
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"this torch has no dtype {name!r}")
        return value
    return torch.from_numpy(np.empty(0, dtype=np.dtype(name))).dtype


_ARENA_ROUND = 1 << 20        # batch buffers are whole MiB
_EAGER_HEADER = 64 << 20      # safetensors files this large have their headers read at once


def _bound(entries: Iterable[_Entry]) -> int:
    """Most bytes the extents of ``entries`` take in a batch buffer (each may start a
    block early, end on a block boundary and pull in a gap to its neighbour)."""
    return sum(round_up(e.nbytes, _ALIGN) + _ALIGN + _MERGE_GAP for e in entries)


_EMBEDDING_NAMES = ("wte", "wpe", "shared")


def embedding_key(key: str) -> bool:
    """Whether ``key`` names an embedding table's weight (a module named ``*embed*``,
    ``wte``, ``wpe`` or ``shared``): the default ``sparse`` test of
    :class:`AioswapWeightsLoader`."""
    module, _, leaf = key.rpartition(".")
    name = module.rpartition(".")[2]
    return leaf == "weight" and ("embed" in name or name in _EMBEDDING_NAMES)


def _group_of(key: str) -> str:
    """A key's read group: its prefix up to the first numeric component (a layer), else its
    module (the key without the last component)."""
    parts = key.split(".")
    for i in range(len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[:i + 1])
    return key.rpartition(".")[0]


def memory_for_cache() -> int:
    """Bytes of memory the page cache has for this process: ``MemAvailable`` of
    ``/proc/meminfo``, capped by its cgroup's memory limit (what decides the default way of
    reading of :class:`AioswapWeightsLoader`)."""
    avail = meminfo_available() or 0
    limit = cgroup_memory_limit()
    return avail if limit is None else min(avail, limit)


_SAMPLES = 8                  # pages of an extent looked up to tell whether it is cached


def _held(fd: int, offset: int, n: int) -> bool:
    """Whether the page cache holds ``n`` bytes at ``offset``, by ``_SAMPLES`` pages spread
    over the range (a ``cachestat`` of each: a whole range's costs ~16 us a MB, which on a
    forward whose weights are all cached is a tenth of its time). A page of the range not
    sampled and not cached is read by the page fault of its use."""
    page = mmap.PAGESIZE
    first, last = offset // page, (offset + n - 1) // page
    step = max(1, (last - first) // (_SAMPLES - 1))
    for p in sorted({*range(first, last, step), last}):
        if cached_bytes(fd, p * page, page) < page:
            return False
    return True


_PIECE = 32 << 20             # bytes of one read-ahead job
_READERS = 4                  # read-ahead threads


def _read_in(fd: int, offset: int, n: int) -> None:
    """Bring ``n`` bytes of ``fd`` at ``offset`` into the page cache: a shared read-only
    mapping of them faulted in (``MADV_POPULATE_READ``, the GIL released) and unmapped.

    Page faults read through the kernel's read-ahead in large folios; ``posix_fadvise
    (WILLNEED)`` fills the cache with 4 KiB pages, and every later mapping, fault and unmap
    of those costs about 14 times more (a cached 300 MB extent mapped, faulted in and
    unmapped: 34 against 2.4 ms): a forward after the first pays it for every weight."""
    base = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, offset + n - base, access=mmap.ACCESS_READ, offset=base)
    except (OSError, ValueError):    # ahead of use only: its own read raises
        return
    try:
        _aio.populate_read(m)
    except OSError:
        pass
    finally:
        m.close()


class _Advisor:
    """``_READERS`` threads that read ranges of files into the page cache
    (:func:`_read_in`), in pieces of ``_PIECE`` bytes taken in the order they were queued:
    the caller never waits for the drive. Jobs carry a duplicate of the caller's
    descriptor, closed once read."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._jobs: deque[tuple[int, int, int]] = deque()
        self._pid = -1

    def after_fork(self) -> None:
        """In a forked child: a fresh lock, no thread, and the parent's queued descriptors
        (inherited duplicates) closed."""
        self._cv = threading.Condition()
        while self._jobs:
            os.close(self._jobs.popleft()[0])
        self._pid = -1

    def put(self, fd: int, offset: int, n: int, first: bool = False) -> None:
        """Queue ``n`` bytes of ``fd`` (a descriptor of the caller's, duplicated here) at
        ``offset``; ``first``: before what is queued."""
        jobs = []
        end = offset + n
        while offset < end:
            jobs.append((os.dup(fd), offset, min(_PIECE, end - offset)))
            offset += _PIECE
        with self._cv:
            if self._pid != os.getpid():             # first use (a forked child: after_fork)
                self._pid = os.getpid()
                for i in range(_READERS):
                    threading.Thread(target=self._run, name=f"aioswap-readahead-{i}",
                                     daemon=True).start()
            if first:
                self._jobs.extendleft(reversed(jobs))
            else:
                self._jobs.extend(jobs)
            self._cv.notify(len(jobs))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                fd, offset, n = self._jobs.popleft()
            try:
                _read_in(fd, offset, n)
            finally:
                os.close(fd)


_advisor = _Advisor()
os.register_at_fork(after_in_child=_advisor.after_fork)


def _extents(entries: Mapping[str, _Entry]) -> list[tuple[str, int, int, list[str]]]:
    """(path, start, end, keys): the tensors of ``entries`` with bytes, neighbouring ones of
    a file (at most ``_MERGE_GAP`` apart) in one extent; starts aligned down to the block."""
    order = sorted((e.path, e.offset, k) for k, e in entries.items() if e.nbytes)
    extents: list[tuple[str, int, int, list[str]]] = []
    for path, offset, k in order:
        e = entries[k]
        if extents and extents[-1][0] == path and offset - extents[-1][2] <= _MERGE_GAP:
            p, s, end, ks = extents[-1]
            extents[-1] = (p, s, max(end, offset + e.nbytes), ks + [k])
        else:
            extents.append((path, offset // _ALIGN * _ALIGN, offset + e.nbytes, [k]))
    return extents


def _view(buf: Any, entry: _Entry, pos: int) -> torch.Tensor:
    """The tensor of ``entry`` at byte ``pos`` of ``buf`` (a batch buffer or a mapping,
    page-aligned): a view with a storage of its own that keeps ``buf`` alive, or a copy
    where the bytes are misaligned for the dtype."""
    n = entry.nbytes
    if n == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    size = entry.dtype.itemsize
    if pos % size:                               # misaligned in the file: own memory
        out = torch.empty(entry.shape, dtype=entry.dtype)
        out.view(-1).view(torch.uint8).copy_(
            torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=pos))
        return out
    return torch.frombuffer(buf, dtype=entry.dtype, count=n // size,
                            offset=pos).view(entry.shape)


class _Resources:
    """The handle and open files of a loader (closed by the loader or its finalizer)."""

    def __init__(self, max_open_files: int) -> None:
        self.handle: AioHandle | None = None
        self.files: OrderedDict[str, AioFile] = OrderedDict()
        self.sizes: dict[str, int] = {}          # size of each file when first opened
        self.plain: dict[str, int] = {}          # buffered fds (page-cache probes, mmap)
        self.mapfds: OrderedDict[str, int] = OrderedDict()   # buffered fds (page-cache way)
        self.max_open_files = max_open_files
        self.live: deque[_Batch] = deque()
        self.direct = True            # which way the loader reads (set at its first read)

    def size(self, path: str, stats: LoaderStats) -> int:
        """The size of ``path`` when first seen (opened through the way in use)."""
        if path not in self.sizes:
            if self.direct:
                self.open(path, stats)
            else:
                self.mapfd(path, stats)
        return self.sizes[path]

    def mapfd(self, path: str, stats: LoaderStats) -> int:
        """A plain (buffered, default read-ahead) descriptor of ``path`` for mappings and
        read-ahead advice; the size seen first is recorded, a change raises."""
        fd = self.mapfds.get(path)
        if fd is not None:
            self.mapfds.move_to_end(path)
            return fd
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        stats.files_opened += 1
        st = os.fstat(fd)
        size = st.st_size
        if self.sizes.setdefault(path, size) != size:
            os.close(fd)
            raise OffloadFileError(f"{path!r} changed size while in use ({self.sizes[path]} "
                                   f"bytes when first opened, {size} now)", path=path)
        self.mapfds[path] = fd
        while len(self.mapfds) > self.max_open_files:    # one .dat file per weight: cap fds
            os.close(self.mapfds.popitem(last=False)[1])
        return fd

    def open(self, path: str, stats: LoaderStats) -> AioFile:
        f = self.files.get(path)
        if f is not None:
            self.files.move_to_end(path)
            return f
        if self.handle is None:
            self.handle = AioHandle()
        f = self.handle.open(path, "r")
        stats.files_opened += 1
        self.files[path] = f
        size = f.size()
        if self.sizes.setdefault(path, size) != size:
            f.close()
            del self.files[path]
            raise OffloadFileError(f"{path!r} changed size while in use ({self.sizes[path]} "
                                   f"bytes when first opened, {size} now)", path=path)
        while len(self.files) > self.max_open_files:     # one .dat file per weight: cap fds
            name, old = self.files.popitem(last=False)
            old.close()                  # requests in flight on it finish first
            fd = self.plain.pop(name, -1)
            if fd >= 0:
                os.close(fd)
        return f

    def fd(self, path: str) -> int:
        """A buffered descriptor of ``path`` (opened with :meth:`open`)."""
        fd = self.plain.get(path)
        if fd is None:
            fd = self.plain[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            # a probe that lands on a page the kernel marked for read-ahead (a header read
            # leaves such marks) would start that read-ahead: not on this descriptor
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd

    def cached(self, path: str, mem: memoryview, offset: int) -> int:
        """Copy the leading part of ``path``'s range at ``offset`` that is in the page cache
        into ``mem``; return the bytes copied (all of them, or a multiple of the alignment).

        ``mincore`` says which part that is, reading nothing (a ``RWF_NOWAIT`` read that
        misses would read the range into the cache, and the drive would then serve it
        twice); the copy is ``RWF_NOWAIT``, so a page dropped meanwhile is left to direct
        I/O too, and the rest goes direct."""
        fd = self.fd(path)
        n = _aio.resident_prefix(fd, offset, len(mem))
        got = 0
        while got < n:
            try:
                r = os.preadv(fd, [mem[got:n]], offset + got, os.RWF_NOWAIT)
            except OSError:      # EAGAIN: dropped meanwhile; EOPNOTSUPP: no RWF_NOWAIT here
                break
            if r <= 0:
                break
            got += r
        return got if got == len(mem) else got // _ALIGN * _ALIGN

    def close(self) -> None:
        for b in self.live:
            for fut in b.futures:
                fut.exception()          # drain before release
        self.live.clear()
        for f in self.files.values():
            f.close()
        self.files.clear()
        for fd in self.plain.values():
            os.close(fd)
        self.plain.clear()
        for fd in self.mapfds.values():
            os.close(fd)
        self.mapfds.clear()
        # self.sizes stays: the loader keeps what it learnt of the files (headers, places),
        # so a file reopened with another size is refused, not misread
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class AioswapWeightsLoader(Mapping[str, torch.Tensor]):
    """accelerate's ``OffloadedWeightsLoader``, reading through aioswap.

    Same constructor and ``Mapping`` behaviour as the stock class (``state_dict`` entries
    first, then the ``index``; ``index`` defaults to ``save_folder/index.json``), same
    tensors (bit for bit), same attributes (``state_dict``, ``save_folder``, ``index``,
    ``all_keys``, ``device``).

    Parameters
    ----------
    state_dict : dict of str to torch.Tensor, optional
        Weights held in memory (returned as they are).
    save_folder : str or os.PathLike, optional
        Where ``.dat`` entries (and ``index.json``) are.
    index : Mapping, optional
        Weight name to ``{"dtype", "shape"}`` (a ``.dat`` file ``save_folder/<name>.dat``) or
        ``{"safetensors_file", "weight_name", "dtype"}`` (a tensor of a safetensors file).
    device : str, int or torch.device, optional
        Where safetensors entries go (default CPU), as in the stock class.
    batch_bytes : int
        A batch grows by the groups that follow its first one up to this many bytes.
    max_open_files : int
        Most files kept open at once (least recently used ones are closed).
    read_ahead : int, optional
        Direct: bytes of batches read ahead of the one in use (whole batch buffers, at least
        one); default one batch. Through the page cache: bytes of the following groups asked
        into the cache (at least one group); default 1 GiB, at most a quarter of
        :func:`memory_for_cache`.
    sparse : callable, optional
        ``sparse(key)`` is true for weights the model uses sparsely (an embedding looks up
        the rows of its tokens): they are handed out as private file mappings, as the stock
        loader hands out every safetensors weight, so a forward reads only the pages it
        touches. Default :func:`embedding_key`; ``lambda key: False`` reads them whole.
    page_cache : bool, optional
        True: read through the page cache (a forward after the first runs at memory speed);
        False: direct (``O_DIRECT``, fills no cache: for models larger than memory). None
        (default): as ``install(page_cache=)`` said; unless it said, through the page cache
        when the offloaded weights take at most half of :func:`memory_for_cache`, decided at
        the first read. :attr:`through_page_cache` says what was chosen.

    Raises
    ------
    ValueError
        None of ``state_dict``, ``save_folder``, ``index`` given.

    Notes
    -----
    Lifetime: tensors handed out are views of page-locked memory with storages of their own,
    freed with the last view. The loader holds the read-ahead plus at most two batches begun
    and not handed out, each one batch buffer. :meth:`close` frees the
    handle and files; the loader reopens them when used again. Thread-safe (one lock).
    """

    def __init__(self, state_dict: Optional[dict[str, torch.Tensor]] = None,
                 save_folder: Optional[PathLike] = None,
                 index: Optional[Mapping[str, Any]] = None,
                 device: Any = None, *, batch_bytes: int = _BATCH_BYTES,
                 max_open_files: int = 512,
                 sparse: Optional[Callable[[str], bool]] = None,
                 read_ahead: Optional[int] = None,
                 page_cache: Optional[bool] = None) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("Need either a `state_dict`, a `save_folder` or an `index` "
                             "containing offloaded weights.")
        self.state_dict: dict[str, torch.Tensor] = {} if state_dict is None else state_dict
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            with open(os.path.join(save_folder, "index.json"), encoding="utf-8") as fh:
                index = json.load(fh)
        self.index: Mapping[str, Any] = {} if index is None else index
        # O(n): dict membership, not the stock class's list scan
        keys = dict.fromkeys(self.state_dict)
        keys.update(dict.fromkeys(self.index))
        self.all_keys: list[str] = list(keys)
        self.device = device
        self.batch_bytes = int(batch_bytes)
        self.read_ahead = None if read_ahead is None else max(0, int(read_ahead))
        self.sparse: Callable[[str], bool] = embedding_key if sparse is None else sparse
        self.page_cache = _page_cache if page_cache is None else page_cache
        self._through: bool | None = None
        self._views: dict[str, tuple[Any, _Entry, int]] = {}  # key -> its mapping, not handed out
        self._mapped_groups: deque[str] = deque()            # groups with views kept, oldest first
        self._advised: dict[str, int] = {}                   # group -> bytes asked ahead, not used
        self._ahead: int | None = None       # bytes to ask ahead (page-cache way), learnt once
        self.stats = LoaderStats()
        self._lock = threading.RLock()
        self._res = _Resources(max(1, int(max_open_files)))
        self._finalizer = weakref.finalize(self, self._res.close)
        self._entries: dict[str, _Entry] = {}
        self._headers: dict[str, Header] = {}
        self._groups: dict[str, list[str]] | None = None     # group -> its index keys
        self._group_key: dict[str, str] = {}
        self._next: dict[str, str] = {}                      # group -> the group used next
        self._last: str | None = None
        self._seen: set[str] = set()                         # groups used so far
        self._peeked: dict[str, Header] = {}   # headers read to choose the way, not checked yet
        self._ready: dict[str, _Batch] = {}                  # key -> its batch, not handed out
        self._arena = 0               # bytes of every batch buffer (set on first read)
        self._current: _Batch | None = None                  # the batch _take serves from
        _loaders[id(self)] = self

    # -- Mapping -----------------------------------------------------------------------------
    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        if key not in self.index:
            raise KeyError(key)
        with self._lock:
            through = self._through_cache()
            if self.sparse(key):
                t, entry = self._mapped(key)
            elif through:
                t, entry = self._take_cached(key)
            else:
                t, entry = self._take(key)
        if entry.cast is not None and t.dtype != entry.cast:
            t = t.to(entry.cast)
        if entry.to_device:
            device = torch.device("cpu" if self.device is None else self.device)
            if t.device != device:
                t = t.to(device)
        return t

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)

    def __repr__(self) -> str:
        return (f"<AioswapWeightsLoader {len(self.all_keys)} weights "
                f"({len(self.index)} offloaded)>")

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for reads in flight, close the files and the handle. Idempotent; the loader
        opens them again when used."""
        with self._lock:
            self._ready.clear()
            self._views.clear()
            self._mapped_groups.clear()
            self._advised.clear()
            self._res.close()

    def __enter__(self) -> AioswapWeightsLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------------
    @property
    def through_page_cache(self) -> bool | None:
        """How this loader reads: True through the page cache, False direct, None not
        decided yet (before the first read; see ``page_cache``)."""
        return self._through

    def _through_cache(self) -> bool:
        if self._through is None:
            if self.page_cache is not None:
                through = bool(self.page_cache)
            else:
                need, room = self._offloaded_bytes(), memory_for_cache()
                through = need <= _CACHE_SHARE * room
                _log.info("aioswap: %d bytes of offloaded weights, %d bytes of memory for the "
                          "page cache: reading %s", need, room,
                          "through the page cache" if through else "direct (O_DIRECT)")
            self._through = through
            self._res.direct = not through
        return self._through

    def _offloaded_bytes(self) -> int:
        """Bytes of the offloaded weights (a file's size where its header cannot be read:
        its own read raises)."""
        total = 0
        by_file: dict[str, list[str]] = {}
        for key, info in self.index.items():
            if key in self.state_dict:
                continue
            st_file = info.get("safetensors_file")
            if st_file is not None:
                by_file.setdefault(os.fspath(st_file), []).append(info.get("weight_name", key))
                continue
            try:
                total += math.prod(int(d) for d in info["shape"]) * \
                    _dat_dtype(str(info["dtype"])).itemsize
            except Exception:            # its own read raises
                continue
        for path, names in by_file.items():
            try:
                header = self._headers.get(path) or self._peeked.get(path)
                if header is None:
                    header = self._peeked[path] = read_header(path)
                total += sum(header.tensors[n].nbytes for n in names if n in header.tensors)
            except Exception:
                try:
                    total += os.stat(path).st_size
                except OSError:
                    pass
        return total

    def _used(self, group: str) -> None:
        """Record that ``group`` is used now (the order read ahead next time)."""
        if self._last is not None and self._last != group:
            self._next[self._last] = group
        self._last = group
        self._seen.add(group)

    def _take_cached(self, key: str) -> tuple[torch.Tensor, _Entry]:
        group = self._group(key)
        self._used(group)
        got = self._views.pop(key, None)
        if got is None:
            self.stats.misses += 1
            self._map_group(group)
            got = self._views.pop(key)
        else:
            self.stats.hits += 1
        m, entry, pos = got
        return _view(m, entry, pos), entry

    def _map_group(self, group: str) -> None:
        """Map the extents of ``group`` (after asking for the groups that follow it to be
        read into the page cache) and fault in what the cache does not hold; its keys' views
        wait in ``_views``."""
        assert self._groups is not None
        entries = {k: self._entry(k) for k in self._groups[group]}
        # checked again even when read ahead: the cache may have dropped it since
        extents = _extents(entries)
        _, held = self._advise(extents, wait=True)
        if len(held) < len(extents) and not self._advised.get(group):
            # not in the cache and not asked ahead: the cache dropped what the last
            # forward found there (or this is the first): what it found counts no more
            self._advised = {}
        self._advise_after(group)
        maps: list[tuple[Any, int, int, list[str], bool]] = []
        for path, start, end, ks in extents:
            fd = self._res.mapfd(path, self.stats)
            size = os.fstat(fd).st_size
            if size != self._res.sizes[path]:            # a mapping past the end is SIGBUS
                raise OffloadFileError(f"{path!r} changed size while in use "
                                       f"({self._res.sizes[path]} bytes when first opened, "
                                       f"{size} now)", path=path)
            base = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            maps.append((mmap.mmap(fd, end - base, access=mmap.ACCESS_COPY, offset=base),
                         base, end, ks, (path, start) in held))
        for m, base, end, ks, cached in maps:
            try:
                # one wait for an extent the drive reads (GIL released); one the page cache
                # holds is left to the page faults of its use, which map 16 pages at a time
                # (faster than populating page by page; a forward after the first)
                if not cached:
                    _aio.populate_read(m)
            except OSError as exc:
                raise OSError(exc.errno, f"reading offloaded weights {ks[0]!r}... from "
                              f"{entries[ks[0]].path!r} (bytes {base}..{end}): "
                              f"{os.strerror(exc.errno or 0)}") from exc
            for k in ks:
                self._views[k] = (m, entries[k], entries[k].offset - base)
            self.stats.requests += 1
            self.stats.bytes_read += end - base
        for k, e in entries.items():
            if not e.nbytes:
                self._views[k] = (None, e, 0)
        self.stats.batches += 1
        # bound what waits to be handed out: views of the last few groups (a caller that
        # skips keys of a group leaves them here)
        if group in self._mapped_groups:
            self._mapped_groups.remove(group)
        self._mapped_groups.append(group)
        while len(self._mapped_groups) > _KEPT_GROUPS:
            old = self._mapped_groups.popleft()
            for k in self._groups[old]:
                self._views.pop(k, None)

    def _advise(self, extents: list[tuple[str, int, int, list[str]]],
                wait: bool) -> tuple[int, set[tuple[str, int]]]:
        """Have the ``extents`` (of :func:`_extents`) the page cache does not hold read into
        it; returns the bytes asked ahead of use and the extents (path, start) it holds.
        ``wait``: the caller faults them in next (the read-ahead threads help, before
        anything else), else the read-ahead threads read them."""
        nbytes = 0
        held: set[tuple[str, int]] = set()
        for path, start, end, _ in extents:
            fd = self._res.mapfd(path, self.stats)
            if _held(fd, start, end - start):
                held.add((path, start))  # (a forward after the first)
                continue
            # ahead: behind what is queued; now: first, the caller faulting it in as well
            _advisor.put(fd, start, end - start, first=wait)
            if not wait:
                nbytes += end - start
        self.stats.advised_bytes += nbytes
        return nbytes, held

    def _advise_after(self, group: str) -> None:
        """Ask for the groups that follow ``group`` (as recorded) to be read into the page
        cache, until ``read_ahead`` bytes are asked for and not used yet."""
        assert self._groups is not None
        if self._ahead is None:
            # by default at most a quarter of the memory the page cache has (under a cgroup
            # limit, the group's page cache counts against it), learnt once
            self._ahead = (min(_CACHE_AHEAD, memory_for_cache() // 4)
                           if self.read_ahead is None else self.read_ahead)
        budget = self._ahead
        ahead = 0
        chain: dict[str, int] = {}       # what is asked ahead now (older asks are forgotten)
        nxt = self._successor(group)
        # Past the last layer of a first forward nothing is recorded yet: what no forward has
        # used so far (the final norm, the head) comes next, in the index's order.
        rest: Iterator[str] = iter(g for g in self._groups if g not in self._seen)
        while True:
            if nxt is None:
                nxt = next((g for g in rest if g not in chain and g != group), None)
            if not (nxt is not None and nxt != group and nxt not in chain
                    and (ahead < budget or not chain)):
                break
            n = self._advised.get(nxt)
            if n is None:
                try:
                    entries = {k: self._entry(k) for k in self._groups[nxt]}
                except Exception as exc:     # read ahead only: its own read raises
                    _log.debug("aioswap: no read-ahead of %s: %s", nxt, exc)
                    break
                n = self._advise(_extents(entries), wait=False)[0]
            chain[nxt] = n
            ahead += n
            nxt = self._successor(nxt)
        self._advised = chain

    def _take(self, key: str) -> tuple[torch.Tensor, _Entry]:
        group = self._group(key)
        self._used(group)
        batch = self._ready.pop(key, None)
        if batch is None:
            self.stats.misses += 1
            batch = self._submit(group)
            del self._ready[key]
        else:
            self.stats.hits += 1
        self._current = batch            # never retired by the read-ahead below
        try:
            if not batch.used:
                # the next batches go to the drive before this one is waited for: their
                # buffers are set up while the drive reads this one, and it never idles
                batch.used = True
                self._prefetch_after(batch)
            self._finish(batch)
            entry, pos = batch.places[key]
            assert batch.buf is not None or not entry.nbytes, \
                "a batch's buffer is dropped only after its tensors"
            t = _view(batch.buf, entry, pos)
            batch.left -= 1
            if batch.left <= 0:
                batch.buf = None         # all handed out: the tensors own the memory now
                try:
                    self._res.live.remove(batch)
                except ValueError:
                    pass
                # what follows may be this batch's own groups again (a model that fits in
                # one batch, the next token's forward): read it now that they are handed out
                self._prefetch_after(batch)
        finally:
            self._current = None
        return t, entry

    def _group(self, key: str) -> str:
        if self._groups is None:         # built on first use, not in the constructor
            groups: dict[str, list[str]] = {}
            for k in self.index:
                if k in self.state_dict or self.sparse(k):
                    continue
                g = _group_of(k)
                self._group_key[k] = g
                groups.setdefault(g, []).append(k)
            self._groups = groups
        return self._group_key[key]

    def _mapped(self, key: str) -> tuple[torch.Tensor, _Entry]:
        """A sparse weight as a private (copy-on-write) mapping of its bytes."""
        entry = self._entry(key)
        self.stats.mapped += 1
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype), entry
        self._res.size(entry.path, self.stats)    # (opened again after close())
        fd = self._res.fd(entry.path)
        size = os.fstat(fd).st_size
        if size != self._res.sizes[entry.path]:      # a mapping past the end is SIGBUS
            raise OffloadFileError(f"{entry.path!r} changed size while in use "
                                   f"({self._res.sizes[entry.path]} bytes when first "
                                   f"opened, {size} now)", path=entry.path)
        start = entry.offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(fd, entry.offset + entry.nbytes - start, access=mmap.ACCESS_COPY,
                      offset=start)
        pos = entry.offset - start
        size = entry.dtype.itemsize
        if pos % size:                           # misaligned in the file: own memory
            out = torch.empty(entry.shape, dtype=entry.dtype)
            out.view(-1).view(torch.uint8).copy_(
                torch.frombuffer(m, dtype=torch.uint8, count=entry.nbytes, offset=pos))
            return out, entry
        # the tensor holds the mapping (torch keeps the buffer's exporter alive)
        return torch.frombuffer(m, dtype=entry.dtype, count=entry.nbytes // size,
                                offset=pos).view(entry.shape), entry

    def _successor(self, group: str) -> str | None:
        nxt = self._next.get(group)
        if nxt is not None:
            return nxt
        # nothing recorded yet (first forward): layer N is followed by layer N + 1
        head, _, num = group.rpartition(".")
        if num.isdigit():
            guess = f"{head}.{int(num) + 1}" if head else str(int(num) + 1)
            assert self._groups is not None
            if guess in self._groups:
                return guess
        return None

    def _sized(self, key: str) -> bool:
        """Whether the size of ``key`` may be learnt now: a ``.dat`` entry, or a safetensors
        file whose header is read or large. (Reading the header of a file smaller than the
        kernel's read-ahead window would pull the whole file into the page cache; such a
        file's groups are small, and its header is read when it is used.)"""
        if key in self._entries:
            return True
        st_file = self.index[key].get("safetensors_file")
        if st_file is None:
            return True
        path = os.fspath(st_file)
        return path in self._headers or os.stat(path).st_size >= _EAGER_HEADER

    def _entry(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        info = self.index[key]
        st_file = info.get("safetensors_file")
        if st_file is not None:
            entry = self._safetensors_entry(key, os.fspath(st_file),
                                            info.get("weight_name", key), info.get("dtype"))
        else:
            entry = self._dat_entry(key, info)
        self._entries[key] = entry
        return entry

    def _safetensors_entry(self, key: str, path: str, name: str, cast: str | None) -> _Entry:
        self._res.size(path, self.stats)
        header = self._headers.get(path)
        if header is None:
            try:
                # the whole header (read already when the way of reading was chosen); a
                # truncated file fails
                header = self._peeked.pop(path, None) or read_header(path)
            except SafetensorsError as exc:
                raise OffloadFileError(f"offloaded weight {key!r}: {exc}", path=path) from exc
            if self._res.sizes[path] != header.data_offset + header.data_bytes:
                raise OffloadFileError(f"{path!r} changed while it was opened", path=path)
            self._headers[path] = header
        t = header.tensors.get(name)
        if t is None:
            raise OffloadFileError(
                f"{path!r} has no tensor {name!r}, which the offload index names for "
                f"{key!r}: the file is not the checkpoint shard the index was built from "
                f"(replaced or swapped?)", path=path)
        dtype = t.torch_dtype
        if dtype is None:
            raise OffloadFileError(f"{path!r}: tensor {name!r} has dtype {t.dtype}, which "
                                   f"this torch cannot hold", path=path)
        cast_dtype = None
        if cast is not None:
            value = getattr(torch, cast, None)
            if not isinstance(value, torch.dtype):
                raise ValueError(f"offload index entry {key!r}: unknown dtype {cast!r}")
            cast_dtype = value
        return _Entry(path, header.data_offset + t.begin, t.nbytes, dtype, t.shape,
                      cast_dtype, True)

    def _dat_entry(self, key: str, info: Mapping[str, Any]) -> _Entry:
        if self.save_folder is None:
            raise OffloadFileError(f"offload index entry {key!r} is a .dat file but the "
                                   f"loader has no save_folder", path=str(key))
        path = os.path.join(os.fspath(self.save_folder), f"{key}.dat")
        dtype = _dat_dtype(str(info["dtype"]))
        shape = tuple(int(s) for s in info["shape"])
        nbytes = math.prod(shape or (1,)) * dtype.itemsize    # a scalar is stored as (1,)
        size = self._res.size(path, self.stats)
        if size != nbytes:
            raise OffloadFileError(
                f"{path!r} holds {size} bytes, but the offload index says {key!r} is "
                f"{info['dtype']} of shape {list(shape)} ({nbytes} bytes): the file is "
                f"truncated or belongs to another weight", path=path)
        return _Entry(path, 0, nbytes, dtype, shape, None, False)

    def _submit(self, first: str) -> _Batch:
        """Read group ``first`` (whose entries must resolve: errors are the caller's) and
        the groups after it up to ``batch_bytes``, in one submission."""
        assert self._groups is not None
        chosen = [first]
        entries = {k: self._entry(k) for k in self._groups[first]}
        arena = self._arena_bytes()
        size = _bound(entries.values())
        nxt = self._successor(first)
        while (size < self.batch_bytes and nxt is not None and nxt not in chosen
               and not any(k in self._ready for k in self._groups[nxt])):
            try:
                more = {k: self._entry(k) for k in self._groups[nxt]}
            except Exception:            # its own request will raise it
                break
            if size + _bound(more.values()) > arena:
                break
            chosen.append(nxt)
            entries.update(more)
            size += _bound(more.values())
            nxt = self._successor(nxt)
        return self._read(chosen, entries)

    def _arena_bytes(self) -> int:
        """The size of every batch buffer: the largest group's extents, or ``batch_bytes``.

        One size for all means that a buffer freed with the last tensor of its batch is the
        one the next batch gets (the locked-memory cache keeps freed buffers of a size for
        that size): after the first few batches no fresh memory is faulted in (on VMs that
        back guest memory lazily, slower than the drive), and what the loader keeps resident
        is a few buffers, not one of every size it ever read."""
        if not self._arena:
            assert self._groups is not None
            largest = 0
            for keys in self._groups.values():
                try:
                    if all(self._sized(k) for k in keys):
                        largest = max(largest, _bound(self._entry(k) for k in keys))
                except Exception:        # its own request will raise it
                    continue
            self._arena = round_up(max(largest, self.batch_bytes, 1), _ARENA_ROUND)
        return self._arena

    def _depth(self) -> int:
        """Batches read ahead of the one in use: ``read_ahead`` bytes of buffers (one by
        default), at least one."""
        if self.read_ahead is None:
            return 1
        return max(1, self.read_ahead // self._arena_bytes())

    def _prefetch_after(self, batch: _Batch) -> None:
        """Submit the batches that follow ``batch`` (as recorded) until ``_depth`` of them
        are submitted and not yet used."""
        assert self._groups is not None
        ahead = sum(1 for b in self._res.live if not b.used)
        depth = self._depth()
        seen = set(batch.groups)
        nxt = self._successor(batch.groups[-1])
        while ahead < depth and nxt is not None and nxt not in seen:
            seen.add(nxt)
            ready = [self._ready[k] for k in self._groups[nxt] if k in self._ready]
            if ready:                    # read already: look past it
                nxt = self._successor(ready[0].groups[-1])
                seen.update(ready[0].groups)
                continue
            try:
                got = self._submit(nxt)
            except Exception as exc:     # read ahead only: the request for it will raise
                _log.debug("aioswap: no read-ahead of %s: %s", nxt, exc)
                return
            ahead += 1
            seen.update(got.groups)
            nxt = self._successor(got.groups[-1])

    def _read(self, groups: list[str], entries: dict[str, _Entry]) -> _Batch:
        total = 0
        layout = []
        for path, start, end, ks in _extents(entries):
            f = self._res.open(path, self.stats)
            n = min(round_up(end, _ALIGN), self._res.sizes[path]) - start
            layout.append((path, f, start, n, total, ks))
            total += round_up(n, _ALIGN)
        buf = (memoryview(pinned.allocate(max(total, self._arena_bytes()), strict=False))
               if total else None)
        places: dict[str, tuple[_Entry, int]] = {
            k: (e, 0) for k, e in entries.items() if not e.nbytes}
        requests = []
        for path, f, start, n, pos, ks in layout:
            assert buf is not None
            # what the page cache holds is copied from it (a warm forward at memory speed);
            # the rest is read from the drive with O_DIRECT, filling no cache
            got = self._res.cached(path, buf[pos:pos + n], start)
            self.stats.bytes_read += n
            self.stats.cached_bytes += got
            if got < n:
                requests.append((torch.frombuffer(buf, dtype=torch.uint8, count=n - got,
                                                  offset=pos + got), f, start + got))
            for k in ks:
                places[k] = (entries[k], pos + entries[k].offset - start)
        batch = _Batch(groups, places, buf, nbytes=total)
        if requests:
            assert self._res.handle is not None
            futures = self._res.handle.pread_many(requests, async_op=True)
            batch.futures = [f for f in futures if isinstance(f, IOFuture)]
        self.stats.batches += 1
        self.stats.requests += len(requests)
        live = self._res.live
        live.append(batch)
        for k in places:
            old_batch = self._ready.get(k)
            if old_batch is not None:            # read again: the older copy is not used
                old_batch.left -= 1
            self._ready[k] = batch
        batch.left = len(places)
        # bound what waits to be used: the read-ahead, plus batches begun but not handed out
        # (a caller that skips keys of a group), the oldest of which go first
        while len(live) > self._depth() + _KEPT_BATCHES:
            old = next((b for b in live if b is not self._current and b is not batch), None)
            if old is None:
                break
            live.remove(old)
            for k in old.places:
                if self._ready.get(k) is old:
                    del self._ready[k]
            old.left = 0
            for fut in old.futures:
                fut.exception()                  # drain before release
            old.buf = None
        # (the caller's key is in this batch's places: _take pops it right after)
        return batch

    def _finish(self, batch: _Batch) -> None:
        if batch.done:
            return
        first = first_error(batch.futures)     # waits (hurried); every one, then raise
        if first is not None:
            for k in batch.places:
                if self._ready.get(k) is batch:
                    del self._ready[k]
            try:
                self._res.live.remove(batch)
            except ValueError:
                pass
            batch.buf = None
            raise first
        batch.done = True


# ----------------------------------------------------------------------------------- writes

_WRITE_FILES = 128            # files of offload_state_dict open (and written) at once


def _dat_bytes(weight: torch.Tensor, name: str, folder: PathLike,
               index: dict[str, Any] | None) -> tuple[str, torch.Tensor]:
    """Stock ``offload_weight``'s file for ``weight`` and the bytes it holds (a flat uint8 CPU
    tensor); records the index entry stock records."""
    t = weight.detach()
    if t.dtype == torch.bfloat16:            # numpy has no bf16/fp8: stock stores raw bytes
        dtype = "bfloat16"
    elif str(t.dtype).startswith("torch.float8_"):
        dtype = str(t.dtype).split(".")[1]
    else:                                    # numpy's name; TypeError where numpy has none
        dtype = str(torch.empty(0, dtype=t.dtype).numpy().dtype)
    path = os.path.join(os.fspath(folder), f"{name}.dat")
    if index is not None:
        index[name] = {"dtype": dtype, "shape": list(t.shape)}
    return path, t.cpu().contiguous().reshape(-1).view(torch.uint8)


def _write_dat(items: list[tuple[str, torch.Tensor]]) -> None:
    """Write each ``(path, bytes)`` as a whole file (created 0600 or truncated), all
    submitted at once, then fsynced (stock's ``np.memmap.flush`` syncs each file too)."""
    handle = _write_handle()
    for i in range(0, len(items), _WRITE_FILES):
        files: list[AioFile] = []
        futures: list[IOFuture] = []
        try:
            for path, data in items[i:i + _WRITE_FILES]:
                f = handle.open(path, "w")
                files.append(f)
                if data.numel():
                    futures.append(handle.pwrite(data, f, 0, async_op=True))
            err = first_error(futures)
            if err is not None:
                raise err
            for f in files:
                f.fsync()
        finally:
            first_error(futures)             # drain before the tensors may go
            for f in files:
                f.close()


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: PathLike,
                   index: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """accelerate's ``offload_weight`` (same file, bytes and index entry), written through
    aioswap: ``offload_folder/<weight_name>.dat`` holds the tensor's bytes (bf16 and fp8
    as stored by accelerate, raw), mode 0600 when created. Returns ``index``."""
    _write_dat([_dat_bytes(weight, weight_name, offload_folder, index)])
    return index


def offload_state_dict(save_dir: PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """accelerate's ``offload_state_dict``: one ``.dat`` file per tensor (as
    :func:`offload_weight`) and ``index.json`` updated by accelerate's own
    ``save_offload_index``; the files are written concurrently."""
    offload = importlib.import_module("accelerate.utils.offload")
    os.makedirs(save_dir, exist_ok=True)
    index: dict[str, Any] = {}
    _write_dat([_dat_bytes(t, name, save_dir, index) for name, t in state_dict.items()])
    offload.save_offload_index(index, save_dir)


_writer: AioHandle | None = None


def _write_handle() -> AioHandle:
    global _writer
    with _state_lock:
        if _writer is None or _writer.closed:
            _writer = AioHandle()
        return _writer


# ---------------------------------------------------------------------------------- install

_state_lock = threading.RLock()
# every loader made (a Mapping is unhashable, so by id)
_page_cache: Optional[bool] = None      # install()'s page_cache: loaders' default
_loaders: weakref.WeakValueDictionary[int, AioswapWeightsLoader] = weakref.WeakValueDictionary()
_stock: type | None = None
_patched: dict[str, Any] = {}        # module name -> its binding before install
_WRITERS = {"offload_weight": offload_weight, "offload_state_dict": offload_state_dict}
_stock_writers: dict[str, Any] = {}  # name -> accelerate's function, while installed


def _rebind(old: Any, new: Any, attr: str = _NAME) -> list[str]:
    """Point every imported module's ``attr`` that is ``old`` at ``new``."""
    done = []
    for name, module in list(sys.modules.items()):
        d = getattr(module, "__dict__", None)
        if name != __name__ and isinstance(d, dict) and d.get(attr) is old:
            d[attr] = new
            done.append(name)
    return done


def install(*, page_cache: Optional[bool] = None) -> None:
    """Make accelerate build :class:`AioswapWeightsLoader` wherever it builds its
    ``OffloadedWeightsLoader``. Idempotent.

    ``page_cache`` is how the loaders built from now on read (their ``page_cache``): None
    (default) chooses per loader by the memory there is; True or False forces it.

    Every imported module that bound the name to accelerate's class (``accelerate.utils``,
    ``accelerate.utils.offload``, ``accelerate.big_modeling``, and any other) gets aioswap's
    class; modules imported later find it in accelerate's. Models dispatched before the
    call keep the loader they have.

    Raises
    ------
    ImportError
        accelerate is not installed (nothing is changed).
    RuntimeError
        accelerate has no ``OffloadedWeightsLoader`` where it is expected (nothing is
        changed).

    Warns
    -----
    AioswapWarning
        One of the modules accelerate 1.x builds the loader from does not bind the name
        (named in the message); that path keeps the stock loader.
    """
    global _stock, _page_cache
    with _state_lock:
        _page_cache = None if page_cache is None else bool(page_cache)
        if _stock is not None:
            return
        try:
            offload = importlib.import_module("accelerate.utils.offload")
            for name in _EXPECTED:
                importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"aioswap.integrations.accelerate.install(): accelerate is not "
                              f"importable ({exc}); pip install accelerate") from exc
        stock = getattr(offload, _NAME, None)
        if not isinstance(stock, type):
            raise RuntimeError(f"aioswap.integrations.accelerate.install(): could not patch: "
                               f"accelerate.utils.offload has no class {_NAME} (accelerate "
                               f"{dist_version('accelerate')})")
        done = _rebind(stock, AioswapWeightsLoader)
        _stock = stock
        for name in done:
            _patched[name] = stock
        for attr, ours in _WRITERS.items():
            theirs = getattr(offload, attr, None)
            if callable(theirs):
                _stock_writers[attr] = theirs
                _log.info("aioswap: %s replaced in %s", attr,
                          ", ".join(_rebind(theirs, ours, attr)))
        missing = [m for m in _EXPECTED if m not in done]
        if missing:
            warnings.warn(f"aioswap.integrations.accelerate.install() could not patch "
                          f"{', '.join(f'{m}.{_NAME}' for m in missing)} (accelerate "
                          f"{dist_version('accelerate')}): weights loaded through "
                          f"{'it' if len(missing) == 1 else 'them'} use the stock loader",
                          AioswapWarning, stacklevel=2)
        _log.info("aioswap: %s replaced in %s", _NAME, ", ".join(done))


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _stock is not None


def uninstall() -> None:
    """Undo :func:`install` and close the handles and files of every loader made since.
    Idempotent. Models dispatched while it was installed keep their (now closed) loaders,
    which reopen their files when used again."""
    global _stock, _writer, _page_cache
    with _state_lock:
        _page_cache = None
        if _stock is not None:
            _rebind(AioswapWeightsLoader, _stock)
            _stock = None
            _patched.clear()
        for attr, theirs in _stock_writers.items():
            _rebind(_WRITERS[attr], theirs, attr)
        _stock_writers.clear()
        for loader in list(_loaders.values()):
            loader.close()
        if _writer is not None:
            _writer.close()
            _writer = None
