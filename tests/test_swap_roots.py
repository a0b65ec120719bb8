"""TensorSwapper over several directories (one per drive): every data file striped over them."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from aioswap.errors import SwapError
from aioswap.swap import TensorSwapper

from test_swap import _check, _mixed_state_dict, _snapshot


def _roots(base: Path, n: int = 3) -> list[Path]:
    return [base / f"drive{i}" / "swap" for i in range(n)]


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def _parts(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name[:2] in ("p-", "t-") and
                  p.name.endswith(".bin"))


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_round_trip_striped_over_three_directories(tmp_dir: Path, async_op: bool) -> None:
    """Odd sizes, every dtype, views; state dicts (packs) and single tensors; every
    directory holds part of the bytes, privately; byte-exact back, also after reopening
    with the other directories in another order."""
    roots = _roots(tmp_dir)
    sd = _mixed_state_dict(120)
    sd["big"] = torch.randn(3, 1_000_003)             # spans many stripe units
    snap = _snapshot(sd)
    single = torch.randn(777_777, dtype=torch.float64)
    with TensorSwapper(roots, pack_bytes=4 << 20) as sw:
        assert sw.directories == tuple(str(r) for r in roots)
        assert sw.directory == str(roots[0])
        r = sw.swap_out_state_dict("m/", sd, async_op=async_op)
        names = r.result() if async_op else r
        assert names == [f"m/{k}" for k in sd]
        sw.swap_out("single", single)
        got = sw.swap_in_state_dict("m/", async_op=async_op)
        _check(snap, got.result() if async_op else got)
        assert torch.equal(sw.swap_in("single"), single)
    total = sum(v.numel() * v.element_size() for v in sd.values()) + single.nbytes
    for d in roots:
        parts = _parts(d)
        assert parts, d
        held = sum(p.stat().st_blocks * 512 for p in parts)
        assert held > total // 10, (d, held, total)     # each drive holds a real share
        for p in d.iterdir():
            if p.is_file():
                assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    with TensorSwapper([roots[0], roots[2], roots[1]]) as sw:     # others in another order
        _check(snap, sw.swap_in_state_dict("m/"))
        assert torch.equal(sw.swap_in("single"), single)


def test_nested_state_and_release_over_roots(tmp_dir: Path) -> None:
    """An optimizer's nested state dict, released and restored in place, over two roots."""
    model = torch.nn.Linear(300, 200)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    state = opt.state_dict()
    want = {k: v.clone() for k, v in state["state"][0].items()}
    with TensorSwapper(_roots(tmp_dir, 2)) as sw:
        sw.swap_out_state_dict("opt/", state, release=True)
        assert state["state"][0]["exp_avg"].untyped_storage().nbytes() == 0
        back = sw.swap_in_state_dict("opt/")
        for k, v in want.items():
            assert torch.equal(back["state"][0][k], v), k
        opt.load_state_dict(back)


def test_a_striped_file_needs_all_its_directories(tmp_dir: Path) -> None:
    roots = _roots(tmp_dir)
    sd = {"a": torch.randn(500_001), "b": torch.arange(10)}
    with TensorSwapper(roots) as sw:
        sw.swap_out_state_dict("", sd)
    for given in ([roots[0]], roots[:2]):
        with TensorSwapper(given) as sw:
            assert sw.names() == ["a", "b"]                 # the manifest is in the first
            with pytest.raises(SwapError, match="striped over several directories"):
                sw.swap_in_state_dict("")
    with TensorSwapper(roots) as sw:                        # nothing was harmed
        got = sw.swap_in_state_dict("")
        assert all(torch.equal(got[k], sd[k]) for k in sd)
    # a part gone from one drive: that swap-in fails, naming the data file
    victim = _parts(roots[2])[0]
    victim.unlink()
    with TensorSwapper(roots) as sw, pytest.raises(SwapError, match=victim.name):
        sw.swap_in_state_dict("")


def test_files_written_with_one_directory_stay_readable(tmp_dir: Path) -> None:
    roots = _roots(tmp_dir)
    old = {"x": torch.randn(12_345)}
    with TensorSwapper(roots[0]) as sw:
        sw.swap_out_state_dict("old/", old)
    new = {"y": torch.randn(54_321)}
    with TensorSwapper(roots) as sw:
        sw.swap_out_state_dict("new/", new)
        assert torch.equal(sw.swap_in_state_dict("old/")["x"], old["x"])
        assert torch.equal(sw.swap_in_state_dict("new/")["y"], new["y"])


def test_remove_compact_and_destroy_clean_every_directory(tmp_dir: Path) -> None:
    roots = _roots(tmp_dir)
    keep = tmp_dir / "drive1"                                   # pre-existing parent: kept
    sd = {f"t{i}": torch.randn(100_000 + i) for i in range(8)}
    with TensorSwapper(roots, pack_bytes=1 << 20) as sw:
        sw.swap_out_state_dict("", sd)
        sw.remove_many([f"t{i}" for i in range(0, 8, 2)])
        sw.compact(0.9)
        sw.wait()
        got = sw.swap_in_state_dict("")
        assert sorted(got) == [f"t{i}" for i in range(1, 8, 2)]
        assert all(torch.equal(got[k], sd[k]) for k in got)
        referenced = {os.path.basename(sw.info(k).file) for k in got}
    for d in roots:
        # no part of a removed or compacted file is left on any drive
        assert {p.name for p in _parts(d)} == referenced, d
    with TensorSwapper(roots) as sw:
        sw.destroy()
    for d in roots:
        assert not d.exists(), _files(d)                        # created by the swapper
    assert keep.exists()


def test_every_directory_is_locked(tmp_dir: Path) -> None:
    roots = _roots(tmp_dir)
    with TensorSwapper(roots):
        with pytest.raises(SwapError, match="in use"):
            TensorSwapper([tmp_dir / "other", roots[1]])
        with pytest.raises(SwapError, match="in use"):
            TensorSwapper(roots[2])
    with pytest.raises(ValueError, match="distinct"):
        TensorSwapper([roots[0], roots[0]])
    with pytest.raises(ValueError, match="at least one"):
        TensorSwapper([])
