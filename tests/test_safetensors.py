"""aioswap.safetensors: round trips, interop with the safetensors package, hostile headers."""
from __future__ import annotations

import functools
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

import aioswap
import aioswap.safetensors as ast
from aioswap import _st_format, _st_write, pinned
from aioswap.safetensors import SafetensorsError

try:
    import safetensors.torch as st
except ImportError:
    st = None

needs_st = pytest.mark.skipif(st is None, reason="the safetensors package is not installed")


def _can_lock(nbytes: int = 256 << 20) -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= nbytes


needs_lock = pytest.mark.skipif(not _can_lock(), reason="RLIMIT_MEMLOCK too small to pin")
# Without enough RLIMIT_MEMLOCK loads fall back to unlocked memory with one warning; the
# results are the same, so that warning is not an error here.
pytestmark = pytest.mark.filterwarnings("ignore::aioswap.pinned.PinnedMemoryWarning")
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_safetensors.py"

# every torch dtype the format holds here (float8 / uint16.. / float4 where torch has them)
DTYPES = sorted(_st_format.FROM_TORCH, key=str)
NOT_IN_ST_LOAD = {"F8_E8M0", "F4"}


def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of random bytes (any bit pattern, NaNs included)."""
    t = torch.empty(shape, dtype=dtype)
    raw = t.reshape(-1).view(torch.uint8)
    if raw.numel():
        data = bytearray(os.urandom(raw.numel()))
        if dtype == torch.bool:
            data = bytearray(b & 1 for b in data)
        raw.copy_(torch.frombuffer(data, dtype=torch.uint8))
    return t


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert got[k].shape == v.shape, k
        assert raw_bytes(got[k]) == raw_bytes(v), k


@functools.lru_cache(maxsize=None)
def st_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this safetensors release saves and loads back with load_file."""
    ok = set()
    with tempfile.TemporaryDirectory() as d:
        for dt in DTYPES:
            p = os.path.join(d, "probe.safetensors")
            try:
                st.save_file({"x": torch.zeros(2, dtype=dt)}, p)
                if st.load_file(p)["x"].dtype == dt:
                    ok.add(dt)
            except Exception:       # an older release without this dtype
                pass
    return frozenset(ok)


