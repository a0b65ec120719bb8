"""aioswap.dcp: DCP storage on an AioHandle, single process and 2-/3-rank gloo groups.

Multi-rank runs start one ``python`` per rank (``subprocess``, ``init_method=file://``) on the
worker script below, so a rank can be SIGKILLed like a real crash. Expected values are
rebuilt from the tensor names, so every process and the test compare the same bytes.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from aioswap import AioHandle, pinned
from aioswap.dcp import LAYOUT_ATTRIBUTE, AioReader, AioWriter

REPO = Path(__file__).resolve().parents[1]

# -- expected contents (shared by the workers through the source below) ----------------------

COMMON = '''
import zlib
import torch

SAVE_RANKS = 2
DTENSORS = {"dt_rows": ((10, 6), torch.float32, "shard0"),
            "dt_cols": ((5, 9), torch.float64, "shard1"),
            "dt_bf16": ((7, 3), torch.bfloat16, "shard0"),
            "dt_rep": ((4, 4), torch.float32, "replicate")}


def full(name, shape, dtype=torch.float32, salt=0):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + salt)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def per_rank(r, salt=0):
    return {f"rank{r}.w": full(f"rank{r}.w", (33, 17), salt=salt),
            f"rank{r}.nested": {"ids": torch.arange(r * 10, r * 10 + 10),
                                "blob": bytes([r]) * 1000 + b"x" * salt}}


def plain(salt=0):
    """Values every rank holds alike (DCP saves them once)."""
    return {"step": 7 + salt, "opt": {"lr": 0.5, "name": "adam", "betas": [0.9, 0.99]},
            "big": full("big", (300, 257), salt=salt)}


def bytes_of(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
'''

WORKER = COMMON + '''
import os
import resource
import signal
import sys
import warnings
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from aioswap import AioHandle
from aioswap.dcp import AioReader, AioWriter

warnings.simplefilter("error")
if os.geteuid() != 0 and resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] != resource.RLIM_INFINITY:
    # a normal user's few MiB cannot lock a handle's bounce ring: the documented fallback,
    # said once per process (tests/conftest.py ignores it in the test process too)
    from aioswap.errors import PinnedMemoryWarning
    warnings.filterwarnings("ignore", category=PinnedMemoryWarning)
mode, store, args = sys.argv[1], sys.argv[2], sys.argv[3:]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                        timeout=timedelta(seconds=20))
mesh = init_device_mesh("cpu", (world,))
PLACE = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}


def dtensors(salt=0, zeros=False):
    out = {}
    for name, (shape, dtype, place) in DTENSORS.items():
        t = full(name, shape, dtype, salt)
        out[name] = distribute_tensor(torch.zeros_like(t) if zeros else t, mesh, PLACE[place])
    return out


def state(salt=0):
    sd = {**per_rank(rank, salt), **plain(salt), **dtensors(salt)}
    return sd


def check(sd, saved_ranks, salt=0):
    want = {**plain(salt), **dtensors(salt)}
    for r in range(saved_ranks):
        want.update(per_rank(r, salt))
    def cmp(a, b, path):
        if isinstance(b, dict):
            assert set(a) == set(b), (path, set(a), set(b))
            for k in b:
                cmp(a[k], b[k], path + "." + k)
        elif isinstance(b, torch.Tensor):
            if hasattr(b, "to_local"):
                a, b = a.to_local(), b.to_local()
            assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, a.shape)
            assert torch.equal(bytes_of(a), bytes_of(b)), path
        else:
            assert a == b, (path, a, b)
    cmp(sd, want, "")


def target(saved_ranks):
    sd = {"step": None, "opt": {"lr": None, "name": None, "betas": None},
          "big": torch.zeros(300, 257), **dtensors(zeros=True)}
    for r in range(saved_ranks):
        sd[f"rank{r}.w"] = torch.zeros(33, 17)
        sd[f"rank{r}.nested"] = {"ids": torch.zeros(10, dtype=torch.int64), "blob": None}
    return sd


class KillingHandle(AioHandle):
    """Dies with its writes in flight: a crash in the middle of a save."""

    def wait(self):
        os.kill(os.getpid(), signal.SIGKILL)


if mode == "save":                       # args: aio dir, stock dir, async dir
    sd = state()
    dcp.save(sd, storage_writer=AioWriter(args[0]))
    dcp.save(sd, storage_writer=FileSystemWriter(args[1]))
    writer = AioWriter(args[2])
    dcp.async_save(sd, storage_writer=writer).result()
elif mode == "load":                     # args: saved ranks, dirs to read, dir to save
    saved = int(args[0])
    for d in args[1].split(","):
        for reader in (AioReader(d), FileSystemReader(d)):
            sd = target(saved)
            dcp.load(sd, storage_reader=reader)
            check(sd, saved)
    dcp.save(state(salt=1), storage_writer=AioWriter(args[2]))
elif mode == "kill":                     # args: dir holding a committed checkpoint
    sd = state(salt=2)
    handle = KillingHandle() if rank == 1 else None
    dcp.save(sd, storage_writer=AioWriter(args[0], handle=handle))
    raise SystemExit(3)                  # unreachable: rank 1 is dead, the gather fails
dist.destroy_process_group()
print("ok", mode, rank, flush=True)
'''

_common: dict[str, Any] = {}
exec(COMMON, _common)  # noqa: S102 - our own source, shared with the worker processes
full, per_rank, plain, bytes_of = (_common[k] for k in ("full", "per_rank", "plain", "bytes_of"))
DTENSORS, SAVE_RANKS = _common["DTENSORS"], _common["SAVE_RANKS"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def _launch(tmp: Path, world: int, mode: str, *args: str) -> list[subprocess.Popen[str]]:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    store = tmp / f"store-{mode}-{time.monotonic_ns()}"
    procs = []
    for r in range(world):
        env = _env()
        env.update(RANK=str(r), WORLD_SIZE=str(world))
        procs.append(subprocess.Popen([sys.executable, str(script), mode, str(store), *args],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _run(tmp: Path, world: int, mode: str, *args: str, timeout: float = 120) -> None:
    procs = _launch(tmp, world, mode, *args)
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {mode} {r}" in out, f"rank {r} of {mode}:\n{out}"


def _target(saved_ranks: int, dtensor_shapes: bool = True) -> dict[str, Any]:
    sd: dict[str, Any] = {"step": None, "opt": {"lr": None, "name": None, "betas": None},
                          "big": torch.zeros(300, 257)}
    for name, (shape, dtype, _) in DTENSORS.items():
        sd[name] = torch.zeros(shape, dtype=dtype)
    for r in range(saved_ranks):
        sd[f"rank{r}.w"] = torch.zeros(33, 17)
        sd[f"rank{r}.nested"] = {"ids": torch.zeros(10, dtype=torch.int64), "blob": None}
    return sd


def _want(saved_ranks: int, salt: int = 0) -> dict[str, Any]:
    want: dict[str, Any] = dict(plain(salt))
    for name, (shape, dtype, _) in DTENSORS.items():
        want[name] = full(name, shape, dtype, salt)
    for r in range(saved_ranks):
        want.update(per_rank(r, salt))
    return want


def _assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(bytes_of(got), bytes_of(want)), path
    else:
        assert got == want, path


def _load(sd: dict[str, Any], reader: Any) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def _save(sd: dict[str, Any], writer: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, storage_writer=writer, no_dist=True)


# -- multi-rank ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Checkpoints saved by 2 ranks (AioWriter, FileSystemWriter, async AioWriter), then
    loaded and resharded by 3 ranks, which save one more with AioWriter."""
    tmp = tmp_path_factory.mktemp("dcp")
    dirs = {k: tmp / k for k in ("aio", "stock", "async", "three")}
    _run(tmp, SAVE_RANKS, "save", str(dirs["aio"]), str(dirs["stock"]), str(dirs["async"]))
    _run(tmp, 3, "load", str(SAVE_RANKS),
         ",".join(str(dirs[k]) for k in ("aio", "stock", "async")), str(dirs["three"]))
    dirs["tmp"] = tmp
    yield dirs


