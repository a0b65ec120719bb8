"""compat.deepnvme: DeepNVMe's aio_handle / pin_handle / module functions, byte-exact.

The cases follow the behaviours DeepSpeed's own tests/unit/v1/nvme suite checks (block size
1024, queue depth 2, two intra-op workers, every submit/overlap mode, locked and plain
tensors, partitions at file offsets through a path or an O_DIRECT fd, the locked-tensor
manager shared with the pin_memory op), written against os.pread/os.pwrite here.
"""
from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
import torch

from aioswap import pinned
from aioswap.compat import deepnvme
from aioswap.errors import ShortReadError

KiB = 1024
MiB = 1 << 20
BLOCK = 1024                      # DeepSpeed's nvme tests
QDEPTH = 2
PARALLEL = 2
IO_SIZE = 4 * BLOCK

MODES = [(s, o) for s in (True, False) for o in (True, False)]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _ref_file(path, nbytes: int = IO_SIZE) -> bytes:
    data = os.urandom(nbytes)
    with open(path, "wb") as f:
        f.write(data)
    return data


def _fill(t: torch.Tensor, data: bytes) -> torch.Tensor:
    t.view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return t


@pytest.fixture
def h():
    with deepnvme.aio_handle(BLOCK, QDEPTH, True, True, PARALLEL) as handle:
        yield handle


def _buffer(h, kind: str, nbytes: int = IO_SIZE) -> torch.Tensor:
    if kind == "locked":
        return h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    return torch.empty(nbytes, dtype=torch.uint8)


# ------------------------------------------------------------------------- knobs


@pytest.mark.parametrize("single_submit,overlap_events", MODES)
def test_block_size_1024_knobs(single_submit, overlap_events):
    with deepnvme.aio_handle(BLOCK, QDEPTH, single_submit, overlap_events, PARALLEL) as h:
        assert h.get_block_size() == BLOCK
        assert h.get_queue_depth() == QDEPTH
        assert h.get_single_submit() is single_submit
        assert h.get_overlap_events() is overlap_events
        assert h.get_intra_op_parallelism() == PARALLEL


def test_defaults_and_alignment():
    with deepnvme.aio_handle() as h:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
                h.get_overlap_events(), h.get_intra_op_parallelism()) == (
                    MiB, 128, False, False, 1)
        assert h.get_alignment() == 512
    for p in (1, 2, 3, 8):
        with deepnvme.aio_handle(BLOCK, QDEPTH, False, False, p) as h:
            assert h.get_alignment() == 512 * p


@pytest.mark.parametrize("block_size", [1, 512, 1000, 1024, 3 * 1024, 4096 + 512])
def test_odd_block_sizes_round_trip(tmp_path, block_size):
    f = tmp_path / "odd.bin"
    ref = _ref_file(f, 64 * KiB + 512)
    with deepnvme.aio_handle(block_size, 4, False, True, 2) as h:
        assert h.get_block_size() == block_size
        for kind in ("locked", "plain"):
            buf = _buffer(h, kind, len(ref))
            assert h.sync_pread(buf, str(f)) == 1
            assert _bytes(buf) == ref
            out = tmp_path / f"odd-{kind}.bin"
            assert h.sync_pwrite(buf, str(out)) == 1
            assert out.read_bytes() == ref
            h.free_cpu_locked_tensor(buf)


# ------------------------------------------------------------------------- read / write


@pytest.mark.parametrize("kind", ["locked", "plain"])
@pytest.mark.parametrize("single_submit,overlap_events", MODES)
def test_read_sync_and_async(tmp_path, kind, single_submit, overlap_events):
    ref_path = tmp_path / "ref.bin"
    ref = _ref_file(ref_path)
    with deepnvme.aio_handle(BLOCK, QDEPTH, single_submit, overlap_events, PARALLEL) as h:
        buf = _buffer(h, kind)
        assert h.is_pinned(buf) is (kind == "locked")
        assert h.sync_pread(buf, str(ref_path), 0) == 1
        assert _bytes(buf) == ref
        buf.zero_()
        assert h.async_pread(buf, str(ref_path), 0) == 0
        assert h.wait() == 1
        assert _bytes(buf) == ref
        # free: True for the handle's locked tensors, False for anything else
        assert h.free_cpu_locked_tensor(buf) is (kind == "locked")


