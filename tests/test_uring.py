"""The io_uring backend: selection, every fallback forced, and the faults it absorbs.

The byte-exact suites (engine, short path, reliability, requests) run on io_uring through
the ``engine_backend`` fixture; here are the io_uring-only paths: setup refused (EPERM,
ENOSYS) or its flags refused (EINVAL), ring registration refused (injected, and for real as
a normal user under a small RLIMIT_MEMLOCK), completions that come back -EAGAIN or short,
more requests than the ring holds, buffered reads, registered files (let go before their fd
closes, refused, never a caller's fd, a forked child's own), and no leak of rings over many
queues.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import aioswap
from aioswap import _aio
from aioswap._aio import MODE_BOUNCE, MODE_DIRECT, AioQueue, LockedMemory, open_direct
from aioswap._info import fs_type as _fs_type

KiB = 1 << 10
MiB = 1 << 20

pytestmark = pytest.mark.skipif(not _aio.aio_available("io_uring")[0],
                                reason=f"io_uring does not work here: "
                                       f"{_aio.aio_available('io_uring')[1]}")


@pytest.fixture(autouse=True)
def no_faults() -> Iterator[None]:
    _aio._uring_inject()
    yield
    _aio._uring_inject()


def _rand(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def data_file(tmp_dir: Path) -> tuple[Path, bytes]:
    data = _rand(8 * MiB, 3)
    path = tmp_dir / "data.bin"
    path.write_bytes(data)
    return path, data


def _round_trip(h: aioswap.AioHandle, path: Path, data: bytes) -> None:
    """Unaligned and aligned, pinned and unpinned reads and writes, checked by os.pread."""
    n = len(data)
    t = torch.empty(n - 1000, dtype=torch.uint8)
    assert h.pread(t, path, 1000) == n - 1000                       # edges, bounce
    assert t.numpy().tobytes() == data[1000:]
    p = aioswap.pinned.empty(n, torch.uint8, strict=False)
    futs = [h.pread(p[i:i + 64 * KiB], path, i, async_op=True) for i in range(0, n, 64 * KiB)]
    assert sum(f.result(timeout=60) for f in futs) == n
    assert p.numpy().tobytes() == data
    new = _rand(n, 11)
    src = torch.frombuffer(bytearray(new), dtype=torch.uint8)
    assert h.pwrite(src[7:], path, 7) == n - 7
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.pread(fd, n, 0) == data[:7] + new[7:]
        os.pwrite(fd, data, 0)                      # as it was, for the next round
    finally:
        os.close(fd)


@pytest.mark.parametrize("err", [errno.EPERM, errno.ENOSYS, errno.ENOMEM])
def test_setup_refused_is_said_and_auto_falls_back(err: int, data_file: tuple[Path, bytes],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = data_file
    _aio._uring_inject(setup_errno=err)
    with pytest.raises(OSError) as info:            # asked for by name: no fallback
        AioQueue(8, backend="io_uring")
    assert info.value.errno == err and "io_uring_setup" in str(info.value)
    ok, why = _aio.aio_available("io_uring")
    assert not ok and "io_uring_setup" in why
    monkeypatch.delenv("AIOSWAP_BACKEND", raising=False)
    with aioswap.AioHandle(queue_depth=8) as h:     # "auto": kernel AIO then, and why
        assert h.backend == "aio"
        assert h.backend_reason.startswith("io_uring_setup failed: ")
        assert h.backend_reason.endswith("; using kernel AIO")
        assert os.strerror(err) in h.backend_reason
        _round_trip(h, path, data)
    _aio._uring_inject()
    with aioswap.AioHandle(queue_depth=8) as h:     # and io_uring where it works
        assert h.backend == "io_uring" and h.backend_reason == ""


def test_flags_refused_step_down(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    q = AioQueue(8, backend="io_uring")
    assert q.uring_flags != 0                       # this kernel takes the best set
    q.close()
    _aio._uring_inject(einval_flags=1)
    q = AioQueue(8, backend="io_uring")
    try:
        assert q.backend == "io_uring" and q.uring_flags == 0
    finally:
        q.close()
    with aioswap.AioHandle(queue_depth=8, backend="io_uring") as h:
        assert h.backend == "io_uring"
        _round_trip(h, path, data)


def test_ring_registered_and_refused(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with aioswap.AioHandle(queue_depth=8, block_size=256 * KiB, backend="io_uring") as h:
        _round_trip(h, path, data)
        q = h._lanes[0].queue
        assert q.fixed_ring and q.ring_note == ""
    _aio._uring_inject(register_errno=errno.ENOMEM)
    with aioswap.AioHandle(queue_depth=8, block_size=256 * KiB, backend="io_uring") as h:
        _round_trip(h, path, data)                  # plain READ/WRITE through the ring
        q = h._lanes[0].queue
        assert not q.fixed_ring and "Cannot allocate memory" in q.ring_note


@pytest.mark.parametrize("fault", ["cqe_eagain", "cqe_short"])
def test_eagain_and_short_completions_are_resubmitted(fault: str,
                                                      data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with aioswap.AioHandle(queue_depth=16, block_size=64 * KiB, backend="io_uring") as h:
        _aio._uring_inject(**{fault: 200})
        _round_trip(h, path, data)
        left = _aio._uring_faults_left()
        assert left[0 if fault == "cqe_eagain" else 1] < 200    # the faults were met
        # direct pieces through the raw queue too, byte-exact
        mem = LockedMemory(4 * MiB)
        fd = open_direct(path)
        try:
            _aio._uring_inject(**{fault: 100})
            q = h._lanes[0].queue
            rq = q.submit(fd, False, mem.address, 4 * MiB, MiB, MODE_DIRECT, 4096, 64 * KiB,
                          None, False, True)
            fd2 = os.open(path, os.O_RDONLY)
            try:
                assert rq.wait() == 4 * MiB
                assert bytes(memoryview(mem)) == os.pread(fd2, 4 * MiB, MiB)
            finally:
                os.close(fd2)
        finally:
            os.close(fd)


def test_more_requests_than_the_ring_holds(data_file: tuple[Path, bytes]) -> None:
    """A ring of depth 1 (SQ 1, CQ 2) with 64 requests of 16 pieces each queued at once."""
    path, data = data_file
    with aioswap.AioHandle(queue_depth=1, block_size=8 * KiB, backend="io_uring") as h:
        bufs = [torch.empty(128 * KiB, dtype=torch.uint8) for _ in range(64)]
        futs = [h.pread(b, path, i * 128 * KiB, async_op=True) for i, b in enumerate(bufs)]
        assert h.wait() == 64
        assert all(f.result() == 128 * KiB for f in futs)
        assert b"".join(b.numpy().tobytes() for b in bufs) == data


def test_buffered_reads_and_writes(data_file: tuple[Path, bytes],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = data_file
    monkeypatch.setenv("AIOSWAP_BUFFERED", "1")
    with aioswap.AioHandle(queue_depth=32, block_size=MiB, backend="io_uring") as h:
        with h.open(path, "r+") as f:
            assert not f.direct
        _round_trip(h, path, data)


def test_bounce_pieces_through_raw_queue(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    q = AioQueue(4, backend="io_uring")
    ring = LockedMemory(4 * 64 * KiB)
    q.attach_ring(ring, ring.address, 64 * KiB, 4)
    assert q.fixed_ring
    mem = LockedMemory(MiB + 4096)
    fd = open_direct(path)
    try:
        rq = q.submit(fd, False, mem.address + 3, MiB, 4096, MODE_BOUNCE, 4096, 64 * KiB, None,
                      False, True)
        assert rq.wait() == MiB
        assert bytes(memoryview(mem)[3:3 + MiB]) == data[4096:4096 + MiB]
    finally:
        os.close(fd)
        q.close()


MEMLOCK_CHILD = textwrap.dedent("""
    import os, sys, torch, aioswap
    path = sys.argv[1]
    with open(path, "rb") as f:
        data = f.read()
    with aioswap.AioHandle(queue_depth=8, block_size=1 << 20,
                           bounce_bytes=16 << 20, backend="io_uring") as h:
        t = torch.empty(len(data) - 5, dtype=torch.uint8)
        assert h.pread(t, path, 5) == len(data) - 5          # through the bounce ring
        assert t.numpy().tobytes() == data[5:]
        q = h._lanes[0].queue
        print("NOTE", q.fixed_ring, q.ring_note)
        # page-locked memory (registered with the ring, or refused): byte-exact either way
        p = aioswap.pinned.empty(256 << 10, torch.uint8, strict=False)
        futs = [h.pread(p[i:i + 4096], path, 4096 + i, async_op=True)
                for i in range(0, 256 << 10, 4096)]
        assert [f.result() for f in futs] == [4096] * 64
        assert p.numpy().tobytes() == data[4096:4096 + (256 << 10)]
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None
                    or shutil.which("prlimit") is None,
                    reason="needs root to drop CAP_IPC_LOCK (setpriv, prlimit)")
