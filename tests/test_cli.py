"""The ``aioswap`` command: ``info``, ``bench`` and ``tune`` end to end, and bad input.

The tools run in subprocesses (``python -m aioswap``, as a user runs them) and, where that is
handy, in-process through :func:`aioswap.cli.main` with capsys. Sizes are tiny. Bad input must
give exit status 2, a clear message on stderr and leave nothing behind; the read-only and
no-O_DIRECT cases mount a file system (tmpfs read-only, ramfs) and skip where that is refused.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aioswap
from aioswap import AioConfig
from aioswap.cli import format_size, main, parse_size
from aioswap.tune import SweepPoint

MiB = 1 << 20
GiB = 1 << 30
TIMEOUT = 300


def run_cli(*args: str | os.PathLike[str], cwd: Path | None = None,
            timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """``python -m aioswap ARGS`` in a subprocess, output captured as text."""
    return subprocess.run([sys.executable, "-m", "aioswap", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          check=False)


def listing(d: Path) -> list[str]:
    """Everything under ``d`` (hidden files too), relative, sorted."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def supports_o_direct(d: Path) -> bool:
    probe = d / f".o-direct-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()
    os.close(fd)
    return True


@pytest.fixture
def disk(tmp_dir: Path) -> Path:
    """An empty directory on a file system with O_DIRECT (the CLI refuses others)."""
    if not supports_o_direct(tmp_dir):
        pytest.skip(f"{tmp_dir} refuses O_DIRECT; set AIOSWAP_TEST_DIR to a disk directory")
    d = tmp_dir / "data"  # tmp_dir may be tmp_path, where logs and outputs go
    d.mkdir()
    return d


