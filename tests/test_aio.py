"""Tests of the kernel AIO engine (``aioswap._aio``): real files, real kernel errors.

Every round trip is checked byte for byte against plain ``os.pread``/``os.pwrite`` on a
buffered fd, in both directions, with ``os.urandom`` data. Errors are the ones the kernel
really returns (misaligned O_DIRECT, RLIMIT_FSIZE, EOF, EBADF, signals), never mocked.
"""
from __future__ import annotations

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
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioswap import _aio
from aioswap._aio import AioContext, LockedMemory, aio_available, dio_alignment, open_direct
from aioswap.errors import (AioswapError, DirectIOUnsupportedError, HandleClosedError,
                            ShortReadError)

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


def _round_trip(ctx: AioContext, path: Path, size: int, offset: int = 0, **knobs) -> None:
    """Engine write checked by os.pread; os.pwrite checked by engine read."""
    mem = _mem(size)
    data = os.urandom(size)
    _load(mem, data)
    fd = open_direct(path, write=True, create=True)
    try:
        assert ctx.pwrite(fd, mem, offset, path=path, **knobs) == size
    finally:
        os.close(fd)
    assert path.stat().st_size >= offset + size
    _ref_check(path, data, offset)

    data = os.urandom(size)
    _ref_write(path, data, offset)
    _fill(mem)
    fd = open_direct(path)
    try:
        assert ctx.pread(fd, mem, offset, path=path, **knobs) == size
    finally:
        os.close(fd)
    _assert_same(mem, data, f"engine read of {size} bytes at {offset}")


@pytest.fixture
def ctx():
    with AioContext(128) as c:
        yield c


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
def test_round_trip_knobs(ctx, tmp_dir, align, block_size, queue_depth, single_submit,
                          overlap_events):
    # 3 MiB + 3 alignment units: not a multiple of 64K/1M (last piece shorter), below 8M
    _round_trip(ctx, tmp_dir / "f.bin", 3 * MiB + 3 * align, offset=5 * align,
                block_size=block_size, queue_depth=queue_depth,
                single_submit=single_submit, overlap_events=overlap_events)


@pytest.mark.parametrize("offset_units", [0, 1, 2049], ids=lambda u: f"off{u}")
@pytest.mark.parametrize("size", ["one-block", "4K", "64K+1", "1M", "33M+1"])
def test_round_trip_sizes(ctx, tmp_dir, align, size, offset_units):
    nbytes = {"one-block": align, "4K": 4 * KiB, "64K+1": 64 * KiB + align, "1M": MiB,
              "33M+1": 33 * MiB + align}[size]
    _round_trip(ctx, tmp_dir / "f.bin", nbytes, offset=offset_units * align)


@pytest.mark.parametrize("single_submit,overlap_events", COMBOS, ids=COMBO_IDS)
def test_last_piece_shorter(ctx, tmp_dir, align, single_submit, overlap_events):
    # 3 full 1 MiB pieces then one of a single alignment unit, at a nonzero aligned offset
    _round_trip(ctx, tmp_dir / "f.bin", 3 * MiB + align, offset=7 * align, block_size=MiB,
                queue_depth=2, single_submit=single_submit, overlap_events=overlap_events)


@pytest.mark.slow
def test_round_trip_over_one_gib(ctx, tmp_dir):
    size = GiB + MiB
    path = tmp_dir / "big.bin"
    knobs = dict(block_size=8 * MiB, queue_depth=32, path=path)
    try:
        data = os.urandom(size)
        mem = _mem(size)
        _load(mem, data)
        fd = open_direct(path, write=True, create=True, truncate=True)
        try:
            assert ctx.pwrite(fd, mem, **knobs) == size
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
            assert ctx.pread(fd, mem, **knobs) == size
        finally:
            os.close(fd)
        _assert_same(mem, rotated, "engine read of 1 GiB + 1 MiB")
    finally:
        path.unlink(missing_ok=True)


