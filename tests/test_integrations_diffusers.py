"""aioswap.integrations.diffusers: diffusers' group offloading to disk through aioswap gives
its own stock results bit for bit, refuses group files that are not this model's (another
model's, truncated, replaced), and uninstall() gives the stock methods back."""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aioswap.integrations.diffusers as idf
from aioswap.integrations.accelerate import OffloadFileError

diffusers = pytest.importorskip("diffusers")
go = pytest.importorskip("diffusers.hooks.group_offloading")

# without CAP_IPC_LOCK and with a small RLIMIT_MEMLOCK reads go to unlocked memory with one
# warning (as in test_safetensors)
pytestmark = pytest.mark.filterwarnings("ignore::aioswap.pinned.PinnedMemoryWarning")

STOCK = {m: go.ModuleGroup.__dict__[m] for m in ("_onload_from_disk", "_offload_to_disk")}
LEVELS = {"block": {"offload_type": "block_level", "num_blocks_per_group": 1},
          "leaf": {"offload_type": "leaf_level"}}


def _model(seed: int, dtype: torch.dtype = torch.float32) -> Any:
    """A tiny random Flux transformer (33k parameters: 2 double and 2 single blocks)."""
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4))
    return model.to(dtype) if dtype != torch.float32 else model


def _forward(model: Any, n: int = 3) -> list[torch.Tensor]:
    """``n`` forwards on fixed inputs (n > 2: the recorded order is used for read-ahead)."""
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 16, 4, generator=g).to(dtype),
              "encoder_hidden_states": torch.randn(1, 8, 16, generator=g).to(dtype),
              "pooled_projections": torch.randn(1, 16, generator=g).to(dtype),
              "timestep": torch.tensor([1.0], dtype=dtype),
              "img_ids": torch.randn(16, 3, generator=g),
              "txt_ids": torch.randn(8, 3, generator=g)}
    with torch.no_grad():
        return [model(**inputs).sample for _ in range(n)]


def _offloaded(seed: int, path: Path, level: str = "block",
               dtype: torch.dtype = torch.float32) -> Any:
    model = _model(seed, dtype)
    model.enable_group_offload(onload_device="cpu", offload_to_disk_path=str(path),
                               **LEVELS[level])
    return model


def _group_files(path: Path) -> list[Path]:
    return sorted(path.glob("group_*.safetensors"))


@pytest.fixture(autouse=True)
def _uninstalled() -> Iterator[None]:
    idf.uninstall()
    yield
    idf.uninstall()
    gc.collect()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("level", list(LEVELS))
def test_bit_identical_to_stock(level: str, dtype: torch.dtype, tmp_path: Path) -> None:
    stock = _forward(_offloaded(0, tmp_path / "stock", level, dtype))
    idf.install()
    ours = _forward(_offloaded(0, tmp_path / "aioswap", level, dtype))
    for a, b in zip(stock, ours):
        assert torch.equal(a, b)
    s = idf.stats()
    assert s.written == len(_group_files(tmp_path / "aioswap")) > 0
    assert s.readahead_hits > s.onloads // 3      # later forwards are read ahead
    # the group files are the bytes stock diffusers writes (alignment, and so the bits)
    for a_file, b_file in zip(_group_files(tmp_path / "stock"),
                              _group_files(tmp_path / "aioswap")):
        assert a_file.name == b_file.name
        assert a_file.read_bytes() == b_file.read_bytes()
        assert Path(f"{b_file}.aioswap.json").is_file()


def test_same_weights_reuse_files(tmp_path: Path) -> None:
    idf.install()
    first = _forward(_offloaded(0, tmp_path))
    stamps = {p: p.stat().st_mtime_ns for p in _group_files(tmp_path)}
    written = idf.stats().written
    again = _forward(_offloaded(0, tmp_path))            # same weights, same directory
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    s = idf.stats()
    assert s.written == written and s.reused == len(stamps)
    assert s.verified >= len(stamps)                     # each reused file hashed once
    assert {p: p.stat().st_mtime_ns for p in _group_files(tmp_path)} == stamps


def test_other_model_in_same_directory_refused(tmp_path: Path) -> None:
    idf.install()
    _forward(_offloaded(0, tmp_path), 1)
    with pytest.raises(OffloadFileError, match=r"group_\w+\.safetensors.*other weights") as e:
        _offloaded(1, tmp_path)                          # stock would run with seed 0's
    assert Path(e.value.path).parent == tmp_path


@pytest.mark.parametrize("how", ["copy", "rename"])
def test_swapped_file_refused(how: str, tmp_path: Path) -> None:
    idf.install()
    a = _offloaded(0, tmp_path / "a")
    _offloaded(1, tmp_path / "b")
    _forward(a)
    victim = _group_files(tmp_path / "a")[0]
    other = tmp_path / "b" / victim.name                 # same group of another model
    if how == "copy":
        shutil.copyfile(other, victim)                   # rewritten in place
    else:
        os.replace(other, victim)                        # another inode
    with pytest.raises(OffloadFileError, match="does not hold this model's weights") as e:
        _forward(a, 1)
    assert e.value.path == str(victim) and str(victim) in str(e.value)


