"""The engine's request object (:class:`aioswap._aio.Request`), on every backend.

A request is one C object from submission to its result: ``wait``/``drain``/``cancel`` are
its methods and are safe twice, from several threads, and after it finished (also after its
queue was closed); the queue keeps it, and the memory it names, alive until it is seen
finished; its error comes from one checker (:func:`aioswap._aio.failure`).
"""
from __future__ import annotations

import errno
import gc
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import aioswap
from aioswap import _aio
from aioswap._aio import MODE_DIRECT, MODE_PLAIN, AioQueue, LockedMemory, open_direct
from aioswap.errors import ShortReadError

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture(autouse=True)
def backend(engine_backend: str) -> str:
    return engine_backend


@pytest.fixture
def queue(backend: str) -> Iterator[AioQueue]:
    q = AioQueue(8, backend=backend)
    assert q.backend == backend
    try:
        yield q
    finally:
        q.close()


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(7).integers(0, 256, 4 * MiB, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def _read(q: AioQueue, fd: int, mem: LockedMemory, n: int, off: int = 0) -> _aio.Request:
    return q.submit(fd, False, mem.address, n, off, MODE_DIRECT, 4096, 64 * KiB, None, False,
                    True, None, "data.bin", mem)


def test_wait_twice_drain_cancel_after(queue: AioQueue, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    mem = LockedMemory(MiB)
    fd = open_direct(path)
    try:
        rq = _read(queue, fd, mem, MiB, MiB)
        assert rq.wait() == MiB
        assert rq.finished and rq.done == MiB and rq.errno == 0 and not rq.eof
        assert rq.wait() == MiB                 # again: the same result, nothing touched
        assert rq.drain() == MiB
        rq.cancel()                             # late: a no-op
        assert rq.error() is None
        assert bytes(memoryview(mem)) == data[MiB:2 * MiB]
    finally:
        os.close(fd)


def test_concurrent_wait_on_one_request(queue: AioQueue,
                                        data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    mem = LockedMemory(4 * MiB)
    fd = open_direct(path)
    results: list[int] = []
    errors: list[BaseException] = []
    try:
        for _ in range(20):
            rq = _read(queue, fd, mem, 4 * MiB)
            results.clear()
            go = threading.Barrier(4)

            def waiter(how: str) -> None:
                try:
                    go.wait()
                    if how == "cancel":
                        rq.cancel()
                        results.append(rq.drain(False))
                    else:
                        results.append(rq.wait() if how == "wait" else rq.drain())
                except BaseException as exc:   # noqa: BLE001 - collected for the assert
                    errors.append(exc)

            threads = [threading.Thread(target=waiter, args=(how,))
                       for how in ("wait", "wait", "drain", "cancel")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
            assert rq.finished and len(set(results)) == 1, results
            done = results[0]
            assert done % 4096 == 0 and done <= 4 * MiB    # cancelled: whole pieces only
            assert bytes(memoryview(mem)[:done]) == data[:done]
        assert queue.inflight == 0
    finally:
        os.close(fd)


def test_cancel_before_wait_stops_early(queue: AioQueue,
                                        data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    mem = LockedMemory(4 * MiB)
    fd = open_direct(path)
    try:
        rq = queue.submit(fd, False, mem.address, 4 * MiB, 0, MODE_DIRECT, 4096, 4096, None,
                          False, True)
        rq.cancel()
        rq.cancel()
        done = rq.wait()
        assert done < 4 * MiB and done % 4096 == 0 and rq.error() is None
        assert bytes(memoryview(mem)[:done]) == data[:done]
    finally:
        os.close(fd)


def test_result_after_queue_closed(backend: str, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    q = AioQueue(4, backend=backend)
    mem = LockedMemory(64 * KiB)
    fd = open_direct(path)
    try:
        rq = _read(q, fd, mem, 64 * KiB)
        assert rq.wait() == 64 * KiB
        q.close()
        # a finished request never touches its (closed) queue again
        assert rq.wait() == 64 * KiB and rq.drain() == 64 * KiB
        rq.cancel()
        assert "finished" in repr(rq)
    finally:
        os.close(fd)


def test_errors_come_from_one_checker(queue: AioQueue, tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 8192)
    mem = LockedMemory(16 * KiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        rq = queue.submit(fd, False, mem.address, 16 * KiB, 0, MODE_PLAIN, 1, 4096, None,
                          False, True, None, str(path))
        with pytest.raises(ShortReadError, match="reached end of file") as info:
            rq.wait()
        assert info.value.done == 8192 and info.value.path == str(path)
        with pytest.raises(ShortReadError):
            rq.wait()                           # again: the same error
        assert rq.eof and rq.errno == 0 and rq.done == 8192
        # a write on a read-only fd: EBADF naming the file, offset and size
        rq = queue.submit(fd, True, mem.address, 4096, 4096, MODE_PLAIN, 1, 4096, None,
                          False, True, None, str(path))
        with pytest.raises(OSError) as info:
            rq.wait()
        exc = info.value
        assert exc.errno == errno.EBADF and exc.filename == str(path)
        assert exc.offset == 4096 and exc.nbytes == 4096 and exc.done == 0  # type: ignore
        assert "4096 bytes at file offset 4096" in str(exc)
        # the fast path of run() raises the same checker's error
        with pytest.raises(OSError) as info:
            queue.run(fd, True, mem.address, 4096, 0, MODE_PLAIN, 1, 4096, None, False,
                      str(path))
        assert info.value.errno == errno.EBADF and info.value.filename == str(path)
    finally:
        os.close(fd)


def test_async_request_is_not_waited_in_python(queue: AioQueue,
                                               data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    mem = LockedMemory(64 * KiB)
    fd = open_direct(path)
    token = object()
    try:
        rq = queue.submit(fd, False, mem.address, 64 * KiB, 0, MODE_DIRECT, 4096, 64 * KiB,
                          None, False, False, token)
        with pytest.raises(RuntimeError, match="serve"):
            rq.wait()
        got: list[_aio.Request] = []
        while not got:
            got.extend(queue.serve() or [])
        assert got == [rq] and rq.token is token and rq.finished
        assert rq.wait() == 64 * KiB            # seen: its result from here on
    finally:
        os.close(fd)


def test_queue_keeps_the_memory_of_a_dropped_request(queue: AioQueue,
                                                     data_file: tuple[Path, bytes]) -> None:
    """The owner given at submit lives while the request may be touched, then is let go."""
    path, _ = data_file
    fd = open_direct(path)
    try:
        mem = LockedMemory(MiB)
        ref = weakref.ref(mem)
        rq = _read(queue, fd, mem, MiB)
        del mem
        gc.collect()
        assert ref() is not None                # the request holds it
        assert rq.wait() == MiB
        gc.collect()
        assert ref() is None                    # seen finished: let go at once
        assert rq.done == MiB and rq.finished
    finally:
        os.close(fd)


def test_dropped_future_completes_and_frees(backend: str,
                                            data_file: tuple[Path, bytes]) -> None:
    """Through the handle: an async request whose future and tensor were dropped at once
    still reads every byte, and then nothing holds the tensor."""
    path, data = data_file
    refs = []
    with aioswap.AioHandle(queue_depth=8, block_size=64 * KiB) as h:
        assert h.backend == backend
        with h.open(path) as f:
            for i in range(64):
                t = torch.empty(64 * KiB, dtype=torch.uint8)
                refs.append(weakref.ref(t))
                h.pread(t, f, i * 64 * KiB, async_op=True)
                del t
            assert h.wait() == 64
        gc.collect()
        assert all(r() is None for r in refs)
        # one more, kept this time, is byte-exact
        t = torch.empty(MiB, dtype=torch.uint8)
        h.pread(t, path, MiB, async_op=True).result(timeout=60)
        assert t.numpy().tobytes() == data[MiB:2 * MiB]


def test_ring_attached_when_a_signal_lands_on_the_call(backend: str) -> None:
    """A signal handler that raises as attach_ring returns (io_uring registers the ring in
    that call, long enough for a SIGINT to land) leaves the ring known as attached: the next
    request does not attach it a second time."""
    from aioswap import _bounce

    class Interrupted(AioQueue):
        def attach_ring(self, *args: object) -> None:
            super().attach_ring(*args)
            raise KeyboardInterrupt

    q = Interrupted(4, backend=backend)
    try:
        ring = _bounce.Ring(q, 64 * KiB, 2)
        with pytest.raises(KeyboardInterrupt):
            ring.ensure()
        assert ring.attached and q.ring_buffers == 2
        ring.ensure()                           # no "the ring is already attached"
    finally:
        q.close()
        ring.close()
