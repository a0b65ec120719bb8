"""Process-wide registry of page-locked ("pinned") memory.

:data:`registry`, the one :class:`PinnedRegistry` of the process, answers before every I/O
request whether a buffer lies entirely inside locked memory, so that the request can go
straight to the drive with ``O_DIRECT`` or must be staged through a bounce buffer. It holds an
interval index of locked host ranges ``[start, end)`` (sorted, non-overlapping) and, apart from
it, ranges of device memory registered with cuFile.

It also hands out locked memory (:func:`allocate`, :func:`empty`, :func:`empty_numpy`) whose
range is registered while the memory lives and unregistered, unlocked and unmapped when the last
object viewing it is collected, and records ranges locked elsewhere (:func:`register`).

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
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Union

from aioswap._aio import PAGE_SIZE, LockedMemory
from aioswap.errors import AioswapWarning, PinnedMemoryError

if TYPE_CHECKING:
    import numpy
    import numpy.typing as npt
    import torch
    from typing_extensions import Self

__all__ = [
    "PinnedMemoryWarning",
    "PinnedRegistry",
    "PinnedStats",
    "Registration",
    "allocate",
    "empty",
    "empty_numpy",
    "extent",
    "free",
    "is_device_registered",
    "is_pinned",
    "register",
    "registry",
    "set_budget",
    "stats",
    "unregister",
]

logger = logging.getLogger("aioswap")

ShapeLike = Union[int, Sequence[int]]

# Kinds of range records.
_ALLOCATED = "allocated"    # locked by allocate(); lives as long as its LockedMemory
_EXTERNAL = "external"      # locked elsewhere, recorded by register()
_UNLOCKED = "unlocked"      # strict=False fallback: tracked for free(), never in an index

# errno values mlock(2) uses for "not allowed to lock that much".
_MLOCK_LIMIT_ERRNOS = frozenset({errno.EPERM, errno.ENOMEM, errno.EAGAIN})


class PinnedMemoryWarning(AioswapWarning):
    """Memory could not be locked and unlocked memory was handed out instead (``strict=False``).

    A ``UserWarning`` rather than a ``ResourceWarning`` so that it is shown by default: the
    fallback works, but direct I/O on that memory is off and transfers go through bounce
    buffers. It is issued once per process; every fallback is also logged at INFO level on
    the ``"aioswap"`` logger.
    """


@dataclass(frozen=True)
class PinnedStats:
    """A consistent snapshot of the registry's counters.

    Attributes
    ----------
    ranges : int
        Host ranges registered: allocations plus external registrations.
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


class _Range:
    """One registered (or tracked) range and what keeps it alive."""

    __slots__ = ("baseline", "device", "end", "finalizer", "freeing", "io", "kind", "live",
                 "owner", "ref", "start")

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
        # sys.getrefcount of the LockedMemory behind a pinned.empty() tensor while that tensor
        # is its only view (measured in empty(), compared in free()); None for other kinds.
        self.baseline: int | None = None
        self.io = 0                 # I/O requests in flight on this memory (hold/unhold)
        self.freeing = False        # free() is releasing it: no new holds


class _Index:
    """Sorted, non-overlapping ranges in parallel lists; mutated only under the registry lock."""

    __slots__ = ("ends", "recs", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.recs: list[_Range] = []

    def overlap(self, start: int, end: int) -> _Range | None:
        """The registered range overlapping ``[start, end)``, if any."""
        i = bisect_right(self.starts, start) - 1
        if i >= 0 and self.ends[i] > start:
            return self.recs[i]
        if i + 1 < len(self.starts) and self.starts[i + 1] < end:
            return self.recs[i + 1]
        return None

    def containing(self, address: int) -> _Range | None:
        """The range holding byte ``address``, if any."""
        i = bisect_right(self.starts, address) - 1
        if i >= 0 and address < self.ends[i]:
            return self.recs[i]
        return None

    def at(self, start: int) -> _Range | None:
        """The range starting exactly at ``start``, if any."""
        i = bisect_left(self.starts, start)
        if i < len(self.starts) and self.starts[i] == start:
            return self.recs[i]
        return None

    def insert(self, rec: _Range) -> None:
        i = bisect_left(self.starts, rec.start)
        self.starts.insert(i, rec.start)
        self.ends.insert(i, rec.end)
        self.recs.insert(i, rec)

    def remove(self, rec: _Range) -> bool:
        i = bisect_left(self.starts, rec.start)
        if i < len(self.starts) and self.recs[i] is rec:
            del self.starts[i], self.ends[i], self.recs[i]
            return True
        return False

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[_Range, ...]]:
        return tuple(self.starts), tuple(self.ends), tuple(self.recs)


