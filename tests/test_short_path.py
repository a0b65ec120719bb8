"""The handle's short path: a whole contiguous CPU tensor on a file the handle opened.

Most requests take it (``f.pread(t, off)``, ``h.pread(t, f, off)``, ``pread_many`` of such
pairs), so it is checked here on its own: byte-exact against ``os.pread`` on every path
(direct, bounce, misaligned, buffered), that it is really taken, and that it keeps every
guarantee of the general path (errors, EOF, stats, close, futures).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import aioswap
from aioswap import AioHandle, ShortReadError, pinned
from aioswap.errors import HandleClosedError

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture(autouse=True)
def backend(engine_backend: str) -> str:
    """Every test of this suite runs on each engine backend (subprocesses inherit it)."""
    return engine_backend


def _rand(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture
def no_general(monkeypatch):
    """Fail the test (at its end) if a request that should not reached the general path.

    Yields the list of general-path requests; a test that expects some (errors raised
    there) clears it.
    """
    # one request first so that the short path knows torch's types
    with AioHandle() as h:
        h.pread(torch.empty(4, dtype=torch.uint8), __file__, 0)
    calls: list[object] = []
    real = AioHandle._prepare

    def spy(self, *a, **k):
        calls.append(a[:4])
        return real(self, *a, **k)

    monkeypatch.setattr(AioHandle, "_prepare", spy)
    yield calls
    assert calls == [], "requests took the general path"


def _buffer(kind: str, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An n-byte tensor of ``dtype``: pinned (aligned), pinned but misaligned, or pageable."""
    item = torch.empty(0, dtype=dtype).element_size()
    assert n % item == 0
    if kind == "pinned":
        return pinned.empty(n, torch.uint8).view(dtype)
    if kind == "misaligned":
        base = pinned.empty(n + 64, torch.uint8)
        return base[item:item + n].view(dtype)
    return torch.empty(n, dtype=torch.uint8).view(dtype)


SIZES = [1, 511, 4 * KiB, 4 * KiB + 1, 64 * KiB + 3, MiB + 512]
OFFSETS = [0, 1, 511, 4 * KiB, 12345]


@pytest.mark.parametrize("kind", ["pinned", "misaligned", "pageable"])
@pytest.mark.parametrize("how", ["sync", "async", "many"])
def test_short_path_is_byte_exact(tmp_dir, no_general, kind, how):
    """Writes then reads over odd sizes and offsets, each checked against os.pread."""
    path = _file(tmp_dir / "f.bin", _rand(3 * MiB, 1))
    expect = bytearray(path.read_bytes())
    with AioHandle(block_size=256 * KiB, queue_depth=8) as h, h.open(path, "r+") as f:
        for i, (n, off) in enumerate((n, o) for n in SIZES for o in OFFSETS):
            data = _rand(n, 100 + i)
            src = _buffer(kind, n)
            src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            dst = _buffer(kind, n)
            dst.fill_(7)
            if how == "sync":
                assert f.pwrite(src, off) == n
            elif how == "async":
                fut = f.pwrite(src, off, async_op=True)
                assert isinstance(fut, aioswap.IOFuture)
                assert h.wait() == 1
                assert fut.result() == n
            else:
                assert h.pwrite_many([(src, f, off)]) == [n]
            expect[off:off + n] = data
            with open(path, "rb") as raw:
                assert os.pread(raw.fileno(), n, off) == data, (n, off)
            if how == "sync":
                assert f.pread(dst, off) == n
            elif how == "async":
                assert h.pread(dst, f, off, async_op=True).result() == n
                h.wait()
            else:
                assert h.pread_many([(dst, f, off)]) == [n]
            assert dst.numpy().tobytes() == data, (n, off)
    assert path.read_bytes() == bytes(expect)
    assert os.path.getsize(path) == 3 * MiB          # nothing past the data, nothing cut


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float64])
def test_short_path_dtypes(tmp_dir, no_general, dtype):
    t = torch.arange(3000, dtype=torch.float64).to(dtype)
    path = tmp_dir / "d.bin"
    with AioHandle() as h, h.open(path, "w+") as f:
        assert f.pwrite(t, 100) == t.nbytes
        back = torch.empty_like(t)
        assert f.pread(back, 100) == t.nbytes
    assert torch.equal(back, t)
    assert path.read_bytes()[100:] == t.view(torch.uint8).numpy().tobytes()
    assert os.path.getsize(path) == 100 + t.nbytes