@pytest.mark.parametrize("which", ["aio", "stock", "async"])
@pytest.mark.parametrize("reader", [AioReader, FileSystemReader])
def test_two_ranks_saved_one_loads(saved: dict[str, Path], which: str, reader: type) -> None:
    """Saved by 2 ranks (DTensors sharded over 2), loaded whole by 1 process: bytes equal;
    the stock reader reads AioWriter's files and AioReader reads FileSystemWriter's."""
    got = _load(_target(SAVE_RANKS), reader(saved[which]))
    _assert_same(got, _want(SAVE_RANKS))


@pytest.mark.parametrize("reader", [AioReader, FileSystemReader])
def test_three_ranks_saved_one_loads(saved: dict[str, Path], reader: type) -> None:
    got = _load(_target(3), reader(saved["three"]))
    _assert_same(got, _want(3, salt=1))


def test_files_and_modes(saved: dict[str, Path]) -> None:
    """One data file per rank with a per-save name, all 0600; the layout is recorded."""
    for which, ranks in (("aio", SAVE_RANKS), ("async", SAVE_RANKS), ("three", 3)):
        names = sorted(os.listdir(saved[which]))
        data = [n for n in names if n.endswith(".distcp")]
        assert names == sorted([".metadata", *data]) and len(data) == ranks, names
        for n in names:
            assert os.stat(saved[which] / n).st_mode & 0o777 == 0o600, (which, n)
    md = FileSystemReader(saved["aio"]).read_metadata()
    layout = getattr(md, LAYOUT_ATTRIBUTE)
    assert layout["version"] == 1 and layout["tensors"]
    for index, (data_offset, sizes, dtype) in layout["tensors"].items():
        nbytes = torch.Size(sizes).numel() * torch.empty(0, dtype=dtype).element_size()
        if nbytes >= 4096:          # big tensors start on a block: direct I/O both ways
            assert (md.storage_data[index].offset + data_offset) % 4096 == 0, index


