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
"""
from __future__ import annotations

import concurrent.futures
import errno
import json
import math
import operator
import os
import secrets
import stat
import struct
import sys
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Union

import numpy as np
import torch

from aioswap import _scratch as _tmpfiles
from aioswap import _adaptive, pinned
from aioswap._aio import DEFAULT_ALIGNMENT as _ALIGN
from aioswap._files import AioFile
from aioswap._units import shape_fits
from aioswap._util import (flat_bytes, fsync_dir, round_up, unique_keys, wait_all,
                           write_atomic)
from aioswap.errors import AioswapError
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

PathLike = Union[str, "os.PathLike[str]"]

#: Largest JSON header accepted, in bytes (the limit the ``safetensors`` package applies).
MAX_HEADER_BYTES = 100_000_000

_GROUP_BYTES = 64 << 20       # read: bytes of consecutive tensors per buffer (one request)
_FIRST_GROUP_BYTES = 4 << 20  # read: the first group; each next one twice the last, up to 64 MiB
_DEVICE_WINDOW_BYTES = 1 << 30   # read to a device: host staging bytes in flight at most
_SLOT_BYTES = 16 << 20        # write: bytes per staging slot (one request)
_SLOTS = 4                    # write: staging slots in the ring
_METADATA_KEY = "__metadata__"


class SafetensorsError(AioswapError, ValueError):
    """A safetensors file or buffer is malformed, or tensors cannot be stored in the format.

    ``path`` is the file (or None for in-memory data).
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


# ---------------------------------------------------------------------------------- dtypes

@dataclass(frozen=True)
class _DType:
    name: str                 # the format's name, "F32"
    bits: int                 # bits per element in the file
    torch_name: str | None    # attribute of torch, None where torch has no such dtype
    packed: int = 1           # file elements per torch element (2 for F4 as float4_e2m1fn_x2)


_DTYPE_LIST = [     # in the order of safetensors' Dtype enum: writers sort by it
    _DType("BOOL", 8, "bool"),
    _DType("F4", 4, "float4_e2m1fn_x2", packed=2),
    _DType("F6_E2M3", 6, None),
    _DType("F6_E3M2", 6, None),
    _DType("U8", 8, "uint8"),
    _DType("I8", 8, "int8"),
    _DType("F8_E5M2", 8, "float8_e5m2"),
    _DType("F8_E4M3", 8, "float8_e4m3fn"),
    _DType("F8_E8M0", 8, "float8_e8m0fnu"),
    _DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    _DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    _DType("I16", 16, "int16"),
    _DType("U16", 16, "uint16"),
    _DType("F16", 16, "float16"),
    _DType("BF16", 16, "bfloat16"),
    _DType("I32", 32, "int32"),
    _DType("U32", 32, "uint32"),
    _DType("F32", 32, "float32"),
    _DType("C64", 64, "complex64"),
    _DType("F64", 64, "float64"),
    _DType("I64", 64, "int64"),
    _DType("U64", 64, "uint64"),
]
_DTYPES = {d.name: d for d in _DTYPE_LIST}
_RANK = {d.name: i for i, d in enumerate(_DTYPE_LIST)}

#: The format's dtype names and their bits per element.
DTYPES: Mapping[str, int] = {d.name: d.bits for d in _DTYPE_LIST}


def _torch_dtype(d: _DType) -> torch.dtype | None:
    if d.torch_name is None:
        return None
    value = getattr(torch, d.torch_name, None)
    return value if isinstance(value, torch.dtype) else None


_FROM_TORCH: dict[torch.dtype, _DType] = {}
for _d in _DTYPE_LIST:
    _t = _torch_dtype(_d)
    if _t is not None:
        _FROM_TORCH[_t] = _d
del _d, _t


# ---------------------------------------------------------------------------------- header