def test_registration_refused_without_ipc_lock_under_memlock(
        data_file: tuple[Path, bytes]) -> None:
    """Registering pins pages against RLIMIT_MEMLOCK for a process without CAP_IPC_LOCK: the
    ring is refused, said so, and served with plain READ/WRITE."""
    path, _ = data_file
    cmd = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock",
           "prlimit", "--memlock=1048576", sys.executable, "-c", MEMLOCK_CHILD, str(path)]
    env = dict(os.environ, AIOSWAP_BACKEND="io_uring")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    note = [line for line in proc.stdout.splitlines() if line.startswith("NOTE")][-1]
    assert note.startswith("NOTE False") and "registering the bounce ring" in note, note
    assert "Cannot allocate memory" in note, note


def test_io_uring_by_default_and_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOSWAP_BACKEND", "io_uring")
    with aioswap.AioHandle(queue_depth=4) as h:
        assert h.backend == "io_uring" and h.backend_reason == "asked for"
    monkeypatch.setenv("AIOSWAP_BACKEND", "aio")
    with aioswap.AioHandle(queue_depth=4) as h:
        assert h.backend == "aio" and h.backend_reason == "asked for"
    monkeypatch.delenv("AIOSWAP_BACKEND")
    with aioswap.AioHandle(queue_depth=4) as h:     # "auto", where io_uring works
        assert h.backend == "io_uring" and h.backend_reason == ""
    assert _aio.backends_available()["io_uring"] == (True, "")


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
@pytest.mark.skipif(_fs_type("/dev/shm") != "tmpfs", reason="/dev/shm is not tmpfs here")
@pytest.mark.parametrize("how", ["direct", "buffered", "cqe_short", "cqe_eagain"])
def test_tmpfs_pieces_run_in_the_submitting_thread(how: str, tmp_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """io_uring cannot start I/O on tmpfs without blocking and hands every piece to a kernel
    worker thread (21 us of CPU per 4 KiB read); the backend runs them in the submitting
    thread instead (a NOP carries the result): byte-exact on every path, with short and
    -EAGAIN completions, and no io-wq worker thread is started."""
    if how == "buffered":
        monkeypatch.setenv("AIOSWAP_BUFFERED", "1")
    d = Path("/dev/shm") / f"aioswap-test-{os.getpid()}"
    d.mkdir(mode=0o700)
    try:
        data = _rand(4 * MiB + 1234, 8)
        path = d / "shm.bin"
        path.write_bytes(data)
        with aioswap.AioHandle(queue_depth=16, block_size=64 * KiB, backend="io_uring") as h:
            with h.open(path, "r+") as f:
                # (tmpfs takes O_DIRECT from Linux 6.6; before, the file is buffered)
                assert f.state.inline and not (how == "buffered" and f.direct)
            other = tmp_dir / "disk.bin"
            other.write_bytes(b"x" * 4096)
            with h.open(other, "r") as f:
                assert f.state.inline == (_fs_type(str(other)) == "tmpfs")
            if how.startswith("cqe_"):
                _aio._uring_inject(**{how: 100})
            _round_trip(h, path, data)
            if how.startswith("cqe_"):
                left = _aio._uring_faults_left()
                assert left[0 if how == "cqe_eagain" else 1] < 100     # the faults were met
                _aio._uring_inject()
            # a read past the end is refused before any I/O; one that ends at it is whole
            t = torch.empty(5000, dtype=torch.uint8)
            with pytest.raises(aioswap.errors.ShortReadError):
                h.pread(t, path, len(data) - 4999)
            assert h.pread(t, path, len(data) - 5000) == 5000
            assert t.numpy().tobytes() == data[-5000:]
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import os, torch, aioswap
            from aioswap import pinned
            h = aioswap.AioHandle(backend="io_uring")
            f = h.open({str(path)!r}, "r")
            bufs = [pinned.empty(4096, torch.uint8, strict=False) for _ in range(32)]
            for r in range(20):
                for i, b in enumerate(bufs):
                    f.pread(b, (r * 32 + i) * 4096, async_op=True)
                h.wait()
            tasks = os.listdir("/proc/self/task")
            names = [open(f"/proc/self/task/{{t}}/comm").read() for t in tasks]
            print("IOWQ", sum(n.startswith("iou-wrk") for n in names))
        """)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "IOWQ 0" in r.stdout, r.stdout
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_page_locked_memory_goes_fixed_and_is_let_go(data_file: tuple[Path, bytes]) -> None:
    """An allocation of the pinned registry that is reused (more than its size moved by
    direct pieces through a lane) is registered with the lane's ring: READ_FIXED/WRITE_FIXED
    from then on; memory used once is not. It is unregistered before its pages are unmapped:
    memory mapped later at the same address is read into, not the old pages the ring pinned
    (which a stale registration would fill, leaving the new memory as it was)."""
    path, data = data_file
    n = 1 << 20
    with aioswap.AioHandle(queue_depth=16, block_size=256 * KiB, backend="io_uring") as h:
        q = h._lanes[0].queue
        base = q.fixed_buffers                          # the bounce ring, once attached
        addrs = []
        for rnd in range(4):
            p = aioswap.pinned.empty(n, torch.uint8)
            assert aioswap.pinned.is_pinned(p)
            addrs.append(p.data_ptr())
            futs = [h.pread(p[i:i + 64 * KiB], path, rnd * 4096 + i, async_op=True)
                    for i in range(0, n, 64 * KiB)]
            assert sum(f.result(timeout=60) for f in futs) == n
            assert p.numpy().tobytes() == data[rnd * 4096:rnd * 4096 + n]
            assert q.fixed_buffers == base              # moved once: not registered
            before = q.fixed_pieces
            out = path.with_suffix(f".w{rnd}")          # moved twice: registered
            assert h.pwrite(p, out, 0, async_op=True).result(timeout=60) == n
            assert out.read_bytes() == data[rnd * 4096:rnd * 4096 + n]
            out.unlink()
            assert q.fixed_buffers == base + 1 and q.fixed_pieces >= before + 4
            before = q.fixed_pieces
            assert h.pread(p, path, 8192, async_op=True).result(timeout=60) == n
            assert p.numpy().tobytes() == data[8192:8192 + n]
            assert q.fixed_pieces >= before + 4
            del p, futs
            assert q.fixed_buffers == base             # let go with its pages
        # the same address came back at least once (else the stale-page case was not met)
        assert len(set(addrs)) < len(addrs), addrs


def test_page_locked_memory_registration_refused_is_plain(
        data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with aioswap.AioHandle(queue_depth=16, block_size=256 * KiB, backend="io_uring") as h:
        q = h._lanes[0].queue
        p = aioswap.pinned.empty(MiB, torch.uint8)
        _aio._uring_inject(register_errno=errno.ENOMEM)
        for rnd in range(2):                            # the second pass asks, and is refused
            futs = [h.pread(p[i:i + 64 * KiB], path, rnd * 4096 + i, async_op=True)
                    for i in range(0, MiB, 64 * KiB)]
            assert sum(f.result(timeout=60) for f in futs) == MiB
            assert p.numpy().tobytes() == data[rnd * 4096:rnd * 4096 + MiB]
        assert q.fixed_pieces == 0                      # plain READ
        _aio._uring_inject()
        h.pread(p, path, 4096, async_op=True).result(timeout=60)
        assert q.fixed_pieces == 0 and p.numpy().tobytes() == data[4096:4096 + MiB]


def _ring_files(under: Path) -> list[str]:
    """The files under ``under`` registered with this process's io_uring instances (fdinfo;
    other handles of the process, such as the DeepNVMe drop-in's striped files, may hold
    files of their own)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:[io_uring]":
                continue
            info = Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:
            continue
        table = info.split("UserFiles:", 1)[1].split("UserBufs:", 1)[0].splitlines()[1:]
        out += [ln.split(":", 1)[1].strip() for ln in table if "<none>" not in ln]
    return [f for f in out if f.startswith(str(under) + os.sep)]


