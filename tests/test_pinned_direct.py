"""aioswap's own unlocked memory: not pinned, but direct I/O goes into it.

Where ``mlock`` is refused (a normal user's 8 MiB ``RLIMIT_MEMLOCK``, or a budget),
``pinned.allocate``/``pinned.empty`` with ``strict=False`` hand out page-aligned unlocked
memory. The registry indexes it as a kind of its own: ``is_pinned`` is False for it, it is no
locked byte, but ``is_direct``/``io_hold`` let requests read into it and write from it with
``O_DIRECT`` (the kernel pins the pages of each request) and hold it while they run. The
caller's own unlocked memory is staged as before.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aioswap
from aioswap import _aio, pinned
from aioswap._aio import PAGE_SIZE
from aioswap.errors import PinnedMemoryWarning
from aioswap.pinned import PinnedRegistry

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def collect() -> None:
    for _ in range(3):
        gc.collect()


@pytest.fixture
def reg() -> PinnedRegistry:
    return PinnedRegistry()


@pytest.fixture
def unlocked() -> Iterator[None]:
    """While inside: strict=False allocations of the process-wide registry are unlocked
    (budget 0), as a normal user's are past RLIMIT_MEMLOCK."""
    before = pinned.stats().budget
    pinned.set_budget(0)
    try:
        yield
    finally:
        pinned.set_budget(before)


def supports_o_direct(d: Path) -> bool:
    probe = d / ".o-direct-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture
def data(tmp_dir: Path) -> tuple[Path, bytes]:
    """A 3 MiB + 1 page file of random bytes on a file system with O_DIRECT."""
    if not supports_o_direct(tmp_dir):
        pytest.skip(f"{tmp_dir} refuses O_DIRECT; set AIOSWAP_TEST_DIR to a disk directory")
    ref = os.urandom(3 * MiB + PAGE_SIZE)
    path = tmp_dir / "data.bin"
    path.write_bytes(ref)
    return path, ref


