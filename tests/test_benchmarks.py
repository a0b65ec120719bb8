"""Smoke tests for the scripts in ``benchmarks/``: each runs at a tiny size in a subprocess,
exits 0, prints its figures and leaves no file behind; and ``benchmarks/_common.py``, which they
share, and the rule that they use aioswap's public API only.

bench_engine.py, bench_pinned.py, bench_swap.py, bench_dcp.py, bench_safetensors.py and
bench_stream.py are smoke-tested by their owners' test files.
"""
from __future__ import annotations

import ast
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TESTED_HERE = {"bench_formats.py", "bench_handle.py", "gpu_check.py", "bench_hf_offload.py",
               "bench_stripe.py", "bench_loaders.py"}
TESTED_ELSEWHERE = {"bench_engine.py", "bench_pinned.py", "bench_swap.py", "bench_dcp.py",
                    "bench_safetensors.py", "bench_small_io.py", "bench_stream.py"}
MINE = {"_common.py", "bench_engine.py", "bench_formats.py", "bench_pinned.py"}
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
    # _cold.py is bench_swap.py's and bench_safetensors.py's child (run by their smoke tests)
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - {"_common.py", "_cold.py"}
    assert TESTED_HERE <= scripts
    assert scripts <= TESTED_HERE | TESTED_ELSEWHERE, scripts - TESTED_HERE - TESTED_ELSEWHERE


def test_bench_formats(tmp_dir: Path, memlock_room: int | None) -> None:
    size = "8M" if memlock_room is None else "2M"   # its buffers locked under a normal user's
    done = run_script("bench_formats.py", "--dir", str(tmp_dir), "--size", size, "--repeat",
                      "1", cwd=tmp_dir)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    methods = ["aioswap (pinned, direct)", "python buffered", "torch.save / torch.load"]
    if shutil.which("fio"):
        methods.append("fio libaio")
    for method in methods:
        figures = table_row(out, method)
        assert len(figures) == 4, (method, out)
        assert all(v > 0 for v in figures[2:]), (method, figures)   # ratios: never 0.00
    assert table_row(out, "aioswap (pinned, direct)")[2:] == [1.0, 1.0]  # ratios to itself
    assert "GB/s = 10^9 bytes/s" in out and "aioswap / other" in out and "posix_fadvise" in out
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


def test_bench_handle(tmp_dir: Path, memlock_room: int | None) -> None:
    size = "8M" if memlock_room is None else "2M"   # its buffers locked under a normal user's
    done = run_script("bench_handle.py", "--dir", str(tmp_dir), "--size", size, "--repeat",
                      "1", "--no-deepspeed", cwd=tmp_dir)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for method in ("aioswap direct (pinned)", "aioswap bounce (unpinned)"):
        figures = table_row(out, method)
        assert len(figures) == 6, (method, out)
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


