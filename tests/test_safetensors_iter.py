"""aioswap.safetensors: tensors handed over as they land (iter_file, SafeOpen.iter_tensors)
and sharded checkpoints in one call (load_checkpoint, iter_checkpoint)."""
from __future__ import annotations

import concurrent.futures
import gc
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import aioswap
import aioswap.safetensors as ast
from aioswap.safetensors import SafetensorsError

from test_safetensors import assert_same, needs_st, rand, raw_bytes, st

pytestmark = pytest.mark.filterwarnings("ignore::aioswap.pinned.PinnedMemoryWarning")

INDEX = "model.safetensors.index.json"


def mixed() -> dict[str, torch.Tensor]:
    """Odd sizes of bf16, fp16, fp32, int8 and bool, with empty tensors among them."""
    return {
        "embed.weight": rand((37, 13), torch.bfloat16),
        "a.empty": rand((0, 5), torch.bfloat16),
        "h.0.attn": rand((129,), torch.float16),
        "h.0.mlp": rand((3, 1001), torch.float32),
        "h.0.scale": rand((), torch.float32),
        "h.1.empty": rand((4, 0), torch.float32),
        "h.1.q": rand((4097,), torch.int8),
        "h.1.mask": rand((11, 3), torch.bool),
        "zz.empty": rand((0,), torch.int8),
        "lm_head": rand((5, 777), torch.float32),
    }


def file_order(path: Path) -> list[str]:
    """Names by data offset, an empty tensor before the one that begins where it is (ties
    in header order)."""
    infos = ast.read_header(path).tensors.values()
    return [i.name for i in sorted(infos, key=lambda i: (i.begin, i.end))]


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """One group per 4 KiB or so: many reads, most of them ahead of the caller."""
    monkeypatch.setattr(ast, "_FIRST_GROUP_BYTES", 4096)
    monkeypatch.setattr(ast, "_GROUP_BYTES", 4096)


# ----------------------------------------------------------------------------- a spying handle

@dataclass
class Read:
    path: str
    offset: int
    nbytes: int
    future: Any


@dataclass
class Spy:
    """Records the asynchronous reads of the files a handle adopts; with ``delay``, their
    futures finish that many seconds after the reads (all but the first ``prompt``)."""

    delay: float = 0.0
    prompt: int = 0
    reads: list[Read] = field(default_factory=list)

    def watch(self, h: aioswap.AioHandle, monkeypatch: pytest.MonkeyPatch) -> None:
        # every read through the handle (none copied from the page cache), to be seen
        monkeypatch.setenv("AIOSWAP_READ", "direct")
        adopt = h.adopt

        def spy_adopt(fd: int, **kwargs: Any) -> SpyFile:
            path = os.readlink(f"/proc/self/fd/{fd}")       # adopt closes fd
            return SpyFile(adopt(fd, **kwargs), path, self)
        monkeypatch.setattr(h, "adopt", spy_adopt)

    def all_done(self) -> bool:
        return all(r.future.done() for r in self.reads)


class SpyFile:
    def __init__(self, file: Any, path: str, spy: Spy) -> None:
        self.file, self.path, self.spy = file, path, spy

    def pread(self, buffer: Any, offset: int = 0, **kwargs: Any) -> Any:
        fut = self.file.pread(buffer, offset, **kwargs)
        if not kwargs.get("async_op"):
            return fut
        if self.spy.delay and len(self.spy.reads) >= self.spy.prompt:
            late: concurrent.futures.Future[Any] = concurrent.futures.Future()

            def later(f: Any) -> None:
                threading.Timer(self.spy.delay, lambda: late.set_result(f.result())).start()
            fut.add_done_callback(later)
            fut = late
        self.spy.reads.append(Read(self.path, offset, buffer.numel(), fut))
        return fut

    def close(self) -> None:
        self.file.close()

    @property
    def closed(self) -> bool:
        return bool(self.file.closed)

    def __getattr__(self, name: str) -> Any:       # direct, fileno, name: the file's
        return getattr(self.file, name)


@pytest.fixture
def handle() -> Iterator[aioswap.AioHandle]:
    with aioswap.AioHandle() as h:
        yield h


# ----------------------------------------------------------------------------- iter_file