def _pread(path: Path, n: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ the registry

def test_own_unlocked_memory_is_direct_not_pinned(reg: PinnedRegistry) -> None:
    reg.set_budget(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # warn=False: nothing said
        mem = reg.allocate(3 * PAGE_SIZE + 5, strict=False, warn=False)
        t = reg.empty((4, 1000), torch.float32, strict=False, warn=False)
    assert not mem.locked and mem.address % PAGE_SIZE == 0
    for x in (mem, memoryview(mem)[10:20], (mem.address, mem.nbytes), t, t[1:3], t[:, ::2]):
        assert not reg.is_pinned(x), x                      # not page-locked: never pinned
        assert reg.is_direct(x), x                          # but direct I/O may use it
    assert not reg.is_direct((mem.address, mem.mapped_bytes + 1))      # runs past it
    assert reg.find(mem.address, 10) is None                # not a registered (locked) range
    s = reg.stats()
    assert (s.ranges, s.bytes_locked, s.allocations, s.unlocked_fallbacks) == (0, 0, 0, 2)
    assert (s.unlocked_ranges, s.unlocked_bytes) == (2, mem.mapped_bytes + 4 * PAGE_SIZE)
    tok, direct = reg.io_hold(mem.address + 7, 100)
    assert tok is not None and direct                       # held like a locked allocation
    with pytest.raises(BufferError, match=r"1 I/O request\(s\) in flight"):
        reg.free(mem)
    reg.unhold(tok)
    reg.free(mem)
    with pytest.raises(ValueError, match="collected"):
        reg.unregister(mem.address)                         # it goes with its memory only
    # the caller's unlocked memory is neither
    plain, arr = torch.empty(4096, dtype=torch.uint8), np.empty(4096, dtype=np.uint8)
    for other in (plain, arr, (plain.data_ptr(), 16)):
        assert not reg.is_pinned(other) and not reg.is_direct(other)
    assert reg.io_hold(plain.data_ptr(), 16) == (None, False)
    # a locked allocation beside it is both
    reg.set_budget(None)
    locked = reg.allocate(PAGE_SIZE)
    assert reg.is_pinned(locked) and reg.is_direct(locked)
    assert reg.stats().bytes_locked == PAGE_SIZE
    del mem, t, locked, x                                   # x: the last view looked at
    collect()
    s = reg.stats()
    assert (s.ranges, s.bytes_locked, s.unlocked_ranges, s.unlocked_bytes) == (0, 0, 0, 0)


def test_a_quiet_fallback_keeps_the_warning_for_the_next_one(reg: PinnedRegistry) -> None:
    reg.set_budget(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = reg.allocate(100, strict=False, warn=False)
    with pytest.warns(PinnedMemoryWarning, match="not page-locked") as caught:
        loud = reg.allocate(100, strict=False)              # the first that warns does
    assert len(caught) == 1 and caught[0].filename == __file__
    assert reg.stats().unlocked_fallbacks == 2 and not quiet.locked and not loud.locked


def test_the_engine_look_up_answers_as_io_hold_for_unlocked_memory(reg: PinnedRegistry
                                                                   ) -> None:
    """``_aio.io_hold`` (the engine's look-up, in C) holds the registry's unlocked memory and
    says it may take direct I/O, as ``io_hold`` does, with and without a snapshot."""
    reg.set_budget(0)
    t = reg.empty(4 * PAGE_SIZE, torch.uint8, strict=False, warn=False)
    base = t.data_ptr()
    plain = torch.empty(PAGE_SIZE, dtype=torch.uint8)
    cases = [(base, 4 * PAGE_SIZE), (base + 5, 10), (base + 4 * PAGE_SIZE - 1, 1),
             (base, 4 * PAGE_SIZE + 1), (base, 0), (plain.data_ptr(), 16)]
    for fresh in (True, False):
        for addr, n in cases:
            if fresh:
                reg.engine_view()[0].snap = None
            ours, want = _aio.io_hold(reg, addr, n), reg.io_hold(addr, n)
            assert (ours[0] is want[0], ours[1]) == (True, want[1]), (addr, n)
            tok: Any = want[0]
            if tok is not None:
                assert want[1] and tok.io == 2                  # held by each
                reg.unhold(ours[0])
                reg.unhold(tok)
    assert [reg.io_hold(a, n)[1] for a, n in cases] == [True, True, True, False, False, False]


# ------------------------------------------------------------------------ requests

@pytest.mark.parametrize("how", ["sync", "async", "lanes", "edges", "write"])
def test_reads_into_own_unlocked_memory_go_direct(how: str, engine_backend: str,
                                                  data: tuple[Path, bytes],
                                                  unlocked: None) -> None:
    """Byte-exact against os.pread on every backend, direct, never bounced: one request
    (the compiled path), an async one, one cut across several lanes (the general path), a
    view at an unaligned file offset (its edge blocks staged, its middle direct) and a write
    from it."""
    path, ref = data
    n = 3 * MiB
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buf = pinned.empty(n, torch.uint8, strict=False, warn=False)
    assert not pinned.is_pinned(buf) and pinned.is_direct(buf)
    pinned.set_budget(None)                 # the handle's own ring (edges) is not the subject
    lanes = 4 if how == "lanes" else 1
    with aioswap.AioHandle(backend=engine_backend, block_size=256 * 1024,
                           intra_op_parallelism=lanes) as h:
        assert h.backend == engine_backend
        offset = 0
        if how == "sync":
            assert h.pread(buf, path) == n
        elif how == "async":
            fut = h.pread(buf, path, 0, async_op=True)
            assert fut.result() == n and h.wait() == 1
        elif how == "lanes":
            assert h.pread(buf, path, PAGE_SIZE) == n
            offset = PAGE_SIZE
        elif how == "edges":
            offset = 1000                   # the view's address lines up with the offset
            buf = buf[offset:]
            n -= offset
            assert h.pread(buf, path, offset) == n
        else:
            out = path.with_name("out.bin")
            src = torch.frombuffer(bytearray(ref[:n]), dtype=torch.uint8)
            buf.copy_(src)
            assert h.pwrite(buf, out) == n
            assert out.read_bytes() == ref[:n]
            assert h.stats.direct_bytes == n and h.stats.bounce_bytes == 0
            return
        s = h.stats
    assert bytes(buf.numpy()) == _pread(path, n, offset) == ref[offset:offset + n]
    assert s.bounce_bytes == 0, s
    if how == "edges":
        assert s.direct_bytes > 0 and s.direct_bytes + s.head_tail_bytes == n, s
    else:
        assert s.direct_bytes == n, s


def test_the_callers_unlocked_memory_still_bounces(engine_backend: str,
                                                   data: tuple[Path, bytes]) -> None:
    path, ref = data
    plain = torch.empty(MiB + PAGE_SIZE, dtype=torch.uint8)
    part = plain[PAGE_SIZE - plain.data_ptr() % PAGE_SIZE:][:MiB]     # aligned, not ours
    with aioswap.AioHandle(backend=engine_backend) as h:
        assert h.pread(part, path) == MiB
        assert h.stats.bounce_bytes == MiB and h.stats.direct_bytes == 0
    assert bytes(part.numpy()) == ref[:MiB]


def test_free_and_drop_while_reads_run_into_it(engine_backend: str,
                                               data: tuple[Path, bytes],
                                               unlocked: None) -> None:
    """While requests use aioswap's unlocked memory free() refuses it (the requests hold it:
    the kernel may still write there); dropping every reference is safe: the requests keep
    the memory until they are over, then it goes."""
    path, ref = data
    n = 3 * MiB
    mem = pinned.allocate(n, strict=False, warn=False)
    t = torch.frombuffer(memoryview(mem), dtype=torch.uint8)
    pinned.set_budget(None)
    with aioswap.AioHandle(backend=engine_backend, block_size=64 * 1024) as h:
        # what every request of the compiled path takes: refused while it is out
        hold, direct = _aio.io_hold(pinned.registry, t.data_ptr(), n)
        assert hold is not None and direct
        with pytest.raises(BufferError, match="in flight"):
            pinned.free(t)
        pinned.registry.unhold(hold)
        futs = [h.pread(t, path, 0, async_op=True) for _ in range(8)]
        try:
            pinned.free(mem)
            assert all(f.done() for f in futs), "free returned with reads in flight"
        except BufferError as exc:
            assert "in flight" in str(exc), exc
        assert h.wait() == 8
        assert bytes(t.numpy()) == ref[:n]
        pinned.free(t)                                      # idle now: accepted
        ref_mem = weakref.ref(mem)
        futs = [h.pread(t[i * MiB:(i + 1) * MiB], path, i * MiB, async_op=True)
                for i in range(3)]
        del t, mem                                          # the requests keep it
        assert h.wait() == 3
        del futs
        collect()
        assert ref_mem() is None                            # and it goes after them
        assert h.stats.bounce_bytes == 0 and h.stats.direct_bytes == 8 * n + n


# ------------------------------------------------------------------------ loaders

def _aligned_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors > 8 MiB in all, saved so that the file's size is a multiple of the page: no
    request of a load has an unaligned end (no edge block, so no bounce ring)."""
    from aioswap.safetensors import save_file

    g = torch.Generator().manual_seed(46)
    tensors = {"big": torch.randn(3 * MiB, generator=g),                  # 12 MiB
               "ids": torch.randint(0, 1 << 40, (300_001,), generator=g),
               "bytes": torch.randint(0, 256, (7 * MiB + 13,), dtype=torch.uint8,
                                      generator=g)}
    pad = 0
    for _ in range(8):
        tensors["pad"] = torch.zeros(pad, dtype=torch.uint8)
        save_file(tensors, path, mode=0o644)
        rest = path.stat().st_size % PAGE_SIZE
        if rest == 0:
            return tensors
        pad += PAGE_SIZE - rest
    raise AssertionError("could not align the file's size")


LOAD_CHILD = textwrap.dedent("""
    import json, os, sys, warnings
    try:
        import torch
        import aioswap
        from aioswap import pinned
        from aioswap.safetensors import load_file
    except Exception as exc:        # this user cannot import the package: not our subject
        print(json.dumps({"no_import": f"{type(exc).__name__}: {exc}"}))
        sys.exit(0)
    path, budget, device = sys.argv[1], sys.argv[2], sys.argv[3]
    if budget != "none":
        pinned.set_budget(int(budget))
    out = {"uid": os.getuid(), "aioswap": aioswap.__file__}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with aioswap.AioHandle() as h:
            got = load_file(path, device, handle=h, read="direct")
            s, p = h.stats, pinned.stats()
            out["backend"] = h.backend
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    out["stats"] = {"direct": s.direct_bytes, "bounce": s.bounce_bytes,
                    "edges": s.head_tail_bytes, "buffered": s.buffered_bytes}
    out["pinned"] = {"locked": p.bytes_locked, "unlocked": p.unlocked_bytes,
                     "fallbacks": p.unlocked_fallbacks}
    out["pinned_flags"] = sorted({pinned.is_pinned(t) for t in got.values() if t.numel()})
    # byte-exact against os.pread of the file (header: 8-byte length, then JSON)
    fd = os.open(path, os.O_RDONLY)
    try:
        hlen = int.from_bytes(os.pread(fd, 8, 0), "little")
        header = json.loads(os.pread(fd, hlen, 8))
        bad = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = info["data_offsets"]
            t = got[name].cpu().contiguous()
            raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            if raw != os.pread(fd, hi - lo, 8 + hlen + lo):
                bad.append(name)
    finally:
        os.close(fd)
    out["bad"] = bad
    out["names"] = sorted(got)
    out["file_size"] = os.path.getsize(path)
    print(json.dumps(out))
""")


def _world_readable_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="aioswap-normal-direct-",
                              dir=os.environ.get("AIOSWAP_TEST_DIR") or None))
    d.chmod(0o755)
    return d


def _run_load(prefix: list[str], path: Path, budget: str, device: str
              ) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(path.parent),
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([*prefix, sys.executable, "-c", LOAD_CHILD, str(path), budget,
                           device], capture_output=True, text=True, check=False,
                          timeout=240, env=env, cwd=str(path.parent))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    if "no_import" in out:
        pytest.skip(f"the child cannot import aioswap there: {out['no_import']}")
    return out


def _check_direct_load(out: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
    assert out["aioswap"] == str(REPO / "aioswap" / "__init__.py")
    assert out["bad"] == [] and out["names"] == sorted(tensors), out
    stats = out["stats"]
    assert isinstance(stats, dict)
    data_bytes = sum(t.nbytes for t in tensors.values())
    # every byte read direct into the loader's own memory: none bounced, no edge block
    assert stats["bounce"] == 0 and stats["edges"] == 0 and stats["buffered"] == 0, out
    assert stats["direct"] >= data_bytes, out              # (group ends overlap a block)
    assert out["pinned_flags"] == [False] or out["pinned_flags"] == [False, True], out
    assert out["warnings"] == [], out                       # a CPU load says nothing


@pytest.mark.parametrize("how", ["budget", "normal_user"])
def test_load_file_into_unlocked_memory_reads_direct(how: str, engine_backend: str) -> None:
    """``aioswap.safetensors.load_file`` to the CPU where its memory cannot be locked (a
    budget of 0 bytes; or a normal user: uid 65534, no CAP_IPC_LOCK, an 8 MiB
    RLIMIT_MEMLOCK, a file larger than that): byte-exact tensors, every byte read direct,
    none bounced, and no PinnedMemoryWarning."""
    prefix: list[str] = []
    if how == "normal_user":
        setpriv, prlimit = shutil.which("setpriv"), shutil.which("prlimit")
        if os.geteuid() != 0 or setpriv is None or prlimit is None:
            pytest.skip("needs root (to become uid 65534), setpriv and prlimit")
        prefix = [prlimit, "--memlock=8388608", "--", setpriv, "--reuid=65534",
                  "--regid=65534", "--clear-groups", "--inh-caps=-ipc_lock",
                  "--bounding-set=-ipc_lock", "--"]
    d = _world_readable_dir()
    try:
        if not supports_o_direct(d):
            pytest.skip(f"{d} refuses O_DIRECT; set AIOSWAP_TEST_DIR to a disk directory")
        path = d / "model.safetensors"
        tensors = _aligned_safetensors(path)
        assert path.stat().st_size > 8 * MiB
        out = _run_load(prefix, path, "0" if how == "budget" else "none", "cpu")
        _check_direct_load(out, tensors)
        assert out["backend"] == engine_backend
        pinned_stats = out["pinned"]
        assert isinstance(pinned_stats, dict)
        assert pinned_stats["unlocked"] > 0 and pinned_stats["fallbacks"] > 0, out
        if how == "normal_user":
            assert out["uid"] == 65534
            assert pinned_stats["locked"] <= 8 * MiB, out
        else:
            assert pinned_stats["locked"] == 0, out
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_file_to_cuda_still_warns_where_its_staging_is_unlocked() -> None:
    """For a CUDA device the host memory is staging, whose copies are slower from unlocked
    memory: nothing changes there, one PinnedMemoryWarning says so."""
    d = _world_readable_dir()
    try:
        path = d / "model.safetensors"
        tensors = _aligned_safetensors(path)
        out = _run_load([], path, "0", "cuda")
        assert out["bad"] == [] and out["names"] == sorted(tensors), out
        warned = out["warnings"]
        assert isinstance(warned, list) and len(warned) == 1, out
        assert warned[0].startswith("PinnedMemoryWarning"), out
    finally:
        shutil.rmtree(d, ignore_errors=True)
