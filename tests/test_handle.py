"""AioHandle: every path (direct, bounce, head/tail, buffered) against os.pread/os.pwrite."""
from __future__ import annotations

import asyncio
import gc
import os
import resource
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioswap
from aioswap import pinned
from aioswap.errors import DirectIOFallbackWarning, HandleClosedError, ShortReadError

MiB = 1 << 20


@pytest.fixture
def handle():
    with aioswap.AioHandle(block_size=64 * 1024, queue_depth=8) as h:
        yield h


@pytest.fixture(scope="module")
def ramfs(tmp_path_factory):
    """A file system that refuses O_DIRECT (ramfs), mounted for the buffered path."""
    d = tmp_path_factory.mktemp("ramfs")
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount ramfs (needs root): {r.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _pread(path, n: int, offset: int = 0) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _bytes_of(x) -> bytes:
    if isinstance(x, torch.Tensor):
        c = x.detach().contiguous()
        return c.as_strided((c.numel(),), (1,)).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def _random_tensor(nbytes: int, dtype: torch.dtype, *, locked: bool) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = nbytes // itemsize
    t = pinned.empty(numel, dtype) if locked else torch.empty(numel, dtype=dtype)
    t.view(-1).view(torch.uint8).copy_(
        torch.frombuffer(bytearray(os.urandom(numel * itemsize)), dtype=torch.uint8))
    return t


# path -> (aligned?, locked?, use ramfs?)
PATHS = {
    "direct": (True, True, False),
    "bounce": (True, False, False),
    "head_tail": (False, True, False),
    "buffered": (False, False, True),
}
SIZES = [1, 4095, 4096, MiB + 3, 3 * MiB]
DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.int64, torch.float32]


