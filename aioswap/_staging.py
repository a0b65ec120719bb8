"""Staging of buffers the kernel cannot take as they are: a contiguous stand-in for a strided,
conjugate or negative view (host or CUDA), copied back after a read.

The handle's general path and :class:`aioswap.stripe.StripedFile` both stage through
:func:`stage`, so a view reads and writes the same bytes on a file and on a striped file.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from aioswap._buffers import Buffer

__all__ = ["stage"]


def stage(mem: Buffer, write: bool, nbytes: int) -> tuple[Any, Callable[[], None] | None]:
    """A contiguous stand-in for the non-contiguous buffer ``mem`` and what to run once a
    read of its first ``nbytes`` into the stand-in succeeded (None for a write).

    The stand-in has ``mem``'s shape, dtype and device. A write sends a copy of the values
    ``mem`` shows (conjugate and negative bits resolved). A read lands in a fresh buffer and
    the elements it reached are copied back in logical order; a read that ends inside an
    element starts from a copy, so that element's other bytes keep their values.
    """
    tmp = _stand_in(mem, write or nbytes % mem.itemsize != 0)
    if write:
        return tmp, None

    def back() -> None:
        _copy_back(mem, tmp, nbytes)
    return tmp, back


def _stand_in(mem: Buffer, copy: bool) -> Any:
    if mem.tensor is not None:
        import torch

        src = mem.tensor.detach()
        if copy:
            return src.resolve_conj().resolve_neg().contiguous()
        return torch.empty(src.shape, dtype=src.dtype, device=src.device)
    arr = mem.array
    return np.ascontiguousarray(arr) if copy else np.empty(arr.shape, dtype=arr.dtype)


def _copy_back(mem: Buffer, tmp: Any, n: int) -> None:
    """Copy the elements of ``tmp`` that its first ``n`` bytes reach into ``mem``."""
    if mem.tensor is not None:
        dst = mem.tensor.detach()
        if n == mem.nbytes:
            dst.copy_(tmp)
        else:
            k = -(-n // dst.element_size())
            flat = dst.flatten()            # a copy, since dst is not contiguous
            flat[:k] = tmp.reshape(-1)[:k]
            dst.copy_(flat.view_as(dst))
        return
    arr = mem.array
    if n == mem.nbytes:
        np.copyto(arr, tmp)
    else:
        k = -(-n // arr.itemsize)
        flat = arr.reshape(-1)              # a copy when arr is not contiguous
        flat[:k] = tmp.reshape(-1)[:k]
        if not np.shares_memory(flat, arr):
            np.copyto(arr, flat.reshape(arr.shape))
