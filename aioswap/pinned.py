"""Process-wide registry of page-locked ("pinned") memory.

:data:`registry`, the one :class:`PinnedRegistry` of the process, answers before every I/O
request whether a buffer lies entirely inside memory that direct I/O may use, so that the
request can go straight to the drive with ``O_DIRECT`` or must be staged through a bounce
buffer. It keeps two :class:`~aioswap._ranges.RangeIndex` of ranges ``[start, end)``: host
memory, and device memory registered with cuFile (:mod:`aioswap.gds` registers there and
looks up the registered base of a device address there).

The host index holds locked memory (allocated here or registered) and also the *unlocked*
memory a ``strict=False`` allocation hands out where ``mlock`` is refused (a normal user's
``RLIMIT_MEMLOCK``). That memory is not pinned (:meth:`PinnedRegistry.is_pinned` says False,
and it never counts as locked bytes), but it is aioswap's own page-aligned anonymous memory
whose lifetime the registry controls, so direct I/O on the CPU may use it all the same: for
an ``O_DIRECT`` request the kernel pins the pages itself for as long as the I/O runs.
:meth:`PinnedRegistry.is_direct` and :meth:`PinnedRegistry.io_hold` answer for it; user
memory that is not locked is never in the index and is staged as before.

It also hands out locked memory (:func:`allocate`, :func:`empty`) and records ranges locked
elsewhere (:func:`register`).

Lifetime, by construction: the pages of an allocation belong to its
:class:`~aioswap._aio.LockedMemory`, and every tensor made by :func:`empty` owns its storage
through a buffer export of that object (``torch.frombuffer`` over a ``memoryview`` of it). The
range is unregistered (a ``weakref.finalize``), and the pages unlocked and unmapped, only when
the LockedMemory is deallocated, that is when the last tensor, array, memoryview or reference
over it is gone. Nothing here unmaps memory that a live object can still reach, so nothing
needs reference or use counts; :func:`free` only refuses memory that I/O requests still hold.

The module imports neither torch nor numpy: it recognises their objects once their modules
are loaded and imports them only in the functions that create them.
"""
from __future__ import annotations

import errno
import logging
import math
import operator
import os
import resource
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Union

from aioswap import _aio
from aioswap._aio import PAGE_SIZE, LockedMemory
from aioswap._ranges import RangeIndex
from aioswap._units import format_size
# PinnedMemoryWarning lives in aioswap.errors; aioswap.pinned.PinnedMemoryWarning stays valid.
from aioswap.errors import PinnedMemoryError, PinnedMemoryWarning

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

__all__ = [
    "PinnedRegistry",
    "PinnedStats",
    "Registration",
    "allocate",
    "empty",
    "free",
    "is_direct",
    "is_pinned",
    "register",
    "registry",
    "release_reserve",
    "reserve",
    "set_budget",
    "stats",
    "unregister",
]

logger = logging.getLogger("aioswap")

ShapeLike = Union[int, Sequence[int]]

# Kinds of range records.
_ALLOCATED = "allocated"    # locked by allocate(); lives as long as its LockedMemory
_EXTERNAL = "external"      # locked elsewhere, recorded by register()
_UNLOCKED = "unlocked"      # strict=False fallback: aioswap's own unlocked memory, indexed
                            # for direct I/O and I/O holds, never pinned nor counted as locked
# Kinds of this registry's own memory: an I/O hold counts on it and free() takes it.
_OWN = frozenset((_ALLOCATED, _UNLOCKED))

# errno values mlock(2) uses for "not allowed to lock that much".
_MLOCK_LIMIT_ERRNOS = frozenset({errno.EPERM, errno.ENOMEM, errno.EAGAIN})


@dataclass(frozen=True)
class PinnedStats:
    """A consistent snapshot of the registry's counters.

    Attributes
    ----------
    ranges : int
        Locked host ranges registered: allocations plus external registrations.
    bytes_locked : int
        Bytes in those ranges (allocations count whole pages: what is locked).
    peak_bytes : int
        Highest ``bytes_locked`` seen since the registry was created.
    budget : int or None
        Limit on ``bytes_locked`` for new allocations; None when unlimited.
    allocations : int
        Ranges allocated (and locked) by this registry.
    bytes_allocated : int
        Bytes of those allocations.
    device_ranges : int
        Device (cuFile-registered) ranges; never counted as host memory.
    device_bytes : int
        Bytes in device ranges.
    unlocked_fallbacks : int
        ``strict=False`` allocations that got unlocked memory since the registry was created.
    unlocked_ranges : int
        Those of them alive now (direct I/O capable, never counted as locked).
    unlocked_bytes : int
        Bytes of those ranges (whole pages).
    """

    ranges: int
    bytes_locked: int
    peak_bytes: int
    budget: int | None
    allocations: int
    bytes_allocated: int
    device_ranges: int
    device_bytes: int
    unlocked_fallbacks: int
    unlocked_ranges: int
    unlocked_bytes: int


