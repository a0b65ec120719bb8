"""Striped files: byte-exact against plain os.pwrite/os.pread, reopening, failing drives."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aioswap
from aioswap.errors import HandleClosedError, ShortReadError
from aioswap.stripe import LAYOUT_SUFFIX, StripedFile, default_stripe, read_layout

UNIT = 8192


def _parts(root: Path, n: int, name: str = "x.bin") -> list[str]:
    out = []
    for i in range(n):
        d = root / f"drive{i}"
        d.mkdir(exist_ok=True)
        out.append(str(d / name))
    return out


def _rand(n: int) -> np.ndarray:
    return np.frombuffer(os.urandom(n), np.uint8).copy()


@pytest.mark.parametrize("nparts", [1, 2, 3, 4])
def test_round_trips_match_a_plain_file(tmp_path: Path, nparts: int) -> None:
    rng = random.Random(nparts)
    ref = os.open(tmp_path / "ref.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with aioswap.AioHandle(block_size=64 << 10) as h, \
                h.open(_parts(tmp_path, nparts), "w+", stripe=UNIT) as f:
            assert isinstance(f, StripedFile)
            for _ in range(40):
                off = rng.randrange(0, 12 * UNIT)
                n = rng.choice([1, 511, 4095, 4096, 4097, UNIT - 1, UNIT, UNIT + 1,
                                3 * UNIT + 17, rng.randrange(1, 7 * UNIT)])
                data = _rand(n)
                kind = rng.randrange(3)
                buf = data if kind == 0 else torch.from_numpy(data.copy()) if kind == 1 \
                    else bytearray(data.tobytes())
                assert f.pwrite(buf, off) == n
                os.pwrite(ref, data.tobytes(), off)
            size = os.fstat(ref).st_size
            assert f.size() == size
            for _ in range(40):
                off = rng.randrange(0, size)
                n = rng.randrange(1, size - off + 1)
                out = np.zeros(n, np.uint8)
                assert f.pread(out, off) == n
                assert out.tobytes() == os.pread(ref, n, off)
            whole = h.new_cpu_locked_tensor(size, torch.uint8)      # pinned: direct path
            assert f.pread(whole, 0) == size
            assert whole.numpy().tobytes() == os.pread(ref, size, 0)
            with pytest.raises(ShortReadError):
                f.pread(np.zeros(2, np.uint8), size - 1)
    finally:
        os.close(ref)


def test_reopen_in_another_order_and_layout_file(tmp_path: Path) -> None:
    parts = _parts(tmp_path, 4)
    data = _rand(13 * UNIT + 123)
    with aioswap.AioHandle() as h:
        with h.open(parts, "w", stripe=UNIT) as f:
            f.pwrite(data, 5)
            ident = f.id
        for order in (parts[::-1], [parts[2], parts[0], parts[3], parts[1]]):
            with h.open(order, "r") as f:
                assert f.paths == tuple(parts)          # layout order, not the given one
                assert f.stripe_unit == UNIT and f.id == ident
                out = np.zeros(data.size, np.uint8)
                f.pread(out, 5)
                assert (out == data).all()
                head = np.ones(5, np.uint8)
                f.pread(head, 0)
                assert not head.any()
                with pytest.raises(PermissionError):
                    f.pwrite(data[:1], 0)
        with pytest.raises(ValueError, match="stripe unit"):
            h.open(parts, "r", stripe=2 * UNIT)
        with pytest.raises(ValueError, match="parts"):
            h.open(parts[:3], "r")
        other = _parts(tmp_path, 4, "y.bin")
        h.open(other, "w").close()
        with pytest.raises(ValueError, match="another striped file"):
            h.open(parts[:3] + other[3:], "r")
    for i, p in enumerate(parts):
        side = p + LAYOUT_SUFFIX
        assert stat.S_IMODE(os.stat(side).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        doc = json.loads(Path(side).read_text())
        assert doc["part"] == i and doc["format"] == "aioswap.stripe"
        lay = read_layout(p)
        assert lay["size"] == data.size + 5 and len(lay["drives"]) == 14


def test_appends_round_robin_and_holes_read_zero(tmp_path: Path) -> None:
    parts = _parts(tmp_path, 3)
    with aioswap.AioHandle() as h:
        with h.open(parts, "w+", stripe=UNIT) as f:
            for k in range(6):
                f.pwrite(np.full(UNIT, k + 1, np.uint8), k * UNIT)
            f.pwrite(np.full(10, 9, np.uint8), 20 * UNIT + 3)      # units 6..19 are holes
            out = np.ones(f.size(), np.uint8)
            f.pread(out, 0)
        lay = read_layout(parts[0])
        assert lay["drives"][:6] == [0, 1, 2, 0, 1, 2]
        assert lay["drives"][6:20] == [255] * 14
        assert [int(x) for x in out[:6 * UNIT:UNIT]] == [1, 2, 3, 4, 5, 6]
        assert not out[6 * UNIT:20 * UNIT + 3].any() and (out[-10:] == 9).all()
        with h.open(parts, "r+") as f:        # a write into a hole allocates it
            f.pwrite(np.full(3, 7, np.uint8), 10 * UNIT + 1)
            back = np.zeros(5, np.uint8)
            f.pread(back, 10 * UNIT)
            assert back.tolist() == [0, 7, 7, 7, 0]


def test_views_async_and_wait(tmp_path: Path) -> None:
    with aioswap.AioHandle() as h, h.open(_parts(tmp_path, 3), "w+", stripe=UNIT) as f:
        src = torch.randn(300, 70)
        col = src[:, 3]                                  # strided
        f.pwrite(col, 100)
        out = torch.zeros(600, 7)[::2, 2]                # strided destination
        f.pread(out, 100)
        assert torch.equal(out, col)
        big = torch.randn(50_000)
        futs = [f.pwrite(big[i * 5000:(i + 1) * 5000], 4096 + i * 20_000, async_op=True)
                for i in range(10)]
        assert f.wait() == 10
        assert all(fu.result() == 20_000 for fu in futs)
        back = torch.empty(50_000)
        fut = f.pread(back, 4096, async_op=True)
        assert isinstance(fut, aioswap.IOFuture) and fut.result() == 200_000
        assert torch.equal(back, big)
        f.fsync()


@pytest.mark.alone      # timing: a drive 50 ms slower takes few units (busy CPUs blur it)
def test_dynamic_units_follow_the_free_drive(tmp_path: Path) -> None:
    """Units of one write go to whichever drive finishes first; the map records it, so a
    reopened file reads them back even when the slots are not the round-robin ones."""
    parts = _parts(tmp_path, 2)
    data = _rand(64 * UNIT)
    with aioswap.AioHandle() as h:
        with h.open(parts, "w+", stripe=UNIT) as f:
            slow = f.handles[0]
            # the first part's drive finishes each unit 50 ms late (the parts, on one disk
            # here, are told they are separate drives: the file would rightly time them as
            # one, as parts on one device are)
            _slow_drive(f, 0, 0.05)
            f.pwrite(data, 0)
            assert slow is f.handles[0]
        lay = read_layout(parts[0])
        assert lay["drives"].count(1) > 2 * lay["drives"].count(0)
        assert lay["slots"] is None             # one writer: slots in unit order
        with h.open(parts[::-1], "r") as f:
            out = np.zeros(data.size, np.uint8)
            f.pread(out, 0)
            assert (out == data).all()


def _slow_drive(f: StripedFile, part: int, delay: float) -> None:
    """Part ``part``'s writes finish ``delay`` seconds late (a drive at a fraction of the
    speed of the others; the parts, on one disk in tests, are made separate drives)."""
    f._peers = [[i] for i in range(len(f.paths))]
    f._files[part] = _Late(f._files[part], delay)        # type: ignore[assignment]


class _Late:
    """An AioFile whose writes finish ``delay`` seconds late (everything else is the file's)."""

    def __init__(self, file: aioswap.AioFile, delay: float) -> None:
        self._file = file
        self._delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def pwrite(self, view: Any, off: int, async_op: bool = False) -> aioswap.IOFuture:
        real = self._file.pwrite(view, off, async_op=True)
        assert isinstance(real, aioswap.IOFuture)
        out = aioswap.IOFuture("write", "slow", len(view), off)
        threading.Timer(self._delay, lambda: out.set_result(real.result())).start()
        return out


def test_one_unit_async_requests_are_byte_exact_and_counted(tmp_path: Path) -> None:
    """Asynchronous requests inside one placed unit run as the part's own request (no
    callback): byte-exact at odd offsets and sizes, their futures name the striped file and
    the logical offset, wait() counts them, and close() waits for those nobody waited for."""
    parts = _parts(tmp_path, 3)
    rng = random.Random(3)
    ref = bytearray(_rand(12 * UNIT).tobytes())
    with aioswap.AioHandle() as h:
        f = h.open(parts, "w+", stripe=UNIT)
        f.pwrite(np.frombuffer(bytes(ref), np.uint8), 0)
        writes = []
        third = UNIT // 3
        for slot in rng.sample(range(36), 30):      # in flight together: none overlap
            start = slot // 3 * UNIT + slot % 3 * third
            inner = rng.randrange(third)
            n = rng.randrange(1, third - inner + 1)
            data = _rand(n)
            fut = f.pwrite(data, start + inner, async_op=True)
            assert isinstance(fut, aioswap.IOFuture)
            assert (fut.file, fut.offset, fut.nbytes) == (f.name, start + inner, n)
            writes.append((fut, data, start + inner))
        assert f.wait() == 30
        for fut, data, off in writes:
            assert fut.result() == data.size
            ref[off:off + data.size] = data.tobytes()
        reads = []
        for _ in range(30):
            k = rng.randrange(12)
            inner = rng.randrange(UNIT)
            n = rng.randrange(1, UNIT - inner + 1)
            out = torch.zeros(n, dtype=torch.uint8)
            reads.append((f.pread(out, k * UNIT + inner, async_op=True), out, k * UNIT + inner))
        f.close()                           # waits for them
        for fut, out, off in reads:
            assert fut.done() and fut.result() == out.numel()
            assert out.numpy().tobytes() == bytes(ref[off:off + out.numel()])
        with h.open(parts[::-1], "r") as g:
            back = np.zeros(len(ref), np.uint8)
            g.pread(back, 0)
            assert back.tobytes() == bytes(ref)
        with h.open(parts, "r+") as g:     # one placed piece and a hole: the whole count
            g.pwrite(np.full(10, 7, np.uint8), 13 * UNIT)       # unit 12 stays a hole
            out = torch.ones(UNIT, dtype=torch.uint8)
            fut = g.pread(out, 11 * UNIT + UNIT // 2, async_op=True)
            assert isinstance(fut, aioswap.IOFuture) and fut.result() == UNIT
            assert out[:UNIT // 2].numpy().tobytes() == bytes(ref[-(UNIT // 2):])
            assert not out[UNIT // 2:].any()


def test_fsync_covers_a_write_that_finished_after_an_earlier_fsync(tmp_path: Path) -> None:
    """A write in flight while fsync() runs is not covered by it; the next fsync() after the
    write finished fsyncs its part again (its part is marked written when it ends, too)."""
    parts = _parts(tmp_path, 2)
    with aioswap.AioHandle() as h, h.open(parts, "w+", stripe=UNIT) as f:
        f.pwrite(_rand(4 * UNIT), 0)
        f.fsync()
        synced: list[int] = []
        _slow_drive(f, 0, 0.3)
        f._files = [_Spy(x, synced, i) for i, x in enumerate(f._files)]   # type: ignore[misc]
        k = read_layout(parts[0])["drives"].index(0)        # a unit on part 0
        fut = f.pwrite(_rand(100), k * UNIT + 5, async_op=True)
        f.fsync()                           # runs while the write is in flight
        assert fut.result() == 100
        synced.clear()
        f.fsync()
        assert 0 in synced, synced
        assert f.wait() == 1


class _Spy:
    """A part file that records its fsync calls (everything else is the file's)."""

    def __init__(self, file: Any, log: list[int], i: int) -> None:
        self._file, self._log, self._i = file, log, i

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def fsync(self) -> None:
        self._log.append(self._i)
        self._file.fsync()


def test_threads_mixing_every_route_stay_byte_exact(tmp_path: Path) -> None:
    """8 threads, each on its own region of one striped file (half of it placed, half new):
    sync and asynchronous reads and writes of odd sizes inside a unit, across units and into
    new units, from numpy arrays, tensors (strided too) and bytearrays; every read matches
    what that thread wrote, and the file matches a plain one afterwards."""
    parts = _parts(tmp_path, 3)
    region = 6 * UNIT
    ref = bytearray(_rand(8 * region).tobytes())
    errors: list[BaseException] = []
    with aioswap.AioHandle() as h, h.open(parts, "w+", stripe=UNIT) as f:
        f.pwrite(np.frombuffer(bytes(ref[:4 * region]), np.uint8), 0)   # threads 0-3: placed

        def work(t: int) -> None:
            rng = random.Random(t)
            base = t * region
            mine = bytearray(ref[base:base + region]) if t < 4 else bytearray(region)
            try:
                if t >= 4:                  # new units first, from this thread
                    f.pwrite(np.frombuffer(bytes(mine), np.uint8), base)
                for _ in range(60):
                    off = rng.randrange(region - 1)
                    n = rng.choice([1, 7, 511, 4096, 4099, UNIT - off % UNIT,
                                    rng.randrange(1, region - off + 1)])
                    n = min(n, region - off)
                    kind = rng.randrange(3)
                    if rng.random() < 0.5:
                        data = _rand(n)
                        buf: Any = data if kind == 0 else torch.from_numpy(data.copy()) \
                            if kind == 1 else bytearray(data.tobytes())
                        if rng.random() < 0.5:
                            fut = f.pwrite(buf, base + off, async_op=True)
                            assert isinstance(fut, aioswap.IOFuture) and fut.result() == n
                        else:
                            assert f.pwrite(buf, base + off) == n
                        mine[off:off + n] = data.tobytes()
                    else:
                        if kind == 1:       # a strided destination
                            out = torch.zeros(2 * n, dtype=torch.uint8)[::2]
                        else:
                            out = torch.zeros(n, dtype=torch.uint8)
                        if rng.random() < 0.5:
                            fut = f.pread(out, base + off, async_op=True)
                            assert isinstance(fut, aioswap.IOFuture) and fut.result() == n
                        else:
                            assert f.pread(out, base + off) == n
                        assert out.numpy().tobytes() == bytes(mine[off:off + n]), (t, off, n)
                ref[base:base + region] = mine
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors[0]
        f.wait()
    with aioswap.AioHandle() as h, h.open(parts[::-1], "r") as g:
        back = np.zeros(len(ref), np.uint8)
        g.pread(back, 0)
        assert back.tobytes() == bytes(ref)


class _Gate:
    """A part file whose asynchronous reads are sent only once ``go`` is set."""

    def __init__(self, file: Any, go: threading.Event, entered: threading.Event) -> None:
        self._file, self._go, self._entered = file, go, entered

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def pread(self, view: Any, off: int, async_op: bool = False) -> Any:
        if async_op:
            self._entered.set()
            self._go.wait()
        return self._file.pread(view, off, async_op=async_op)


def test_wait_settles_a_request_sent_while_it_waits(tmp_path: Path) -> None:
    """wait() from one thread while another thread is sending a one-unit request (counted,
    not yet queued): wait() returns once that request is done, it does not hang."""
    parts = _parts(tmp_path, 2)
    data = _rand(4 * UNIT)
    with aioswap.AioHandle() as h, h.open(parts, "w+", stripe=UNIT) as f:
        f.pwrite(data, 0)
        go, entered = threading.Event(), threading.Event()
        f._files = [_Gate(x, go, entered) for x in f._files]     # type: ignore[misc]
        out = np.zeros(100, np.uint8)
        futs: list[Any] = []
        sender = threading.Thread(target=lambda: futs.append(f.pread(out, UNIT + 3,
                                                                     async_op=True)))
        sender.start()
        assert entered.wait(10)
        counts: list[int] = []
        waiter = threading.Thread(target=lambda: counts.append(f.wait()))
        waiter.start()
        time.sleep(0.2)                 # the waiter found nothing to settle and sleeps
        go.set()
        sender.join(10)
        waiter.join(10)
        hung = waiter.is_alive()
        if hung:
            futs[0].result()
            f._quiesce()                # let the test end; the assertion below fails
        assert not hung, "wait() missed a request sent while it waited"
        assert counts == [1] and futs[0].result() == 100
        assert (out == data[UNIT + 3:UNIT + 103]).all()


def test_units_are_dealt_in_proportion_to_speed_in_every_run(tmp_path: Path) -> None:
    """The dispatcher deals new units by smooth weighted round-robin: equal drives strictly
    in turn, and a drive at half speed every other turn, in every run of units (reads of a
    run then wait on no drive more than its share)."""
    parts = _parts(tmp_path, 4)
    with aioswap.AioHandle() as h, h.open(parts, "w+", stripe=UNIT) as f:
        f._peers = [[i] for i in range(4)]     # four drives (one disk in tests)
        f._acc_b = [1e9] * 4                    # busy seconds over bytes: the speed
        f._acc_t = [1.0, 1.0, 1.0, 1.0]
        assert [f._choose(k) for k in range(12)] == [k % 4 for k in range(12)]
        f._acc_t = [1.0, 1.0, 2.0, 1.0]         # part 2 at half speed: weights 8, 8, 4, 8
        f._acc_n = [5.0] * 4
        assert f._weights() == [8] * 4          # ... once ~6 pieces of each have ended
        f._acc_n = [6.0] * 4
        assert f._weights() == [8, 8, 4, 8]
        f._credit = [0, 0, 0, 0]
        seq = [f._choose(k) for k in range(28 * 4)]
        for start in range(0, len(seq), 28):
            run = seq[start:start + 28]
            assert [run.count(d) for d in range(4)] == [8, 8, 4, 8], run
        for start in range(len(seq) - 7):       # any 7 consecutive: 2 of each fast drive
            run = seq[start:start + 7]
            assert all(abs(run.count(d) - 2) <= 1 for d in (0, 1, 3)) and \
                run.count(2) <= 2, run
        f._credit = [0, 10, 0, 0]               # part 1's turn, but it is full:
        f._busy = [1, f._window, 1, 1]
        assert f._choose(1) == -1 and f._credit == [0, 10, 0, 0]   # the unit waits
        f._busy = [0, f._window, 0, 0]          # ... unless a drive is idle: the idle one
        assert f._choose(1) == 3                # with the most credit (ties: from unit k)
        assert f._credit == [8, 18, 4, 8 - 28]
        f._busy = [0, 0, 0, 0]


def test_parts_on_one_device_share_units_evenly(tmp_path: Path) -> None:
    """Parts on one device are one drive to the dispatcher: a large write spreads its units
    evenly over them (timed apart, one part of four took 40% of them), byte-exact back."""
    parts = _parts(tmp_path, 4)
    data = _rand(256 * UNIT + 17)
    with aioswap.AioHandle() as h:
        with h.open(parts, "w+", stripe=UNIT) as f:
            assert f._peers == [[0, 1, 2, 3]] * 4
            f.pwrite(data, 0)
        drives = read_layout(parts[0])["drives"]
        assert sorted(drives.count(d) for d in range(4)) == [64, 64, 64, 65]
        with h.open(parts[::-1], "r") as f:
            out = np.zeros(data.size, np.uint8)
            f.pread(out, 0)
            assert (out == data).all()


@pytest.mark.alone      # timing: a drive 50 ms slower takes few units (busy CPUs blur it)
def test_many_one_unit_requests_favour_the_fast_drives(tmp_path: Path) -> None:
    """Many concurrent one-unit writes: the file's queue hands each new unit to the drive
    free first, so a slow drive takes few units instead of its round-robin share."""
    parts = _parts(tmp_path, 3)
    data = _rand(96 * UNIT)
    with aioswap.AioHandle() as h:
        with h.open(parts, "w+", stripe=UNIT) as f:
            _slow_drive(f, 0, 0.05)
            futs = [f.pwrite(data[k * UNIT:(k + 1) * UNIT], k * UNIT, async_op=True)
                    for k in rng_order(96)]
            assert f.wait() == 96
            assert all(fu.result() == UNIT for fu in futs)
        drives = read_layout(parts[0])["drives"]
        assert len(drives) == 96 and _NONE_UNIT not in drives
        assert drives.count(0) < 96 // 3 // 2, drives          # under half its even share
        with h.open([parts[2], parts[0], parts[1]], "r") as f:
            out = np.zeros(data.size, np.uint8)
            f.pread(out, 0)
            assert (out == data).all()


_NONE_UNIT = 255


def rng_order(n: int) -> list[int]:
    order = list(range(n))
    random.Random(n).shuffle(order)
    return order


def test_layout_saved_lazily(tmp_path: Path) -> None:
    """Plain writes leave the sidecars alone; fsync=True, fsync() and close() save them,
    with only finished units and the data before the layout that points at it."""
    parts = _parts(tmp_path, 3)
    data = _rand(10 * UNIT + 5)
    with aioswap.AioHandle() as h:
        with h.open(parts, "w+", stripe=UNIT) as f:
            before = [Path(p + LAYOUT_SUFFIX).read_bytes() for p in parts]
            for k in range(10):
                f.pwrite(data[k * UNIT:(k + 1) * UNIT], k * UNIT)
            assert [Path(p + LAYOUT_SUFFIX).read_bytes() for p in parts] == before
            out = np.zeros(10 * UNIT, np.uint8)
            f.pread(out, 0)                                 # the live layout serves reads
            assert (out == data[:10 * UNIT]).all()
            f.pwrite(data[10 * UNIT:], 10 * UNIT, fsync=True)
            lays = [read_layout(p) for p in parts]
            assert {lay["generation"] for lay in lays} == {lays[0]["generation"]}
            assert lays[0]["size"] == data.size and len(lays[0]["drives"]) == 11
            gen = lays[0]["generation"]
            f.fsync()                                       # nothing new: no rewrite
            assert read_layout(parts[1])["generation"] == gen
            f.pwrite(data[:UNIT], 20 * UNIT)                # plain again: saved at close
            assert read_layout(parts[2])["size"] == data.size
        assert read_layout(parts[2])["size"] == 21 * UNIT
        with h.open(parts[::-1], "r") as f:
            out = np.zeros(21 * UNIT, np.uint8)
            f.pread(out, 0)
            assert (out[:data.size] == data).all() and (out[20 * UNIT:] == data[:UNIT]).all()
            assert not out[data.size:20 * UNIT].any()


_WRITER = """
import sys, numpy as np, aioswap
parts, unit, chunk = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(7)
with aioswap.AioHandle() as h, h.open(parts, "w+", stripe=unit) as f:
    i = 0
    while True:
        block = rng.integers(0, 256, chunk, dtype=np.uint8)
        durable = i % 3 == 2
        f.pwrite(block, i * chunk, fsync=durable)
        if durable:
            print((i + 1) * chunk, flush=True)
        i += 1
"""


def test_sigkill_during_writes_leaves_a_saved_state_whole(tmp_path: Path) -> None:
    """SIGKILL while a process writes: the reopened file is one saved state (at least the
    last one it reported durable), byte-exact."""
    parts = _parts(tmp_path, 3)
    chunk = 3 * UNIT + 100
    with subprocess.Popen([sys.executable, "-c", _WRITER, ",".join(parts), str(UNIT),
                           str(chunk)], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            durable = [int(proc.stdout.readline()) for _ in range(5)]
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
    rng = np.random.default_rng(7)
    with aioswap.AioHandle() as h, h.open(parts[::-1], "r") as f:
        size = f.size()
        assert size >= durable[-1] and size % (3 * chunk) == 0
        want = np.concatenate([rng.integers(0, 256, chunk, dtype=np.uint8)
                               for _ in range(size // chunk)])
        out = np.zeros(size, np.uint8)
        f.pread(out, 0)
        assert (out == want).all()


def test_a_bad_part_fails_only_its_requests(tmp_path: Path) -> None:
    parts = _parts(tmp_path, 3)
    data = _rand(12 * UNIT)
    with aioswap.AioHandle() as h, h.open(parts, "w+", stripe=UNIT) as f:
        f.pwrite(data, 0, fsync=True)                   # the layout is saved now
        os.truncate(parts[1], 0)                        # the drive lost its data
        with pytest.raises(ShortReadError, match=str(parts[1])):
            f.pread(np.zeros(data.size, np.uint8), 0)
        drives = read_layout(parts[0])["drives"]
        assert drives.count(1) > 0 and len(drives) == 12
        for k, d in enumerate(drives):
            out = np.zeros(UNIT, np.uint8)
            if d == 1:
                with pytest.raises(ShortReadError, match=str(parts[1])):
                    f.pread(out, k * UNIT)
            else:
                f.pread(out, k * UNIT)
                assert (out == data[k * UNIT:(k + 1) * UNIT]).all()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_releases_fds_and_threads(tmp_path: Path) -> None:
    h = aioswap.AioHandle()
    try:
        h.open(_parts(tmp_path, 2), "w").close()    # warm up
        fds, threads = _fds(), threading.active_count()
        for _ in range(3):
            with h.open(_parts(tmp_path, 3), "w+", stripe=UNIT) as f:
                f.pwrite(_rand(5 * UNIT), 0, async_op=True)
            assert f.closed
            with pytest.raises(ValueError, match="closed"):
                f.pread(np.zeros(1, np.uint8), 0)
        assert _fds() == fds
        assert threading.active_count() <= threads
        f = h.open(_parts(tmp_path, 2, "z.bin"), "a+")
    finally:
        h.close()
    with pytest.raises(HandleClosedError):
        f.pwrite(b"x", 0)
    f.close()
    assert default_stripe(h) >= h.block_size


def test_bad_arguments(tmp_path: Path) -> None:
    with aioswap.AioHandle() as h:
        with pytest.raises(ValueError, match="stripe"):
            h.open(_parts(tmp_path, 2), "w", stripe=1000)
        with pytest.raises(ValueError, match="distinct"):
            h.open([str(tmp_path / "a"), str(tmp_path / "a")], "w")
        with pytest.raises(FileNotFoundError):
            h.open(_parts(tmp_path, 2, "none.bin"), "r")
        with pytest.raises(ValueError, match="mode"):
            h.open(_parts(tmp_path, 2), "rw")


# -- a drive that fails mid-read (root: ext4 on a loop device, then EXT4_IOC_SHUTDOWN) --------
_EXT4_IOC_SHUTDOWN = 0x8004587D          # _IOR('X', 125, __u32)
_NOLOGFLUSH = 2


def _root_loops() -> str | None:
    if os.geteuid() != 0:
        return "needs root (loop devices, mount)"
    for tool in ("losetup", "mkfs.ext4", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@pytest.mark.skipif(_root_loops() is not None, reason=str(_root_loops()))
def test_a_failing_drive_fails_only_its_requests(tmp_path: Path) -> None:
    img = tmp_path / "drive.img"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as fh:
        fh.truncate(64 << 20)
    loop = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(img)],
                          capture_output=True, text=True, check=True).stdout.strip()
    mounted = False
    try:
        subprocess.run(["mkfs.ext4", "-q", loop], check=True, capture_output=True)
        subprocess.run(["mount", loop, str(mnt)], check=True, capture_output=True)
        mounted = True
        parts = _parts(tmp_path, 2) + [str(mnt / "x.bin")]
        data = _rand(24 * UNIT)
        with aioswap.AioHandle() as h, h.open(parts, "w+", stripe=UNIT) as f:
            f.pwrite(data, 0)
            f.fsync()                                   # the layout is saved now
            drives = read_layout(parts[0])["drives"]
            on_bad = [k for k, d in enumerate(drives) if d == 2]
            fine = [k for k, d in enumerate(drives) if d != 2]
            assert on_bad and fine
            fd = os.open(mnt, os.O_RDONLY)
            try:
                fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _NOLOGFLUSH))
            finally:
                os.close(fd)
            outs = {k: np.zeros(UNIT, np.uint8) for k in range(len(drives))}
            futs = {k: f.pread(outs[k], k * UNIT, async_op=True) for k in outs}
            for k in fine:
                assert futs[k].result() == UNIT
                assert (outs[k] == data[k * UNIT:(k + 1) * UNIT]).all()
            for k in on_bad:
                exc = futs[k].exception()
                assert isinstance(exc, OSError) and exc.errno == errno.EIO
                assert parts[2] in str(exc)
            with pytest.raises(OSError, match=parts[2]):
                f.pread(np.zeros(data.size, np.uint8), 0)
            with pytest.raises(OSError):
                f.wait()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        subprocess.run(["losetup", "-d", loop], capture_output=True)