def test_truncated_file_refused(tmp_path: Path) -> None:
    idf.install()
    model = _offloaded(0, tmp_path, "leaf")
    _forward(model)
    victim = max(_group_files(tmp_path), key=lambda p: p.stat().st_size)
    os.truncate(victim, victim.stat().st_size - 100)
    with pytest.raises(OffloadFileError) as e:
        _forward(model, 1)
    assert e.value.path == str(victim) and str(victim) in str(e.value)
    # and at first offload: a truncated file where the group file should be
    with pytest.raises(OffloadFileError, match="cannot be used") as e:
        _offloaded(0, tmp_path, "leaf")
    assert e.value.path == str(victim)


def test_hooks_applied_again_keep_the_weights(tmp_path: Path) -> None:
    stock2 = _model(0)
    stock2.enable_group_offload(onload_device="cpu", offload_type="block_level",
                                num_blocks_per_group=2, offload_to_disk_path=str(tmp_path / "s2"))
    ref2 = _forward(stock2, 1)[0]
    idf.install()
    model = _offloaded(0, tmp_path / "a")
    ref = _forward(model, 1)[0]
    written = idf.stats().written
    go._maybe_remove_and_reapply_group_offloading(model)    # what LoRA loading does
    assert torch.equal(_forward(model, 1)[0], ref)
    assert idf.stats().written == written                    # same files, same grouping
    # another grouping while offloaded: stock would write the empty placeholders
    registry = diffusers.hooks.HookRegistry.check_if_exists_or_initialize(model)
    registry.remove_hook(go._GROUP_OFFLOADING, recurse=True)
    go.apply_group_offloading(model, onload_device=torch.device("cpu"),
                              offload_type="block_level", num_blocks_per_group=2,
                              offload_to_disk_path=str(tmp_path / "b"))
    assert torch.equal(_forward(model, 1)[0], ref2)


def test_uninstall_restores_stock(tmp_path: Path) -> None:
    ref = _forward(_offloaded(0, tmp_path / "ref"), 1)[0]
    idf.install()
    idf.install()                                        # idempotent
    assert idf.installed()
    assert all(go.ModuleGroup.__dict__[m] is not f for m, f in STOCK.items())
    idf.uninstall()
    idf.uninstall()
    assert not idf.installed()
    assert all(go.ModuleGroup.__dict__[m] is f for m, f in STOCK.items())
    stock_model = _offloaded(0, tmp_path / "stock")
    assert not list((tmp_path / "stock").glob("*.aioswap.json"))
    assert torch.equal(_forward(stock_model, 1)[0], ref)


def test_install_names_what_it_cannot_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(go.ModuleGroup, "_offload_to_disk")
    with pytest.raises(RuntimeError, match=r"could not patch .*ModuleGroup\._offload_to_disk"):
        idf.install()
    assert not idf.installed()
    assert go.ModuleGroup.__dict__["_onload_from_disk"] is STOCK["_onload_from_disk"]
    monkeypatch.setitem(sys.modules, "diffusers.hooks.group_offloading", None)
    with pytest.raises(ImportError, match="diffusers is not importable"):
        idf.install()
    assert not idf.installed()


def test_import_without_diffusers() -> None:
    code = ("import sys\n"
            "sys.modules['diffusers'] = None\n"        # import diffusers raises ImportError
            "import aioswap, aioswap.integrations.diffusers as d\n"
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules\n"
            "try:\n"
            "    d.install()\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install diffusers" in r.stdout


@pytest.mark.parametrize("forced", [None, "direct", "buffered"])
def test_onloads_follow_the_page_cache(forced: str | None, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A group file the page cache holds is copied from it, one it does not is read direct;
    AIOSWAP_READ forces either; the results stay stock's bit for bit."""
    from aioswap.tune import drop_cache
    stock = _forward(_offloaded(0, tmp_path / "stock"), 1)
    if forced is not None:
        monkeypatch.setenv("AIOSWAP_READ", forced)
    idf.install()
    model = _offloaded(0, tmp_path / "aioswap")
    _forward(model, 1)                                   # writes the group files
    files = _group_files(tmp_path / "aioswap")
    try:
        os.close(os.open(files[0], os.O_RDONLY | os.O_DIRECT))
        direct_ok = True
    except OSError:
        direct_ok = False
    for state in ("dropped", "cached"):
        for f in files:
            if state == "dropped":
                drop_cache(str(f))
            else:
                f.read_bytes()
        before = idf.stats()
        (got,) = _forward(model, 1)
        assert torch.equal(got, stock[0])
        after = idf.stats()
        read = after.bytes_read - before.bytes_read
        copied = after.cached_bytes - before.cached_bytes
        assert read > 0
        want = {"direct": 0, "buffered": read}.get(forced or "", read if state == "cached"
                                                   else 0)
        if not direct_ok:               # tmpfs and the like: every read is a copy
            want = read
        assert copied == want, (state, forced, copied, read)