class _Range:
    """One registered (or tracked) range and what keeps it alive."""

    __slots__ = ("device", "end", "finalizer", "io", "kind", "live", "owner", "ref", "start")

    def __init__(self, start: int, end: int, kind: str, device: bool = False,
                 owner: object = None) -> None:
        self.start = start
        self.end = end
        self.kind = kind
        self.device = device
        self.owner = owner
        self.live = True
        self.ref: weakref.ReferenceType[LockedMemory] | None = None
        self.finalizer: weakref.finalize[Any, Any] | None = None
        self.io = 0                 # I/O requests in flight on this memory (hold/unhold)


def _released(rec: _Range) -> bool:
    """Whether ``rec`` is an allocation (locked or not) whose LockedMemory is gone or was
    released."""
    if rec.kind == _EXTERNAL or rec.ref is None:
        return False
    mem = rec.ref()
    return mem is None or mem.closed


# torch.Tensor once torch is imported by someone (never imported from here on a query).
_Tensor: Any = None
# Tensor subclasses seen so far -> whether their instances own real memory.
_subclass_has_memory: dict[type, bool] = {}


def _tensor_type() -> Any:
    """``torch.Tensor`` if torch has been imported, else None."""
    global _Tensor
    if _Tensor is None:
        torch = sys.modules.get("torch")
        if torch is not None:
            _Tensor = getattr(torch, "Tensor", None)
    return _Tensor


def _has_memory(cls: type) -> bool:
    """Whether instances of this torch.Tensor subclass are taken to be backed by real memory.

    A subclass that defines ``__torch_dispatch__`` (fake, functional and other wrapper
    tensors) is a stand-in whose ``data_ptr()`` means nothing (FakeTensor's warns): its
    memory is never asked for, so it is never pinned and never freed here. That is the
    documented extension point, so no torch module path is needed; a real-memory subclass
    that defines it only loses direct I/O (staged instead), never correctness.
    """
    known = _subclass_has_memory.get(cls)
    if known is None:
        base = _tensor_type()
        known = not any("__torch_dispatch__" in vars(k) for k in cls.__mro__
                        if k is not base and k is not object)
        _subclass_has_memory[cls] = known
    return known


def _strided(addr: int, shape: Sequence[int], strides: Sequence[int],
             itemsize: int, unit: int) -> tuple[int, int]:
    """[lo, hi) of a strided view whose element 0 is at ``addr`` (strides in ``unit`` bytes)."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return addr, addr
        d = s * (n - 1)
        if d < 0:
            lo += d
        else:
            hi += d
    return addr + lo * unit, addr + hi * unit + itemsize


def _tensor_extent(x: Any) -> tuple[int, int]:
    """[lo, hi) of a strided tensor with storage (CPU or device addresses)."""
    lo: int = x.data_ptr()
    if x.is_contiguous():
        return lo, lo + x.nbytes
    size: int = x.element_size()
    return _strided(lo, x.shape, x.stride(), size, size)


def _buffer_extent(x: object) -> tuple[int, int]:
    """[lo, hi) of a numpy array, memoryview or buffer-protocol object."""
    if isinstance(x, LockedMemory):
        return (0, 0) if x.closed else (x.address, x.address + x.nbytes)
    import numpy as np
    if isinstance(x, np.ndarray):
        addr: int = x.__array_interface__["data"][0]
        if x.flags.c_contiguous or x.flags.f_contiguous:
            return addr, addr + x.nbytes
        return _strided(addr, x.shape, x.strides, x.itemsize, 1)
    buf: Any = x
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)   # TypeError if no buffer
    if mv.nbytes == 0:
        # numpy cannot always wrap an empty view; its address is unknown and irrelevant.
        return 0, 0
    if mv.c_contiguous:
        addr = np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0]
        return addr, addr + mv.nbytes
    # Strided or Fortran order: numpy finds element 0; the extent comes from the view itself.
    addr = np.asarray(mv).__array_interface__["data"][0]
    return _strided(addr, mv.shape or (), mv.strides or (), mv.itemsize, 1)


def _address_pair(x: tuple[Any, ...]) -> tuple[int, int]:
    if len(x) != 2:
        raise TypeError(f"expected (address, nbytes), got a tuple of {len(x)} items")
    address, nbytes = operator.index(x[0]), operator.index(x[1])
    if address < 0 or nbytes < 0:
        raise ValueError(f"address and nbytes must be non-negative, got ({address}, {nbytes})")
    return address, address + nbytes


def _format_bytes(n: int) -> str:
    return f"{n} bytes" if n < 1024 else f"{format_size(n)} ({n} bytes)"


def _format_limit(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else _format_bytes(n)


def _vmlck() -> int | None:
    """Bytes this process has locked, from /proc/self/status (None where unavailable)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memlock_message(mapped: int, exc: OSError) -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    locked = _vmlck()
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    held = "" if locked is None else f" and this process already has {_format_bytes(locked)} locked"
    return (f"cannot lock {_format_bytes(mapped)} of memory: mlock failed with {code} "
            f"({os.strerror(exc.errno or 0)}). RLIMIT_MEMLOCK is {_format_limit(soft)} "
            f"(hard limit {_format_limit(hard)}){held}. Raise it with `ulimit -l unlimited` "
            f"(or `ulimit -l <KiB>`) in the shell that starts Python, a `memlock` line in "
            f"/etc/security/limits.conf (e.g. `*  -  memlock  unlimited`), LimitMEMLOCK= for a "
            f"systemd service, `docker run --ulimit memlock=-1` for a container, or give the "
            f"process CAP_IPC_LOCK")


