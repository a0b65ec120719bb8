"""Tests of the kernel AIO engine (``aioswap._aio``): real files, real kernel errors.

The engine is :class:`~aioswap._aio.AioQueue`, driven here directly (the handle's layer is in
``test_handle.py`` and ``test_engine_queue.py``). Every round trip is checked byte for byte
against plain ``os.pread``/``os.pwrite`` on a buffered fd, in both directions, with
``os.urandom`` data. Errors are the ones the kernel really returns (misaligned O_DIRECT,
RLIMIT_FSIZE, EOF, EBADF, signals), never mocked.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioswap
from aioswap import _aio
from aioswap._aio import (MODE_BOUNCE, MODE_DIRECT, MODE_PLAIN, FileState,
                          LockedMemory, Request, aio_available, dio_alignment, open_direct)
from aioswap.errors import DirectIOUnsupportedError, HandleClosedError, ShortReadError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_engine.py"

# (single_submit, overlap_events): every way the submit/reap loop can be driven
COMBOS = [(False, True), (False, False), (True, True), (True, False)]
COMBO_IDS = ["batch-overlap", "batch-wait", "single-overlap", "single-wait"]


# --------------------------------------------------------------------------- helpers

def _mem(nbytes: int) -> LockedMemory:
    """Page-aligned memory, locked where RLIMIT_MEMLOCK allows it (alignment is what counts)."""
    try:
        return LockedMemory(nbytes)
    except OSError:
        return LockedMemory(nbytes, lock=False)


def _fill(mem: LockedMemory, value: int = 0xA5) -> None:
    ctypes.memset(mem.address, value, len(mem))


def _load(mem: LockedMemory, data: bytes, at: int = 0) -> None:
    memoryview(mem)[at:at + len(data)] = data


def _first_diff(a: bytes, b: bytes) -> int:
    x = np.frombuffer(a, np.uint8)
    y = np.frombuffer(b, np.uint8)
    n = min(len(x), len(y))
    idx = np.flatnonzero(x[:n] != y[:n])
    return int(idx[0]) if len(idx) else n


def _assert_same(actual, expected, what: str = "data", chunk: int = 64 * MiB) -> None:
    """Byte-exact comparison of two buffers, in chunks; names the first differing byte."""
    a = memoryview(actual).cast("B")
    e = memoryview(expected).cast("B")
    assert len(a) == len(e), f"{what}: {len(a)} bytes, expected {len(e)}"
    for start in range(0, len(e), chunk):
        x = a[start:start + chunk].tobytes()
        y = e[start:start + chunk].tobytes()
        if x != y:
            pytest.fail(f"{what}: first difference at byte {start + _first_diff(x, y)}")


def _ref_write(path: Path, data, offset: int = 0) -> None:
    """Reference write: plain buffered os.pwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            done += os.pwrite(fd, mv[done:done + 256 * MiB], offset + done)
    finally:
        os.close(fd)


def _ref_check(path: Path, expected, offset: int = 0, chunk: int = 64 * MiB) -> None:
    """Reference read: plain buffered os.pread, compared chunk by chunk."""
    e = memoryview(expected).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in range(0, len(e), chunk):
            want = e[start:start + chunk].tobytes()
            got = os.pread(fd, len(want), offset + start)
            if got != want:
                pytest.fail(f"{path.name}: {len(got)} bytes read at {offset + start}, first "
                            f"difference at file offset {offset + start + _first_diff(got, want)}")
    finally:
        os.close(fd)


def _file_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# Every test runs on each engine backend that works here (the queue logic is shared; what
# differs is how pieces reach the kernel); subprocesses get it through AIOSWAP_BACKEND.
_ENGINE = {"backend": "auto"}


@pytest.fixture(autouse=True)
def backend(engine_backend: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(_ENGINE, "backend", engine_backend)
    return engine_backend


def AioQueue(depth: int, **knobs: Any) -> _aio.AioQueue:
    """A queue on the backend under test."""
    knobs.setdefault("backend", _ENGINE["backend"])
    q = _aio.AioQueue(depth, **knobs)
    assert q.backend == knobs["backend"]
    return q


@contextlib.contextmanager
def _queue(depth: int, **knobs) -> Iterator[AioQueue]:
    q = AioQueue(depth, **knobs)
    try:
        yield q
    finally:
        q.close()


def _submit(q: AioQueue, fd: int, write: bool, addr: int, nbytes: int, offset: int = 0, *,
            mode: int = MODE_DIRECT, align: int = 1, block: int = MiB,
            file: FileState | None = None) -> Request:
    """Queue one sync request (finish it with ``_res``)."""
    return q.submit(fd, write, addr, nbytes, offset, mode, align, block, file, False, True)


def _res(rq: Request) -> tuple[int, int, int, int, bool]:
    """Finish a sync request (a signal handler's exception propagates, as from ``wait``):
    ``(done, err, err_offset, err_nbytes, eof)``."""
    try:
        rq.wait()
    except (OSError, EOFError):
        assert rq.finished and rq.error() is not None
    return (rq.done, rq.errno, *rq.failed_at, rq.eof)


def _io(q: AioQueue, fd: int, write: bool, addr: int, nbytes: int, offset: int = 0, *,
        route: str = "submit", mode: int = MODE_DIRECT, align: int = 1, block: int = MiB,
        file: FileState | None = None) -> tuple[int, int, int, int, bool]:
    """One sync request: ``(done, err, err_offset, err_nbytes, eof)``.

    ``route="run"`` goes through :meth:`AioQueue.run`, which serves a request of one aligned
    piece with a plain ``pread``/``pwrite`` in this thread and raises the request's error
    (built by :func:`aioswap._aio.failure`, whose attributes give the same tuple back).
    """
    if route == "run":
        try:
            return (q.run(fd, write, addr, nbytes, offset, mode, align, block, file), 0, 0,
                    0, False)
        except ShortReadError as exc:
            return (exc.done, 0, exc.eof_offset, exc.eof_nbytes, True)
        except OSError as exc:
            return (exc.done, exc.errno, exc.offset, exc.nbytes, False)
    return _res(_submit(q, fd, write, addr, nbytes, offset, mode=mode, align=align,
                        block=block, file=file))


def _ok(res: tuple[int, int, int, int, bool], nbytes: int) -> None:
    assert res == (nbytes, 0, 0, 0, False), res


def _round_trip(q: AioQueue, path: Path, size: int, offset: int = 0, **kw) -> None:
    """Engine write checked by os.pread; os.pwrite checked by engine read."""
    mem = _mem(size)
    data = os.urandom(size)
    _load(mem, data)
    fd = open_direct(path, write=True, create=True)
    try:
        _ok(_io(q, fd, True, mem.address, size, offset, **kw), size)
    finally:
        os.close(fd)
    assert path.stat().st_size >= offset + size
    _ref_check(path, data, offset)

    data = os.urandom(size)
    _ref_write(path, data, offset)
    _fill(mem)
    fd = open_direct(path)
    try:
        _ok(_io(q, fd, False, mem.address, size, offset, **kw), size)
    finally:
        os.close(fd)
    _assert_same(mem, data, f"engine read of {size} bytes at {offset}")


@pytest.fixture
def queue():
    with _queue(128) as q:
        yield q


@pytest.fixture
def align(tmp_dir: Path) -> int:
    """O_DIRECT granularity (memory and offset) of the test directory's file system."""
    probe = tmp_dir / "align-probe"
    probe.touch()
    mem_align, off_align = dio_alignment(probe)
    probe.unlink()
    return max(mem_align, off_align)


@pytest.fixture(scope="module")
def long_file(disk_root: Path):
    """256 MiB of os.urandom data: long enough at queue depth 1 to hit it with signals."""
    path = disk_root / f"long-{os.getpid()}.bin"
    data = os.urandom(256 * MiB)
    _ref_write(path, data)
    yield path, data
    path.unlink()


# --------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("block_size", [4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB],
                         ids=["bs4K", "bs64K", "bs1M", "bs8M"])