def test_short_path_paths_in_stats(tmp_dir, no_general):
    """Direct, bounce and edge bytes are counted as the general path counts them."""
    path = _file(tmp_dir / "s.bin", _rand(MiB, 2))
    with AioHandle(block_size=64 * KiB) as h, h.open(path, "r+") as f:
        f.pread(_buffer("pinned", 64 * KiB), 4 * KiB)
        st = h.stats
        assert (st.direct_bytes, st.bounce_bytes, st.head_tail_bytes) == (64 * KiB, 0, 0)
        f.pread(_buffer("pageable", 64 * KiB), 4 * KiB)
        st = h.stats
        assert (st.direct_bytes, st.bounce_bytes) == (64 * KiB, 64 * KiB)
        # edges of 412 + 100 bytes; the middle is direct where memory and file line up
        f.pread(pinned.empty(9 * KiB, torch.uint8)[100:100 + 8 * KiB], 100)
        st = h.stats
        assert st.head_tail_bytes == 512 and st.direct_bytes == 64 * KiB + 8 * KiB - 512
        f.pread(_buffer("pinned", 8 * KiB), 100)        # they do not: bounced
        st = h.stats
        assert st.head_tail_bytes == 1024 and st.bounce_bytes == 64 * KiB + 8 * KiB - 512
        assert st.reads == 4 and st.read_bytes == 144 * KiB and st.failed == 0


def test_short_path_buffered_file(tmp_dir, monkeypatch):
    monkeypatch.setenv("AIOSWAP_BUFFERED", "1")
    path = tmp_dir / "b.bin"
    data = _rand(100_003, 3)
    with AioHandle() as h, h.open(path, "w+") as f:
        assert not f.direct
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert f.pwrite(t, 5) == len(data)
        back = torch.empty(len(data), dtype=torch.uint8)
        assert f.pread(back, 5, async_op=True).result() == len(data)
        h.wait()
        assert h.stats.buffered_bytes == 2 * len(data)
    assert back.numpy().tobytes() == data
    assert path.read_bytes() == b"\0" * 5 + data


def test_general_path_still_serves_what_the_short_path_refuses(tmp_dir):
    """nbytes, fsync and another handle's file take the compiled path; a strided view the
    general one (staged, then submitted through the Core): same bytes either way."""
    path = _file(tmp_dir / "g.bin", _rand(256 * KiB, 4))
    data = path.read_bytes()
    with AioHandle() as h, AioHandle() as other, h.open(path, "r+") as f:
        calls = []
        real = AioHandle._prepare

        def spy(self, *a, **k):
            calls.append(a[0])
            return real(self, *a, **k)

        AioHandle._prepare = spy
        try:
            t = torch.empty(8 * KiB, dtype=torch.uint8)
            assert f.pread(t, 0, nbytes=100) == 100
            assert t[:100].numpy().tobytes() == data[:100]
            assert f.pwrite(t[:4 * KiB], 0, fsync=True) == 4 * KiB
            assert f.pwrite(t, 4 * KiB, nbytes=100, fsync=True) == 100
            fut = h.pread(t, str(path), 3, nbytes=5000, async_op=True)
            assert fut.result() == 5000 and fut.nbytes == 5000
            assert t[:5000].numpy().tobytes() == path.read_bytes()[3:5003]
            assert calls == []                                  # the compiled path
            with pytest.raises(ValueError, match="holds only 8192 bytes"):
                f.pread(t, 0, nbytes=8 * KiB + 1)
            assert len(calls) == 1                              # refused by the general path
            calls.clear()
            strided = torch.empty(2 * KiB, dtype=torch.uint8)[::2]
            assert f.pread(strided, 8 * KiB) == KiB
            assert strided.numpy().tobytes() == data[8 * KiB:9 * KiB]
            back = torch.empty(KiB, dtype=torch.uint8)
            assert len(calls) == 1                              # the strided view
            assert other.pread(back, f, 16 * KiB) == KiB        # f belongs to h
            assert back.numpy().tobytes() == data[16 * KiB:17 * KiB]
        finally:
            AioHandle._prepare = real
        assert len(calls) == 1                                  # f on `other`: compiled