@pytest.mark.parametrize("kind", ["locked", "plain"])
@pytest.mark.parametrize("single_submit,overlap_events", MODES)
def test_write_sync_and_async(tmp_path, kind, single_submit, overlap_events):
    ref = os.urandom(IO_SIZE)
    with deepnvme.aio_handle(BLOCK, QDEPTH, single_submit, overlap_events, PARALLEL) as h:
        buf = _fill(_buffer(h, kind), ref)
        a, b = tmp_path / "a.bin", tmp_path / "b.bin"
        assert h.sync_pwrite(buf, str(a), 0) == 1
        assert h.async_pwrite(buf, str(b), 0) == 0
        assert h.wait() == 1
        h.free_cpu_locked_tensor(buf)
    assert a.read_bytes() == ref and b.read_bytes() == ref
    assert a.stat().st_size == IO_SIZE


@pytest.mark.parametrize("queued", [2, 3])
def test_async_queue(tmp_path, h, queued):
    refs = [_ref_file(tmp_path / f"r{i}.bin") for i in range(queued)]
    bufs = [_buffer(h, "locked") for _ in range(queued)]
    for i, b in enumerate(bufs):
        assert h.async_pread(b, str(tmp_path / f"r{i}.bin"), 0) == 0
    assert h.wait() == queued
    assert [_bytes(b) for b in bufs] == refs
    for i, b in enumerate(bufs):
        assert h.async_pwrite(b, str(tmp_path / f"w{i}.bin"), 0) == 0
    assert h.wait() == queued
    assert [(tmp_path / f"w{i}.bin").read_bytes() for i in range(queued)] == refs
    assert all(h.free_cpu_locked_tensor(b) for b in bufs)


def test_sync_call_counts_what_was_queued(tmp_path, h):
    """DeepNVMe's synchronous calls wait for every queued op and return that count."""
    ref = _ref_file(tmp_path / "ref.bin")
    bufs = [_buffer(h, "plain") for _ in range(3)]
    assert h.async_pread(bufs[0], str(tmp_path / "ref.bin")) == 0
    assert h.async_pread(bufs[1], str(tmp_path / "ref.bin")) == 0
    assert h.sync_pread(bufs[2], str(tmp_path / "ref.bin")) == 3
    assert h.wait() == 0
    assert all(_bytes(b) == ref for b in bufs)


def test_pread_pwrite_async_keyword(tmp_path, h):
    """DeepNVMe's flag is named ``async`` (reachable by keyword only through **kwargs)."""
    ref = os.urandom(IO_SIZE)
    buf = _fill(_buffer(h, "locked"), ref)
    f = str(tmp_path / "kw.bin")
    assert h.pwrite(buf, f, False, **{"async": True}) == 0
    assert h.wait() == 1
    out = _buffer(h, "plain")
    assert h.pread(buffer=out, filename=f, validate=True, **{"async": False},
                   file_offset=0) == 1
    assert _bytes(out) == ref
    assert h.pread(out, f, False, True) == 0 and h.wait() == 1
    with pytest.raises(TypeError, match="async"):
        h.pread(out, f, False)
    with pytest.raises(TypeError, match="unexpected"):
        h.pwrite(buf, f, False, True, bogus=1)
    h.free_cpu_locked_tensor(buf)