@pytest.mark.slow
def test_sigkill_mid_save_keeps_previous(saved: dict[str, Path]) -> None:
    """Rank 1 is SIGKILLed with its writes in flight while 2 ranks overwrite a committed
    checkpoint: the previous checkpoint still loads, bytes equal; the next save cleans up."""
    d = saved["tmp"] / "killed"
    _run(saved["tmp"], SAVE_RANKS, "save", str(d), str(saved["tmp"] / "s2"),
         str(saved["tmp"] / "a2"))
    before = set(os.listdir(d))
    procs = _launch(saved["tmp"], SAVE_RANKS, "kill", str(d))
    try:
        procs[1].wait(timeout=120)
        assert procs[1].returncode == -signal.SIGKILL, procs[1].communicate()[0]
        try:
            procs[0].wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode != 0
    after = set(os.listdir(d))
    assert after > before, "the killed save wrote no files"
    for reader in (AioReader(d), FileSystemReader(d)):
        _assert_same(_load(_target(SAVE_RANKS), reader), _want(SAVE_RANKS))
    # the next committed save removes the old and the orphaned files
    sd = {"x": torch.arange(5)}
    _save(sd, AioWriter(d))
    names = os.listdir(d)
    assert len([n for n in names if n.endswith(".distcp")]) == 1, names
    got = _load({"x": torch.zeros(5, dtype=torch.int64)}, AioReader(d))
    assert torch.equal(got["x"], sd["x"])


# -- single process ------------------------------------------------------------------------

def _random_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(1000, 37, generator=g),
        "nested": {"deep": {"i": torch.arange(10), "nc": torch.randn(40, 30, generator=g).t()}},
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "bf16": torch.randn(4097, generator=g).to(torch.bfloat16),
        "bool": torch.rand(777, generator=g) > 0.5,
        "big": torch.randn(3 << 18, generator=g),
        "view": torch.randn(500, 64, generator=g)[100:300, 8:40],     # a window of a storage
        "raw": os.urandom(3000),
        "meta": {"epoch": 3, "names": ["a", "b"]},
    }


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: _zeros_like(v) if isinstance(v, dict) else
            torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