@needs_st
@pytest.mark.parametrize("writer", ["safetensors", "aioswap"])
@pytest.mark.parametrize("groups", ["default", "small"])
def test_iter_file_order_and_values(tmp_dir: Path, writer: str, groups: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if groups == "small":
        monkeypatch.setattr(ast, "_FIRST_GROUP_BYTES", 4096)
        monkeypatch.setattr(ast, "_GROUP_BYTES", 4096)
    sd = mixed()
    p = tmp_dir / "m.safetensors"
    (st.save_file if writer == "safetensors" else ast.save_file)(sd, str(p))
    want = st.load_file(str(p))
    got = list(ast.iter_file(p))
    assert [k for k, _ in got] == file_order(p)
    assert len(got) == len(sd)
    assert_same(dict(got), want)
    assert_same(dict(ast.iter_file(p, max_inflight_bytes=0)), want)
    # load_file: the same tensors, in header order
    loaded = ast.load_file(p)
    assert list(loaded) == list(ast.read_header(p).tensors)
    assert_same(loaded, want)


def test_iter_file_empty_tensors_keep_their_place(tmp_dir: Path) -> None:
    sd = {"a": rand((3,), torch.float32), "b": torch.zeros(0), "c": rand((2,), torch.float32),
          "d": torch.zeros(0, 3)}
    p = tmp_dir / "e.safetensors"
    ast.save_file(sd, p)
    assert [k for k, _ in ast.iter_file(p)] == ["a", "b", "c", "d"]
    only = tmp_dir / "only.safetensors"
    ast.save_file({"x": torch.zeros(0), "y": torch.zeros(2, 0)}, only)
    assert [k for k, _ in ast.iter_file(only)] == ["x", "y"]
    none = tmp_dir / "none.safetensors"
    ast.save_file({}, none)
    assert list(ast.iter_file(none)) == []


def aligned_file(path: Path, sizes: list[int]) -> dict[str, torch.Tensor]:
    """A file of F32 tensors of ``sizes`` pages each, the data region at 4096: every tensor
    is one aligned group of its own under ``small_groups``."""
    sd = {f"t{i:02d}": rand((n * 1024,), torch.float32) for i, n in enumerate(sizes)}
    hdr, pos = {}, 0
    for k, v in sd.items():
        hdr[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [pos, pos + v.nbytes]}
        pos += v.nbytes
    text = json.dumps(hdr).encode()
    text += b" " * (4096 - 8 - len(text))
    path.write_bytes(len(text).to_bytes(8, "little") + text
                     + b"".join(raw_bytes(v) for v in sd.values()))
    assert ast.read_header(path).data_offset == 4096
    return sd


@pytest.mark.parametrize("window_pages", [0, 3, 8, None])
def test_max_inflight_bytes_bounds_the_reads_ahead(tmp_dir: Path, small_groups: None,
                                                  handle: aioswap.AioHandle,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  window_pages: int | None) -> None:
    """Bytes submitted and not yet handed over stay within the window (one group at least),
    and reads do run ahead of the caller when the window lets them."""
    sizes = [1, 2, 1, 3, 1, 1, 2, 4, 1, 1]
    p = tmp_dir / "w.safetensors"
    sd = aligned_file(p, sizes)
    # no read lands before the next submission: the reads ahead are the window's
    spy = Spy(delay=0.2 if window_pages in (None, 8) else 0.0)
    spy.watch(handle, monkeypatch)
    window = None if window_pages is None else window_pages * 4096
    ahead = []
    for k, (name, t) in enumerate(ast.iter_file(p, handle=handle, max_inflight_bytes=window)):
        assert name == f"t{k:02d}"
        assert raw_bytes(t) == raw_bytes(sd[name])
        # groups k.. are submitted and not handed over (this one is being handed over)
        assert [r.offset for r in spy.reads[:k + 1]] == [4096 * (1 + sum(sizes[:j]))
                                                         for j in range(k + 1)]
        inflight = sum(r.nbytes for r in spy.reads[k:])
        if window is not None:
            assert inflight <= max(window, sizes[k] * 4096)
        ahead.append(len(spy.reads) - k - 1)
    assert len(spy.reads) == len(sizes)
    if window_pages == 0:
        assert ahead == [0] * len(sizes)
    elif window_pages is None:
        assert ahead[0] == len(sizes) - 1   # every read submitted before the first wait
    else:                                   # 3 pages: one group ahead; 8: up to four
        assert max(ahead) == {3: 1, 8: 4}[window_pages]


@pytest.mark.parametrize("how", ["close", "break", "exception", "collected", "never_started"])
def test_leaving_early_waits_for_every_read_and_closes_the_file(
        tmp_dir: Path, small_groups: None, handle: aioswap.AioHandle,
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    sd = {f"t{i}": rand((1500 + i,), torch.float32) for i in range(12)}
    p = tmp_dir / "b.safetensors"
    ast.save_file(sd, p)
    spy = Spy(delay=0.3, prompt=1)          # every read but the first ends late
    spy.watch(handle, monkeypatch)
    before = fd_count()
    start = time.monotonic()
    if how == "close":
        it = ast.iter_file(p, handle=handle)
        first = next(it)
        it.close()
    elif how == "break":
        for first in ast.iter_file(p, handle=handle):
            break
    elif how == "exception":
        with pytest.raises(KeyError):
            for first in ast.iter_file(p, handle=handle):
                raise KeyError(first[0])
    elif how == "collected":
        it = ast.iter_file(p, handle=handle)
        first = next(it)
        cycle: list[Any] = [it]
        cycle.append(cycle)                 # only the cycle collector can free it
        del it, cycle
        gc.collect()
    else:
        it = ast.iter_file(p, handle=handle)
        assert fd_count() == before + 1    # opened and checked by the call
        del it
    assert fd_count() == before
    assert spy.all_done()
    if how != "never_started":
        assert len(spy.reads) > 1 and time.monotonic() - start >= 0.25   # it did wait
        assert raw_bytes(first[1]) == raw_bytes(sd[first[0]])
    else:
        assert spy.reads == []
    handle.wait()                           # nothing in flight, nothing failed


def test_iter_file_checks_before_reading(tmp_dir: Path, handle: aioswap.AioHandle,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy()
    spy.watch(handle, monkeypatch)
    p = tmp_dir / "bad.safetensors"
    p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"x\": 1}        ")
    before = fd_count()
    with pytest.raises(SafetensorsError, match="tensor 'x'"):
        ast.iter_file(p, handle=handle)     # at the call, not at the first next()
    with pytest.raises(FileNotFoundError):
        ast.iter_file(tmp_dir / "missing.safetensors", handle=handle)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        ast.iter_file(p, max_inflight_bytes=-1)
    assert fd_count() == before and spy.reads == []


def test_safe_open_iter_tensors(tmp_dir: Path, small_groups: None) -> None:
    sd = mixed()
    p = tmp_dir / "s.safetensors"
    ast.save_file(sd, p)
    with ast.safe_open(p) as f:
        got = dict(f.iter_tensors())
        assert list(got) == file_order(p)
        assert_same(got, sd)
        for name, _ in f.iter_tensors(max_inflight_bytes=0):
            break
        assert not f.closed                 # the file is the SafeOpen's
        assert_same({name: f.get_tensor(name)}, {name: sd[name]})
        with pytest.raises(ValueError, match="max_inflight_bytes"):
            f.iter_tensors(max_inflight_bytes=-5)
    with pytest.raises(ValueError, match="closed"):
        f.iter_tensors()


def test_device_iteration_moves_each_tensor(tmp_dir: Path, small_groups: None) -> None:
    """To a device ("meta" needs no GPU) through the default staging window."""
    sd = mixed()
    p = tmp_dir / "d.safetensors"
    ast.save_file(sd, p)
    got = dict(ast.iter_file(p, device="meta"))
    assert all(t.is_meta for t in got.values())
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {
        k: (v.shape, v.dtype) for k, v in sd.items()}


# ----------------------------------------------------------------------------- checkpoints

def st_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """Four shards written by safetensors and an index written by hand (its weight_map in an
    order of its own)."""
    d.mkdir(parents=True, exist_ok=True)
    parts = [{"embed": rand((33, 7), torch.bfloat16), "e0": torch.zeros(0, 2)},
             {"h.0.w": rand((5, 301), torch.float32), "h.0.b": rand((5,), torch.float16),
              "h.0.q": rand((999,), torch.int8)},
             {"h.1.mask": rand((17,), torch.bool), "h.1.w": rand((300,), torch.bfloat16)},
             {"head": rand((3, 3), torch.float32)}]
    wm = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-00004.safetensors"
        st.save_file(part, str(d / name), metadata={"format": "pt"})
        wm.update({k: name for k in part})
    wm = dict(sorted(wm.items(), key=lambda kv: kv[0][::-1]))
    total = sum(t.nbytes for p in parts for t in p.values())
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm},
                                      indent=2))
    return {k: v for p in parts for k, v in p.items()}