def test_short_path_read_past_eof_raises_before_io(tmp_dir, no_general):
    path = _file(tmp_dir / "e.bin", _rand(10 * KiB, 5))
    with AioHandle() as h, h.open(path, "r") as f:
        t = torch.full((8 * KiB,), 9, dtype=torch.uint8)
        with pytest.raises(ShortReadError, match="e.bin") as ei:
            f.pread(t, 4 * KiB)
        assert ei.value.file_size == 10 * KiB
        assert bool((t == 9).all())                         # nothing was read
        assert h.stats.failed == 0 and h.stats.reads == 0
        assert len(no_general) == 1                         # it raised there
        no_general.clear()


def test_short_path_sees_a_file_grow_and_shrink(tmp_dir, no_general):
    """The size seen at open is a hint: a grown file is read, a truncated one fails."""
    path = _file(tmp_dir / "grow.bin", _rand(4 * KiB, 6))
    with AioHandle() as h, h.open(path, "r") as f:
        more = _rand(60 * KiB, 7)
        with open(path, "ab") as fh:                        # grown by someone else
            fh.write(more)
        t = torch.empty(60 * KiB, dtype=torch.uint8)
        assert f.pread(t, 4 * KiB) == 60 * KiB
        assert t.numpy().tobytes() == more
        os.truncate(path, 8 * KiB)                          # shrunk by someone else
        t.fill_(0xAA)
        # refused before any I/O (the size is asked per read: an O_DIRECT read past the new
        # end would zero-fill the destination), sync and async alike
        with pytest.raises(ShortReadError, match="grow.bin"):
            f.pread(t, 4 * KiB)
        with pytest.raises(ShortReadError, match="grow.bin"):
            f.pread(t, 4 * KiB, async_op=True)
        assert bool((t == 0xAA).all())
        assert h.wait() == 0
        no_general.clear()                                  # those errors come from there


def test_short_path_write_error_fails_that_request_only(tmp_dir):
    """EFBIG from RLIMIT_FSIZE: the failing write raises naming the file, the next works."""
    code = textwrap.dedent("""
        import json, os, resource, signal, sys, torch
        from aioswap import AioHandle, pinned
        path = sys.argv[1]
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        out = {}
        with AioHandle() as h, h.open(path, "w+") as f:
            t = pinned.empty(64 << 10, torch.uint8)
            f.pwrite(t, 0)                                   # learn torch's types
            try:
                f.pwrite(t, 1 << 20)
            except OSError as exc:
                out["sync"] = [exc.errno, exc.filename]
            fut = f.pwrite(t, 2 << 20, async_op=True)
            try:
                fut.result()
            except OSError as exc:
                out["async"] = [exc.errno, exc.filename]
            out["wait"] = h.wait()          # counted; its error was handed out by its future
            out["ok"] = f.pwrite(t, 64 << 10)
            out["failed"] = h.stats.failed
        print(json.dumps(out))
    """)
    path = str(tmp_dir / "big.bin")
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    import errno
    import json
    out = json.loads(r.stdout)
    assert out["sync"][0] == errno.EFBIG and "big.bin" in out["sync"][1]
    assert out["async"][0] == errno.EFBIG and out["wait"] == 1
    assert out["ok"] == 64 * KiB and out["failed"] == 2
    assert os.path.getsize(path) == 128 * KiB


