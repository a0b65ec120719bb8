"""diffusers' group offloading to disk, read with direct I/O, read ahead, and verified.

``enable_group_offload(..., offload_to_disk_path=...)`` (``apply_group_offloading``) writes
each group of modules to ``group_<hash>.safetensors`` when it is first offloaded and reads
the whole file back on every onload. Stock diffusers loads it with ``safetensors.torch``,
one group at a time, and uses a file that already exists at that path without looking at
it: a second model offloaded to the same directory runs with the first one's weights.

After :func:`install`, two methods of diffusers' ``ModuleGroup`` are aioswap's:
``_offload_to_disk`` and ``_onload_from_disk`` (``onload_``/``offload_`` call them only for
groups offloaded to disk; memory offloading is untouched).

Writing (the first offload of a group)
--------------------------------------
The group's weights are hashed (xxh3-64, or crc32 without the xxhash package) in the
group's tensor order. If the group file does not exist, it is written with
:func:`aioswap.safetensors.save_file` (the bytes stock diffusers writes, so every tensor
lands at the same alignment and CPU kernels give the same bits; direct I/O, fsync, renamed
into place, so a crash never leaves half a file), and a manifest beside it,
``group_<hash>.safetensors.aioswap.json``, records the group id, algorithm and checksum. If
the file exists, it is used only when its header names the group's tensors with their
dtypes and shapes, its size is the header's, and its manifest (if any: stock diffusers
writes none) records the weights' checksum; anything else raises :class:`OffloadFileError`
naming the file. When hooks are applied again to a model whose weights are offloaded (LoRA
loading does this, and so may a new grouping), the stock code would write the placeholders
that stand for offloaded weights; here weights offloaded through aioswap are taken from the
file they were written to.

Reading (every onload)
----------------------
The file is opened and ``fstat``-ed. The first time a version of it (device, inode, size,
mtime, ctime) is used, its header is checked as above and the bytes read are hashed and
compared with the checksum of the weights; later onloads of the same version only compare
the ``fstat``. A file replaced, rewritten, truncated or removed is therefore re-verified or
refused with :class:`OffloadFileError`; it is never used silently. The data region is read
in one request into page-locked memory (from aioswap's locked-memory cache, given back
when the group is offloaded again); each tensor is a view of it. The request is an
``O_DIRECT`` read, or, when the page cache holds the file (``cachestat``; ``AIOSWAP_READ``
forces either way, see :mod:`aioswap.safetensors`), a copy from the page cache on aioswap's
copy threads.

The order in which groups are onloaded is recorded; as soon as a group's read is
submitted, the files of the groups that followed it last time are submitted too (at least
one group, then up to ``readahead_bytes``), so they are read while this group computes.
A read ahead is used only if the file has not changed since it was submitted.

With ``use_stream=True`` the host tensors are copied to the device on diffusers' stream
(``non_blocking``) and kept alive until the stream has passed the copy.

Without diffusers installed, importing this module works and :func:`install` raises
:class:`ImportError`.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from aioswap import pinned
from aioswap._aio import DEFAULT_ALIGNMENT as _ALIGN
from aioswap._adaptive import Reader
from aioswap._checksum import algorithms, host_bytes, new_hasher
from aioswap._util import dist_version, first_error, import_for, round_up, write_atomic
from aioswap.errors import AioswapError, AioswapWarning
from aioswap.handle import AioFile, shared_handle
from aioswap.integrations.accelerate import OffloadFileError
from aioswap.safetensors import Header, SafetensorsError, read_header, save_file

__all__ = [
    "OffloadFileError",
    "OffloadStats",
    "install",
    "installed",
    "stats",
    "uninstall",
]

_log = logging.getLogger("aioswap")

_MODULE = "diffusers.hooks.group_offloading"
_CLASS = "ModuleGroup"
_METHODS = ("_onload_from_disk", "_offload_to_disk")
# attributes a disk-offloaded ModuleGroup of diffusers 0.3x-0.4x sets in __init__ and we use
_ATTRIBUTES = ("safetensors_file_path", "tensor_to_key", "key_to_tensor",
               "_is_offloaded_to_disk", "group_id")
# beside each group file: what it must hold (not in its header, which would move the data
# and so the alignment of every tensor: CPU kernels round differently on other alignments)
_MANIFEST_SUFFIX = ".aioswap.json"
_FORMAT = 1
_READAHEAD_BYTES = 64 << 20
_READAHEAD_GROUPS = 8         # most group files read ahead at once (leaf level: tiny files)

_Ident = tuple[int, int, int, int, int]
_Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


@dataclass
class OffloadStats:
    """What the patched group offloading has done since :func:`install`."""

    onloads: int = 0          # group onloads served
    readahead_hits: int = 0   # of them, served by a read submitted ahead
    bytes_read: int = 0       # bytes read from group files
    cached_bytes: int = 0     # of them, copied from the page cache (the rest read direct)
    verified: int = 0         # file versions whose bytes were hashed and matched
    written: int = 0          # group files written
    reused: int = 0           # existing group files accepted at first offload


@dataclass(eq=False)
class _GroupFile:
    """What a group's file must hold, and the version of it already verified."""

    path: str
    group_id: str
    layout: _Layout                       # the group's tensors, in its key order
    algorithm: str
    checksum: str                         # of the weights, in layout order
    ident: Optional[_Ident] = None        # the file version verified
    header: Optional[Header] = None       # its header
    next: Optional[weakref.ref[_GroupFile]] = None    # the group onloaded after it last time
    nbytes: int = 0