def test_open_files_are_registered_and_let_go(tmp_dir: Path) -> None:
    """A file the handle opened goes to the ring as a registered (fixed) file on its first
    request; closing it takes it out of every ring's table before its fd is closed, so the
    next file that gets the same fd number is read as itself, not as the old one."""
    a, b = tmp_dir / "a.bin", tmp_dir / "b.bin"
    da, db = _rand(MiB, 21), _rand(MiB, 22)
    a.write_bytes(da)
    b.write_bytes(db)
    with aioswap.AioHandle(queue_depth=16, block_size=256 * KiB, backend="io_uring") as h:
        q = h._lanes[0].queue
        assert q.fixed_files == 0
        p = aioswap.pinned.empty(MiB, torch.uint8)
        f = h.open(a, "r+")
        fd = f.fileno()
        futs = [f.pread(p[i:i + 64 * KiB], i, async_op=True) for i in range(0, MiB, 64 * KiB)]
        assert sum(x.result(timeout=60) for x in futs) == MiB
        assert p.numpy().tobytes() == da
        assert q.fixed_files == 1 and q.fixed_file_sqes >= 16
        assert _ring_files(tmp_dir) == [str(a)]
        new = _rand(MiB, 23)                          # writes and fsync through the slot
        src = aioswap.pinned.empty(MiB, torch.uint8)
        src.copy_(torch.frombuffer(bytearray(new), dtype=torch.uint8))
        before = q.fixed_file_sqes
        assert f.pwrite(src, 0, async_op=True, fsync=True).result(timeout=60) == MiB
        assert q.fixed_file_sqes >= before + 5        # 4 pieces and the fsync
        assert a.read_bytes() == new
        f.close()
        assert q.fixed_files == 0 and _ring_files(tmp_dir) == []
        g = h.open(b, "r")                            # the lowest free number: a's
        assert g.fileno() == fd
        assert g.pread(p, 0, async_op=True).result(timeout=60) == MiB
        assert p.numpy().tobytes() == db
        assert q.fixed_files == 1 and _ring_files(tmp_dir) == [str(b)]
        g.close()
        # a path argument: the handle's own file for it, registered the same way, and
        # let go when the handle closes
        assert h.pread(p, a, 0, async_op=True).result(timeout=60) == MiB
        assert p.numpy().tobytes() == new
        assert _ring_files(tmp_dir) == [str(a)]
    assert _ring_files(tmp_dir) == []