def test_short_path_futures_are_real_futures(tmp_dir, no_general):
    path = _file(tmp_dir / "fut.bin", _rand(256 * KiB, 8))
    data = path.read_bytes()
    with AioHandle() as h, h.open(path, "r") as f:
        bufs = [torch.empty(4 * KiB, dtype=torch.uint8) for _ in range(16)]
        seen = []
        futs = [f.pread(b, i * 4 * KiB, async_op=True) for i, b in enumerate(bufs)]
        assert all(fut.running() or fut.done() for fut in futs)
        assert not futs[0].cancel()
        for fut in futs:
            fut.add_done_callback(lambda x: seen.append(x.result()))
        done, _ = concurrent.futures.wait(futs, timeout=30)
        assert len(done) == 16
        assert sorted(fut.result() for fut in concurrent.futures.as_completed(futs)) \
            == [4 * KiB] * 16

        async def main():
            return await asyncio.wrap_future(f.pread(bufs[0], 0, async_op=True))

        assert asyncio.run(main()) == 4 * KiB
        assert h.wait() == 17
        assert h.wait() == 0
        assert seen == [4 * KiB] * 16
    for i, b in enumerate(bufs[1:], 1):
        assert b.numpy().tobytes() == data[i * 4 * KiB:(i + 1) * 4 * KiB]


def test_close_file_and_handle_with_short_requests_in_flight(tmp_dir, no_general):
    """Closing the file keeps its fd until its requests end; closing the handle waits."""
    path = _file(tmp_dir / "c.bin", _rand(4 * MiB, 9))
    data = path.read_bytes()
    h = AioHandle(queue_depth=4)
    f = h.open(path, "r")
    fd = f.fileno()
    bufs = [torch.empty(64 * KiB, dtype=torch.uint8) for _ in range(64)]
    futs = [f.pread(b, i * 64 * KiB, async_op=True) for i, b in enumerate(bufs)]
    f.close()
    with pytest.raises(ValueError, match="closed file"):
        f.pread(bufs[0], 0)
    no_general.clear()                          # raised by the general path
    h.close()                                   # waits for every request
    assert all(fut.done() for fut in futs)
    assert [fut.result() for fut in futs] == [64 * KiB] * 64
    with pytest.raises(OSError):
        os.fstat(fd)                            # the fd went with the last request
    for i, b in enumerate(bufs):
        assert b.numpy().tobytes() == data[i * 64 * KiB:(i + 1) * 64 * KiB]
    with pytest.raises(HandleClosedError):
        h.pread(bufs[0], path, 0)
    no_general.clear()


def test_pread_many_mixes_short_and_general_requests(tmp_dir, no_general):
    path = _file(tmp_dir / "m.bin", _rand(MiB, 10))
    data = path.read_bytes()
    with AioHandle(queue_depth=4) as h, h.open(path, "r") as f:
        ts = [torch.empty(4 * KiB + i, dtype=torch.uint8) for i in range(40)]
        out = h.pread_many([(t, f, 3 * i * KiB) for i, t in enumerate(ts)])
        assert out == [t.nbytes for t in ts]
        for i, t in enumerate(ts):
            assert t.numpy().tobytes() == data[3 * i * KiB:3 * i * KiB + t.nbytes]
        # one read past the end fails the batch after every request finished
        ts[5] = torch.empty(8 * KiB, dtype=torch.uint8)
        with pytest.raises(ShortReadError):
            h.pread_many([(t, f, MiB - 4 * KiB if i == 5 else 0) for i, t in enumerate(ts)])
        assert h.stats.failed == 0       # refused before any I/O
        assert h._core.active == 0 and f._users == 0
        assert len(no_general) == 1
        no_general.clear()