def _case(path, tmp_path, request):
    aligned, locked, use_ramfs = PATHS[path]
    d = request.getfixturevalue("ramfs") if use_ramfs else tmp_path
    return d, aligned, locked


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("size", SIZES)
def test_round_trip_every_path(path, size, tmp_path, request, handle):
    d, aligned, locked = _case(path, tmp_path, request)
    if path in ("direct", "bounce") and size % 4096:
        size = (size // 4096 + 1) * 4096      # these paths are about aligned middles
    offset = 0 if aligned else 4097
    src = _random_tensor(size, torch.uint8, locked=locked)
    f = str(d / "data.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DirectIOFallbackWarning)
        assert handle.pwrite(src, f, offset) == size
        # reference read of what was written
        with open(f, "rb") as fh:
            disk = os.pread(fh.fileno(), size + 10, offset)
        assert disk == _bytes_of(src)
        assert os.path.getsize(f) == offset + size          # ends where the data ends
        # reference write, engine read
        ref = os.urandom(size)
        fd = os.open(f, os.O_WRONLY)
        os.pwrite(fd, ref, offset)
        os.close(fd)
        dst = _random_tensor(size, torch.uint8, locked=locked)
        assert handle.pread(dst, f, offset) == size
    assert _bytes_of(dst) == ref
    s = handle.stats
    moved = {"direct": s.direct_bytes, "bounce": s.bounce_bytes,
             "head_tail": s.head_tail_bytes, "buffered": s.buffered_bytes}
    assert moved[path] > 0, s
    if path in ("direct", "bounce"):
        assert s.head_tail_bytes == 0 and s.buffered_bytes == 0
        other = "bounce" if path == "direct" else "direct"
        assert moved[other] == 0, s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("locked", [True, False])
def test_dtypes(dtype, locked, tmp_path, handle):
    t = _random_tensor(MiB + 8, dtype, locked=locked)
    f = tmp_path / "t.bin"
    handle.pwrite(t, f, 512)
    assert _pread(f, t.numel() * t.element_size(), 512) == _bytes_of(t)
    out = torch.empty_like(t)
    handle.pread(out, f, 512)
    assert torch.equal(out.view(torch.uint8) if dtype != torch.uint8 else out,
                       t.view(torch.uint8) if dtype != torch.uint8 else t)


def test_views_and_slices(tmp_path, handle):
    base = _random_tensor(4 * MiB, torch.float32, locked=True)
    f = tmp_path / "v.bin"
    views = {
        "narrow": base.narrow(0, 1000, 4096),
        "slice": base[4096:4096 + 65536],
        "strided": base[::3],
        "2d_t": base[:1024 * 256].view(1024, 256).t(),
    }
    for name, v in views.items():
        handle.pwrite(v, f, 0)
        assert _pread(f, v.numel() * 4) == _bytes_of(v), name
        out = torch.zeros_like(v)
        handle.pread(out, f, 0)
        assert _bytes_of(out) == _bytes_of(v), name


def test_read_into_noncontiguous_tensor(tmp_path, handle):
    f = tmp_path / "nc.bin"
    ref = os.urandom(512 * 384 * 8)
    f.write_bytes(ref)
    big = torch.zeros(512, 768, dtype=torch.float64)
    view = big[:, ::2]                         # non-contiguous, 512 x 384
    assert not view.is_contiguous()
    assert handle.pread(view, f, 0) == len(ref)
    assert _bytes_of(view) == ref              # the tensor holds the data afterwards
    assert torch.equal(big[:, 1::2], torch.zeros(512, 384, dtype=torch.float64))


def test_numpy_and_buffers(tmp_path, handle):
    f = tmp_path / "np.bin"
    a = np.frombuffer(os.urandom(8 * 100_003), dtype=np.float64).copy()
    handle.pwrite(a, f)
    assert f.read_bytes() == a.tobytes()
    b = np.empty_like(a)
    handle.pread(b, f)
    assert b.tobytes() == a.tobytes()
    ba = bytearray(100_003)
    handle.pread(ba, f)
    assert bytes(ba) == a.tobytes()[:100_003]
    handle.pwrite(b"hello world", f, 3)                      # read-only buffer is fine to write
    assert _pread(f, 11, 3) == b"hello world"
    strided = np.arange(10_000, dtype=np.int32)[::7]
    handle.pwrite(strided, f)
    out = np.zeros_like(strided)
    handle.pread(out, f)
    assert np.array_equal(out, strided)


def test_file_descriptor_argument(tmp_path, handle):
    f = tmp_path / "fd.bin"
    data = _random_tensor(2 * MiB + 100, torch.uint8, locked=False)
    fd = os.open(f, os.O_RDWR | os.O_CREAT)
    try:
        assert handle.pwrite(data, fd, 100) == data.numel()
        out = torch.empty_like(data)
        assert handle.pread(out, fd, 100) == data.numel()
        assert torch.equal(out, data)
    finally:
        os.close(fd)
    ro = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(PermissionError, match="not open for writing"):
            handle.pwrite(data, ro)
    finally:
        os.close(ro)


@pytest.mark.parametrize("knobs", [
    dict(single_submit=True, overlap_events=False),
    dict(single_submit=False, overlap_events=True),
    dict(intra_op_parallelism=3),
    dict(intra_op_parallelism=4, queue_depth=2, block_size=4096),
])
def test_knobs_and_parallelism(knobs, tmp_path, memlock_room):
    f = tmp_path / "k.bin"
    n = (5 if memlock_room is None else 3) * MiB + 12288    # two locked: a normal user's 8 MiB
    for locked in (True, False):
        src = _random_tensor(n, torch.uint8, locked=locked)
        with aioswap.AioHandle(**knobs) as h:
            h.pwrite(src, f)
            out = _random_tensor(src.numel(), torch.uint8, locked=locked)
            h.pread(out, f)
        assert torch.equal(out, src)
        assert f.read_bytes() == _bytes_of(src)


# ---------------------------------------------------------------------------- property


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nbytes=st.integers(1, 300_000), offset=st.integers(0, 20_000),
       dtype=st.sampled_from([torch.uint8, torch.int16, torch.float32, torch.int64]),
       view=st.sampled_from(["whole", "slice", "strided"]), locked=st.booleans())
def test_property_round_trip(tmp_path, nbytes, offset, dtype, view, locked):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    base = _random_tensor(max(itemsize, nbytes - nbytes % itemsize) * 2 + 64, dtype,
                          locked=locked)
    n = max(1, nbytes // itemsize)
    t = {"whole": base[:n], "slice": base[3:3 + n], "strided": base[: 2 * n: 2]}[view]
    f = tmp_path / "p.bin"
    f.unlink(missing_ok=True)
    with aioswap.AioHandle(block_size=16384, queue_depth=4) as h:
        h.pwrite(t, f, offset)
        raw = f.read_bytes()
        assert len(raw) == offset + t.numel() * itemsize
        assert raw[offset:] == _bytes_of(t)
        out = torch.empty_like(t)
        h.pread(out, f, offset)
    assert _bytes_of(out) == _bytes_of(t)


# ---------------------------------------------------------------------------- async


def test_async_from_threads_then_wait(tmp_path, memlock_room):
    nthreads, per = 4, 8
    datas = {}
    futs = []
    lock = threading.Lock()
    # 16 locked tensors, two blocks each, and the ring: under a normal user's 8 MiB too
    block = 128 * 1024 if memlock_room is None else 32 * 1024
    with aioswap.AioHandle(block_size=block, queue_depth=8) as h:
        def worker(k):
            for i in range(per):
                t = _random_tensor(2 * block + k * 512 + i, torch.uint8, locked=(i % 2 == 0))
                p = tmp_path / f"a{k}_{i}.bin"
                fut = h.pwrite(t, p, async_op=True)
                with lock:
                    datas[p] = t
                    futs.append(fut)
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(nthreads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert h.wait() == nthreads * per
        assert all(f.done() and f.result() == datas[f.file].numel() for f in futs)
        assert h.wait() == 0
        for p, t in datas.items():
            assert p.read_bytes() == _bytes_of(t)
        outs = {p: torch.empty_like(t) for p, t in datas.items()}
        for p, o in outs.items():
            h.pread(o, p, async_op=True)
        assert h.wait() == len(outs)
    for p, o in outs.items():
        assert torch.equal(o, datas[p])


def test_futures_carry_errors_and_callbacks(tmp_path):
    f = tmp_path / "short.bin"
    f.write_bytes(b"x" * 1000)
    seen = []
    with aioswap.AioHandle() as h:
        ok = h.pread(torch.empty(1000, dtype=torch.uint8), f, async_op=True)
        ok.add_done_callback(lambda fut: seen.append(fut.result()))
        fd = os.open(f, os.O_RDONLY)
        bad = h.pread(torch.empty(1000, dtype=torch.uint8), fd, async_op=True)
        os.close(fd)       # the request reopened what it needs; closing the caller's fd is safe
        assert h.wait() == 2
        assert ok.result() == 1000 and seen == [1000] and bad.result() == 1000

        async def main():
            return await asyncio.wrap_future(h.pwrite(b"abc", f, async_op=True))
        assert asyncio.run(main()) == 3
        assert h.wait() == 1


def test_futures_nobody_looks_at_hold_no_lists_and_the_used_ones_work(tmp_path):
    """A future starts with Future.__init__'s fields as class defaults (no waiter or
    callback list, no Condition, so a burst of them gives the cyclic collector little to
    track); each is made on first use, per future. Futures used every way still finish
    byte-exact; the engine's requests are not tracked by the collector."""
    import concurrent.futures as cf
    KiB = 1 << 10
    data = os.urandom(64 * KiB)
    p = tmp_path / "lazy.bin"
    p.write_bytes(data)
    with aioswap.AioHandle(queue_depth=4) as h, h.open(p, "r") as f:
        f.pread(torch.empty(4, dtype=torch.uint8), 0)   # the short path learns torch's types
        bufs = [torch.empty(4 * KiB, dtype=torch.uint8) for _ in range(16)]
        futs = [f.pread(b, i * 4 * KiB, async_op=True) for i, b in enumerate(bufs)]
        plain = futs[0]
        assert plain._waiter_list is None and plain._callback_list is None
        assert plain._cond is None       # (it may have finished already: fields only)
        got = []
        futs[1].add_done_callback(lambda fu: got.append(fu.result()))
        done, _ = cf.wait(futs[2:6], return_when=cf.FIRST_COMPLETED, timeout=30)
        assert done
        assert [x.result() for x in cf.as_completed(futs[6:10], timeout=30)] == [4 * KiB] * 4

        async def one():
            return await asyncio.wrap_future(futs[10])
        assert asyncio.run(one()) == 4 * KiB
        assert h.wait() == 16
        assert got == [4 * KiB]
        for i, b in enumerate(bufs):
            assert b.numpy().tobytes() == data[i * 4 * KiB:(i + 1) * 4 * KiB]
        assert plain.result() == 4 * KiB
        assert "_waiter_list" not in vars(plain) and "_callback_list" not in vars(plain)
        assert repr(plain).startswith("<IOFuture") and "finished" in repr(plain)
    # the lists a future makes on first use are its own (unfinished futures, so no race)
    a = aioswap.IOFuture("read", str(p), 1, 0)
    b = aioswap.IOFuture("read", str(p), 1, 0)
    a._waiters.append("w")
    a._done_callbacks.append("c")
    assert b._waiters == [] and b._done_callbacks == [] and a._waiters == ["w"]
    assert a._callback_list == ["c"] and b._waiter_list is not a._waiter_list
    assert not aioswap._aio.Request.__flags__ & (1 << 14)    # Py_TPFLAGS_HAVE_GC


def test_wait_raises_first_error_after_all_finish(tmp_path):
    """A request's error fails that request only; wait() raises it after all finished."""
    code = f"""
import os, resource, signal, torch, aioswap
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
big = torch.ones(2 << 20, dtype=torch.uint8)
with aioswap.AioHandle(block_size=1 << 18) as h:
    f1 = h.pwrite(big, {str(tmp_path / 'bad.bin')!r}, async_op=True)
    f2 = h.pwrite(b"b" * 10, {str(tmp_path / 'good.bin')!r}, async_op=True)
    try:
        h.wait()
        print("NO ERROR")
    except OSError as e:
        print("ERRNO", e.errno, "bad.bin" in str(e))
    print("F1", f1.exception().errno, "F2", f2.result(), "AGAIN", h.wait())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ERRNO 27 True" in r.stdout, r.stdout
    assert "F1 27 F2 10 AGAIN 0" in r.stdout, r.stdout
    assert (tmp_path / "good.bin").read_bytes() == b"b" * 10


def test_close_drains_in_flight(tmp_path):
    h = aioswap.AioHandle()
    t = _random_tensor(16 * MiB, torch.uint8, locked=False)
    futs = [h.pwrite(t, tmp_path / f"c{i}.bin", async_op=True) for i in range(4)]
    h.close()
    assert all(f.done() and f.result() == t.numel() for f in futs)
    for i in range(4):
        assert (tmp_path / f"c{i}.bin").read_bytes() == _bytes_of(t)
    h.close()                                   # idempotent
    with pytest.raises(HandleClosedError):
        h.pwrite(t, tmp_path / "x.bin")


# ---------------------------------------------------------------------------- bad input


def test_bad_input_before_any_io(tmp_path, handle):
    f = tmp_path / "small.bin"
    f.write_bytes(b"z" * 4096)
    before = f.read_bytes()
    with pytest.raises(ShortReadError, match=r"small\.bin.*4096 bytes"):
        handle.pread(torch.empty(8192, dtype=torch.uint8), f)
    with pytest.raises(ShortReadError, match="past the end"):
        handle.pread(torch.empty(10, dtype=torch.uint8), f, 4090)
    with pytest.raises(ValueError, match=r"only 10 bytes"):
        handle.pread(torch.empty(10, dtype=torch.uint8), f, nbytes=20)
    with pytest.raises(ValueError, match="read-only"):
        handle.pread(b"x" * 16, f)
    with pytest.raises(FileNotFoundError):
        handle.pread(torch.empty(10, dtype=torch.uint8), tmp_path / "missing.bin")
    with pytest.raises(IsADirectoryError):
        handle.pread(torch.empty(10, dtype=torch.uint8), tmp_path)
    with pytest.raises(IsADirectoryError):
        handle.pwrite(torch.empty(10, dtype=torch.uint8), tmp_path)
    with pytest.raises(ValueError, match="negative file offset"):
        handle.pwrite(torch.empty(10, dtype=torch.uint8), f, -1)
    with pytest.raises(TypeError, match="buffer"):
        handle.pwrite(12345, f)
    with pytest.raises(TypeError, match="meta"):
        handle.pwrite(torch.empty(10, device="meta"), f)
    assert f.read_bytes() == before
    assert not (tmp_path / "missing.bin").exists()
    assert handle.stats.read_bytes == 0 and handle.stats.write_bytes == 0


def test_fsync_and_empty(tmp_path, handle):
    f = tmp_path / "e.bin"
    assert handle.pwrite(torch.empty(0), f, fsync=True) == 0
    assert f.exists() and f.stat().st_size == 0
    assert handle.pread(torch.empty(0), f) == 0
    assert handle.pwrite(torch.ones(3), f, fsync=True) == 12


def test_rlimit_fsize_error_in_subprocess(tmp_path):
    code = f"""
import os, resource, signal, sys, torch, aioswap
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
t = torch.arange(3 << 18, dtype=torch.int32)   # 3 MiB
with aioswap.AioHandle(block_size=1 << 18) as h:
    try:
        h.pwrite(t, {str(tmp_path / 'big.bin')!r})
    except OSError as e:
        print('ERRNO', e.errno, e)
        sys.exit(0)
print('NO ERROR'); sys.exit(1)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ERRNO 27" in r.stdout and "big.bin" in r.stdout
    raw = (tmp_path / "big.bin").read_bytes()
    assert len(raw) <= 1 << 20
    expect = torch.arange(3 << 18, dtype=torch.int32).numpy().tobytes()
    assert raw == expect[:len(raw)]              # intact up to the limit


# ---------------------------------------------------------------------------- resources


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _vmlck() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


def test_no_fd_or_locked_memory_growth(tmp_path):
    f = tmp_path / "leak.bin"
    small = _random_tensor(8192 + 17, torch.uint8, locked=False)
    locked = _random_tensor(8192, torch.uint8, locked=True)
    with aioswap.AioHandle(block_size=4096, queue_depth=4) as h:
        h.pwrite(small, f)
        h.pread(small, f)
        gc.collect()
        fds, lck = _fds(), _vmlck()
        for i in range(2500):
            h.pwrite(small, f)
            h.pread(small, f)
            h.pwrite(locked, f, 4096)
            h.pread(locked, f, 4096)
        assert h.stats.bounce_bytes > 0 and h.stats.direct_bytes > 0
        assert _fds() == fds
        assert _vmlck() == lck
    del locked
    gc.collect()


def test_bounce_pool_is_bounded_and_reused(tmp_path):
    with aioswap.AioHandle(block_size=MiB, queue_depth=8) as h:
        assert h.bounce_pool_bytes == 16 * MiB       # 2 x queue_depth buffers of a block
        t = _random_tensor(40 * MiB, torch.uint8, locked=False)
        before = pinned.registry.stats()
        h.pwrite(t, tmp_path / "b.bin")
        mid = pinned.registry.stats()
        h.pwrite(t, tmp_path / "b.bin")
        h.pread(t, tmp_path / "b.bin")
        after = pinned.registry.stats()
        assert mid.bytes_locked - before.bytes_locked <= 16 * MiB
        assert after.bytes_locked == mid.bytes_locked        # the pool is reused, not regrown


def test_peak_rss_writing_unpinned_tensor(tmp_path):
    size = int(os.environ.get("AIOSWAP_TEST_RSS_BYTES", str(512 * MiB)))
    code = f"""
import resource, torch, aioswap
t = torch.ones({size}, dtype=torch.uint8)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with aioswap.AioHandle() as h:
    pool = h.bounce_pool_bytes
    h.pwrite(t, {str(tmp_path / 'rss.bin')!r})
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(base, peak, pool)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    base, peak, pool = map(int, r.stdout.split())
    assert peak - base <= pool + 64 * MiB, (base, peak, pool)
    assert os.path.getsize(tmp_path / "rss.bin") == size


# ---------------------------------------------------------------------------- buffered


def test_buffered_fallback_warns_once(ramfs):
    f1, f2 = ramfs / "w1.bin", ramfs / "w2.bin"
    t = _random_tensor(MiB, torch.uint8, locked=True)
    with aioswap.AioHandle() as h:
        with pytest.warns(DirectIOFallbackWarning, match="O_DIRECT"):
            h.pwrite(t, f1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            h.pwrite(t, f2)
        assert h.stats.buffered_bytes == 2 * MiB and h.stats.direct_bytes == 0
    assert f1.read_bytes() == _bytes_of(t) == f2.read_bytes()


def test_handle_from_config():
    cfg = aioswap.AioConfig(block_size=2 * MiB, queue_depth=16, intra_op_parallelism=2,
                            single_submit=True, overlap_events=False)
    with aioswap.AioHandle.from_config(cfg) as h:
        assert (h.block_size, h.queue_depth, h.intra_op_parallelism, h.single_submit,
                h.overlap_events) == (2 * MiB, 16, 2, True, False)
    with pytest.raises(aioswap.ConfigError):
        aioswap.AioHandle(block_size=0)


def test_unprivileged_process_without_memlock(tmp_path):
    """Without CAP_IPC_LOCK and with a tiny RLIMIT_MEMLOCK the bounce pool falls back."""
    import shutil
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed")
    code = f"""
import os, warnings, torch, aioswap
warnings.simplefilter("always")
t = torch.arange(1 << 20, dtype=torch.int32)
with warnings.catch_warnings(record=True) as w:
    with aioswap.AioHandle() as h:
        h.pwrite(t, {str(tmp_path / 'np.bin')!r})
        out = torch.empty_like(t)
        h.pread(out, {str(tmp_path / 'np.bin')!r})
        h.pwrite(t, {str(tmp_path / 'np.bin')!r})
assert torch.equal(out, t)
print("WARNINGS", len(w), w[0].message if w else "")
"""
    def limit():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, 64 * 1024))
    r = subprocess.run(["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--",
                        sys.executable, "-c", code], capture_output=True, text=True,
                       preexec_fn=limit)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNINGS 1" in r.stdout, r.stdout


def test_partial_read_into_noncontiguous_buffers(tmp_path, handle):
    f = tmp_path / "part.bin"
    ref = os.urandom(4096)
    f.write_bytes(ref)
    t = torch.zeros(2048, dtype=torch.int32)[::2]               # 1024 elements, strided
    assert handle.pread(t, f, nbytes=400) == 400
    assert _bytes_of(t)[:400] == ref[:400] and not t[100:].any()
    a = np.zeros(2048, dtype=np.int32)[::2]
    assert handle.pread(a, f, nbytes=400) == 400
    assert a.tobytes()[:400] == ref[:400] and not a[100:].any()
    with pytest.raises(ValueError, match="whole elements"):
        handle.pread(t, f, nbytes=401)


def test_knobs_from_the_environment(tmp_path, monkeypatch):
    """Knobs left out come from AIOSWAP_*; AIOSWAP_BUFFERED serves files without O_DIRECT."""
    monkeypatch.setenv("AIOSWAP_QUEUE_DEPTH", "7")
    monkeypatch.setenv("AIOSWAP_BLOCK_SIZE", "256K")
    monkeypatch.setenv("AIOSWAP_POOL_SIZE", "1M")
    monkeypatch.setenv("AIOSWAP_BUFFERED", "1")
    f = tmp_path / "env.bin"
    t = _random_tensor(MiB + 5, torch.uint8, locked=True)
    with aioswap.AioHandle() as h:
        assert (h.queue_depth, h.block_size, h.bounce_pool_bytes) == (7, 256 * 1024, MiB)
        assert h.pwrite(t, f, 3) == t.numel()
        out = torch.empty_like(t)
        assert h.pread(out, f, 3) == t.numel()
        assert h.stats.buffered_bytes == 2 * t.numel() and h.stats.direct_bytes == 0
    assert torch.equal(out, t)
    with aioswap.AioHandle(queue_depth=3) as h:          # a knob given wins
        assert h.queue_depth == 3


def test_freed_locked_memory_is_reused():
    """Locked mappings of 4 MiB+ are kept for the next allocation of that size (bounded)."""
    from aioswap import _aio
    old = _aio.set_locked_cache(0)        # empty: what earlier tests left would be evicted
    _aio.set_locked_cache(64 * MiB)
    try:
        before = _aio.locked_cache_bytes()
        m = _aio.LockedMemory(8 * MiB)
        addr = m.address
        m.close()
        assert _aio.locked_cache_bytes() == before + 8 * MiB
        again = _aio.LockedMemory(8 * MiB)
        assert again.address == addr and again.locked
        again.close()
        _aio.set_locked_cache(0)                          # shrinking unmaps what is kept
        assert _aio.locked_cache_bytes() == 0
        small = _aio.LockedMemory(MiB)                    # under 4 MiB: never kept
        small.close()
        assert _aio.locked_cache_bytes() == 0
    finally:
        _aio.set_locked_cache(old)