@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a header: ``begin``/``end`` are offsets in the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype of ``dtype``; None where this torch has none (``F6_*``...)."""
        return _torch_dtype(_DTYPES[self.dtype])


@dataclass(frozen=True)
class Header:
    """A validated header.

    ``header_bytes`` is ``N``; the data region is ``[data_offset, data_offset + data_bytes)``
    of the file (``data_offset = 8 + N``). ``tensors`` keeps the header's order.
    """

    path: str | None
    header_bytes: int
    data_offset: int
    data_bytes: int
    tensors: Mapping[str, TensorInfo]
    metadata: dict[str, str] | None


def _where(path: str | None) -> str:
    return repr(path) if path is not None else "safetensors data"


def _reject_constant(value: str) -> Any:
    raise ValueError(f"{value} is not valid JSON")


def _parse_header(raw: bytes, data_bytes: int, path: str | None) -> Header:
    """Check a header's JSON against a data region of ``data_bytes``; nothing is allocated."""
    where = _where(path)

    def fail(msg: str) -> SafetensorsError:
        return SafetensorsError(f"{where}: {msg}", path=path)

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"the header is not valid UTF-8 ({exc.reason} at byte {exc.start})"
                   ) from None

    try:
        obj = json.loads(text, object_pairs_hook=unique_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise fail(f"the header is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise fail(f"the header must be a JSON object, got {type(obj).__name__}")
    metadata = obj.pop(_METADATA_KEY, None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(v, str)
                                                     for v in metadata.values()):
            raise fail('"__metadata__" must be an object of strings')
    infos: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        if not isinstance(entry, dict):
            raise fail(f"tensor {name!r}: expected an object, got {type(entry).__name__}")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise fail(f"tensor {name!r}: missing {', '.join(missing)}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise fail(f"tensor {name!r}: unknown dtype {dtype!r} (known: "
                       f"{', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_count(x) for x in shape):
            raise fail(f"tensor {name!r}: shape must be a list of integers >= 0, "
                       f"got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_count(x) for x in offsets)):
            raise fail(f"tensor {name!r}: data_offsets must be [begin, end], integers >= 0, "
                       f"got {offsets!r}")
        begin, end = offsets
        if begin > end:
            raise fail(f"tensor {name!r}: data_offsets [{begin}, {end}] end before they begin")
        if end > data_bytes:
            raise fail(f"tensor {name!r}: data_offsets [{begin}, {end}] run past the end of "
                       f"the data region ({data_bytes} bytes)")
        if not shape_fits(shape):
            raise fail(f"tensor {name!r}: shape {shape} has more elements than any tensor "
                       f"can hold (the product of its non-zero sizes must be < 2**63)")
        bits = math.prod(shape) * _DTYPES[dtype].bits
        if bits % 8:
            raise fail(f"tensor {name!r}: {math.prod(shape)} elements of {dtype} "
                       f"({_DTYPES[dtype].bits} bits) do not fill whole bytes")
        if bits // 8 != end - begin:
            raise fail(f"tensor {name!r}: shape {shape} of {dtype} needs {bits // 8} bytes, "
                       f"data_offsets [{begin}, {end}] hold {end - begin}")
        infos[name] = TensorInfo(name, dtype, tuple(shape), begin, end)
    pos, last = 0, None
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        if info.begin < pos:
            raise fail(f"tensor {info.name!r} [{info.begin}, {info.end}] overlaps tensor "
                       f"{last!r} (ends at {pos})")
        if info.begin > pos:
            raise fail(f"bytes [{pos}, {info.begin}) of the data region belong to no tensor "
                       f"(before tensor {info.name!r})")
        pos, last = info.end, info.name
    if pos != data_bytes:
        raise fail(f"the data region has {data_bytes} bytes but the tensors cover only "
                   f"{pos}: the file has trailing bytes or is not fully described")
    return Header(path, len(raw), 8 + len(raw), data_bytes, infos, metadata)


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0


def _header_length(prefix: bytes, size: int, path: str | None) -> int:
    """The JSON length from the first 8 bytes, checked against the limit and ``size``."""
    where = _where(path)
    if len(prefix) < 8:
        raise SafetensorsError(f"{where}: {size} bytes is too short for a safetensors file "
                               f"(it starts with an 8-byte header length)", path=path)
    n: int = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"{where}: header length {n} exceeds the limit of "
                               f"{MAX_HEADER_BYTES} bytes (aioswap.safetensors."
                               f"MAX_HEADER_BYTES); not a safetensors file, or a hostile one",
                               path=path)
    if 8 + n > size:
        raise SafetensorsError(f"{where}: header length {n} runs past the end of the "
                               f"{size}-byte {'file' if path is not None else 'buffer'}",
                               path=path)
    return n


def _pread_all(fd: int, n: int, offset: int, path: str) -> bytes:
    parts = []
    done = 0
    while done < n:
        b = os.pread(fd, n - done, offset + done)
        if not b:
            raise SafetensorsError(f"{path!r}: the file ended at offset {offset + done} while "
                                   f"reading its header (it changed while being read?)",
                                   path=path)
        parts.append(b)
        done += len(b)
    return b"".join(parts)


def _open_data(path: str) -> int:
    """Open a file to read its tensors. ``O_NONBLOCK``: a FIFO in its place is refused by the
    regular-file check instead of blocking the open (no effect on regular files)."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)


def _read_header_fd(fd: int, path: str) -> Header:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SafetensorsError(f"{path!r} is not a regular file", path=path)
    size = st.st_size
    n = _header_length(_pread_all(fd, min(8, size), 0, path), size, path)
    raw = _pread_all(fd, n, 8, path)
    return _parse_header(raw, size - 8 - n, path)


def read_header(filename: PathLike) -> Header:
    """Read and validate the header of a safetensors file; no tensor data is read.

    Parameters
    ----------
    filename : str or os.PathLike
        The file.

    Returns
    -------
    Header
        Tensor names, dtypes, shapes and offsets, and the metadata.

    Raises
    ------
    SafetensorsError
        The header is malformed (see the module's notes for every check).
    OSError
        The file cannot be opened.
    """
    path = os.fspath(filename)
    fd = _open_data(path)
    try:
        try:
            # only the header's pages: read-ahead would pull the first tensors into the
            # page cache, where direct reads never look for them
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:         # not a regular file (ESPIPE): refused below, as it was
            pass
        return _read_header_fd(fd, path)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- tensors

def _dtype_of(info: TensorInfo, path: str | None) -> tuple[torch.dtype, tuple[int, ...]]:
    """The torch dtype and shape of a tensor of the file."""
    d = _DTYPES[info.dtype]
    t = _torch_dtype(d)
    if t is None:
        raise SafetensorsError(f"{_where(path)}: tensor {info.name!r} has dtype {d.name}, which "
                               f"this torch ({torch.__version__}) has no dtype for", path=path)
    shape = info.shape
    if d.packed > 1:
        if not shape or shape[-1] % d.packed:
            raise SafetensorsError(f"{_where(path)}: tensor {info.name!r} of {d.name} has "
                                   f"shape {list(shape)}; torch.{d.torch_name} needs a last "
                                   f"dimension divisible by {d.packed}", path=path)
        shape = shape[:-1] + (shape[-1] // d.packed,)
    return t, shape


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
    return {name: _dtype_of(info, path) for name, info in header.tensors.items()}


def _open_source(path: str, handle: AioHandle | None) -> _Source:
    """Open ``path`` and check its header and dtypes; nothing is allocated for the data."""
    fd = _open_data(path)
    try:
        header = _read_header_fd(fd, path)
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

_INDEX_NAME = "model.safetensors.index.json"   # transformers' SAFE_WEIGHTS_INDEX_NAME
_SINGLE_NAME = "model.safetensors"             # transformers' SAFE_WEIGHTS_NAME


def _read_index(path: str) -> dict[str, str]:
    """The weight map of a Hugging Face index, checked: tensor name -> shard file name."""
    def fail(msg: str) -> SafetensorsError:
        return SafetensorsError(f"{path!r}: {msg}", path=path)

    fd = _open_data(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SafetensorsError(f"{path!r} is not a regular file", path=path)
        if st.st_size > MAX_HEADER_BYTES:
            raise fail(f"an index of {st.st_size} bytes is over the limit of "
                       f"{MAX_HEADER_BYTES} bytes (MAX_HEADER_BYTES)")
        raw = _pread_all(fd, st.st_size, 0, path)
    finally:
        os.close(fd)
    try:        # UnicodeDecodeError is a ValueError
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys,
                         parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise fail(f"the index is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or "weight_map" not in doc:
        raise fail('the index has no "weight_map" (a JSON object {"weight_map": '
                   '{tensor name: shard file name}} is expected)')
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise fail('"weight_map" must be an object of tensor name to shard file name')
    for shard in sorted(set(weight_map.values())):
        if (not shard or os.sep in shard or (os.altsep and os.altsep in shard)
                or ".." in shard or "\0" in shard):
            raise fail(f"shard file name {shard!r} is refused: a shard is a file of the "
                       f"index's directory, named without a path separator or '..'")
    return weight_map


def _checkpoint_files(path: str) -> tuple[str | None, dict[str, str] | None, list[str]]:
    """(index, weight map, shard paths in file name order); (None, None, [file]) for a
    checkpoint of one file without an index."""
    if os.path.isdir(path):
        index = os.path.join(path, _INDEX_NAME)
        single = os.path.join(path, _SINGLE_NAME)
        if not os.path.lexists(index):
            if os.path.lexists(single):
                return None, None, [single]
            raise FileNotFoundError(errno.ENOENT, f"{path!r} holds neither {_INDEX_NAME} "
                                    f"nor {_SINGLE_NAME}", path)
    elif path.endswith(".json"):
        index = path
    else:
        return None, None, [path]
    weight_map = _read_index(index)
    directory = os.path.dirname(index)
    return index, weight_map, [os.path.join(directory, s)
                               for s in sorted(set(weight_map.values()))]


def _check_index(index: str, weight_map: Mapping[str, str], sources: Sequence[_Source]
                 ) -> None:
    """Every tensor in exactly one shard, the one the index names for it."""
    def fail(msg: str) -> SafetensorsError:
        return SafetensorsError(f"{index!r}: {msg}", path=index)

    held: dict[str, list[str]] = {}
    for src in sources:
        for name in src.header.tensors:
            held.setdefault(name, []).append(os.path.basename(src.path))
    for name, shards in held.items():
        if len(shards) > 1:
            raise fail(f"tensor {name!r} is in more than one shard: {', '.join(shards)}")
        listed = weight_map.get(name)
        if listed is None:
            raise fail(f"tensor {name!r} of shard {shards[0]!r} is not in the weight_map")
        if listed != shards[0]:
            raise fail(f"the weight_map puts tensor {name!r} in {listed!r}, but it is in "
                       f"{shards[0]!r}")
    for name, shard in weight_map.items():
        if name not in held:
            raise fail(f"the weight_map puts tensor {name!r} in {shard!r}, but no shard "
                       f"holds it")


def _given_files(path: PathLike | Sequence[PathLike]) -> str | list[str]:
    """A checkpoint's path, or the list of shard files given in its place."""
    if isinstance(path, (str, bytes, os.PathLike)):
        return os.fspath(path)
    files = [os.fspath(f) for f in path]
    if not files:
        raise ValueError("no safetensors files given")
    return files


def _open_checkpoint(path: str | list[str], handle: AioHandle | None
                     ) -> tuple[list[_Source], Mapping[str, Any]]:
    """The checkpoint's shards, opened and checked (headers, dtypes, index), and the order
    of its tensors (the weight map's, the one file's header's, or the files' headers' in the
    order given)."""
    if isinstance(path, list):
        return _open_files(path, handle)
    index, weight_map, files = _checkpoint_files(path)
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
        _check_index(index, weight_map, sources)
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
    p = _given_files(path)
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
        headers' in the order given for a list of files); the tensors are those :func:`iter_checkpoint` yields, like :func:`load_file`'s.

    Raises
    ------
    SafetensorsError, FileNotFoundError, OSError, ShortReadError, RuntimeError
        As for :func:`iter_checkpoint`; every check is made before any data is read.
    """
    p = _given_files(path)
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
    n = _header_length(bytes(mv[:8]), len(mv), None)
    header = _parse_header(bytes(mv[8:8 + n]), len(mv) - 8 - n, None)
    out = {}
    for name, info in header.tensors.items():
        dtype, shape = _dtype_of(info, None)
        lo = header.data_offset + info.begin
        buf = bytearray(mv[lo:lo + info.nbytes])
        out[name] = (_view(buf, 0, info, dtype, shape) if buf
                     else torch.empty(shape, dtype=dtype))
    return out


# ---------------------------------------------------------------------------------- writing

@dataclass
class _Piece:
    """Bytes of the file at ``[start, start + nbytes)``, from a flat uint8 tensor."""

    start: int
    nbytes: int
    source: Any               # torch.Tensor (uint8) or a callable giving one


def _check_inputs(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
                  ) -> None:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of str to torch.Tensor, got "
                        f"{type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if name == _METADATA_KEY:
            raise SafetensorsError(f"{_METADATA_KEY!r} is reserved for the metadata and cannot "
                                   f"name a tensor")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise SafetensorsError(f"tensor {name!r} has layout {t.layout}; only dense "
                                   f"tensors can be saved")
        if t.device.type == "meta":
            raise SafetensorsError(f"tensor {name!r} is on the meta device and has no data")
        if t.dtype not in _FROM_TORCH:
            raise SafetensorsError(f"tensor {name!r} has dtype {t.dtype}, which the "
                                   f"safetensors format cannot hold")
        if _FROM_TORCH[t.dtype].packed > 1 and t.dim() == 0:
            raise SafetensorsError(f"tensor {name!r}: a 0-dim {t.dtype} cannot be stored "
                                   f"(its shape in the file needs a last dimension)")
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must be a dict of str to str")


def _layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
            ) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The header bytes (length prefix and padding included) and (name, begin, end)."""
    _check_inputs(tensors, metadata)
    # safetensors' order (its dtype enum, descending, then the name): larger alignments
    # first keeps every tensor aligned, and the file is byte for byte what safetensors writes
    order = sorted(tensors, key=lambda k: (-_RANK[_FROM_TORCH[tensors[k].dtype].name], k))
    obj: dict[str, Any] = {}
    if metadata is not None:
        obj[_METADATA_KEY] = dict(sorted(metadata.items()))     # deterministic bytes
    spans = []
    pos = 0
    for name in order:
        t = tensors[name]
        d = _FROM_TORCH[t.dtype]
        shape = list(t.shape)
        if d.packed > 1:
            shape[-1] *= d.packed
        n = t.numel() * t.element_size()
        obj[name] = {"dtype": d.name, "shape": shape, "data_offsets": [pos, pos + n]}
        spans.append((name, pos, pos + n))
        pos += n
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise SafetensorsError(f"the header would be {len(text)} bytes, over the limit of "
                               f"{MAX_HEADER_BYTES} bytes readers accept")
    return struct.pack("<Q", len(text)) + text, spans


def save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
         ) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (and ``metadata``)."""
    head, spans = _layout(tensors, metadata)
    out = bytearray(len(head) + (spans[-1][2] if spans else 0))
    out[:len(head)] = head
    dst = torch.frombuffer(out, dtype=torch.uint8) if out else None
    for name, begin, end in spans:
        if end > begin:
            assert dst is not None
            dst[len(head) + begin:len(head) + end].copy_(flat_bytes(tensors[name]))
    return bytes(out)


def save_file(tensors: Mapping[str, torch.Tensor], filename: PathLike,
              metadata: Mapping[str, str] | None = None, *, handle: AioHandle | None = None,
              mode: int = 0o600) -> None:
    """Save tensors to a safetensors file with direct I/O, durably and atomically.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        CPU or CUDA tensors of any dtype the format holds. Unlike ``safetensors``,
        non-contiguous tensors and tensors sharing memory are accepted (each is stored with
        its own elements).
    filename : str or os.PathLike
        The file; replaced atomically once the new one is durable.
    metadata : dict of str to str, optional
        Stored as ``"__metadata__"``.
    handle : AioHandle, optional
        The handle to write through; default :func:`aioswap.handle.shared_handle`.
    mode : int
        Permission bits of the new file, before the umask. Default ``0o600`` (the file holds
        user data); ``safetensors`` and ``torch.save`` create ``0o644`` files.

    Raises
    ------
    SafetensorsError
        A tensor the format cannot hold (dtype, layout, meta device), a reserved name, a
        header over :data:`MAX_HEADER_BYTES`.
    TypeError
        Names or metadata that are not strings, values that are not tensors.
    OSError
        The file cannot be written; ``filename`` is left as it was.

    Notes
    -----
    The bytes go through a ring of four page-locked 16 MiB slots (less for a small
    file) written at 4096-aligned offsets, so the data is written with ``O_DIRECT``, into a
    new file beside ``filename`` that is fsynced, renamed over it and the directory fsynced.
    That file is an unnamed ``O_TMPFILE`` where the file system allows (linked as
    ``.<name>.<pid>-<random>.tmp`` just before the rename), so a crash mid-save leaves
    nothing; elsewhere it has that name from the start, and a later save beside it removes
    it once its process is gone. The tensors must not change until this returns.
    """
    path = os.fspath(filename)
    head, spans = _layout(tensors, metadata)
    total = len(head) + (spans[-1][2] if spans else 0)
    pieces = [_Piece(0, len(head), torch.frombuffer(bytearray(head), dtype=torch.uint8))]
    for name, begin, end in spans:
        if end > begin:
            pieces.append(_Piece(len(head) + begin, end - begin, tensors[name]))
    directory = os.path.dirname(os.path.abspath(path))
    stem = f".{os.path.basename(path)}."
    _tmpfiles.remove_stale(directory, stem, ".tmp")       # left by a killed save
    tmp = os.path.join(directory, f"{stem}{os.getpid()}-{secrets.token_hex(6)}.tmp")
    fd, named = _open_tmp(directory, tmp, mode)
    file: AioFile | None = None
    done = False
    try:
        h = shared_handle() if handle is None else handle
        file = h.adopt(fd)                  # the handle's own file from here on
        fd = -1
        _write_pieces(file, pieces, total)
        file.fsync()
        if not named:   # an O_TMPFILE file gets a name only now, for the rename
            os.link(f"/proc/self/fd/{file.fileno()}", tmp, follow_symlinks=True)
        file.close()
        os.replace(tmp, path)
        done = True
        fsync_dir(directory)
    finally:
        if fd >= 0:
            os.close(fd)
        if file is not None:
            file.close()
        if not done:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def save_sharded(tensors: Mapping[str, torch.Tensor], directory: PathLike, *,
                 roots: Sequence[PathLike] | None = None, max_shard_bytes: int | None = None,
                 prefix: str = "model", metadata: Mapping[str, str] | None = None,
                 handle: AioHandle | None = None, mode: int = 0o600) -> str:
    """Save ``tensors`` as shards with a Hugging Face index, spread over several drives.

    The layout is what ``save_pretrained`` writes and ``from_pretrained`` reads:
    ``<prefix>-00001-of-0000N.safetensors``... and ``<prefix>.safetensors.index.json``
    (``{"metadata": {"total_size": ...}, "weight_map": {name: shard}}``) in ``directory``.
    Shard ``i`` is written (with :func:`save_file`: direct I/O, durable, atomic) on
    ``[directory, *roots][i mod (1 + len(roots))]``, all shards at once; a shard on another
    drive is linked from ``directory`` by an absolute symbolic link, so every reader finds
    it there. The index is written last (atomically): a crash before it leaves the old
    index. Shards of an earlier save with another shard count are left alone.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        As for :func:`save_file`; split in their order.
    directory : str or os.PathLike
        Where the index and (links to) every shard go; created if missing.
    roots : sequence of paths, optional
        Directories on the other drives (created if missing).
    max_shard_bytes : int, optional
        Cap on the tensor bytes of one shard (a larger tensor gets a shard of its own);
        default: the total divided evenly over the drives, so each holds one shard.
    prefix : str
        File name prefix (``"model"``, as transformers names them).
    metadata : dict of str to str, optional
        Stored in every shard (default ``{"format": "pt"}``, what transformers writes).
    handle : AioHandle, optional
        As for :func:`save_file`.
    mode : int
        Permission bits of the shards and the index (``0o600``).

    Returns
    -------
    str
        The path of the index file.
    """
    directory = os.path.abspath(os.fspath(directory))
    homes = [directory] + [os.path.abspath(os.fspath(r)) for r in roots or ()]
    if len({os.path.realpath(h) for h in homes}) != len(homes):
        raise ValueError(f"the directory and the roots must be distinct: {homes}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    _check_inputs(tensors, metadata)
    if not prefix or os.sep in prefix:
        raise ValueError(f"prefix must be a file name prefix, got {prefix!r}")
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    cap = max_shard_bytes if max_shard_bytes is not None else max(1, -(-total // len(homes)))
    groups: list[list[str]] = []
    held = 0
    for k in tensors:
        # by default at most one shard per drive: the last takes what the others left
        if not groups or (groups[-1] and held + sizes[k] > cap and (
                max_shard_bytes is not None or len(groups) < len(homes))):
            groups.append([])
            held = 0
        groups[-1].append(k)
        held += sizes[k]
    if not groups:
        groups.append([])           # no tensors: one empty shard, as a model without any
    n = len(groups)
    names = [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for h in homes:
        os.makedirs(h, mode=0o700, exist_ok=True)
    md = dict(metadata) if metadata is not None else {"format": "pt"}

    def write(i: int) -> None:
        home = homes[i % len(homes)]
        target = os.path.join(home, names[i])
        save_file({k: tensors[k] for k in groups[i]}, target, md, handle=handle, mode=mode)
        if home != directory:       # linked from the directory (replacing what was there)
            link = os.path.join(directory, names[i])
            tmp = f"{link}.{os.getpid()}-{secrets.token_hex(6)}.link"
            os.symlink(target, tmp)
            try:
                os.replace(tmp, link)
            except BaseException:
                os.unlink(tmp)
                raise

    with concurrent.futures.ThreadPoolExecutor(
            min(n, len(homes)), thread_name_prefix="aioswap-shard") as pool:
        futures = [pool.submit(write, i) for i in range(n)]
        wait_all(futures)
    for h in set(homes):
        fsync_dir(h)
    index = os.path.join(directory, f"{prefix}.safetensors.index.json")
    doc = {"metadata": {"total_size": total},
           "weight_map": {k: names[i] for i, g in enumerate(groups) for k in g}}
    write_atomic(index, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), mode)
    return index


def _open_tmp(directory: str, tmp: str, mode: int) -> tuple[int, bool]:
    """The file a save writes: (fd, whether it has a name yet).

    ``O_TMPFILE`` where the file system has it (ext4, xfs, btrfs, tmpfs): a crash while
    writing leaves nothing behind, as the file has no name until it is complete. Elsewhere
    the named ``tmp`` (``O_EXCL``); its name carries our pid, so a later save removes it if
    this process dies. O_RDWR: an engine may read back a partial last block around an
    O_DIRECT write.
    """
    flags = os.O_RDWR | os.O_CLOEXEC
    tmpfile = getattr(os, "O_TMPFILE", 0)
    dev = os.stat(directory).st_dev
    if tmpfile and _TMPFILE_WORKS.get(dev, True):
        try:
            fd = os.open(directory, flags | tmpfile, mode)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
            _TMPFILE_WORKS[dev] = False
        else:
            if dev not in _TMPFILE_WORKS:       # linking it later must work too: try once
                probe = f"{tmp}.probe"
                try:
                    os.link(f"/proc/self/fd/{fd}", probe, follow_symlinks=True)
                    os.unlink(probe)
                    _TMPFILE_WORKS[dev] = True
                except OSError:     # EXDEV (some kernels, sandboxes), no /proc
                    _TMPFILE_WORKS[dev] = False
                    os.close(fd)
            if _TMPFILE_WORKS[dev]:
                return fd, False
    return os.open(tmp, flags | os.O_CREAT | os.O_EXCL, mode), True


#: st_dev -> whether O_TMPFILE plus linkat through /proc works on that file system
_TMPFILE_WORKS: dict[int, bool] = {}


def _write_pieces(file: AioFile, pieces: list[_Piece], total: int) -> None:
    """Stage ``pieces`` through a ring of aligned slots; every slot is one pwrite."""
    slot = min(_SLOT_BYTES, -(-total // _ALIGN) * _ALIGN)
    nslots = min(_SLOTS, -(-total // slot))
    # unlocked where mlock is refused: written from direct all the same, so it warns only
    # where a device tensor (or a lazy source, maybe one) is copied into it
    cpu_only = all(isinstance(p.source, torch.Tensor) and p.source.is_cpu for p in pieces)
    ring_mem = pinned.allocate(slot * nslots, strict=False, warn=not cpu_only)
    ring = torch.frombuffer(memoryview(ring_mem), dtype=torch.uint8)
    busy: list[Any] = [None] * nslots
    futures: list[Any] = []
    flat: dict[int, torch.Tensor] = {}
    try:
        k = 0                                       # next piece that has bytes left
        for idx, lo in enumerate(range(0, total, slot)):
            hi = min(total, lo + slot)
            s = idx % nslots
            if busy[s] is not None:
                busy[s].result()                    # its previous write is done
            dst = ring[s * slot:s * slot + (hi - lo)]
            while k < len(pieces) and pieces[k].start + pieces[k].nbytes <= lo:
                flat.pop(k, None)
                k += 1
            j = k
            while j < len(pieces) and pieces[j].start < hi:
                p = pieces[j]
                a, b = max(lo, p.start), min(hi, p.start + p.nbytes)
                src = flat.get(j)
                if src is None:
                    src = flat[j] = flat_bytes(p.source)
                dst[a - lo:b - lo].copy_(src[a - p.start:b - p.start])
                j += 1
            busy[s] = file.pwrite(dst, lo, async_op=True)
            futures.append(busy[s])
    finally:
        concurrent.futures.wait([f for f in futures])
    wait_all(futures)


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
        fd = _open_data(self._path)
        try:
            self._header = _read_header_fd(fd, self._path)
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
        dtype, shape = _dtype_of(info, self._path)
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