@dataclass(eq=False)
class _Read:
    """One group file's data region, being read into locked memory."""

    gf: _GroupFile
    file: Optional[AioFile]
    ident: _Ident
    header: Header
    check: bool                           # hash the bytes when they land
    buf: Optional[memoryview]
    start: int                            # file offset of buf[0]
    reader: Reader                        # copies from the page cache or reads direct
    futures: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class _Held:
    """A tensor whose data is our placeholder: its bytes are in ``gf``'s file as ``key``."""

    gf: _GroupFile
    key: str
    placeholder: torch.Tensor


def _ident(st: os.stat_result) -> _Ident:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _fail(gf: _GroupFile, problem: str) -> OffloadFileError:
    return OffloadFileError(f"diffusers group offload file {gf.path!r} (group {gf.group_id!r}) "
                            f"{problem}", path=gf.path)


# ------------------------------------------------------------------------------- checking

def _check_header(gf: _GroupFile, header: Header, size: int) -> None:
    """Raise unless ``header`` (of a file of ``size`` bytes) can hold ``gf``'s weights."""
    end = header.data_offset + header.data_bytes
    if size != end:
        raise _fail(gf, f"is {size} bytes, but its header says {end}: truncated or "
                        f"extended since it was written")
    want = {key: (dtype, shape) for key, dtype, shape in gf.layout}
    if set(header.tensors) != set(want):
        raise _fail(gf, f"holds tensors {sorted(header.tensors)}, but the group has "
                        f"{sorted(want)}: it belongs to another model or another grouping")
    for key, info in header.tensors.items():
        dtype, shape = want[key]
        if info.torch_dtype != dtype or info.shape != shape:
            raise _fail(gf, f"holds {key} as {info.dtype} {list(info.shape)}, but the group's "
                            f"is {dtype} {list(shape)}: it belongs to another model")


def _check_manifest(gf: _GroupFile) -> None:
    """Raise if the manifest beside ``gf``'s file records other weights than ``gf``'s."""
    where = gf.path + _MANIFEST_SUFFIX
    try:
        with open(where, encoding="utf-8") as fh:
            manifest = json.load(fh)
        algorithm, checksum = str(manifest["algorithm"]), str(manifest["checksum"])
    except FileNotFoundError:
        return                    # written by stock diffusers: the bytes are hashed on use
    except (ValueError, TypeError, KeyError) as exc:
        raise _fail(gf, f"has a malformed manifest {where!r} ({exc}); remove both") from exc
    if algorithm == gf.algorithm and checksum != gf.checksum:
        raise _fail(gf, f"holds other weights than this model's group (checksum {checksum} "
                        f"in {where!r}, {gf.checksum} of the weights): written by another "
                        f"model offloaded to the same directory, or before the weights "
                        f"changed; remove it or offload to another directory")