@needs_st
def test_load_checkpoint_of_safetensors_shards(tmp_dir: Path, handle: aioswap.AioHandle,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_dir / "ckpt"
    sd = st_checkpoint(d)
    want: dict[str, torch.Tensor] = {}
    for shard in sorted(d.glob("model-*.safetensors")):
        want.update(st.load_file(str(shard)))
    wm = json.loads((d / INDEX).read_text())["weight_map"]
    for where in (d, d / INDEX, str(d)):
        got = ast.load_checkpoint(where)
        assert list(got) == list(wm)        # the weight_map's order
        assert_same(got, want)
    spy = Spy()
    spy.watch(handle, monkeypatch)
    before = fd_count()
    names = [k for k, _ in ast.iter_checkpoint(d, handle=handle)]
    assert sorted(names) == sorted(sd) and len(names) == len(set(names))
    assert names == [k for i in range(4)
                     for k in file_order(d / f"model-{i + 1:05d}-of-00004.safetensors")]
    assert len({r.path for r in spy.reads}) == 4       # one handle read every shard
    assert fd_count() == before


@needs_st
def test_single_file_checkpoints(tmp_dir: Path) -> None:
    sd = mixed()
    d = tmp_dir / "one"
    d.mkdir()
    st.save_file(sd, str(d / "model.safetensors"))
    for where in (d, d / "model.safetensors"):
        got = ast.load_checkpoint(where)
        assert list(got) == list(ast.read_header(d / "model.safetensors").tensors)
        assert_same(got, sd)
    assert sorted(k for k, _ in ast.iter_checkpoint(d)) == sorted(sd)
    with pytest.raises(FileNotFoundError, match="neither"):
        ast.load_checkpoint(tmp_dir)


def test_load_checkpoint_of_save_sharded(tmp_dir: Path, small_groups: None) -> None:
    sd = {f"layers.{i}.w": rand((64 + i, 17), [torch.float32, torch.bfloat16][i % 2])
          for i in range(8)}
    sd["norm"] = torch.zeros(0)
    roots = [tmp_dir / "nvme1", tmp_dir / "nvme2"]
    index = ast.save_sharded(sd, tmp_dir / "m", roots=roots, max_shard_bytes=6000)
    assert any((tmp_dir / "m" / n).is_symlink() for n in os.listdir(tmp_dir / "m"))
    wm = json.loads(Path(index).read_text())["weight_map"]
    assert len(set(wm.values())) > 3
    for where in (tmp_dir / "m", index):
        got = ast.load_checkpoint(where, max_pinned_bytes=8192)
        assert list(got) == list(wm)
        assert_same(got, sd)
    seen = [k for k, _ in ast.iter_checkpoint(index, max_inflight_bytes=0)]
    assert sorted(seen) == sorted(sd)


@needs_st
def test_checkpoint_shards_are_in_flight_together(tmp_dir: Path, small_groups: None,
                                                  handle: aioswap.AioHandle,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No shard waits for another: by the first tensor every shard's reads were submitted."""
    d = tmp_dir / "c"
    sd = st_checkpoint(d)
    spy = Spy(delay=0.3)
    spy.watch(handle, monkeypatch)
    it = ast.iter_checkpoint(d, handle=handle)
    name, t = next(it)
    assert len({r.path for r in spy.reads}) == 4
    rest = dict(it)
    rest[name] = t
    assert_same(rest, sd)


def rewrite_index(d: Path, change: Any) -> None:
    doc = json.loads((d / INDEX).read_text())
    change(doc["weight_map"])
    (d / INDEX).write_text(json.dumps(doc))


def two_copies(d: Path) -> None:
    """Tensor "head" in shards 3 and 4."""
    name = d / "model-00003-of-00004.safetensors"
    part = st.load_file(str(name))
    part["head"] = torch.ones(2)
    st.save_file(part, str(name))


BAD_CHECKPOINTS: list[tuple[str, Any, str]] = [
    ("not_json", lambda d: (d / INDEX).write_text("{not json"),
     r"model.safetensors.index.json'?: the index is not valid JSON"),
    ("duplicate_key", lambda d: (d / INDEX).write_text(
        '{"weight_map": {"head": "model-00004-of-00004.safetensors", '
        '"head": "model-00004-of-00004.safetensors"}}'), "duplicate key 'head'"),
    ("no_weight_map", lambda d: (d / INDEX).write_text('{"metadata": {}}'),
     r'index.json.*no "weight_map"'),
    ("not_an_object", lambda d: (d / INDEX).write_text("[1, 2]"), 'no "weight_map"'),
    ("weight_map_list", lambda d: (d / INDEX).write_text('{"weight_map": ["a"]}'),
     '"weight_map" must be an object of tensor name to shard file name'),
    ("weight_map_int", lambda d: rewrite_index(d, lambda wm: wm.update(head=4)),
     '"weight_map" must be an object of tensor name to shard file name'),
    ("missing_shard", lambda d: (d / "model-00003-of-00004.safetensors").unlink(),
     r"index.json'?: shard 'model-00003-of-00004.safetensors' is missing"),
    ("dotdot", lambda d: rewrite_index(d, lambda wm: wm.update(head="../x.safetensors")),
     r"shard file name '../x.safetensors' is refused"),
    ("separator", lambda d: rewrite_index(d, lambda wm: wm.update(head="sub/x.safetensors")),
     r"shard file name 'sub/x.safetensors' is refused"),
    ("absolute", lambda d: rewrite_index(d, lambda wm: wm.update(head="/etc/x.safetensors")),
     r"shard file name '/etc/x.safetensors' is refused"),
    ("wrong_shard", lambda d: rewrite_index(
        d, lambda wm: wm.update({"h.1.w": "model-00001-of-00004.safetensors"})),
     r"puts tensor 'h.1.w' in 'model-00001-of-00004.safetensors', but it is in "
     r"'model-00003-of-00004.safetensors'"),
    ("not_in_index", lambda d: rewrite_index(d, lambda wm: wm.pop("h.0.b")),
     r"tensor 'h.0.b' of shard 'model-00002-of-00004.safetensors' is not in the weight_map"),
    ("in_no_shard", lambda d: rewrite_index(
        d, lambda wm: wm.update(ghost="model-00002-of-00004.safetensors")),
     r"puts tensor 'ghost' in 'model-00002-of-00004.safetensors', but no shard holds it"),
    ("in_two_shards", two_copies,
     r"tensor 'head' is in more than one shard: model-00003-of-00004.safetensors, "
     r"model-00004-of-00004.safetensors"),
    ("bad_shard_header", lambda d: (d / "model-00004-of-00004.safetensors").write_bytes(
        b"\x0b\x00\x00\x00\x00\x00\x00\x00{\"head\": 1}"),
     r"model-00004-of-00004.safetensors': tensor 'head': expected an object"),
]


@needs_st
@pytest.mark.parametrize("mutate,match", [b[1:] for b in BAD_CHECKPOINTS],
                         ids=[b[0] for b in BAD_CHECKPOINTS])
def test_bad_checkpoints(tmp_dir: Path, handle: aioswap.AioHandle,
                         monkeypatch: pytest.MonkeyPatch, mutate: Any, match: str) -> None:
    """Each is refused naming the file and what is wrong, before any data is read, with no
    descriptor left open."""
    d = tmp_dir / "bad"
    st_checkpoint(d)
    mutate(d)
    spy = Spy()
    spy.watch(handle, monkeypatch)
    before = fd_count()
    for call in (ast.load_checkpoint, ast.iter_checkpoint):
        with pytest.raises(SafetensorsError, match=match) as info:
            call(d, handle=handle)
        assert info.value.path is not None
    assert spy.reads == [] and fd_count() == before