@pytest.mark.parametrize("queue_depth", [1, 2, 32, 128], ids=lambda q: f"qd{q}")
@pytest.mark.parametrize("single_submit,overlap_events", COMBOS, ids=COMBO_IDS)
def test_round_trip_knobs(tmp_dir, align, block_size, queue_depth, single_submit,
                          overlap_events):
    # 3 MiB + 3 alignment units: not a multiple of 64K/1M (last piece shorter), below 8M
    with _queue(queue_depth, single_submit=single_submit, overlap_events=overlap_events) as q:
        _round_trip(q, tmp_dir / "f.bin", 3 * MiB + 3 * align, offset=5 * align, align=align,
                    block=block_size)


@pytest.mark.parametrize("route", ["submit", "run"])
@pytest.mark.parametrize("offset_units", [0, 1, 2049], ids=lambda u: f"off{u}")
@pytest.mark.parametrize("size", ["one-block", "4K", "64K+1", "1M", "33M+1"])
def test_round_trip_sizes(queue, tmp_dir, align, size, offset_units, route):
    nbytes = {"one-block": align, "4K": 4 * KiB, "64K+1": 64 * KiB + align, "1M": MiB,
              "33M+1": 33 * MiB + align}[size]
    _round_trip(queue, tmp_dir / "f.bin", nbytes, offset=offset_units * align, align=align,
                route=route)


@pytest.mark.parametrize("single_submit,overlap_events", COMBOS, ids=COMBO_IDS)
def test_last_piece_shorter(tmp_dir, align, single_submit, overlap_events):
    # 3 full 1 MiB pieces then one of a single alignment unit, at a nonzero aligned offset
    with _queue(2, single_submit=single_submit, overlap_events=overlap_events) as q:
        _round_trip(q, tmp_dir / "f.bin", 3 * MiB + align, offset=7 * align, align=align,
                    block=MiB)


@pytest.mark.slow
def test_round_trip_over_one_gib(tmp_dir, align):
    size = GiB + MiB
    path = tmp_dir / "big.bin"
    knobs = dict(align=align, block=8 * MiB)
    try:
        data = os.urandom(size)
        mem = _mem(size)
        _load(mem, data)
        with _queue(32) as q:
            fd = open_direct(path, write=True, create=True, truncate=True)
            try:
                _ok(_io(q, fd, True, mem.address, size, **knobs), size)
            finally:
                os.close(fd)
            assert path.stat().st_size == size
            _ref_check(path, data)

            # the other direction without another GiB of urandom: rotate the data by 5 MiB
            rotated = data[5 * MiB:] + data[:5 * MiB]
            del data
            _ref_write(path, rotated)
            _fill(mem)
            fd = open_direct(path)
            try:
                _ok(_io(q, fd, False, mem.address, size, **knobs), size)
            finally:
                os.close(fd)
        _assert_same(mem, rotated, "engine read of 1 GiB + 1 MiB")
    finally:
        path.unlink(missing_ok=True)


def test_round_trip_buffered_fd_any_size(tmp_dir):
    # without O_DIRECT nothing needs alignment: odd sizes, odd offsets, odd block sizes
    path = tmp_dir / "f.bin"
    n = MiB + 7
    mem = _mem(n)
    data = os.urandom(n)
    _load(mem, data)
    knobs = dict(mode=MODE_PLAIN, block=4093)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with _queue(5) as q:
            _ok(_io(q, fd, True, mem.address, n, 3, **knobs), n)
            _ref_check(path, data, 3)
            data = os.urandom(n)
            _ref_write(path, data, 3)
            _fill(mem)
            _ok(_io(q, fd, False, mem.address, n, 3, **knobs), n)
    finally:
        os.close(fd)
    _assert_same(mem, data)


