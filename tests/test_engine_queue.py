"""Issue 10 (one queue per handle, open files, batches) against the shared-queue engine.

Byte-exact against ``os.pread``/``os.pwrite`` on random data: many threads x many small
async requests on one handle, mixed sizes in one batch, per-request errors, ``wait()``
semantics, :class:`AioFile`, fd lifetime, the buffered fallback, the small-I/O benchmark's
smoke run, and a grid of sizes x offsets x memory kinds on every sync/async path.
"""
from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aioswap
from aioswap import pinned
from aioswap.errors import DirectIOFallbackWarning, HandleClosedError, ShortReadError

KiB = 1 << 10
MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def backend(engine_backend: str) -> str:
    """Every test of this suite runs on each engine backend (subprocesses inherit it)."""
    return engine_backend


def _rand(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _write(path: Path, data: bytes) -> Path:
    with open(path, "wb") as f:
        f.write(data)
    return path


def _file_bytes(path: Path | str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _os_pread(path: Path | str, n: int, off: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def _result(r: Any) -> int:
    return r if isinstance(r, int) else r.result(timeout=60)


# ------------------------------------------------------------------ many threads, one handle
def test_many_threads_many_small_async_reads(tmp_path: Path) -> None:
    """8 threads x 500 async reads of 4..64 KiB at random offsets on one handle."""
    size = 16 * MiB
    data = _rand(size, 100)
    path = _write(tmp_path / "src.bin", data)
    nthreads, per = 8, 500
    errors: list[BaseException] = []
    checks: list[tuple[Any, int, int, int]] = []       # (buffer, start, offset, n)
    lock = threading.Lock()
    barrier = threading.Barrier(nthreads, timeout=120)
    with aioswap.AioHandle(queue_depth=32, block_size=256 * KiB) as h, \
            h.open(path, "r") as f:

        def worker(k: int) -> None:
            rng = random.Random(k)
            sizes = [rng.randrange(4 * KiB, 64 * KiB + 1) for _ in range(per)]
            # even threads: aioswap's memory at 4 KiB-aligned slots (direct when aligned,
            # locked or not: unlocked as a normal user); odd threads: the caller's (bounce)
            stride = 64 * KiB
            if k % 2 == 0:
                buf = pinned.empty(per * stride, torch.uint8, strict=False)
            else:
                buf = torch.empty(per * stride, dtype=torch.uint8)
            mine = []
            try:
                barrier.wait()
                futs = []
                for i, n in enumerate(sizes):
                    off = rng.randrange(0, size - n + 1)
                    if rng.random() < 0.5:
                        off -= off % 4096
                    target: Any = f if i % 3 else path       # open file and path both
                    futs.append(h.pread(buf[i * stride:i * stride + n], target, off,
                                        async_op=True))
                    mine.append((buf, i * stride, off, n))
                for fut, (_, _, _, n) in zip(futs, mine):
                    assert fut.result(timeout=120) == n
            except BaseException as exc:
                errors.append(exc)
            with lock:
                checks.extend(mine)

        ts = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(nthreads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        assert not any(t.is_alive() for t in ts), "a thread hung"
        assert not errors, [repr(e) for e in errors[:3]]
        h.wait()
        assert h.stats.bounce_bytes > 0
        assert h.stats.direct_bytes > 0, h.stats
    assert len(checks) == nthreads * per
    for buf, start, off, n in checks:
        got = bytes(buf[start:start + n].numpy())
        assert got == data[off:off + n], (start, off, n)


# ------------------------------------------------------------------ mixed sizes in one batch
def _mixed(rng: random.Random, count: int, file_size: int) -> list[tuple[Any, int, int]]:
    """(buffer, offset, n) of mixed kinds: 1 byte .. 3 MiB, odd offsets."""
    sizes = [1, 3, 511, 4095, 4096, 4097, 65537, MiB + 3, 3 * MiB]
    out = []
    for i in range(count):
        n = sizes[i % len(sizes)] if i < len(sizes) else rng.randrange(1, 3 * MiB + 1)
        off = rng.randrange(0, file_size - n)
        if i % 4 == 0:
            off |= 1
        kind = i % 5
        buf: Any
        if kind == 0:
            buf = pinned.empty(n + 8192, torch.uint8, strict=False)[4096:4096 + n]
        elif kind == 1:
            buf = pinned.empty(n + 1, torch.uint8, strict=False)[1:]     # misaligned pinned
        elif kind == 2:
            buf = torch.empty(n, dtype=torch.uint8)
        elif kind == 3:
            buf = np.empty(n, dtype=np.uint8)
        else:
            buf = bytearray(n)
        out.append((buf, off, n))
    return out


def _as_bytes(buf: Any) -> bytes:
    if isinstance(buf, torch.Tensor):
        return bytes(buf.numpy())
    return bytes(memoryview(buf))


def _fill(buf: Any, data: bytes) -> None:
    memoryview(buf.numpy() if isinstance(buf, torch.Tensor) else buf).cast("B")[:] = data


@pytest.mark.parametrize("how", ["many", "many_async", "async_wait"])
def test_mixed_batch_reads(tmp_path: Path, how: str) -> None:
    size = 24 * MiB
    data = _rand(size, 200)
    path = _write(tmp_path / "src.bin", data)
    reqs = _mixed(random.Random(how), 40, size)
    with aioswap.AioHandle(block_size=MiB, queue_depth=16) as h:
        if how == "many":
            res = h.pread_many([(b, path, off) for b, off, _ in reqs])
        elif how == "many_async":
            futs = h.pread_many([(b, path, off) for b, off, _ in reqs], async_op=True)
            assert h.wait() == len(reqs)
            res = [f.result() for f in futs]
        else:
            futs = [h.pread(b, path, off, async_op=True) for b, off, _ in reqs]
            assert h.wait() == len(reqs)
            res = [f.result() for f in futs]
        assert h.wait() == 0
    assert res == [n for _, _, n in reqs]
    for b, off, n in reqs:
        assert _as_bytes(b) == data[off:off + n], (type(b), off, n)


@pytest.mark.parametrize("how", ["many", "async_wait"])
def test_mixed_batch_writes(tmp_path: Path, how: str) -> None:
    """Mixed writes into one file at disjoint ranges in one batch; the rest untouched."""
    size = 40 * MiB
    old = _rand(size, 300)
    path = _write(tmp_path / "dst.bin", old)
    rng = random.Random(how)
    reqs = _mixed(rng, 14, size)
    # disjoint, odd file ranges laid out one after another with gaps
    expected = bytearray(old)
    pos = 7
    items = []
    for k, (b, _, n) in enumerate(reqs):
        payload = _rand(n, 1000 + k)
        _fill(b, payload)
        items.append((b, path, pos))
        expected[pos:pos + n] = payload
        pos += n + rng.randrange(1, 9000)
    assert pos < size
    with aioswap.AioHandle(block_size=MiB, queue_depth=16) as h:
        if how == "many":
            res = h.pwrite_many(items)
        else:
            futs = [h.pwrite(b, p, off, async_op=True) for b, p, off in items]
            assert h.wait() == len(items)
            res = [f.result() for f in futs]
    assert res == [n for _, _, n in reqs]
    assert _file_bytes(path) == bytes(expected)


# ------------------------------------------------------------------ errors and wait()
def test_error_fails_only_that_request(tmp_path: Path) -> None:
    """RLIMIT_FSIZE: the write past the limit fails (EFBIG) with the file and offset in the
    message; the others of the batch succeed; wait() raises that error after all finished."""
    out = tmp_path / "lim.bin"
    script = f"""
        import errno, os, resource, signal, torch, aioswap
        from aioswap import pinned
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        path = {str(out)!r}
        h = aioswap.AioHandle(block_size=1 << 20)
        srcs = [torch.full((1 << 20,), k + 1, dtype=torch.uint8) for k in range(12)]
        good_p = pinned.empty(1 << 20, torch.uint8, strict=False); good_p.fill_(99)
        futs = []
        for k, s in enumerate(srcs[:6]):
            futs.append(h.pwrite(s, path, k * (1 << 20) + 3, async_op=True))
        bad = h.pwrite(srcs[6], path, (20 << 20) + 5, async_op=True)      # past the limit
        futs.append(h.pwrite(good_p, path, 7 << 20, async_op=True))        # direct, ok
        try:
            h.wait()
            raise SystemExit("wait() did not raise")
        except OSError as exc:
            assert exc.errno == errno.EFBIG, exc
            assert "lim.bin" in str(exc), exc
            assert all(f.done() for f in futs) and bad.done()
        assert isinstance(bad.exception(), OSError)
        assert [f.result() for f in futs] == [1 << 20] * 7
        assert h.wait() == 0
        # the same with pwrite_many: the error raised after all finished, others written
        try:
            h.pwrite_many([(srcs[8], path, 0), (srcs[9], path, 30 << 20), (srcs[10], path, 2 << 20)])
            raise SystemExit("pwrite_many did not raise")
        except OSError as exc:
            assert exc.errno == errno.EFBIG
        h.close()
        data = open(path, "rb").read()
        assert data[0:1 << 20] == bytes([9]) * (1 << 20)
        assert data[2 << 20:3 << 20] == bytes([11]) * (1 << 20)
        assert data[(1 << 20) + 3:2 << 20] == bytes([2]) * ((1 << 20) - 3)
        for k in (3, 4, 5):
            o = k * (1 << 20) + 3
            assert data[o:o + (1 << 20)] == bytes([k + 1]) * (1 << 20), k
        assert data[7 << 20:8 << 20] == bytes([99]) * (1 << 20)
        print("ok")
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout,
                                                            r.stderr[-3000:])


def test_truncated_file_fails_only_that_read(tmp_path: Path) -> None:
    """A file truncated under a queued read: that read fails with ShortReadError naming the
    file; another request of the same batch succeeds (racy: skipped if the read won)."""
    data = _rand(64 * MiB, 402)
    p = _write(tmp_path / "t.bin", data)
    other_data = _rand(MiB, 403)
    q = _write(tmp_path / "o.bin", other_data)
    with aioswap.AioHandle(queue_depth=1, block_size=64 * KiB) as h:
        buf = torch.empty(64 * MiB, dtype=torch.uint8)
        other = bytearray(MiB - 9)
        f1 = h.pread(buf, p, 0, async_op=True)
        f2 = h.pread(other, q, 9, async_op=True)
        os.truncate(p, MiB)
        try:
            h.wait()
        except ShortReadError as exc:
            assert "t.bin" in str(exc)
        else:
            pytest.skip("the read finished before the truncation")
        assert isinstance(f1.exception(), ShortReadError)
        assert f2.result() == len(other) and bytes(other) == other_data[9:]
        assert bytes(buf[:MiB].numpy()) == data[:MiB]
        assert h.wait() == 0
        # the handle is fine afterwards
        assert h.pread(other, q, 9) == len(other)


def test_bad_request_in_a_batch(tmp_path: Path) -> None:
    """pread_many with a bad item: raised after the queued ones finished; none stays
    pending; their bytes are right."""
    data = _rand(4 * MiB, 404)
    p = _write(tmp_path / "b.bin", data)
    with aioswap.AioHandle() as h:
        good = [torch.empty(MiB + 1, dtype=torch.uint8) for _ in range(3)]
        with pytest.raises(TypeError):
            h.pread_many([(good[0], p, 1), (good[1], p, 2), (object(), p, 0), (good[2], p, 3)])
        assert h.wait() == 0
        assert bytes(good[0].numpy()) == data[1:MiB + 2]
        assert bytes(good[1].numpy()) == data[2:MiB + 3]
        with pytest.raises(ShortReadError):
            h.pread_many([(good[0], p, 5), (good[1], p, 4 * MiB - 10)])
        assert h.wait() == 0
        assert bytes(good[0].numpy()) == data[5:MiB + 6]


@pytest.mark.parametrize("lanes", [1, 2])
def test_wait_after_lane_split_request(tmp_path: Path, lanes: int) -> None:
    """A large async request split across lanes completes once, byte-exact."""
    data = _rand(24 * MiB + 5, 405)
    p = _write(tmp_path / "s.bin", data)
    with aioswap.AioHandle(intra_op_parallelism=lanes, block_size=MiB) as h:
        dst = torch.empty(24 * MiB, dtype=torch.uint8)
        fut = h.pread(dst, p, 5, async_op=True)
        assert h.wait() == 1
        assert fut.result() == dst.numel()
        assert bytes(dst.numpy()) == data[5:]
        out = tmp_path / "w.bin"
        fut = h.pwrite(dst[1:], out, 4097, async_op=True, fsync=True)
        assert h.wait() == 1 and fut.result() == dst.numel() - 1
    got = _file_bytes(out)
    assert len(got) == 4097 + dst.numel() - 1
    assert got[4097:] == data[6:] and got[:4097] == bytes(4097)


def test_wait_semantics(tmp_path: Path) -> None:
    data = _rand(2 * MiB, 400)
    path = _write(tmp_path / "src.bin", data)
    with aioswap.AioHandle() as h:
        assert h.wait() == 0
        bufs = [bytearray(1000 + k) for k in range(10)]
        futs = [h.pread(b, path, 17 * k, async_op=True) for k, b in enumerate(bufs)]
        assert h.wait() == 10
        assert all(f.done() for f in futs)
        assert h.wait() == 0
        # sync requests are not counted
        h.pread(bufs[0], path, 0)
        assert h.wait() == 0
        # futures from pread_many(async_op=True) are counted by wait()
        h.pread_many([(b, path, 5) for b in bufs[:4]], async_op=True)
        assert h.wait() == 4
        for k, b in enumerate(bufs[:4]):
            assert bytes(b) == data[5:5 + len(b)]


def test_submit_errors_are_raised_at_once(tmp_path: Path) -> None:
    """A read past EOF is refused at submission (ShortReadError), nothing is pending."""
    path = _write(tmp_path / "s.bin", _rand(10_000, 401))
    with aioswap.AioHandle() as h:
        ok = h.pread(bytearray(100), path, 0, async_op=True)
        with pytest.raises(ShortReadError, match="s.bin"):
            h.pread(bytearray(5000), path, 9000, async_op=True)
        with pytest.raises(FileNotFoundError):
            h.pread(bytearray(10), tmp_path / "missing.bin", 0, async_op=True)
        assert h.wait() == 1
        assert ok.result() == 100


# ------------------------------------------------------------------ AioFile
def test_aiofile_modes(tmp_path: Path) -> None:
    data = _rand(100_000, 500)
    p = _write(tmp_path / "m.bin", data)
    with aioswap.AioHandle() as h:
        with h.open(p, "r") as f:
            buf = bytearray(777)
            assert f.pread(buf, 3) == 777 and bytes(buf) == data[3:780]
            with pytest.raises(PermissionError):
                f.pwrite(b"x", 0)
        with h.open(p, "r+") as f:
            assert f.pwrite(b"abc", 5) == 3
            assert f.pread(buf, 0) == 777
            assert bytes(buf[:8]) == data[:5] + b"abc"
        assert _file_bytes(p)[:8] == data[:5] + b"abc"
        with pytest.raises(FileNotFoundError):
            h.open(tmp_path / "none.bin", "r+")
        with pytest.raises(FileNotFoundError):
            h.open(tmp_path / "none.bin", "r")
        with pytest.raises(FileExistsError):
            h.open(p, "x")
        with h.open(p, "a+") as f:                     # keeps contents, positional writes
            assert f.pwrite(b"Z", 0) == 1
        assert _file_bytes(p)[:1] == b"Z" and len(_file_bytes(p)) == len(data)
        with h.open(p, "w") as f:                      # truncates
            assert os.fstat(f.fileno()).st_size == 0
            assert f.pwrite(b"hello", 1) == 5
        assert _file_bytes(p) == b"\0hello"
        with pytest.raises(ValueError, match="mode"):
            h.open(p, "rw")
        with pytest.raises(IsADirectoryError):
            h.open(tmp_path, "r")


def test_created_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with aioswap.AioHandle() as h:
            h.pwrite(b"x" * 5000, tmp_path / "path.bin", 1)
            h.pwrite(b"x" * 5000, tmp_path / "async.bin", 1, async_op=True).result()
            for mode in ("w", "w+", "x", "a+"):
                with h.open(tmp_path / f"open_{mode}.bin", mode) as f:
                    f.pwrite(b"y" * 10, 0)
            with h.open(tmp_path / "perm.bin", "w", perm=0o640):
                pass
    finally:
        os.umask(old)
    for p in tmp_path.iterdir():
        want = 0o640 if p.name == "perm.bin" else 0o600
        assert stat.S_IMODE(p.stat().st_mode) == want, (p.name, oct(p.stat().st_mode))


def _open_fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


def test_aiofile_close_with_requests_in_flight(tmp_path: Path) -> None:
    data = _rand(16 * MiB, 501)
    p = _write(tmp_path / "c.bin", data)
    with aioswap.AioHandle(queue_depth=4, block_size=256 * KiB) as h:
        f = h.open(p, "r")
        fd = f.fileno()
        bufs = [torch.empty(2 * MiB + 1, dtype=torch.uint8) for _ in range(8)]
        futs = [f.pread(b, k * MiB + 1, async_op=True) for k, b in enumerate(bufs)]
        f.close()
        assert f.closed
        with pytest.raises(ValueError, match="closed"):
            f.pread(bytearray(10), 0)
        with pytest.raises(ValueError, match="closed"):
            h.pread(bytearray(10), f, 0)
        with pytest.raises(ValueError, match="closed"):
            f.fileno()
        assert h.wait() == 8
        for k, (b, fut) in enumerate(zip(bufs, futs)):
            assert fut.result() == b.numel()
            assert bytes(b.numpy()) == data[k * MiB + 1:k * MiB + 1 + b.numel()]
        # the fd went with the last request (it may have been reused since: compare targets)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            target = None
        assert target != str(p)
        f.close()                                     # idempotent


def test_no_fd_leak(tmp_path: Path) -> None:
    p = _write(tmp_path / "l.bin", _rand(MiB, 502))
    with aioswap.AioHandle() as h:
        h.pread(bytearray(10), p, 1)
        before = len(_open_fds())
        for k in range(200):
            h.pread(bytearray(100), p, k, async_op=True)
            h.pwrite(b"q" * 100, p, k * 3, async_op=k % 2 == 0)
            with h.open(p, "r") as f:
                f.pread(bytearray(10), k)
        h.wait()
        assert len(_open_fds()) <= before + 1


def test_closed_handle_refuses_everything(tmp_path: Path) -> None:
    p = _write(tmp_path / "h.bin", _rand(8192, 503))
    h = aioswap.AioHandle()
    f = h.open(p, "r+")
    h.close()
    for call in (lambda: h.pread(bytearray(10), p, 0), lambda: h.pwrite(b"x", p, 0),
                 lambda: h.pread(bytearray(10), p, 0, async_op=True),
                 lambda: h.open(p, "r"), lambda: f.pread(bytearray(10), 0),
                 lambda: h.pread_many([(bytearray(10), p, 0)])):
        with pytest.raises(HandleClosedError):
            call()
    assert h.wait() == 0
    f.close()
    h.close()


# ------------------------------------------------------------------ fd and path arguments
@pytest.mark.parametrize("write", [False, True])
def test_caller_closes_fd_during_async_request(tmp_path: Path, write: bool) -> None:
    data = _rand(8 * MiB, 600)
    p = _write(tmp_path / "fd.bin", data)
    with aioswap.AioHandle(queue_depth=2, block_size=128 * KiB) as h:
        fd = os.open(p, os.O_RDWR)
        buf = torch.empty(6 * MiB + 5, dtype=torch.uint8)
        if write:
            payload = _rand(buf.numel(), 601)
            _fill(buf, payload)
            fut = h.pwrite(buf, fd, 3, async_op=True)
        else:
            fut = h.pread(buf, fd, 3, async_op=True)
        os.close(fd)
        # reuse the number for another file: the request must not follow it
        other = os.open(tmp_path / "other.bin", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            assert fut.result(timeout=60) == buf.numel()
        finally:
            os.close(other)
    if write:
        assert _file_bytes(p) == data[:3] + payload + data[3 + len(payload):]
    else:
        assert bytes(buf.numpy()) == data[3:3 + buf.numel()]
    assert _file_bytes(tmp_path / "other.bin") == b""


def test_fd_offset_untouched_and_access_mode(tmp_path: Path) -> None:
    data = _rand(100_000, 602)
    p = _write(tmp_path / "fo.bin", data)
    with aioswap.AioHandle() as h:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.lseek(fd, 1234, os.SEEK_SET)
            buf = bytearray(5000)
            assert h.pread(buf, fd, 7) == 5000 and bytes(buf) == data[7:5007]
            assert os.lseek(fd, 0, os.SEEK_CUR) == 1234
            with pytest.raises(PermissionError):
                h.pwrite(b"x", fd, 0)
        finally:
            os.close(fd)
        with pytest.raises(OSError, match="not an open file"):
            h.pread(bytearray(10), fd, 0)


# ------------------------------------------------------------------ buffered fallback
@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting ramfs needs root")
    d = tmp_path / "ramfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount ramfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_ramfs_falls_back_with_one_warning(ramfs: Path) -> None:
    data = _rand(3 * MiB + 5, 700)
    p = ramfs / "r.bin"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with aioswap.AioHandle() as h:
            src = pinned.empty(len(data), torch.uint8, strict=False)
            _fill(src, data)
            assert h.pwrite(src, p, 0) == len(data)
            assert h.pwrite(b"abc", ramfs / "second.bin", 1, async_op=True).result() == 3
            buf = torch.empty(len(data) - 1, dtype=torch.uint8)
            assert h.pread(buf, p, 1) == len(data) - 1
            assert bytes(buf.numpy()) == data[1:]
            fd = os.open(p, os.O_RDONLY)
            try:
                b2 = bytearray(4096)
                assert h.pread(b2, fd, 4096) == 4096 and bytes(b2) == data[4096:8192]
            finally:
                os.close(fd)
            with h.open(p, "r+") as f:
                assert not f.direct
                futs = [f.pread(bytearray(1000), k * 1000, async_op=True) for k in range(20)]
                assert h.wait() == 21            # with the async pwrite above
                assert all(x.result() == 1000 for x in futs)
            assert h.stats.buffered_bytes > 0
    fallback = [w for w in rec if issubclass(w.category, DirectIOFallbackWarning)]
    assert len(fallback) == 1, [str(w.message) for w in fallback]
    assert "O_DIRECT" in str(fallback[0].message)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert _file_bytes(p) == data
    assert _file_bytes(ramfs / "second.bin") == b"\0abc"


# ------------------------------------------------------------------ benchmark smoke
@pytest.mark.slow
def test_bench_small_io_smoke(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_small_io.py"),
                        "--dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "IOPS" in out and "4K" in out and "64K" in out, out[-2000:]
    assert "async" in out, out[-2000:]
    assert not [p for p in tmp_path.iterdir()], "the benchmark left files behind"


# ------------------------------------------------------------------ the grid
SIZES = [1, 511, 512, 4095, 4096, 65537, MiB + 3]
OFFSETS = [0, 1, 511, 4096, 4097]


def _memory(kind: str, n: int) -> tuple[Any, Any]:
    """(buffer, keep-alive) of ``n`` bytes of the given kind."""
    if kind == "pinned":
        base = pinned.empty(n, torch.uint8, strict=False)
        return base, base
    if kind == "unpinned":
        base = torch.empty(n, dtype=torch.uint8)
        return base, base
    base = pinned.empty(n + 4096 + 3, torch.uint8, strict=False)     # misaligned view
    return base[3:3 + n], base


@pytest.mark.parametrize("kind", ["pinned", "unpinned", "misaligned"])
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_grid_against_os(tmp_path: Path, kind: str, write: bool) -> None:
    file_size = 2 * MiB + 8192
    base = _rand(file_size, 800)
    path = _write(tmp_path / "g.bin", base)
    expected = bytearray(base)
    ref_fd = os.open(path, os.O_RDWR)
    case = 0
    try:
        with aioswap.AioHandle(block_size=256 * KiB, queue_depth=8) as h, \
                h.open(path, "r+") as f:
            for n in SIZES:
                for off in OFFSETS:
                    for how in ("sync", "async"):
                        case += 1
                        target: Any = (path, ref_fd, f)[case % 3]
                        buf, keep = _memory(kind, n)
                        if write:
                            payload = _rand(n, case)
                            _fill(buf, payload)
                            r = h.pwrite(buf, target, off, async_op=how == "async")
                            assert _result(r) == n
                            expected[off:off + n] = payload
                            lo = max(0, off - 4096)
                            want = bytes(expected[lo:off + n + 4096])
                            got = os.pread(ref_fd, len(want), lo)
                            assert got == want, (n, off, how, target)
                        else:
                            r = h.pread(buf, target, off, async_op=how == "async")
                            assert _result(r) == n
                            assert _as_bytes(buf) == os.pread(ref_fd, n, off), (n, off, how)
                        del keep
            # futures consumed with result() still count once, at the next wait()
            assert h.wait() == case // 2
            assert h.wait() == 0
    finally:
        os.close(ref_fd)
    assert _file_bytes(path) == bytes(expected)
    assert case == len(SIZES) * len(OFFSETS) * 2


@pytest.mark.alone      # takes every AIO context of the machine while it runs
def test_auto_backend_falls_back_to_threads_when_io_setup_is_refused(
        tmp_path: Path, backend: str) -> None:
    """With io_uring refused and every AIO context of the system taken (fs.aio-max-nr), a
    handle still works, quietly, on worker threads, byte-exact, and says why; a handle that
    insists on kernel AIO says why it cannot have it."""
    if backend != "aio":
        pytest.skip("one run is enough")
    data = _rand(3 * 1024 * 1024 + 17, 77)
    p = _write(tmp_path / "f.bin", data)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, warnings, torch, aioswap
        from aioswap import _aio
        warnings.simplefilter("error")
        # a normal user's handle cannot lock its bounce ring (RLIMIT_MEMLOCK): not this test's
        warnings.filterwarnings("ignore", category=aioswap.errors.PinnedMemoryWarning)
        taken = []
        for depth in (4096, 256, 16, 1):     # every event of fs.aio-max-nr, to the last one
            try:
                while True:
                    taken.append(_aio.AioQueue(depth, backend="aio"))
            except OSError as e:
                assert e.errno == 11, e
        try:
            aioswap.AioHandle(backend="aio")
        except OSError as e:
            print("AIO REFUSED", "aio-max-nr" in str(e))
        os.environ.pop("AIOSWAP_BACKEND", None)
        _aio._uring_inject(setup_errno=1)   # io_uring refused too (EPERM: a seccomp profile)
        with aioswap.AioHandle() as h:
            print("BACKEND", h.backend, "aio-max-nr" in h.backend_reason,
                  "io_uring_setup failed" in h.backend_reason)
            t = torch.empty({len(data)}, dtype=torch.uint8)
            assert h.pread(t, {str(p)!r}) == {len(data)}
            out = {str(tmp_path / 'o.bin')!r}
            h.pwrite(t[5:], out, 4095, async_op=True).result()
            assert h.wait() == 1
            with open(out, "rb") as fo, open({str(p)!r}, "rb") as fi:
                assert fo.read()[4095:] == bytes(t[5:].numpy())
                assert bytes(t.numpy()) == fi.read()
        for q in taken:
            q.close()
        print("OK")
    """)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "AIO REFUSED True" in r.stdout and "BACKEND threads True True" in r.stdout


def test_waiting_threads_reap_and_deliver_with_the_completion_thread(tmp_path: Path) -> None:
    """Bursts of async requests from 4 threads, each waited for a different way (handle
    wait(), each future's result(), concurrent.futures.wait, a done callback, nothing until
    the end): threads that wait reap and deliver for the lane while its completion thread
    stands by; every request ends once, byte-exact, and no wait hangs."""
    import concurrent.futures as cf
    size = 8 * MiB
    data = _rand(size, 11)
    p = _write(tmp_path / "help.bin", data)
    errors: list[BaseException] = []
    with aioswap.AioHandle(queue_depth=16) as h:
        f = h.open(p, "r")

        def work(k: int) -> None:
            rng = random.Random(k)
            bufs = [pinned.empty(16 * KiB, torch.uint8, strict=False) for _ in range(24)]
            try:
                for rnd in range(40):
                    offs = [rng.randrange(0, size - 16 * KiB) for _ in bufs]
                    ns = [rng.choice((4 * KiB, 16 * KiB, 3000, 1)) for _ in bufs]
                    hit = threading.Event()
                    futs = [f.pread(b[:n], o, async_op=True) for b, n, o in zip(bufs, ns, offs)]
                    how = (k + rnd) % 5
                    if how == 0:
                        h.wait()
                    elif how == 1:
                        assert [fu.result(timeout=30) for fu in futs] == ns
                    elif how == 2:
                        assert not cf.wait(futs, timeout=30).not_done
                    elif how == 3:
                        futs[-1].add_done_callback(lambda _: hit.set())
                        assert hit.wait(30)
                        assert not cf.wait(futs, timeout=30).not_done
                    for fu, b, n, o in zip(futs, bufs, ns, offs):
                        assert fu.result(timeout=30) == n
                        assert bytes(b[:n].numpy()) == data[o:o + n]
            except BaseException as e:      # noqa: BLE001  (reported below)
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a wait hung"
        h.wait()
        assert h._core.active == 0 and f._users == 0
    assert not errors, errors[0]


def test_requests_nobody_waits_for_still_finish_after_waited_bursts(tmp_path: Path) -> None:
    """While a lane's callers wait for their bursts (and reap them), queueing a request no
    longer wakes the completion thread; it looks on its own every millisecond. A request
    nobody waits for (a done callback, a many-piece read left running while the caller
    sleeps, an asyncio future) must still be reaped, finish and be delivered, byte-exact."""
    import asyncio
    import time
    size = 8 * MiB
    data = _rand(size, 12)
    p = _write(tmp_path / "helped.bin", data)
    with aioswap.AioHandle(queue_depth=8, block_size=64 * KiB) as h:
        f = h.open(p, "r")
        bufs = [pinned.empty(4 * KiB, torch.uint8, strict=False) for _ in range(16)]
        big = pinned.empty(size, torch.uint8, strict=False)

        def bursts() -> None:           # the callers reap their own bursts: helped mode
            for r in range(6):
                for i, b in enumerate(bufs):
                    f.pread(b, (r * 16 + i) * 4 * KiB, async_op=True)
                h.wait()
            assert bytes(bufs[3].numpy()) == data[(5 * 16 + 3) * 4 * KiB:][:4 * KiB]

        for k in range(20):
            bursts()
            hit = threading.Event()
            fut = f.pread(bufs[0], 4096 * (k + 1), async_op=True)
            fut.add_done_callback(lambda _: hit.set())
            assert hit.wait(10), "a request nobody waited for was never delivered"
            assert bytes(bufs[0].numpy()) == data[4096 * (k + 1):][:4096]
        bursts()
        # 128 pieces at depth 8: only a reaper moves it on; the caller sleeps meanwhile
        fut = f.pread(big, 0, async_op=True)
        deadline = time.monotonic() + 30
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fut.done(), "a many-piece read nobody waited for stalled"
        assert fut.result() == size and bytes(big.numpy()) == data
        bursts()

        async def gather() -> list[int]:
            return list(await asyncio.wait_for(asyncio.gather(
                *(asyncio.wrap_future(f.pread(b, i * 8 * KiB, async_op=True))
                  for i, b in enumerate(bufs))), 30))

        assert asyncio.run(gather()) == [4 * KiB] * len(bufs)
        for i, b in enumerate(bufs):
            assert bytes(b.numpy()) == data[i * 8 * KiB:][:4 * KiB]
        assert h._core.active == 0


def test_requests_move_while_their_caller_queues_without_pause(tmp_path: Path) -> None:
    """A thread that queues asynchronous requests back to back (20 us apart: inside the
    engine's burst gap), never waiting, keeps the completion thread standing by for the end
    of its burst. Once the kernel queue is full and requests wait for room, only a reap
    lets them go out: the completion thread must reap while the caller is still queueing.
    The queueing takes ~4x the device time it asks for; here all were read before it
    stopped (asked: an eighth, for slower drives), and every one byte-exact. With the
    completion thread as the only reaper, 2-7% were."""
    import random
    import time
    n = 8192
    size = n * 4 * KiB
    data = _rand(size, 13)
    p = _write(tmp_path / "nopause.bin", data)
    offs = list(range(0, size, 4 * KiB))
    random.Random(5).shuffle(offs)
    with aioswap.AioHandle(queue_depth=8) as h:
        f = h.open(p, "r")
        buf = pinned.empty(size, torch.uint8, strict=False)
        f.pread(buf[:4 * KiB], 0)               # the lane exists before the clock
        buf.zero_()
        want = np.frombuffer(data, np.uint8).reshape(n, 4 * KiB)[np.array(offs) // (4 * KiB)]
        futs = []
        clock = time.perf_counter
        for i, off in enumerate(offs):
            futs.append(f.pread(buf[i * 4 * KiB:(i + 1) * 4 * KiB], off, async_op=True))
            t = clock() + 20e-6
            while clock() < t:
                pass
        # read by then: their bytes are in place (a future's done() needs the GIL, which
        # this thread holds, so it would count deliveries, not reads)
        early = int((buf.numpy().reshape(n, 4 * KiB) == want).all(axis=1).sum())
        assert early >= n // 8, f"only {early} of {n} requests were read while queueing"
        assert [x.result(timeout=60) for x in futs] == [4 * KiB] * n
        got = buf.numpy().tobytes()
        for i, off in enumerate(offs):
            assert got[i * 4 * KiB:(i + 1) * 4 * KiB] == data[off:off + 4 * KiB]
        assert h.wait() == n and h._core.active == 0
