"""Writes past the end of a file: the engine extends the file first (``fallocate``, grow only)
so that their pieces run together; the bytes and the file's length stay exactly those of
plain ``os.pwrite``, on every backend, with concurrent writers, unaligned ends, files cut
short behind the handle's back, and block devices (never grown)."""
from __future__ import annotations

import os
import random

import pytest
import torch

import aioswap
from aioswap import pinned

KiB = 1 << 10
BLOCK = 64 * KiB


@pytest.fixture
def handle(engine_backend):
    with aioswap.AioHandle(block_size=BLOCK, queue_depth=8) as h:
        yield h


def _data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = pinned.empty(n, torch.uint8)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    return t


def _plain(path, chunks: list[tuple[int, bytes]]) -> bytes:
    """What plain os.pwrite makes of the same writes on a new file."""
    ref = str(path) + ".ref"
    fd = os.open(ref, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for off, b in chunks:
            os.pwrite(fd, b, off)
        return os.pread(fd, os.fstat(fd).st_size + 1, 0)
    finally:
        os.close(fd)
        os.unlink(ref)


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("n", [5 * BLOCK, 5 * BLOCK + 100, 3 * BLOCK - 512, 1])
@pytest.mark.parametrize("offset", [0, 4096, 777])
def test_write_past_end_grows_first(handle, tmp_dir, n, offset):
    path = tmp_dir / "f.bin"
    src = _data(n, n + offset)
    with handle.open(path, "w+") as f:
        assert f.state.known_size == 0
        assert handle.pwrite(src, f, offset) == n
        if n > BLOCK and f.direct:
            # several pieces past the end: the file was extended to the write's end first
            assert f.state.known_size == offset + n
    assert _read(path) == _plain(path, [(offset, src.numpy().tobytes())])
    assert os.stat(path).st_size == offset + n


def test_write_far_past_the_end_keeps_the_hole(handle, tmp_dir):
    """Only the write's own blocks are allocated: a hole before it stays a hole."""
    path = tmp_dir / "sparse.bin"
    src = _data(4 * BLOCK, 9)
    at = 1 << 30
    with handle.open(path, "w+") as f:
        assert handle.pwrite(src, f, at) == src.numel()
    st = os.stat(path)
    assert st.st_size == at + src.numel()
    assert st.st_blocks * 512 < 64 * BLOCK          # not a gigabyte of allocated zeros
    with open(path, "rb") as g:
        assert g.read(4096) == bytes(4096)
        g.seek(at)
        assert g.read() == src.numpy().tobytes()


def test_concurrent_writes_in_any_order(handle, tmp_dir):
    """Unaligned neighbours submitted at once, the last first: every byte lands, the file
    ends exactly where the last write ends (no padding left, nothing cut)."""
    rnd = random.Random(7)
    bounds = sorted(rnd.sample(range(1, 40 * BLOCK), 11))
    bounds = [0] + bounds + [40 * BLOCK + 333]
    src = _data(bounds[-1], 1)
    pieces = list(zip(bounds, bounds[1:]))
    rnd.shuffle(pieces)
    path = tmp_dir / "f.bin"
    with handle.open(path, "w+") as f:
        futs = [handle.pwrite(src[a:b], f, a, async_op=True) for a, b in pieces]
        assert [x.result() for x in futs] == [b - a for a, b in pieces]
    want = src.numpy().tobytes()
    assert _read(path) == want == _plain(path, [(a, want[a:b]) for a, b in pieces])


def test_burst_of_small_appends(handle, tmp_dir):
    """One-piece writes of a burst past the end (each grows the file, trusting what it
    knows), then the same after the file was cut short behind the handle's back: they
    extend it themselves, nothing is lost."""
    path = tmp_dir / "f.bin"
    src = _data(64 * 4096, 2)
    items = lambda lo, hi: [(src[i * 4096:(i + 1) * 4096], path, i * 4096)  # noqa: E731
                            for i in range(lo, hi)]
    assert handle.pwrite_many(items(0, 64)) == [4096] * 64
    assert _read(path) == src.numpy().tobytes()
    os.truncate(path, 0)                # the handle still knows the file as 256 KiB long
    assert handle.pwrite_many(items(0, 32)) == [4096] * 32
    assert _read(path) == src[:32 * 4096].numpy().tobytes()


def test_cut_short_then_a_large_write(handle, tmp_dir):
    """A write of several pieces always asks the file its length: after the file was cut
    short by someone else, it is grown again, and known_size follows."""
    path = tmp_dir / "f.bin"
    src = _data(8 * BLOCK, 3)
    with handle.open(path, "w+") as f:
        handle.pwrite(src, f, 0)
        os.truncate(path, BLOCK)
        handle.pwrite(src[:4 * BLOCK + 5], f, 2 * BLOCK)
        if f.direct:
            assert f.state.known_size == 6 * BLOCK + 5
    want = bytearray(src[:BLOCK].numpy().tobytes()) + bytes(BLOCK)
    want += src[:4 * BLOCK + 5].numpy().tobytes()
    assert _read(path) == bytes(want)


def test_truncating_open_forgets_the_length(handle, tmp_dir):
    path = tmp_dir / "f.bin"
    src = _data(4 * BLOCK, 4)
    with handle.open(path, "w+") as f:
        handle.pwrite(src, f, 0)
        state = f.state
        if f.direct:
            assert state.known_size == 4 * BLOCK
        with handle.open(path, "w") as g:       # the same inode, cut to 0
            assert g.state is state and state.known_size == 0
            handle.pwrite(src[:2 * BLOCK + 9], g, 0)
    assert _read(path) == src[:2 * BLOCK + 9].numpy().tobytes()


def test_block_device_is_never_grown(tmp_dir):
    """A loop device (its size is not a file's): writes past nothing, no fallocate; the
    engine remembers it and the bytes are exact."""
    import shutil
    import subprocess
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("needs root and losetup")
    backing = tmp_dir / "loop.img"
    with open(backing, "wb") as f:
        f.truncate(4 << 20)
    r = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"no loop device here: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        src = _data(8 * BLOCK, 5)
        with aioswap.AioHandle(block_size=BLOCK) as h, h.open(dev, "r+") as f:
            assert h.pwrite(src, f, 4096) == src.numel()
            h.pwrite(src[:2 * BLOCK], f, 0, async_op=True).result()
            assert f.state.known_size == 0
        fd = os.open(dev, os.O_RDONLY)
        try:
            got = os.pread(fd, 8 * BLOCK + 4096, 0)
        finally:
            os.close(fd)
        want = src[:2 * BLOCK].numpy().tobytes() + src.numpy().tobytes()[2 * BLOCK - 4096:]
        assert got == want
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