def every_dtype(only: frozenset[torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    sd = {}
    for dt in DTYPES:
        if only is not None and dt not in only:
            continue
        name = str(dt).split(".")[-1]
        sd[f"{name}.m"] = rand((3, 6), dt)
        sd[f"{name}.scalar"] = rand((), dt) if _st_format.FROM_TORCH[dt].packed == 1 \
            else rand((1,), dt)
        sd[f"{name}.empty"] = rand((0, 4), dt)
        sd[f"{name}.odd"] = rand((7,), dt)
    return sd


def header_file(path: Path, header: Any, data: bytes = b"", *, raw: bytes | None = None,
                length: int | None = None) -> Path:
    text = raw if raw is not None else json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


def tensor_bytes(path: Path, name: str) -> bytes:
    """A tensor's bytes in the file, read with plain os.pread."""
    h = ast.read_header(path)
    info = h.tensors[name]
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, info.nbytes, h.data_offset + info.begin)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- round trips

def test_round_trip_every_dtype(tmp_dir: Path) -> None:
    sd = every_dtype()
    path = tmp_dir / "all.safetensors"
    ast.save_file(sd, path)
    got = ast.load_file(path)
    assert list(got) == list(ast.read_header(path).tensors)     # the header's order
    assert_same(got, sd)
    for name in sd:                                             # against plain os.pread
        assert raw_bytes(got[name]) == tensor_bytes(path, name)


def test_round_trip_in_memory() -> None:
    sd = every_dtype()
    data = ast.save({**sd}, {"a": "b"})
    assert isinstance(data, bytes)
    assert_same(ast.load(data), sd)
    assert ast.load(bytearray(data)).keys() == sd.keys()


def test_empty_dict_and_metadata(tmp_dir: Path) -> None:
    p = tmp_dir / "empty.safetensors"
    ast.save_file({}, p, metadata={"format": "pt", "ünï": "ç"})
    assert ast.load_file(p) == {}
    with ast.safe_open(p) as f:
        assert f.metadata() == {"format": "pt", "ünï": "ç"}
        assert f.keys() == []
    ast.save_file({}, p)
    assert ast.read_header(p).metadata is None
    assert ast.load_file(p) == {}


def test_only_empty_tensors(tmp_dir: Path) -> None:
    sd = {"a": torch.zeros(0), "b": torch.zeros(2, 0, 3, dtype=torch.int8)}
    p = tmp_dir / "e.safetensors"
    ast.save_file(sd, p)
    assert_same(ast.load_file(p), sd)


def test_many_groups_and_slots(tmp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads cut into many groups and writes into many slots give the same bytes."""
    monkeypatch.setattr(ast, "_FIRST_GROUP_BYTES", 4096)
    monkeypatch.setattr(ast, "_GROUP_BYTES", 3 * 4096 + 5)
    monkeypatch.setattr(_st_write, "_SLOT_BYTES", 8192)
    monkeypatch.setattr(_st_write, "_SLOTS", 2)
    sd = {f"t{i}": rand((i * 397 + 1,), [torch.float32, torch.int8, torch.float16][i % 3])
          for i in range(40)}
    p = tmp_dir / "many.safetensors"
    ast.save_file(sd, p)
    assert_same(ast.load_file(p), sd)
    assert_same(ast.load(p.read_bytes()), sd)


@needs_lock
def test_loaded_tensors_are_pinned_own_storages_writable(tmp_dir: Path) -> None:
    sd = {"w": rand((64, 64), torch.float32), "b": rand((64,), torch.float32),
          "i": rand((3,), torch.int64)}
    p = tmp_dir / "p.safetensors"
    ast.save_file(sd, p)
    got = ast.load_file(p)
    ptrs = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(ptrs) == len(got)                       # no two share a storage
    for t in got.values():
        assert pinned.is_pinned(t)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    got["w"][0, 0] = 1.5                               # writable, and only that tensor
    assert got["w"][0, 0].item() == 1.5
    assert_same({"b": got["b"]}, {"b": sd["b"]})


def test_not_pinned_past_the_budget(tmp_dir: Path) -> None:
    sd = {"w": rand((300, 301), torch.float32), "x": rand((5,), torch.int16)}
    p = tmp_dir / "u.safetensors"
    ast.save_file(sd, p)
    got = ast.load_file(p, max_pinned_bytes=0)
    assert_same(got, sd)
    assert not any(pinned.is_pinned(t) for t in got.values())


def test_direct_io_through_a_given_handle(tmp_dir: Path) -> None:
    # no lock needed: where mlock is refused the loader's own unlocked memory is read direct
    sd = {"w": rand((1024, 257), torch.float32), "b": rand((7,), torch.uint8)}
    p = tmp_dir / "d.safetensors"
    with aioswap.AioHandle() as h:
        ast.save_file(sd, p, handle=h)
        written = h.stats.direct_bytes
        assert written >= 1024 * 257 * 4 - 2 * 4096
        got = ast.load_file(p, handle=h)
        assert h.stats.direct_bytes - written >= 1024 * 257 * 4 - 2 * 4096
        assert h.stats.bounce_bytes == 0
        assert not h.closed
    assert_same(got, sd)


def test_misaligned_tensors_in_the_file(tmp_dir: Path) -> None:
    """Other writers may place an F32 at an odd offset: it is loaded into its own memory."""
    hdr = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
           "c": {"dtype": "F64", "shape": [1], "data_offsets": [9, 17]}}
    data = os.urandom(17)
    p = header_file(tmp_dir / "odd.safetensors", hdr, data, raw=b'{"a":{"dtype":"U8","shape"'
                    b':[1],"data_offsets":[0,1]},"b":{"dtype":"F32","shape":[2],"data_offsets'
                    b'":[1,9]},"c":{"dtype":"F64","shape":[1],"data_offsets":[9,17]}}')
    got = ast.load_file(p)
    assert raw_bytes(got["a"]) == data[:1]
    assert raw_bytes(got["b"]) == data[1:9]
    assert raw_bytes(got["c"]) == data[9:]
    for t in got.values():
        assert t.data_ptr() % t.element_size() == 0


def test_non_contiguous_and_shared_tensors_are_saved(tmp_dir: Path) -> None:
    base = rand((8, 6), torch.float32)
    sd = {"t": base.t(), "row": base[2], "base": base}
    p = tmp_dir / "nc.safetensors"
    ast.save_file(sd, p)
    got = ast.load_file(p)
    for k, v in sd.items():
        assert torch.equal(got[k].view(torch.int32), v.contiguous().view(torch.int32))


def test_file_mode_atomic_replace_and_no_leftovers(tmp_dir: Path) -> None:
    old = os.umask(0o022)
    try:
        p = tmp_dir / "m.safetensors"
        ast.save_file({"a": torch.ones(3)}, p)
        assert (p.stat().st_mode & 0o777) == 0o600
        ast.save_file({"b": torch.zeros(2)}, p, mode=0o644)
        assert (p.stat().st_mode & 0o777) == 0o644
        assert list(ast.load_file(p)) == ["b"]
        with pytest.raises(SafetensorsError, match="complex128"):
            ast.save_file({"c": torch.zeros(2, dtype=torch.complex128)}, p)
        assert list(ast.load_file(p)) == ["b"]             # left as it was
        assert sorted(x.name for x in tmp_dir.iterdir()) == ["m.safetensors"]
    finally:
        os.umask(old)


def test_save_refuses_bad_input(tmp_dir: Path) -> None:
    p = tmp_dir / "bad.safetensors"
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        ast.save_file({"a": [1, 2]}, p)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="names must be str"):
        ast.save_file({1: torch.ones(1)}, p)  # type: ignore[dict-item]
    with pytest.raises(SafetensorsError, match="reserved"):
        ast.save_file({"__metadata__": torch.ones(1)}, p)
    with pytest.raises(TypeError, match="metadata must be a dict of str to str"):
        ast.save_file({"a": torch.ones(1)}, p, metadata={"k": 1})  # type: ignore[dict-item]
    with pytest.raises(SafetensorsError, match="layout"):
        ast.save_file({"s": torch.eye(3).to_sparse()}, p)
    with pytest.raises(SafetensorsError, match="meta device"):
        ast.save_file({"m": torch.empty(3, device="meta")}, p)
    with pytest.raises(TypeError, match="dict of str"):
        ast.save_file([torch.ones(1)], p)  # type: ignore[arg-type]
    assert not p.exists() and list(tmp_dir.iterdir()) == []


def test_load_missing_file_and_directory(tmp_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ast.load_file(tmp_dir / "nope.safetensors")
    with pytest.raises(SafetensorsError, match="not a regular file"):
        ast.load_file(tmp_dir)


def test_cuda_without_a_device(tmp_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    p = tmp_dir / "c.safetensors"
    ast.save_file({"a": torch.ones(2)}, p)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        ast.load_file(p, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip(tmp_dir: Path) -> None:
    sd = {"w": rand((256, 33), torch.float16), "e": torch.zeros(0), "s": torch.tensor(2.0)}
    p = tmp_dir / "g.safetensors"
    ast.save_file({k: v.cuda() for k, v in sd.items()}, p)
    got = ast.load_file(p, device="cuda")
    assert all(t.is_cuda for t in got.values())
    assert_same(got, sd)
    with ast.safe_open(p, device=0) as f:
        assert f.get_tensor("w").is_cuda


def test_device_path_stages_through_a_window(tmp_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads to a device (here "meta", which needs no GPU) move each group as it lands."""
    monkeypatch.setattr(ast, "_FIRST_GROUP_BYTES", 4096)
    monkeypatch.setattr(ast, "_GROUP_BYTES", 4096)
    monkeypatch.setattr(ast, "_DEVICE_WINDOW_BYTES", 3 * 4096)
    sd = {f"t{i}": rand((1000 + i,), torch.float32) for i in range(12)}
    sd["e"] = torch.zeros(0, 2)
    p = tmp_dir / "w.safetensors"
    ast.save_file(sd, p)
    moved: list[str] = []
    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        moved.append(raw_bytes(self).hex())
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    got = ast.load_file(p, device="meta")
    assert list(got) == list(ast.read_header(p).tensors)
    assert all(t.is_meta for t in got.values())
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {
        k: (v.shape, v.dtype) for k, v in sd.items()}
    assert sorted(moved) == sorted(raw_bytes(v).hex() for k, v in sd.items() if k != "e")


def test_f6_without_torch_dtype(tmp_dir: Path) -> None:
    hdr = {"x": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}
    p = header_file(tmp_dir / "f6.safetensors", hdr, b"abc")
    assert ast.read_header(p).tensors["x"].nbytes == 3       # a valid header
    with pytest.raises(SafetensorsError, match="F6_E2M3.*no dtype"):
        ast.load_file(p)


# ----------------------------------------------------------------------------- lazy access

def test_safe_open(tmp_dir: Path) -> None:
    sd = {"z": rand((5, 3), torch.bfloat16), "a": rand((4,), torch.int32),
          "e": torch.zeros(0, dtype=torch.float64)}
    p = tmp_dir / "lazy.safetensors"
    ast.save_file(sd, p, metadata={"k": "v"})
    with ast.safe_open(p, framework="pt") as f:
        assert f.keys() == ["a", "e", "z"]
        assert "z" in f and "q" not in f
        assert f.metadata() == {"k": "v"}
        for k in f:
            assert_same({k: f.get_tensor(k)}, {k: sd[k]})
        with pytest.raises(KeyError, match="no tensor 'q'"):
            f.get_tensor("q")
    assert f.closed
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.get_tensor("a")
    with pytest.raises(ValueError, match="framework 'np'"):
        ast.safe_open(p, framework="np")
    with aioswap.AioHandle() as h:
        with ast.safe_open(p, handle=h) as f:
            f.get_tensor("z")
        assert not h.closed


# ----------------------------------------------------------------------------- interop

@needs_st
def test_files_from_safetensors_load_identically(tmp_dir: Path) -> None:
    sd = every_dtype(st_dtypes())
    p = tmp_dir / "st.safetensors"
    st.save_file(sd, p, metadata={"format": "pt"})
    assert_same(ast.load_file(p), st.load_file(p))
    with ast.safe_open(p) as f:
        assert f.metadata() == {"format": "pt"}
    assert_same(ast.load(st.save(sd)), sd)


@needs_st
def test_files_from_aioswap_load_identically_in_safetensors(tmp_dir: Path) -> None:
    sd = every_dtype(st_dtypes())
    p = tmp_dir / "aio.safetensors"
    md = {"format": "pt", "zz": "ü", "a": ""}
    ast.save_file(sd, p, metadata=md)
    assert_same(st.load_file(p), sd)
    from safetensors import safe_open
    with safe_open(str(p), framework="pt") as f:
        assert f.metadata() == md
        assert sorted(f.keys()) == sorted(sd)
    # safetensors.torch.load (bytes) knows fewer dtypes than its load_file
    known = {k: v for k, v in sd.items()
             if _st_format.FROM_TORCH[v.dtype].name not in NOT_IN_ST_LOAD}
    assert_same(st.load(ast.save(known)), known)


@needs_st
def test_same_bytes_as_safetensors(tmp_dir: Path) -> None:
    sd = every_dtype(st_dtypes())
    # (safetensors writes metadata keys in hash order: one key, for a comparable file)
    for md in (None, {"format": "pt"}):
        a, b = tmp_dir / "a.safetensors", tmp_dir / "b.safetensors"
        ast.save_file(sd, a, metadata=md)
        st.save_file(sd, b, metadata=md)
        assert a.read_bytes() == b.read_bytes()
        assert ast.save(sd, md) == st.save(sd, md)


@needs_st
def test_loaded_tensors_save_again_with_safetensors(tmp_dir: Path) -> None:
    """Views of one buffer, but each with its own storage: safetensors sees no sharing."""
    assert len(st_dtypes()) >= 10           # bool, (u)int8..64, float16/32/64, bfloat16...
    sd = {f"l{i}": rand((33, 17), torch.float32) for i in range(5)}
    p = tmp_dir / "x.safetensors"
    ast.save_file(sd, p)
    st.save_file(ast.load_file(p), tmp_dir / "y.safetensors")
    assert_same(st.load_file(tmp_dir / "y.safetensors"), sd)


_SHAPES = hs.lists(hs.integers(0, 5), min_size=0, max_size=3).map(tuple)
_DICTS = hs.dictionaries(hs.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
                         hs.tuples(_SHAPES, hs.sampled_from([d for d in DTYPES
                                                             if _st_format.FROM_TORCH[d].packed == 1
                                                             and st is not None
                                                             and d in st_dtypes()])),
                         max_size=6)


@needs_st
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_DICTS, md=hs.none() | hs.dictionaries(hs.text(max_size=4), hs.text(max_size=4),
                                                    max_size=1))
def test_property_same_file_as_safetensors(tmp_dir: Path, spec: dict[str, Any],
                                           md: dict[str, str] | None) -> None:
    sd = {k: rand(shape, dt) for k, (shape, dt) in spec.items()}
    p = tmp_dir / "h.safetensors"
    ast.save_file(sd, p, metadata=md)
    if sd or md != {}:
        assert p.read_bytes() == st.save(sd, md)
    else:   # safetensors 0.8 writes '{},"__metadata__":{}}' here, which it cannot read back
        assert st.load(p.read_bytes()) == {}
    assert_same(ast.load_file(p), sd)


# ----------------------------------------------------------------------------- hostile files

GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]}}


