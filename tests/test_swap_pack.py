"""TensorSwapper, format 2: packed state dicts, pinned destinations, space, version 1, ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import aioswap
from aioswap import pinned
from aioswap.errors import ChecksumError, SwapError
from aioswap.swap import MANIFEST_NAME, PACK_ALIGN, TensorSwapper, current_rank

from test_swap import _bytes, _check, _data_files, _mixed_state_dict, _rand, _snapshot

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST_NAME).read_text())


def _packs(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()
                  if p.name.startswith("p-") and p.name.endswith(".bin"))


def _gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------
# Packing


def test_mixed_state_dict_is_one_aligned_pack(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    sd = _mixed_state_dict(120)
    snap = _snapshot(sd)
    with TensorSwapper(d) as sw:
        sw.swap_out_state_dict("m/", sd)
        doc = _manifest(d)
        assert doc["version"] == 2
        packs = _packs(d)
        assert len(packs) == 1 and list(doc["packs"]) == packs
        assert [p for p in _data_files(d) if not p.startswith("p-")] == []
        size = (d / packs[0]).stat().st_size
        assert doc["packs"][packs[0]] == size and size % PACK_ALIGN == 0
        fd = os.open(d / packs[0], os.O_RDONLY)
        try:
            for e in doc["entries"]:
                assert e["file"] == packs[0] and e["offset"] % PACK_ALIGN == 0
                # byte-exact against plain os.pread of the recorded range
                raw = os.pread(fd, e["nbytes"], e["offset"]) if e["nbytes"] else b""
                assert raw == snap[e["name"][2:]][0], e["name"]
        finally:
            os.close(fd)
        spans = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in doc["entries"])
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))      # no overlap
        _check(snap, sw.swap_in_state_dict("m/"))
    with TensorSwapper(d) as sw:                      # and after a reopen
        _check(snap, sw.swap_in_state_dict("m/", verify=True))


def test_pack_size_cap(tmp_dir: Path) -> None:
    gen = _gen()
    sd = {f"t{i}": _rand((n,), torch.uint8, gen)
          for i, n in enumerate([5000, 70000, 30000, 200000, 1, 0, 65536, 10])}
    snap = _snapshot(sd)
    cap = 64 * 1024
    with TensorSwapper(tmp_dir / "s", pack_bytes=cap) as sw:
        sw.swap_out_state_dict("", sd)
        doc = _manifest(tmp_dir / "s")
        assert len(doc["packs"]) > 1
        for f, size in doc["packs"].items():
            members = [e for e in doc["entries"] if e["file"] == f]
            # over the cap only when it holds one tensor larger than the cap
            assert size <= cap or (len([m for m in members if m["nbytes"]]) == 1
                                   and max(m["nbytes"] for m in members) > cap - PACK_ALIGN)
        _check(snap, sw.swap_in_state_dict(""))
    with pytest.raises(ValueError, match="pack_bytes"):
        TensorSwapper(tmp_dir / "t", pack_bytes=100)


def test_batched_requests_and_one_fsync_per_pack(tmp_dir: Path, monkeypatch) -> None:
    gen = _gen()
    sd = {f"w{i}": _rand((1000 + 17 * i,), torch.float32, gen) for i in range(40)}
    calls: dict[str, list] = {"fsync": []}
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        import stat as st
        if st.S_ISREG(os.fstat(fd).st_mode):
            calls["fsync"].append(fd)
        real_fsync(fd)

    with aioswap.AioHandle() as h, TensorSwapper(tmp_dir / "s", handle=h) as sw:
        monkeypatch.setattr(os, "fsync", counting_fsync)
        s0 = h.stats
        sw.swap_out_state_dict("sd/", sd)
        monkeypatch.setattr(os, "fsync", real_fsync)
        s1 = h.stats
        # one async request per tensor
        assert (s1.writes - s0.writes, s1.async_ops - s0.async_ops, s1.reads) == (40, 40, 0)
        assert len(calls["fsync"]) == 2                        # the pack + the manifest .tmp
        got = sw.swap_in_state_dict("sd/")
        s2 = h.stats
        assert (s2.reads - s1.reads, s2.async_ops - s1.async_ops) == (40, 40)
        # the swapper's files are the handle's own (h.open, adopt): not one path or fd
        # argument went through the handle's cache of the files behind them
        assert not h._core.files
        for k, v in sd.items():
            assert _bytes(got[k]) == _bytes(v)


def test_fresh_destinations_are_pinned_within_budget(tmp_dir: Path) -> None:
    gen = _gen()
    sd = {f"a{i}": _rand((3, 20000 + i), torch.float16, gen) for i in range(6)}  # ~120 KB
    sd.update({f"b{i}": _rand((100 + i,), torch.int32, gen) for i in range(5)})   # small
    sd["empty"] = torch.empty(0)
    sd["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    snap = _snapshot(sd)
    small = [k for k in sd if not k.startswith("a")]
    with aioswap.AioHandle() as h, TensorSwapper(tmp_dir / "s", handle=h) as sw:
        sw.swap_out_state_dict("", sd)
        s0 = h.stats
        got = sw.swap_in_state_dict("")
        _check(snap, got)
        assert all(pinned.is_pinned(got[f"a{i}"]) for i in range(6))
        # small ones are read through one locked slab into plain memory
        assert not any(pinned.is_pinned(got[k]) for k in small)
        assert all(got[k].untyped_storage().resizable() for k in small)
        assert all(got[k].is_contiguous() for k in sd)
        if hasattr(s0, "direct_bytes"):     # the handle reports its paths
            moved = h.stats.direct_bytes - s0.direct_bytes
            assert moved >= sum(v.numel() * v.element_size() for v in sd.values())
    with TensorSwapper(tmp_dir / "s", pin_budget=130000) as sw:
        got = sw.swap_in_state_dict("")
        _check(snap, got)
        flags = [pinned.is_pinned(got[f"a{i}"]) for i in range(6)]
        assert flags == [True, False, False, False, False, False]   # 120 KB each: 1 fits
        assert got["a1"].untyped_storage().resizable()     # plain memory past the budget
    with TensorSwapper(tmp_dir / "s", pin_memory=True) as sw:
        got = sw.swap_in_state_dict("")
        _check(snap, got)
        assert all(pinned.is_pinned(got[k]) for k in sd if k != "empty")
    with TensorSwapper(tmp_dir / "s", pin_memory=False) as sw:
        got = sw.swap_in_state_dict("")
        _check(snap, got)
        assert not any(pinned.is_pinned(got[k]) for k in sd)
        sw.swap_out_state_dict("again/", got, release=True)   # plain tensors can be released


def test_out_and_in_place_restores_from_packs(tmp_dir: Path) -> None:
    sd = _mixed_state_dict(40, releasable=True)
    snap = _snapshot(sd)
    with TensorSwapper(tmp_dir / "s") as sw:
        sw.swap_out_state_dict("r/", sd, release=True)
        assert all(v.untyped_storage().nbytes() == 0 for v in sd.values() if v.numel())
        got = sw.swap_in_state_dict("r/", state_dict=sd)
        assert got is sd
        _check(snap, sd)
        # out= tensors (non-contiguous ones included) are read into
        outs = {k: torch.empty_like(v).transpose(0, 1).contiguous().transpose(0, 1)
                if v.dim() == 2 else torch.empty_like(v) for k, v in sd.items()}
        res = sw.swap_in_state_dict("r/", state_dict=dict(outs))
        for k in sd:
            assert res[k] is outs[k]
        _check(snap, res)
        fut = sw.swap_in_state_dict("r/", async_op=True)
        _check(snap, fut.result())
        assert sw.wait() == 1


def test_corrupted_packed_tensor_names_itself(tmp_dir: Path) -> None:
    gen = _gen()
    sd = {"a": _rand((5000,), torch.uint8, gen), "b": _rand((7000,), torch.uint8, gen),
          "c": _rand((3,), torch.uint8, gen)}
    with TensorSwapper(tmp_dir / "s") as sw:
        sw.swap_out_state_dict("", sd)
        info = sw.info("b")
        with open(info.file, "r+b") as f:
            f.seek(info.offset + 10)
            f.write(b"\xff" if sd["b"][10] != 255 else b"\x00")
        with pytest.raises(ChecksumError, match="'b'.*offset"):
            sw.swap_in_state_dict("")
        assert torch.equal(sw.swap_in("a"), sd["a"])          # neighbours unaffected
        assert torch.equal(sw.swap_in("c"), sd["c"])
        os.truncate(info.file, info.offset + 4096)
        out = torch.zeros(5000, dtype=torch.uint8)
        with pytest.raises(SwapError, match="truncated"):
            sw.swap_in("a", out=out)
        assert int(out.count_nonzero()) == 0                   # checked before any I/O


# ----------------------------------------------------------------------------------------
# Space: overwrite, remove, compaction


def test_overwrite_and_remove_packed_tensors(tmp_dir: Path) -> None:
    gen = _gen()
    d = tmp_dir / "s"
    sd = {f"t{i}": _rand((20000 + i,), torch.int16, gen) for i in range(6)}
    snap = _snapshot(sd)
    with TensorSwapper(d) as sw:
        sw.swap_out_state_dict("p/", sd)
        (pack,) = _packs(d)
        new3 = _rand((20003,), torch.int16, gen)
        sw.swap_out("p/t3", new3, overwrite=True)              # single file replaces it
        sw.remove("p/t1")
        assert _packs(d) == [pack]                             # still has live tensors
        for i in (0, 2, 4, 5):
            assert _bytes(sw.swap_in(f"p/t{i}")) == snap[f"t{i}"][0]
        assert torch.equal(sw.swap_in("p/t3"), new3)
        live, size = sw.pack_usage()[str(d / pack)]
        assert live == sum(sd[f"t{i}"].numel() * 2 for i in (0, 2, 4, 5)) and size > live
        # a packed overwrite of part of it: the rest of the old pack stays valid
        sw.swap_out_state_dict("p/", {"t0": sd["t0"] * 0 + 1, "t2": sd["t2"] * 0 + 2},
                               overwrite=True)
        assert len(_packs(d)) == 2
        assert _bytes(sw.swap_in("p/t4")) == snap["t4"][0]
        sw.remove_many(["p/t4", "p/t5"])
        assert pack not in _packs(d)                           # last live entry gone
        assert torch.equal(sw.swap_in("p/t0"), torch.ones(20000, dtype=torch.int16))
    with TensorSwapper(d) as sw:
        assert sorted(sw.names()) == ["p/t0", "p/t2", "p/t3"]
        assert torch.equal(sw.swap_in("p/t2"), torch.full((20002,), 2, dtype=torch.int16))


def test_compact_reclaims_mostly_dead_packs(tmp_dir: Path) -> None:
    gen = _gen()
    d = tmp_dir / "s"
    sd = {f"t{i}": _rand((100000,), torch.uint8, gen) for i in range(8)}
    snap = _snapshot(sd)
    with TensorSwapper(d) as sw:
        sw.swap_out_state_dict("", sd)
        assert sw.compact() == 0                               # nothing dead yet
        sw.remove_many([f"t{i}" for i in range(6)])
        (old,) = _packs(d)
        old_size = (d / old).stat().st_size
        freed = sw.compact(0.5)
        (new,) = _packs(d)
        assert new != old and freed == old_size - (d / new).stat().st_size > 0
        for k in ("t6", "t7"):
            assert _bytes(sw.swap_in(k, verify=True)) == snap[k][0]
        info = sw.info("t7")
        assert info.checksum is not None
    with TensorSwapper(d) as sw:
        assert sw.names() == ["t6", "t7"]
        assert _bytes(sw.swap_in("t6")) == snap["t6"][0]


_PACK_CRASH_CHILD = """
    import sys, torch
    import aioswap
    from aioswap.swap import TensorSwapper
    roots, which = sys.argv[1].split(","), sys.argv[2]
    h = aioswap.AioHandle(block_size=64 * 1024, queue_depth=1)    # slow enough to be killed
    sw = TensorSwapper(roots, handle=h)     # several: every pack striped over them
    def sd(v):
        return {f"w{i}": torch.full((1000 + i,), float(v)) for i in range(20)} | {
            "big": torch.full((64 * 2**20 // 4,), float(v))}
    if which == "first":
        sw.swap_out_state_dict("sd/", sd(1))
        print("READY", flush=True)
    else:
        print("STARTED", flush=True)
        sw.swap_out_state_dict("sd/", sd(2), overwrite=True)
        print("DONE", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("drives", [1, 3])
def test_sigkill_during_packed_save_keeps_one_whole_dict(tmp_dir: Path, drives: int) -> None:
    """SIGKILL early, mid-write and late in an overwriting save: the old or the new dict,
    whole; the loser's files are gone (with 3 directories: on every drive)."""
    dirs = [tmp_dir / f"crash{i}" for i in range(drives)]
    arg = ",".join(str(x) for x in dirs)
    code = textwrap.dedent(_PACK_CRASH_CHILD)
    r = subprocess.run([sys.executable, "-c", code, arg, "first"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, check=False)
    assert "READY" in r.stdout, r.stderr
    seen = set()
    for delay in (0.05, 0.5, 2.0):          # early, mid-write, and (likely) after the commit
        p = subprocess.Popen([sys.executable, "-c", code, arg, "second"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT)
        try:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "STARTED"
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            for s in (p.stdout, p.stderr):
                if s:
                    s.close()
        with TensorSwapper(dirs, verify=True) as sw:
            got = sw.swap_in_state_dict("sd/")
            values = {float(v.reshape(-1)[0]) for v in got.values()}
            assert values in ({1.0}, {2.0}), values        # the old or the new, whole
            v = values.pop()
            seen.add(v)
            for k, t in got.items():
                assert bool((t == v).all()), k
            assert len(got) == 21
        for x in dirs:
            assert len(_packs(x)) == 1                      # the loser was removed
    assert 1.0 in seen                                      # at least one kill mid-save


# ----------------------------------------------------------------------------------------
# Version 1


def _write_v1(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A directory as aioswap format 1 wrote it: one t- file per tensor, no pack list."""
    import hashlib
    d.mkdir()
    entries = []
    for seq, (name, t) in enumerate(tensors.items()):
        h = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        fname = f"t-{h}-{os.urandom(8).hex()}.bin"
        raw = _bytes(t)
        (d / fname).write_bytes(raw)
        import xxhash
        entries.append({"name": name, "file": fname, "offset": 0, "nbytes": len(raw),
                        "dtype": str(t.dtype).rpartition(".")[2], "shape": list(t.shape),
                        "stride": list(t.stride()), "storage_offset": t.storage_offset(),
                        "checksum": xxhash.xxh3_64(raw).hexdigest(),
                        "checksum_algo": "xxh3_64", "seq": seq})
    doc = {"format": "aioswap-swap", "version": 1, "seq": len(entries), "entries": entries}
    (d / MANIFEST_NAME).write_text(json.dumps(doc))


def test_reads_version_1_directories(tmp_dir: Path) -> None:
    pytest.importorskip("xxhash")
    d = tmp_dir / "v1"
    gen = _gen()
    old = {"a": _rand((10, 33), torch.float32, gen), "sd/x": _rand((4097,), torch.uint8, gen),
           "sd/y": torch.tensor(7, dtype=torch.int64), "sd/z": torch.empty(0, 3)}
    _write_v1(d, old)
    files = set(_data_files(d))
    with TensorSwapper(d) as sw:
        assert sw.names() == list(old)
        assert _manifest(d)["version"] == 1            # opening does not rewrite it
        for k, v in old.items():
            assert _bytes(sw.swap_in(k, verify=True)) == _bytes(v)
        got = sw.swap_in_state_dict("sd/")
        assert list(got) == ["x", "y", "z"]
        sw.swap_out_state_dict("new/", {"b": torch.arange(5)})   # first change: version 2
        doc = _manifest(d)
        assert doc["version"] == 2 and len(doc["packs"]) == 1
        assert files <= set(_data_files(d))            # version-1 files kept as they are
    with TensorSwapper(d) as sw:
        assert _bytes(sw.swap_in("a")) == _bytes(old["a"])
        assert torch.equal(sw.swap_in("new/b"), torch.arange(5))
    bad = _manifest(d)
    bad["version"] = 1
    (d / MANIFEST_NAME).write_text(json.dumps(bad))
    with pytest.raises(SwapError, match="version-1 entry"):   # packs are not version 1
        TensorSwapper(d)


# ----------------------------------------------------------------------------------------
# Ranks


def test_for_rank_spreads_ranks_over_roots(tmp_dir: Path, monkeypatch) -> None:
    roots = [tmp_dir / "nvme0", tmp_dir / "nvme1"]
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert current_rank() == (0, 0)
    with TensorSwapper.for_rank(roots) as sw:
        assert sw.directory == str(roots[0] / "rank0")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert current_rank() == (5, 3)
    with TensorSwapper.for_rank(roots, checksum="crc32") as sw:
        assert sw.directory == str(roots[1] / "rank5")        # local rank 3 -> drive 1
        assert sw.checksum_algo == "crc32"
        sw.swap_out("x", torch.ones(3))
    dirs = []
    for r in range(4):
        sw = TensorSwapper.for_rank([str(p) for p in roots], rank=r, local_rank=r,
                                    name="swap-{rank:03d}")
        dirs.append(sw.directory)
        sw.destroy()
    assert dirs == [str(roots[r % 2] / f"swap-{r:03d}") for r in range(4)]
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK"):
        current_rank()
    with pytest.raises(ValueError, match="root"):
        TensorSwapper.for_rank([], rank=0, local_rank=0)


def test_async_state_dicts_on_one_worker(tmp_dir: Path) -> None:
    gen = _gen()
    sds = [{f"t{i}": _rand((3000 + i,), torch.float32, gen) for i in range(10)}
           for _ in range(3)]
    with TensorSwapper(tmp_dir / "s", max_inflight=1) as sw:
        outs = [sw.swap_out_state_dict(f"sd{j}/", sd, async_op=True)
                for j, sd in enumerate(sds)]
        assert [len(f.result(timeout=60)) for f in outs] == [10, 10, 10]
        ins = [sw.swap_in_state_dict(f"sd{j}/", async_op=True) for j in range(3)]
        for sd, f in zip(sds, ins):
            _check(_snapshot(sd), f.result(timeout=60))
        assert sw.wait() == 6
        assert len(_packs(tmp_dir / "s")) == 3


def test_interrupt_during_packed_load_drains_and_keeps_state(tmp_dir: Path,
                                                             monkeypatch) -> None:
    gen = _gen()
    sd = {f"t{i}": _rand((50000 + i,), torch.float32, gen) for i in range(12)}
    snap = _snapshot(sd)
    with TensorSwapper(tmp_dir / "s") as sw:
        sw.swap_out_state_dict("", sd, release=True)
        real = TensorSwapper._check_piece_sums
        seen = []

        def interrupted(self, p, verify):
            seen.append(p.name)
            if len(seen) == 3:
                raise KeyboardInterrupt      # as a Ctrl-C in the middle of the batch
            return real(self, p, verify)

        monkeypatch.setattr(TensorSwapper, "_check_piece_sums", interrupted)
        with pytest.raises(KeyboardInterrupt):
            sw.swap_in_state_dict("")
        monkeypatch.undo()
        # every read finished before the error came back; nothing is half restored
        assert all(v.untyped_storage().nbytes() == 0 for v in sd.values())
        assert all(sw.info(k).released for k in sd)
        got = sw.swap_in_state_dict("", state_dict=sd)    # and it works again
        _check(snap, got)
        assert not any(sw.info(k).released for k in sd)


def test_replaced_pack_is_deleted_in_the_background(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    gen = _gen()
    v1 = {f"t{i}": _rand((70000,), torch.uint8, gen) for i in range(4)}
    v2 = {k: _rand((70000,), torch.uint8, gen) for k in v1}
    with TensorSwapper(d) as sw:
        sw.swap_out_state_dict("", v1)
        (old,) = _packs(d)
        sw.swap_out_state_dict("", v2, overwrite=True)   # durable and published on return
        assert sw.wait() == 0                            # ... and the old pack is gone now
        (new,) = _packs(d)
        assert new != old
        _check(_snapshot(v2), sw.swap_in_state_dict(""))
    with TensorSwapper(d) as sw:
        assert _packs(d) == [new]


def test_current_rank_prefers_the_process_group(tmp_dir: Path, monkeypatch) -> None:
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("LOCAL_RANK", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir / 'pg'}", rank=0,
                            world_size=1)
    try:
        assert current_rank() == (0, 1)        # the group's rank, the node-local rank
        with TensorSwapper.for_rank([tmp_dir / "a", tmp_dir / "b"]) as sw:
            assert sw.directory == str(tmp_dir / "b" / "rank0")
    finally:
        dist.destroy_process_group()