def test_callers_fds_are_never_registered(data_file: tuple[Path, bytes]) -> None:
    """An fd the caller owns may be closed (and its number reused) at any time: the ring
    names it by number on every request."""
    path, data = data_file
    q = AioQueue(4, backend="io_uring")
    mem = LockedMemory(MiB)
    fd = open_direct(path)
    try:
        assert q.submit(fd, False, mem.address, MiB, 0, MODE_DIRECT, 4096, 256 * KiB, None,
                        False, True).wait() == MiB
        assert bytes(memoryview(mem)) == data[:MiB]
        assert q.fixed_file_sqes == 0 and q.fixed_files == 0
    finally:
        os.close(fd)
        q.close()


def test_file_table_refused_names_files_by_fd(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    _aio._uring_inject(files_errno=errno.EINVAL)
    with aioswap.AioHandle(queue_depth=16, block_size=256 * KiB, backend="io_uring") as h:
        q = h._lanes[0].queue
        assert q.fixed_files == -1
        with h.open(path, "r") as f:
            p = aioswap.pinned.empty(MiB, torch.uint8)
            assert f.pread(p, 4096, async_op=True).result(timeout=60) == MiB
            assert p.numpy().tobytes() == data[4096:4096 + MiB]
        assert q.fixed_file_sqes == 0 and q.fixed_files == -1
        _round_trip(h, path, data)


def test_forked_child_registers_files_on_its_own_ring(data_file: tuple[Path, bytes]) -> None:
    """A child's rings are its own: the parent's table of registered files is neither used
    nor changed by the child, and a handle made in the child registers its own files."""
    path, _ = data_file
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time, torch, aioswap
        path = {str(path)!r}
        data = open(path, "rb").read()
        h = aioswap.AioHandle(backend="io_uring", block_size=256 << 10)
        f = h.open(path, "r")
        p = aioswap.pinned.empty(1 << 20, torch.uint8)
        assert f.pread(p, 0, async_op=True).result() == 1 << 20
        q = h._lanes[0].queue
        assert q.fixed_files == 1
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                h2 = aioswap.AioHandle(backend="io_uring", block_size=256 << 10)
                g = h2.open(path, "r")
                c = torch.empty(1 << 20, dtype=torch.uint8)
                assert g.pread(c, 4096, async_op=True).result() == 1 << 20
                assert c.numpy().tobytes() == data[4096:4096 + (1 << 20)]
                assert h2._lanes[0].queue.fixed_files == 1
                g.close()
                assert h2._lanes[0].queue.fixed_files == 0
                h2.close()
            except BaseException as exc:
                print("child", repr(exc), flush=True)
                code = 3
            os._exit(code)
        for k in range(20):                    # the parent goes on meanwhile
            assert f.pread(p, k * 4096, async_op=True).result() == 1 << 20
            assert p.numpy().tobytes() == data[k * 4096:k * 4096 + (1 << 20)]
        _, status = os.waitpid(pid, 0)
        assert q.fixed_files == 1
        f.close()
        assert q.fixed_files == 0
        h.close()
        sys.exit(os.waitstatus_to_exitcode(status))
    """)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])


def test_more_open_files_than_the_table_holds(tmp_dir: Path) -> None:
    """The 65th open file goes by its fd number, byte-exact; slots freed by closing are
    used again; hundreds of opens and closes leave no registration and no fd behind."""
    paths, datas = [], []
    for i in range(70):
        paths.append(tmp_dir / f"f{i}.bin")
        datas.append(_rand(8192, 100 + i))
        paths[-1].write_bytes(datas[-1])
    fds_before = len(os.listdir("/proc/self/fd"))
    with aioswap.AioHandle(queue_depth=16, backend="io_uring") as h:
        q = h._lanes[0].queue
        buf = aioswap.pinned.empty(8192, torch.uint8)
        for rnd in range(3):
            files = [h.open(p, "r") for p in paths]
            before = q.fixed_file_sqes
            for f, data in zip(files, datas):
                assert f.pread(buf, 0, async_op=True).result(timeout=60) == 8192
                assert buf.numpy().tobytes() == data
            assert q.fixed_files == 64 and q.fixed_file_sqes == before + 64   # 6 by number
            assert len(_ring_files(tmp_dir)) == 64
            for f in files:
                f.close()
            assert q.fixed_files == 0 and _ring_files(tmp_dir) == []
    assert len(os.listdir("/proc/self/fd")) <= fds_before