def bad(**changes: Any) -> dict[str, Any]:
    h = json.loads(json.dumps(GOOD))
    for k, v in changes.items():
        h["b"][k] = v
    return h


MALFORMED: list[tuple[str, bytes, str]] = [
    ("bad JSON", b'{"a": {"dtype": "F32",', "not valid JSON"),
    ("non-dict JSON", b"[1, 2, 3]", "must be a JSON object, got list"),
    ("a string", b'"hello"', "must be a JSON object, got str"),
    ("offsets past EOF", json.dumps(bad(data_offsets=[8, 40], shape=[32])).encode(),
     r"run past the end of the data region \(11 bytes\)"),
    ("overlapping", json.dumps(bad(data_offsets=[4, 7])).encode(), "overlaps tensor 'a'"),
    ("wrong size", json.dumps(bad(shape=[4])).encode(), r"needs 4 bytes.*hold 3"),
    ("unknown dtype", json.dumps(bad(dtype="F128")).encode(), "unknown dtype 'F128'"),
    ("dtype not a string", json.dumps(bad(dtype=5)).encode(), "unknown dtype 5"),
    ("gap", json.dumps({"a": GOOD["a"], "b": {"dtype": "U8", "shape": [2],
                                              "data_offsets": [9, 11]}}).encode(),
     r"bytes \[8, 9\) of the data region belong to no tensor"),
    ("not covered", json.dumps({"a": GOOD["a"]}).encode(), "trailing bytes"),
    ("duplicate names", b'{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},'
                        b'"a":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}',
     "duplicate key 'a'"),
    ("negative shape", json.dumps(bad(shape=[-3])).encode(), "shape must be a list of int"),
    ("float shape", json.dumps(bad(shape=[3.0])).encode(), "shape must be a list of int"),
    ("bool shape", json.dumps(bad(shape=[True, 3])).encode(), "shape must be a list of int"),
    ("offsets reversed", json.dumps(bad(data_offsets=[11, 8])).encode(), "end before"),
    ("one offset", json.dumps(bad(data_offsets=[8])).encode(), r"must be \[begin, end\]"),
    ("missing keys", json.dumps({"a": GOOD["a"], "b": {"dtype": "U8"}}).encode(),
     "missing shape, data_offsets"),
    ("entry not an object", json.dumps({"a": GOOD["a"], "b": 3}).encode(),
     "expected an object, got int"),
    ("metadata not strings", json.dumps({"__metadata__": {"k": 1}, **GOOD}).encode(),
     '"__metadata__" must be an object of strings'),
    ("metadata a list", json.dumps({"__metadata__": ["k"], **GOOD}).encode(),
     '"__metadata__" must be an object of strings'),
    ("NaN", json.dumps(bad(shape=[float("nan")])).encode(), "not valid JSON"),
    ("not UTF-8", b'{"\xff":1}', "not valid UTF-8"),
    ("sub-byte sizes", json.dumps({"a": GOOD["a"], "b": {"dtype": "F4", "shape": [5],
                                                         "data_offsets": [8, 11]}}).encode(),
     "do not fill whole bytes"),
]