_Snapshot = tuple[tuple[int, ...], tuple[int, ...], tuple[_Range, ...]]

# torch.Tensor once torch is imported by someone (never imported from here on a query).
_Tensor: Any = None
# Tensor subclasses seen so far -> whether their instances own real memory (FakeTensor and
# FunctionalTensor do not, and FakeTensor.data_ptr() warns).
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
    """Whether instances of this torch.Tensor subclass are backed by real memory."""
    known = _subclass_has_memory.get(cls)
    if known is None:
        known = True
        for module, name in (("torch._subclasses.fake_tensor", "FakeTensor"),
                             ("torch._subclasses.functional_tensor", "FunctionalTensor")):
            mod = sys.modules.get(module)
            fake = getattr(mod, name, None) if mod is not None else None
            if isinstance(fake, type) and issubclass(cls, fake):
                known = False
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


def extent(x: object) -> tuple[int, int]:
    """Byte extent ``[lo, hi)`` of ``x`` in memory.

    Parameters
    ----------
    x : torch.Tensor, numpy.ndarray, memoryview, buffer-protocol object or (address, nbytes)
        For strided and non-contiguous views, ``lo`` is the lowest byte any element touches
        and ``hi`` one past the highest; torch's ``data_ptr()`` already includes the storage
        offset. CUDA tensors give device addresses.

    Returns
    -------
    tuple of int
        ``(lo, hi)``; ``(addr, addr)`` when ``x`` holds no bytes (``(0, 0)`` for an empty
        memoryview or a released :class:`~aioswap._aio.LockedMemory`).

    Raises
    ------
    ValueError
        For tensors without memory (meta, fake and functional tensors, sparse layouts) and
        negative (address, nbytes).
    TypeError
        For objects that expose no memory.
    """
    if type(x) is tuple:
        return _address_pair(x)
    tensor_type = _tensor_type()
    if tensor_type is not None and isinstance(x, tensor_type):
        t: Any = x
        if t.is_meta or not _has_memory(type(t)):
            raise ValueError(f"a {type(t).__name__} on device {t.device} has no memory")
        try:
            return _tensor_extent(t)
        except (RuntimeError, NotImplementedError) as exc:   # sparse, nested, wrappers
            raise ValueError(f"tensor with layout {t.layout} has no single extent: {exc}") \
                from None
    return _buffer_extent(x)


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit} ({n} bytes)"
    return f"{n} bytes"


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
    """Interval index of page-locked memory, and the allocator of such memory.

    Use the process-wide instance :data:`aioswap.pinned.registry` (the module functions are
    its bound methods); a separate instance knows only its own ranges.

    Notes
    -----
    Thread safety: every change (allocation, registration, collection of memory) happens
    under one lock and invalidates an immutable snapshot of the host (or device) index.
    Queries take no lock: they run ``bisect`` on the current snapshot, O(log n). The first
    query after a change rebuilds the snapshot once, under the lock, in O(n), so n
    registrations followed by queries cost O(n) in total, not O(n^2).

    Lifetime: an allocation's range is removed by a ``weakref.finalize`` on its
    :class:`~aioswap._aio.LockedMemory`, which runs before the pages are unlocked and
    unmapped, so no other mapping can reuse the address while it is still registered.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None          # thread id inside a critical section
        self._pending: list[_Range] = []           # collected during our own critical section
        self._host = _Index()
        self._device = _Index()
        self._host_snap: _Snapshot | None = ((), (), ())
        self._device_snap: _Snapshot | None = ((), (), ())
        self._io_lock = threading.Lock()
        self._unlocked: dict[int, _Range] = {}
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
        index = self._device if rec.device else self._host
        other = index.overlap(rec.start, rec.end)
        if other is not None:
            kind = "device" if rec.device else "host"
            raise ValueError(
                f"{kind} range [{rec.start:#x}, {rec.end:#x}) overlaps the registered range "
                f"[{other.start:#x}, {other.end:#x}) ({other.kind}); ranges may not overlap: "
                f"unregister the other one first, or register exactly the memory you locked")
        index.insert(rec)
        size = rec.end - rec.start
        if rec.device:
            self._device_bytes += size
            self._device_snap = None
        else:
            self._bytes_locked += size
            self._peak = max(self._peak, self._bytes_locked)
            if rec.kind == _ALLOCATED:
                self._allocations += 1
                self._bytes_allocated += size
            self._host_snap = None

    def _remove(self, rec: _Range) -> None:
        if not rec.live:
            return
        rec.live = False
        rec.owner = None
        if rec.kind == _UNLOCKED:
            if self._unlocked.get(rec.start) is rec:
                del self._unlocked[rec.start]
            return
        index = self._device if rec.device else self._host
        if not index.remove(rec):
            return
        size = rec.end - rec.start
        if rec.device:
            self._device_bytes -= size
            self._device_snap = None
        else:
            self._bytes_locked -= size
            if rec.kind == _ALLOCATED:
                self._allocations -= 1
                self._bytes_allocated -= size
            self._host_snap = None

    def _snapshot(self, device: bool) -> _Snapshot:
        with self._critical():
            if device:
                snap = self._device_snap
                if snap is None:
                    snap = self._device_snap = self._device.snapshot()
            else:
                snap = self._host_snap
                if snap is None:
                    snap = self._host_snap = self._host.snapshot()
            return snap

    def _contains(self, lo: int, hi: int, device: bool = False) -> bool:
        """Whether the non-empty extent [lo, hi) lies inside one registered range."""
        snap = self._device_snap if device else self._host_snap
        if snap is None:
            snap = self._snapshot(device)
        starts, ends, _ = snap
        i = bisect_right(starts, lo) - 1
        return i >= 0 and hi <= ends[i]

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
            True iff the whole extent of ``x`` (see :func:`extent`: start and end, for strided
            views the lowest to the highest byte touched) lies inside one registered host
            range, or torch reports the CPU tensor pinned (``x.is_pinned()``, asked only when
            the registry says no). Ranges that merely touch do not join: an extent spanning
            two adjacent registrations is not pinned.

            - Objects holding no bytes (empty tensors, arrays and views, ``(address, 0)``)
              are never pinned: there is no memory to do I/O on, whatever the address.
            - Meta, fake and functional tensors are never pinned (torch is not asked).
            - CUDA tensors are True iff their extent lies in one device range registered
              with ``device=True`` (cuFile); host ranges never count for them.
            - Tensors on other devices and sparse tensors are False, except a sparse CPU
              tensor that torch reports pinned.

        Raises
        ------
        TypeError
            For objects that expose no memory.

        Notes
        -----
        Asked before every request, so it is kept short: no lock, one ``bisect`` on the
        current snapshot, O(log n) in the number of ranges. A contiguous tensor costs
        ``data_ptr()`` and ``nbytes``; a strided view is first checked by its storage's
        extent (a view lies inside its storage) and its strides are walked only when that
        does not settle it.
        """
        tensor_type = _Tensor if _Tensor is not None else _tensor_type()
        if tensor_type is not None and isinstance(x, tensor_type):
            t: Any = x
            if type(t) is not tensor_type and not _has_memory(type(t)):
                return False
            if t.is_cpu:
                snap = self._host_snap
                if snap is None:
                    snap = self._snapshot(False)
                starts, ends, _ = snap
                try:
                    lo: int = t.data_ptr()
                    if t.is_contiguous():        # also every tensor without elements
                        hi: int = lo + t.nbytes
                    else:
                        # A view lies inside its storage: when all of the storage is in one
                        # range, so is the view, and its strides need not be walked.
                        storage = t.untyped_storage()
                        lo = storage.data_ptr()
                        i = bisect_right(starts, lo) - 1
                        if i >= 0 and lo + storage.nbytes() <= ends[i]:
                            return True
                        size: int = t.element_size()
                        lo, hi = _strided(t.data_ptr(), t.shape, t.stride(), size, size)
                except (RuntimeError, NotImplementedError):   # sparse and other layouts
                    return self._torch_says_pinned(t)
                if lo >= hi:
                    return False
                i = bisect_right(starts, lo) - 1
                if i >= 0 and hi <= ends[i]:
                    return True
                return bool(t.is_pinned())
            if t.is_cuda:
                try:
                    lo, hi = _tensor_extent(t)
                except (RuntimeError, NotImplementedError):
                    return False
                return lo < hi and self._contains(lo, hi, device=True)
            return False          # meta and other devices
        if type(x) is tuple:
            lo, hi = _address_pair(x)
        else:
            lo, hi = _buffer_extent(x)
        return lo < hi and self._contains(lo, hi)

    @staticmethod
    def _torch_says_pinned(t: Any) -> bool:
        try:
            return bool(t.is_pinned())
        except (RuntimeError, NotImplementedError):
            return False

    def is_device_registered(self, address: int, nbytes: int) -> bool:
        """Whether device memory ``[address, address + nbytes)`` lies in one device range.

        Parameters
        ----------
        address : int
            Device address (``tensor.data_ptr()`` of a CUDA tensor).
        nbytes : int
            Length in bytes; 0 gives False.

        Returns
        -------
        bool
            True iff the whole range lies inside one range registered with ``device=True``.
        """
        lo, hi = _address_pair((address, nbytes))
        return lo < hi and self._contains(lo, hi, device=True)

    # ------------------------------------------------------------------- I/O holds
    def hold(self, address: int, nbytes: int) -> object | None:
        """Count an I/O request on memory from :meth:`allocate`/:meth:`empty`.

        While a hold is out, :meth:`free` refuses that memory (BufferError), so memory the
        kernel may still write is never unmapped. Returns a token for :meth:`unhold`, or
        None when ``[address, address + nbytes)`` is not such memory (nothing to guard:
        other memory stays alive through the request's reference to its owner).
        """
        if nbytes <= 0:
            return None
        snap = self._host_snap
        if snap is None:
            snap = self._snapshot(False)
        starts, ends, recs = snap
        i = bisect_right(starts, address) - 1
        if i < 0 or address + nbytes > ends[i]:
            return None
        rec = recs[i]
        if rec.kind != _ALLOCATED:
            return None
        with self._io_lock:
            if not rec.live or rec.freeing:
                return None
            rec.io += 1
        return rec

    def unhold(self, token: object) -> None:
        """Give back a hold from :meth:`hold`."""
        assert isinstance(token, _Range)
        with self._io_lock:
            token.io -= 1

    def _begin_free(self, rec: _Range, what: str) -> None:
        with self._io_lock:
            if rec.io:
                raise BufferError(f"cannot free {what}: {rec.io} I/O request(s) in flight use "
                                  f"its memory; wait for them (handle.wait()) first")
            rec.freeing = True

    def _end_free(self, rec: _Range) -> None:
        with self._io_lock:
            rec.freeing = False

    def stats(self) -> PinnedStats:
        """Counters of the registry, read together under the lock.

        Returns
        -------
        PinnedStats
        """
        with self._critical():
            return PinnedStats(
                ranges=len(self._host.starts), bytes_locked=self._bytes_locked,
                peak_bytes=self._peak, budget=self._budget, allocations=self._allocations,
                bytes_allocated=self._bytes_allocated, device_ranges=len(self._device.starts),
                device_bytes=self._device_bytes, unlocked_fallbacks=self._fallbacks)

    def set_budget(self, nbytes: int | None) -> None:
        """Limit the host bytes locked, or lift the limit.

        Parameters
        ----------
        nbytes : int or None
            An allocation that would bring ``bytes_locked`` (allocations and external host
            registrations together, whole pages) above this is refused:
            :class:`~aioswap.errors.PinnedMemoryError` when strict, unlocked memory with a
            :class:`PinnedMemoryWarning` otherwise. None removes the limit. Setting it below
            what is locked already frees nothing; it only refuses new allocations.
            External registrations are never refused: their memory is locked already.

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
    def allocate(self, nbytes: int, *, strict: bool = True) -> LockedMemory:
        """Page-aligned memory, locked in RAM and registered while it lives.

        Parameters
        ----------
        nbytes : int
            Size in bytes (> 0). Whole pages are mapped and locked and registered.
        strict : bool
            When the memory cannot be locked (RLIMIT_MEMLOCK, budget), True raises and
            leaves nothing behind (no mapping, no range, no accounting); False ("try" mode)
            returns page-aligned *unlocked* memory that is not registered as pinned and
            warns once per process with :class:`PinnedMemoryWarning`.

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
        Lifetime: ``torch.frombuffer`` and ``numpy.frombuffer`` views keep the object alive;
        the range is unregistered, unlocked and unmapped when the last of them (and the
        object itself) is collected. See :meth:`free` to release it earlier.
        """
        return self._allocate(operator.index(nbytes), strict, 3)[0]

    def _allocate(self, nbytes: int, strict: bool, stacklevel: int
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
            return self._fallback(nbytes, message, stacklevel + 1)
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
                                        f"back to unlocked memory (no direct I/O on it)"
                                        ) from exc
            return self._fallback(nbytes, message, stacklevel + 1)
        rec = _Range(mem.address, mem.address + mem.mapped_bytes, _ALLOCATED)
        rec.ref = weakref.ref(mem)
        with self._critical():
            self._reserved -= mapped
            try:
                self._insert(rec)
            except ValueError as exc:
                # A stale external registration covers memory the kernel just gave us: that
                # registration outlived its memory.
                mem.release()
                raise PinnedMemoryError(f"fresh locked memory is already registered: {exc}"
                                        ) from None
        fin = weakref.finalize(mem, self._collected, rec)
        fin.atexit = False
        rec.finalizer = fin
        return mem, rec

    def _fallback(self, nbytes: int, reason: str, stacklevel: int
                  ) -> tuple[LockedMemory, _Range]:
        mem = LockedMemory(nbytes, False)
        rec = _Range(mem.address, mem.address + mem.mapped_bytes, _UNLOCKED)
        rec.ref = weakref.ref(mem)
        with self._critical():
            self._fallbacks += 1
            warn, self._warned = not self._warned, True
            self._unlocked[rec.start] = rec
        fin = weakref.finalize(mem, self._collected, rec)
        fin.atexit = False
        rec.finalizer = fin
        logger.info("using %d bytes of unlocked memory: %s", nbytes, reason)
        if warn:
            warnings.warn(f"{reason}. Falling back to unlocked memory: transfers through it "
                          f"are staged, not direct (this warning is shown once per process)",
                          PinnedMemoryWarning, stacklevel=stacklevel)
        return mem, rec

    def empty(self, shape_or_numel: ShapeLike, dtype: torch.dtype, *,
              strict: bool = True) -> torch.Tensor:
        """An uninitialised CPU tensor over freshly allocated locked memory.

        Parameters
        ----------
        shape_or_numel : int or sequence of int
            Number of elements, or the shape.
        dtype : torch.dtype
            Any torch dtype.
        strict : bool
            As for :meth:`allocate`.

        Returns
        -------
        torch.Tensor
            Contiguous, page-aligned, not a view of another tensor; its storage keeps the
            memory alive (through a buffer export), so the memory is freed when the tensor
            and every view of it are collected, or by :meth:`free`. A tensor with no
            elements still owns one page, but is never reported pinned.

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
        mem, rec = self._allocate(max(nbytes, 1), strict, 3)
        # Through a memoryview the storage holds a buffer export on the memory, so that
        # LockedMemory.release() (and free(mem)) refuses while any such tensor lives;
        # torch.frombuffer on the object itself would hold only a reference.
        view = memoryview(mem)
        raw = torch.frombuffer(view, dtype=torch.uint8)
        del view
        # set_ rather than .view(): a view would pin `raw` as its _base, and free() wants
        # one tensor to be the storage's only user.
        strides = [1] * len(shape)
        for i in range(len(shape) - 1, 0, -1):
            strides[i - 1] = strides[i] * max(shape[i], 1)
        t = torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), 0, shape, strides)
        del raw
        rec.baseline = sys.getrefcount(mem)
        return t

    def empty_numpy(self, shape_or_numel: ShapeLike, dtype: npt.DTypeLike, *,
                    strict: bool = True) -> numpy.ndarray[Any, Any]:
        """An uninitialised numpy array over freshly allocated locked memory.

        Parameters
        ----------
        shape_or_numel : int or sequence of int
            Number of elements, or the shape.
        dtype : numpy dtype-like
            Any fixed-size numpy dtype.
        strict : bool
            As for :meth:`allocate`.

        Returns
        -------
        numpy.ndarray
            C-contiguous, page-aligned, writable. The memory is freed when the array and
            every view of it are collected; :meth:`free` refuses arrays (they cannot be
            detached from their memory).

        Raises
        ------
        PinnedMemoryError, ValueError
            As for :meth:`allocate`.
        """
        import numpy as np

        dt = np.dtype(dtype)
        if dt.itemsize == 0:
            raise TypeError(f"dtype {dt} has no fixed size")
        shape = _shape_of(shape_or_numel)
        nbytes = math.prod(shape) * dt.itemsize
        mem, _ = self._allocate(max(nbytes, 1), strict, 3)
        raw: Any = np.frombuffer(memoryview(mem), dtype=np.uint8, count=nbytes)
        arr: numpy.ndarray[Any, Any] = raw.view(dt).reshape(shape)
        return arr

    def free(self, obj: object) -> None:
        """Release memory from :meth:`allocate` or :meth:`empty` now.

        ``free`` refuses, with :class:`BufferError`, while anything else still views the
        memory, and otherwise unregisters, unlocks and unmaps it before it returns. It never
        leaves a live object pointing at unmapped memory. It is never required: memory is
        released anyway when its last view is collected.

        Parameters
        ----------
        obj : torch.Tensor or aioswap._aio.LockedMemory
            - A tensor from :meth:`empty`: refused while other tensors share its storage
              (views, slices, ``.numpy()`` and DLPack aliases; for a view, its base, which
              autograd keeps alive as ``view._base``) or it is referenced from C++
              (autograd graph, DLPack capsule). Otherwise the
              tensor is detached from the memory first (``set_()``: it becomes an empty
              tensor of the same dtype, everywhere it is referenced), then the memory goes.
            - A :class:`~aioswap._aio.LockedMemory` from :meth:`allocate`: refused while
              buffer exports are open (numpy arrays, memoryviews, tensors from :meth:`empty`)
              or while it is referenced from more than one place besides this call (tensors
              from ``torch.frombuffer(mem)`` hold such a reference). It is closed afterwards
              (``mem.closed``; new views raise ``BufferError``). Freeing a closed one is a
              no-op.

        Raises
        ------
        BufferError
            While other views are alive; nothing is changed then.
        TypeError
            For numpy arrays (they cannot be detached from their memory: drop them, and
            the memory goes with the last one) and other objects.
        ValueError
            For memory that this registry did not allocate.

        Notes
        -----
        The checks use CPython reference counts and torch's use counts. One case cannot be
        told apart: a LockedMemory passed as the *only* reference (``free(pool.pop())``)
        while one ``torch.frombuffer(mem)`` tensor is alive looks like the caller's own
        reference. Make tensors over a LockedMemory with ``torch.frombuffer(memoryview(mem))``
        (a buffer export, always detected) or use :meth:`empty`.
        """
        if isinstance(obj, LockedMemory):
            probe = object()
            # References held outside this call: the caller's, plus any other holder.
            others = sys.getrefcount(obj) - sys.getrefcount(probe)
            if obj.closed:
                return
            rec = self._record_of(obj.address)
            if rec is None or rec.ref is None or rec.ref() is not obj:
                raise ValueError(f"{obj!r} was not allocated by aioswap.pinned")
            if others > 1:
                raise BufferError(
                    f"cannot free {obj!r}: it is still referenced from {others - 1} other "
                    f"place(s) besides the caller (views: memoryviews, numpy arrays, tensors "
                    f"from torch.frombuffer; or containers); drop them first, or just drop "
                    f"every reference and the memory is freed when it is collected")
            self._begin_free(rec, repr(obj))
            with self._critical():
                try:
                    obj.release()
                except BufferError as exc:
                    self._end_free(rec)
                    raise BufferError(f"cannot free {obj!r}: views of it are alive ({exc}); "
                                      f"drop them first, or just drop every reference and "
                                      f"the memory is freed when it is collected") from None
                self._forget(rec)
            return
        tensor_type = _tensor_type()
        if tensor_type is not None and isinstance(obj, tensor_type):
            self._free_tensor(obj)
            return
        numpy_mod = sys.modules.get("numpy")
        if numpy_mod is not None and isinstance(obj, numpy_mod.ndarray):
            raise TypeError("free() cannot release a numpy array: arrays cannot be detached "
                            "from their memory, so it would be left pointing at unmapped "
                            "pages. Drop every reference to the array and its views; the "
                            "memory is released when the last one is collected")
        raise TypeError(f"free() takes a tensor from pinned.empty() or a LockedMemory from "
                        f"pinned.allocate(), not {type(obj).__name__}")

    def _record_of(self, address: int) -> _Range | None:
        with self._critical():
            rec = self._host.containing(address)
            if rec is None or rec.kind != _ALLOCATED:
                rec = self._unlocked.get(address)
            return rec

    def _forget(self, rec: _Range) -> None:
        """Drop an allocation whose memory free() releases (under the lock)."""
        if rec.finalizer is not None:
            rec.finalizer.detach()
        self._remove(rec)

    def _free_tensor(self, t: Any) -> None:
        import torch

        if not t.is_cpu or t.layout != torch.strided or not _has_memory(type(t)):
            raise ValueError("free() takes a CPU tensor from pinned.empty()")
        storage = t.untyped_storage()
        rec = self._record_of(storage.data_ptr())
        mem = rec.ref() if rec is not None and rec.ref is not None else None
        if rec is None or mem is None or rec.baseline is None:
            raise ValueError("this tensor's memory was not allocated by pinned.empty()")
        storage_users = getattr(torch._C, "_storage_Use_Count", None)
        impl_users = getattr(t, "_use_count", None)
        if storage_users is None or impl_users is None:
            raise BufferError("this torch does not report use counts, so free() cannot prove "
                              "the tensor is the memory's only view; drop every reference "
                              "instead and the memory is freed when it is collected")
        sharing: int = storage_users(storage._cdata) - 2       # minus t and `storage`
        del storage
        if sharing > 0:
            raise BufferError(f"cannot free the tensor: {sharing} other tensor(s) share its "
                              f"memory (views, slices, .numpy() or DLPack aliases); drop them "
                              f"first, or drop every reference and the memory is freed when "
                              f"the last one is collected")
        if impl_users() > 1:
            raise BufferError("cannot free the tensor: it is referenced from C++ (autograd "
                              "graph, DLPack capsule...); drop those references first")
        if sys.getrefcount(mem) != rec.baseline:
            raise BufferError("cannot free the tensor: other objects view its memory")
        self._begin_free(rec, "the tensor")
        with self._critical():
            with torch.no_grad():
                t.set_()        # the storage dies here, and with it the buffer export
            self._forget(rec)
            mem.release()

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
            (it is removed when that memory is freed).
        """
        address = operator.index(address)
        with self._critical():
            rec = (self._device if device else self._host).at(address)
            if rec is None:
                kind = "device" if device else "host"
                raise ValueError(f"no {kind} range is registered at {address:#x}")
            if rec.kind == _ALLOCATED:
                raise ValueError(f"the range at {address:#x} belongs to memory from "
                                 f"pinned.allocate(); it is unregistered when that memory is "
                                 f"freed or collected")
            self._remove(rec)

    def _unregister_record(self, rec: _Range) -> None:
        with self._critical():
            self._remove(rec)


registry: PinnedRegistry = PinnedRegistry()
"""The process-wide registry; the module functions below are its bound methods."""

is_pinned = registry.is_pinned
is_device_registered = registry.is_device_registered
allocate = registry.allocate
empty = registry.empty
empty_numpy = registry.empty_numpy
free = registry.free
register = registry.register
unregister = registry.unregister
stats = registry.stats
set_budget = registry.set_budget