def test_batch_items_of_every_shape(tmp_dir, no_general):
    """A batch item is any sequence ``(buffer, file[, offset])``: tuples of two or three
    (unpacked in C), lists, and items mixing paths, fds and open files, byte-exact; an item
    that is not one is refused, naming the problem, after the queued ones finished."""
    path = _file(tmp_dir / "shapes.bin", _rand(MiB, 12))
    data = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        with AioHandle() as h, h.open(path, "r") as f:
            ts = [torch.empty(4 * KiB + 3 * i, dtype=torch.uint8) for i in range(8)]
            items = [(ts[0], f), [ts[1], f, 5], (ts[2], str(path), 4 * KiB), [ts[3], fd, 777],
                     (ts[4], path, 12345), (ts[5], fd), [ts[6], f], (ts[7], f, MiB - ts[7].nbytes)]
            offs = [0, 5, 4 * KiB, 777, 12345, 0, 0, MiB - ts[7].nbytes]
            assert h.pread_many(items) == [t.nbytes for t in ts]
            for t, off in zip(ts, offs):
                assert t.numpy().tobytes() == data[off:off + t.nbytes]
            for t in ts:
                t.zero_()
            futs = h.pread_many(items, async_op=True)
            assert [x.result() for x in futs] == [t.nbytes for t in ts] and h.wait() == 8
            for t, off in zip(ts, offs):
                assert t.numpy().tobytes() == data[off:off + t.nbytes]
            before = h.stats.reads
            with pytest.raises(ValueError, match="not enough values"):
                h.pread_many([(ts[0], f, 64), (ts[1],)], async_op=True)
            assert h.wait() == 0        # the item before it ran, and was counted off
            assert h.stats.reads == before + 1
            ts[0].zero_()
            before = h.stats.reads
            with pytest.raises(ValueError, match="not enough values"):
                h.pread_many([(ts[0], f, 64), (ts[1],)])
            assert ts[0].numpy().tobytes() == data[64:64 + ts[0].nbytes]
            assert h.stats.reads == before + 1      # the first item ran to its end
            assert h._core.active == 0 and f._users == 0
        assert not no_general
    finally:
        os.close(fd)


def test_short_path_refuses_a_forked_child(tmp_dir):
    path = _file(tmp_dir / "fork.bin", _rand(8 * KiB, 11))
    code = textwrap.dedent("""
        import os, sys, torch
        from aioswap import AioHandle
        h = AioHandle()
        f = h.open(sys.argv[1], "r")
        t = torch.empty(4096, dtype=torch.uint8)
        f.pread(t, 0)
        f.pread(t, 0)
        pid = os.fork()
        if pid == 0:
            try:
                f.pread(t, 0)
            except RuntimeError as exc:
                os._exit(0 if "fork" in str(exc) else 3)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        f.close(); h.close()
    """)
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_futures_used_before_and_after_they_finish(tmp_dir, no_general):
    """A future waited on while in flight is woken; one first touched after its request
    ended (its lock made only then) reports the same result, and late callbacks run."""
    import threading
    path = _file(tmp_dir / "late.bin", _rand(4 * MiB, 12))
    data = path.read_bytes()
    with AioHandle(queue_depth=2) as h, h.open(path, "r") as f:
        bufs = [torch.empty(MiB, dtype=torch.uint8) for _ in range(4)]
        futs = [f.pread(b, i * MiB, async_op=True) for i, b in enumerate(bufs)]
        got: list[object] = []
        waiter = threading.Thread(target=lambda: got.append(futs[3].result(timeout=30)))
        waiter.start()                            # blocks in result() while it runs
        assert h.wait() == 4
        waiter.join(30)
        assert got == [MiB]
        for fut in futs:                          # touched only now
            assert fut.done() and not fut.running() and not fut.cancelled()
            assert fut.exception() is None and fut.result(timeout=0) == MiB
            late: list[int] = []
            fut.add_done_callback(lambda x: late.append(x.result()))
            assert late == [MiB]
            assert "finished" in repr(fut)
    for i, b in enumerate(bufs):
        assert b.numpy().tobytes() == data[i * MiB:(i + 1) * MiB]