@pytest.mark.parametrize("text,match", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_headers(tmp_dir: Path, text: bytes, match: str,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    p = header_file(tmp_dir / "bad.safetensors", None, os.urandom(11), raw=text)
    allocations: list[int] = []
    monkeypatch.setattr(pinned, "allocate", lambda n, **kw: allocations.append(n))
    for call in (ast.load_file, ast.read_header, ast.safe_open):
        with pytest.raises(SafetensorsError, match=match) as info:
            call(p)  # type: ignore[operator]
        assert str(p) in str(info.value) and info.value.path == str(p)
    with pytest.raises(SafetensorsError, match=match):
        ast.load(p.read_bytes())
    assert allocations == []                    # refused before any allocation
    if st is not None:                          # safetensors refuses them too
        if text.startswith(b'{"a":{"dtype":"U8","shape":[8]'):
            return                              # (it keeps the last of duplicate keys)
        with pytest.raises(Exception):
            st.load_file(p)


@pytest.mark.parametrize("length,match", [
    (2 ** 60, r"header length 1152921504606846976 exceeds the limit of 100000000 bytes"),
    (2 ** 64 - 1, "exceeds the limit of 100000000 bytes"),
    (ast.MAX_HEADER_BYTES, "runs past the end of the"),
    (212, "runs past the end of the 219-byte file"),
])
def test_header_lengths(tmp_dir: Path, length: int, match: str,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    p = header_file(tmp_dir / "long.safetensors", None, raw=json.dumps(GOOD).encode()[:100]
                    + b" " * 111, length=length)
    allocations: list[int] = []
    monkeypatch.setattr(pinned, "allocate", lambda n, **kw: allocations.append(n))
    with pytest.raises(SafetensorsError, match=match) as info:
        ast.load_file(p)
    assert str(p) in str(info.value)
    with pytest.raises(SafetensorsError, match=match.replace("file", "buffer")):
        ast.load(p.read_bytes())
    assert allocations == []


def test_too_short_and_zero_length(tmp_dir: Path) -> None:
    p = tmp_dir / "short.safetensors"
    p.write_bytes(b"\x01\x02\x03")
    with pytest.raises(SafetensorsError, match="3 bytes is too short"):
        ast.load_file(p)
    p.write_bytes(b"")
    with pytest.raises(SafetensorsError, match="0 bytes is too short"):
        ast.load_file(p)
    p.write_bytes(struct.pack("<Q", 0))
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        ast.load_file(p)


def test_unknown_fields_are_accepted_like_safetensors(tmp_dir: Path) -> None:
    hdr = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2], "extra": 1},
           "__metadata__": None}
    p = header_file(tmp_dir / "x.safetensors", hdr, b"ab")
    assert raw_bytes(ast.load_file(p)["a"]) == b"ab"