@pytest.mark.parametrize("use_fd", [False, True])
@pytest.mark.parametrize("partitions", [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]])
def test_offset_write(tmp_path, h, partitions, use_fd):
    """Partitions of one locked tensor written at their offsets, by path or O_DIRECT fd."""
    total = sum(partitions) * BLOCK
    data = h.new_cpu_locked_tensor(total, torch.empty(0, dtype=torch.uint8))
    _fill(data, os.urandom(total))
    expected = b""
    f = str(tmp_path / "offsets.bin")
    off = 0
    for p in partitions:
        part = torch.narrow(data, 0, off, p * BLOCK)
        expected += _bytes(part)
        if use_fd:
            fd = os.open(f, os.O_DIRECT | os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                assert h.async_pwrite(buffer=part, fd=fd, file_offset=off) == 0
                assert h.wait() == 1
            finally:
                os.close(fd)
        else:
            assert h.async_pwrite(buffer=part, filename=f, file_offset=off) == 0
            assert h.wait() == 1
        with open(f, "rb") as fh:
            assert fh.read() == expected
        off += p * BLOCK
    # Views of `data` are alive (`part`): freeing is accepted and deferred, never unsafe.
    assert h.free_cpu_locked_tensor(data) is True
    assert _bytes(part) == expected[-part.numel():]


@pytest.mark.parametrize("kind", ["locked", "plain"])
@pytest.mark.parametrize("partitions", [[1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1]])
def test_offset_read(tmp_path, h, partitions, kind):
    total = sum(partitions) * BLOCK
    f = tmp_path / "ref.bin"
    ref = _ref_file(f, total)
    data = _buffer(h, kind, total)
    off = 0
    for p in partitions:
        n = p * BLOCK
        dst = torch.narrow(data, 0, 0, n)
        assert h.sync_pread(dst, str(f), off) == 1
        assert _bytes(dst) == ref[off:off + n]
        off += n
    assert h.free_cpu_locked_tensor(data) is (kind == "locked")


def test_fd_keyword_everywhere(tmp_path, h):
    ref = os.urandom(IO_SIZE)
    buf = _fill(_buffer(h, "plain"), ref)
    f = tmp_path / "fd.bin"
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert h.sync_pwrite(buf, fd=fd) == 1
        out = _buffer(h, "plain")
        assert h.sync_pread(out, fd=fd) == 1 and _bytes(out) == ref
        out.zero_()
        assert h.async_pread(out, fd=fd, file_offset=0) == 0 and h.wait() == 1
        assert _bytes(out) == ref
        assert h.async_pwrite(buf, fd, BLOCK) == 0 and h.wait() == 1     # positional fd
        assert os.pread(fd, IO_SIZE, BLOCK) == ref
        with pytest.raises(TypeError, match="not both"):
            h.async_pwrite(buf, str(f), fd=fd)
        with pytest.raises(TypeError, match="fd must be an int"):
            h.async_pwrite(buf, fd="3")
        with pytest.raises(TypeError, match="filename"):
            h.async_pwrite(buf)
    finally:
        os.close(fd)


def test_read_write_validate_and_errors(tmp_path):
    f = str(tmp_path / "ds.bin")
    with deepnvme.aio_handle() as h:
        t = h.new_cpu_locked_tensor(MiB, torch.empty(0, dtype=torch.float16))
        assert t.dtype == torch.float16 and t.shape == (MiB,) and h.is_pinned(t)
        t.copy_(torch.randn(MiB).half())
        assert h.write(t, f, True) == 0
        out = torch.empty_like(t)
        assert h.read(out, f, True, 0) == 0 and torch.equal(out, t)
        assert h.pwrite(t, f, True, True, 0) == 0 and h.wait() == 1     # validated after
        assert h.pread(out, f, True, True) == 0
        assert h.handle.wait() == 1          # the read is done, its validation still queued
        out.fill_(0)          # the buffer no longer matches the file: validation must fail
        with pytest.raises(ValueError, match="validation failed"):
            h.wait()
        assert h.wait() == 0
        with pytest.raises(ShortReadError):
            h.sync_pread(torch.empty(2 * MiB, dtype=torch.float16), f)
        with pytest.raises(FileNotFoundError):
            h.sync_pread(out, str(tmp_path / "missing.bin"))
        assert h.free_cpu_locked_tensor(t) is True


def test_concurrent_sync_reads_on_one_handle(tmp_path, h):
    """Two threads' synchronous reads each return 1 (DeepNVMe serialises them per handle)."""
    refs = [_ref_file(tmp_path / f"c{i}.bin") for i in range(2)]
    bufs = [_buffer(h, "plain") for _ in range(2)]
    start = threading.Barrier(2)
    status: list[int | None] = [None, None]

    def read(i):
        start.wait()
        for _ in range(20):
            status[i] = h.sync_pread(bufs[i], str(tmp_path / f"c{i}.bin"), 0)
            assert status[i] == 1

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert status == [1, 1]
    assert [_bytes(b) for b in bufs] == refs


# ------------------------------------------------------------------------- locked memory


def test_free_semantics():
    with deepnvme.aio_handle(BLOCK, QDEPTH, False, False, 1) as h:
        example = torch.empty(0, dtype=torch.float32)
        t = h.new_cpu_locked_tensor(4 * BLOCK, example)
        assert h.is_pinned(t) and h.is_pinned(t.narrow(0, BLOCK, BLOCK))
        assert h.free_cpu_locked_tensor(torch.empty(10)) is False         # plain tensor
        assert h.free_cpu_locked_tensor(np.zeros(4)) is False              # not a tensor
        assert h.free_cpu_locked_tensor(t.narrow(0, BLOCK, BLOCK)) is False   # not its start
        other = pinned.empty(16, torch.float32)                             # not the manager's
        assert h.free_cpu_locked_tensor(other) is False
        view = t[BLOCK:2 * BLOCK]
        view.fill_(7.0)
        assert h.free_cpu_locked_tensor(t) is True
        assert h.free_cpu_locked_tensor(t) is False                         # already freed
        # The view still owns valid, locked memory: the release waits for the last view.
        assert h.is_pinned(view) and bool((view == 7.0).all())
        before = pinned.stats().bytes_locked
        del t, view
        gc.collect()
        assert pinned.stats().bytes_locked <= before - 4 * BLOCK * 4


def test_example_keyword_spellings():
    h = deepnvme.pin_handle()
    a = deepnvme.aio_handle()
    try:
        t1 = a.new_cpu_locked_tensor(num_elem=8, example_tenosr=torch.empty(0, dtype=torch.int16))
        t2 = h.new_cpu_locked_tensor(num_elem=8, example_tensor=torch.empty(0, dtype=torch.int64))
        assert (t1.dtype, t2.dtype) == (torch.int16, torch.int64)
        with pytest.raises(TypeError, match="example"):
            a.new_cpu_locked_tensor(8)
        with pytest.raises(TypeError, match="torch tensor"):
            a.new_cpu_locked_tensor(8, "float32")
        assert a.free_cpu_locked_tensor(t1) and h.free_cpu_locked_tensor(t2)
    finally:
        a.close()


def test_pin_handle_and_aio_handle_share_the_manager():
    pin = deepnvme.pin_handle()
    with deepnvme.aio_handle(BLOCK, QDEPTH, False, False, 1) as a, \
            deepnvme.aio_handle(BLOCK, QDEPTH, False, False, 1) as b:
        example = torch.empty(0, dtype=torch.float)
        x = pin.new_cpu_locked_tensor(4 * BLOCK, example)
        y = a.new_cpu_locked_tensor(4 * BLOCK, example)
        for handle in (pin, a, b):
            assert handle.is_pinned(x) and handle.is_pinned(y)
            assert handle.is_pinned(x.narrow(0, BLOCK, BLOCK))
            assert not handle.is_pinned(torch.empty(4 * BLOCK))
        assert b.free_cpu_locked_tensor(x) is True       # freed through another handle
        assert pin.free_cpu_locked_tensor_by_ptr(y.data_ptr()) is True
        assert pin.free_cpu_locked_tensor_by_ptr(y.data_ptr()) is False
        assert a.free_cpu_locked_tensor(y) is False


def test_free_by_ptr_from_a_finalizer():
    """DeepSpeed's native pinned memory frees by address once its tensor is collected."""
    import weakref
    pin = deepnvme.pin_handle()
    base = pin.new_cpu_locked_tensor(1024, torch.empty(0, dtype=torch.float))
    address = base.data_ptr()
    freed: list[bool] = []
    weakref.finalize(base, lambda: freed.append(pin.free_cpu_locked_tensor_by_ptr(address)))
    locked = pinned.stats().bytes_locked
    del base
    gc.collect()
    assert freed == [True]
    assert pinned.stats().bytes_locked < locked


def test_locked_tensor_threads(tmp_path):
    """Allocating and freeing locked tensors while another thread reads (no lost ops)."""
    ref = _ref_file(tmp_path / "t.bin")
    errors: list[BaseException] = []
    with deepnvme.aio_handle(BLOCK, QDEPTH, True, True, PARALLEL) as h:
        buf = torch.zeros(IO_SIZE, dtype=torch.uint8)

        def reads():
            try:
                for _ in range(16):
                    assert h.sync_pread(buf, str(tmp_path / "t.bin"), 0) == 1
            except BaseException as exc:
                errors.append(exc)

        def manage():
            try:
                for _ in range(16):
                    t = h.new_cpu_locked_tensor(BLOCK, torch.empty(1, dtype=torch.uint8))
                    assert h.free_cpu_locked_tensor(t)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reads), threading.Thread(target=manage)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and _bytes(buf) == ref


