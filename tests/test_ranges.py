"""aioswap._ranges.RangeIndex: the one interval index (host and device ranges of the registry)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioswap._ranges import RangeIndex, Span


def test_find_and_remove() -> None:
    idx: RangeIndex[str] = RangeIndex()
    idx.add(0x10000, 0x11000, "a")
    idx.add(0x30000, 0x32000, "c")
    idx.add(0x11000, 0x12000, "b")              # adjacent, not overlapping
    assert idx.spans() == [Span(0x10000, 0x11000, "a"), Span(0x11000, 0x12000, "b"),
                           Span(0x30000, 0x32000, "c")]
    assert len(idx) == 3
    assert idx.find(0x10000, 0x11000) == (0x10000, 0x11000, "a")
    assert idx.find(0x10800, 0x11000).value == "a"      # an interior view, to the end
    assert idx.find(0x31fff, 0x32000).value == "c"
    assert idx.find(0x0ffff, 0x10001) is None           # starts before
    assert idx.find(0x32000, 0x32001) is None           # starts at the end
    assert idx.at(0x11000) == (0x11000, 0x12000, "b") and idx.at(0x11001) is None
    assert idx.remove(0x10800) is None                  # not a start
    assert idx.remove(0x11000, "other") is None         # not that value: left alone
    assert idx.remove(0x11000, "b") == Span(0x11000, 0x12000, "b")
    assert idx.find(0x11000, 0x11001) is None and len(idx) == 2
    assert "2 ranges" in repr(idx)


def test_adjacent_ranges_do_not_join() -> None:
    idx: RangeIndex[int] = RangeIndex()
    idx.add(1000, 2000, 1)
    idx.add(2000, 3000, 2)
    assert idx.contains(1000, 2000) and idx.contains(2000, 3000)
    assert not idx.contains(1000, 2001)                 # one byte into the neighbour
    assert not idx.contains(1999, 2001)
    assert idx.find(1000, 3000) is None
    assert idx.overlap(1999, 2001) == (1000, 2000, 1)   # the lowest one that overlaps


@pytest.mark.parametrize(("start", "end"), [
    (0x10000, 0x11000), (0x0f000, 0x10001), (0x10fff, 0x11000), (0x1, 0x100000),
    (0x10800, 0x10810),
])
def test_overlaps_are_refused(start: int, end: int) -> None:
    idx: RangeIndex[None] = RangeIndex()
    idx.add(0x10000, 0x11000, None)
    with pytest.raises(ValueError, match=r"overlaps the registered range \[0x10000, 0x11000\)"):
        idx.add(start, end, None)
    assert idx.spans() == [(0x10000, 0x11000, None)]
    idx.add(0x0f000, 0x10000, None)                     # touching below and above is fine
    idx.add(0x11000, 0x12000, None)
    assert len(idx) == 3


@pytest.mark.parametrize(("start", "end"), [(10, 10), (10, 9)])
def test_empty_ranges_are_refused(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="empty or reversed"):
        RangeIndex[None]().add(start, end, None)


def test_empty_lookups_find_nothing() -> None:
    idx: RangeIndex[None] = RangeIndex()
    idx.add(100, 200, None)
    assert not idx.contains(150, 150) and idx.find(150, 150) is None
    assert not idx.contains(150, 140)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), min_size=2, max_size=12, unique=True),
       keep=st.lists(st.booleans(), min_size=11, max_size=11),
       lo=st.integers(-10, 410), n=st.integers(0, 60))
def test_lookups_of_views_match_a_plain_scan(cuts: list[int], keep: list[bool], lo: int,
                                             n: int) -> None:
    """Every view [lo, lo + n) is found iff one range holds it, like a linear scan says."""
    cuts.sort()
    ranges = [(a, b) for (a, b), k in zip(zip(cuts, cuts[1:]), keep) if k]
    idx: RangeIndex[int] = RangeIndex()
    for i, (a, b) in enumerate(ranges):
        idx.add(a, b, i)
    hi = lo + n
    expect = [i for i, (a, b) in enumerate(ranges) if n > 0 and a <= lo and hi <= b]
    got = idx.find(lo, hi)
    assert (got.value if got is not None else None) == (expect[0] if expect else None)
    assert idx.contains(lo, hi) is bool(expect)
    over = [i for i, (a, b) in enumerate(ranges) if n > 0 and a < hi and lo < b]
    hit = idx.overlap(lo, hi)
    assert (hit.value if hit is not None else None) == (over[0] if over else None)


def test_an_owner_lock_guards_changes_and_rebuilds() -> None:
    lock = threading.RLock()
    entered: list[str] = []

    @contextmanager
    def guard() -> Iterator[None]:
        with lock:
            entered.append("in")
            yield

    idx: RangeIndex[None] = RangeIndex(guard)
    idx.add(0, 10, None)
    assert entered == ["in"]
    assert idx.contains(0, 10)                          # the first lookup rebuilds, guarded
    assert entered == ["in", "in"]
    assert idx.contains(2, 3) and idx.at(0) is not None
    assert entered == ["in", "in"]                      # later lookups take no lock
    with lock:                                          # the owner's lock is reentrant
        idx.add(20, 30, None)
        assert idx.remove(0) is not None


def test_concurrent_writers_and_lock_free_readers() -> None:
    idx: RangeIndex[int] = RangeIndex()
    errors: list[str] = []
    stop = threading.Event()

    def writer(k: int) -> None:
        for i in range(200):
            base = (k * 1000 + i + 1) * 0x1000
            idx.add(base, base + 0x1000, k)
            found = idx.find(base + 8, base + 16)
            if found is None or found.start != base:
                errors.append(f"lost {base:#x}")
            if i % 2:
                idx.remove(base)

    def reader() -> None:
        while not stop.is_set():
            spans = idx.spans()
            if any(a.end > b.start for a, b in zip(spans, spans[1:])):
                errors.append("torn snapshot")

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert errors == []
    spans = idx.spans()
    assert len(spans) == 400
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