# ----------------------------------------------------------------------------- benchmark

@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
def test_benchmark_smoke(tmp_dir: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--dir", str(tmp_dir), "--repeat", "2"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "GB/s = 10^9 B/s" in out and "aioswap/other, bigger is better" in out
    rows = [line for line in out.splitlines()
            if line.startswith(("aioswap.safetensors", "safetensors.torch", "direct:"))]
    assert len(rows) == (3 if st is not None else 2), out
    for line in rows:     # save, warm load, cold load: each a median and a spread
        figures = [float(x) for x in line.split()[-6:] if x[0].isdigit() and "-" not in x]
        assert len(figures) == 3 and all(f > 0 for f in figures), line
    assert "ratio aioswap/direct load" in out and "ratio aioswap/direct cold" in out
    assert list(tmp_dir.iterdir()) == []


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
def test_benchmark_json(tmp_dir: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--dir", str(tmp_dir), "--repeat", "1",
                           "--layers", "1", "--hidden", "32", "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert res["tensors"] == 48 and res["repeat"] == 1
    assert res["bytes"] == 3 * 4 * (12 * 32 * 32 + 13 * 32)
    for row in res["methods"].values():
        assert row["load_GBps"] > 0 and len(row["save_GBps_all"]) == 1
        assert row["cold_GBps"] > 0 and len(row["cold_GBps_all"]) == 1
    assert res["ratios"]["aioswap/direct load"] == pytest.approx(
        res["methods"]["aioswap"]["load_GBps"] / res["methods"]["direct"]["load_GBps"])
    assert list(tmp_dir.iterdir()) == []


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
def test_benchmark_without_cold_rounds(tmp_dir: Path) -> None:
    """--cold 0: no cold column or ratio, and the JSON stays JSON (no NaN)."""
    args = [sys.executable, str(BENCH), "--dir", str(tmp_dir), "--repeat", "1", "--layers",
            "1", "--hidden", "32", "--cold", "0"]
    done = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr

    def no_constant(name: str) -> None:
        raise AssertionError(f"{name} in the JSON")
    res = json.loads(done.stdout, parse_constant=no_constant)
    for row in res["methods"].values():
        assert "cold_GBps" not in row and row["load_GBps"] > 0
    assert not any(k.endswith(" cold") for k in res["ratios"])
    assert "aioswap/direct save" in res["ratios"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "cold" not in done.stdout.split("\n", 2)[2] and "nan" not in done.stdout
    assert list(tmp_dir.iterdir()) == []


def test_save_sharded_over_drives_loads_everywhere(tmp_dir: Path) -> None:
    """save_sharded: Hugging Face shards and index, shards on every drive and linked from the
    directory; stock safetensors, aioswap and transformers' from_pretrained read it."""
    import json

    import safetensors.torch as st
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out, roots = tmp_dir / "model", [tmp_dir / "nvme1" / "m", tmp_dir / "nvme2" / "m"]
    index = ast.save_sharded(sd, out, roots=roots)
    cfg.save_pretrained(out)
    doc = json.loads(Path(index).read_text())
    shards = sorted(set(doc["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(doc["weight_map"]) == set(sd)
    assert doc["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    assert (out / shards[0]).is_file() and not (out / shards[0]).is_symlink()
    for shard, root in zip(shards[1:], roots):
        link = out / shard
        assert link.is_symlink() and Path(os.readlink(link)) == (root / shard).absolute()
        assert ((root / shard).stat().st_mode & 0o777) == 0o600
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = st.load_file(str(out / shard))
        assert ast.load_file(out / shard).keys() == part.keys()
        got.update(part)
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    back = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16)
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k]), k
    with pytest.raises(ValueError, match="distinct"):
        ast.save_sharded(sd, out, roots=[out])
    # one shard per tensor group under a cap, all in the directory without roots
    one = tmp_dir / "one"
    ast.save_sharded(sd, one, max_shard_bytes=64 << 10)
    n = len(list(one.glob("model-*.safetensors")))
    assert n > 3 and not any(p.is_symlink() for p in one.iterdir())
    empty = Path(ast.save_sharded({}, tmp_dir / "empty", roots=[tmp_dir / "e1"]))
    assert json.loads(empty.read_text())["weight_map"] == {}
    assert ast.load_file(tmp_dir / "empty" / "model-00001-of-00001.safetensors") == {}
