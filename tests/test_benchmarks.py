"""Smoke tests for the scripts in ``benchmarks/``: each runs at a tiny size in a subprocess,
exits 0, prints its figures and leaves no file behind.

bench_engine.py, bench_pinned.py and bench_swap.py are smoke-tested by their owners' test files.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TESTED_HERE = {"bench_formats.py", "bench_handle.py", "gpu_check.py"}
TESTED_ELSEWHERE = {"bench_engine.py", "bench_pinned.py", "bench_swap.py"}
TIMEOUT = 300
NUMBER = r"\d+\.\d\d"


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True,
                          text=True, cwd=cwd, timeout=TIMEOUT, check=False)


def table_row(out: str, method: str) -> list[float]:
    """The figures on the table line that starts with ``method``."""
    line = next((x for x in out.splitlines() if x.startswith(method)), None)
    assert line is not None, (method, out)
    return [float(v) for v in re.findall(NUMBER, line[len(method):])]


def test_every_script_is_smoke_tested() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    assert TESTED_HERE <= scripts
    assert scripts <= TESTED_HERE | TESTED_ELSEWHERE, scripts - TESTED_HERE - TESTED_ELSEWHERE


def test_bench_formats(tmp_dir: Path) -> None:
    done = run_script("bench_formats.py", "--dir", str(tmp_dir), "--size", "8M", "--repeat",
                      "1", cwd=tmp_dir)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    methods = ["aioswap (pinned, direct)", "python buffered", "torch.save / torch.load"]
    if shutil.which("fio"):
        methods.append("fio libaio")
    for method in methods:
        figures = table_row(out, method)
        assert len(figures) == 4, (method, out)
        assert all(v >= 0 for v in figures)
    assert table_row(out, "aioswap (pinned, direct)")[2:] == [1.0, 1.0]  # ratios to itself
    assert "10^9 bytes per second" in out and "posix_fadvise" in out
    assert "100% of the aligned bytes direct" in out
    assert list(tmp_dir.iterdir()) == []


def test_bench_formats_json(tmp_dir: Path) -> None:
    done = run_script("bench_formats.py", "--dir", str(tmp_dir), "--size", "4M", "--repeat",
                      "2", "--json", "--no-fio", cwd=tmp_dir)
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert res["size_bytes"] == 4 << 20 and res["repeat"] == 2
    assert res["aioswap_direct_share"] == 1.0
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == ["aioswap (pinned, direct)", "python buffered",
                          "torch.save / torch.load"]
    ref = rows["aioswap (pinned, direct)"]
    for r in rows.values():
        for d in ("write", "read"):
            assert len(r[f"{d}_GBps_all"]) == 2
            assert math.isfinite(r[f"{d}_GBps"]) and r[f"{d}_GBps"] > 0
            assert r[f"{d}_GBps"] == pytest.approx(statistics.median(r[f"{d}_GBps_all"]))
            assert r[f"aioswap_vs_{d}"] == pytest.approx(ref[f"{d}_GBps"] / r[f"{d}_GBps"])
    assert "fio left out (--no-fio)" in res["notes"]
    assert list(tmp_dir.iterdir()) == []


def test_bench_formats_odd_size(tmp_dir: Path) -> None:
    """Sizes that fill no aligned block still round-trip; fio (1 MiB blocks) is left out."""
    done = run_script("bench_formats.py", "--dir", str(tmp_dir), "--size", "1000",
                      "--repeat", "1", cwd=tmp_dir)
    assert done.returncode == 0, done.stderr
    assert "python buffered" in done.stdout
    assert list(tmp_dir.iterdir()) == []


def test_bench_handle(tmp_dir: Path) -> None:
    done = run_script("bench_handle.py", "--dir", str(tmp_dir), "--size", "8M", "--repeat",
                      "1", "--no-deepspeed", cwd=tmp_dir)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for method in ("aioswap direct (pinned)", "aioswap bounce (unpinned)"):
        figures = table_row(out, method)
        assert len(figures) == 6 and all(v >= 0 for v in figures), (method, out)
    assert table_row(out, "aioswap direct (pinned)")[4:] == [1.0, 1.0]
    if shutil.which("fio"):
        assert len(table_row(out, "fio libaio")) == 6
    assert "GB/s = 10^9 B/s" in out
    assert list(tmp_dir.iterdir()) == []


def test_gpu_check(tmp_dir: Path) -> None:
    import torch
    if not torch.cuda.is_available():
        done = run_script("gpu_check.py", "--dir", str(tmp_dir), "--size", "8M", cwd=tmp_dir)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert "no CUDA device" in done.stdout
        assert "Traceback" not in done.stderr
    else:
        done = run_script("gpu_check.py", "--dir", str(tmp_dir), "--size", "8M",
                          "--allow-no-cufile", cwd=tmp_dir)
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert len(table_row(done.stdout, "CPU pinned direct (AioHandle)")) == 4
        assert len(table_row(done.stdout, "CUDA bounce (AioHandle)")) == 4
        assert "MISMATCH" not in done.stdout
    assert list(tmp_dir.iterdir()) == []