def test_round_trip_buffered_fd_any_size(ctx, tmp_dir):
    # without O_DIRECT nothing needs alignment: odd sizes, odd offsets, odd block sizes
    path = tmp_dir / "f.bin"
    buf = bytearray(MiB + 7)
    data = os.urandom(len(buf))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert ctx.pwrite(fd, data, 3, block_size=4093, queue_depth=5) == len(data)
        _ref_check(path, data, 3)
        data = os.urandom(len(buf))
        _ref_write(path, data, 3)
        assert ctx.pread(fd, buf, 3, block_size=4093, queue_depth=5) == len(buf)
    finally:
        os.close(fd)
    _assert_same(buf, data)


def test_buffers_of_every_kind(ctx, tmp_dir):
    # bytes/bytearray/memoryview/numpy for writes; writable ones and raw addresses for reads
    path = tmp_dir / "f.bin"
    data = os.urandom(64 * KiB)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for src in (data, bytearray(data), memoryview(data),
                    np.frombuffer(data, np.float32).reshape(64, -1)):
            assert ctx.pwrite(fd, src) == len(data)
            _ref_check(path, data)
        arr = np.zeros(len(data) // 8, np.float64)
        for dst in (bytearray(len(data)), memoryview(bytearray(len(data))), arr):
            assert ctx.pread(fd, dst) == len(data)
            _assert_same(dst, data)
        mem = _mem(len(data))
        assert ctx.pread(fd, mem.address, nbytes=len(data)) == len(data)
        _assert_same(mem, data)
        assert ctx.pread(fd, bytearray(10), nbytes=0) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("block_size", [4 * KiB, 256 * KiB], ids=["bs4K", "bs256K"])
@pytest.mark.parametrize("single_submit,overlap_events", COMBOS, ids=COMBO_IDS)
def test_vectored_round_trip(ctx, tmp_dir, align, block_size, single_submit, overlap_events):
    path = tmp_dir / "v.bin"
    mem = _mem(4 * MiB)
    a = mem.address
    # (memory offset, nbytes, file offset): out of file order, with gaps, one empty segment
    layout = [(0, 64 * KiB, MiB), (64 * KiB, 8 * align, 0), (MiB, 512 * KiB, 2 * MiB + align),
              (2 * MiB, 0, 0), (2 * MiB, MiB + align, 5 * MiB + 3 * align),
              (128 * KiB, 3 * align, 64 * KiB)]
    segs = [(a + m, n, off) for m, n, off in layout]
    total = sum(n for _, n, _ in layout)
    knobs = dict(block_size=block_size, queue_depth=8, single_submit=single_submit,
                 overlap_events=overlap_events, path=path)
    pieces = [os.urandom(n) for _, n, _ in layout]
    for (m, _, _), p in zip(layout, pieces):
        _load(mem, p, m)
    fd = open_direct(path, write=True, create=True)
    try:
        assert ctx.pwritev(fd, iter(segs), **knobs) == total       # any iterable
    finally:
        os.close(fd)
    for (_, _, off), p in zip(layout, pieces):
        _ref_check(path, p, off)
    assert _file_bytes(path)[MiB + 64 * KiB:2 * MiB + align] == bytes(MiB - 64 * KiB + align)

    pieces = [os.urandom(n) for _, n, _ in layout]
    for (_, _, off), p in zip(layout, pieces):
        _ref_write(path, p, off)
    _fill(mem)
    fd = open_direct(path)
    try:
        assert ctx.preadv(fd, segs, **knobs) == total
        assert ctx.preadv(fd, [], **knobs) == 0
    finally:
        os.close(fd)
    for (m, n, off), p in zip(layout, pieces):
        _assert_same(memoryview(mem)[m:m + n], p, f"segment at file offset {off}")


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(units=st.integers(1, 600), offset_units=st.integers(0, 5000),
       block_units=st.sampled_from([1, 3, 8, 64, 256, 2048]), queue_depth=st.integers(1, 8),
       single_submit=st.booleans(), overlap_events=st.booleans())
def test_property_direct(ctx, tmp_dir, align, units, offset_units, block_units, queue_depth,
                         single_submit, overlap_events):
    path = tmp_dir / "p.bin"
    path.unlink(missing_ok=True)
    _round_trip(ctx, path, units * align, offset_units * align, block_size=block_units * align,
                queue_depth=queue_depth, single_submit=single_submit,
                overlap_events=overlap_events)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 300_000), offset=st.integers(0, 100_000),
       block_size=st.integers(1, 70_000), queue_depth=st.integers(1, 16),
       single_submit=st.booleans(), overlap_events=st.booleans())