@pytest.mark.parametrize("writer", ["aio", "stock"])
@pytest.mark.parametrize("reader", ["aio", "stock"])
def test_roundtrip_single_process(tmp_dir: Path, writer: str, reader: str) -> None:
    sd = _random_state()
    _save(sd, AioWriter(tmp_dir) if writer == "aio" else FileSystemWriter(tmp_dir))
    got = _load(_zeros_like(sd), AioReader(tmp_dir) if reader == "aio" else
                FileSystemReader(tmp_dir))
    _assert_same(got, sd)


@pytest.mark.parametrize("read", ["auto", "direct", "buffered"])
@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_reads_adapt_to_the_page_cache(tmp_dir: Path, read: str, cache: str) -> None:
    """AioReader(read=...): byte-exact whether the checkpoint is cached or not and whatever
    the mode; auto copies cached files and reads the others direct (the stats say which)."""
    from aioswap import _adaptive
    sd = _random_state()
    _save(sd, AioWriter(tmp_dir))
    from test_adaptive import drop
    for p in tmp_dir.rglob("*.distcp"):
        drop(p)
        if cache == "warm":
            p.read_bytes()
    before = _adaptive.stats.snapshot()
    got = _load(_zeros_like(sd), AioReader(tmp_dir, read=read))
    _assert_same(got, sd)
    after = _adaptive.stats.snapshot()
    copied = after["buffered_bytes"] - before["buffered_bytes"]
    direct = after["direct_bytes"] - before["direct_bytes"]
    assert copied + direct > 0
    if read == "direct" or (read == "auto" and cache == "cold"):
        assert copied == 0
    if read == "buffered" or (read == "auto" and cache == "warm"):
        assert direct == 0
    with pytest.raises(ValueError, match="read='fast'"):
        AioReader(tmp_dir, read="fast")


@pytest.mark.parametrize("reader", ["aio", "stock"])
def test_roots_spread_a_ranks_files_over_drives(tmp_dir: Path, reader: str) -> None:
    """AioWriter(roots=...): a rank's files spread over the checkpoint directory and the
    roots, each found through a link in the checkpoint directory by both readers; a new
    save replaces them on every drive, leaving no file of the old one."""
    ckpt, roots = tmp_dir / "ckpt", [tmp_dir / "nvme1" / "ck", tmp_dir / "nvme2" / "ck"]
    sd = _random_state()
    _save(sd, AioWriter(ckpt, roots=roots))
    for d in [ckpt, *roots]:
        assert list(d.glob("__0_*.distcp")), d          # each drive holds one of the files
    links = [p for p in ckpt.glob("__0_*.distcp") if p.is_symlink()]
    assert len(links) == 2
    assert {Path(os.readlink(p)).parent for p in links} == {r.resolve() for r in roots}
    for p in [ckpt, *roots]:
        for f in p.glob("__0_*.distcp"):
            if not f.is_symlink():
                assert (f.stat().st_mode & 0o777) == 0o600, f
    read = AioReader(ckpt) if reader == "aio" else FileSystemReader(ckpt)
    _assert_same(_load(_zeros_like(sd), read), sd)
    old = {p.name for d in [ckpt, *roots] for p in d.glob("__0_*.distcp")}
    sd2 = _random_state()
    sd2["w"] += 1
    _save(sd2, AioWriter(ckpt, roots=roots))
    now = {p.name for d in [ckpt, *roots] for p in d.glob("__0_*.distcp")}
    assert not (old & now) and len(now) == 3            # the old files are gone everywhere
    read = AioReader(ckpt) if reader == "aio" else FileSystemReader(ckpt)
    _assert_same(_load(_zeros_like(sd2), read), sd2)
    with pytest.raises(ValueError, match="distinct"):
        AioWriter(ckpt, roots=[ckpt])


