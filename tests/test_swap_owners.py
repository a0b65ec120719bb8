"""Several swap directories never lose data: ownership by identity, any order, an added
directory, no links, cleanup of failed swap-outs and layout temporaries, release + overwrite.

Each test names the fault it covers; every one of them lost data or left files behind before
the owner records (``aioswap-owner.json``) and the layout lookup by sidecar.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from aioswap import stripe
from aioswap.stream import offload, onload, stream
from aioswap._owner import OWNER_NAME
from aioswap.errors import SwapError
from aioswap.swap import TensorSwapper


def _sd(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(50_000 + 7 * i, generator=g) for i in range(n)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _ours(d: Path) -> list[str]:
    """aioswap's data files, layouts and temporaries in ``d``."""
    return sorted(p.name for p in d.iterdir()
                  if p.name[:2] in ("p-", "t-") or p.name.endswith(".tmp"))


# -- 1: one swapper never deletes another's files --------------------------------------------
def test_a_striped_swapper_never_deletes_another_swappers_files(tmp_dir: Path) -> None:
    """Swap out into B, then open [A, B] twice: B's swapper is found (its owner record) and A
    joins it as a drive; nothing of B is deleted. Another swapper's directories are
    refused, before anything is touched."""
    a, b, c = tmp_dir / "A", tmp_dir / "B", tmp_dir / "C"
    mine = _sd(1)
    with TensorSwapper(b) as sw:
        sw.swap_out_state_dict("m/", mine)
    before = _ours(b)
    for _ in range(2):
        with TensorSwapper([a, b]) as sw:
            assert sw.directory == str(b)
            assert _equal(sw.swap_in_state_dict("m/"), mine)
    assert _ours(b) == before
    with TensorSwapper(b) as sw:
        assert _equal(sw.swap_in_state_dict("m/"), mine)
    other = _sd(12)
    with TensorSwapper([tmp_dir / "X", c]) as sw:           # another, striped swapper
        sw.swap_out_state_dict("o/", other)
    theirs = _ours(c)
    with pytest.raises(SwapError, match="cannot also hold this swapper's files"):
        TensorSwapper([b, c])
    with pytest.raises(SwapError, match="belong to two swappers"):
        TensorSwapper([tmp_dir / "X", b])
    assert _ours(b) == before and _ours(c) == theirs
    with TensorSwapper([c, tmp_dir / "X"]) as sw:
        assert _equal(sw.swap_in_state_dict("o/"), other)
    with TensorSwapper(b) as sw:
        assert _equal(sw.swap_in_state_dict("m/"), mine)


def test_a_single_swapper_refuses_a_striped_swappers_member(tmp_dir: Path) -> None:
    a, b = tmp_dir / "A", tmp_dir / "B"
    sd = _sd(2)
    with TensorSwapper([a, b]) as sw:
        sw.swap_out_state_dict("", sd)
    before = _ours(b)
    assert before
    with pytest.raises(SwapError, match=f"first directory is '{a}'"):
        TensorSwapper(b)
    assert _ours(b) == before and not (b / "orphans").exists()
    rec = json.loads((b / OWNER_NAME).read_text())
    assert rec["role"] == "member" and rec["primary"]["ino"] == a.stat().st_ino
    with TensorSwapper([b, a]) as sw:
        assert sw.directory == str(a)
        assert _equal(sw.swap_in_state_dict(""), sd)


def test_two_primaries_are_refused(tmp_dir: Path) -> None:
    a, b = tmp_dir / "A", tmp_dir / "B"
    for d, seed in ((a, 3), (b, 4)):
        with TensorSwapper(d) as sw:
            sw.swap_out_state_dict("", _sd(seed))
    with pytest.raises(SwapError, match="belong to two swappers"):
        TensorSwapper([a, b])
    for d, seed in ((a, 3), (b, 4)):
        with TensorSwapper(d) as sw:
            assert _equal(sw.swap_in_state_dict(""), _sd(seed))


# -- 2: two paths to one directory -------------------------------------------------------------
def test_a_hard_link_is_not_two_parts(tmp_dir: Path) -> None:
    import aioswap
    with aioswap.AioHandle() as h:
        f0 = tmp_dir / "f0"
        f0.write_bytes(b"")
        os.link(f0, tmp_dir / "f1")
        with pytest.raises(ValueError, match="hard link"):
            stripe.open_striped(h, [tmp_dir / "f0", tmp_dir / "f1"], "w")


