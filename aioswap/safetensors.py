"""The safetensors format, read and written with batched direct I/O through an AioHandle.

Same calls as ``safetensors.torch``: :func:`load_file`, :func:`save_file`, :func:`load`,
:func:`save` and a lazy :func:`safe_open`. Files written here are read by the ``safetensors``
package unchanged and the other way round.

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

Writing: the header (compact JSON, spaces up to a multiple of 8 bytes, tensors ordered by
dtype alignment then name: the bytes ``safetensors`` writes) and the tensors' bytes are staged
through a ring of page-locked 16 MiB slots written at aligned file offsets with ``O_DIRECT``,
the copy into one slot overlapping the writes of the others; then fsync, and the temporary
file is renamed over ``filename`` (a crash never leaves a half-written checkpoint there).
"""
from __future__ import annotations

import collections
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Union

import numpy as np
import torch

from aioswap import _scratch as _tmpfiles
from aioswap import pinned
from aioswap._aio import DEFAULT_ALIGNMENT as _ALIGN
from aioswap._files import AioFile
from aioswap._units import shape_fits
from aioswap._util import flat_bytes, fsync_dir, wait_all, write_atomic
from aioswap.errors import AioswapError
from aioswap.handle import AioHandle, shared_handle

__all__ = [
    "MAX_HEADER_BYTES",
    "DTYPES",
    "Header",
    "SafeOpen",
    "SafetensorsError",
    "TensorInfo",
    "load",
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

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise ValueError(f"duplicate key {k!r}")
            out[k] = v
        return out

    try:
        obj = json.loads(text, object_pairs_hook=pairs, parse_constant=_reject_constant)
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


@dataclass
class _Group:
    """Consecutive tensors read with one request into one buffer."""

    infos: list[TensorInfo]
    file_start: int           # aligned file offset the buffer starts at
    nbytes: int
    buf: Any = None
    future: Any = None
    locked: bool = False      # buf counts against the page-locked budget


def _groups(header: Header, file_size: int, first: int, most: int) -> list[_Group]:
    """Tensors in file order, cut into groups of ``first``, ``2 * first``... ``most`` bytes.

    Small groups first, so the first read starts early and the allocation of the later,
    larger buffers overlaps the reads of the earlier ones.
    """
    out: list[_Group] = []
    group_bytes = first
    cur: list[TensorInfo] = []
    order = sorted((i for i in header.tensors.values() if i.nbytes),
                   key=lambda i: i.begin)
    for i, info in enumerate(order):
        cur.append(info)
        if (cur[-1].end - cur[0].begin >= group_bytes or i == len(order) - 1):
            lo = header.data_offset + cur[0].begin
            hi = header.data_offset + cur[-1].end
            start = lo // _ALIGN * _ALIGN
            stop = min(-(-hi // _ALIGN) * _ALIGN, file_size)
            out.append(_Group(cur, start, stop - start))
            cur = []
            group_bytes = min(most, 2 * group_bytes)
    return out


def load_file(filename: PathLike, device: str | int | torch.device = "cpu", *,
              handle: AioHandle | None = None, max_pinned_bytes: int | None = None
              ) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file, reading it with direct I/O.

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
    (RLIMIT_MEMLOCK) it is plain page-aligned memory, one warning per process, and the
    reads are staged through the handle's bounce pool.
    """
    path = os.fspath(filename)
    dev = _device(device)
    if sys.byteorder != "little":
        raise SafetensorsError("safetensors data is little-endian; this machine is not",
                               path=path)
    limit = _phys_bytes() // 2 if max_pinned_bytes is None else operator.index(
        max_pinned_bytes)
    fd = _open_data(path)
    try:
        header = _read_header_fd(fd, path)
        h = shared_handle() if handle is None else handle
        file = h.adopt(fd)                  # the handle's own file from here on
        fd = -1
    finally:
        if fd >= 0:
            os.close(fd)
    try:
        types = {name: _dtype_of(info, path) for name, info in header.tensors.items()}
        groups = _groups(header, header.data_offset + header.data_bytes,
                         _FIRST_GROUP_BYTES, _GROUP_BYTES)
        out: dict[str, torch.Tensor] = {}
        futures: list[Any] = []
        pending: collections.deque[_Group] = collections.deque()

        def finish(g: _Group) -> None:
            """Wait for one group, then make (and move) its tensors."""
            concurrent.futures.wait([g.future])
            if g.future.exception() is not None:
                wait_all(futures)                   # every read ends; the first error raises
            for info in g.infos:
                dtype, shape = types[info.name]
                t = _view(g.buf, header.data_offset + info.begin - g.file_start, info, dtype,
                          shape)
                out[info.name] = t if dev.type == "cpu" else t.to(dev)
            g.buf = None

        # Host memory: on the CPU it is the result, so every group keeps its buffer and the
        # first `limit` bytes are page-locked. For a device it is staging: at most `window`
        # bytes are in flight, and a group's buffer goes once its tensors are on the device.
        window = None if dev.type == "cpu" else min(limit, _DEVICE_WINDOW_BYTES)
        inflight = locked = 0
        try:
            for g in groups:      # allocate and submit; later allocations overlap the reads
                while window is not None and pending and inflight + g.nbytes > window:
                    done = pending.popleft()
                    finish(done)
                    inflight -= done.nbytes
                    locked -= done.nbytes if done.locked else 0
                if locked + g.nbytes <= limit:
                    g.buf = memoryview(pinned.allocate(g.nbytes, strict=False))
                    g.locked = True
                    locked += g.nbytes
                else:
                    g.buf = np.empty(g.nbytes, dtype=np.uint8).data
                target = torch.frombuffer(g.buf, dtype=torch.uint8)
                g.future = file.pread(target, g.file_start, async_op=True)
                futures.append(g.future)
                pending.append(g)
                inflight += g.nbytes
            while pending:
                finish(pending.popleft())
        finally:
            concurrent.futures.wait(futures)        # never leave the kernel writing
        for name, info in header.tensors.items():     # empty tensors, and header order
            if name not in out:
                dtype, shape = types[name]
                out[name] = torch.empty(shape, dtype=dtype, device=dev)
        return {name: out[name] for name in header.tensors}
    finally:
        file.close()


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
    ring_mem = pinned.allocate(slot * nslots, strict=False)
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