def test_buffers_of_every_kind(tmp_dir):
    # the engine takes addresses; the handle turns every kind of buffer into one
    path = tmp_dir / "f.bin"
    data = os.urandom(64 * KiB)
    with aioswap.AioHandle(block_size=16 * KiB, queue_depth=4) as h:
        for src in (data, bytearray(data), memoryview(data),
                    np.frombuffer(data, np.float32).reshape(64, -1)):
            assert h.pwrite(src, path) == len(data)
            _ref_check(path, data)
        arr = np.zeros(len(data) // 8, np.float64)
        for dst in (bytearray(len(data)), memoryview(bytearray(len(data))), arr):
            assert h.pread(dst, path) == len(data)
            _assert_same(dst, data)
        assert h.pread(bytearray(10), path, nbytes=0) == 0


@pytest.mark.parametrize("block_size", [4 * KiB, 256 * KiB], ids=["bs4K", "bs256K"])
@pytest.mark.parametrize("single_submit,overlap_events", COMBOS, ids=COMBO_IDS)
def test_many_requests_in_one_queue(tmp_dir, align, block_size, single_submit, overlap_events):
    # requests queued together, then waited for in turn: out of file order, with gaps, one
    # empty; every waiter reaps whatever completes
    path = tmp_dir / "v.bin"
    mem = _mem(4 * MiB)
    a = mem.address
    # (memory offset, nbytes, file offset)
    layout = [(0, 64 * KiB, MiB), (64 * KiB, 8 * align, 0), (MiB, 512 * KiB, 2 * MiB + align),
              (2 * MiB, 0, 0), (2 * MiB, MiB + align, 5 * MiB + 3 * align),
              (128 * KiB, 3 * align, 64 * KiB)]
    knobs = dict(align=align, block=block_size)

    def run_all(q: AioQueue, fd: int, write: bool) -> None:
        rids = [_submit(q, fd, write, a + m, n, off, **knobs) for m, n, off in layout]
        for rid, (_, n, _) in zip(rids, layout):
            _ok(_res(rid), n)

    pieces = [os.urandom(n) for _, n, _ in layout]
    for (m, _, _), p in zip(layout, pieces):
        _load(mem, p, m)
    with _queue(8, single_submit=single_submit, overlap_events=overlap_events) as q:
        fd = open_direct(path, write=True, create=True)
        try:
            run_all(q, fd, True)
        finally:
            os.close(fd)
        for (_, _, off), p in zip(layout, pieces):
            _ref_check(path, p, off)
        assert _file_bytes(path)[MiB + 64 * KiB:2 * MiB + align] == \
            bytes(MiB - 64 * KiB + align)

        pieces = [os.urandom(n) for _, n, _ in layout]
        for (_, _, off), p in zip(layout, pieces):
            _ref_write(path, p, off)
        _fill(mem)
        fd = open_direct(path)
        try:
            run_all(q, fd, False)
        finally:
            os.close(fd)
        assert q.inflight == 0
    for (m, n, off), p in zip(layout, pieces):
        _assert_same(memoryview(mem)[m:m + n], p, f"request at file offset {off}")


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(units=st.integers(1, 600), offset_units=st.integers(0, 5000),
       block_units=st.sampled_from([1, 3, 8, 64, 256, 2048]), queue_depth=st.integers(1, 8),
       single_submit=st.booleans(), overlap_events=st.booleans())
def test_property_direct(tmp_dir, align, units, offset_units, block_units, queue_depth,
                         single_submit, overlap_events):
    path = tmp_dir / "p.bin"
    path.unlink(missing_ok=True)
    with _queue(queue_depth, single_submit=single_submit, overlap_events=overlap_events) as q:
        _round_trip(q, path, units * align, offset_units * align, align=align,
                    block=block_units * align)


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 300_000), offset=st.integers(0, 100_000),
       block_size=st.integers(1, 70_000), queue_depth=st.integers(1, 16),
       single_submit=st.booleans(), overlap_events=st.booleans())
def test_property_buffered(tmp_dir, size, offset, block_size, queue_depth, single_submit,
                           overlap_events):
    path = tmp_dir / "p.bin"
    knobs = dict(mode=MODE_PLAIN, block=block_size)
    mem = _mem(size)
    data = os.urandom(size)
    _load(mem, data)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with _queue(queue_depth, single_submit=single_submit,
                    overlap_events=overlap_events) as q:
            _ok(_io(q, fd, True, mem.address, size, offset, **knobs), size)
            assert os.fstat(fd).st_size == offset + size
            _ref_check(path, data, offset)
            data = os.urandom(size)
            _ref_write(path, data, offset)
            _fill(mem)
            _ok(_io(q, fd, False, mem.address, size, offset, **knobs), size)
    finally:
        os.close(fd)
    _assert_same(mem, data)


# --------------------------------------------------------------------------- kernel errors

def test_missing_file(tmp_dir):
    missing = tmp_dir / "nope.bin"
    for kw in ({}, {"write": True}):
        with pytest.raises(FileNotFoundError) as ei:
            open_direct(missing, **kw)
        assert ei.value.errno == errno.ENOENT
        assert ei.value.filename == str(missing)
    with pytest.raises(FileNotFoundError):
        open_direct(tmp_dir / "no-dir" / "f.bin", write=True, create=True)
    assert not missing.exists()


@pytest.mark.parametrize("kw", [{"write": True}, {"create": True},
                                {"write": True, "create": True}],
                         ids=["write", "create", "write-create"])
def test_open_direct_directory(tmp_dir, kw):
    with pytest.raises(IsADirectoryError):
        open_direct(tmp_dir, **kw)


def test_open_direct_directory_read_only(tmp_dir):
    with pytest.raises(IsADirectoryError):
        open_direct(tmp_dir)


def test_open_direct_create_truncate(tmp_dir):
    path = tmp_dir / "f.bin"
    fd = open_direct(path, write=True, create=True, mode=0o600)
    os.close(fd)
    assert path.stat().st_mode & 0o777 == 0o600
    _ref_write(path, os.urandom(8192))
    fd = open_direct(path, write=True, truncate=True)
    os.close(fd)
    assert path.stat().st_size == 0


def test_dio_alignment(tmp_dir):
    path = tmp_dir / "f.bin"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        by_path, by_fd = dio_alignment(path), dio_alignment(fd)
    finally:
        os.close(fd)
    assert by_path == by_fd
    for v in by_path + dio_alignment(str(tmp_dir)):
        assert v > 0 and v & (v - 1) == 0, by_path
    with pytest.raises(FileNotFoundError):
        dio_alignment(tmp_dir / "nope")
    assert aio_available() == (True, "")