def test_direct_aligned_requests_lock_no_bounce_ring(tmp_dir):
    """Requests that go direct and aligned (page-locked memory, whole blocks) never need the
    bounce ring, so a handle that only makes such requests locks none; the first request
    with an unaligned edge or unlocked memory attaches it, on the short and general paths."""
    data = _rand(4 * MiB, 31)
    path = _file(tmp_dir / "f.bin", data)
    with AioHandle(intra_op_parallelism=2) as h:
        f = h.open(path, "r")
        if not f.direct:
            pytest.skip("the file system refuses O_DIRECT")
        buf = pinned.empty(4 * MiB, torch.uint8)
        assert h.pread(buf[:64 * KiB], f, 4096) == 64 * KiB             # short path
        assert h.pread(buf, path) == 4 * MiB                            # general: 2 lanes
        futs = [f.pread(buf[i:i + MiB], i, async_op=True) for i in range(0, 4 * MiB, MiB)]
        assert sum(x.result() for x in futs) == 4 * MiB
        assert buf.numpy().tobytes() == data
        assert not any(lane.ring.attached for lane in h._lanes)
        assert h.stats.bounce_bytes == 0 and h.stats.head_tail_bytes == 0
        out = torch.empty(5000, dtype=torch.uint8)                      # unlocked memory
        assert h.pread(out, f, 100) == 5000
        assert out.numpy().tobytes() == data[100:5100]
        assert any(lane.ring.attached for lane in h._lanes)


# -- one path: every contiguous host buffer, every lane count ---------------------------------
@pytest.mark.parametrize("kind", ["numpy", "bytearray", "memoryview", "numpy-f32"])
@pytest.mark.parametrize("size,offset", [(1, 0), (4 * KiB + 1, 511), (MiB + 512, 12345)])
def test_buffers_of_every_kind_take_the_compiled_path(tmp_dir, no_general, kind, size, offset):
    """numpy arrays and bytes-like objects go the way tensors go (no general path): sync,
    async, nbytes, fsync and batches, byte-exact against os.pread/os.pwrite."""
    import numpy as np
    data = _rand(size + 8, 21)
    path = _file(tmp_dir / "b.bin", _rand(offset + 2 * size + 64, 22))

    def make(n: int):
        if kind == "numpy":
            return np.zeros(n, np.uint8)
        if kind == "numpy-f32":
            return np.zeros(-(-n // 4), np.float32)
        if kind == "bytearray":
            return bytearray(n)
        return memoryview(bytearray(n))

    src = make(size)
    nb = size                              # (a float32 array of `size` bytes rounded up)
    memoryview(src).cast("B")[:size] = data[:size]
    with AioHandle() as h, h.open(path, "r+") as f:
        assert h.pwrite(src, path, offset, nbytes=nb, fsync=True) == nb
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, nb, offset) == data[:size]
            dst = make(size)
            assert f.pread(dst, offset, nbytes=nb) == nb
            assert bytes(memoryview(dst).cast("B")[:nb]) == data[:size]
            dst2 = make(size)
            assert h.pread(dst2, fd, offset, nbytes=nb, async_op=True).result() == nb
            assert bytes(memoryview(dst2).cast("B")[:nb]) == data[:size]
            a, b = make(size), make(size)
            assert h.pread_many([(a, f, offset), (b, str(path), offset)]) == [
                memoryview(a).nbytes, memoryview(b).nbytes]
            assert bytes(memoryview(a).cast("B")[:nb]) == data[:size]
            assert bytes(memoryview(b).cast("B")[:nb]) == data[:size]
        finally:
            os.close(fd)


def test_read_only_and_object_buffers_are_refused_by_the_general_path(tmp_dir):
    import numpy as np
    path = _file(tmp_dir / "r.bin", _rand(8 * KiB, 23))
    with AioHandle() as h:
        with pytest.raises(ValueError, match="read-only buffer"):
            h.pread(bytes(4 * KiB), path)
        with pytest.raises(TypeError, match="object"):
            h.pwrite(np.array([object()] * 8), path)
        assert h.pwrite(bytes(range(256)), path, 3) == 256      # a read-only source is fine
        assert path.read_bytes()[3:259] == bytes(range(256))


def test_a_bytearray_cannot_be_resized_under_an_async_read(tmp_dir):
    """The request holds the buffer's export until it is over: resizing raises BufferError
    instead of freeing memory the kernel may still write."""
    path = _file(tmp_dir / "x.bin", _rand(4 * MiB, 24))
    buf = bytearray(4 * MiB)
    with AioHandle() as h:
        fut = h.pread(buf, path, async_op=True)
        try:
            buf.extend(b"x")
        except BufferError:
            pass                            # refused while the read is in flight
        else:
            assert fut.done() or len(buf) == 4 * MiB + 1
        assert fut.result() == 4 * MiB
        assert bytes(buf[:4 * MiB]) == path.read_bytes()
    del fut
    buf.extend(b"y")                        # and released once the request is over


@pytest.mark.parametrize("lanes", [2, 3])
@pytest.mark.parametrize("kind", ["pinned", "misaligned", "pageable"])
def test_cross_lane_requests_take_the_compiled_path(tmp_dir, no_general, lanes, kind):
    """A request of two pieces or more is cut across the lanes by the Core: sync, async,
    fsync and batches, byte-exact at odd offsets, counted once in the statistics."""
    n = 3 * MiB + 777
    data = _rand(n, 25)
    path = _file(tmp_dir / "l.bin", _rand(n + 8 * KiB, 26))
    with AioHandle(block_size=256 * KiB, intra_op_parallelism=lanes) as h:
        src = _buffer(kind, n + (n % 2 if kind == "misaligned" else 0))[:n]
        src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        before = h.stats
        assert h.pwrite(src, path, 4097, fsync=True) == n
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, n, 4097) == data
        finally:
            os.close(fd)
        dst = _buffer(kind, n + (n % 2 if kind == "misaligned" else 0))[:n]
        assert h.pread(dst, path, 4097) == n
        assert dst.numpy().tobytes() == data
        dst.zero_()
        fut = h.pread(dst, path, 4097, async_op=True)
        assert fut.result() == n and dst.numpy().tobytes() == data
        other = torch.empty(n, dtype=torch.uint8)
        assert h.pread_many([(dst, path, 4097), (other, path, 4097)]) == [n, n]
        assert other.numpy().tobytes() == data
        assert h.pwrite(src, path, 9, async_op=True, fsync=True).result() == n
        assert path.read_bytes()[9:9 + n] == data
        s = h.stats
        assert (s.reads - before.reads, s.writes - before.writes) == (4, 2)
        assert s.read_bytes - before.read_bytes == 4 * n
        assert s.async_ops - before.async_ops == 2
        assert h.wait() == 2