@pytest.mark.slow      # importing transformers in its process: 30-45 s on 2 cores
def test_bench_hf_offload(tmp_dir: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    done = run_script("bench_hf_offload.py", "--dir", str(tmp_dir), "--hidden", "64",
                      "--layers", "1", "--vocab", "256", "--repeat", "1", "--new-tokens", "2",
                      "--keys", "2000", "--json", cwd=tmp_dir)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for method in ("stock", "aioswap"):
        for figure in ("cold_forward_s", "cold_generate_s", "warm_forward_s"):
            assert report["figures"][method][figure]["median"] > 0
    assert set(report["ratios_stock_over_aioswap_time"]) == {
        "cold_forward_s", "cold_generate_s", "warm_forward_s"}
    assert report["loader_construction_s"]["keys"] == 2000
    # the drive read from the model's own files, the compute alone, and the bound from both
    assert report["drive_read_gbs"] > 0 and len(report["drive_read_gbs_rounds"]) == 1
    compute = report["figures"]["compute"]["compute_forward_s"]["median"]
    read_s = report["forward_read_bytes"] / (report["drive_read_gbs"] * 1e9)
    assert report["overlap_bound_s"]["forward_s"] == pytest.approx(max(compute, read_s))
    for method in ("stock", "aioswap"):
        assert report["ratios_bound_over_time"][method]["cold_forward"] > 0
    assert set(report["targets"]) == {
        "cold_forward_vs_bound", "limited_forward_vs_bound", "peak_rss_over_stock_layers",
        "limited_peak_rss_over_stock_layers", "cold_generate_vs_stock",
        "second_forward_vs_stock", "warm_forward_vs_stock"}
    for method, syncs in report["offload_state_dict_sync_calls"].items():
        if syncs is not None:          # strace installed: the files are made durable
            assert sum(syncs.values()) > 0, (method, syncs)
        assert report["figures"][method]["offload_state_dict_written_bytes"]["median"] > 0
    assert list(tmp_dir.iterdir()) == []


def _stripe_why_not() -> str | None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_stripe
    finally:
        sys.path.remove(str(BENCHMARKS))
    reason: str | None = bench_stripe.why_not()
    return reason


def _stripe_leftovers(base: Path, cgroup: str) -> list[str]:
    """Loops over images in ``base``, mounts under it, the cgroup: what a run left behind."""
    left = []
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    left += [line.split(":")[0] for line in loops.splitlines() if str(base) in line]
    with open("/proc/mounts") as f:
        left += [ln.split()[1] for ln in f if ln.split()[1].startswith(str(base))]
    if os.path.isdir(cgroup):
        left.append(cgroup)
    return left


def test_bench_stripe(tmp_dir: Path) -> None:
    """Root only: throttled loop drives, fio, btrfs raid0 and aioswap at tiny sizes; the
    rig (loops, mounts, cgroup, images) is gone afterwards, and torn down here if not."""
    reason = _stripe_why_not()
    if reason is not None:
        pytest.skip(f"bench_stripe.py: {reason}")
    base = tmp_dir / "rig"
    base.mkdir()
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "bench_stripe.py"), "--dir",
                             str(base), "--drives", "2", "--size", "4M", "--small", "256K",
                             "--cap", "200M", "--iops", "4000", "--ram-cpu", "512", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_dir)
    cgroup = f"/sys/fs/cgroup/blkio/aioswap-bench-{proc.pid}"
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
        left = _stripe_leftovers(base, cgroup)
    finally:
        proc.kill()
        proc.wait()
        for what in _stripe_leftovers(base, cgroup):        # never leave a rig behind
            if what.startswith("/dev/loop"):
                subprocess.run(["losetup", "-d", what], capture_output=True)
            elif what == cgroup:
                os.rmdir(cgroup)
            else:
                subprocess.run(["umount", "-l", what], capture_output=True)
    assert proc.returncode == 0, err
    assert left == [], left
    report = json.loads(out)
    ops = {(c["drives"], c["request"], c["op"]) for c in report["cases"]}
    assert {(2, 1 << 20, "write"), (2, 4096, "read"), (4, 1 << 20, "read, one at half")} <= ops
    for c in report["cases"]:
        assert c["aioswap"] > 0 and math.isfinite(c.get("vs_fio_sum", c.get("vs_caps_sum")))
    assert "GB/s = 10^9 bytes/s" in report["units"]
    assert not [p for p in base.iterdir() if p.suffix == ".img"]
    cpu = report["ram_cpu_us_per_read"]
    assert set(cpu) == {f"{f} {m}" for f in ("plain", "striped")
                        for m in ("sync", "burst x128", "window x128")}
    assert all(v > 0 for v in cpu.values())


# -- benchmarks/_common.py -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def common() -> object:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCHMARKS))
    return _common