@pytest.mark.parametrize("route", ["submit", "run"])
@pytest.mark.parametrize("op", ["read", "write"])
def test_misaligned_offset_is_einval(queue, tmp_dir, align, op, route):
    # a caller that claims no alignment on an O_DIRECT fd gets the kernel's EINVAL, with the
    # offset of the failed piece, and nothing moves
    path = tmp_dir / "f.bin"
    data = os.urandom(4 * align)
    _ref_write(path, data)
    mem = _mem(2 * align)
    _fill(mem)
    fd = open_direct(path, write=True)
    try:
        done, err, eoff, en, eof = _io(queue, fd, op == "write", mem.address, 2 * align, 100,
                                       route=route)
        assert (done, err, eoff, eof) == (0, errno.EINVAL, 100, False)
        assert 0 < en <= 2 * align
        _ok(_io(queue, fd, False, mem.address, align, 0, align=align), align)  # still usable
    finally:
        os.close(fd)
    assert _file_bytes(path) == data


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("what", ["address", "size"])
def test_misaligned_memory_or_size_is_einval(queue, tmp_dir, align, op, what):
    path = tmp_dir / "f.bin"
    data = os.urandom(64 * KiB)
    _ref_write(path, data)
    mem = _mem(64 * KiB)
    # a misaligned address: 16 KiB, so the request spans pages (the kernel may accept a
    # misaligned piece that sits inside one page); a misaligned size: one unit + 100 bytes
    addr = mem.address + (1 if what == "address" else 0)
    nbytes = 16 * KiB if what == "address" else align + 100
    fd = open_direct(path, write=True)
    try:
        done, err, eoff, _, eof = _io(queue, fd, op == "write", addr, nbytes, align)
    finally:
        os.close(fd)
    assert err == errno.EINVAL and eoff == align and not eof
    assert _file_bytes(path) == data


@pytest.mark.parametrize("route", ["submit", "run"])
def test_bad_fd_is_ebadf(queue, tmp_dir, route):
    path = tmp_dir / "f.bin"
    _ref_write(path, os.urandom(8192))
    mem = _mem(4096)
    wfd = os.open(path, os.O_WRONLY)
    rfd = os.open(path, os.O_RDONLY)
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)
    knobs = dict(mode=MODE_PLAIN, block=4096, route=route)
    try:
        for write, fd in ((False, wfd), (True, rfd), (False, closed)):
            done, err, eoff, en, eof = _io(queue, fd, write, mem.address, 4096, **knobs)
            assert (done, err, eoff, en, eof) == (0, errno.EBADF, 0, 4096, False)
        _ok(_io(queue, rfd, False, mem.address, 4096, **knobs), 4096)   # still usable
    finally:
        os.close(wfd)
        os.close(rfd)


@pytest.mark.parametrize("queue_depth", [1, 32])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_read_past_eof(tmp_dir, align, queue_depth, direct):
    # the file ends 100 bytes into a block: the last piece is short, its remainder hits EOF
    path = tmp_dir / "f.bin"
    data = os.urandom(MiB + 100)
    _ref_write(path, data)
    mem = _mem(2 * MiB)
    _fill(mem)
    knobs = dict(mode=MODE_DIRECT, align=align) if direct else dict(mode=MODE_PLAIN)
    fd = open_direct(path) if direct else os.open(path, os.O_RDONLY)
    try:
        with _queue(queue_depth) as q:
            done, err, eoff, _, eof = _io(q, fd, False, mem.address, 2 * MiB,
                                          block=256 * KiB, **knobs)
            assert eof and err == 0 and done <= len(data), (done, err, eoff, eof)
            assert MiB <= eoff < 2 * MiB                   # a piece that met the end
            _assert_same(memoryview(mem)[:len(data)], data, "bytes before EOF")

            done, err, eoff, _, eof = _io(q, fd, False, mem.address, 4096, 4 * MiB,
                                          block=256 * KiB, **knobs)
            assert (done, err, eoff, eof) == (0, 0, 4 * MiB, True)   # wholly past the end
            _ok(_io(q, fd, False, mem.address, MiB, 0, block=256 * KiB, **knobs), MiB)
    finally:
        os.close(fd)


RLIMIT_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    from aioswap._aio import MODE_DIRECT, AioQueue, LockedMemory, dio_alignment, open_direct
    ref, target, limit, ss, ov = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
        sys.argv[4] == "1", sys.argv[5] == "1"
    with open(ref, "rb") as f:
        data = f.read()
    mem = LockedMemory(len(data), lock=False)
    memoryview(mem)[:] = data
    fd = open_direct(target, write=True, create=True, truncate=True)
    align = dio_alignment(fd)[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # else the kernel kills us instead of EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    q = AioQueue(4, single_submit=ss, overlap_events=ov,
                 backend=os.environ.get("AIOSWAP_BACKEND", "auto"))
    try:
        rq = q.submit(fd, True, mem.address, len(data), 0, MODE_DIRECT, align, 64 << 10,
                      None, False, True)
        rq.drain(False)
        done, err, (eoff, en), eof = rq.done, rq.errno, rq.failed_at, rq.eof
        # the queue survives a failed request
        rq = q.submit(fd, True, mem.address, 4096, 0, MODE_DIRECT, align, 4096, None, False,
                      True)
        rq.drain(False)
        after = (rq.done, rq.errno, *rq.failed_at, rq.eof)
    finally:
        q.close()
    print(json.dumps({"done": done, "errno": err, "offset": eoff, "eof": eof,
                      "after": list(after)}))