def test_property_buffered(ctx, tmp_dir, size, offset, block_size, queue_depth, single_submit,
                           overlap_events):
    path = tmp_dir / "p.bin"
    knobs = dict(block_size=block_size, queue_depth=queue_depth, single_submit=single_submit,
                 overlap_events=overlap_events)
    data = os.urandom(size)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        assert ctx.pwrite(fd, data, offset, **knobs) == size
        assert os.fstat(fd).st_size == offset + size
        _ref_check(path, data, offset)
        data = os.urandom(size)
        _ref_write(path, data, offset)
        buf = bytearray(size)
        assert ctx.pread(fd, buf, offset, **knobs) == size
    finally:
        os.close(fd)
    _assert_same(buf, data)


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


@pytest.mark.parametrize("op", ["read", "write"])
def test_misaligned_offset_is_einval(ctx, tmp_dir, align, op):
    path = tmp_dir / "f.bin"
    data = os.urandom(4 * align)
    _ref_write(path, data)
    mem = _mem(2 * align)
    fd = open_direct(path, write=True)
    try:
        call = ctx.pread if op == "read" else ctx.pwrite
        with pytest.raises(OSError) as ei:
            call(fd, mem, 100, path=path)
    finally:
        os.close(fd)
    exc = ei.value
    assert exc.errno == errno.EINVAL, exc
    assert os.fspath(exc.filename) == str(path)
    assert "file offset 100" in str(exc) and exc.offset == 100
    assert _file_bytes(path) == data


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("what", ["address", "size"])
def test_misaligned_memory_or_size_is_einval(ctx, tmp_dir, align, op, what):
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
        call = ctx.pread if op == "read" else ctx.pwrite
        with pytest.raises(OSError) as ei:
            call(fd, addr, align, nbytes, path=path)
    finally:
        os.close(fd)
    assert ei.value.errno == errno.EINVAL
    assert f"file offset {align}" in str(ei.value)
    assert _file_bytes(path) == data


def test_bad_fd_is_ebadf(ctx, tmp_dir):
    path = tmp_dir / "f.bin"
    _ref_write(path, os.urandom(8192))
    buf = bytearray(4096)
    wfd = os.open(path, os.O_WRONLY)
    rfd = os.open(path, os.O_RDONLY)
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)
    try:
        for call, fd in ((ctx.pread, wfd), (ctx.pwrite, rfd), (ctx.pread, closed)):
            with pytest.raises(OSError) as ei:
                call(fd, buf, path=path)
            assert ei.value.errno == errno.EBADF
        assert ctx.pread(rfd, buf) == len(buf)                   # still usable
    finally:
        os.close(wfd)
        os.close(rfd)


@pytest.mark.parametrize("queue_depth", [1, 32])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_read_past_eof(ctx, tmp_dir, queue_depth, direct):
    # the file ends 100 bytes into a block: the last piece is short, its remainder hits EOF
    path = tmp_dir / "f.bin"
    data = os.urandom(MiB + 100)
    _ref_write(path, data)
    mem = _mem(2 * MiB)
    _fill(mem)
    fd = open_direct(path) if direct else os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ShortReadError) as ei:
            ctx.pread(fd, mem, block_size=256 * KiB, queue_depth=queue_depth, path=path)
        exc = ei.value
        assert isinstance(exc, EOFError) and isinstance(exc, AioswapError)
        assert (exc.path, exc.offset, exc.nbytes, exc.file_size) == (str(path), 0, 2 * MiB,
                                                                      len(data))
        assert str(path) in str(exc)
        _assert_same(memoryview(mem)[:len(data)], data, "bytes before EOF")

        with pytest.raises(ShortReadError) as ei:                # wholly past the end
            ctx.pread(fd, mem, 4 * MiB, 4096, path=path)
        assert ei.value.offset == 4 * MiB
        assert ctx.pread(fd, mem, 0, MiB) == MiB                 # context still usable
    finally:
        os.close(fd)


