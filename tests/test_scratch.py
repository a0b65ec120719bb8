"""Scratch and temporary files do not outlive their process (bench, tune, safetensors saves).

Each case runs the real thing in a subprocess, ends it with a signal, and looks at the disk.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aioswap import _scratch

ROOT = Path(__file__).resolve().parents[1]


def _wait_for(d: Path, pattern: str, p: subprocess.Popen[str], timeout: float = 120) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(d.glob(pattern))
        if found:
            return found
        if p.poll() is not None:
            out, err = p.communicate()
            pytest.fail(f"exited {p.returncode} before making {pattern}: {out} {err}")
        time.sleep(0.01)
    pytest.fail(f"no {pattern} in {d} after {timeout} s")


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_a_signal_during_bench_or_tune_removes_its_scratch_file(tmp_dir: Path, tmp_path: Path,
                                                                 command: str,
                                                                 sig: signal.Signals,
                                                                 memlock_room: int | None) -> None:
    # tune locks its buffers: a normal user's 8 MiB lock 4M and the --quick grid (to 4M blocks)
    io = ["16M", "--search", "grid"] if memlock_room is None else ["4M", "--quick"]
    d = tmp_dir / "drive"
    d.mkdir()
    args = (["bench", "--dir", str(d), "--size", "64M", "--repeat", "1000"]
            if command == "bench" else
            ["tune", "--dir", str(d), "--io-size", *io, "--repeat", "50",
             "--log-dir", str(tmp_path / "logs")])
    p = _start("-m", "aioswap", *args, "--no-progress")
    try:
        found = _wait_for(d, f".aioswap-{command}-*.bin", p)
        assert found[0].name.startswith(f".aioswap-{command}-{p.pid}-")
        time.sleep(0.2)                         # well inside the transfers
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert err.strip().splitlines()[-1] == (f"aioswap {command}: terminated by {sig.name}; its "
                                            f"files were removed"), err
    assert "Traceback" not in err
    assert sorted(os.listdir(d)) == []


def test_a_killed_bench_leaves_a_file_the_next_run_removes(tmp_dir: Path) -> None:
    d = tmp_dir / "drive"
    d.mkdir()
    p = _start("-m", "aioswap", "bench", "--dir", str(d), "--size", "64M", "--repeat", "1000",
               "--no-progress")
    try:
        (left,) = _wait_for(d, ".aioswap-bench-*.bin", p)
        p.kill()                                # SIGKILL: nothing can clean up
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert left.exists()
    done = subprocess.run([sys.executable, "-m", "aioswap", "bench", "--dir", str(d), "--size",
                           "1M", "--repeat", "1", "--no-progress"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    assert (f"aioswap bench: removed a stale scratch file {left} left by an interrupted run "
            f"(pid {p.pid})") in done.stderr.splitlines(), done.stderr
    assert sorted(os.listdir(d)) == []


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


@pytest.mark.parametrize("command", ["bench", "tune", "info"])
def test_a_stale_scratch_file_is_removed_and_named(tmp_dir: Path, command: str) -> None:
    """What a SIGKILLed run left (its pid is gone) goes, with one line saying so; a running
    process's file stays."""
    d = tmp_dir / "drive"
    d.mkdir()
    dead, live = _dead_pid(), os.getpid()
    stale = [d / f".aioswap-bench-{dead}-k1ll3d.bin", d / f".aioswap-tune-{dead}-k1ll3d.bin",
             d / f".aioswap-stripe-{dead}-k1ll3d.bin",
             d / f".aioswap-stripe-{dead}-k1ll3d.bin.stripe.json"]
    kept = [d / f".aioswap-bench-{live}-running.bin", d / f"aioswap-bench-{dead}-notours.bin"]
    for f in stale + kept:
        f.write_bytes(b"x" * 4096)
    args = {"bench": ["--size", "1M", "--repeat", "1", "--no-progress"],
            "tune": ["--io-size", "4M", "--quick", "--no-write", "--repeat", "1",
                     "--search", "fast", "--no-progress", "--json"],
            "info": ["--json"]}[command]
    done = subprocess.run([sys.executable, "-m", "aioswap", command, "--dir", str(d), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    said = [x for x in done.stderr.splitlines() if "stale" in x]
    assert sorted(said) == sorted(
        f"aioswap {command}: removed a stale scratch file {f} left by an interrupted run "
        f"(pid {dead})" for f in stale), done.stderr
    assert sorted(os.listdir(d)) == sorted(f.name for f in kept)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("end", ["finished", "SIGINT", "SIGTERM"])
def test_tune_leaves_nothing_in_tmpdir(tmp_dir: Path, tmp_path: Path, end: str,
                                       memlock_room: int | None) -> None:
    """Without --log-dir, tune keeps no logs: no /tmp/aioswap-tune-* after it finished or was
    interrupted, and its scratch files are gone from the drive."""
    d, tmp = tmp_dir / "drive", tmp_path / "tmp"
    d.mkdir()
    tmp.mkdir()
    io = ["4M", "--quick"] if end == "finished" or memlock_room is not None else \
        ["16M", "--search", "grid"]
    p = subprocess.Popen([sys.executable, "-m", "aioswap", "tune", "--dir", str(d),
                          "--io-size", *io, "--repeat", "1" if end == "finished" else "50",
                          "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)},
                         # Ctrl-C as in a terminal: a shell's background job (a CI runner
                         # started with `&`) hands its children SIGINT ignored
                         preexec_fn=_sigint_default)
    try:
        if end != "finished":
            _wait_for(d, ".aioswap-tune-*.bin", p)
            time.sleep(0.2)
            p.send_signal(getattr(signal, end))
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    want = {"finished": 0, "SIGINT": 130, "SIGTERM": 128 + signal.SIGTERM}[end]
    assert p.returncode == want, (p.returncode, err)
    assert "Traceback" not in err and "logs in" not in err
    assert [n for n in os.listdir(tmp) if "aioswap" in n] == []
    assert os.listdir(d) == []


def test_a_scratch_file_that_cannot_be_removed_is_named(tmp_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from aioswap.cli import main
    d = tmp_dir / "drive"
    d.mkdir()
    unlink = os.unlink
    refused: list[str] = []

    def stuck(path: str | os.PathLike[str], *args: object, **kw: object) -> None:
        if os.path.basename(path).startswith(".aioswap-probe-"):
            refused.append(os.fspath(path))
            raise PermissionError(1, "Operation not permitted", os.fspath(path))
        unlink(path)
    monkeypatch.setattr(os, "unlink", stuck)
    try:
        assert main(["info", "--dir", str(d), "--json"]) == 0
    finally:
        monkeypatch.undo()
        left = sorted(d.iterdir())
        for f in left:
            f.unlink()
    out, err = capsys.readouterr()
    assert refused and [str(f) for f in left] == sorted(set(refused))
    assert err.splitlines() == [
        f"aioswap info: could not remove its scratch file {left[0]} (Operation not "
        f"permitted); remove it by hand"], err
    assert _scratch.remove_leftovers() == []        # the record forgets it once it is gone


_SAVE_CHILD = """
    import sys, torch
    import aioswap, aioswap.safetensors as ast
    h = aioswap.AioHandle(block_size=64 * 1024, queue_depth=1)    # slow enough to be killed
    t = {"w": torch.ones(256 << 20, dtype=torch.uint8)}
    print("START", flush=True)
    ast.save_file(t, sys.argv[1], handle=h)
    print("DONE", flush=True)
"""


def test_a_killed_save_leaves_no_temporary_file_for_long(tmp_dir: Path) -> None:
    d = tmp_dir / "ckpt"
    d.mkdir()
    target = d / "model.safetensors"
    p = _start("-c", textwrap.dedent(_SAVE_CHILD), str(target))
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "START"
        time.sleep(0.5)
        p.kill()
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    if "DONE" in out:
        pytest.skip("the save finished before it could be killed")
    # with O_TMPFILE nothing has a name yet; without it, the next save beside it removes it
    left = [n for n in os.listdir(d) if n.endswith(".tmp")]
    assert all(n.startswith(f".model.safetensors.{p.pid}-") for n in left), left
    import torch
    import aioswap.safetensors as ast
    ast.save_file({"x": torch.arange(10)}, d / "other.safetensors")
    ast.save_file({"x": torch.arange(10)}, target)
    assert sorted(os.listdir(d)) == ["model.safetensors", "other.safetensors"]
    assert ast.load_file(target)["x"].tolist() == list(range(10))


def test_stale_means_our_naming_and_a_dead_process(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        names = [f".a.{sleeper.pid}-abc123.tmp", f".a.{dead.pid}-abc123.tmp",
                 f".a.{dead.pid}-abc123.tmp.keep", ".a.abc123.tmp", f"a.{dead.pid}-x.tmp"]
        for n in names:
            (tmp_path / n).write_bytes(b"x")
        os.mkdir(tmp_path / f".a.{dead.pid}-dir.tmp")
        os.symlink("/etc/passwd", tmp_path / f".a.{dead.pid}-link.tmp")
        removed = _scratch.remove_stale(str(tmp_path), ".a.", ".tmp")
        assert removed == [_scratch.Stale(str(tmp_path / f".a.{dead.pid}-abc123.tmp"),
                                          dead.pid)]
        assert sorted(os.listdir(tmp_path)) == sorted(
            set(names) - {f".a.{dead.pid}-abc123.tmp"}
            | {f".a.{dead.pid}-dir.tmp", f".a.{dead.pid}-link.tmp"})
    finally:
        sleeper.kill()
        sleeper.wait()