# ------------------------------------------------------------------------- module functions


@pytest.mark.parametrize("single_submit,overlap_events", MODES)
def test_aio_read_write_functions(tmp_path, single_submit, overlap_events):
    ref = os.urandom(256 * KiB)
    src = tmp_path / "src.bin"
    src.write_bytes(ref)
    buf = pinned.empty(len(ref), torch.uint8)
    assert deepnvme.aio_read(buf, str(src), BLOCK, QDEPTH, single_submit, overlap_events,
                             True) == 0
    assert _bytes(buf) == ref
    dst = tmp_path / "dst.bin"
    assert deepnvme.aio_write(buf, str(dst), BLOCK, QDEPTH, single_submit, overlap_events,
                              True) == 0
    assert dst.read_bytes() == ref
    with pytest.raises(ValueError, match="must be equal"):
        deepnvme.aio_read(torch.empty(len(ref) // 2, dtype=torch.uint8), str(src), BLOCK,
                          QDEPTH, False, False, False)


def test_deepspeed_memcpy():
    src = torch.randn(1000)
    dst = torch.empty(1000)
    assert deepnvme.deepspeed_memcpy(dst, src) == 0
    assert torch.equal(dst, src)
    dst2 = torch.empty(10, 100)
    assert deepnvme.deepspeed_memcpy(dst2, src) == 0 and torch.equal(dst2.reshape(-1), src)
    with pytest.raises(ValueError, match="elements"):
        deepnvme.deepspeed_memcpy(torch.empty(3), src)
    with pytest.raises(TypeError):
        deepnvme.deepspeed_memcpy(np.zeros(3), src)


def test_op_module_surface():
    """What DeepSpeed's code and tests look up on the loaded op modules."""
    for name in ("aio_handle", "aio_read", "aio_write", "deepspeed_memcpy", "gds_handle",
                 "pin_handle"):
        assert callable(getattr(deepnvme, name))
    for method in ("get_block_size", "get_queue_depth", "get_single_submit",
                   "get_overlap_events", "get_intra_op_parallelism", "get_alignment", "read",
                   "write", "pread", "pwrite", "sync_pread", "sync_pwrite", "async_pread",
                   "async_pwrite", "new_cpu_locked_tensor", "free_cpu_locked_tensor",
                   "is_pinned", "wait"):
        assert callable(getattr(deepnvme.aio_handle, method))
    for method in ("new_pinned_device_tensor", "free_pinned_device_tensor",
                   "pin_device_tensor", "unpin_device_tensor"):
        assert callable(getattr(deepnvme.gds_handle, method))


def test_dropped_handle_closes_quietly(tmp_path):
    """DeepSpeed never closes DeepNVMe handles: dropping one must not warn or leak."""
    import warnings
    f = tmp_path / "drop.bin"
    ref = _ref_file(f)
    h = deepnvme.aio_handle(BLOCK, QDEPTH, False, True, PARALLEL)
    buf = torch.empty(IO_SIZE, dtype=torch.uint8)
    assert h.async_pread(buf, str(f)) == 0
    inner = h.handle
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del h
        gc.collect()
    assert inner.closed and _bytes(buf) == ref      # the queued read finished first


# ---------------------------------------------------------------------------------------
# Several drives: AIOSWAP_NVME_PATHS stripes the files under DeepSpeed's nvme_path


def test_nvme_paths_stripe_files_over_every_directory(tmp_path, monkeypatch):
    """Files under the first directory are striped over all of them, byte-exact at odd
    sizes and offsets, sync and async, with validate; a file removed and written again (as
    DeepSpeed clears its swap folder) starts a new layout; elsewhere files are plain."""
    import shutil

    roots = [tmp_path / f"nvme{i}" / "ds" for i in range(3)]
    roots[0].mkdir(parents=True)
    monkeypatch.setenv(deepnvme.NVME_PATHS_ENV, os.pathsep.join(map(str, roots)))
    g = torch.Generator().manual_seed(3)
    data = {f"zero_stage_3/float32params/rank0/{i}_param.tensor.swp":
            torch.randint(0, 256, (3 * (1 << 20) + 4096 * i + 123,), dtype=torch.uint8,
                          generator=g) for i in range(4)}
    (roots[0] / "zero_stage_3" / "float32params" / "rank0").mkdir(parents=True)
    h = deepnvme.aio_handle(block_size=1 << 20, queue_depth=8)
    try:
        for name, t in data.items():
            assert h.async_pwrite(t, str(roots[0] / name)) == 0
        assert h.wait() == len(data)
        for root in roots:                              # every drive holds a part
            for name in data:
                part = root / name
                assert part.stat().st_size > 0, part
                assert (root / (name + ".stripe.json")).exists()
        outs = {n: torch.empty_like(t) for n, t in data.items()}
        for name, out in outs.items():
            assert h.async_pread(out, str(roots[0] / name)) == 0
        assert h.wait() == len(data)
        assert all(torch.equal(outs[n], data[n]) for n in data)
        name = next(iter(data))
        part = torch.empty(777, dtype=torch.uint8)
        assert h.sync_pread(part, str(roots[0] / name), 1_000_001) == 1
        assert torch.equal(part, data[name][1_000_001:1_000_001 + 777])
        assert h.pwrite(part, str(roots[0] / name), True, False, 12_345) == 1   # validated
        # DeepSpeed removes its swap folder and writes the files again
        shutil.rmtree(roots[0] / "zero_stage_3")
        (roots[0] / "zero_stage_3" / "float32params" / "rank0").mkdir(parents=True)
        fresh = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8, generator=g)
        assert h.sync_pwrite(fresh, str(roots[0] / name)) == 1
        back = torch.empty_like(fresh)
        assert h.sync_pread(back, str(roots[0] / name)) == 1
        assert torch.equal(back, fresh)
        with pytest.raises(FileNotFoundError):
            h.sync_pread(back, str(roots[0] / "zero_stage_3" / "missing.swp"))
        other = tmp_path / "elsewhere.bin"                 # not under the first directory
        assert h.sync_pwrite(fresh, str(other)) == 1
        assert other.read_bytes() == fresh.numpy().tobytes()
    finally:
        h.close()


def test_nvme_paths_need_two_distinct_directories(tmp_path, monkeypatch):
    monkeypatch.setenv(deepnvme.NVME_PATHS_ENV, str(tmp_path))
    h = deepnvme.aio_handle()
    try:
        t = torch.arange(4096, dtype=torch.uint8)
        h.sync_pwrite(t, str(tmp_path / "one.bin"))
        assert not (tmp_path / "one.bin.stripe.json").exists()     # one directory: plain
    finally:
        h.close()
    monkeypatch.setenv(deepnvme.NVME_PATHS_ENV, os.pathsep.join([str(tmp_path)] * 2))
    with pytest.raises(ValueError, match="twice"):
        deepnvme.aio_handle()