RLIMIT_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    from aioswap._aio import AioContext, LockedMemory, open_direct
    ref, target, limit, ss, ov = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
        sys.argv[4] == "1", sys.argv[5] == "1"
    with open(ref, "rb") as f:
        data = f.read()
    mem = LockedMemory(len(data), lock=False)
    memoryview(mem)[:] = data
    fd = open_direct(target, write=True, create=True, truncate=True)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # else the kernel kills us instead of EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    with AioContext(16) as ctx:
        try:
            n = ctx.pwrite(fd, mem, block_size=64 << 10, queue_depth=4, single_submit=ss,
                           overlap_events=ov, path=target)
        except OSError as exc:
            out = {"errno": exc.errno, "msg": str(exc), "filename": exc.filename,
                   "offset": getattr(exc, "offset", None)}
        else:
            out = {"written": n}
        # the context survives a failed request
        ctx.pwrite(fd, mem, 0, 4096)
    print(json.dumps(out))
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
    assert out.get("errno") == errno.EFBIG, out
    assert out["filename"] == str(target)
    assert limit <= out["offset"] < len(data), out
    assert re.search(r"file offset \d+", out["msg"]), out
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


def test_signals_during_long_read(ctx, long_file):
    path, data = long_file
    mem = _mem(len(data))
    _fill(mem)
    calls = []
    fd = open_direct(path)
    try:
        n = _with_timer(lambda signum, frame: calls.append(signum), 0.002,
                        lambda: ctx.pread(fd, mem, block_size=64 * KiB, queue_depth=1,
                                          path=path))
    finally:
        os.close(fd)
    assert n == len(data)
    assert len(calls) >= 1
    _assert_same(mem, data, "read interrupted by signals")


def test_signals_during_long_write(ctx, tmp_dir):
    path = tmp_dir / "w.bin"
    data = os.urandom(128 * MiB)
    mem = _mem(len(data))
    _load(mem, data)
    calls = []
    fd = open_direct(path, write=True, create=True)
    try:
        n = _with_timer(lambda signum, frame: calls.append(signum), 0.002,
                        lambda: ctx.pwrite(fd, mem, block_size=64 * KiB, queue_depth=1,
                                           path=path))
    finally:
        os.close(fd)
    assert n == len(data) and len(calls) >= 1
    _ref_check(path, data)
    path.unlink()


def test_signal_handler_exception_propagates(ctx, long_file):
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
        with pytest.raises(_Interrupt):
            _with_timer(handler, 0.01,
                        lambda: ctx.pread(fd, mem, block_size=16 * KiB, queue_depth=1,
                                          path=path))
        assert len(calls) >= 1
        # the transfer stopped early (the last MiB was never read) ...
        assert memoryview(mem)[-MiB:].tobytes() == b"\xa5" * MiB
        # ... and the context is still usable
        _fill(mem)
        assert ctx.pread(fd, mem, 0, 8 * MiB, block_size=MiB) == 8 * MiB
        _assert_same(memoryview(mem)[:8 * MiB], data[:8 * MiB])
    finally:
        os.close(fd)
    assert not ctx.closed


