"""TensorSwapper against a hostile or unlucky swap directory (issue 11, items 3, 11, 13, 14,
19, 20): each test fails on the format-1 swapper and passes now."""
from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from aioswap.errors import SwapError
from aioswap.swap import MANIFEST_NAME, TensorSwapper


def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST_NAME).read_text())


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# item 3 --------------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "Input/output error"),
                                 KeyboardInterrupt()], ids=["EIO", "SIGINT"])
def test_error_after_the_rename_keeps_the_published_data(tmp_dir: Path, monkeypatch,
                                                         exc: BaseException) -> None:
    d = tmp_dir / "s"
    old, new = torch.full((1000,), 1.0), torch.full((1000,), 2.0)
    with TensorSwapper(d) as sw:
        sw.swap_out("a", old)
        sw.swap_out_state_dict("sd/", {"x": old, "y": old})
        real = os.replace

        def replace_then_fail(src, dst, **kw):       # the rename happens, then an error
            real(src, dst, **kw)
            if str(dst).endswith(MANIFEST_NAME):
                raise exc

        monkeypatch.setattr(os, "replace", replace_then_fail)
        with pytest.raises(type(exc)):
            sw.swap_out("a", new, overwrite=True)
        with pytest.raises(type(exc)):
            sw.swap_out_state_dict("sd/", {"x": new, "y": new}, overwrite=True)
        monkeypatch.undo()
        # the published manifest names the new data, and that data is still there
        assert torch.equal(sw.swap_in("a"), new)
        assert torch.equal(sw.swap_in_state_dict("sd/")["y"], new)
    with TensorSwapper(d) as sw:                     # and at the next open
        assert torch.equal(sw.swap_in("a"), new)
        got = sw.swap_in_state_dict("sd/")
        assert torch.equal(got["x"], new) and torch.equal(got["y"], new)


# item 11 -------------------------------------------------------------------------------


def test_fifo_in_place_of_a_data_file_is_refused_not_waited_on(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    with TensorSwapper(d) as sw:
        info = sw.swap_out("a", torch.arange(100))
        os.unlink(info.file)
        os.mkfifo(info.file, 0o600)
        result: list[BaseException | None] = []

        def read() -> None:
            try:
                sw.swap_in("a", verify=False)
                result.append(None)
            except BaseException as e:       # noqa: BLE001 - reported below
                result.append(e)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(10)
        if t.is_alive():                     # the old code blocks in open(): unblock it
            fd = os.open(info.file, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            t.join(10)
            pytest.fail("swap_in blocked on a FIFO planted in place of a data file")
        assert isinstance(result[0], SwapError), result
        assert "not a regular file" in str(result[0])
        os.unlink(info.file)


# item 13 -------------------------------------------------------------------------------


def test_files_are_private_and_created_directory_is_0700(tmp_dir: Path) -> None:
    d = tmp_dir / "deep" / "s"
    old = os.umask(0o022)
    try:
        with TensorSwapper(d) as sw:
            sw.swap_out("a", torch.ones(10))
            sw.swap_out_state_dict("sd/", {"x": torch.ones(3)})
            assert _mode(d) == 0o700
            for p in d.iterdir():
                assert _mode(p) == 0o600, p.name
        with TensorSwapper(tmp_dir / "g", mode=0o640) as sw:
            sw.swap_out("a", torch.ones(10))
            assert _mode(tmp_dir / "g") == 0o750
            assert {_mode(p) for p in (tmp_dir / "g").iterdir()} == {0o640}
    finally:
        os.umask(old)
    with pytest.raises(ValueError, match="mode"):
        TensorSwapper(tmp_dir / "h", mode=0o400)


# item 14 -------------------------------------------------------------------------------


def test_symlink_in_place_of_a_data_file_is_never_followed(tmp_dir: Path) -> None:
    secret = tmp_dir / "secret.bin"
    secret.write_bytes(b"S" * 400)
    os.chmod(secret, 0o600)
    with TensorSwapper(tmp_dir / "s", checksum=None) as sw:
        info = sw.swap_out("a", torch.zeros(100))     # 400 bytes, no checksum
        os.unlink(info.file)
        os.symlink(secret, info.file)
        out = torch.empty(100)
        with pytest.raises(SwapError, match="symbolic link"):
            sw.swap_in("a", out=out)
        with pytest.raises(SwapError, match="symbolic link"):
            sw.swap_in_state_dict("")


# item 19 -------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("shape", 5), ("stride", 5), ("shape", [1.5]),
                                         ("stride", "x"), ("shape", None), ("offset", "0"),
                                         ("shape", [2, 2, 2])])
def test_bad_manifest_fields_raise_swap_error(tmp_dir: Path, field: str, value) -> None:
    d = tmp_dir / "s"
    with TensorSwapper(d) as sw:
        sw.swap_out("a", torch.ones(4))
    m = _manifest(d)
    m["entries"][0][field] = value
    (d / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(SwapError, match="malformed manifest entry"):
        TensorSwapper(d)


# item 20 -------------------------------------------------------------------------------


def test_missing_manifest_keeps_data_files_and_warns(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    with TensorSwapper(d) as sw:
        sw.swap_out("a", torch.arange(10))
        sw.swap_out_state_dict("sd/", {"x": torch.arange(3)})
    data = sorted(p.name for p in d.iterdir() if p.name[:2] in ("t-", "p-"))
    assert len(data) == 2
    contents = {n: (d / n).read_bytes() for n in data}
    (d / MANIFEST_NAME).unlink()
    with pytest.warns(RuntimeWarning, match="no manifest.*moved, not deleted"):
        sw = TensorSwapper(d)
    with sw:
        assert sw.names() == []
        sw.swap_out("b", torch.ones(2))
    kept = d / "orphans"
    assert sorted(os.listdir(kept)) == data
    assert {n: (kept / n).read_bytes() for n in data} == contents
    with TensorSwapper(d) as sw:                    # a known manifest: no warning, kept
        assert sw.names() == ["b"]
        sw.destroy()
    assert sorted(os.listdir(kept)) == data         # destroy never touches them
