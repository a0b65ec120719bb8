"""Checksums of swapped tensors: xxh3-64 (the ``xxhash`` package) or zlib's crc32.

xxh3-64 runs at about 12 GB/s and releases the GIL on large inputs; crc32 (about 4 GB/s) is
the fallback that needs nothing installed. The algorithm is recorded per manifest entry, so a
directory written with one can be read where only the other is installed (as long as the one
recorded is available, or verification is off).
"""
from __future__ import annotations

import functools
import importlib
import zlib
from typing import TYPE_CHECKING, Any, Protocol

from aioswap import _aio
from aioswap.errors import SwapError

if TYPE_CHECKING:
    import torch

__all__ = ["Hasher", "algorithms", "digest", "host_bytes", "new_hasher"]

#: Bytes hashed per step for CUDA tensors (each step copies that much to the host).
HASH_CHUNK = 64 << 20


class Hasher(Protocol):
    """The incremental interface of an xxhash object."""

    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib.crc32 with the incremental interface of an xxhash object."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


@functools.lru_cache(maxsize=None)
def _xxhash() -> Any:
    """The xxhash module, or None when it is not installed (looked up once)."""
    try:
        return importlib.import_module("xxhash")
    except ImportError:
        return None


def algorithms() -> list[str]:
    """Checksum algorithms usable here, fastest first (``"crc32"`` is always available)."""
    return (["xxh3_64"] if _xxhash() is not None else []) + ["crc32"]


def new_hasher(algo: str) -> Hasher:
    """A fresh incremental hasher of ``algo``.

    Raises
    ------
    SwapError
        Unknown algorithm, or ``"xxh3_64"`` without the xxhash package.
    """
    if algo == "crc32":
        return _Crc32()
    if algo == "xxh3_64":
        mod = _xxhash()
        if mod is None:
            raise SwapError("checksum algorithm 'xxh3_64' needs the xxhash package "
                            "(pip install xxhash)")
        h: Hasher = mod.xxh3_64()
        return h
    raise SwapError(f"unknown checksum algorithm {algo!r}; known: 'xxh3_64', 'crc32'")


def host_bytes(t: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """The first ``nbytes`` (default all) bytes of a contiguous CPU tensor, without a copy.

    The caller keeps ``t`` alive while the view is used.
    """
    n = t.numel() * t.element_size() if nbytes is None else nbytes
    if n == 0:
        return memoryview(b"")
    return _aio.address_view(t.data_ptr(), n)


def digest(t: torch.Tensor, algo: str) -> str:
    """Checksum of the row-major bytes of ``t`` (CPU or CUDA, any layout)."""
    h = new_hasher(algo)
    src = t.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    if src.is_cuda and src.numel():
        import torch
        flat = src.reshape(-1).view(torch.uint8)
        for s in range(0, flat.numel(), HASH_CHUNK):
            host = flat[s:s + HASH_CHUNK].cpu()    # kept alive while it is hashed
            h.update(host_bytes(host))
    else:
        h.update(host_bytes(src))
    return str(h.hexdigest())
