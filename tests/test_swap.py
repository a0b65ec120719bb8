"""TensorSwapper: byte-exact round trips, crash safety, corruption, memory, bad input."""
from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioswap
from aioswap.errors import ChecksumError, HandleClosedError, SwapError
from aioswap.swap import MANIFEST_NAME, TensorSwapper, checksum_algorithms

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
           torch.complex128]
_DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "uint16") if hasattr(torch, n)]


def _bytes(t: torch.Tensor) -> bytes:
    """Row-major bytes of a tensor (byte-exact comparison, NaN payloads included)."""
    # clone: .numpy() on the caller's tensor would make its storage non-resizable
    return t.detach().resolve_conj().resolve_neg().clone(
        memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8).numpy().tobytes()


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes of the given shape and dtype (0/1 for bool)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    numel = 1
    for s in shape:
        numel *= s
    es = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * es,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _mixed_state_dict(n: int = 120, *, releasable: bool = False) -> dict[str, torch.Tensor]:
    """``n`` tensors: every dtype, 0-dim, empty, large-ish, and non-contiguous ones.

    ``releasable``: only tensors that span their whole storage (transposes/permutes are
    non-contiguous but release-able; slices with steps are not).
    """
    gen = torch.Generator().manual_seed(1234)
    shapes = [(), (0,), (3, 0, 2), (1,), (7,), (5, 3), (2, 3, 4), (33, 17), (1, 1, 1, 1),
              (4096,), (300, 257), (2, 65537)]
    sd: dict[str, torch.Tensor] = {}
    for i in range(n):
        dtype = _DTYPES[i % len(_DTYPES)]
        shape = shapes[(i * 7) % len(shapes)]
        t = _rand(shape, dtype, gen)
        kind = i % 5
        if kind == 1 and t.dim() >= 2:
            t = t.transpose(0, 1)                      # non-contiguous, whole storage
        elif kind == 2 and t.dim() >= 3:
            t = t.permute(*range(t.dim() - 1, -1, -1))
        elif kind == 3 and not releasable and t.dim() >= 1 and t.shape[0] > 1:
            t = _rand((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype, gen)[::2]   # strided
        elif kind == 4 and not releasable and t.dim() >= 2 and t.shape[1] > 2:
            t = t[:, 1:-1]                             # view with an offset
        sd[f"layer{i}.{'weight' if i % 2 else 'bias'}"] = t
    return sd


def _snapshot(sd: dict[str, torch.Tensor]) -> dict[str, tuple[bytes, tuple[int, ...], torch.dtype]]:
    return {k: (_bytes(v), tuple(v.shape), v.dtype) for k, v in sd.items()}


def _check(snap: dict[str, tuple[bytes, tuple[int, ...], torch.dtype]],
           got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(snap)
    for k, (data, shape, dtype) in snap.items():
        assert tuple(got[k].shape) == shape, k
        assert got[k].dtype == dtype, k
        assert _bytes(got[k]) == data, k


def _data_files(d: Path) -> list[str]:
    """Single-tensor files (t-) and packs (p-)."""
    return sorted(p.name for p in d.iterdir() if p.name[:2] in ("t-", "p-"))


def _written(p: Path) -> int:
    """Bytes of ``p`` that hold written data (``SEEK_DATA``/``SEEK_HOLE``): packs are sized up
    front, and a write past the end allocates its blocks first (``fallocate``), so neither
    the size nor the allocated blocks tell how far a write got; blocks allocated but not
    written yet read as holes."""
    fd = os.open(p, os.O_RDONLY)
    total = pos = 0
    try:
        while True:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:        # no data after pos
                    return total
                raise
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            total += pos - start
    finally:
        os.close(fd)


def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST_NAME).read_text())


def _run_child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


@pytest.fixture
def swapper(tmp_dir: Path):
    with TensorSwapper(tmp_dir / "swap") as sw:
        yield sw