def test_single_signal_handled_during_transfer(ctx, long_file):
    # one SIGALRM (think Ctrl-C) early in a long transfer must stop it early
    path, data = long_file
    nbytes = 64 * MiB
    mem = _mem(nbytes)

    def handler(signum, frame):
        raise _Interrupt("one signal")

    fd = open_direct(path)
    old = signal.signal(signal.SIGALRM, handler)
    try:
        for trial in range(5):
            _fill(mem)
            signal.setitimer(signal.ITIMER_REAL, 0.005 + 0.002 * trial)
            raised = False
            try:
                ctx.pread(fd, mem, 0, nbytes, block_size=16 * KiB, queue_depth=1)
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


def test_contexts_in_threads(tmp_dir, align):
    # one context per thread, all on one file at once, each on its own region
    path = tmp_dir / "t.bin"
    region = 4 * MiB
    datas = [os.urandom(region) for _ in range(4)]
    errors = []

    def work(i):
        try:
            mem = _mem(region)
            _load(mem, datas[i])
            with AioContext(16) as c:
                fd = open_direct(path, write=True, create=True)
                try:
                    for _ in range(3):
                        c.pwrite(fd, mem, i * region, block_size=64 * KiB, queue_depth=8)
                        _fill(mem)
                        c.pread(fd, mem, i * region, block_size=256 * KiB, queue_depth=4)
                        assert memoryview(mem).tobytes() == datas[i]
                finally:
                    os.close(fd)
        except BaseException as exc:                     # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _ref_check(path, b"".join(datas))


@pytest.mark.parametrize("op", ["read", "write"])
def test_gil_released_during_transfer(ctx, tmp_dir, long_file, op):
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
            call = ctx.pread if op == "read" else ctx.pwrite
            c0, t0 = counter[0], time.perf_counter()
            call(fd, mem, block_size=64 * KiB, queue_depth=1, path=path)
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
    """AIO contexts of this process: each maps its ring as '/[aio] (deleted)'."""
    with open("/proc/self/maps") as f:
        return sum("[aio]" in line for line in f)


def _aio_nr() -> int:
    with open("/proc/sys/fs/aio-nr") as f:
        return int(f.read())


def _aio_nr_back_to(baseline: int, timeout: float = 10.0) -> int:
    # fs.aio-nr is system-wide: wait out other processes' (e.g. parallel tests') contexts
    deadline = time.monotonic() + timeout
    while (now := _aio_nr()) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_no_leaks_after_10000_operations(tmp_dir, align):
    path = tmp_dir / "f.bin"
    data = os.urandom(MiB)
    _ref_write(path, data)
    mem = _mem(64 * KiB)
    gc.collect()
    fds, rings, nr = _open_fds(), _aio_rings(), _aio_nr()

    with AioContext(32) as ctx:
        assert _aio_rings() == rings + 1
        fd = open_direct(path, write=True)
        try:
            a = mem.address
            for i in range(10_000):
                kind, off = i % 10, (i * align) % (MiB - 8 * KiB)
                if kind < 3:
                    ctx.pwrite(fd, mem, off, 4 * KiB, block_size=align)
                elif kind < 6:
                    ctx.pread(fd, mem, off, 8 * KiB, queue_depth=2)
                elif kind == 6:
                    ctx.preadv(fd, [(a, align, off), (a + 4 * KiB, align, 0)])
                elif kind == 7:
                    with pytest.raises(OSError):
                        ctx.pread(fd, mem, off + 1, 4 * KiB)             # EINVAL
                elif kind == 8:
                    with pytest.raises(ShortReadError):
                        ctx.pread(fd, mem, MiB - align, 2 * align)
                else:
                    with pytest.raises(ValueError):
                        ctx.pwrite(fd, mem, -1)
                    os.close(open_direct(path))
                    with pytest.raises(FileNotFoundError):
                        open_direct(tmp_dir / "missing")
        finally:
            os.close(fd)
    assert ctx.closed
    gc.collect()
    assert _open_fds() == fds
    assert _aio_rings() == rings
    assert _aio_nr_back_to(nr) <= nr