@pytest.fixture
def bind_mount(tmp_dir: Path):
    """``(directory, second path to it)`` through a bind mount; skipped where mount is not
    allowed (not root, or no mount binary)."""
    src, dst = tmp_dir / "real", tmp_dir / "bound"
    src.mkdir()
    dst.mkdir()
    mount = shutil.which("mount") or "/usr/bin/mount"
    if os.geteuid() != 0 or not os.path.exists(mount):
        pytest.skip("bind mounts need root and mount(8)")
    r = subprocess.run([mount, "--bind", str(src), str(dst)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mount --bind refused: {r.stderr.strip()}")
    try:
        yield src, dst
    finally:
        subprocess.run([shutil.which("umount") or "/usr/bin/umount", str(dst)], check=False)


def test_two_paths_to_one_directory_are_refused(bind_mount: tuple[Path, Path]) -> None:
    import aioswap
    src, dst = bind_mount
    assert os.path.realpath(src) != os.path.realpath(dst)   # realpath cannot tell
    with pytest.raises(ValueError, match="same directory"):
        TensorSwapper([src, dst])
    with pytest.raises(ValueError, match="same directory"):
        TensorSwapper([src / "s", dst / "s"])
    assert not (src / "s").exists()
    with aioswap.AioHandle() as h, pytest.raises(ValueError, match="same file"):
        stripe.open_striped(h, [src / "x.bin", dst / "x.bin"], "w")
    assert not (src / "x.bin").exists()


# -- 3 and 7: any order, an added directory ----------------------------------------------------
def test_reopen_in_another_order_and_with_an_added_directory(tmp_dir: Path) -> None:
    r = [tmp_dir / f"r{i}" for i in range(4)]
    old = _sd(5)
    with TensorSwapper(r[:3], pack_bytes=1 << 20) as sw:
        sw.swap_out_state_dict("old/", old)
        sw.swap_out("single", old["w0"] * 2)
    with TensorSwapper([r[1], r[0], r[2]]) as sw:
        assert sw.directory == str(r[0])
        assert sw.directories[0] == str(r[0])
        assert _equal(sw.swap_in_state_dict("old/"), old)
    assert not any((d / "orphans").exists() for d in r[:3])
    new = _sd(6)
    with TensorSwapper([r[3], r[2], r[1], r[0]], pack_bytes=1 << 20) as sw:   # one added
        assert sw.directory == str(r[0])
        assert _equal(sw.swap_in_state_dict("old/"), old)
        assert torch.equal(sw.swap_in("single"), old["w0"] * 2)
        sw.swap_out_state_dict("new/", new)
    assert _ours(r[3])                      # the new dict is striped over the added one too
    with TensorSwapper(r) as sw:
        assert _equal(sw.swap_in_state_dict("old/"), old)
        assert _equal(sw.swap_in_state_dict("new/"), new)
    # a member given without its primary: refused, naming it, nothing moved
    with pytest.raises(SwapError, match="its first directory was not given"):
        TensorSwapper([r[1], r[2]])
    assert not (r[1] / "orphans").exists()


def test_directories_of_an_aioswap_without_owner_records(tmp_dir: Path) -> None:
    """Written before owner records existed (simulated: the records removed): reopening in
    another order finds the manifest; files in a member it never named are kept in
    orphans/, not deleted."""
    r = [tmp_dir / f"r{i}" for i in range(3)]
    sd = _sd(7)
    with TensorSwapper(r) as sw:
        sw.swap_out_state_dict("", sd)
    for d in r:
        (d / OWNER_NAME).unlink()
    stray = r[2] / ("p-" + "ab" * 16 + ".bin")
    stray.write_bytes(b"not this swapper's")
    with pytest.warns(RuntimeWarning, match="moved, not deleted"):
        sw = TensorSwapper([r[1], r[0], r[2]])
    with sw:
        assert sw.directory == str(r[0])
        assert _equal(sw.swap_in_state_dict(""), sd)
    assert (r[2] / "orphans" / stray.name).read_bytes() == b"not this swapper's"
    assert all((d / OWNER_NAME).exists() for d in r)


# -- 5 and 6: a failed striped swap-out leaves nothing; layout temporaries go -----------------
def test_a_failed_layout_write_removes_the_parts(tmp_dir: Path, monkeypatch) -> None:
    roots = [tmp_dir / "a", tmp_dir / "b"]
    keep = _sd(8, 2)
    real = stripe.write_atomic
    calls = {"n": 0}

    def full(path, data, mode=0o600, *, durable=True):      # noqa: ANN001
        calls["n"] += 1
        if calls["n"] > 2:              # the new file's first layout goes; then ENOSPC
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data, mode, durable=durable)

    with TensorSwapper(roots) as sw:
        sw.swap_out_state_dict("keep/", keep)
        files = {str(d): _ours(d) for d in roots}
        monkeypatch.setattr(stripe, "write_atomic", full)
        with pytest.raises(OSError, match="No space left"):
            sw.swap_out_state_dict("big/", _sd(9, 3))
        monkeypatch.setattr(stripe, "write_atomic", real)
        assert {str(d): _ours(d) for d in roots} == files      # no part, layout or temporary
        sw.swap_out_state_dict("after/", keep)                 # commits still work
        assert _equal(sw.swap_in_state_dict("keep/"), keep)
        sw.destroy()
    assert not any(d.exists() for d in roots)


def test_layout_temporaries_are_removed_and_destroy_leaves_nothing(tmp_dir: Path) -> None:
    roots = [tmp_dir / "a", tmp_dir / "b"]
    sd = _sd(10)
    with TensorSwapper(roots) as sw:
        sw.swap_out_state_dict("", sd)
        packs = [Path(sw.info(k).file).name for k in sd]
    planted = []
    for d in roots:
        for suffix in (".stripe.json.tmp", ".stripe.json.4242-0123456789ab.tmp"):
            p = d / (packs[0] + suffix)
            p.write_text("{")
            planted.append(p)
        p = d / (OWNER_NAME + ".77-abcdefabcdef.tmp")
        p.write_text("{")
        planted.append(p)
    with TensorSwapper(roots) as sw:
        assert not any(p.exists() for p in planted)
        assert _equal(sw.swap_in_state_dict(""), sd)
    for d in roots:                          # and once more, for destroy() to find
        (d / (packs[0] + ".stripe.json.99-0123456789ab.tmp")).write_text("{")
    with TensorSwapper(roots) as sw:
        sw.destroy()
    assert not any(d.exists() for d in roots), [list(d.iterdir()) for d in roots if d.exists()]


# -- 8: no links, no FIFOs ---------------------------------------------------------------------
@pytest.mark.parametrize("what", ["part", "layout", "fifo"])
def test_striped_parts_are_never_followed(tmp_dir: Path, what: str) -> None:
    roots = [tmp_dir / "a", tmp_dir / "b"]
    sd = _sd(11, 2)
    with TensorSwapper(roots, verify=False) as sw:
        sw.swap_out_state_dict("", sd)
        part = roots[1] / Path(sw.info("w0").file).name
    decoy = tmp_dir / "decoy"
    if what == "part":
        shutil.copyfile(part, decoy)
        decoy.write_bytes(os.urandom(decoy.stat().st_size))
        part.unlink()
        part.symlink_to(decoy)
        match = "symbolic link"
    elif what == "layout":
        side = Path(str(part) + stripe.LAYOUT_SUFFIX)
        shutil.copyfile(side, decoy)
        side.unlink()
        side.symlink_to(decoy)
        match = "symbolic link"
    else:
        part.unlink()
        os.mkfifo(part)
        match = "not a regular file"
    with TensorSwapper(roots, verify=False) as sw:
        with pytest.raises(SwapError, match=match) as info:
            sw.swap_in_state_dict("")
        if what != "layout":
            assert "open the swapper with all" not in str(info.value)


# -- 9: release, then an overwrite of the tag --------------------------------------------------
def test_released_offload_then_write_back_restores_the_new_bytes(tmp_dir: Path) -> None:
    params = {f"p{i}": torch.randn(10_000 + i) for i in range(4)}
    with TensorSwapper(tmp_dir / "s") as sw:
        offload(sw, "model", params, release=True)
        assert all(p.untyped_storage().nbytes() == 0 for p in params.values())
        with stream(sw, ["model"]) as s:            # a write-back overwrites the tag
            for bucket in s:
                for t in bucket.values():
                    t.add_(1)
        want = {k: v.clone() for k, v in
                onload(sw, "model").items()}         # the new bytes, fresh tensors
        got = onload(sw, "model", into=params)
        assert got is params
        assert _equal(params, want)
        # an overwrite with another shape: that released tensor can no longer be restored,
        # and the error says why
        offload(sw, "other", {"x": torch.randn(100)}, release=False)
        x = {"x": torch.randn(100)}
        offload(sw, "t", x, release=True)
        offload(sw, "t", {"x": torch.randn(7)})
        with pytest.raises(SwapError, match="another shape or dtype"):
            onload(sw, "t", into=x)