def _write_manifest(gf: _GroupFile) -> None:
    manifest = {"format": _FORMAT, "group": gf.group_id, "algorithm": gf.algorithm,
                "checksum": gf.checksum, "bytes": gf.ident[2] if gf.ident else None}
    write_atomic(gf.path + _MANIFEST_SUFFIX, json.dumps(manifest, sort_keys=True).encode())


def _digest(gf: _GroupFile, chunks: Any) -> str:
    h = new_hasher(gf.algorithm)
    for chunk in chunks:
        h.update(chunk)
    return str(h.hexdigest())


def _host(t: torch.Tensor) -> torch.Tensor:
    src = t.detach().cpu()
    return src if src.is_contiguous() else src.contiguous()


# -------------------------------------------------------------------------------- reading

def _submit(gf: _GroupFile) -> _Read:
    """Open ``gf``'s file, check it unless this version is verified, submit its read."""
    h = shared_handle()
    try:
        f = h.open(gf.path, "r")
    except FileNotFoundError as exc:
        raise _fail(gf, "is missing (removed since the group was offloaded?)") from exc
    reader = Reader(None, f"diffusers group {gf.path}")
    try:
        ident = _ident(os.fstat(f.fileno()))
        if ident == gf.ident and gf.header is not None:
            header, check = gf.header, False
        else:
            try:
                header = read_header(gf.path)
            except SafetensorsError as exc:
                raise _fail(gf, f"cannot be used: {exc}") from exc
            _check_header(gf, header, ident[2])
            check = True
        start = header.data_offset // _ALIGN * _ALIGN
        n = min(round_up(header.data_offset + header.data_bytes, _ALIGN), ident[2]) - start
        buf = memoryview(pinned.allocate(round_up(n, _ALIGN), strict=False)) if n > 0 else None
        read = _Read(gf, f, ident, header, check, buf, start, reader)
        if buf is not None:
            dest = torch.frombuffer(buf, dtype=torch.uint8, count=n)
            copy = read.reader.copies(f, start, n)     # the page cache holds the file
            read.futures.append(read.reader.pread(f, dest, start, n, copy=copy))
            _stats.bytes_read += n
            _stats.cached_bytes += n if copy else 0
        return read
    except BaseException:
        reader.close()               # (its descriptor, when it opened one)
        f.close()
        raise


def _close_file(read: _Read) -> None:
    """Close ``read``'s file and its reader (its reads are done)."""
    if read.file is not None:
        read.reader.close()
        read.file.close()
        read.file = None


def _drop(read: _Read) -> None:
    """Wait for ``read`` (drain before release) and free it."""
    first_error(read.futures)
    _close_file(read)
    read.buf = None


def _finish(read: _Read) -> dict[str, torch.Tensor]:
    """Wait for ``read``, verify its bytes if needed, and return the group's tensors."""
    gf = read.gf
    exc = first_error(read.futures)
    if exc is not None:
        _drop(read)
        raise _fail(gf, f"could not be read: {exc}") from exc
    buf, header = read.buf, read.header
    places = [(key, dtype, shape, header.data_offset + header.tensors[key].begin - read.start,
               header.tensors[key].nbytes) for key, dtype, shape in gf.layout]
    if read.check:
        assert buf is not None or not any(n for *_, n in places)
        got = _digest(gf, (buf[p:p + n] for *_, p, n in places if n) if buf is not None else ())
        if got != gf.checksum:
            _drop(read)
            raise _fail(gf, f"does not hold this model's weights (checksum {got} of its bytes, "
                            f"{gf.checksum} expected): replaced, modified or written by "
                            f"another model; remove it or offload to another directory")
        gf.ident, gf.header, gf.nbytes = read.ident, header, header.data_bytes
        _stats.verified += 1
    out = {key: _view(buf, pos, n, dtype, shape) for key, dtype, shape, pos, n in places}
    _close_file(read)
    read.buf = None                       # the views own the memory now
    return out


