"""The safetensors format itself: its dtypes, its header (checked before anything is
allocated) and :class:`SafetensorsError`.

What :mod:`aioswap.safetensors` reads and :mod:`aioswap._st_write` writes both rest on it; the
public names are exported by :mod:`aioswap.safetensors` (see its notes for the format).
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch

from aioswap._units import shape_fits
from aioswap._util import unique_keys
from aioswap.errors import AioswapError

PathLike = Union[str, "os.PathLike[str]"]

#: Largest JSON header accepted, in bytes (the limit the ``safetensors`` package applies).
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"     # the header's key for the metadata, never a tensor's name


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
RANK = {d.name: i for i, d in enumerate(_DTYPE_LIST)}   # writers order tensors by it

#: The format's dtype names and their bits per element.
DTYPES: Mapping[str, int] = {d.name: d.bits for d in _DTYPE_LIST}


def _torch_dtype(d: _DType) -> torch.dtype | None:
    if d.torch_name is None:
        return None
    value = getattr(torch, d.torch_name, None)
    return value if isinstance(value, torch.dtype) else None


FROM_TORCH: dict[torch.dtype, _DType] = {}     # the dtypes of this torch the format holds
for _d in _DTYPE_LIST:
    _t = _torch_dtype(_d)
    if _t is not None:
        FROM_TORCH[_t] = _d
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


def describe(path: str | None) -> str:
    """How messages name a file (or in-memory data)."""
    return repr(path) if path is not None else "safetensors data"


def reject_constant(value: str) -> Any:
    """``json.loads``' ``parse_constant``: NaN and the infinities are not JSON."""
    raise ValueError(f"{value} is not valid JSON")


def parse_header(raw: bytes, data_bytes: int, path: str | None) -> Header:
    """Check a header's JSON against a data region of ``data_bytes``; nothing is allocated."""
    where = describe(path)

    def fail(msg: str) -> SafetensorsError:
        return SafetensorsError(f"{where}: {msg}", path=path)

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"the header is not valid UTF-8 ({exc.reason} at byte {exc.start})"
                   ) from None

    try:
        obj = json.loads(text, object_pairs_hook=unique_keys, parse_constant=reject_constant)
    except (ValueError, RecursionError) as exc:
        raise fail(f"the header is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise fail(f"the header must be a JSON object, got {type(obj).__name__}")
    metadata = obj.pop(METADATA_KEY, None)
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


def header_length(prefix: bytes, size: int, path: str | None) -> int:
    """The JSON length from the first 8 bytes, checked against the limit and ``size``."""
    where = describe(path)
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


def pread_all(fd: int, n: int, offset: int, path: str) -> bytes:
    """``n`` bytes at ``offset``; a file that ends first is refused."""
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


def open_data(path: str) -> int:
    """Open a file to read its tensors. ``O_NONBLOCK``: a FIFO in its place is refused by the
    regular-file check instead of blocking the open (no effect on regular files)."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)


def read_header_fd(fd: int, path: str) -> Header:
    """The checked header of an open file (a regular one)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SafetensorsError(f"{path!r} is not a regular file", path=path)
    size = st.st_size
    n = header_length(pread_all(fd, min(8, size), 0, path), size, path)
    raw = pread_all(fd, n, 8, path)
    return parse_header(raw, size - 8 - n, path)


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
    fd = open_data(path)
    try:
        try:
            # only the header's pages: read-ahead would pull the first tensors into the
            # page cache, where direct reads never look for them
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:         # not a regular file (ESPIPE): refused below, as it was
            pass
        return read_header_fd(fd, path)
    finally:
        os.close(fd)


def dtype_of(info: TensorInfo, path: str | None) -> tuple[torch.dtype, tuple[int, ...]]:
    """The torch dtype and shape of a tensor of the file."""
    d = _DTYPES[info.dtype]
    t = _torch_dtype(d)
    if t is None:
        raise SafetensorsError(f"{describe(path)}: tensor {info.name!r} has dtype {d.name}, which "
                               f"this torch ({torch.__version__}) has no dtype for", path=path)
    shape = info.shape
    if d.packed > 1:
        if not shape or shape[-1] % d.packed:
            raise SafetensorsError(f"{describe(path)}: tensor {info.name!r} of {d.name} has "
                                   f"shape {list(shape)}; torch.{d.torch_name} needs a last "
                                   f"dimension divisible by {d.packed}", path=path)
        shape = shape[:-1] + (shape[-1] // d.packed,)
    return t, shape