""")


@pytest.mark.parametrize("limit", [MiB + 12 * KiB, MiB], ids=["mid-block", "on-block"])
@pytest.mark.parametrize("single_submit,overlap_events", [(False, True), (True, False)],
                         ids=["batch-overlap", "single-wait"])
def test_full_disk_rlimit_fsize_is_efbig(tmp_dir, limit, single_submit, overlap_events):
    data = os.urandom(4 * MiB)
    ref = tmp_dir / "ref.bin"
    target = tmp_dir / "target.bin"
    ref.write_bytes(data)
    proc = subprocess.run(
        [sys.executable, "-c", RLIMIT_CHILD, str(ref), str(target), str(limit),
         str(int(single_submit)), str(int(overlap_events))],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errno"] == errno.EFBIG and not out["eof"], out
    assert limit <= out["offset"] < len(data), out
    assert out["done"] <= limit, out
    assert out["after"] == [4096, 0, 0, 0, False], out
    assert target.stat().st_size == limit
    _ref_check(target, data[:limit])                 # nothing before the limit corrupted


# --------------------------------------------------------------------------- signals, GIL

class _Interrupt(Exception):
    pass


def _with_timer(handler, interval: float, fn):
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)


def test_signals_during_long_read(long_file, align):
    path, data = long_file
    mem = _mem(len(data))
    _fill(mem)
    calls = []
    fd = open_direct(path)
    try:
        with _queue(1) as q:
            res = _with_timer(lambda signum, frame: calls.append(signum), 0.002,
                              lambda: _io(q, fd, False, mem.address, len(data), align=align,
                                          block=64 * KiB))
    finally:
        os.close(fd)
    _ok(res, len(data))
    assert len(calls) >= 1
    _assert_same(mem, data, "read interrupted by signals")


def test_signals_during_long_write(tmp_dir, align):
    path = tmp_dir / "w.bin"
    data = os.urandom(128 * MiB)
    mem = _mem(len(data))
    _load(mem, data)
    calls = []
    fd = open_direct(path, write=True, create=True)
    try:
        with _queue(1) as q:
            res = _with_timer(lambda signum, frame: calls.append(signum), 0.002,
                              lambda: _io(q, fd, True, mem.address, len(data), align=align,
                                          block=64 * KiB))
    finally:
        os.close(fd)
    _ok(res, len(data))
    assert len(calls) >= 1
    _ref_check(path, data)
    path.unlink()


def test_signal_handler_exception_propagates(long_file, align):
    path, data = long_file
    mem = _mem(len(data))
    _fill(mem)
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        if len(calls) == 1:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            raise _Interrupt("from the signal handler")

    fd = open_direct(path)
    try:
        with _queue(1) as q:
            with pytest.raises(_Interrupt):
                _with_timer(handler, 0.01,
                            lambda: _io(q, fd, False, mem.address, len(data), align=align,
                                        block=16 * KiB))
            assert len(calls) >= 1
            # the request stopped early (the last MiB was never read), nothing is left in
            # flight ...
            assert q.inflight == 0
            assert memoryview(mem)[-MiB:].tobytes() == b"\xa5" * MiB
            # ... and the queue is still usable
            _fill(mem)
            _ok(_io(q, fd, False, mem.address, 8 * MiB, align=align, block=MiB), 8 * MiB)
            _assert_same(memoryview(mem)[:8 * MiB], data[:8 * MiB])
            assert not q.closed
    finally:
        os.close(fd)


def test_single_signal_handled_during_transfer(long_file, align):
    # one SIGALRM (think Ctrl-C) early in a long transfer must stop it early
    path, data = long_file
    nbytes = 64 * MiB
    mem = _mem(nbytes)

    def handler(signum, frame):
        raise _Interrupt("one signal")

    fd = open_direct(path)
    old = signal.signal(signal.SIGALRM, handler)
    try:
        with _queue(1) as q:
            for trial in range(5):
                _fill(mem)
                signal.setitimer(signal.ITIMER_REAL, 0.005 + 0.002 * trial)
                raised = False
                try:
                    _io(q, fd, False, mem.address, nbytes, align=align, block=16 * KiB)
                    for _ in range(100):                  # a deferred handler runs here
                        time.sleep(0.001)
                except _Interrupt:
                    raised = True
                assert raised
                finished = memoryview(mem)[-4096:].tobytes() != b"\xa5" * 4096
                assert not finished, f"trial {trial}: the signal was handled after the transfer"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(fd)


def test_threads_share_one_queue(tmp_dir, align):
    # four threads, each waiting for its own sync requests on one queue, all on one file at
    # once, each on its own region
    path = tmp_dir / "t.bin"
    region = 4 * MiB
    datas = [os.urandom(region) for _ in range(4)]
    errors = []
    fd = open_direct(path, write=True, create=True)

    def work(q, i):
        try:
            mem = _mem(region)
            _load(mem, datas[i])
            for _ in range(3):
                _ok(_io(q, fd, True, mem.address, region, i * region, align=align,
                        block=64 * KiB), region)
                _fill(mem)
                _ok(_io(q, fd, False, mem.address, region, i * region, align=align,
                        block=256 * KiB), region)
                assert memoryview(mem).tobytes() == datas[i]
        except BaseException as exc:                     # reported below
            errors.append(exc)

    try:
        with _queue(16) as q:
            threads = [threading.Thread(target=work, args=(q, i)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert q.inflight == 0
    finally:
        os.close(fd)
    assert not errors, errors
    _ref_check(path, b"".join(datas))


@pytest.mark.parametrize("op", ["read", "write"])
def test_gil_released_during_transfer(tmp_dir, long_file, align, op):
    path, data = long_file
    if op == "write":
        path = tmp_dir / "gil.bin"
    mem = _mem(len(data))
    _load(mem, data)
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        c0, t0 = counter[0], time.perf_counter()
        time.sleep(0.2)                                   # main thread idle: full speed
        rate_idle = (counter[0] - c0) / (time.perf_counter() - t0)
        fd = open_direct(path, write=op == "write", create=op == "write")
        try:
            with _queue(1) as q:
                c0, t0 = counter[0], time.perf_counter()
                _ok(_io(q, fd, op == "write", mem.address, len(data), align=align,
                        block=64 * KiB), len(data))
                elapsed = time.perf_counter() - t0
                advanced = counter[0] - c0
        finally:
            os.close(fd)
    finally:
        stop.set()
        t.join()
    # a transfer that held the GIL would leave the counter still (a few switches at most)
    assert advanced >= 0.2 * rate_idle * elapsed, (advanced, rate_idle, elapsed)
    if op == "write":
        path.unlink()


# --------------------------------------------------------------------------- lifetime, leaks

def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _aio_rings() -> int:
    """Kernel queues of this process: AIO contexts (each maps its ring as '/[aio] (deleted)')
    and io_uring instances (each an fd on 'anon_inode:[io_uring]')."""
    with open("/proc/self/maps") as f:
        n = sum("[aio]" in line for line in f)
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "io_uring" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _aio_nr() -> int:
    with open("/proc/sys/fs/aio-nr") as f:
        return int(f.read())


def _aio_nr_back_to(baseline: int, timeout: float = 10.0) -> int:
    # fs.aio-nr is system-wide: wait out other processes' (e.g. parallel tests') contexts
    deadline = time.monotonic() + timeout
    while (now := _aio_nr()) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


@pytest.mark.alone      # fs.aio-nr counts every process's AIO contexts
def test_no_leaks_after_10000_operations(tmp_dir, align):
    path = tmp_dir / "f.bin"
    data = os.urandom(MiB)
    _ref_write(path, data)
    mem = _mem(64 * KiB)
    gc.collect()
    fds, rings, nr = _open_fds(), _aio_rings(), _aio_nr()

    with _queue(32) as q:
        assert _aio_rings() == rings + (q.backend != "threads")
        fd = open_direct(path, write=True)
        try:
            a = mem.address
            kw = dict(align=align, block=align)
            for i in range(10_000):
                kind, off = i % 10, (i * align) % (MiB - 8 * KiB)
                if kind < 3:
                    _ok(_io(q, fd, True, a, 4 * KiB, off, **kw), 4 * KiB)
                elif kind < 6:
                    _ok(_io(q, fd, False, a, 8 * KiB, off, route="run", align=align,
                            block=4 * align), 8 * KiB)
                elif kind == 6:                          # two requests in flight together
                    r1 = _submit(q, fd, False, a, align, off, **kw)
                    r2 = _submit(q, fd, False, a + 4 * KiB, align, 0, **kw)
                    _ok(_res(r1), align)
                    _ok(_res(r2), align)
                elif kind == 7:
                    assert _io(q, fd, False, a, 4 * KiB, off + 1)[1] == errno.EINVAL
                elif kind == 8:
                    assert _io(q, fd, False, a, 2 * align, MiB - align, **kw)[4]   # EOF
                else:
                    with pytest.raises(ValueError):
                        _submit(q, fd, True, a, 4 * KiB, -1, **kw)
                    os.close(open_direct(path))
                    with pytest.raises(FileNotFoundError):
                        open_direct(tmp_dir / "missing")
        finally:
            os.close(fd)
        assert q.inflight == 0
    assert q.closed
    gc.collect()
    assert _open_fds() == fds
    assert _aio_rings() == rings
    assert _aio_nr_back_to(nr) <= nr


@pytest.mark.slow
@pytest.mark.alone      # fs.aio-nr counts every process's AIO contexts
def test_no_leaks_after_many_queues():
    gc.collect()
    fds, rings, nr, tasks = _open_fds(), _aio_rings(), _aio_nr(), _tasks()
    errors = []

    def churn(n):
        try:
            for i in range(n):
                if i % 2:
                    AioQueue(32).close()                 # created and closed
                else:
                    AioQueue(32)                         # dropped without close
        except BaseException as exc:                     # pragma: no cover - reported below
            errors.append(exc)

    # io_destroy waits for an RCU grace period (~tens of ms), with the GIL released:
    # threads overlap those waits; 2,000 queues in all
    threads = [threading.Thread(target=churn, args=(125,)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for _ in range(20):                                  # in reference cycles: freed by gc
        cycle = [AioQueue(8)]
        cycle.append(cycle)
        del cycle
    gc.collect()
    assert _open_fds() == fds
    assert _aio_rings() == rings
    assert _aio_nr_back_to(nr) <= nr
    assert _tasks() == tasks                             # worker threads joined


def test_close_twice_and_closed_queue(tmp_dir):
    path = tmp_dir / "f.bin"
    data = os.urandom(8192)
    _ref_write(path, data)
    q = AioQueue(4)
    assert not q.closed and q.depth == 4 and "depth=4" in repr(q)
    q.close()
    q.close()
    assert q.closed and "closed" in repr(q)
    mem = _mem(8192)
    _fill(mem)
    fd = os.open(path, os.O_RDWR)
    try:
        for call in (lambda: _io(q, fd, False, mem.address, 4096, mode=MODE_PLAIN),
                     lambda: _io(q, fd, True, mem.address, 4096, mode=MODE_PLAIN),
                     lambda: _io(q, fd, True, mem.address, 4096, mode=MODE_PLAIN,
                                 route="run"),
                     lambda: q.attach_ring(mem, mem.address, 4096, 2)):
            with pytest.raises(HandleClosedError):
                call()
    finally:
        os.close(fd)
    assert q.serve() is None                     # a completion thread ends at once
    q.hurry(1)
    q.shutdown()
    assert memoryview(mem).tobytes() == b"\xa5" * 8192 and _file_bytes(path) == data
    assert issubclass(HandleClosedError, ValueError)


def test_bad_depth():
    for depth in (0, -1, _aio.MAX_DEPTH + 1):
        with pytest.raises(ValueError):
            AioQueue(depth)


# --------------------------------------------------------------------------- bad input

def _ring(q: AioQueue, bufsize: int = 16 * KiB, nbuf: int = 2) -> LockedMemory:
    ring = _mem(bufsize * nbuf)
    q.attach_ring(ring, ring.address, bufsize, nbuf)
    return ring


# (id, exception, call(queue, fd, mem)); mem is 16 KiB of aligned memory, fd an O_DIRECT
# file; a fresh queue of depth 8 without a ring
BAD_INPUTS = [
    ("bad-mode", ValueError,
     lambda q, fd, m: q.submit(fd, False, m.address, 4096, 0, 7, 4096, 4096)),
    ("negative-offset", ValueError,
     lambda q, fd, m: q.submit(fd, True, m.address, 4096, -4096, MODE_DIRECT, 4096, 4096)),
    ("negative-nbytes", OverflowError,
     lambda q, fd, m: q.submit(fd, False, m.address, -1, 0, MODE_DIRECT, 4096, 4096)),
    ("align-zero", ValueError,
     lambda q, fd, m: q.submit(fd, False, m.address, 4096, 0, MODE_DIRECT, 0, 4096)),
    ("block-under-align", ValueError,
     lambda q, fd, m: q.submit(fd, False, m.address, 4096, 0, MODE_DIRECT, 4096, 2048)),
    ("block-not-multiple", ValueError,
     lambda q, fd, m: q.submit(fd, True, m.address, 8192, 0, MODE_DIRECT, 4096, 6144)),
    ("run-block-zero", ValueError,
     lambda q, fd, m: q.run(fd, False, m.address, 4096, 0, MODE_DIRECT, 4096, 0)),
    ("edges-without-ring", RuntimeError,
     lambda q, fd, m: q.submit(fd, False, m.address, 100, 0, MODE_DIRECT, 4096, 4096)),
    ("bounce-without-ring", RuntimeError,
     lambda q, fd, m: q.submit(fd, True, m.address, 4096, 0, MODE_BOUNCE, 4096, 4096)),
    ("unaligned-write-without-filestate", ValueError,
     lambda q, fd, m: (_ring(q), q.submit(fd, True, m.address, 100, 4000, MODE_DIRECT, 4096,
                                          4096))),
    ("ring-under-align", ValueError,
     lambda q, fd, m: (_ring(q, 1024), q.submit(fd, False, m.address, 100, 0, MODE_DIRECT,
                                                4096, 4096))),
    ("ring-bufsize-zero", ValueError, lambda q, fd, m: q.attach_ring(m, m.address, 0, 2)),
    ("ring-nbuf-zero", ValueError, lambda q, fd, m: q.attach_ring(m, m.address, 4096, 0)),
    ("ring-bufsize-odd", ValueError, lambda q, fd, m: q.attach_ring(m, m.address, 4000, 2)),
    ("ring-address-odd", ValueError,
     lambda q, fd, m: q.attach_ring(m, m.address + 8, 4096, 2)),
    ("ring-twice", RuntimeError, lambda q, fd, m: (_ring(q), _ring(q))),
]


@pytest.mark.parametrize("exc_type,call", [
    pytest.param(exc, call, id=name) for name, exc, call in BAD_INPUTS])
def test_bad_input_raises_before_any_io(tmp_dir, exc_type, call):
    path = tmp_dir / "f.bin"
    data = os.urandom(64 * KiB)
    _ref_write(path, data)
    mem = _mem(16 * KiB)
    _fill(mem)
    align = max(dio_alignment(path))
    fd = open_direct(path, write=True)
    try:
        with _queue(8) as q:
            with pytest.raises(exc_type):
                call(q, fd, mem)
            assert q.inflight == 0
            assert memoryview(mem).tobytes() == b"\xa5" * len(mem)     # nothing read
            assert _file_bytes(path) == data                          # nothing written
            _ok(_io(q, fd, False, mem.address, len(mem), align=align), len(mem))  # usable
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- O_DIRECT refused

ODIRECT_CHILD = textwrap.dedent("""
    import errno, os, sys
    from aioswap._aio import open_direct
    from aioswap.errors import DirectIOUnsupportedError
    d = sys.argv[1]
    new, old = os.path.join(d, "new.bin"), os.path.join(d, "old.bin")
    try:
        os.close(open_direct(new, write=True, create=True))
    except DirectIOUnsupportedError as exc:
        assert isinstance(exc, OSError) and exc.errno == errno.EINVAL, exc
        assert new in str(exc), exc
    else:
        print("O_DIRECT-SUPPORTED")
        sys.exit(0)
    assert not os.path.lexists(new), "the file open_direct created was left behind"
    with open(old, "wb") as f:
        f.write(b"keep me")
    try:
        open_direct(old, write=True, create=True)
    except DirectIOUnsupportedError:
        pass
    with open(old, "rb") as f:                 # a file it did not create is left alone
        assert f.read() == b"keep me"
    print("REFUSED-OK")