def _view(buf: Optional[memoryview], pos: int, n: int, dtype: torch.dtype,
          shape: tuple[int, ...]) -> torch.Tensor:
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    assert buf is not None
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=pos)
    if raw.data_ptr() % dtype.itemsize:           # misaligned in the file: own memory
        out = torch.empty(shape, dtype=dtype)
        out.view(-1).view(torch.uint8).copy_(raw)
        return out
    return torch.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize, offset=pos).view(shape)


def _current(read: _Read) -> bool:
    """Whether ``read``'s file is still the version it was submitted for."""
    try:
        return _ident(os.stat(read.gf.path)) == read.ident
    except OSError:
        return False


def _take(gf: _GroupFile) -> dict[str, torch.Tensor]:
    """The group's tensors: from its read ahead if the file is unchanged, else read now."""
    global _last
    prev = _last() if _last is not None else None
    if prev is not None and prev is not gf:
        prev.next = weakref.ref(gf)
    _last = weakref.ref(gf)
    _stats.onloads += 1
    read = _pending.pop(gf, None)
    if read is not None and not _current(read):
        _drop(read)
        read = None
    if read is not None:
        _stats.readahead_hits += 1
    else:
        read = _submit(gf)
    _read_ahead(gf)
    return _finish(read)


def _read_ahead(gf: _GroupFile) -> None:
    want: list[_GroupFile] = []
    total = 0
    ref = gf.next
    while ref is not None and len(want) < _READAHEAD_GROUPS:
        nxt = ref()
        if nxt is None or nxt is gf or nxt in want:
            break
        if want and total + nxt.nbytes > _readahead_bytes:
            break
        want.append(nxt)
        total += nxt.nbytes
        ref = nxt.next
    for old in [g for g in _pending if g not in want]:
        _drop(_pending.pop(old))
    for nxt in want:
        if nxt not in _pending:
            try:
                _pending[nxt] = _submit(nxt)
            except Exception as exc:      # read ahead only: its own onload raises it
                _log.debug("aioswap: no read-ahead of %s: %s", nxt.path, exc)