@contextlib.contextmanager
def mounted(target: Path, fstype: str, *options: str) -> Iterator[Path]:
    """Mount a fresh ``fstype`` on ``target`` for the block; skip when mounting is refused."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a file system needs root and mount(8)")
    target.mkdir(exist_ok=True)
    cmd = ["mount", "-t", fstype] + (["-o", ",".join(options)] if options else [])
    done = subprocess.run(cmd + [fstype, str(target)], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True,
                          check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


def assert_usage_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit status 2, the message on stderr (not a traceback), nothing on stdout."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout == ""
    for needle in needles:
        assert needle in done.stderr, (needle, done.stderr)


def is_power_of_two(n: Any) -> bool:
    return type(n) is int and n > 0 and n & (n - 1) == 0


def best_section(stdout: str) -> dict[str, Any]:
    """The ``{"aio": {...}}`` section the text output of ``tune`` ends with."""
    head = stdout.index('best "aio" section')
    doc: dict[str, Any] = json.loads(stdout[stdout.index("{", head):])
    return doc


def assert_real_section(doc: dict[str, Any]) -> AioConfig:
    """A section AioConfig reads back unchanged, with ints and real JSON booleans."""
    aio = doc["aio"]
    assert set(aio) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                        "overlap_events", "use_gds"}
    for key in ("single_submit", "overlap_events", "use_gds"):
        assert type(aio[key]) is bool, (key, aio[key])
    for key in ("block_size", "queue_depth", "intra_op_parallelism"):
        assert type(aio[key]) is int and aio[key] > 0, (key, aio[key])
    assert aio["use_gds"] is False
    cfg = AioConfig.from_dict(doc)
    assert cfg.to_dict() == aio
    assert AioConfig.from_dict(aio) == cfg
    return cfg


# -- sizes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("1G", GiB), ("1g", GiB), ("1GiB", GiB), ("1 GB", GiB), ("400M", 400 * MiB),
    ("64K", 64 << 10), ("4096", 4096), ("1.5K", 1536), ("2T", 2 << 40), (" 8M ", 8 * MiB),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text, why", [
    ("0", "must be positive"), ("0K", "must be positive"), ("12X", "invalid size"),
    ("", "invalid size"), ("-1M", "invalid size"), ("M", "invalid size"),
    ("1.2.3G", "invalid size"), ("1 G B", "invalid size"),
])
def test_parse_size_rejects(text: str, why: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        parse_size(text)


@pytest.mark.parametrize("n, text", [
    (GiB, "1 GiB"), (8 * MiB, "8 MiB"), (400 * MiB, "400 MiB"), (64 << 10, "64 KiB"),
    (1536, "1.50 KiB"), (1000, "1000 B"), (3 * GiB // 2, "1.50 GiB"), (1 << 40, "1 TiB"),
])
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize("n", [4096, 64 << 10, MiB, 8 * MiB, GiB, 3 * GiB // 2])
def test_format_size_parses_back(n: int) -> None:
    assert parse_size(format_size(n)) == n


# -- info ----------------------------------------------------------------------------------------


def check_info(info: dict[str, Any], directory: Path) -> None:
    assert info["aioswap"] == aioswap.__version__
    assert isinstance(info["kernel"], str) and isinstance(info["python"], str)

    aio = info["aio"]
    assert aio["available"] is True and aio["reason"] is None
    assert aio["aio_max_nr"] is None or type(aio["aio_max_nr"]) is int

    d = info["directory"]
    assert d["path"] == str(directory.resolve())
    assert isinstance(d["fs_type"], str) and d["fs_type"]
    assert type(d["free_bytes"]) is int and type(d["total_bytes"]) is int
    assert 0 < d["free_bytes"] <= d["total_bytes"]
    assert d["o_direct"] is True
    assert is_power_of_two(d["dio_mem_align"]) and d["dio_mem_align"] <= 4096
    assert is_power_of_two(d["dio_offset_align"]) and d["dio_offset_align"] <= 4096

    m = info["memlock"]
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert m["unlimited"] is (soft == resource.RLIM_INFINITY)
    assert m["rlimit_soft"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert m["rlimit_hard"] == (None if hard == resource.RLIM_INFINITY else hard)
    assert type(m["cap_ipc_lock"]) is bool

    c = info["cufile"]
    from aioswap import _cufile
    assert c["available"] is _cufile.available()[0]
    if not c["available"]:
        assert isinstance(c["reason"], str) and "cuFile" in c["reason"]

    import torch
    assert info["gpu"]["torch"] == torch.__version__
    assert info["gpu"]["cuda"] is torch.cuda.is_available()


def test_info_json_subprocess(disk: Path) -> None:
    before = listing(disk)
    done = run_cli("info", disk, "--json")
    assert done.returncode == 0, done.stderr
    check_info(json.loads(done.stdout), disk)
    assert listing(disk) == before  # the O_DIRECT probe file is gone


def test_info_json_no_cufile_here(disk: Path) -> None:
    """On a box without libcufile (this one): available False, and the reason says why."""
    from aioswap import _cufile
    if _cufile.available()[0]:
        pytest.skip("libcufile is present here")
    info = json.loads(run_cli("info", disk, "--json").stdout)
    assert info["cufile"]["available"] is False
    assert "libcufile" in info["cufile"]["reason"]


def test_info_json_in_process(disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(disk), "--json"]) == 0
    out, err = capsys.readouterr()
    check_info(json.loads(out), disk)
    assert err == ""


def test_info_text(disk: Path, capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(disk)  # DIR defaults to .
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for label in ("kernel AIO", "directory", "O_DIRECT", "RLIMIT_MEMLOCK", "CAP_IPC_LOCK",
                  "cuFile", "GPU"):
        assert label in out, (label, out)
    assert "kernel AIO       : yes" in out
    assert str(disk.resolve()) in out and "free of" in out
    align = json.loads(run_cli("info", disk, "--json").stdout)["directory"]["dio_mem_align"]
    assert f"O_DIRECT         : yes, memory alignment {align} B" in out
    assert listing(disk) == []


def test_console_script(disk: Path) -> None:
    exe = shutil.which("aioswap")
    if exe is None:
        pytest.skip("the aioswap console script is not on PATH")
    done = subprocess.run([exe, "info", str(disk), "--json"], capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["directory"]["o_direct"] is True


def test_no_command_is_a_usage_error() -> None:
    done = run_cli()
    assert done.returncode == 2 and "usage: aioswap" in done.stderr


# -- bench ---------------------------------------------------------------------------------------


def test_bench_text(disk: Path) -> None:
    before = listing(disk)
    done = run_cli("bench", "--dir", disk, "--size", "8M", "--no-progress")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "8 MiB" in out and str(disk.resolve()) in out
    for method in ("aioswap direct (pinned)", "aioswap bounce (unpinned)", "python buffered"):
        line = next(x for x in out.splitlines() if x.startswith(method))
        numbers = [float(v) for v in line[len(method):].split()]
        assert len(numbers) == 4 and all(v > 0 for v in numbers), line
    assert "fsync" in out and "page cache" in out  # says how reads avoid the cache
    assert "GiB/s" in out
    assert listing(disk) == before
    assert done.stderr == ""  # --no-progress


def test_bench_json_in_process(disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = listing(disk)
    assert main(["bench", "--dir", str(disk), "--size", "8M", "--json"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)  # the progress bar went to stderr, not into the JSON
    assert "aioswap bench" in err
    assert res["size_bytes"] == 8 * MiB and res["size"] == "8 MiB"
    assert res["directory"] == str(disk.resolve())
    assert "page cache" in res["cache"] and "fsync" in res["writes"]
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == ["aioswap direct (pinned)", "aioswap bounce (unpinned)",
                          "python buffered"]
    gib = res["size_bytes"] / GiB
    for r in rows.values():
        for key in ("write_GiBps", "read_GiBps"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["method"], key, r[key])
    base = rows["python buffered"]
    for r in rows.values():
        for d in ("write", "read"):
            method_s = gib / r[f"{d}_GiBps"]
            buffered_s = gib / base[f"{d}_GiBps"]
            assert r[f"{d}_vs_buffered"] == pytest.approx(buffered_s / method_s, rel=1e-9)
    assert base["write_vs_buffered"] == base["read_vs_buffered"] == 1.0
    assert listing(disk) == before


def test_bench_progress_on_stderr(disk: Path) -> None:
    done = run_cli("bench", "--dir", disk, "--size", "4M", "--json")
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)
    assert "aioswap bench" in done.stderr and "7/7" in done.stderr
    assert listing(disk) == []


def test_bench_default_dir_is_cwd(disk: Path) -> None:
    done = run_cli("bench", "--size", "1M", "--no-progress", "--json", cwd=disk)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["directory"] == str(disk.resolve())
    assert listing(disk) == []


def test_bench_odd_size(disk: Path) -> None:
    done = run_cli("bench", "--dir", disk, "--size", "1000", "--no-progress")
    assert done.returncode in (0, 2), done.stderr
    assert "Traceback" not in done.stderr
    assert listing(disk) == []


# -- tune ----------------------------------------------------------------------------------------


def logged_points(log_dir: Path, direction: str) -> set[str]:
    files = sorted((log_dir / direction).glob("*.json"))
    for f in files:
        rec = json.loads(f.read_text())
        assert rec["direction"] == direction and rec["name"] == f.stem
        assert rec["error"] is None and rec["bytes"] == rec["io_size"] and rec["gbps"] > 0
    return {f.stem for f in files}


def test_tune_end_to_end(disk: Path, tmp_path: Path) -> None:
    """``tune --io-size 64M`` on a real file: table, best section, one log per point."""
    logs, out_file = tmp_path / "logs", tmp_path / "best.json"
    before = listing(disk)
    done = run_cli("tune", "--dir", disk, "--io-size", "64M", "--search", "fast",
                   "--log-dir", logs, "--output", out_file, "--no-progress")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "read GB/s" in out and "write GB/s" in out and "hmean GB/s" in out
    assert "0 failed" in out
    doc = best_section(out)
    cfg = assert_real_section(doc)
    # the file --output wrote is the same section
    assert json.loads(out_file.read_text()) == doc
    # one log per measured point and direction; the table lists the same points
    reads, writes = logged_points(logs, "read"), logged_points(logs, "write")
    assert reads == writes and reads
    table = {line.split()[1] if line.startswith("* ") else line.split()[0]
             for line in out.splitlines() if line.startswith(("* ", "  block", "  single"))}
    assert table == reads
    evaluations = int(out.split("best \"aio\" section (")[1].split(" of ")[0])
    assert evaluations == len(reads)
    winner = next(line for line in out.splitlines() if line.startswith("* ")).split()[1]
    assert SweepPoint.parse(winner).to_config() == cfg
    assert f"logs in {logs}" in done.stderr
    assert listing(disk) == before  # scratch files removed


@pytest.mark.parametrize("flag, measured", [("--no-read", "write"), ("--no-write", "read")])
def test_tune_one_direction(disk: Path, tmp_path: Path, flag: str, measured: str) -> None:
    """Only that direction is measured, logged, and picked by."""
    logs = tmp_path / "logs"
    done = run_cli("tune", "--dir", disk, "--io-size", "16M", flag, "--json", "--log-dir", logs,
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["direction"] == measured and doc["error"] is None
    assert {r["direction"] for r in doc["results"]} == {measured}
    assert not (logs / ("read" if measured == "write" else "write")).exists()
    assert logged_points(logs, measured) == {r["name"] for r in doc["results"]}
    cfg = assert_real_section(doc)
    best = max(r["gbps"] for r in doc["results"])
    chosen = [r for r in doc["results"]
              if SweepPoint.parse(r["name"]).to_config() == cfg]
    assert len(chosen) == 1 and chosen[0]["gbps"] == best
    assert listing(disk) == []


def test_tune_in_process(disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through main(): JSON on stdout, the progress bar and log note on stderr."""
    logs = tmp_path / "logs"
    assert main(["tune", "--dir", str(disk), "--io-size", "8M", "--no-read", "--json",
                 "--log-dir", str(logs)]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert_real_section(doc)
    assert doc["log_dir"] == str(logs) and doc["evaluations"] == len(doc["results"])
    assert "aioswap tune" in err and f"logs in {logs}" in err
    assert listing(disk) == []


def test_tune_plot(disk: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    done = run_cli("tune", "--dir", disk, "--io-size", "8M", "--no-read", "--plot", png,
                   "--log-dir", tmp_path / "logs", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert_real_section(best_section(done.stdout))
    assert listing(disk) == []


def test_tune_needs_dir_and_one_direction(disk: Path) -> None:
    done = run_cli("tune", "--io-size", "8M")
    assert done.returncode == 2 and "--dir" in done.stderr
    done = run_cli("tune", "--dir", disk, "--no-read", "--no-write")
    assert done.returncode == 2 and "not allowed with" in done.stderr
    assert listing(disk) == []


# -- bad input -----------------------------------------------------------------------------------


def bench_args(d: Path) -> list[str]:
    return ["bench", "--dir", str(d), "--size", "8M", "--no-progress"]


def tune_args(d: Path, logs: Path) -> list[str]:
    return ["tune", "--dir", str(d), "--io-size", "8M", "--no-progress", "--log-dir", str(logs)]


@pytest.mark.parametrize("command", ["bench", "tune", "info"])
def test_missing_directory(tmp_path: Path, command: str) -> None:
    missing, logs = tmp_path / "no-such-dir", tmp_path / "logs"
    args = {"bench": bench_args(missing), "tune": tune_args(missing, logs),
            "info": ["info", str(missing), "--json"]}[command]
    assert_usage_error(run_cli(*args), f"aioswap {command}: error:", str(missing),
                       "does not exist")
    assert listing(tmp_path) == []  # neither the directory nor the logs were created


def test_missing_directory_in_process(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "gone"
    assert main(bench_args(missing)) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"aioswap bench: error: directory '{missing}' does not exist" in err


def test_second_tune_dir_missing(disk: Path, tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    done = run_cli(*tune_args(disk, tmp_path / "logs"), "--dir", missing)
    assert_usage_error(done, str(missing), "does not exist")
    assert listing(disk) == [] and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_a_file_is_not_a_directory(tmp_path: Path, command: str) -> None:
    f = tmp_path / "plain-file"
    f.write_bytes(b"x")
    args = bench_args(f) if command == "bench" else tune_args(f, tmp_path / "logs")
    assert_usage_error(run_cli(*args), str(f))
    assert listing(tmp_path) == ["plain-file"]


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_read_only_directory(tmp_path: Path, command: str) -> None:
    # As root, os.access calls a mode-0555 directory writable; a read-only mount is not.
    with mounted(tmp_path / "ro", "tmpfs", "ro") as ro:
        args = bench_args(ro) if command == "bench" else tune_args(ro, tmp_path / "logs")
        assert_usage_error(run_cli(*args), str(ro), "not writable")
        assert listing(ro) == []
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_no_o_direct(tmp_path: Path, command: str) -> None:
    with mounted(tmp_path / "ramfs", "ramfs") as rf:
        if supports_o_direct(rf):
            pytest.skip("this kernel's ramfs accepts O_DIRECT")
        args = bench_args(rf) if command == "bench" else tune_args(rf, tmp_path / "logs")
        assert_usage_error(run_cli(*args), str(rf), "refuses O_DIRECT")
        assert listing(rf) == []  # the probe file is gone too
    assert not (tmp_path / "logs").exists()


def test_info_reports_no_o_direct(tmp_path: Path) -> None:
    """info describes such a file system (status 0) rather than refusing it."""
    with mounted(tmp_path / "ramfs", "ramfs") as rf:
        if supports_o_direct(rf):
            pytest.skip("this kernel's ramfs accepts O_DIRECT")
        done = run_cli("info", rf, "--json")
        assert done.returncode == 0, done.stderr
        d = json.loads(done.stdout)["directory"]
        assert d["o_direct"] is False and d["fs_type"] == "ramfs"
        assert "O_DIRECT" in d["reason"]
        text = run_cli("info", rf).stdout
        assert "O_DIRECT         : NO" in text and "buffered I/O" in text
        assert listing(rf) == []


@pytest.mark.parametrize("args, needle", [
    (["bench", "--size", "0"], "size must be positive"),
    (["bench", "--size", "12X"], "invalid size '12X'"),
    (["bench", "--size=-8M"], "invalid size"),
    (["bench", "--block-size", "0"], "size must be positive"),
    (["tune", "--io-size", "0"], "size must be positive"),
    (["tune", "--io-size", "64Q"], "invalid size '64Q'"),
])
def test_bad_size(disk: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    flag = ["--dir", str(disk)] + (["--log-dir", str(tmp_path / "logs")]
                                   if args[0] == "tune" else [])
    done = run_cli(*args, *flag)
    assert_usage_error(done, needle, f"aioswap {args[0]}: error: argument")
    assert "usage: aioswap" in done.stderr
    assert listing(disk) == [] and not (tmp_path / "logs").exists()


def test_bad_size_in_process(disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--dir", str(disk), "--size", "0"])
    assert exc.value.code == 2
    assert "size must be positive" in capsys.readouterr().err
    assert listing(disk) == []


@pytest.mark.parametrize("flag", ["--output", "--plot"])
def test_tune_bad_output_path_fails_before_sweeping(disk: Path, flag: str) -> None:
    done = run_cli("tune", "--dir", disk, "--io-size", "4M", flag,
                   str(disk / "missing-dir" / "x.out"), "--no-progress")
    assert done.returncode == 2, done.stderr
    assert "directory does not exist" in done.stderr and "Traceback" not in done.stderr
    assert listing(disk) == []
