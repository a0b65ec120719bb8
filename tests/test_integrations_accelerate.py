"""aioswap.integrations.accelerate: accelerate's disk offload read through aioswap gives the
stock results bit for bit, refuses offload files that are not what the index says, and
uninstall() gives the stock loader back."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aioswap
import aioswap.integrations.accelerate as ia

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

# without CAP_IPC_LOCK and with a small RLIMIT_MEMLOCK the batches go to unlocked memory
# with one warning (as in test_safetensors)
pytestmark = pytest.mark.filterwarnings("ignore::aioswap.pinned.PinnedMemoryWarning")

IDS = torch.tensor([[1, 7, 42, 3, 99]])
NEW_TOKENS = 6


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model_dir(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A tiny random Llama saved in several shards, and the stock in-memory results."""
    dtype = request.param
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=dtype)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size=f"{50 * dtype.itemsize}KB")
    assert len(list(path.glob("*.safetensors"))) >= 3
    with torch.no_grad():
        ref = {"logits": model(IDS).logits,
               "generate": model.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False)}
    yield path, ref


@pytest.fixture(autouse=True, params=["cache", "direct"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test runs both ways a loader reads, chosen as by default: by what
    memory_for_cache() says there is (plenty: through the page cache; none: direct)."""
    room = 1 << 60 if request.param == "cache" else 0
    monkeypatch.setattr(ia, "memory_for_cache", lambda: room)
    ia.uninstall()
    yield request.param
    ia.uninstall()
    gc.collect()


def _run(model: Any) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"logits": model(IDS).logits,
                "generate": model.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False)}


def _weights_maps(model: Any) -> list[Any]:
    maps = []
    for m in model.modules():
        hook = getattr(m, "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]):
            wm = getattr(h, "weights_map", None)
            wm = getattr(wm, "dataset", wm)
            if wm is not None:
                maps.append(wm)
    return maps


def _assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got["logits"].dtype == ref["logits"].dtype
    assert torch.equal(got["logits"], ref["logits"])
    assert torch.equal(got["generate"], ref["generate"])


def _aioswap_maps(model: Any) -> list[ia.AioswapWeightsLoader]:
    maps = list({id(m): m for m in _weights_maps(model)}.values())     # Mappings: no hash
    assert maps and all(isinstance(m, ia.AioswapWeightsLoader) for m in maps), maps
    return maps


def test_disk_device_map(model_dir: tuple[Path, dict[str, Any]], tmp_path: Path,
                         way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path, ref = model_dir
    ia.install()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map={"": "disk"}, offload_folder=tmp_path / "off")
    (loader,) = _aioswap_maps(model)
    _drop(sorted(path.glob("*.safetensors")))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref["logits"])
    s = loader.stats
    first = s.advised_bytes
    if way == "cache":          # the first forward asks for its groups ahead of use
        assert s.advised_bytes > 0 and s.bytes_read > 0
    _assert_same(_run(model), ref)
    assert loader.through_page_cache is (way == "cache")
    # every shard opened once; most tensors come from a batch read (or a group mapped)
    # for several of them, and a group's read-ahead was asked for before it was used
    assert s.files_opened == len(list(path.glob("*.safetensors")))
    if way == "direct":
        assert s.hits > 10 * s.misses and s.batches < s.hits
    else:
        assert s.hits > 3 * s.misses
    advised, read = s.advised_bytes, s.bytes_read
    # again after close(): files reopen; the page cache holds them now, so nothing more is
    # asked into it
    loader.close()
    _assert_same(_run(model), ref)
    if way == "cache":
        assert s.advised_bytes == advised and s.bytes_read > read
        # the cache dropped between forwards: what the last forward found there is asked
        # for again (the asks recorded, not run: a read-ahead thread's fault would pull the
        # rest of these tiny files into the cache before the groups after it are looked at)
        asked: list[int] = []
        monkeypatch.setattr(ia._advisor, "put",
                            lambda fd, offset, n, first=False: asked.append(0 if first else n))
        _drop(sorted(path.glob("*.safetensors")))
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, ref["logits"])
        assert sum(asked) >= first // 2, (asked, first)


def test_auto_with_max_memory(model_dir: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, ref = model_dir
    ia.install()
    nbytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={"cpu": nbytes // 3},
        offload_folder=tmp_path / "off")
    devices = set(model.hf_device_map.values())
    assert "disk" in devices and "cpu" in devices, model.hf_device_map
    loaders = _aioswap_maps(model)
    _assert_same(_run(model), ref)
    assert sum(x.stats.bytes_read for x in loaders) > 0


def test_dat_disk_offload(model_dir: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, ref = model_dir
    ia.install()
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    accelerate.disk_offload(model, tmp_path / "dat", execution_device="cpu")
    assert len(list((tmp_path / "dat").glob("*.dat"))) == len(model.state_dict())
    _aioswap_maps(model)
    _assert_same(_run(model), ref)


def test_dispatch_model_layer_on_disk(model_dir: tuple[Path, dict[str, Any]],
                                      tmp_path: Path) -> None:
    path, ref = model_dir
    ia.install()
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "disk", "model.layers.3": "cpu",
                  "model.norm": "cpu", "lm_head": "disk"}
    accelerate.dispatch_model(model, device_map, offload_dir=tmp_path / "dm")
    _aioswap_maps(model)
    _assert_same(_run(model), ref)


def test_uninstall_restores_stock(model_dir: tuple[Path, dict[str, Any]],
                                  tmp_path: Path) -> None:
    from accelerate import big_modeling, utils
    from accelerate.utils import offload
    stock = offload.OffloadedWeightsLoader
    path, ref = model_dir
    ia.install()
    ia.install()                                   # idempotent
    assert ia.installed()
    for mod in (big_modeling, utils, offload):
        assert mod.OffloadedWeightsLoader is ia.AioswapWeightsLoader
    ia.uninstall()
    ia.uninstall()
    assert not ia.installed()
    for mod in (big_modeling, utils, offload):
        assert mod.OffloadedWeightsLoader is stock
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map={"": "disk"}, offload_folder=tmp_path / "off")
    maps = _weights_maps(model)
    assert maps and all(type(m) is stock for m in maps)
    _assert_same(_run(model), ref)


# -- refused files ---------------------------------------------------------------------------

def _disk_model(path: Path, tmp_path: Path) -> Any:
    ia.install()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map={"": "disk"}, offload_folder=tmp_path / "off")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_truncated_shard_refused(model_dir: tuple[Path, dict[str, Any]],
                                 tmp_path: Path) -> None:
    path = _copy(model_dir[0], tmp_path / "m")
    model = _disk_model(path, tmp_path)
    shard = sorted(path.glob("*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(ia.OffloadFileError, match=shard.name) as e, torch.no_grad():
        model(IDS)
    assert e.value.path == str(shard)


def test_swapped_shards_refused(model_dir: tuple[Path, dict[str, Any]],
                                tmp_path: Path) -> None:
    path = _copy(model_dir[0], tmp_path / "m")
    model = _disk_model(path, tmp_path)
    a, b = sorted(path.glob("*.safetensors"))[:2]
    data_a = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data_a)
    with pytest.raises(ia.OffloadFileError, match="has no tensor .* swapped"), torch.no_grad():
        model(IDS)


def _dat_model(model_dir: tuple[Path, dict[str, Any]], folder: Path) -> Any:
    ia.install()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir[0])
    accelerate.disk_offload(model, folder, execution_device="cpu")
    return model


def test_truncated_dat_refused(model_dir: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    model = _dat_model(model_dir, tmp_path / "dat")
    f = tmp_path / "dat" / "model.layers.0.mlp.up_proj.weight.dat"
    os.truncate(f, f.stat().st_size - 2)
    with pytest.raises(ia.OffloadFileError, match="truncated or belongs to another weight"):
        with torch.no_grad():
            model(IDS)


def test_swapped_dat_refused(model_dir: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    model = _dat_model(model_dir, tmp_path / "dat")
    a = tmp_path / "dat" / "model.layers.1.self_attn.q_proj.weight.dat"
    b = tmp_path / "dat" / "model.layers.1.self_attn.k_proj.weight.dat"    # half its size
    data_a = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data_a)
    with pytest.raises(ia.OffloadFileError, match="q_proj.weight.dat"), torch.no_grad():
        model(IDS)


# -- the loader itself ---------------------------------------------------------------------

@pytest.mark.parametrize("read_ahead", [None, 1 << 30], ids=["ahead1", "aheadall"])
@pytest.mark.parametrize("batch_bytes", [1, 16 << 20])
def test_loader_matches_stock(model_dir: tuple[Path, dict[str, Any]], tmp_path: Path,
                              batch_bytes: int, read_ahead: int | None) -> None:
    """Every key, in any order, twice; tensors handed out are never overwritten (also with
    every batch read ahead at once, their buffers reused as tensors are dropped)."""
    from accelerate.utils import OffloadedWeightsLoader, offload_state_dict
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir[0])
    sd = {k: v for k, v in model.state_dict().items()}
    sd["scalar"] = torch.tensor(3.5, dtype=sd["lm_head.weight"].dtype)
    offload_state_dict(tmp_path / "sd", sd)
    stock = OffloadedWeightsLoader(save_folder=tmp_path / "sd")
    with ia.AioswapWeightsLoader(save_folder=tmp_path / "sd", batch_bytes=batch_bytes,
                                 read_ahead=read_ahead) as ours:
        assert list(ours) == list(stock) and len(ours) == len(stock)
        assert "scalar" in ours and "nope" not in ours
        with pytest.raises(KeyError):
            ours["nope"]
        kept = []
        keys = list(stock)
        shuffled = [keys[i] for i in torch.randperm(len(keys), generator=torch.Generator()
                                                    .manual_seed(1)).tolist()]
        for key in keys[::-1] + keys + shuffled + keys:     # read-ahead right and wrong
            t = ours[key]
            kept.append((key, t, t.clone()))
            assert t.dtype == stock[key].dtype and torch.equal(t, stock[key]), key
        for key, t, copy in kept:
            assert torch.equal(t, copy), key
        assert ours.stats.files_opened == len(sd)


def test_loader_construction_is_linear() -> None:
    index = {f"model.layers.{i // 10}.w{i % 10}.weight": {"dtype": "float32", "shape": [1]}
             for i in range(20000)}
    import time
    t0 = time.perf_counter()
    loader = ia.AioswapWeightsLoader(index=index, save_folder="/nonexistent")
    assert time.perf_counter() - t0 < 0.5 and len(loader) == 20000
    loader.close()


def test_import_and_install_without_accelerate(tmp_path: Path) -> None:
    """``import aioswap`` and this module work without accelerate; install() says what is
    missing."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('accelerate', 'transformers'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    code = ("import aioswap, aioswap.integrations.accelerate as ia\n"
            "assert 'accelerate' not in __import__('sys').modules\n"
            "try:\n    ia.install()\nexcept ImportError as e:\n    print('ERR', e)\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "ERR" in done.stdout and "accelerate" in done.stdout and "pip install" in done.stdout


def test_install_warns_naming_what_it_could_not_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import big_modeling
    monkeypatch.delattr(big_modeling, "OffloadedWeightsLoader")
    with pytest.warns(aioswap.AioswapWarning,
                      match="accelerate.big_modeling.OffloadedWeightsLoader"):
        ia.install()
    ia.uninstall()
    monkeypatch.undo()


def test_index_json_default(model_dir: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """save_folder alone reads index.json, like the stock class."""
    (tmp_path / "index.json").write_text(json.dumps({"a": {"dtype": "int64", "shape": [3]}}))
    (tmp_path / "a.dat").write_bytes(torch.arange(3).numpy().tobytes())
    with ia.AioswapWeightsLoader(save_folder=tmp_path) as loader:
        assert torch.equal(loader["a"], torch.arange(3))


# -- reads from the page cache, from the drive, and sparse weights ---------------------------

def _drop(files: list[Path]) -> None:
    from aioswap.tune import drop_cache
    for f in files:
        drop_cache(str(f))


def _resident(path: Path) -> float:
    """Fraction of the file's pages in the page cache (mincore)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        from _common import resident_fraction
    finally:
        sys.path.pop(0)
    return float(resident_fraction(str(path)))


def _cache(files: list[Path]) -> None:
    for f in files:
        f.read_bytes()


@pytest.mark.parametrize("cache", ["cached", "dropped", "half"])
def test_loader_cache_paths_match_stock(model_dir: tuple[Path, dict[str, Any]],
                                        tmp_path: Path, cache: str) -> None:
    """One body over the page-cache copy, the direct read and a mix of both (a file half
    in the cache): the same tensors as the stock loader."""
    from accelerate.utils import OffloadedWeightsLoader
    path = model_dir[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map={"": "disk"}, offload_folder=tmp_path / "off")
    (stock,) = {id(m): m for m in _weights_maps(model)}.values()
    assert type(stock) is OffloadedWeightsLoader
    shards = sorted(path.glob("*.safetensors"))
    expected = {k: stock[k].clone() for k in stock.index}
    if cache == "cached":
        _cache(shards)
    else:
        _drop(shards)
    if cache == "half":
        for f in shards:                    # the first half, not on a page boundary
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)     # no read-ahead
                os.pread(fd, f.stat().st_size // 2 + 1000, 0)
            finally:
                os.close(fd)
    with ia.AioswapWeightsLoader(index=stock.index, sparse=lambda k: False) as ours:
        for key in stock.index:
            t = ours[key]
            assert t.dtype == expected[key].dtype and torch.equal(t, expected[key]), key
        s = ours.stats
        assert s.bytes_read >= sum(t.numel() * t.element_size() for t in expected.values())
        if ours.through_page_cache:
            # mapped, and what the page cache did not hold asked into it ahead: afterwards
            # the shards are cached
            assert s.requests > 0 and s.cached_bytes == 0
            assert (s.advised_bytes == 0) == (cache == "cached"), s
            assert all(_resident(f) > 0.9 for f in shards), [_resident(f) for f in shards]
        elif cache == "cached":
            assert s.cached_bytes == s.bytes_read and s.requests == 0
        elif cache == "dropped":        # (pages a mapping still holds may stay cached)
            assert s.cached_bytes < s.bytes_read and s.requests > 0
            # looking for cached pages read none in: only the headers' pages are there
            assert all(_resident(f) < 0.1 for f in shards), [_resident(f) for f in shards]
        else:
            assert 0 < s.cached_bytes < s.bytes_read and s.requests > 0


def test_embedding_is_mapped(model_dir: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """An embedding is handed out as a file mapping (a forward reads the rows it touches):
    same results, writable, and never read whole."""
    path, ref = model_dir
    assert ia.embedding_key("model.embed_tokens.weight")
    assert ia.embedding_key("transformer.wte.weight")
    assert not ia.embedding_key("lm_head.weight")
    assert not ia.embedding_key("model.layers.0.mlp.up_proj.weight")
    model = _disk_model(path, tmp_path)
    (loader,) = _aioswap_maps(model)
    _assert_same(_run(model), ref)
    assert loader.stats.mapped > 0
    t = loader["model.embed_tokens.weight"]
    t[0, 0] = 1.0                                  # private: the file is untouched
    assert torch.equal(loader["lm_head.weight"], loader["lm_head.weight"])
    dense = ia.AioswapWeightsLoader(index=loader.index, sparse=lambda k: False)
    with dense:
        e = dense["model.embed_tokens.weight"]
        assert not torch.equal(t, e) and torch.equal(t[1:], e[1:])
        assert dense.stats.mapped == 0


def test_mapped_file_truncated_refused(model_dir: tuple[Path, dict[str, Any]],
                                       tmp_path: Path) -> None:
    path = _copy(model_dir[0], tmp_path / "m")
    model = _disk_model(path, tmp_path)
    (loader,) = _aioswap_maps(model)
    key = "model.embed_tokens.weight"
    shard = Path(loader.index[key]["safetensors_file"])
    loader[key]
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(ia.OffloadFileError, match="changed size"):
        loader[key]


def test_dense_tensors_private_and_kept(model_dir: tuple[Path, dict[str, Any]],
                                        tmp_path: Path, way: str) -> None:
    """A tensor handed out (a view of a mapping, or of a batch buffer) is the caller's: a
    write to it changes neither the file nor the next tensor of that key, and it stays
    valid after the loader is closed and after later reads; a shard truncated while in
    use is refused, naming it."""
    path = _copy(model_dir[0], tmp_path / "m")
    model = _disk_model(path, tmp_path)
    (loader,) = _aioswap_maps(model)
    key = "model.layers.1.mlp.up_proj.weight"
    t = loader[key]
    assert loader.through_page_cache is (way == "cache")
    want = t.clone()
    t.fill_(7)
    again = loader[key]
    assert torch.equal(again, want) and not torch.equal(t, again)
    for k in loader.index:                         # every other group, read and dropped
        loader[k]
    loader.close()
    assert torch.equal(again, want) and bool((t == 7).all())
    shard = Path(loader.index[key]["safetensors_file"])
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises((ia.OffloadFileError, OSError), match=str(shard)):
        loader[key]


# -- writes ----------------------------------------------------------------------------------

def _state_dict(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=dtype)
    sd = dict(model.state_dict())
    sd["scalar"] = torch.tensor(3.5, dtype=dtype)
    sd["transposed"] = torch.randn(5, 33).to(dtype).t()
    sd["odd"] = torch.randn(4097).to(dtype)           # not a multiple of a block
    sd["int"] = torch.arange(11)
    sd["mask"] = torch.rand(9) > 0.5
    sd["fp8"] = torch.randn(77).to(torch.float8_e4m3fn)
    return sd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_state_dict_same_files(tmp_path: Path, dtype: torch.dtype) -> None:
    """After install(), accelerate's offload_state_dict/offload_weight write through aioswap:
    the same files byte for byte, the same index.json, data files 0600."""
    import accelerate.utils
    from accelerate.utils import offload as stock_offload
    sd = _state_dict(dtype)
    stock_offload.offload_state_dict(tmp_path / "stock", sd)
    ia.install()
    assert accelerate.utils.offload_state_dict is ia.offload_state_dict
    assert stock_offload.offload_weight is ia.offload_weight
    accelerate.utils.offload_state_dict(tmp_path / "ours", sd)
    index: dict[str, Any] = {}
    (tmp_path / "w").mkdir()
    (tmp_path / "sw").mkdir()
    assert accelerate.utils.offload_weight(sd["odd"], "one", tmp_path / "w", index) is index
    ia.uninstall()
    assert accelerate.utils.offload_state_dict is not ia.offload_state_dict
    assert stock_offload.offload_weight is not ia.offload_weight
    names = sorted(p.name for p in (tmp_path / "stock").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ours").iterdir())
    for name in names:
        ours = tmp_path / "ours" / name
        assert ours.read_bytes() == (tmp_path / "stock" / name).read_bytes(), name
        if name.endswith(".dat"):
            assert ours.stat().st_mode & 0o777 == 0o600
    stock_index: dict[str, Any] = {}
    stock_offload.offload_weight(sd["odd"], "one", tmp_path / "sw", stock_index)
    assert index == stock_index
    assert (tmp_path / "w" / "one.dat").read_bytes() == (tmp_path / "sw" / "one.dat").read_bytes()
    # stock reads what aioswap wrote, and aioswap what stock wrote
    stock = stock_offload.OffloadedWeightsLoader(save_folder=tmp_path / "ours")
    with ia.AioswapWeightsLoader(save_folder=tmp_path / "stock") as loader:
        for k, v in sd.items():
            assert torch.equal(stock[k].view(-1).view(torch.uint8),
                               v.contiguous().view(-1).view(torch.uint8)), k
            assert torch.equal(loader[k], stock[k]), k


def test_disk_offload_written_by_aioswap_read_by_stock(model_dir: tuple[Path, dict[str, Any]],
                                                       tmp_path: Path) -> None:
    path, ref = model_dir
    ia.install()
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    accelerate.disk_offload(model, tmp_path / "dat", execution_device="cpu")
    _assert_same(_run(model), ref)
    ia.uninstall()
    assert all((tmp_path / "dat" / f"{k}.dat").stat().st_mode & 0o777 == 0o600
               for k in model.state_dict())
    from accelerate.utils import OffloadedWeightsLoader
    stock = OffloadedWeightsLoader(save_folder=tmp_path / "dat")    # uninstalled: stock's
    assert type(stock) is OffloadedWeightsLoader
    fresh = transformers.AutoModelForCausalLM.from_config(_config(),
                                                          dtype=ref["logits"].dtype)
    fresh.load_state_dict({k: stock[k] for k in fresh.state_dict()})
    _assert_same(_run(fresh), ref)


def test_held_samples_the_range(tmp_path: Path) -> None:
    """The page-cache way's check that a range is cached: true when all of it is, false
    when it was dropped or only its first half is cached (the samples reach the end)."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * 4096 + 100))
    fd = os.open(path, os.O_RDONLY)
    try:
        n = path.stat().st_size
        os.pread(fd, n, 0)
        assert ia._held(fd, 0, n) and ia._held(fd, 4096 * 3 + 7, 5000)
        _drop([path])
        assert not ia._held(fd, 0, n)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)     # no read-ahead
        os.pread(fd, n // 2, 0)
        assert ia._held(fd, 0, n // 2 - 4096) and not ia._held(fd, 0, n)
    finally:
        os.close(fd)