def test_bytes_on_disk_match_stock_blobs(tmp_dir: Path) -> None:
    """Each tensor's blob is a torch.save archive whose data sits at the recorded offset."""
    sd = {"a": torch.randn(3000, 5), "b": torch.arange(7)}
    _save(sd, AioWriter(tmp_dir, files_per_rank=2))
    md = FileSystemReader(tmp_dir).read_metadata()
    layout = getattr(md, LAYOUT_ATTRIBUTE)["tensors"]
    for index, info in md.storage_data.items():
        with open(tmp_dir / info.relative_path, "rb") as f:
            blob = os.pread(f.fileno(), info.length, info.offset)
        t = torch.load(io.BytesIO(blob), weights_only=True)
        assert torch.equal(t, sd[index.fqn])
        off, sizes, dtype = layout[index]
        assert blob[off:off + t.nbytes] == bytes_of(t).numpy().tobytes()
        assert sizes == tuple(t.shape) and dtype == t.dtype
    assert len({i.relative_path for i in md.storage_data.values()}) == 2


def test_file_per_item_and_overwrite_refused(tmp_dir: Path) -> None:
    sd = _random_state()
    _save(sd, AioWriter(tmp_dir, single_file_per_rank=False))
    assert len([n for n in os.listdir(tmp_dir) if n.endswith(".distcp")]) >= 8
    _assert_same(_load(_zeros_like(sd), FileSystemReader(tmp_dir)), sd)
    from torch.distributed.checkpoint.api import CheckpointException   # a BaseException
    with pytest.raises(CheckpointException) as info:
        _save(sd, AioWriter(tmp_dir, overwrite=False))
    assert "overwrite=False" in str(info.value) + repr(getattr(info.value, "failures", ""))


def test_pinned_paths_are_direct(tmp_dir: Path) -> None:
    """Staged (page-locked) tensors are written, and page-locked targets read, with O_DIRECT."""
    sd = {f"w{i}": torch.randn(64, 1024) for i in range(4)}
    with AioHandle() as h:
        w = AioWriter(tmp_dir, handle=h)
        staged = w.stage(sd)
        assert all(pinned.is_pinned(t) for t in staged.values())
        _save(staged, w)
        assert h.stats.bounce_bytes == 0 and h.stats.buffered_bytes == 0
        assert h.stats.direct_bytes >= 4 * 64 * 1024 * 4
    with AioHandle() as h:
        out = {k: pinned.empty((64, 1024), torch.float32) for k in sd}
        _load(out, AioReader(tmp_dir, handle=h))
        assert h.stats.direct_bytes == 4 * 64 * 1024 * 4 and h.stats.bounce_bytes == 0
    _assert_same(out, sd)


def test_dtype_conversion_and_noncontiguous_destination(tmp_dir: Path) -> None:
    """A destination of another dtype, or a non-contiguous one, is filled through a staging
    buffer, and matches what the stock reader gives."""
    sd = {"m": torch.randn(50, 40, dtype=torch.float64)}
    _save(sd, AioWriter(tmp_dir))
    got = _load({"m": torch.zeros(50, 40, dtype=torch.float32)}, AioReader(tmp_dir))
    ref = _load({"m": torch.zeros(50, 40, dtype=torch.float32)}, FileSystemReader(tmp_dir))
    assert torch.equal(got["m"], ref["m"]) and torch.equal(got["m"], sd["m"].float())
    base = torch.zeros(40, 50, dtype=torch.float64)
    _load({"m": base.t()}, AioReader(tmp_dir, staging_bytes=1))
    assert torch.equal(base.t(), sd["m"])


def test_async_save_stages_pinned_and_caches(tmp_dir: Path) -> None:
    sd = {"a": torch.randn(100, 100), "n": {"b": torch.arange(12).view(3, 4)}, "k": 5}
    w = AioWriter(tmp_dir, cache_staged_state_dict=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.async_save(sd, storage_writer=w, no_dist=True).result()
        first = w.stage(sd)["a"]
        sd["a"] += 1
        dcp.async_save(sd, storage_writer=w, no_dist=True).result()
    assert w.stage(sd)["a"].data_ptr() == first.data_ptr() and pinned.is_pinned(first)
    _assert_same(_load(_zeros_like(sd), FileSystemReader(tmp_dir)), sd)


def test_bad_arguments(tmp_dir: Path) -> None:
    with pytest.raises(ValueError, match="files_per_rank"):
        AioWriter(tmp_dir, files_per_rank=0)
    with pytest.raises(ValueError, match="staging_bytes"):
        AioReader(tmp_dir, staging_bytes=0)


def test_truncated_file_raises(tmp_dir: Path) -> None:
    sd = {"a": torch.randn(10000)}
    _save(sd, AioWriter(tmp_dir))
    (data,) = [n for n in os.listdir(tmp_dir) if n.endswith(".distcp")]
    os.truncate(tmp_dir / data, 4096)
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException) as info:
        _load({"a": torch.zeros(10000)}, AioReader(tmp_dir))
    assert f"{data} is 4096 bytes" in repr(info.value.failures), info.value.failures


