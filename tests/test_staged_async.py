"""Asynchronous requests on buffers the queue cannot take as they are (strided views,
conjugate and negative views, empty requests with fsync) run on the handle's staging thread:
the call returns a future at once and never blocks the caller on I/O; byte-exact against
``os.pread``/``os.pwrite``; ``wait()``, ``close()`` and callbacks behave as for any request.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import aioswap

MiB = 1 << 20


@pytest.fixture(autouse=True)
def backend(engine_backend: str) -> str:
    return engine_backend


def _rand(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _pread(path: Path, n: int, off: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def test_strided_async_read_and_write_run_on_the_staging_thread(tmp_path: Path) -> None:
    data = _rand(8 * MiB, 1)
    path = tmp_path / "d.bin"
    path.write_bytes(data)
    where: list[str] = []
    with aioswap.AioHandle(block_size=MiB) as h:
        base = torch.full((1024, 2048), 7.0, dtype=torch.float32)
        view = base[:, ::2]                             # strided: 1024 x 1024 float32
        n = view.numel() * 4
        fut = h.pread(view, path, 13, async_op=True)
        fut.add_done_callback(lambda f: where.append(threading.current_thread().name))
        assert fut.result(timeout=60) == n
        assert view.contiguous().numpy().tobytes() == data[13:13 + n]
        assert base[:, 1::2].eq(7.0).all()              # the columns between untouched
        # writes: a strided view, a conjugate view and a negative view, all in flight at once
        x = torch.randn(512, 512, dtype=torch.complex64)
        futs = [h.pwrite(base[:, ::2], tmp_path / "s.bin", 7, async_op=True),
                h.pwrite(x.conj(), tmp_path / "c.bin", 0, async_op=True),
                h.pwrite(torch.randn(1000)._neg_view(), tmp_path / "n.bin", 3, async_op=True)]
        assert h.wait() == 4                            # the read, and the three writes
        assert [f.result() for f in futs] == [n, x.numel() * 8, 4000]
        assert _pread(tmp_path / "s.bin", n, 7) == base[:, ::2].contiguous().numpy().tobytes()
        assert _pread(tmp_path / "c.bin", x.numel() * 8, 0) == \
            x.conj().resolve_conj().numpy().tobytes()
    assert where and where[0] == "aioswap-stage", where


def test_staged_async_does_not_block_the_caller(tmp_path: Path) -> None:
    """The caller gets its future while the staging thread still works: a callback that the
    test holds up keeps the staged request from finishing, and the caller returns anyway."""
    data = _rand(4 * MiB, 2)
    path = tmp_path / "d.bin"
    path.write_bytes(data)
    gate = threading.Event()
    with aioswap.AioHandle(block_size=MiB) as h:
        first = h.pread(torch.empty(1024, 2048)[:, ::2], path, 0, async_op=True)
        first.add_done_callback(lambda f: gate.wait(30))   # the staging thread waits here
        second = h.pread(torch.empty(512, 1024)[:, ::2], path, 0, async_op=True)
        # first's callback holds the staging thread: second cannot have run yet
        assert not second.done()
        gate.set()
        assert second.result(timeout=60) == 512 * 512 * 4
        assert h.wait() == 2


def test_zero_bytes_with_fsync_and_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "z.bin"
    path.write_bytes(b"abc")
    with aioswap.AioHandle() as h:
        fut = h.pwrite(torch.empty(0), path, 0, async_op=True, fsync=True)
        assert fut.result(timeout=60) == 0
        # past the end of the file: refused before any I/O, in the caller, as for any shape
        with pytest.raises(aioswap.ShortReadError):
            h.pread(torch.empty(64, 64)[:, ::2], path, 0, async_op=True)
        assert h.wait() == 1


def test_wait_and_close_from_a_staged_callback(tmp_path: Path) -> None:
    data = _rand(2 * MiB, 3)
    path = tmp_path / "d.bin"
    path.write_bytes(data)
    seen: list[object] = []
    h = aioswap.AioHandle()

    def cb(f: object) -> None:
        try:
            h.wait()
        except RuntimeError as exc:
            seen.append(exc)
        h.close()                                       # deferred to another thread
        seen.append("closed")

    views = [torch.empty(256, 1024)[:, ::2] for _ in range(3)]
    futs = [h.pread(v, path, 0, async_op=True) for v in views]
    futs[0].add_done_callback(cb)
    assert [f.result(timeout=60) for f in futs] == [256 * 512 * 4] * 3
    for _ in range(600):
        if h.closed and len(seen) == 2:
            break
        threading.Event().wait(0.05)
    assert isinstance(seen[0], RuntimeError) and seen[1] == "closed", seen
    assert h.closed
    for v in views:
        assert v.contiguous().numpy().tobytes() == data[:256 * 512 * 4]