""")


def _refuses_o_direct(d: str) -> bool:
    probe = os.path.join(d, f"aioswap-probe-{os.getpid()}")
    try:
        os.close(open_direct(probe, write=True, create=True))
    except DirectIOUnsupportedError:
        return True
    except OSError:
        return False
    os.unlink(probe)
    return False


def test_open_direct_refused_by_file_system(tmp_dir):
    """On a file system without O_DIRECT: DirectIOUnsupportedError, created file removed."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
            and _refuses_o_direct("/dev/shm"):
        cmd = [sys.executable, "-c", ODIRECT_CHILD, "/dev/shm"]
        where = "/dev/shm"
    else:
        # tmpfs has O_DIRECT since Linux 6.6; ramfs never has: mount one in a private mount
        # namespace (root only), which vanishes with the child
        unshare, mount = shutil.which("unshare"), shutil.which("mount")
        if os.geteuid() != 0 or not unshare or not mount:
            pytest.skip("O_DIRECT works on /dev/shm here and no ramfs can be mounted "
                        "(needs root, unshare and mount)")
        mnt = tmp_dir / "ramfs"
        mnt.mkdir()
        script = 'mount -t ramfs aioswap-test "$1" && exec "$2" -c "$3" "$1"'
        cmd = [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh",
               str(mnt), sys.executable, ODIRECT_CHILD]
        where = "ramfs"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if where == "ramfs" and proc.returncode != 0 and "REFUSED" not in proc.stdout \
            and "Traceback" not in proc.stderr:
        pytest.skip(f"could not mount a ramfs in a private namespace: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    if "O_DIRECT-SUPPORTED" in proc.stdout:
        pytest.skip(f"{where} accepts O_DIRECT on this kernel")
    assert "REFUSED-OK" in proc.stdout, (proc.stdout, proc.stderr)


# --------------------------------------------------------------------------- LockedMemory

def test_locked_memory_basics():
    m = _mem(5000)
    assert m.address % _aio.PAGE_SIZE == 0 and len(m) == m.nbytes == 5000
    assert m.mapped_bytes == -(-5000 // _aio.PAGE_SIZE) * _aio.PAGE_SIZE
    mv = memoryview(m)
    assert not mv.readonly and mv.nbytes == 5000 and mv.contiguous
    with pytest.raises(BufferError):
        m.release()                                        # an export is open
    mv.release()
    m.release()
    m.release()
    assert m.closed
    with pytest.raises(BufferError):
        memoryview(m)
    with pytest.raises(ValueError):
        LockedMemory(0)


# --------------------------------------------------------------------------- benchmark smoke

@pytest.mark.slow
def test_bench_engine_smoke(tmp_dir):
    before = set(tmp_dir.iterdir())
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--dir", str(tmp_dir), "--size", "8M", "--repeat", "1"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for op in ("write", "read"):
        assert re.search(rf"^\s*{op}\s+\d+\.\d+", out, re.M), out
    assert "GB/s" in out
    num = r"\s+\d+\.\d+"
    for op in ("write", "read"):                     # aioswap best, median [fio x2, ratio x3]
        cols = rf"^{op}({num}){{7}}\s*$" if shutil.which("fio") else rf"^{op}({num}){{2}}\s+-"
        assert re.search(cols, out, re.M), out
    assert set(tmp_dir.iterdir()) == before                 # its file is removed

    proc = subprocess.run(
        [sys.executable, str(BENCH), "--dir", str(tmp_dir), "--size", "4M", "--block-size",
         "256K", "--queue-depth", "4", "--repeat", "2", "--json"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["size"] == 4 * MiB and report["block_size"] == 256 * KiB
    for op in ("write", "read"):
        assert len(report["aioswap"][op]) == 2 and min(report["aioswap"][op]) > 0
        if shutil.which("fio"):
            assert len(report["fio"][op]) == 2
            assert set(report["ratio"][op]) == {"best", "median", "paired"}
    assert set(tmp_dir.iterdir()) == before

    proc = subprocess.run([sys.executable, str(BENCH), "--size", "3X"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "size" in proc.stderr


def test_address_view_reads_the_bytes_without_a_new_type() -> None:
    """``address_view``: the bytes at an address, read-only, and no garbage cycle per call
    (a ``ctypes`` array type per size was one, and it made every checksummed load pay a
    full collection)."""
    data = np.random.default_rng(3).integers(0, 256, 10_001, dtype=np.uint8)
    addr = data.ctypes.data
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        views = [_aio.address_view(addr + k, n) for k, n in ((0, 10_001), (1, 9_999),
                                                            (4095, 3), (77, 1))]
        assert [bytes(v) for v in views] == [data.tobytes()[k:k + n] for k, n in
                                             ((0, 10_001), (1, 9_999), (4095, 3), (77, 1))]
        assert all(v.readonly and v.format == "B" for v in views)
        with pytest.raises(TypeError):
            views[0][0] = 1
        del views
        assert gc.collect() == 0
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert bytes(_aio.address_view(addr, 0)) == b""
    with pytest.raises(ValueError, match="-1"):
        _aio.address_view(addr, -1)
    with pytest.raises(ValueError, match="address 0"):
        _aio.address_view(0, 8)


def test_cached_hit_finds_the_handles_file_by_fd_and_path(tmp_path: Path) -> None:
    """One C call (fcntl + fstat, or stat) finds the handle's own file for an fd or a path,
    pinned; anything it cannot vouch for is None (the handle's slow path decides)."""
    p = tmp_path / "x.bin"
    p.write_bytes(b"x" * 4096)
    with aioswap.AioHandle() as h:
        assert h._core.cached_hit(str(p), False) is None        # not open yet
        h.pread(bytearray(4096), str(p))
        (f,) = h._core.files.values()
        users = f._users
        for arg in (str(p), p, os.fsencode(p)):
            assert h._core.cached_hit(arg, False) is f
            assert f._users == users + 1
            f.unuse()
        fd = os.open(p, os.O_RDONLY)
        try:
            assert h._core.cached_hit(fd, False) is f
            f.unuse()
            assert h._core.cached_hit(fd, True) is None         # a read-only fd
        finally:
            os.close(fd)
        fd = os.open(p, os.O_WRONLY | os.O_APPEND)
        try:
            assert h._core.cached_hit(fd, True) is None         # O_APPEND
            assert h._core.cached_hit(fd, False) is None        # write-only
        finally:
            os.close(fd)
        assert h._core.cached_hit(fd, False) is None            # closed now
        for bad in (-1, 1 << 40, str(tmp_path), str(tmp_path / "missing"), "a\0b", 1.5, True,
                    None):
            assert h._core.cached_hit(bad, False) is None
        assert f._users == users


def test_resident_prefix_reads_nothing_in(tmp_dir: Path) -> None:
    """``resident_prefix``: the cached part at the front of a range, in bytes from its
    offset, told without reading any page in (a RWF_NOWAIT probe that misses would)."""
    page = os.sysconf("SC_PAGE_SIZE")
    path = tmp_dir / "r.bin"
    path.write_bytes(os.urandom(8 * page))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)      # reads below: their pages only
        assert _aio.resident_prefix(fd, 0, 8 * page) == 0
        assert _aio.resident_prefix(fd, 0, 8 * page) == 0        # and still nothing there
        os.pread(fd, 2 * page, 0)                               # pages 0 and 1
        os.pread(fd, page, 5 * page)                            # page 5: not leading
        assert _aio.resident_prefix(fd, 0, 8 * page) == 2 * page
        assert _aio.resident_prefix(fd, 100, 8 * page - 100) == 2 * page - 100
        assert _aio.resident_prefix(fd, 100, 50) == 50          # clipped to the range
        assert _aio.resident_prefix(fd, 2 * page, page) == 0
        assert _aio.resident_prefix(fd, 5 * page + 7, page - 7) == page - 7
        assert _aio.resident_prefix(fd, 0, 0) == 0
        assert _aio.resident_prefix(-1, 0, page) == 0           # cannot be told: 0
    finally:
        os.close(fd)