def _memlock_short(exc: OSError) -> str:
    """Why mlock failed, in a few words, for the once-per-process warning."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = "unlimited" if soft == resource.RLIM_INFINITY else format_size(soft)
    return f"mlock {errno.errorcode.get(exc.errno or 0, exc.errno)}, RLIMIT_MEMLOCK {lim}"


def _shape_of(shape_or_numel: ShapeLike) -> tuple[int, ...]:
    if isinstance(shape_or_numel, Sequence):
        shape = tuple(operator.index(n) for n in shape_or_numel)
    else:
        shape = (operator.index(shape_or_numel),)
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


class Registration:
    """A registered range; a context manager that unregisters it on exit.

    Returned by :meth:`PinnedRegistry.register`. :meth:`close` is idempotent and also a
    no-op once the range was removed with :meth:`PinnedRegistry.unregister`. The ``owner``
    given at registration is kept alive until then.
    """

    __slots__ = ("_rec", "_registry")

    def __init__(self, registry: PinnedRegistry, rec: _Range) -> None:
        self._registry = registry
        self._rec = rec

    @property
    def address(self) -> int:
        """First byte of the range."""
        return self._rec.start

    @property
    def nbytes(self) -> int:
        """Length of the range in bytes."""
        return self._rec.end - self._rec.start

    @property
    def device(self) -> bool:
        """True for a device (cuFile) range, False for host memory."""
        return self._rec.device

    @property
    def owner(self) -> object:
        """The object kept alive while registered (None after close)."""
        return self._rec.owner

    @property
    def closed(self) -> bool:
        """True once the range is unregistered."""
        return not self._rec.live

    def close(self) -> None:
        """Unregister the range. Idempotent."""
        self._registry._unregister_record(self._rec)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "device" if self.device else "host"
        state = " closed" if self.closed else ""
        return (f"<aioswap.pinned.Registration {kind} [{self.address:#x}, "
                f"{self.address + self.nbytes:#x}){state}>")


class PinnedRegistry:
    """Index of page-locked memory, and the allocator of such memory.

    Use the process-wide instance :data:`aioswap.pinned.registry` (the module functions are
    its bound methods); a separate instance knows only its own ranges.

    Notes
    -----
    Thread safety: every change (allocation, registration, collection of memory) happens
    under one lock, which is also the guard of both :class:`~aioswap._ranges.RangeIndex`.
    Queries take no lock: they bisect the index's immutable snapshot, O(log n); the first
    query after a change rebuilds it once.

    Lifetime: an allocation's range is removed by a ``weakref.finalize`` on its
    :class:`~aioswap._aio.LockedMemory`, which runs before the pages are unlocked and
    unmapped, so no other mapping can reuse the address while it is still registered. The
    pages go only with the LockedMemory itself (see the module's docstring).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None          # thread id inside a critical section
        self._pending: list[_Range] = []        # collected during our own critical section
        self._host: RangeIndex[_Range] = RangeIndex(self._critical)
        self._device: RangeIndex[_Range] = RangeIndex(self._critical)
        # guards each record's ``io`` count; aioswap._aio._io_hold/_unhold take it too
        self._io_lock = threading.Lock()
        self._unlocked_ranges = 0
        self._unlocked_bytes = 0
        self._bytes_locked = 0
        self._peak = 0
        self._reserved = 0
        self._budget: int | None = None
        self._allocations = 0
        self._bytes_allocated = 0
        self._device_bytes = 0
        self._fallbacks = 0
        self._warned = False

    # ----------------------------------------------------------------- locking and state
    @contextmanager
    def _critical(self) -> Iterator[None]:
        """Hold the lock; apply removals that garbage collection queued meanwhile."""
        with self._lock:
            outer = self._owner
            self._owner = threading.get_ident()
            try:
                self._drain()
                yield
            finally:
                self._drain()
                self._owner = outer

    def _drain(self) -> None:
        while self._pending:
            self._remove(self._pending.pop())

    def _collected(self, rec: _Range) -> None:
        """weakref.finalize callback: the LockedMemory behind ``rec`` is being deallocated."""
        if self._owner == threading.get_ident():
            # A collection ran inside one of our own critical sections (an allocation can
            # trigger the cyclic GC): changing the index now could tear the outer operation,
            # so queue it; the critical section applies it before it ends.
            self._pending.append(rec)
            return
        with self._critical():
            self._remove(rec)

    def _insert(self, rec: _Range) -> None:
        """Index ``rec`` and count it (under the lock)."""
        index = self._device if rec.device else self._host
        other = index.overlap(rec.start, rec.end)
        while other is not None and _released(other.value):
            # Its LockedMemory was released by hand (LockedMemory.release()), not collected:
            # the pages are gone, so the record is stale. Drop it for the new one.
            self._remove(other.value)
            other = index.overlap(rec.start, rec.end)
        if other is not None:
            kind = "device" if rec.device else "host"
            raise ValueError(
                f"{kind} range [{rec.start:#x}, {rec.end:#x}) overlaps the registered range "
                f"[{other.start:#x}, {other.end:#x}) ({other.value.kind}); ranges may not "
                f"overlap: unregister the other one first, or register exactly the memory "
                f"you locked")
        index.add(rec.start, rec.end, rec)
        size = rec.end - rec.start
        if rec.device:
            self._device_bytes += size
        elif rec.kind == _UNLOCKED:
            self._unlocked_ranges += 1
            self._unlocked_bytes += size
        else:
            self._bytes_locked += size
            self._peak = max(self._peak, self._bytes_locked)
            if rec.kind == _ALLOCATED:
                self._allocations += 1
                self._bytes_allocated += size

    def _remove(self, rec: _Range) -> None:
        """Forget ``rec`` once (under the lock)."""
        if not rec.live:
            return
        rec.live = False
        rec.owner = None
        index = self._device if rec.device else self._host
        if index.remove(rec.start, rec) is None:
            return
        size = rec.end - rec.start
        if rec.device:
            self._device_bytes -= size
        elif rec.kind == _UNLOCKED:
            self._unlocked_ranges -= 1
            self._unlocked_bytes -= size
        else:
            self._bytes_locked -= size
            if rec.kind == _ALLOCATED:
                self._allocations -= 1
                self._bytes_allocated -= size

    # ----------------------------------------------------------------------- queries
    def is_pinned(self, x: object) -> bool:
        """Whether all of ``x`` lies in page-locked memory, so direct I/O can use it.

        Parameters
        ----------
        x : torch.Tensor, numpy.ndarray, memoryview, buffer-protocol object or (address, nbytes)
            What a request would read into or write from.

        Returns
        -------
        bool
            True iff the whole extent of ``x`` (from the lowest to one past the highest byte
            any element touches, for strided views too) lies inside one registered host
            range, or torch reports the CPU tensor pinned (``x.is_pinned()``, asked only when
            the registry says no). Ranges that merely touch do not join: an extent spanning
            two adjacent registrations is not pinned.

            - Objects holding no bytes (empty tensors, arrays and views, ``(address, 0)``)
              are never pinned: there is no memory to do I/O on, whatever the address.
            - Meta tensors and tensor subclasses that define ``__torch_dispatch__`` (fake,
              functional and other wrapper tensors) are never pinned; torch is not asked.
            - CUDA tensors are True iff their extent lies in one device range registered
              with ``device=True`` (cuFile); host ranges never count for them.
            - Tensors on other devices and sparse tensors are False, except a sparse CPU
              tensor that torch reports pinned.

        Raises
        ------
        TypeError
            For objects that expose no memory.
        ValueError
            For a negative address or size in an (address, nbytes) pair.

        Notes
        -----
        Asked before every request, so it is kept short: no lock, one ``bisect`` on the
        current snapshot, O(log n) in the number of ranges. A contiguous tensor costs
        ``data_ptr()`` and ``nbytes``; a strided view is first checked by its storage's
        extent (a view lies inside its storage) and its strides are walked only when that
        does not settle it. Unlocked memory from ``allocate(strict=False)`` is not pinned
        (see :meth:`is_direct`).
        """
        return self._covered(x, False)

    def is_direct(self, x: object) -> bool:
        """Whether direct I/O may use all of ``x`` without a bounce buffer.

        True where :meth:`is_pinned` is, and also for host memory that this registry
        allocated unlocked (``strict=False`` where ``mlock`` was refused): its pages are
        page-aligned anonymous memory that lives as long as the objects viewing it, and the
        kernel pins them itself for each ``O_DIRECT`` request. Other unlocked memory (the
        caller's) is False: it is staged. The engine asks this (and :meth:`io_hold`) to
        plan a request; ``x`` takes the same forms as for :meth:`is_pinned`.
        """
        return self._covered(x, True)

    def _covered(self, x: object, unlocked: bool) -> bool:
        """:meth:`is_pinned` (``unlocked`` False) or :meth:`is_direct` (True)."""
        tensor_type = _Tensor if _Tensor is not None else _tensor_type()
        if tensor_type is not None and isinstance(x, tensor_type):
            t: Any = x
            if type(t) is not tensor_type and not _has_memory(type(t)):
                return False
            if t.is_cpu:
                host = self._host
                try:
                    lo: int = t.data_ptr()
                    if t.is_contiguous():        # also every tensor without elements
                        hi: int = lo + t.nbytes
                    else:
                        # A view lies inside its storage: when all of the storage is in one
                        # range, so is the view, and its strides need not be walked.
                        storage = t.untyped_storage()
                        s_lo: int = storage.data_ptr()
                        rec = host.value_of(s_lo, s_lo + storage.nbytes())
                        if rec is not None and (unlocked or rec.kind is not _UNLOCKED):
                            return True
                        size: int = t.element_size()
                        lo, hi = _strided(lo, t.shape, t.stride(), size, size)
                except (RuntimeError, NotImplementedError):   # sparse and other layouts
                    return self._torch_says_pinned(t)
                if lo >= hi:
                    return False
                rec = host.value_of(lo, hi)
                if rec is not None and (unlocked or rec.kind is not _UNLOCKED):
                    return True
                return bool(t.is_pinned())
            if t.is_cuda:
                try:
                    lo, hi = _tensor_extent(t)
                except (RuntimeError, NotImplementedError):
                    return False
                return self._device.contains(lo, hi)
            return False          # meta and other devices
        if type(x) is tuple:
            lo, hi = _address_pair(x)
        else:
            lo, hi = _buffer_extent(x)
        rec = self._host.value_of(lo, hi)
        return rec is not None and (unlocked or rec.kind is not _UNLOCKED)

    @staticmethod
    def _torch_says_pinned(t: Any) -> bool:
        try:
            return bool(t.is_pinned())
        except (RuntimeError, NotImplementedError):
            return False

    def find(self, address: int, nbytes: int, *, device: bool = False) -> tuple[int, int] | None:
        """The registered range holding all of ``[address, address + nbytes)``.

        Parameters
        ----------
        address : int
            First byte: a host address, or with ``device=True`` a device address.
        nbytes : int
            Length in bytes; 0 gives None.
        device : bool
            Look in the device index (ranges registered with ``device=True``).

        Returns
        -------
        tuple of int or None
            ``(start, end)`` of the range (locked memory only), or None. cuFile wants I/O
            inside a registered buffer issued against its ``start`` with an offset:
            :mod:`aioswap.gds` asks here.
        """
        lo, hi = _address_pair((address, nbytes))
        span = (self._device if device else self._host).find(lo, hi)
        if span is None or span.value.kind == _UNLOCKED:
            return None
        return span.start, span.end

    # ------------------------------------------------------------------- I/O holds
    def hold(self, address: int, nbytes: int) -> object | None:
        """Count an I/O request on memory from :meth:`allocate`/:meth:`empty` (locked or
        not).

        While a hold is out, :meth:`free` refuses that memory (BufferError). Returns a token
        for :meth:`unhold`, or None when ``[address, address + nbytes)`` is not such memory
        (nothing to count: the request's reference to its buffer keeps any memory alive).
        """
        return self.io_hold(address, nbytes)[0]

    def io_hold(self, address: int, nbytes: int) -> tuple[object | None, bool]:
        """:meth:`hold` and whether direct I/O may use ``[address, address + nbytes)``
        (:meth:`is_direct`: page-locked, or this registry's unlocked memory), in one
        look-up: ``(token or None, direct)`` (what a request asks before it starts)."""
        rec = self._host.value_of(address, address + nbytes) if nbytes > 0 else None
        if rec is None:
            return None, False
        if rec.kind not in _OWN:
            return None, True
        with self._io_lock:
            if not rec.live:
                return None, False
            rec.io += 1
        return rec, True

    def engine_view(self) -> tuple[RangeIndex[_Range], threading.Lock, frozenset[str]]:
        """What the engine reads per request without running Python (``aioswap._aio.Core``):
        the index of host ranges direct I/O may use (its immutable ``snap``), the lock that
        guards the records' ``io`` counts, and the ``kind`` values of records whose memory a
        hold pins (this registry's own allocations, locked or not). The answers are the same
        as :meth:`io_hold` and :meth:`unhold` (a test compares)."""
        return self._host, self._io_lock, _OWN

    def unhold(self, token: object) -> None:
        """Give back a hold from :meth:`hold`."""
        assert isinstance(token, _Range)
        with self._io_lock:
            token.io -= 1

    def stats(self) -> PinnedStats:
        """Counters of the registry, read together under the lock.

        Returns
        -------
        PinnedStats
        """
        with self._critical():
            return PinnedStats(
                ranges=len(self._host) - self._unlocked_ranges, bytes_locked=self._bytes_locked,
                peak_bytes=self._peak, budget=self._budget, allocations=self._allocations,
                bytes_allocated=self._bytes_allocated, device_ranges=len(self._device),
                device_bytes=self._device_bytes, unlocked_fallbacks=self._fallbacks,
                unlocked_ranges=self._unlocked_ranges, unlocked_bytes=self._unlocked_bytes)

    def reserve(self, nbytes: int) -> int:
        """Lock ``nbytes`` of fresh memory now, for page-locked allocations to take later.

        Fresh memory costs a page fault per page when it is first locked (on VMs whose host
        backs guest memory lazily, 1-2 GB/s: slower than a drive), so a program that knows
        it will load a large state dict can pay that early, e.g. on a thread while it builds
        its model (the call releases the GIL while the pages are faulted in). Later
        :meth:`allocate`/:meth:`empty` calls (and so ``swap_in_state_dict``,
        ``aioswap.safetensors.load_file`` and the handles' staging buffers) are carved from
        the reservation while it lasts: no fault and no ``mlock`` then. Reserved memory
        counts against ``RLIMIT_MEMLOCK`` at once, and against the budget only as it is
        allocated. :meth:`release_reserve` gives back what was not taken.

        Parameters
        ----------
        nbytes : int
            Bytes to reserve (rounded up to whole pages); reservations add up (at most 16).

        Returns
        -------
        int
            Bytes reserved and not yet taken, in all.

        Raises
        ------
        PinnedMemoryError
            The memory cannot be locked (``RLIMIT_MEMLOCK``, no ``CAP_IPC_LOCK``): the
            message says how much was asked and what the limit is.
        ValueError
            A size <= 0, or a 17th reservation.
        """
        nbytes = operator.index(nbytes)
        if nbytes <= 0:
            raise ValueError(f"reserve needs a positive size, got {nbytes}")
        try:
            return int(_aio.reserve_locked(nbytes))
        except OSError as exc:
            if exc.errno not in _MLOCK_LIMIT_ERRNOS:
                raise
            mapped = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
            raise PinnedMemoryError(f"reserve: {_memlock_message(mapped, exc)}") from exc

    def release_reserve(self) -> int:
        """Unlock and unmap the reserved memory not taken yet; returns its size in bytes
        (memory already handed out is unaffected)."""
        return int(_aio.release_locked_reserve())

    @property
    def reserved(self) -> int:
        """Bytes reserved by :meth:`reserve` and not taken yet."""
        return int(_aio.locked_reserve_bytes())

    def set_budget(self, nbytes: int | None) -> None:
        """Limit the host bytes locked, or lift the limit.

        Parameters
        ----------
        nbytes : int or None
            An allocation that would bring ``bytes_locked`` (allocations and external host
            registrations together, whole pages) above this is refused:
            :class:`~aioswap.errors.PinnedMemoryError` when strict, unlocked memory with a
            :class:`~aioswap.errors.PinnedMemoryWarning` otherwise. None removes the limit.
            Setting it below what is locked already frees nothing; it only refuses new
            allocations. External registrations are never refused: their memory is locked
            already.

        Raises
        ------
        ValueError
            For a negative budget.
        """
        if nbytes is not None:
            nbytes = operator.index(nbytes)
            if nbytes < 0:
                raise ValueError(f"budget must be >= 0 or None, got {nbytes}")
        with self._critical():
            self._budget = nbytes

    # ------------------------------------------------------------------- allocation
    def allocate(self, nbytes: int, *, strict: bool = True, warn: bool = True
                 ) -> LockedMemory:
        """Page-aligned memory, locked in RAM and registered while it lives.

        Parameters
        ----------
        nbytes : int
            Size in bytes (> 0). Whole pages are mapped and locked and registered.
        strict : bool
            When the memory cannot be locked (RLIMIT_MEMLOCK, budget), True raises and
            leaves nothing behind (no mapping, no range, no accounting); False ("try" mode)
            returns page-aligned *unlocked* memory: not pinned (:meth:`is_pinned` is False,
            it is not counted as locked), but recorded as this registry's own, so that
            direct I/O on the CPU uses it (:meth:`is_direct`) and :meth:`free` refuses it
            while I/O runs on it. It warns once per process with
            :class:`~aioswap.errors.PinnedMemoryWarning` (see ``warn``).
        warn : bool
            Whether unlocked memory handed out with ``strict=False`` warns (once per
            process). Pass False for memory that only file I/O on the CPU uses: that runs
            direct on it all the same, so nothing there is slower. Keep it for memory that
            CUDA copies go through (a copy from pageable memory is slower and synchronous)
            or that io_uring should register.

        Returns
        -------
        aioswap._aio.LockedMemory
            A writable buffer (``.address``, ``.nbytes``, ``.locked``).

        Raises
        ------
        PinnedMemoryError
            Strict, and mlock failed (the message names RLIMIT_MEMLOCK's value and how to
            raise it) or the budget would be exceeded.
        ValueError
            For ``nbytes <= 0``.
        MemoryError
            When the memory cannot even be mapped.

        Notes
        -----
        Lifetime: the object owns the pages. ``torch.frombuffer`` and ``numpy.frombuffer``
        views keep it alive; the range is unregistered, unlocked and unmapped when the last
        of them (and the object itself) is collected.
        """
        return self._allocate(operator.index(nbytes), strict, 3, warn)[0]

    def _allocate(self, nbytes: int, strict: bool, stacklevel: int, warn: bool = True
                  ) -> tuple[LockedMemory, _Range]:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        mapped = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
        with self._critical():
            budget = self._budget
            over = budget is not None and self._bytes_locked + self._reserved + mapped > budget
            if not over:
                self._reserved += mapped
        if over:
            message = (f"cannot lock {_format_bytes(mapped)}: the pinned memory budget is "
                       f"{_format_bytes(budget or 0)} and {_format_bytes(self._bytes_locked)} "
                       f"are locked; raise it with aioswap.pinned.registry.set_budget() "
                       f"or free pinned memory")
            if strict:
                raise PinnedMemoryError(message)
            return self._fallback(nbytes, f"pinned memory budget {format_size(budget or 0)} "
                                  f"reached", "raise it with PinnedRegistry.set_budget()",
                                  message, stacklevel + 1, warn)
        try:
            mem = LockedMemory(nbytes, True)
        except BaseException as exc:
            with self._critical():
                self._reserved -= mapped
            if not isinstance(exc, OSError) or exc.errno not in _MLOCK_LIMIT_ERRNOS:
                raise
            message = _memlock_message(mapped, exc)
            if strict:
                raise PinnedMemoryError(f"{message}; or allocate with strict=False to fall "
                                        f"back to unlocked memory"
                                        ) from exc
            return self._fallback(nbytes, _memlock_short(exc),
                                  "raise it with `ulimit -l unlimited`", message, stacklevel + 1,
                                  warn)
        with self._critical():
            self._reserved -= mapped
            rec = self._record(mem, _ALLOCATED)
        self._finalize(mem, rec)
        return mem, rec

    def _record(self, mem: LockedMemory, kind: str) -> _Range:
        """Index fresh memory as this registry's own, of ``kind`` (the caller holds the
        registry's lock)."""
        rec = _Range(mem.address, mem.address + mem.mapped_bytes, kind)
        rec.ref = weakref.ref(mem)
        try:
            self._insert(rec)
        except ValueError as exc:
            # A stale external registration covers memory the kernel just gave us: that
            # registration outlived its memory. Nothing else has seen `mem` yet.
            mem.release()
            raise PinnedMemoryError(f"fresh memory is already registered: {exc}") from None
        return rec

    def _finalize(self, mem: LockedMemory, rec: _Range) -> None:
        """Unindex ``rec`` when ``mem`` is collected."""
        fin = weakref.finalize(mem, self._collected, rec)
        fin.atexit = False
        rec.finalizer = fin

    def _fallback(self, nbytes: int, cause: str, fix: str, detail: str, stacklevel: int,
                  warn: bool) -> tuple[LockedMemory, _Range]:
        """Unlocked memory, indexed as this registry's own (direct I/O may use it, see
        :meth:`is_direct`), and, when ``warn``, the first time one short line (what,
        ``cause``, ``fix``) as a warning; ``detail`` (every way to raise the limit) goes to
        the debug log: most users meet this once per process, where a paragraph of advice
        is noise."""
        mem = LockedMemory(nbytes, False)
        with self._critical():
            rec = self._record(mem, _UNLOCKED)
            self._fallbacks += 1
            if warn:
                warn, self._warned = not self._warned, True
        self._finalize(mem, rec)
        logger.debug("using %d bytes of unlocked memory (direct I/O on the CPU still uses it; "
                     "CUDA copies through it are pageable): %s", nbytes, detail)
        if warn:
            warnings.warn(f"aioswap: {format_size(mem.mapped_bytes)} not page-locked ({cause}); "
                          f"I/O works, slower; {fix}", PinnedMemoryWarning, stacklevel=stacklevel)
        return mem, rec

    def empty(self, shape_or_numel: ShapeLike, dtype: torch.dtype, *,
              strict: bool = True, warn: bool = True) -> torch.Tensor:
        """An uninitialised CPU tensor over freshly allocated locked memory.

        Parameters
        ----------
        shape_or_numel : int or sequence of int
            Number of elements, or the shape.
        dtype : torch.dtype
            Any torch dtype.
        strict, warn : bool
            As for :meth:`allocate`.

        Returns
        -------
        torch.Tensor
            Contiguous, page-aligned, not a view of another tensor. Its storage owns the
            memory through a buffer export of the :class:`~aioswap._aio.LockedMemory`, so
            the memory lives exactly as long as the storage: it is freed when the tensor and
            every view and alias of it (slices, ``.numpy()``, DLPack) are collected. A tensor
            with no elements still owns one page, but is never reported pinned.

        Raises
        ------
        PinnedMemoryError, ValueError, TypeError
            As for :meth:`allocate`; TypeError when ``dtype`` is not a torch dtype.
        ImportError
            When torch is not installed.
        """
        import torch

        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        shape = _shape_of(shape_or_numel)
        nbytes = math.prod(shape) * dtype.itemsize
        mem, _ = self._allocate(max(nbytes, 1), strict, 3, warn)
        # Through a memoryview the storage holds a buffer export on the memory (so
        # LockedMemory.release() refuses while the storage lives); torch.frombuffer on the
        # object itself would hold only a reference.
        raw = torch.frombuffer(memoryview(mem), dtype=torch.uint8)
        # set_ rather than .view(): the result is a base tensor, not a view of `raw`.
        strides = [1] * len(shape)
        for i in range(len(shape) - 1, 0, -1):
            strides[i - 1] = strides[i] * max(shape[i], 1)
        return torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), 0, shape, strides)

    def free(self, obj: object) -> None:
        """Say that the caller is done with memory from :meth:`allocate` or :meth:`empty`.

        The memory is released (unregistered, unlocked, unmapped) when its
        :class:`~aioswap._aio.LockedMemory` is deallocated: at once when the caller drops
        its last reference to ``obj`` and nothing else views the memory, else with the last
        view. ``free`` never releases memory itself and never changes ``obj``, so no live
        tensor, array or capsule can be left pointing at unmapped pages, whatever holds it.
        It refuses while I/O requests use the memory, so that memory the kernel may still
        write is not handed back by mistake. Calling it is never required.

        Parameters
        ----------
        obj : torch.Tensor or aioswap._aio.LockedMemory
            A tensor over memory from :meth:`empty` (or any view of it), or a LockedMemory
            from :meth:`allocate`. A LockedMemory released by hand
            (``LockedMemory.release()``, which unmaps at once) is accepted: its range is
            forgotten now rather than when the object is collected.

        Raises
        ------
        BufferError
            While I/O requests hold the memory (:meth:`hold`): wait for them first.
        TypeError
            For numpy arrays and other objects.
        ValueError
            For memory that this registry did not allocate.
        """
        if isinstance(obj, LockedMemory):
            if obj.closed:
                self._forget_released(obj)
                return
            rec = self._record_of(obj.address)
            if rec is None or rec.ref is None or rec.ref() is not obj:
                raise ValueError(f"{obj!r} was not allocated by aioswap.pinned")
            self._check_idle(rec, repr(obj))
            return
        tensor_type = _tensor_type()
        if tensor_type is not None and isinstance(obj, tensor_type):
            import torch

            t: Any = obj
            if not _has_memory(type(t)) or not t.is_cpu or t.layout != torch.strided:
                raise ValueError("free() takes a CPU tensor from pinned.empty()")
            rec = self._record_of(t.untyped_storage().data_ptr())
            if rec is None:
                raise ValueError("this tensor's memory was not allocated by pinned.empty()")
            self._check_idle(rec, "the tensor")
            return
        numpy_mod = sys.modules.get("numpy")
        if numpy_mod is not None and isinstance(obj, numpy_mod.ndarray):
            raise TypeError("free() takes a tensor from pinned.empty() or a LockedMemory from "
                            "pinned.allocate(), not a numpy array: drop every reference to "
                            "the array and its views, and the memory goes with the last one")
        raise TypeError(f"free() takes a tensor from pinned.empty() or a LockedMemory from "
                        f"pinned.allocate(), not {type(obj).__name__}")

    def _forget_released(self, mem: LockedMemory) -> None:
        """Drop the range of an allocation released by hand (its address is gone with it)."""
        with self._critical():
            for span in self._host:
                if span.value.ref is not None and span.value.ref() is mem:
                    self._remove(span.value)
                    return

    def _record_of(self, address: int) -> _Range | None:
        """The allocation (locked or not) whose memory holds ``address``."""
        rec = self._host.value_of(address, address + 1)
        return rec if rec is not None and rec.kind in _OWN else None

    def _check_idle(self, rec: _Range, what: str) -> None:
        with self._io_lock:
            if rec.io:
                raise BufferError(f"cannot free {what}: {rec.io} I/O request(s) in flight use "
                                  f"its memory; wait for them (handle.wait()) first")

    # ----------------------------------------------------------------- registration
    def register(self, address: int, nbytes: int, *, device: bool = False,
                 owner: object = None) -> Registration:
        """Record a range that was locked (or cuFile-registered) elsewhere.

        Parameters
        ----------
        address : int
            First byte: host address (torch-pinned, ``cudaHostRegister``-ed memory) or,
            with ``device=True``, a device address registered with cuFile.
        nbytes : int
            Length in bytes (> 0).
        device : bool
            Device ranges live in their own index: they never make host memory pinned and
            may share numeric addresses with host ranges.
        owner : object, optional
            Kept alive until the range is unregistered (the tensor that owns the memory).

        Returns
        -------
        Registration
            A context manager; leaving it (or ``close()``) unregisters the range.

        Raises
        ------
        ValueError
            When the range overlaps a registered range of the same kind (host or device),
            or for a non-positive address or size.

        Notes
        -----
        The registry trusts the caller: the range must stay locked (mapped, for device
        memory) until it is unregistered. Registered host bytes count in ``bytes_locked``
        and against the budget of later allocations.
        """
        address, nbytes = operator.index(address), operator.index(nbytes)
        if address <= 0 or nbytes <= 0:
            raise ValueError(f"cannot register address {address:#x} with {nbytes} bytes: "
                             f"both must be positive")
        rec = _Range(address, address + nbytes, _EXTERNAL, device=bool(device), owner=owner)
        with self._critical():
            self._insert(rec)
        return Registration(self, rec)

    def unregister(self, address: int, *, device: bool = False) -> None:
        """Remove the registered range that starts at ``address``.

        Parameters
        ----------
        address : int
            Start of a range given to :meth:`register`.
        device : bool
            Look in the device index instead of the host index.

        Raises
        ------
        ValueError
            When no registered range starts there, or the range belongs to an allocation
            (it is removed when that memory is collected).
        """
        address = operator.index(address)
        with self._critical():
            span = (self._device if device else self._host).at(address)
            if span is None:
                kind = "device" if device else "host"
                raise ValueError(f"no {kind} range is registered at {address:#x}")
            if span.value.kind in _OWN:
                raise ValueError(f"the range at {address:#x} belongs to memory from "
                                 f"pinned.allocate(); it is unregistered when that memory is "
                                 f"collected")
            self._remove(span.value)

    def _unregister_record(self, rec: _Range) -> None:
        with self._critical():
            self._remove(rec)


registry: PinnedRegistry = PinnedRegistry()
"""The process-wide registry; the module functions below are its bound methods."""

is_pinned = registry.is_pinned
is_direct = registry.is_direct
allocate = registry.allocate
empty = registry.empty
free = registry.free
register = registry.register
unregister = registry.unregister
stats = registry.stats
set_budget = registry.set_budget
reserve = registry.reserve
release_reserve = registry.release_reserve