def test_a_failed_part_fails_the_whole_cross_lane_request(tmp_dir):
    """One lane's part of a request fails (EFBIG past a file size limit, as a full disk
    gives ENOSPC): the request fails as a whole, sync and async, naming the file, its size
    and the bytes done; the statistics count one failed request."""
    script = textwrap.dedent(f"""
        import errno, resource, signal, torch
        from aioswap import AioHandle
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (MiB, MiB))
        n = 2 * MiB
        src = torch.ones(n, dtype=torch.uint8)
        with AioHandle(block_size=128 * KiB, intra_op_parallelism=2) as h:
            for how in ("sync", "async"):
                path = {str(tmp_dir)!r} + "/f-" + how
                try:
                    if how == "sync":
                        h.pwrite(src, path, 0)
                    else:
                        h.pwrite(src, path, 0, async_op=True, fsync=True).result()
                except OSError as exc:
                    assert exc.errno == errno.EFBIG, exc
                    assert path in str(exc) and f"of {{n}} bytes done" in str(exc), str(exc)
                    assert MiB <= exc.offset < n, exc.offset
                else:
                    raise AssertionError("no error")
            assert h.stats.failed == 2 and h.stats.writes == 0, h.stats
        print("ok")
    """).replace("MiB", str(MiB)).replace("KiB", str(KiB))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
