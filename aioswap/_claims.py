"""Name claims and released tensors of a TensorSwapper.

``NameClaims`` orders operations on one name: a swap-out, overwrite, removal or compaction
claims its names (waiting for operations in flight on them), and a swap-in waits until none
of its names is claimed. ``Releases`` keeps the tensors freed by ``release=True`` until they
are restored, and the restores in flight (so two swap-ins of one released tensor share one
read). Both are guarded by the swapper's lock, which their callers hold where noted.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from aioswap.errors import SwapError

if TYPE_CHECKING:
    import torch

__all__ = ["NameClaims", "Released", "Releases", "guard", "released_as", "storage_key",
           "unguard"]

_log = logging.getLogger("aioswap")
_T = TypeVar("_T")


# What a released tensor still answers: its metadata (none of it reads the freed memory).
# Everything else (math, indexing, data_ptr, numpy, copies, repr through torch) raises.
_SAFE = frozenset({
    "shape", "dtype", "device", "layout", "size", "dim", "ndim", "numel", "nelement",
    "element_size", "itemsize", "nbytes", "stride", "storage_offset", "is_contiguous",
    "untyped_storage", "requires_grad", "grad", "is_leaf", "is_cuda", "is_cpu", "is_meta",
    "is_sparse", "is_quantized", "is_complex", "is_floating_point", "is_conj", "is_neg",
    "_is_view", "names", "__hash__", "grad_fn", "_base", "name", "__get__",
})
_ATTR = "_aioswap_released"         # on a released tensor: the name it was swapped out as
_guards: dict[type, type] = {}      # tensor class -> its released twin


def _released_name(args: Any) -> str:
    for a in args:
        found = _released_name(a) if isinstance(a, (list, tuple)) else getattr(a, _ATTR, None)
        if isinstance(found, str) and found:
            return found
    return ""


def _refuse(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    import torch

    what = getattr(func, "__name__", "")
    if what == "__get__":               # a property: its name is on the descriptor
        what = getattr(getattr(func, "__self__", None), "__name__", what)
    if what in _SAFE:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    name = _released_name(list(args) + list((kwargs or {}).values()))
    raise SwapError(f"{what}() on the tensor swapped out as {name!r} with release=True: its "
                    f"memory was freed; swap_in({name!r}) restores it in place")


def _released_repr(self: Any) -> str:
    return (f"<released tensor {getattr(self, _ATTR, '?')!r}: shape {tuple(self.shape)}, "
            f"{self.dtype}; swap it in to use it>")


def guard(tensor: torch.Tensor, name: str) -> None:
    """Make a tensor whose storage was freed refuse every use that would read it."""
    cls = type(tensor)
    if getattr(tensor, _ATTR, None) is not None:
        setattr(tensor, _ATTR, name)
        return
    twin = _guards.get(cls)
    if twin is None:
        twin = _guards[cls] = type(f"Released{cls.__name__}", (cls,), {
            "__torch_function__": classmethod(_refuse), "__repr__": _released_repr,
            "__str__": _released_repr, "__module__": __name__})
    setattr(tensor, _ATTR, name)
    tensor.__class__ = twin


def unguard(tensor: torch.Tensor) -> None:
    """Undo :func:`guard` (before the tensor's storage is given memory again)."""
    if getattr(tensor, _ATTR, None) is not None:
        tensor.__class__ = type(tensor).__mro__[1]
        delattr(tensor, _ATTR)


def released_as(tensor: Any) -> str | None:
    """The name a tensor was released under (it is guarded, its storage freed), else None."""
    name = getattr(tensor, _ATTR, None)
    return name if isinstance(name, str) else None


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (stable across ``resize_``)."""
    st = t.untyped_storage()
    key = getattr(st, "_cdata", None)
    return int(key) if isinstance(key, int) else id(st)


class NameClaims:
    """Names with an operation in flight."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._busy: dict[str, threading.Event] = {}

    def claim(self, names: list[str], check: Callable[[list[str]], None]) -> threading.Event:
        """Wait until no operation is in flight on ``names``, then mark them busy.

        ``check(names)`` runs with the lock held once they are free, and may raise (closed
        swapper, names taken) before anything is marked.
        """
        if len(set(names)) != len(names):
            raise SwapError("the same name appears twice in one request")
        while True:
            with self._lock:
                waits = [self._busy[n] for n in names if n in self._busy]
                if not waits:
                    check(names)
                    ev = threading.Event()
                    for n in names:
                        self._busy[n] = ev
                    return ev
            for w in waits:
                w.wait()

    def unclaim(self, names: list[str], ev: threading.Event) -> None:
        with self._lock:
            for n in names:
                if self._busy.get(n) is ev:
                    del self._busy[n]
        ev.set()

    def when_free(self, names: list[str], then: Callable[[], _T]) -> _T:
        """Run ``then()`` with the lock held as soon as none of ``names`` is claimed."""
        while True:
            with self._lock:
                waits = [self._busy[n] for n in names if n in self._busy]
                if not waits:
                    return then()
            for w in waits:
                w.wait()


@dataclass
class Released:
    """A tensor whose storage was freed by ``release=True``, waiting for ``swap_in``."""

    tensor: torch.Tensor
    storage_nbytes: int


class Releases:
    """Released tensors by name, and their restores in flight (callers hold the lock)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Released] = {}
        self._by_storage: dict[int, str] = {}         # storage key -> name
        self._restoring: dict[str, concurrent.futures.Future[Any]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> Released | None:
        return self._by_name.get(name)

    def release(self, name: str, tensor: torch.Tensor) -> None:
        """Free the storage of a published tensor."""
        st = tensor.untyped_storage()
        if tensor.numel() == 0:     # nothing to free, but swap_in restores the same object
            self._by_name[name] = Released(tensor, st.nbytes())
            return
        key = storage_key(tensor)
        other = self._by_storage.get(key)
        if (other is not None and other != name) or st.nbytes() == 0:
            # the storage is already released under another name, which restores it
            _log.debug("%r not released: its storage is already released as %r", name, other)
            return
        self._by_name[name] = Released(tensor, st.nbytes())
        self._by_storage[key] = name
        st.resize_(0)
        guard(tensor, name)

    def overwritten(self, name: str, tensor: torch.Tensor, release: bool) -> None:
        """``name`` was just overwritten with ``tensor`` (published). A released tensor of the
        same shape and dtype stays released under the name, so a swap-in (``onload(into=)``)
        restores it in place with the new bytes; one that no longer fits is dropped. With
        ``release`` the new tensor is released instead."""
        rel = self._by_name.get(name)
        if rel is not None and (release or tuple(rel.tensor.shape) != tuple(tensor.shape)
                                or rel.tensor.dtype != tensor.dtype):
            self.forget(name)
        if release:
            self.release(name, tensor)

    def forget(self, name: str) -> None:
        """Drop the released tensor of ``name`` (restored, overwritten or removed)."""
        rel = self._by_name.pop(name, None)
        if rel is not None:
            key = storage_key(rel.tensor)
            if self._by_storage.get(key) == name:
                del self._by_storage[key]

    def restoring(self, name: str) -> concurrent.futures.Future[Any] | None:
        """The future of a restore of ``name`` in flight, if any."""
        return self._restoring.get(name)

    def begin_restore(self, name: str, fut: concurrent.futures.Future[Any]) -> None:
        self._restoring[name] = fut

    def end_restore(self, name: str, fut: concurrent.futures.Future[Any]) -> None:
        if self._restoring.get(name) is fut:
            del self._restoring[name]