# ----------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("release", [False, True], ids=["keep", "release"])
def test_state_dict_round_trip(tmp_dir: Path, async_op: bool, release: bool) -> None:
    sd = _mixed_state_dict(120, releasable=release)
    assert any(v.dim() == 0 for v in sd.values())
    assert any(v.numel() == 0 for v in sd.values())
    assert any(not v.is_contiguous() for v in sd.values())
    assert len({v.dtype for v in sd.values()}) >= 12
    snap = _snapshot(sd)
    objects = dict(sd)
    with TensorSwapper(tmp_dir / "s") as sw:
        r = sw.swap_out_state_dict("model/", sd, release=release, async_op=async_op)
        names = r.result() if async_op else r
        assert names == [f"model/{k}" for k in sd]
        assert sw.names() == names
        if release:
            for k, v in sd.items():
                assert v.untyped_storage().nbytes() == 0 or v.numel() == 0, k
                assert sw.info(f"model/{k}").released
        r2 = sw.swap_in_state_dict("model/", async_op=async_op)
        got = r2.result() if async_op else r2
        _check(snap, got)
        if release:     # restored in place: the caller's own tensors hold the data again
            for k, v in objects.items():
                assert got[k] is v, k
                assert tuple(got[k].stride()) == tuple(v.stride())
            assert not any(sw.info(n).released for n in names)
    with TensorSwapper(tmp_dir / "s") as sw:       # and from a fresh process view
        assert sw.names() == names
        _check(snap, sw.swap_in_state_dict("model/"))


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_single_tensor_round_trips(swapper: TensorSwapper, async_op: bool) -> None:
    sd = _mixed_state_dict(40)
    snap = _snapshot(sd)
    results = {k: swapper.swap_out(k, v, async_op=async_op) for k, v in sd.items()}
    if async_op:
        assert swapper.wait() == len(sd)
        results = {k: f.result() for k, f in results.items()}
    for k, v in sd.items():
        info = results[k]
        assert info.nbytes == v.numel() * v.element_size()
        assert os.path.getsize(info.file) == info.nbytes          # no padding on disk
        assert os.path.dirname(info.file) == swapper.directory
        assert info.shape == tuple(v.shape) and info.dtype == v.dtype
        assert info.stride == tuple(v.stride())
    got = {k: swapper.swap_in(k, async_op=async_op) for k in sd}
    if async_op:
        got = {k: f.result() for k, f in got.items()}
    _check(snap, got)
    for k, v in got.items():
        assert v.is_contiguous()
    # into out tensors, contiguous and not
    outs = {k: (torch.empty(tuple(v.shape)[::-1], dtype=v.dtype).t() if v.dim() == 2
                else torch.empty_like(v)) for k, v in got.items()}
    assert any(not o.is_contiguous() for o in outs.values())
    for k, o in outs.items():
        r = swapper.swap_in(k, out=o, async_op=async_op)
        assert (r.result() if async_op else r) is o
    _check(snap, outs)


def test_any_string_is_a_safe_name(tmp_dir: Path) -> None:
    names = ["../../etc/passwd", "/abs/path", "a/b/c", ".", "..", "", "\0nul", "x" * 20000,
             "émoji 🚀 名前", "\ud800 lone surrogate", "manifest.json", "aioswap.lock",
             "t-00.bin", "back\\slash", "new\nline"]
    d = tmp_dir / "s"
    with TensorSwapper(d) as sw:
        for i, n in enumerate(names):
            sw.swap_out(n, torch.full((i + 1,), i, dtype=torch.int32))
        assert sw.names() == names
    assert set(os.listdir(tmp_dir)) == {"s"}              # nothing escaped the directory
    files = _data_files(d)
    assert len(files) == len(names)
    assert all(len(f) < 64 for f in files)
    with TensorSwapper(d) as sw:
        assert sw.names() == names
        for i, n in enumerate(names):
            assert torch.equal(sw.swap_in(n), torch.full((i + 1,), i, dtype=torch.int32))


def test_conj_and_neg_views(swapper: TensorSwapper) -> None:
    z = torch.randn(8, 3, dtype=torch.complex64)
    swapper.swap_out("conj", z.conj())
    assert torch.equal(swapper.swap_in("conj"), z.conj().resolve_conj())
    out = torch.zeros(8, 3, dtype=torch.complex64).conj()
    swapper.swap_in("conj", out=out)
    assert torch.equal(out.resolve_conj(), z.conj().resolve_conj())


