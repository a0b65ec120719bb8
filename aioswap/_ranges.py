"""RangeIndex: sorted, non-overlapping address ranges ``[start, end)``, each with a value.

The one interval index of aioswap: :mod:`aioswap.pinned` keeps one for locked host memory and
one for device memory registered with cuFile. Lookups are asked before every I/O request, so
they take no lock: they bisect an immutable snapshot. Changes go to mutable lists under a
lock and drop the snapshot; the first lookup after a change rebuilds it once, so n changes
followed by lookups cost O(n) in all rather than O(n) each.

Ranges never join: two adjacent ranges stay two, and a span crossing from one into the other
lies in neither.
"""
from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

__all__ = ["RangeIndex", "Span"]

V = TypeVar("V")


class Span(Generic[V]):
    """One range ``[start, end)`` of a :class:`RangeIndex` and its value.

    Compares equal to the tuple ``(start, end, value)`` and unpacks like it. (Not a generic
    NamedTuple: those need Python 3.11.)
    """

    __slots__ = ("end", "start", "value")

    def __init__(self, start: int, end: int, value: V) -> None:
        self.start = start
        self.end = end
        self.value = value

    def __iter__(self) -> Iterator[Any]:
        return iter((self.start, self.end, self.value))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Span, tuple)):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None     # type: ignore[assignment]  # equal to tuples, so not hashable

    def __repr__(self) -> str:
        return f"Span({self.start:#x}, {self.end:#x}, {self.value!r})"


# starts, ends, values: the immutable snapshot lookups bisect.
_Snapshot = tuple[tuple[int, ...], tuple[int, ...], tuple[V, ...]]


class RangeIndex(Generic[V]):
    """Sorted, non-overlapping ranges ``[start, end)`` with a value each.

    Parameters
    ----------
    guard : callable returning a context manager, optional
        What :meth:`add`, :meth:`remove` and snapshot rebuilds run under. The default is a
        lock of the index's own; an owner with a lock of its own passes it (reentrant), so
        that its other state changes together with the index.

    Notes
    -----
    Thread safety: writers are serialised by ``guard``; readers never take it except to
    rebuild the snapshot after a change. A reader sees the index as it was before or after
    each change, never half of one.
    """

    __slots__ = ("_ends", "_guard", "_starts", "_values", "snap")

    def __init__(self, guard: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        if guard is None:
            lock = threading.RLock()
            guard = lambda: lock        # noqa: E731  (a factory of the one lock)
        self._guard = guard
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._values: list[V] = []
        #: The published snapshot, read without a lock by lookups here and by the engine's
        #: registry look-up (aioswap._aio.Core, in C): an immutable (starts, ends, values),
        #: or None after a change until the next look-up rebuilds it
        self.snap: _Snapshot[V] | None = ((), (), ())

    # ----------------------------------------------------------------------- changes
    def add(self, start: int, end: int, value: V) -> None:
        """Insert ``[start, end)`` with ``value``.

        Raises
        ------
        ValueError
            When ``end <= start``, or the range overlaps one in the index (the message names
            it). Touching is not overlapping.
        """
        if end <= start:
            raise ValueError(f"empty or reversed range [{start:#x}, {end:#x})")
        with self._guard():
            other = self._overlap(start, end)
            if other is not None:
                raise ValueError(f"range [{start:#x}, {end:#x}) overlaps the registered range "
                                 f"[{other.start:#x}, {other.end:#x})")
            i = bisect_left(self._starts, start)
            self._starts.insert(i, start)
            self._ends.insert(i, end)
            self._values.insert(i, value)
            self.snap = None

    def remove(self, start: int, value: object = None) -> Span[V] | None:
        """Remove the range starting at ``start`` and return it; None when there is none.

        With ``value``, remove it only when it holds that very object (``is``), so that a
        stale owner never removes a newer range at the same address.
        """
        with self._guard():
            i = bisect_left(self._starts, start)
            if i == len(self._starts) or self._starts[i] != start:
                return None
            if value is not None and self._values[i] is not value:
                return None
            span = Span(start, self._ends[i], self._values[i])
            del self._starts[i], self._ends[i], self._values[i]
            self.snap = None
            return span

    # ----------------------------------------------------------------------- lookups
    def _snapshot(self) -> _Snapshot[V]:
        snap = self.snap
        if snap is None:
            with self._guard():
                snap = self.snap
                if snap is None:
                    snap = self.snap = (tuple(self._starts), tuple(self._ends),
                                         tuple(self._values))
        return snap

    def contains(self, lo: int, hi: int) -> bool:
        """Whether the non-empty span ``[lo, hi)`` lies inside one range (False if empty)."""
        starts, ends, _ = self._snapshot()
        i = bisect_right(starts, lo) - 1
        return lo < hi and i >= 0 and hi <= ends[i]

    def find(self, lo: int, hi: int) -> Span[V] | None:
        """The range holding all of the non-empty span ``[lo, hi)``, or None."""
        starts, ends, values = self._snapshot()
        i = bisect_right(starts, lo) - 1
        if lo < hi and i >= 0 and hi <= ends[i]:
            return Span(starts[i], ends[i], values[i])
        return None

    def value_of(self, lo: int, hi: int) -> V | None:
        """The value of the range holding all of the non-empty span ``[lo, hi)``, or None
        (:meth:`find` without building a span: asked once per request)."""
        starts, ends, values = self._snapshot()
        i = bisect_right(starts, lo) - 1
        if lo < hi and i >= 0 and hi <= ends[i]:
            return values[i]
        return None

    def at(self, start: int) -> Span[V] | None:
        """The range starting exactly at ``start``, or None."""
        starts, ends, values = self._snapshot()
        i = bisect_left(starts, start)
        if i < len(starts) and starts[i] == start:
            return Span(start, ends[i], values[i])
        return None

    def overlap(self, lo: int, hi: int) -> Span[V] | None:
        """The lowest range overlapping ``[lo, hi)``, or None (an empty span overlaps none)."""
        with self._guard():
            return self._overlap(lo, hi)

    def _overlap(self, lo: int, hi: int) -> Span[V] | None:
        if hi <= lo:
            return None
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, lo) - 1
        if i >= 0 and ends[i] > lo:
            return Span(starts[i], ends[i], self._values[i])
        if i + 1 < len(starts) and starts[i + 1] < hi:
            return Span(starts[i + 1], ends[i + 1], self._values[i + 1])
        return None

    def spans(self) -> list[Span[V]]:
        """Every range, in address order."""
        return list(self)

    def __iter__(self) -> Iterator[Span[V]]:
        starts, ends, values = self._snapshot()
        return map(Span, starts, ends, values)

    def __len__(self) -> int:
        return len(self._snapshot()[0])

    def __repr__(self) -> str:
        return f"<aioswap._ranges.RangeIndex {len(self)} ranges>"
