"""What every part of the swapper shares: the pack alignment, dtypes as the manifest names
them, and the bytes a tensor spans."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aioswap._aio import DEFAULT_ALIGNMENT
from aioswap._util import round_up
from aioswap.errors import SwapError

if TYPE_CHECKING:
    import torch

#: Alignment of every tensor in a pack file (and of the pack's size).
PACK_ALIGN = DEFAULT_ALIGNMENT
SLAB_MAX = 64 << 20           # bytes of one locked slab for small tensors (per write or read)


def round_pack(n: int) -> int:
    """``n`` rounded up to :data:`PACK_ALIGN`."""
    return round_up(n, PACK_ALIGN)


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of a dtype (``"float32"``)."""
    return str(dtype).rpartition(".")[2]


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype the manifest names; one this torch lacks is a :class:`SwapError`."""
    import torch
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SwapError(f"dtype {name!r} in the manifest is not a dtype of this PyTorch "
                        f"({torch.__version__})")
    return dt


def extent(t: torch.Tensor) -> int:
    """Bytes of storage that ``t`` spans from the start of its storage."""
    if t.numel() == 0:
        return 0
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return int((last + 1) * t.element_size())