@pytest.mark.slow
def test_no_leaks_after_many_contexts():
    gc.collect()
    fds, rings, nr = _open_fds(), _aio_rings(), _aio_nr()
    errors = []

    def churn(n):
        try:
            for i in range(n):
                if i % 2:
                    AioContext(32).close()               # created and closed
                else:
                    AioContext(32)                       # dropped without close
        except BaseException as exc:                     # pragma: no cover - reported below
            errors.append(exc)

    # io_destroy waits for an RCU grace period (~tens of ms), with the GIL released:
    # threads overlap those waits; 2,000 contexts in all
    threads = [threading.Thread(target=churn, args=(125,)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for _ in range(20):                                  # in reference cycles: freed by gc
        cycle = [AioContext(8)]
        cycle.append(cycle)
        del cycle
    gc.collect()
    assert _open_fds() == fds
    assert _aio_rings() == rings
    assert _aio_nr_back_to(nr) <= nr


def test_close_twice_and_closed_context(tmp_dir):
    path = tmp_dir / "f.bin"
    data = os.urandom(8192)
    _ref_write(path, data)
    ctx = AioContext(4)
    assert not ctx.closed and ctx.depth == 4 and "depth=4" in repr(ctx)
    ctx.close()
    ctx.close()
    assert ctx.closed and "closed" in repr(ctx)
    with AioContext(2) as c2:
        pass
    c2.close()
    assert c2.closed
    buf = bytearray(4096)
    fd = os.open(path, os.O_RDWR)
    try:
        for call in (lambda: ctx.pread(fd, buf), lambda: ctx.pwrite(fd, b"y" * 4096),
                     lambda: ctx.preadv(fd, [(1, 1, 0)]),
                     lambda: ctx.pwritev(fd, [(1, 1, 0)]),
                     lambda: ctx.__enter__()):
            with pytest.raises(HandleClosedError):
                call()
    finally:
        os.close(fd)
    assert buf == bytearray(4096) and _file_bytes(path) == data
    assert issubclass(HandleClosedError, ValueError)


def test_bad_depth():
    for depth in (0, -1, _aio.MAX_DEPTH + 1):
        with pytest.raises(ValueError):
            AioContext(depth)


def test_busy_context_refuses_close_and_second_transfer(tmp_dir):
    # an AIO read of a pipe blocks inside io_submit until data arrives: a transfer that is
    # in flight for as long as the test wants
    r, w = os.pipe()
    ctx = AioContext(4)
    result = []

    def reader():
        while True:                           # the main thread may hold the context briefly
            try:
                result.append(ctx.pread(r, bytearray(10), block_size=10))
                return
            except RuntimeError:
                time.sleep(0.001)

    t = threading.Thread(target=reader)
    try:
        path = tmp_dir / "f.bin"
        _ref_write(path, os.urandom(4096))
        fd = os.open(path, os.O_RDONLY)
        t.start()
        deadline = time.monotonic() + 10
        try:
            while True:                       # wait until the thread holds the context
                try:
                    ctx.pread(fd, bytearray(4096))
                except RuntimeError as exc:
                    assert "another transfer" in str(exc)
                    break
                assert time.monotonic() < deadline, "the thread never started its read"
                time.sleep(0.01)
            with pytest.raises(RuntimeError, match="while a transfer is running"):
                ctx.close()
            assert not ctx.closed
        finally:
            os.close(fd)
        os.write(w, b"0123456789")
        t.join(10)
        assert result == [10]
    finally:
        os.close(r)
        os.close(w)
        ctx.close()


# --------------------------------------------------------------------------- bad input

def _strided(mem):
    return np.zeros(len(mem), np.uint8)[::2]


# (id, exception, call(ctx, fd, mem)); mem is 16 KiB of aligned memory, fd an O_DIRECT file
BAD_INPUTS = [
    ("read-negative-offset", ValueError, lambda c, fd, m: c.pread(fd, m, -4096)),
    ("write-negative-offset", ValueError, lambda c, fd, m: c.pwrite(fd, m, -4096)),
    ("read-negative-nbytes", ValueError, lambda c, fd, m: c.pread(fd, m, 0, -1)),
    ("write-negative-nbytes", ValueError, lambda c, fd, m: c.pwrite(fd, m, 0, -4096)),
    ("addr-negative-nbytes", ValueError, lambda c, fd, m: c.pread(fd, m.address, 0, -4096)),
    ("addr-without-nbytes", TypeError, lambda c, fd, m: c.pread(fd, m.address)),
    ("addr-zero", ValueError, lambda c, fd, m: c.pwrite(fd, 0, 0, 4096)),
    ("read-into-bytes", BufferError, lambda c, fd, m: c.pread(fd, bytes(len(m)))),
    ("read-into-readonly-view", BufferError,
     lambda c, fd, m: c.pread(fd, memoryview(bytearray(len(m))).toreadonly())),
    ("read-into-strided-view", BufferError,
     lambda c, fd, m: c.pread(fd, memoryview(bytearray(2 * len(m)))[::2])),
    ("write-strided-view", BufferError,
     lambda c, fd, m: c.pwrite(fd, memoryview(bytearray(2 * len(m)))[::2])),
    ("read-into-noncontiguous-numpy", BufferError, lambda c, fd, m: c.pread(fd, _strided(m))),
    ("write-noncontiguous-numpy", BufferError, lambda c, fd, m: c.pwrite(fd, _strided(m))),
    ("read-into-readonly-numpy", BufferError,
     lambda c, fd, m: c.pread(fd, np.frombuffer(bytes(len(m)), np.uint8))),
    ("read-nbytes-over-buffer", ValueError, lambda c, fd, m: c.pread(fd, m, 0, len(m) + 4096)),
    ("write-nbytes-over-buffer", ValueError,
     lambda c, fd, m: c.pwrite(fd, m, 0, len(m) + 4096)),
    ("queue-depth-over-depth", ValueError, lambda c, fd, m: c.pwrite(fd, m, queue_depth=9)),
    ("queue-depth-zero", ValueError, lambda c, fd, m: c.pread(fd, m, queue_depth=0)),
    ("block-size-zero", ValueError, lambda c, fd, m: c.pwrite(fd, m, block_size=0)),
    ("block-size-negative", ValueError, lambda c, fd, m: c.pread(fd, m, block_size=-4096)),
    ("negative-fd", ValueError, lambda c, fd, m: c.pwrite(-1, m)),
    # vectored: a bad segment after a good one: nothing at all is submitted
    ("readv-negative-offset", ValueError,
     lambda c, fd, m: c.preadv(fd, [(m.address, 4096, 0), (m.address + 4096, 4096, -4096)])),
    ("writev-negative-nbytes", ValueError,
     lambda c, fd, m: c.pwritev(fd, [(m.address, 4096, 0), (m.address, -4096, 4096)])),
    ("writev-address-zero", ValueError,
     lambda c, fd, m: c.pwritev(fd, [(m.address, 4096, 0), (0, 4096, 4096)])),
    ("writev-not-triples", ValueError,
     lambda c, fd, m: c.pwritev(fd, [(m.address, 4096, 0), (m.address, 4096)])),
]


@pytest.mark.parametrize("exc_type,call", [
    pytest.param(exc, call, id=name, marks=[])
    for name, exc, call in BAD_INPUTS])
def test_bad_input_raises_before_any_io(tmp_dir, exc_type, call):
    path = tmp_dir / "f.bin"
    data = os.urandom(64 * KiB)
    _ref_write(path, data)
    mem = _mem(16 * KiB)
    _fill(mem)
    fd = open_direct(path, write=True)
    try:
        with AioContext(8) as ctx:
            with pytest.raises(exc_type):
                call(ctx, fd, mem)
            assert memoryview(mem).tobytes() == b"\xa5" * len(mem)     # nothing read
            assert _file_bytes(path) == data                          # nothing written
            assert ctx.pread(fd, mem) == len(mem)                     # still usable
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