def _keep(stream: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Keep host tensors alive until ``stream`` has copied them (non_blocking copies)."""
    while _inflight and _inflight[0][0].query():
        _inflight.popleft()
    _inflight.append((stream.record_event(), tensors))


# -------------------------------------------------------------------------------- writing

def _placeholder_of(t: torch.Tensor) -> Optional[_Held]:
    """The record of ``t`` if its data is still the placeholder we gave it."""
    entry = _held.get(id(t))
    if entry is None or entry[0]() is not t or t.numel() == 0:
        return None
    held = entry[1]
    if t.untyped_storage().data_ptr() != held.placeholder.untyped_storage().data_ptr():
        return None                        # given other data since (load_state_dict...)
    return held


def _hold(t: torch.Tensor, gf: _GroupFile, key: str, device: Any) -> None:
    """Give ``t`` a placeholder (one per tensor, reused), recording where its bytes are."""
    entry = _held.get(id(t))
    ph = None
    if entry is not None and entry[0]() is t:
        ph = entry[1].placeholder
        if ph.shape != t.shape or ph.dtype != t.dtype or ph.device != torch.device(device):
            ph = None
    if ph is None:
        ph = torch.empty_like(t.data, device=device)
    key_id = id(t)

    def forget(_: Any, key_id: int = key_id) -> None:
        e = _held.get(key_id)
        if e is not None and e[0]() is None:
            del _held[key_id]

    ref = entry[0] if entry is not None and entry[0]() is t else weakref.ref(t, forget)
    _held[key_id] = (ref, _Held(gf, key, ph))
    t.data = ph


def _first_offload(group: Any) -> _GroupFile:
    """The verified file of a group offloaded for the first time (written if missing)."""
    path = os.fspath(group.safetensors_file_path)
    items = list(group.tensor_to_key.items())          # (tensor, key) in key order
    layout: _Layout = tuple((key, t.dtype, tuple(t.shape)) for t, key in items)
    helds = [_placeholder_of(t) for t, _ in items]
    gid = str(group.group_id)
    # hooks applied again with the same grouping: the file written last time holds them
    first = helds[0] if helds else None
    if first is not None and first.gf.path == path and first.gf.layout == layout and all(
            h is not None and h.gf is first.gf and h.key == key
            for h, (_, key) in zip(helds, items)):
        return replace(first.gf, group_id=gid, next=None)
    # else the weights: in memory, or (offloaded through aioswap) in the files they went to
    data: dict[str, torch.Tensor] = {}
    loaded: dict[int, dict[str, torch.Tensor]] = {}
    for (t, key), h in zip(items, helds):
        if h is None:
            data[key] = t.data.detach().to(group.offload_device)
        else:
            if id(h.gf) not in loaded:
                loaded[id(h.gf)] = _finish(_submit(h.gf))
            data[key] = loaded[id(h.gf)][h.key]
    algorithm = algorithms()[0]
    gf = _GroupFile(path, gid, layout, algorithm, "")
    hosts = [_host(data[key]) for key, _, _ in layout]
    gf.checksum = _digest(gf, (host_bytes(x) for x in hosts if x.numel()))
    own = any(h is not None and h.gf.path == path for h in helds)
    try:
        size: Optional[int] = os.stat(path).st_size
    except FileNotFoundError:
        size = None
    if size is not None and not own:
        try:
            header = read_header(path)
        except SafetensorsError as exc:
            raise _fail(gf, f"exists and cannot be used: {exc}; remove it") from exc
        _check_header(gf, header, size)
        _check_manifest(gf)
        gf.nbytes = header.data_bytes
        _stats.reused += 1
        _log.debug("aioswap: reusing %s (bytes verified on first onload)", path)
        return gf                          # hashed when first read
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(data, path)                  # the bytes stock diffusers writes
    header = read_header(path)
    gf.ident, gf.header, gf.nbytes = _ident(os.stat(path)), header, header.data_bytes
    _write_manifest(gf)
    _stats.written += 1
    return gf


# ----------------------------------------------------------------------- patched methods

def _check_torchao(group: Any) -> None:
    check = getattr(group, "_check_disk_offload_torchao", None)
    if callable(check):
        check()


def _offload_to_disk(self: Any) -> None:
    """aioswap's ``ModuleGroup._offload_to_disk`` (see the module's notes)."""
    with _state_lock:
        gf = _files.get(self)
        if gf is None and self._is_offloaded_to_disk:     # offloaded before install()
            _stock_call("_offload_to_disk", self)
            return
        _check_torchao(self)
        stream = getattr(self, "stream", None)
        if stream is not None and not getattr(self, "record_stream", False):
            # the compute stream may still read what the placeholders replace (as stock)
            self._torch_accelerator_module.current_stream().synchronize()
        if gf is None:
            gf = _first_offload(self)
            _files[self] = gf
        self._is_offloaded_to_disk = True
        for t, key in self.tensor_to_key.items():
            _hold(t, gf, key, self.offload_device)


def _onload_from_disk(self: Any) -> None:
    """aioswap's ``ModuleGroup._onload_from_disk`` (see the module's notes)."""
    with _state_lock:
        gf = _files.get(self)
        if gf is None:                     # offloaded before install()
            _stock_call("_onload_from_disk", self)
            return
        _check_torchao(self)
        stream = getattr(self, "stream", None)
        if stream is not None:
            stream.synchronize()           # the previous host-to-device copies (as stock)
        tensors = _take(gf)
        device = torch.device(self.onload_device)
        if stream is None:
            for key, t in self.key_to_tensor.items():
                src = tensors[key]
                t.data = src if src.device == device else src.to(device)
            return
        backend = self._torch_accelerator_module
        current = backend.current_stream() if self.record_stream else None
        with backend.stream(stream):
            for key, t in self.key_to_tensor.items():
                t.data = tensors[key].to(device, non_blocking=self.non_blocking)
                if current is not None:
                    t.data.record_stream(current)
            _keep(stream, tensors)


def _stock_call(name: str, group: Any) -> None:
    path = str(getattr(group, "safetensors_file_path", "?"))
    if path not in _warned:
        _warned.add(path)
        warnings.warn(f"aioswap.integrations.diffusers: group file {path!r} was offloaded "
                      f"before install(); it is read by stock diffusers, unverified",
                      AioswapWarning, stacklevel=3)
    fn = _stock.get(name)
    if fn is None:
        raise AioswapError(f"aioswap.integrations.diffusers: stock {name} is not known")
    fn(group)


# ---------------------------------------------------------------------------------- install

_state_lock = threading.RLock()
_cls: Optional[type] = None
_stock: dict[str, Callable[[Any], None]] = {}
_files: weakref.WeakKeyDictionary[Any, _GroupFile] = weakref.WeakKeyDictionary()
# id(tensor) -> (weak reference, record): tensors compare element-wise, so no WeakKeyDictionary
_held: dict[int, tuple[weakref.ref[torch.Tensor], _Held]] = {}
_pending: OrderedDict[_GroupFile, _Read] = OrderedDict()
_inflight: deque[tuple[Any, dict[str, torch.Tensor]]] = deque()
_last: Optional[weakref.ref[_GroupFile]] = None
_warned: set[str] = set()
_stats = OffloadStats()
_readahead_bytes = _READAHEAD_BYTES


def install(*, readahead_bytes: int = _READAHEAD_BYTES) -> None:
    """Make diffusers' group offloading to disk write, verify and read its group files
    through aioswap. Idempotent (a second call only sets ``readahead_bytes``).

    Groups offloaded before the call keep the stock methods' behaviour (with one
    :class:`~aioswap.errors.AioswapWarning` per file); groups offloaded after it are
    verified and read as the module's notes say.

    Parameters
    ----------
    readahead_bytes : int
        Group files read ahead while a group computes: the next one always, more while
        their data regions add up to at most this many bytes (default 64 MiB; at most 8).

    Raises
    ------
    ImportError
        diffusers is not installed (nothing is changed).
    RuntimeError
        diffusers' group offloading is not what this was written for (diffusers 0.42): the
        message names what could not be patched (nothing is changed).
    """
    global _cls, _readahead_bytes, _stats
    with _state_lock:
        _readahead_bytes = max(0, int(readahead_bytes))
        if _cls is not None:
            return
        module = import_for("diffusers", _MODULE, "diffusers")
        cls = getattr(module, _CLASS, None)
        where = f"{_MODULE}.{_CLASS}"
        version = dist_version("diffusers")
        if not isinstance(cls, type):
            raise RuntimeError(f"aioswap.integrations.diffusers.install(): could not patch: "
                               f"{_MODULE} has no class {_CLASS} (diffusers {version})")
        missing = [f"{where}.{m}" for m in _METHODS if not callable(cls.__dict__.get(m))]
        init = getattr(cls.__dict__.get("__init__"), "__code__", None)
        names = set(init.co_names) if init is not None else set()
        missing += [f"{where} attribute {a!r}" for a in _ATTRIBUTES if a not in names]
        if missing:
            raise RuntimeError(f"aioswap.integrations.diffusers.install(): could not patch "
                               f"{', '.join(missing)} (diffusers {version}; written for "
                               f"0.42): group offloading is left stock")
        for m in _METHODS:
            _stock[m] = cls.__dict__[m]
        cls._offload_to_disk = _offload_to_disk       # type: ignore[attr-defined]
        cls._onload_from_disk = _onload_from_disk     # type: ignore[attr-defined]
        _cls = cls
        _stats = OffloadStats()
        _log.info("aioswap: %s.%s replaced", where, " and .".join(_METHODS))


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _cls is not None


def uninstall() -> None:
    """Undo :func:`install`: diffusers' own methods again, reads ahead drained and freed.
    Idempotent. Groups offloaded meanwhile go on with the stock methods, which read the
    same files (they are plain safetensors)."""
    global _cls, _last
    with _state_lock:
        if _cls is not None:
            for m, fn in _stock.items():
                setattr(_cls, m, fn)
            _cls = None
            _stock.clear()
        while _pending:
            _drop(_pending.popitem(last=False)[1])
        while _inflight:
            event, _ = _inflight.popleft()
            event.synchronize()
        _last = None


def stats() -> OffloadStats:
    """A copy of the counters since :func:`install` (see :class:`OffloadStats`)."""
    with _state_lock:
        return replace(_stats)
