"""One resolver for every buffer aioswap moves: tensors, numpy arrays, buffer-protocol objects.

:func:`resolve` turns what a caller passes into a :class:`Buffer` (address, size, device,
contiguity, writability and the object that keeps the memory alive). Every module that does
I/O on caller memory goes through it, so the rules (which dtypes, which views, which devices)
are stated once.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["Buffer", "resolve"]


class Buffer:
    """A caller's memory, resolved.

    Attributes
    ----------
    address : int
        First byte (host or device address).
    nbytes : int
        Bytes of the logical contents (``numel * itemsize``).
    device : str
        ``"cpu"`` or ``"cuda"``.
    contiguous : bool
        True when the bytes lie in order at ``address`` (no strides, no conjugate or negative
        bit): the engine can move them as they are. Otherwise the handle stages a copy.
    writable : bool
        Whether reads may land in it.
    owner : object
        What the caller passed; a request keeps it referenced until it is finished.
    tensor, array
        The torch tensor or numpy array behind it, when it is one.
    itemsize : int
        Bytes per element (1 for plain buffers).
    """

    __slots__ = ("address", "array", "contiguous", "device", "itemsize", "nbytes", "owner",
                 "tensor", "writable")

    def __init__(self, address: int, nbytes: int, device: str, contiguous: bool,
                 writable: bool, owner: Any, tensor: Any = None, array: Any = None,
                 itemsize: int = 1) -> None:
        self.address = address
        self.nbytes = nbytes
        self.device = device
        self.contiguous = contiguous
        self.writable = writable
        self.owner = owner
        self.tensor = tensor
        self.array = array
        self.itemsize = itemsize

    def __repr__(self) -> str:
        kind = "tensor" if self.tensor is not None else "array" if self.array is not None \
            else type(self.owner).__name__
        return (f"<Buffer {kind} {self.nbytes} bytes at {self.address:#x} on {self.device}"
                f"{'' if self.contiguous else ' strided'}"
                f"{'' if self.writable else ' read-only'}>")


def _tensor_type() -> Any:
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


def resolve(obj: Any) -> Buffer:
    """Resolve ``obj`` to a :class:`Buffer`.

    Raises
    ------
    TypeError
        For objects that expose no memory, tensors on devices other than CPU and CUDA
        (meta, fake), sparse tensors, and numpy arrays of object dtype (their bytes are
        PyObject pointers, meaningless on disk and fatal to read back).
    """
    tensor_type = _tensor_type()
    if tensor_type is not None and isinstance(obj, tensor_type):
        return _resolve_tensor(obj)
    if isinstance(obj, np.ndarray):
        return _resolve_array(obj, obj)
    if isinstance(obj, (int, float, str)) or obj is None:
        raise TypeError(f"buffer must be a torch tensor, a numpy array or support the buffer "
                        f"protocol, got {type(obj).__name__}")
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"buffer must be a torch tensor, a numpy array or support the buffer "
                        f"protocol, got {type(obj).__name__}") from None
    if mv.c_contiguous:
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    else:
        arr = np.asarray(mv)
    if mv.readonly and arr.flags.writeable:
        arr.flags.writeable = False
    return _resolve_array(arr, obj)


def _resolve_tensor(t: Any) -> Buffer:
    dev = t.device.type
    if dev not in ("cpu", "cuda"):
        raise TypeError(f"cannot do I/O on a tensor on device {t.device}; use a CPU or CUDA "
                        f"tensor")
    if t.layout != sys.modules["torch"].strided:
        raise TypeError(f"cannot do I/O on a {t.layout} tensor; use a dense (strided) tensor")
    itemsize = t.element_size()
    # conj() and _neg_view() are lazy: the memory holds the un-negated values, so they are
    # staged through a resolved copy, like strided views
    plain = t.is_contiguous() and not t.is_conj() and not t.is_neg()
    try:
        addr = t.data_ptr()
    except RuntimeError as exc:          # functional / fake wrappers without storage
        raise TypeError(f"cannot do I/O on this tensor ({exc})") from None
    return Buffer(addr, t.numel() * itemsize, dev, plain, True, t, tensor=t,
                  itemsize=itemsize)


def _resolve_array(arr: np.ndarray[Any, Any], owner: Any) -> Buffer:
    if arr.dtype.hasobject:
        raise TypeError(f"cannot do I/O on a numpy array of dtype {arr.dtype}: it holds "
                        f"Python object pointers, not data")
    addr = arr.__array_interface__["data"][0]
    return Buffer(addr, arr.nbytes, "cpu", bool(arr.flags.c_contiguous),
                  bool(arr.flags.writeable), owner, array=arr,
                  itemsize=max(1, arr.dtype.itemsize))
