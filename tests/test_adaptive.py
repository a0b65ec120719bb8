"""Reads that adapt to the page cache (aioswap._adaptive): the residency probe, the mode in
force, the copy threads."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from aioswap import _adaptive


def _file(p: Path, n: int) -> bytes:
    data = os.urandom(n)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return data


def test_cached_bytes_follows_the_page_cache(tmp_dir: Path) -> None:
    p = tmp_dir / "f.bin"
    _file(p, 8 << 20)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _adaptive.cached_bytes(fd, 0, 8 << 20) > 1 << 20:
            pytest.skip("this file system keeps the pages (tmpfs?)")
        assert _adaptive.cached_bytes(fd, 0, 8 << 20) < 1 << 20
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)    # no read-ahead past it
        os.pread(fd, 4 << 20, 0)                        # the first half now cached
        got = _adaptive.cached_bytes(fd, 0, 4 << 20)
        assert got >= (4 << 20) * 0.9
        assert not _adaptive.choose("auto", True, fd, 4 << 20, 4 << 20)   # not cached: direct
        assert _adaptive.choose("auto", True, fd, 0, 4 << 20)             # cached: copied
        assert not _adaptive.choose("direct", True, fd, 0, 4 << 20)
        assert _adaptive.choose("buffered", True, fd, 4 << 20, 4 << 20)
        assert _adaptive.choose("direct", False, fd, 0, 4 << 20)           # no O_DIRECT
        assert _adaptive.cached_bytes(fd, 0, 0) == 0
    finally:
        os.close(fd)


def test_read_mode_argument_environment_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOSWAP_READ", raising=False)
    assert _adaptive.read_mode(None) == "auto"
    monkeypatch.setenv("AIOSWAP_READ", "Buffered")
    assert _adaptive.read_mode(None) == "buffered"
    assert _adaptive.read_mode("direct") == "direct"        # the argument wins
    monkeypatch.setenv("AIOSWAP_READ", "fast")
    with pytest.raises(ValueError, match="AIOSWAP_READ='fast'"):
        _adaptive.read_mode(None)
    with pytest.raises(ValueError, match="read='mmap'"):
        _adaptive.read_mode("mmap")


@pytest.mark.parametrize("n,offset", [(1, 0), (4095, 3), (8 << 20, 0), ((19 << 20) + 7, 4097)])
def test_copy_pool_is_byte_exact(tmp_dir: Path, n: int, offset: int) -> None:
    p = tmp_dir / "c.bin"
    data = _file(p, n + offset + 11)
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = bytearray(n)
        assert _adaptive.copy_pool.read(fd, memoryview(buf), offset, str(p)).result() == n
        assert bytes(buf) == data[offset:offset + n]
    finally:
        os.close(fd)


def test_copy_pool_names_a_short_file(tmp_dir: Path) -> None:
    p = tmp_dir / "s.bin"
    _file(p, 1000)
    fd = os.open(p, os.O_RDONLY)
    try:
        fut = _adaptive.copy_pool.read(fd, memoryview(bytearray(5000)), 10, "the file")
        from aioswap.errors import ShortReadError
        with pytest.raises(ShortReadError, match="the file: the file ends at byte 1000"):
            fut.result()
    finally:
        os.close(fd)


def drop(p: Path) -> None:
    """Write ``p`` back and drop its pages from the page cache."""
    from aioswap.tune import drop_cache
    drop_cache(str(p))


def _drop_dir(d: Path) -> None:
    for p in d.iterdir():
        if p.name.startswith(("p-", "t-")):
            drop(p)


def _warm_dir(d: Path) -> None:
    for p in d.iterdir():
        if p.name.startswith(("p-", "t-")):
            p.read_bytes()


@pytest.mark.parametrize("read", [None, "direct", "buffered"])
@pytest.mark.parametrize("cache", ["cold", "warm", "half"])
def test_swap_in_adapts_and_is_byte_exact(tmp_dir: Path, read: str | None, cache: str) -> None:
    import torch

    from aioswap.swap import TensorSwapper
    g = torch.Generator().manual_seed(3)
    sd = {f"w{i}": torch.randn(200_003 + 977 * i, generator=g).to(
        torch.bfloat16 if i % 2 else torch.float32) for i in range(6)}
    sd["small"] = torch.arange(5, dtype=torch.int16)
    d = tmp_dir / "s"
    with TensorSwapper(d, pack_bytes=2 << 20, read=read) as sw:
        sw.swap_out_state_dict("m/", sd)
        sw.swap_out("single", sd["w0"][:99_999].clone())
        _drop_dir(d)
        if cache == "warm":
            _warm_dir(d)
        elif cache == "half":       # one pack cached, the others not
            next(p for p in sorted(d.iterdir()) if p.name.startswith("p-")).read_bytes()
        before = _adaptive.stats.snapshot()
        got = sw.swap_in_state_dict("m/")
        assert sorted(got) == sorted(sd)
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        assert torch.equal(sw.swap_in("single"), sd["w0"][:99_999])
        after = _adaptive.stats.snapshot()
    copied = after["buffered_bytes"] - before["buffered_bytes"]
    direct = after["direct_bytes"] - before["direct_bytes"]
    total = sum(t.numel() * t.element_size() for t in sd.values()) + 99_999 * 4
    assert copied + direct >= total         # direct reads may take whole blocks
    if read == "direct" or (read is None and cache == "cold"):
        assert copied == 0
    if read == "buffered" or (read is None and cache == "warm"):
        assert direct == 0
    if read is None and cache == "half":
        assert 0 < copied < total


def test_swapper_refuses_a_bad_read_mode(tmp_dir: Path) -> None:
    from aioswap.swap import TensorSwapper
    with pytest.raises(ValueError, match="read='fast'"):
        TensorSwapper(tmp_dir / "x", read="fast")


@pytest.mark.parametrize("read", [None, "direct", "buffered"])
@pytest.mark.parametrize("cache", ["cold", "warm", "half", "tmpfs"])
def test_safetensors_loads_adapt_and_are_byte_exact(tmp_dir: Path, read: str | None,
                                                   cache: str) -> None:
    import torch
    from safetensors.torch import load_file as st_load
    from safetensors.torch import save_file as st_save

    import aioswap.safetensors as ast
    g = torch.Generator().manual_seed(5)
    sd = {f"t{i:02d}": torch.randn(300_001 + 4099 * i, generator=g).to(
        [torch.float32, torch.bfloat16, torch.float16][i % 3]) for i in range(24)}
    sd["empty"] = torch.empty(0, 3)
    sd["flag"] = torch.rand(999, generator=g) > 0.5
    if cache == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        import tempfile
        base = Path(tempfile.mkdtemp(dir="/dev/shm"))
    else:
        base = tmp_dir
    p = base / "m.safetensors"
    try:
        st_save(sd, str(p))
        want = st_load(str(p))
        if cache != "tmpfs":
            drop(p)
        if cache == "warm":
            p.read_bytes()
        elif cache == "half":
            with open(p, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)   # no read-ahead
                f.read(p.stat().st_size // 2)
        before = _adaptive.stats.snapshot()
        got = ast.load_file(p, read=read)
        after = _adaptive.stats.snapshot()
        assert list(got) == list(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
        copied = after["buffered_bytes"] - before["buffered_bytes"]
        direct = after["direct_bytes"] - before["direct_bytes"]
        if read == "buffered" or (read is None and cache in ("warm", "tmpfs")):
            assert direct == 0 and copied > 0       # tmpfs: all in the cache (or no O_DIRECT)
        elif read == "direct" and cache == "tmpfs":     # tmpfs takes O_DIRECT since 6.6
            assert copied + direct > 0
        elif read == "direct" or (read is None and cache == "cold"):
            assert copied == 0 and direct > 0
        else:
            assert copied > 0 and direct > 0
        if cache != "tmpfs":
            drop(p)
        names = [n for n, _ in ast.iter_file(p, read=read)]
        assert sorted(names) == sorted(want)
    finally:
        if cache == "tmpfs":
            import shutil
            shutil.rmtree(base, ignore_errors=True)
    with pytest.raises(ValueError, match="read='fast'"):
        ast.load_file(p, read="fast")


def test_a_range_cached_in_part_is_copied_and_read_direct_at_once(tmp_dir: Path) -> None:
    """A 128 MiB range cached in alternate 32 MiB stretches: auto copies those and reads the
    others direct (one future for all of it); cached in alternate 4 MiB stretches, the holes
    are read through the cache too; cold it reads all direct, warm it copies all. Every
    read byte-exact."""
    import torch

    import aioswap
    p = tmp_dir / "h.bin"
    size = 128 << 20
    data = _file(p, size + (1 << 20))
    with aioswap.AioHandle() as h, h.open(p, "r") as f:
        if not f.direct:
            pytest.skip("this file system takes no O_DIRECT")
        for state, stretch in (("cold", 0), ("split", 32 << 20), ("holes", 4 << 20),
                               ("warm", 0)):
            drop(p)
            fd = os.open(p, os.O_RDONLY)
            try:
                if _adaptive.cached_bytes(fd, 0, size) > 1 << 20:
                    pytest.skip("this file system keeps the pages (tmpfs?)")
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)    # no read-ahead past it
                if state == "warm":
                    os.pread(fd, size, 4096)
                for o in range(0, size if stretch else 0, 2 * stretch or 1):
                    os.pread(fd, stretch, 4096 + o)
            finally:
                os.close(fd)
            r = _adaptive.Reader("auto", "test")
            dst = torch.empty(size, dtype=torch.uint8)
            assert r.pread(f, dst, 4096).result() == size
            copied, direct = r.copied, r.direct
            r.close()
            assert dst.numpy().tobytes() == data[4096:4096 + size], state
            assert copied + direct == size
            if state == "cold":
                assert copied == 0
            elif state in ("warm", "holes"):
                assert direct == 0, (state, copied, direct)
            else:       # pieces aligned to 4 MiB in the file: each run is cut by 4 KiB
                assert abs(copied - size // 2) <= 8 << 20, (copied, direct)
