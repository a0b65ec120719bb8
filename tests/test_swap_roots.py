"""TensorSwapper over several directories (one per drive): every data file striped over them."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from aioswap.errors import SwapError
from aioswap.swap import TensorSwapper

from test_swap import _check, _mixed_state_dict, _snapshot

ROOT = Path(__file__).resolve().parents[1]


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


_CRASH_CHILD = """
    import sys, torch
    import aioswap
    from aioswap.swap import TensorSwapper
    roots, which = sys.argv[1].split(","), sys.argv[2]
    h = aioswap.AioHandle(block_size=64 * 1024, queue_depth=1)    # slow enough to be killed
    sw = TensorSwapper(roots, handle=h)
    def sd(v):
        return {f"w{i}": torch.full((1000 + i,), float(v)) for i in range(20)} | {
            "big": torch.full((48 * 2**20 // 4,), float(v))}
    if which == "first":
        sw.swap_out_state_dict("sd/", sd(1))
        print("READY", flush=True)
    else:
        print("STARTED", flush=True)
        sw.swap_out_state_dict("sd/", sd(2), overwrite=True)
        print("DONE", flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_a_striped_swap_out_keeps_one_whole_dict(tmp_dir: Path) -> None:
    roots = ",".join(str(r) for r in _roots(tmp_dir))
    code = textwrap.dedent(_CRASH_CHILD)
    r = subprocess.run([sys.executable, "-c", code, roots, "first"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, check=False)
    assert "READY" in r.stdout, r.stderr
    seen = set()
    for delay in (0.05, 0.5, 2.0):
        p = subprocess.Popen([sys.executable, "-c", code, roots, "second"],
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
        with TensorSwapper(roots.split(","), verify=True) as sw:
            got = sw.swap_in_state_dict("sd/")
            values = {float(v.reshape(-1)[0]) for v in got.values()}
            assert values in ({1.0}, {2.0}), values        # the old or the new, whole
            v = values.pop()
            seen.add(v)
            assert all(bool((t == v).all()) for t in got.values())
            assert len(got) == 21
        for d in roots.split(","):                         # the loser's parts were removed
            assert len(_parts(Path(d))) == 1, _files(Path(d))
    assert 1.0 in seen