def test_checksum_algorithms(tmp_dir: Path) -> None:
    assert "crc32" in checksum_algorithms()
    for algo in checksum_algorithms() + [None]:
        with TensorSwapper(tmp_dir / f"s-{algo}", checksum=algo) as sw:
            t = torch.randn(1000)
            info = sw.swap_out("t", t)
            assert info.checksum_algo == algo
            assert (info.checksum is None) == (algo is None)
            assert torch.equal(sw.swap_in("t", verify=True), t)


def test_pin_memory_swap_in(tmp_dir: Path, memlock_room: int | None) -> None:
    with TensorSwapper(tmp_dir / "s", pin_memory=True) as sw:
        # two results locked at once: under a normal user's 8 MiB too
        t = torch.randn((3 * MiB if memlock_room is None else MiB // 2) + 5)
        sw.swap_out("t", t)
        got = sw.swap_in("t")
        assert aioswap.pinned.is_pinned(got)
        assert torch.equal(got, t)
        before = sw.handle.stats.direct_bytes
        sw.swap_in("t")
        assert sw.handle.stats.direct_bytes > before      # read with O_DIRECT into it
        for name, x in [("scalar", torch.tensor(2.5)), ("empty", torch.empty(0, 3))]:
            sw.swap_out(name, x)
            assert torch.equal(sw.swap_in(name), x)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
       dtype=st.sampled_from(_DTYPES),
       view=st.sampled_from(["plain", "t", "step", "expand", "offset"]),
       seed=st.integers(0, 2**31))
def test_property_round_trip(swapper: TensorSwapper, shape: list[int], dtype: torch.dtype,
                             view: str, seed: int) -> None:
    t = _rand(tuple(shape), dtype, torch.Generator().manual_seed(seed))
    if view == "t" and t.dim() >= 2:
        t = t.transpose(-1, -2)
    elif view == "step" and t.dim() >= 1:
        t = t[::2]
    elif view == "expand":
        t = t.unsqueeze(0).expand(3, *t.shape)        # stride 0: overlapping elements
    elif view == "offset" and t.dim() >= 1:
        t = t[1:]
    name = f"p{seed}-{len(swapper)}"
    swapper.swap_out(name, t)
    assert _bytes(swapper.swap_in(name)) == _bytes(t)
    swapper.remove(name)


# ----------------------------------------------------------------------------------------
# Concurrency


def test_many_async_in_flight(tmp_dir: Path) -> None:
    with aioswap.AioHandle(block_size=256 * 1024, queue_depth=8) as h, \
            TensorSwapper(tmp_dir / "s", handle=h, max_inflight=8) as sw:
        tensors = {f"t{i}": torch.randn(64 * 1024 + i * 1000) for i in range(64)}
        futs = [sw.swap_out(k, v, async_op=True) for k, v in tensors.items()]
        assert sw.wait() == 64
        assert all(f.done() and f.exception() is None for f in futs)
        assert len(_manifest(Path(sw.directory))["entries"]) == 64
        outs = {k: torch.empty_like(v) for k, v in tensors.items()}
        futs2 = [sw.swap_in(k, out=outs[k], async_op=True) for k in tensors]
        for f in futs2:
            f.result()
        for k, v in tensors.items():
            assert torch.equal(outs[k], v)
        assert h.stats.writes >= 64 and h.stats.reads >= 64


def test_staging_of_non_contiguous_tensors_is_bounded(tmp_dir: Path) -> None:
    from aioswap import _swap_write

    peak = [0]

    class Tracking(_swap_write.ByteBudget):
        def acquire(self, n: int) -> None:
            super().acquire(n)
            peak[0] = max(peak[0], self._used)

    with TensorSwapper(tmp_dir / "s", staging_bytes=3 * MiB, max_inflight=8) as sw:
        sw._staging = Tracking(3 * MiB)
        tensors = {f"nc{i}": torch.randn(1024, 512).t() for i in range(16)}   # 2 MiB each
        for k, v in tensors.items():
            sw.swap_out(k, v, async_op=True)
        assert sw.wait() == 16
        for k, v in tensors.items():
            assert torch.equal(sw.swap_in(k), v)
    assert 0 < peak[0] <= 3 * MiB          # at most one 2 MiB copy alive at a time here


def test_threads_share_one_swapper(swapper: TensorSwapper) -> None:
    errors: list[BaseException] = []

    def work(tid: int) -> None:
        try:
            for i in range(15):
                t = torch.full((1000 + i,), tid * 100 + i, dtype=torch.int64)
                swapper.swap_out(f"th{tid}/{i}", t)
                assert torch.equal(swapper.swap_in(f"th{tid}/{i}"), t)
        except BaseException as exc:    # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(swapper) == 90
    assert len(_manifest(Path(swapper.directory))["entries"]) == 90


def test_swap_in_waits_for_swap_out_of_same_name(swapper: TensorSwapper) -> None:
    t = torch.randn(16 * MiB // 4)
    fut = swapper.swap_out("big", t, async_op=True)
    got = swapper.swap_in("big")             # waits for the in-flight swap-out
    assert fut.done()
    assert torch.equal(got, t)


def test_async_release_then_swap_in(swapper: TensorSwapper) -> None:
    t = torch.randn(4 * MiB // 4)
    ref = t.clone()
    alias = t.view(2, -1)
    fut = swapper.swap_out("t", t, release=True, async_op=True)
    fut.result()
    assert t.untyped_storage().nbytes() == 0
    f1 = swapper.swap_in("t", async_op=True)
    f2 = swapper.swap_in("t", async_op=True)     # a second request gets the same restore
    assert f1.result() is t and f2.result() is t
    assert torch.equal(t, ref) and torch.equal(alias.reshape(-1), ref)


# ----------------------------------------------------------------------------------------
# Durability: reopen, orphans, directory ownership, locking


def test_reopen_removes_only_own_orphans(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    d.mkdir()
    (d / "notes.txt").write_text("user data")
    (d / "t-mine.bin").write_text("not ours: wrong pattern")
    with TensorSwapper(d) as sw:
        sw.swap_out("a", torch.arange(10))
        assert not sw.created_directory
    orphan = d / ("t-" + "0" * 32 + "-" + "1" * 16 + ".bin")
    orphan.write_bytes(b"partial")
    (d / (MANIFEST_NAME + ".tmp")).write_text("{half")
    with TensorSwapper(d) as sw:
        assert sw.names() == ["a"]
        assert torch.equal(sw.swap_in("a"), torch.arange(10))
    assert not orphan.exists()
    assert not (d / (MANIFEST_NAME + ".tmp")).exists()
    assert (d / "notes.txt").read_text() == "user data"
    assert (d / "t-mine.bin").exists()


def test_destroy_keeps_directories_it_did_not_create(tmp_dir: Path) -> None:
    foreign = tmp_dir / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    sw = TensorSwapper(foreign)
    sw.swap_out("a", torch.ones(3))
    sw.destroy()
    assert sw.closed
    assert sorted(os.listdir(foreign)) == ["keep.txt"]

    mine = tmp_dir / "parent" / "mine"
    sw = TensorSwapper(mine)
    assert sw.created_directory
    sw.swap_out("a", torch.ones(3))
    sw.close()
    with TensorSwapper(mine) as sw2:       # the marker survives a reopen
        assert sw2.created_directory
        assert sw2.names() == ["a"]
    sw3 = TensorSwapper(mine)
    sw3.destroy()
    assert not mine.exists()
    assert (tmp_dir / "parent").is_dir()   # only the directory it created

    mine2 = tmp_dir / "mine2"
    sw = TensorSwapper(mine2)
    (mine2 / "user.txt").write_text("added by a user")
    sw.destroy()
    assert (mine2 / "user.txt").exists()   # never a tree: a non-empty directory stays


def test_close_keeps_data_and_is_idempotent(tmp_dir: Path) -> None:
    sw = TensorSwapper(tmp_dir / "s")
    sw.swap_out("a", torch.arange(5))
    sw.close()
    sw.close()
    with pytest.raises(HandleClosedError):
        sw.swap_in("a")
    with pytest.raises(HandleClosedError):
        sw.swap_out("b", torch.ones(1))
    with TensorSwapper(tmp_dir / "s") as sw2:
        assert torch.equal(sw2.swap_in("a"), torch.arange(5))


def test_directory_lock(tmp_dir: Path) -> None:
    with TensorSwapper(tmp_dir / "s"):
        with pytest.raises(SwapError, match=f"in use .*pid {os.getpid()}"):
            TensorSwapper(tmp_dir / "s")
        r = _run_child("""
            import sys
            from aioswap.errors import SwapError
            from aioswap.swap import TensorSwapper
            try:
                TensorSwapper(sys.argv[1])
            except SwapError as exc:
                print("REFUSED", exc)
            """, str(tmp_dir / "s"))
        assert "REFUSED" in r.stdout, r.stderr
    with TensorSwapper(tmp_dir / "s"):      # free again once closed
        pass


def test_user_handle_stays_open(tmp_dir: Path) -> None:
    with aioswap.AioHandle() as h:
        with TensorSwapper(tmp_dir / "s", handle=h) as sw:
            assert sw.handle is h
            sw.swap_out("a", torch.ones(4))
        assert not h.closed
        with pytest.raises(ValueError):
            TensorSwapper(tmp_dir / "t", handle=h, config=aioswap.config.AioConfig())


_CRASH_CHILD = """
    import sys, torch
    import aioswap
    from aioswap.swap import TensorSwapper
    d = sys.argv[1]
    # small blocks and one request in flight: the big write takes long enough to be killed
    h = aioswap.AioHandle(block_size=64 * 1024, queue_depth=1)
    sw = TensorSwapper(d, handle=h)
    for i in range(5):
        sw.swap_out(f"small{i}", torch.full((1000 + i,), float(i)))
    sw.swap_out("old", torch.full((100,), 7.0))
    big = torch.ones(512 * 2**20 // 4)
    print("STARTED", flush=True)
    if sys.argv[2] == "overwrite":
        sw.swap_out("old", big, overwrite=True)
    else:
        sw.swap_out_state_dict("sd/", {"a": torch.ones(10), "big": big})
    print("DONE", flush=True)
"""


@pytest.mark.parametrize("mode", ["overwrite", "state_dict"])
def test_sigkill_mid_swap_out(tmp_dir: Path, mode: str) -> None:
    d = tmp_dir / "crash"
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CRASH_CHILD), str(d), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "STARTED", (line, p.stderr.read() if p.stderr else "")
        published = {e["file"] for e in _manifest(d)["entries"]}
        deadline = time.monotonic() + 30
        partial = []
        while time.monotonic() < deadline:      # kill once the big file is being written
            partial = [f for f in _data_files(d) if f not in published
                       and _written(d / f) > 8 * MiB]
            if partial:
                break
            time.sleep(0.005)
        assert partial, "the big swap_out never started writing"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stdout:
            p.stdout.close()
        if p.stderr:
            p.stderr.close()
    assert p.returncode == -signal.SIGKILL
    size = _written(d / partial[0])
    assert 0 < size < 512 * MiB                       # really interrupted mid-write
    with TensorSwapper(d, verify=True) as sw:
        assert sw.names() == [f"small{i}" for i in range(5)] + ["old"]
        for i in range(5):
            assert torch.equal(sw.swap_in(f"small{i}"), torch.full((1000 + i,), float(i)))
        assert torch.equal(sw.swap_in("old"), torch.full((100,), 7.0))   # old version intact
        assert "sd/a" not in sw                        # a state dict is all or nothing
    assert len(_data_files(d)) == 6                    # the partial file was removed


# ----------------------------------------------------------------------------------------
# Corruption


def test_truncated_or_extended_file_is_reported(swapper: TensorSwapper) -> None:
    t = torch.randn(10000)
    info = swapper.swap_out("t", t)
    os.truncate(info.file, info.nbytes - 1)
    out = torch.zeros(10000)
    with pytest.raises(SwapError, match=r"truncated.*39999 bytes.*40000 bytes") as ei:
        swapper.swap_in("t", out=out, verify=False)
    assert info.file in str(ei.value)
    assert torch.count_nonzero(out) == 0              # detected before any I/O
    with open(info.file, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(SwapError, match="longer than recorded"):
        swapper.swap_in("t")
    assert swapper.names() == ["t"]
    os.unlink(info.file)
    with pytest.raises(SwapError, match="missing"):
        swapper.swap_in("t")


@pytest.mark.parametrize("nbytes", [40000, 136 * MiB], ids=["small", "chunked"])
def test_corrupted_byte_fails_checksum(swapper: TensorSwapper, nbytes: int) -> None:
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    info = swapper.swap_out("t", t)
    pos = nbytes - 3
    with open(info.file, "r+b") as f:
        f.seek(pos)
        old = f.read(1)
        f.seek(pos)
        f.write(bytes([old[0] ^ 0x40]))
        os.fsync(f.fileno())
    with pytest.raises(ChecksumError, match="checksum mismatch.*corrupted"):
        swapper.swap_in("t", verify=True)
    got = swapper.swap_in("t", verify=False)          # asked not to check: raw bytes
    assert int(got[pos]) == old[0] ^ 0x40
    with pytest.raises(ChecksumError):
        swapper.swap_in("t", out=torch.empty_like(t), async_op=True).result()


def test_corrupted_release_stays_released(swapper: TensorSwapper) -> None:
    t = torch.randn(5000)
    swapper.swap_out("t", t, release=True)
    info = swapper.info("t")
    with open(info.file, "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(ChecksumError):
        swapper.swap_in("t")
    assert t.untyped_storage().nbytes() == 0          # no unverified data handed out
    assert swapper.info("t").released


def test_corrupt_manifest_is_reported(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    with TensorSwapper(d) as sw:
        sw.swap_out("a", torch.ones(2))
    m = _manifest(d)
    m["entries"][0]["file"] = "../../outside.bin"
    (d / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(SwapError, match="not a swap data file"):
        TensorSwapper(d)
    (d / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(SwapError, match="not valid JSON"):
        TensorSwapper(d)
    m["version"] = 99
    (d / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(SwapError, match="version 99"):
        TensorSwapper(d)


# ----------------------------------------------------------------------------------------
# Memory


_RSS_CHILD = """
    import json, sys, torch
    from aioswap.swap import TensorSwapper

    def rss():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024

    n = 16
    sd = {f"t{i}": torch.full((2**24,), i + 1, dtype=torch.int32) for i in range(n)}
    for i, t in enumerate(sd.values()):
        t[::4097] = torch.arange(t[::4097].numel(), dtype=torch.int32) * (i + 3)
    alias = {k: v.view(2, -1) for k, v in sd.items()}      # other references to the data
    with TensorSwapper(sys.argv[1]) as sw:
        r0 = rss()
        sw.swap_out_state_dict("sd/", sd, release=True)
        r1 = rss()
        got = sw.swap_in_state_dict("sd/")
        r2 = rss()
        ok = all(got[k] is sd[k] for k in sd)
        for i in range(n):
            t = alias[f"t{i}"].reshape(-1)
            ok = ok and torch.equal(t[::4097], torch.arange(t[::4097].numel(),
                                                            dtype=torch.int32) * (i + 3))
            t[::4097] = i + 1
            ok = ok and bool((t == i + 1).all())
    print(json.dumps({"before": r0, "released": r1, "restored": r2, "ok": ok}))
"""


def test_release_returns_memory(tmp_dir: Path) -> None:
    r = _run_child(_RSS_CHILD, str(tmp_dir / "s"))
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    GiB = 1 << 30
    assert m["ok"]
    assert m["before"] - m["released"] >= 0.8 * GiB, m
    assert m["restored"] - m["released"] >= 0.8 * GiB, m


# ----------------------------------------------------------------------------------------
# Bad input


def test_unknown_name(swapper: TensorSwapper) -> None:
    with pytest.raises(SwapError, match="no tensor named 'nope'"):
        swapper.swap_in("nope")
    with pytest.raises(SwapError, match="no tensor named"):
        swapper.info("nope")
    with pytest.raises(SwapError, match="no tensor named"):
        swapper.remove("nope")
    with pytest.raises(SwapError, match="starts with .nothing/."):
        swapper.swap_in_state_dict("nothing/")
    with pytest.raises(TypeError):
        swapper.swap_in(3)      # type: ignore[arg-type]


def test_duplicate_name_needs_overwrite(swapper: TensorSwapper) -> None:
    d = Path(swapper.directory)
    swapper.swap_out("a", torch.ones(4))
    before = _data_files(d)
    with pytest.raises(SwapError, match="already swapped out.*overwrite=True"):
        swapper.swap_out("a", torch.zeros(4))
    with pytest.raises(SwapError, match="already swapped out"):
        swapper.swap_out_state_dict("", {"b": torch.ones(1), "a": torch.ones(1)})
    assert "b" not in swapper                     # checked before any I/O
    assert _data_files(d) == before
    assert torch.equal(swapper.swap_in("a"), torch.ones(4))
    swapper.swap_out("a", torch.zeros(7, dtype=torch.int8), overwrite=True)
    assert torch.equal(swapper.swap_in("a"), torch.zeros(7, dtype=torch.int8))
    swapper.wait()          # the old file is unlinked on a background thread: done by wait()
    assert len(_data_files(d)) == 1 and _data_files(d) != before   # old file deleted
    assert [e["name"] for e in _manifest(d)["entries"]] == ["a"]


def test_wrong_out(swapper: TensorSwapper) -> None:
    swapper.swap_out("a", torch.arange(12, dtype=torch.float32).view(3, 4))
    out = torch.full((4, 3), -1.0)
    with pytest.raises(SwapError, match=r"shape \(4, 3\).*shape \(3, 4\)"):
        swapper.swap_in("a", out=out)
    with pytest.raises(SwapError, match="dtype torch.float64.*torch.float32"):
        swapper.swap_in("a", out=torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(TypeError):
        swapper.swap_in("a", out=[1, 2])        # type: ignore[arg-type]
    empty = torch.zeros(3, 4)
    empty.untyped_storage().resize_(0)
    with pytest.raises(SwapError, match="no data"):
        swapper.swap_in("a", out=empty)
    assert torch.equal(out, torch.full((4, 3), -1.0))


def test_bad_tensors(swapper: TensorSwapper) -> None:
    import numpy as np
    base = torch.randn(10, 10)
    with pytest.raises(SwapError, match="view of part of a larger storage"):
        swapper.swap_out("v", base[2:5], release=True)
    with pytest.raises(SwapError, match="not resizable"):
        swapper.swap_out("np", torch.from_numpy(np.ones(4)), release=True)
    with pytest.raises(TypeError):
        swapper.swap_out("s", torch.eye(3).to_sparse())
    with pytest.raises(TypeError):
        swapper.swap_out("n", np.ones(3))       # type: ignore[arg-type]
    with pytest.raises(TypeError):
        swapper.swap_out(b"bytes", torch.ones(1))     # type: ignore[arg-type]
    assert swapper.names() == []
    t = torch.ones(100)
    swapper.swap_out("t", t, release=True)
    with pytest.raises(SwapError, match="swapped out as 't' with release=True"):
        swapper.swap_out("t2", t)           # a released tensor refuses every use
    with pytest.raises(SwapError, match="release=True and not swapped in"):
        swapper.remove("t")
    w = torch.randn(4, 4)
    with pytest.raises(SwapError, match="shares its storage"):
        swapper.swap_out_state_dict("tied/", {"emb": w, "head": w}, release=True)
    assert swapper.names() == ["t"]
    swapper.remove("t", force=True)
    assert swapper.names() == []


_FULL_DISK_CHILD = """
    import errno, json, resource, signal, sys, torch
    from aioswap.swap import TensorSwapper
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = 8 * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    res = {}
    with TensorSwapper(sys.argv[1]) as sw:
        sw.swap_out("a", torch.arange(1000))
        sw.swap_out("old", torch.full((10,), 7))
        for label, call in [
                ("new", lambda: sw.swap_out("big", torch.ones(4 * 2**20))),
                ("overwrite", lambda: sw.swap_out("old", torch.ones(4 * 2**20),
                                                  overwrite=True)),
                ("async", lambda: sw.swap_out("big2", torch.ones(4 * 2**20),
                                              async_op=True).result()),
                ("state_dict", lambda: sw.swap_out_state_dict(
                    "sd/", {"x": torch.ones(3), "y": torch.ones(4 * 2**20)}))]:
            try:
                call()
                res[label] = "no error"
            except OSError as exc:
                res[label] = [exc.errno, str(exc)]
        res["names"] = sw.names()
        res["old"] = sw.swap_in("old").tolist()
        sw.swap_out("after", torch.ones(5))       # still usable
        res["names_after"] = sw.names()
    print(json.dumps(res))
"""


def test_full_disk_rlimit_fsize(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    r = _run_child(_FULL_DISK_CHILD, str(d))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    import errno
    for label in ("new", "overwrite", "async", "state_dict"):
        assert res[label][0] == errno.EFBIG, (label, res[label])
    assert res["names"] == ["a", "old"]
    assert res["old"] == [7] * 10
    assert res["names_after"] == ["a", "old", "after"]
    with TensorSwapper(d) as sw:                  # the manifest on disk agrees
        assert sw.names() == ["a", "old", "after"]
        assert torch.equal(sw.swap_in("a"), torch.arange(1000))
        assert torch.equal(sw.swap_in("old"), torch.full((10,), 7))
    assert len(_data_files(d)) == 3               # no partial files left


# ----------------------------------------------------------------------------------------
# GPU (only where a CUDA device is present)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip(tmp_dir: Path) -> None:
    with TensorSwapper(tmp_dir / "s") as sw:
        sd = {f"g{i}": torch.randn(1000 * (i + 1), device="cuda").view(-1, 10)
              for i in range(8)}
        sd["nc"] = torch.randn(300, 200, device="cuda").t()
        snap = {k: v.cpu() for k, v in sd.items()}
        sw.swap_out_state_dict("gpu/", sd, release=True)
        got = sw.swap_in_state_dict("gpu/")
        for k, v in snap.items():
            assert got[k] is sd[k] and got[k].is_cuda
            assert torch.equal(got[k].cpu(), v)
        got2 = sw.swap_in("gpu/g3", device="cuda")
        assert got2.is_cuda and torch.equal(got2.cpu(), snap["g3"])
        cpu = sw.swap_in("gpu/nc")
        assert torch.equal(cpu, snap["nc"])


# ----------------------------------------------------------------------------------------
# Benchmark smoke test


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
def test_bench_swap_smoke(tmp_dir: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_swap.py"),
                        "--dir", str(tmp_dir), "--repeat", "2", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    methods = res["methods"]
    for key in ("aioswap", "aioswap_noverify", "torch", "direct"):
        assert methods[key]["save_gbps"] > 0 and methods[key]["load_gbps"] > 0
    assert ("safetensors" in methods) == (importlib.util.find_spec("safetensors") is not None)
    assert res["tensors"] == 2 * 16 * 3 and res["min_tensor"] == 64 * 4
    assert res["ratios"]["warm load vs direct"] > 0
    # the drive's read requests per warm load, where tmp_dir sits on a block device
    dev = os.stat(tmp_dir).st_dev
    counted = os.path.exists(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    for key, m in methods.items():
        assert (m["load_device_reads"] is not None) == counted, key
        if counted:
            assert m["load_device_reads"] >= 1, key     # every load read from the drive
    for key in ("aioswap", "torch", "direct"):         # a fresh process per cold load
        assert len(methods[key]["cold_load_gbps_all"]) == 2
        assert methods[key]["cold_load_gbps"] > 0 and methods[key]["cold_maxrss_kib"] > 0
    assert "aioswap_noverify" not in [k.split(" vs ")[-1] for k in res["ratios"]
                                      if k.startswith("cold")]
    assert res["ratios"]["cold load vs torch"] > 0
    assert os.listdir(tmp_dir) == []              # the benchmark cleans up after itself


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_loads_leave_no_garbage_cycles(tmp_dir: Path, verify: bool) -> None:
    """A load frees by reference counting alone: no reference cycle is left for the
    collector (each one makes a program pay for full collections; checksumming through a
    ctypes array type per tensor left one per size)."""
    import gc

    import aioswap.safetensors as ast
    sd = _mixed_state_dict(40)
    snap = _snapshot(sd)
    with TensorSwapper(tmp_dir / "s") as sw:
        sw.swap_out_state_dict("", sd)
        ast.save_file({k: v.contiguous() for k, v in sd.items() if not v.is_complex()},
                      tmp_dir / "m.safetensors")
        st_snap = {k: v for k, v in snap.items() if not v[2].is_complex}
        for load, want in ((lambda: sw.swap_in_state_dict("", verify=verify), snap),
                           (lambda: ast.load_file(tmp_dir / "m.safetensors"), st_snap)):
            load()                              # first use: lazy imports and caches
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                got = load()
                assert set(got) == set(want)
                _check(want, {k: got[k] for k in want})
                del got
                found = gc.collect()
                kinds = sorted({type(o).__qualname__ for o in gc.garbage})
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
            assert found == 0, kinds