@pytest.mark.slow
def test_bench_dcp_smoke(tmp_dir: Path) -> None:
    """benchmarks/bench_dcp.py at a tiny size, 1 and 2 ranks: a table, no files left."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_dcp.py"), "--dir",
                           str(tmp_dir), "--layers", "1", "--hidden", "16", "--repeat", "1",
                           "--ranks", "1,2"], capture_output=True, text=True, timeout=300,
                          env=_env(), check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "10^9 bytes per second" in out and "aioswap/other" in out, out
    for method in ("aioswap", "stock", "stock, N threads"):
        for ranks in (1, 2):
            line = [x for x in out.splitlines()
                    if x.startswith(method + " ") and x[18:24].strip() == str(ranks)]
            assert len(line) == 1, (method, ranks, out)
            figures = [float(v) for v in line[0][24:].replace("(", " ").replace(")", " ")
                       .replace("-", " ").split()]
            assert len(figures) == 8 and all(v >= 0 for v in figures), line
            if method == "aioswap":
                assert figures[-2:] == [1.0, 1.0]
    assert list(tmp_dir.iterdir()) == []


DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.complex64, torch.bool, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_block_boundaries(tmp_dir: Path, dtype: torch.dtype) -> None:
    """Tensors of every size class around the 4096-byte block (data, tail, glue) and many
    dtypes, next to each other in one file: both readers give back the bytes."""
    item = torch.empty(0, dtype=dtype).element_size()
    sizes = [1, 7, 4095, 4096, 4097, 8191, 3 * 4096 + 5, 1 << 16]
    sd = {}
    for i, nbytes in enumerate(sizes):
        raw = torch.frombuffer(bytearray(os.urandom(max(item, nbytes // item * item))),
                               dtype=torch.uint8)
        if dtype == torch.bool:
            raw = raw % 2
        sd[f"t{i}"] = raw.view(dtype)
    _save(sd, AioWriter(tmp_dir))
    for reader in (AioReader(tmp_dir), FileSystemReader(tmp_dir)):
        _assert_same(_load({k: torch.zeros_like(v) for k, v in sd.items()}, reader), sd)


FULL_DISK = """
import os, resource, signal, sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from aioswap.dcp import AioReader, AioWriter
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # EFBIG instead of a signal, like ENOSPC
d = sys.argv[1]
a = {"w": torch.arange(1000.0)}
dcp.save(a, storage_writer=AioWriter(d), no_dist=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    dcp.save({"w": torch.randn(1 << 20)}, storage_writer=AioWriter(d), no_dist=True)
except BaseException as exc:
    print("raised", type(exc).__name__, "File too large" in repr(exc) or repr(exc)[:300])
else:
    print("no error")
got = {"w": torch.zeros(1000)}
dcp.load(got, storage_reader=AioReader(d), no_dist=True)
print("previous intact", torch.equal(got["w"], a["w"]))
"""


def test_full_disk_keeps_previous(tmp_dir: Path) -> None:
    """A save that hits the file size limit (EFBIG, as a full disk gives ENOSPC) raises and
    leaves the committed checkpoint in place."""
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_dir)], capture_output=True,
                          text=True, timeout=120, env=_env(), check=False)
    assert done.returncode == 0, done.stderr
    assert "raised CheckpointException True" in done.stdout, done.stdout
    assert "previous intact True" in done.stdout, done.stdout