@pytest.mark.slow          # a fresh process per load: ~1 min even at this size
def test_bench_loaders(tmp_dir: Path) -> None:
    """Every loader installed, cold and warm, at a tiny size: figures, ratios, JSON, and no
    file left behind."""
    done = run_script("bench_loaders.py", "--dir", str(tmp_dir), "--size", "8M", "--repeat",
                      "1", "--json", cwd=tmp_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert set(doc["modes"]) == {"cold", "warm"}
    for mode, m in doc["modes"].items():
        for name in ("aioswap", "aioswap-direct", "aioswap-buffered", "aioswap-sharded",
                     "aioswap-swap", "safetensors", "torch", "pread4"):
            v = m["loaders"][name]
            assert v["gbps"] > 0 and v["cpu_s_per_gb"] > 0 and v["peak_rss"] > 0, (mode, v)
        assert m["ratios"]["aioswap"]["torch"] > 0
        assert ("fio" in m["loaders"]) == (mode == "cold" and shutil.which("fio") is not None)
    for peer in ("tensorizer", "fastsafetensors", "runai"):
        assert (peer in doc["modes"]["cold"]["loaders"]) != (peer in doc["skipped"])
    if "hf-aioswap" not in doc["skipped"]:      # transformers installed: from_pretrained rows
        hf = doc["from_pretrained"]
        assert hf["logits_equal"] and hf["params_equal"] and hf["shards"] >= 3, hf
        for mode, m in doc["modes"].items():
            for name in ("hf-stock", "hf-aioswap"):
                assert m["loaders"][name]["gbps"] > 0, (mode, name)
            assert m["ratios"]["hf-aioswap"]["hf-stock"] > 0
    assert list(tmp_dir.iterdir()) == []


def test_common_scratch_file(common: object, tmp_dir: Path) -> None:
    c: object = common
    with c.scratch_file(str(tmp_dir), "x") as path:  # type: ignore[attr-defined]
        st = os.lstat(path)
        assert st.st_mode & 0o777 == 0o600 and os.path.basename(path).startswith(".aioswap-x-")
        Path(path).write_bytes(os.urandom(8192))
        assert c.drop_cache(path) <= 1.0  # type: ignore[attr-defined]
    assert list(tmp_dir.iterdir()) == []


def test_common_rounds_and_summaries(common: object) -> None:
    c: object = common
    assert list(c.orders(["a", "b", "c"], 4)) == [  # type: ignore[attr-defined]
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    s = c.summarize([1.0, 3.0, 2.0])  # type: ignore[attr-defined]
    assert (s.median, s.lo, s.hi, s.spread) == (2.0, 1.0, 3.0, 1.0)
    assert math.isnan(c.summarize([]).median)  # type: ignore[attr-defined]
    assert c.ratio(2.0, 1.0) == 2.0 and math.isnan(c.ratio(1.0, 0.0))  # type: ignore[attr-defined]


def test_common_table_states_its_units(common: object) -> None:
    c: object = common
    out = io.StringIO()
    c.print_table(["method", "write GB/s", "ratio"],  # type: ignore[attr-defined]
                  [["aioswap", 1.234, 1.0], ["other", 0.5, math.nan]], title=["t"],
                  notes=["n"], file=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "t" and lines[1].split() == ["method", "write", "GB/s", "ratio"]
    assert lines[2].split() == ["aioswap", "1.23", "1.00"] and lines[3].split()[-1] == "-"
    assert "GB/s = 10^9 bytes/s" in lines[4] and "aioswap / other" in lines[4]
    assert lines[5] == "note: n"


# the scripts that take --dir (add_common_args gives it to those that call it)
DIR_SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py")
                     if p.name != "_common.py"
                     and re.search(r"add_argument\(\s*\"--dir\"|add_common_args\(p", p.read_text()))


def test_the_dir_scripts_are_found() -> None:
    assert {"bench_stripe.py", "bench_swap.py", "bench_engine.py", "gpu_check.py"} <= \
        set(DIR_SCRIPTS)


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
@pytest.mark.parametrize("script", DIR_SCRIPTS)
def test_a_missing_dir_is_a_usage_error(script: str, tmp_path: Path) -> None:
    """``--dir X`` where X does not exist: one error line and exit status 2, not a traceback
    (bench_stripe.py failed so at its first drive image)."""
    missing = tmp_path / "no" / "such"
    done = run_script(script, "--dir", str(missing), cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        f"error: argument --dir: directory {str(missing)!r} does not exist"), done.stderr
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


def test_common_dir_arg(common: object, tmp_path: Path) -> None:
    import argparse
    check = common.dir_arg  # type: ignore[attr-defined]
    assert check(str(tmp_path)) == str(tmp_path)
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        check(str(tmp_path / "missing"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a directory"):
        check(str(tmp_path / "f"))
    if os.geteuid() != 0:           # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(argparse.ArgumentTypeError, match="is not writable"):
            check(str(ro))


def test_common_size_arg(common: object) -> None:
    import argparse
    parse = common.size_arg(4096)  # type: ignore[attr-defined]
    assert parse("1.5M") == 3 << 19
    with pytest.raises(argparse.ArgumentTypeError, match="at least 4 KiB"):
        parse("1000")


def _aioswap_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every ``import aioswap...`` / ``from aioswap... import name``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aioswap"):
            out += [(node.module or "", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("aioswap")]
    return out


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_benchmarks_use_public_api_only(script: str, request: pytest.FixtureRequest) -> None:
    """No private module or name of aioswap (``aioswap._aio.LockedMemory`` was one)."""
    for module, name in _aioswap_imports(BENCHMARKS / script):
        assert not any(part.startswith("_") for part in module.split(".")), (script, module)
        assert not name.startswith("_"), (script, module, name)


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")
                                           if p.name != "_common.py"))
def test_benchmarks_share_common(script: str, request: pytest.FixtureRequest) -> None:
    """Scratch files, the page cache and sizes come from _common, not from aioswap.cli."""
    used = _aioswap_imports(BENCHMARKS / script)
    assert not [u for u in used if u[0] == "aioswap.cli"], (script, used)
