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

__all__ = ["NameClaims", "Released", "Releases", "storage_key"]

_log = logging.getLogger("aioswap")
_T = TypeVar("_T")


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
