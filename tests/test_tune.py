"""aioswap.tune: sweep points, logs, recommendation, searches, table and plot.

Everything but the last test runs without touching a drive: the sweep and search functions take
the measurement as a parameter, so synthetic drives stand in for real ones.
"""
from __future__ import annotations

import io
import json
import logging
import math
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

import aioswap
from aioswap.config import DEFAULT_CONFIG, AioConfig
from aioswap.errors import ConfigError
from aioswap.cli import UsageError, run_tune
from aioswap.tune import (Direction, Grid, Result, SweepPoint, TuneError, default_grid, fast_search,
                          format_table, grid_search, parse_logs, plot, recommend, score_of, sweep,
                          tune, write_log)
from aioswap.tune.measure import check_environment, run_point

MiB = 1 << 20


def from_throughput(point: SweepPoint, direction: Literal["read", "write"], gbps: float, *,
                    io_size: int = 1 << 30, use_gds: bool = False) -> Result:
    """A successful result moving ``io_size`` bytes at ``gbps`` GB/s (synthetic runs)."""
    return Result(point, direction, io_size, nbytes=io_size, seconds=io_size / (gbps * 1e9),
                  use_gds=use_gds)


def recommendation_json(config: AioConfig) -> str:
    return config.to_json(wrap=True)

# -- sweep point names -------------------------------------------------------------------------


def test_point_name_fields() -> None:
    p = SweepPoint.parse("single_overlap_bs1M_qd32_p8")
    assert p == SweepPoint(block_size=MiB, queue_depth=32, single_submit=True,
                           overlap_events=True, intra_op_parallelism=8)
    q = SweepPoint.parse("block_sequential_bs8M_qd128_p2")
    assert (q.block_size, q.queue_depth, q.intra_op_parallelism) == (8 * MiB, 128, 2)
    assert q.single_submit is False and q.overlap_events is False
    assert SweepPoint.parse("block_overlap_bs512K_qd4_p1.json").block_size == 512 << 10
    assert SweepPoint.parse("block_overlap_bs1G_qd4_p1").block_size == 1 << 30
    assert SweepPoint.parse("block_overlap_bs8192_qd4_p1").name == "block_overlap_bs8K_qd4_p1"


def test_every_grid_point_round_trips() -> None:
    names = set()
    for p in default_grid():
        assert SweepPoint.parse(p.name) == p
        names.add(p.name)
    assert len(names) == len(default_grid()) == 7 * 6 * 4 * 2 * 2


points = st.builds(SweepPoint, block_size=st.integers(1, 1 << 18).map(lambda n: n * 4096),
                   queue_depth=st.integers(1, 65535), single_submit=st.booleans(),
                   overlap_events=st.booleans(), intra_op_parallelism=st.integers(1, 256))


@given(points)
def test_point_name_round_trip(p: SweepPoint) -> None:
    assert SweepPoint.parse(p.name) == p
    assert SweepPoint.from_config(p.to_config()) == p


@pytest.mark.parametrize("name", ["single_overlap_bs1M_qd32", "both_overlap_bs1M_qd32_p8",
                                  "single_overlap_bs1X_qd32_p8", "", "single_overlap"])
def test_point_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="not a sweep point name"):
        SweepPoint.parse(name)


def test_point_bad_values_use_config_rules() -> None:
    with pytest.raises(ConfigError, match="block_size must be positive"):
        SweepPoint.parse("block_overlap_bs0_qd4_p1")
    with pytest.raises(ConfigError, match="queue_depth must be between 1 and 65535"):
        SweepPoint.parse("block_overlap_bs1M_qd0_p1")
    with pytest.raises(ConfigError, match="intra_op_parallelism must be between 1 and 256"):
        SweepPoint.parse("block_overlap_bs1M_qd4_p0")


def test_grids() -> None:
    full, quick = default_grid(), default_grid(quick=True)
    assert full.block_sizes[0] == 128 << 10 and full.block_sizes[-1] == 8 * MiB
    assert full.queue_depths == (4, 8, 16, 32, 64, 128)
    assert full.intra_op_parallelism == (1, 2, 4, 8)
    assert len(quick) == 72 and set(quick.points()) <= set(full.points())
    assert full.nearest(DEFAULT_CONFIG) == SweepPoint.from_config(DEFAULT_CONFIG)
    with pytest.raises(ValueError, match="no values for queue_depth"):
        Grid(block_sizes=(MiB,), queue_depths=(), intra_op_parallelism=(1,))


# -- synthetic logs -> recommendation ------------------------------------------------------------
def put_log(log_dir: Path, direction: str, name: str, gbps: float | None, *,
            use_gds: bool = False, error: str | None = None) -> Path:
    """Write a sweep log by hand, as a run would leave it (not through write_log)."""
    p = SweepPoint.parse(name)
    io_size = 400 * MiB
    record: dict[str, Any] = {
        "name": name, "block_size": p.block_size, "queue_depth": p.queue_depth,
        "intra_op_parallelism": p.intra_op_parallelism, "single_submit": p.single_submit,
        "overlap_events": p.overlap_events, "use_gds": use_gds, "direction": direction,
        "io_size": io_size, "bytes": 0 if gbps is None else io_size,
        "seconds": 0.0 if gbps is None else io_size / (gbps * 1e9),
        "gbps": gbps, "gibps": None if gbps is None else gbps * 1e9 / (1 << 30),
        "error": error,
    }
    path = log_dir / direction / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def printed_section(config: AioConfig) -> AioConfig:
    """What a user does with the printed JSON: feed it to the loader."""
    text = recommendation_json(config)
    assert '"true"' not in text and '"false"' not in text and "num_threads" not in text
    data = json.loads(text)
    assert list(data) == ["aio"] and set(data["aio"]) == set(DEFAULT_CONFIG.to_dict())
    return AioConfig.from_dict(data)


def assert_is_point(cfg: AioConfig, name: str, *, use_gds: bool = False) -> None:
    p = SweepPoint.parse(name)
    assert cfg.block_size == p.block_size
    assert cfg.queue_depth == p.queue_depth
    assert cfg.intra_op_parallelism == p.intra_op_parallelism
    assert cfg.single_submit is p.single_submit
    assert cfg.overlap_events is p.overlap_events
    assert cfg.use_gds is use_gds


PAIRS = [
    ("single_overlap_bs1M_qd32_p8", "block_sequential_bs8M_qd128_p2"),
    ("block_sequential_bs8M_qd128_p2", "single_overlap_bs1M_qd32_p8"),
    ("single_sequential_bs256K_qd16_p4", "block_overlap_bs2M_qd64_p1"),
    ("block_overlap_bs2M_qd64_p1", "single_sequential_bs256K_qd16_p4"),
]


@pytest.mark.parametrize("winner, loser", PAIRS)
def test_logs_to_printed_section(tmp_path: Path, winner: str, loser: str) -> None:
    for d in ("read", "write"):
        put_log(tmp_path, d, winner, 6.2)
        put_log(tmp_path, d, loser, 3.1)
    cfg = printed_section(recommend(parse_logs(tmp_path), direction="both"))
    assert_is_point(cfg, winner)
    if winner.startswith("single_overlap_bs1M_qd32_p8"):
        assert cfg.intra_op_parallelism == 8
        assert cfg.single_submit is True and cfg.overlap_events is True


@pytest.mark.parametrize("winner, loser", PAIRS[:2])
def test_gds_sweep_keeps_use_gds(tmp_path: Path, winner: str, loser: str) -> None:
    for d in ("read", "write"):
        put_log(tmp_path, d, winner, 9.0, use_gds=True)
        put_log(tmp_path, d, loser, 4.0, use_gds=True)
    results = parse_logs(tmp_path)
    assert all(r.use_gds for r in results)
    assert_is_point(printed_section(recommend(results)), winner, use_gds=True)
    assert_is_point(printed_section(recommend(results, use_gds=True)), winner, use_gds=True)
    assert '"use_gds": true' in recommendation_json(recommend(results))


@pytest.mark.parametrize("direction", ["read", "write"])
def test_single_direction_picks_by_that_direction(tmp_path: Path, direction: Direction) -> None:
    # Only `direction` was measured (--no-read / --no-write): that direction decides, and a
    # "both" pick has nothing to go on.
    a, b = PAIRS[0]
    put_log(tmp_path, direction, a, 2.0)
    put_log(tmp_path, direction, b, 5.0)
    results = parse_logs(tmp_path)
    assert_is_point(printed_section(recommend(results, direction=direction)), b)
    other: Direction = "write" if direction == "read" else "read"
    with pytest.raises(TuneError, match=f"no sweep point succeeded in {other}"):
        recommend(results, direction=other)
    with pytest.raises(TuneError, match="no sweep point succeeded in read and write"):
        recommend(results, direction="both")


def test_direction_chooses_among_both_measured(tmp_path: Path) -> None:
    reader, writer, balanced = ("single_overlap_bs1M_qd32_p8", "block_sequential_bs8M_qd128_p2",
                                "block_overlap_bs2M_qd64_p4")
    for name, r, w in ((reader, 7.0, 1.0), (writer, 1.0, 6.0), (balanced, 5.0, 4.5)):
        put_log(tmp_path, "read", name, r)
        put_log(tmp_path, "write", name, w)
    results = parse_logs(tmp_path)
    assert_is_point(printed_section(recommend(results, direction="read")), reader)
    assert_is_point(printed_section(recommend(results, direction="write")), writer)
    # "both" ranks by the harmonic mean: 1.75, 1.71, 4.74.
    assert_is_point(printed_section(recommend(results, direction="both")), balanced)
    scores = score_of(results, "both")
    assert scores[SweepPoint.parse(balanced)] == pytest.approx(2 / (1 / 5.0 + 1 / 4.5))


def test_corrupt_and_failed_logs_are_tolerated(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    good, bad = "block_overlap_bs1M_qd32_p4", "single_overlap_bs1M_qd32_p8"
    for d in ("read", "write"):
        put_log(tmp_path, d, good, 3.0)
    # A half-written log of what would have been the best point, a log of a failed point,
    # a record missing its timing, and a stray file naming nothing.
    (tmp_path / "read" / f"{bad}.json").write_text('{"name": "single_overlap_bs1M_qd3')
    put_log(tmp_path, "write", bad, 9.0)
    put_log(tmp_path, "read", "block_sequential_bs8M_qd128_p2", None,
            error="OSError: [Errno 28] No space left on device")
    put_log(tmp_path, "write", "block_sequential_bs8M_qd128_p2", 8.0)
    (tmp_path / "write" / "block_overlap_bs4M_qd8_p1.json").write_text(
        json.dumps({"direction": "write", "error": None}))
    (tmp_path / "read" / "notes.json").write_text("not json")
    with caplog.at_level(logging.WARNING, logger="aioswap"):
        results = parse_logs(tmp_path)
    assert "skipping sweep log" in caplog.text and "notes.json" in caplog.text
    failed = {(r.point.name, r.direction): r.error for r in results if not r.ok}
    assert "corrupt log" in str(failed[(bad, "read")])
    assert "No space left" in str(failed[("block_sequential_bs8M_qd128_p2", "read")])
    assert "bytes > 0 and seconds > 0" in str(failed[("block_overlap_bs4M_qd8_p1", "write")])
    assert_is_point(printed_section(recommend(results)), good)
    table = format_table(results)
    assert "FAILED" in table and "corrupt log" in table


def test_all_failed_is_a_clear_error(tmp_path: Path) -> None:
    for name in PAIRS[0]:
        for d in ("read", "write"):
            put_log(tmp_path, d, name, None, error="CuFileUnavailable: no GPU")
    with pytest.raises(TuneError, match=r"no sweep point succeeded in read and write "
                                        r"\(4 measurement\(s\).*CuFileUnavailable: no GPU"):
        recommend(parse_logs(tmp_path))
    with pytest.raises(TuneError, match="no sweep point succeeded"):
        recommend([])


def test_missing_log_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no sweep log directory"):
        parse_logs(tmp_path / "nope")


def test_write_log_round_trip(tmp_path: Path) -> None:
    p = SweepPoint.parse("single_overlap_bs1M_qd32_p8")
    results = [from_throughput(p, "write", 2.5, use_gds=True),
               Result(p, "read", 4 * MiB, nbytes=4 * MiB, seconds=0.0123, dirs=("/a", "/b")),
               Result.failed(SweepPoint.parse("block_overlap_bs1M_qd4_p1"), "read", MiB,
                             "OSError: boom")]
    for r in results:
        write_log(r, tmp_path)
    assert sorted(parse_logs(tmp_path), key=repr) == sorted(results, key=repr)
    record = json.loads((tmp_path / "write" / f"{p.name}.json").read_text())
    assert record["gbps"] == 2.5 and record["gibps"] == pytest.approx(2.5e9 / (1 << 30))
    assert record["single_submit"] is True and record["use_gds"] is True
    assert record["intra_op_parallelism"] == 8 and "num_threads" not in record


# -- synthetic drives: sweeps and searches without a disk ------------------------------------------
def synthetic_drive(*, peak: float = 6.5, knee_mib: float = 24.0, req_us: float = 25.0,
                    best_p: int = 4, ripple: float = 0.04,
                    salt: int = 0) -> Callable[[SweepPoint], float]:
    """A deterministic fake NVMe drive, in GB/s.

    Throughput saturates with the bytes in flight (block x depth x parallelism), pays a fixed
    cost per request (small blocks lose), has a best thread count (more threads contend on a
    small box), loses a little to single submits and to batch-wise reaping at low depth,
    drops past 512 MiB in flight (memory pressure), and carries a +-ripple bump per point
    (local structure that stops a naive hill climb).
    """
    def gbps(p: SweepPoint) -> float:
        inflight = p.block_size * p.queue_depth * p.intra_op_parallelism / MiB
        sat = inflight / (inflight + knee_mib)
        per_req = 1.0 / (1.0 + req_us * 1e-6 * peak * 1e9 / p.block_size
                         / math.sqrt(p.intra_op_parallelism))
        threads = math.exp(-0.2 * math.log2(p.intra_op_parallelism / best_p) ** 2)
        submit = 1.0 - 0.0015 * p.queue_depth if p.single_submit else 1.0
        overlap = 1.0 if p.overlap_events else 0.8 + 0.2 * (1 - 1 / p.queue_depth)
        memory = 0.85 if inflight > 512 else 1.0
        bump = 1 + ripple * (2 * zlib.crc32(f"{salt}:{p.name}".encode()) / 0xFFFFFFFF - 1)
        return peak * sat * per_req * threads * submit * overlap * memory * bump
    return gbps


DRIVES = [
    dict(),
    dict(knee_mib=4, best_p=1, salt=1),
    dict(knee_mib=200, best_p=8, req_us=60, salt=2),
    dict(peak=3.0, knee_mib=64, best_p=2, ripple=0.08, salt=3),
    dict(peak=8.4, knee_mib=16, req_us=66, best_p=4, salt=33),  # a hill climb stops at 91%
    dict(peak=11.3, knee_mib=4, req_us=41, best_p=4, salt=6),
]


@pytest.mark.parametrize("drive", DRIVES)
def test_fast_search_reaches_grid_best_in_a_fraction(drive: dict[str, Any]) -> None:
    f = synthetic_drive(**drive)
    grid = default_grid()
    full = grid_search(grid, f)
    fast = fast_search(grid, f)
    assert full.evaluations == len(grid) == 672
    assert full.best is not None and full.best_score is not None
    assert fast.best is not None and fast.best_score is not None
    assert fast.best_score >= 0.95 * full.best_score
    assert fast.evaluations <= 0.2 * len(grid)  # measured: 27..96 of 672 on these drives
    assert len({p for p, _ in fast.history}) == fast.evaluations  # nothing measured twice


def test_fast_search_over_many_drives() -> None:
    import random
    grid = default_grid()
    ratios, evals = [], []
    for salt in range(12):
        rnd = random.Random(salt)
        f = synthetic_drive(peak=rnd.uniform(1, 14), knee_mib=rnd.choice([2, 8, 32, 128, 256]),
                            req_us=rnd.uniform(5, 80), best_p=rnd.choice([1, 2, 4, 8]),
                            salt=salt)
        full, fast = grid_search(grid, f), fast_search(grid, f)
        assert full.best_score is not None and fast.best_score is not None
        ratios.append(fast.best_score / full.best_score)
        evals.append(fast.evaluations)
    assert min(ratios) >= 0.95
    assert sum(evals) / len(evals) <= 0.15 * len(grid)


def test_fast_search_skips_failed_points() -> None:
    f = synthetic_drive(best_p=8)

    def score(p: SweepPoint) -> float | None:
        return None if p.intra_op_parallelism == 8 or p.block_size == 8 * MiB else f(p)

    fast = fast_search(default_grid(), score)
    assert fast.best is not None
    assert fast.best.intra_op_parallelism != 8 and fast.best.block_size != 8 * MiB
    assert any(s is None for _, s in fast.history)
    assert fast_search(default_grid(quick=True), lambda p: None).best is None


def fake_measure(drive: Callable[[SweepPoint], float], direction: str = "both", *,
                 use_gds: bool = False, write_factor: float = 0.8) -> Any:
    """A `measure` for sweep/tune: reads at the drive's speed, writes a bit slower."""
    def measure(p: SweepPoint) -> list[Result]:
        out = []
        if direction in ("write", "both"):
            out.append(from_throughput(p, "write", drive(p) * write_factor,
                                              use_gds=use_gds))
        if direction in ("read", "both"):
            out.append(from_throughput(p, "read", drive(p), use_gds=use_gds))
        return out
    return measure


def test_sweep_logs_every_point(tmp_path: Path) -> None:
    grid = default_grid(quick=True)
    results = sweep(grid, fake_measure(synthetic_drive()), log_dir=tmp_path)
    assert len(results) == 2 * len(grid)
    assert len(list((tmp_path / "read").glob("*.json"))) == len(grid)
    assert len(list((tmp_path / "write").glob("*.json"))) == len(grid)
    assert sorted(parse_logs(tmp_path), key=repr) == sorted(results, key=repr)
    assert recommend(results) == recommend(parse_logs(tmp_path))


def test_sweep_tolerates_a_raising_measure(tmp_path: Path) -> None:
    f = fake_measure(synthetic_drive())

    def measure(p: SweepPoint) -> list[Result]:
        if p.queue_depth == 128:
            raise OSError(28, "No space left on device")
        return f(p)  # type: ignore[no-any-return]

    grid = default_grid(quick=True)
    results = sweep(grid, measure, log_dir=tmp_path)
    failed = [r for r in results if not r.ok]
    assert len(failed) == 2 * len(grid) // 3
    assert all("OSError: [Errno 28] No space left on device" == r.error for r in failed)
    assert recommend(results).queue_depth != 128


@pytest.mark.parametrize("search", ["grid", "fast"])
@pytest.mark.parametrize("direction", ["both", "read", "write"])
def test_tune_end_to_end(tmp_path: Path, search: Literal['grid', 'fast'],
                         direction: Direction) -> None:
    drive = synthetic_drive(best_p=2, salt=7)
    grid = default_grid(quick=True)
    report = tune([], 64 * MiB, direction=direction, search=search,
                  grid=grid, log_dir=tmp_path,
                  measure=fake_measure(drive, direction))
    assert report.best is not None and report.error is None
    assert report.grid_size == 72
    if search == "grid":
        assert report.evaluations == 72
    else:
        assert report.evaluations < 72
    n_dirs = 2 if direction == "both" else 1
    assert len(report.results) == n_dirs * report.evaluations
    assert recommend(parse_logs(tmp_path), direction=direction) == report.best


@pytest.mark.parametrize("direction", ["both", "read", "write"])
@pytest.mark.parametrize("use_gds", [False, True])
@pytest.mark.parametrize("as_json", [False, True])
def test_run_tune_prints_a_loadable_section(tmp_path: Path, direction: Direction,
                                            use_gds: bool, as_json: bool) -> None:
    # The winner: single submit + overlap at 1M/qd32/p8, as in the issue.
    winner = SweepPoint.parse("single_overlap_bs1M_qd32_p8")
    loser = SweepPoint.parse("block_sequential_bs8M_qd128_p2")
    grid = Grid(block_sizes=(MiB, 8 * MiB), queue_depths=(32, 128), intra_op_parallelism=(2, 8))
    speeds = {winner: 7.0, loser: 3.0}

    def drive(p: SweepPoint) -> float:
        return speeds.get(p, 1.0)

    out, err = io.StringIO(), io.StringIO()
    plot_path = tmp_path / "sweep.png" if "matplotlib" in sys.modules else None
    rc = run_tune(dirs=[str(tmp_path)], io_size=64 * MiB, direction=direction,
                  use_gds=use_gds, search="grid", log_dir=tmp_path / "logs",
                  output=tmp_path / "best.json", plot=plot_path, as_json=as_json,
                  progress=False, grid=grid,
                  measure=fake_measure(drive, direction, use_gds=use_gds),
                  stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    text = out.getvalue()
    if as_json:
        printed = json.loads(text)
        assert printed["evaluations"] == len(grid) and printed["stopped"] is False
        assert "10^9" in printed["units"]
    else:
        assert "GB/s = 10^9 bytes per second" in text and "bigger is better" in text
        assert text.splitlines()[2].startswith("* " + winner.name)
        printed = json.loads(text[text.index("\n{\n") + 1:])
    for cfg in (AioConfig.from_dict(printed), AioConfig.from_json(tmp_path / "best.json")):
        assert_is_point(cfg, winner.name, use_gds=use_gds)
        assert cfg.intra_op_parallelism == 8
    assert "logs in" in err.getvalue()
    assert len(parse_logs(tmp_path / "logs")) == len(grid) * (2 if direction == "both" else 1)


def test_a_first_point_that_fails_stops_the_sweep(tmp_path: Path) -> None:
    """A reason that fails every point (no GPU, no memory, a full disk) is reported once."""
    calls: list[SweepPoint] = []

    def measure(p: SweepPoint) -> list[Result]:
        calls.append(p)
        return [Result.failed(p, "write", MiB, "CuFileUnavailable: no CUDA device"),
                Result.failed(p, "read", MiB, "CuFileUnavailable: no CUDA device")]

    out, err = io.StringIO(), io.StringIO()
    rc = run_tune(dirs=[str(tmp_path)], io_size=MiB, direction="both", use_gds=True,
                  search="fast", log_dir=tmp_path, progress=False,
                  grid=default_grid(quick=True), measure=measure, stdout=out, stderr=err)
    assert rc == 1 and len(calls) == 1
    lines = [x for x in err.getvalue().splitlines() if "error" in x]
    assert len(lines) == 1, err.getvalue()
    assert "the first point failed (CuFileUnavailable: no CUDA device); stopped" in lines[0]
    assert "FAILED" in out.getvalue()
    report = tune([], MiB, grid=default_grid(quick=True), measure=measure, search="grid")
    assert report.stopped and report.evaluations == 1 and report.best is None


def test_a_later_failure_does_not_stop_the_sweep() -> None:
    f = fake_measure(synthetic_drive())

    def measure(p: SweepPoint) -> list[Result]:
        if p.queue_depth == 128:
            return [Result.failed(p, d, MiB, "OSError: boom") for d in ("write", "read")]
        return f(p)  # type: ignore[no-any-return]

    report = tune([], MiB, grid=default_grid(quick=True), measure=measure, search="grid")
    assert not report.stopped and report.evaluations == 72 and report.best is not None
    assert report.best.queue_depth != 128


def test_on_point_reports_progress() -> None:
    grid = Grid(block_sizes=(MiB,), queue_depths=(8, 32), intra_op_parallelism=(1,))
    seen: list[tuple[str, int, float | None]] = []
    sweep(grid, fake_measure(synthetic_drive()),
          on_point=lambda p, rs, best: seen.append((p.name, len(rs), best)))
    assert [n for n, _, _ in seen] == [p.name for p in grid]
    assert all(k == 2 for _, k, _ in seen)
    bests = [b for _, _, b in seen]
    assert all(b is not None for b in bests) and bests == sorted(bests)  # type: ignore


@pytest.mark.parametrize("as_json", [False, True])
def test_run_tune_without_a_log_dir_leaves_no_temporary_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool) -> None:
    """No --log-dir: no logs are written, so no /tmp/aioswap-tune-* is left behind, and no
    "logs in" names a directory that is not kept."""
    import tempfile
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    grid = Grid(block_sizes=(MiB,), queue_depths=(8, 32), intra_op_parallelism=(1,))
    out, err = io.StringIO(), io.StringIO()
    assert run_tune(dirs=[str(tmp_path)], io_size=MiB, direction="both", grid=grid,
                    progress=False, as_json=as_json, measure=fake_measure(synthetic_drive()),
                    stdout=out, stderr=err) == 0
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]
    assert "logs in" not in err.getvalue()
    if as_json:
        assert json.loads(out.getvalue())["log_dir"] is None
    else:
        assert 'best "aio" section' in out.getvalue()


def test_run_tune_draws_no_bar_off_a_terminal(tmp_path: Path) -> None:
    grid = Grid(block_sizes=(MiB,), queue_depths=(8, 32), intra_op_parallelism=(1,))
    out, err = io.StringIO(), io.StringIO()
    assert run_tune(dirs=[str(tmp_path)], io_size=MiB, direction="read", grid=grid,
                    log_dir=tmp_path, measure=fake_measure(synthetic_drive(), "read"),
                    stdout=out, stderr=err) == 0
    assert "aioswap tune (fast)" not in err.getvalue() and "\r" not in err.getvalue()


# -- showing ----------------------------------------------------------------------------------
def test_format_table() -> None:
    a, b, c = (SweepPoint.parse(n) for n in ("single_overlap_bs1M_qd32_p8",
                                              "block_sequential_bs8M_qd128_p2",
                                              "block_overlap_bs128K_qd4_p1"))
    results = [from_throughput(a, "read", 6.0), from_throughput(a, "write", 5.0),
               from_throughput(b, "read", 3.0), from_throughput(b, "write", 2.0),
               Result.failed(c, "write", MiB, "OSError: boom"),
               Result.failed(c, "read", MiB, "OSError: boom")]
    lines = format_table(results).splitlines()
    assert lines[0].split() == ["point", "read", "GB/s", "spread", "write", "GB/s", "spread",
                                "hmean", "GB/s", "status"]
    assert lines[1].startswith("* " + a.name) and "6.000" in lines[1] and "5.455" in lines[1]
    assert lines[2].startswith("  " + b.name)
    assert lines[3].startswith("  " + c.name) and lines[3].endswith("FAILED: OSError: boom")
    assert "3 point(s), 1 failed" in lines[-1] and "10^9 bytes" in lines[-1]
    assert "bigger is better" in lines[-1]
    half = format_table(results[:4] + [from_throughput(c, "read", 1.0), results[4]])
    assert half.splitlines()[3].endswith("FAILED write: OSError: boom")
    only_read = format_table([r for r in results if r.direction == "read"])
    assert "write GB/s" not in only_read and "hmean" not in only_read


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = sweep(default_grid(quick=True), fake_measure(synthetic_drive()))
    results.append(Result.failed(SweepPoint.parse("block_overlap_bs8M_qd4_p1"), "read", MiB,
                                 "boom"))
    out = plot(results, tmp_path / "sweep.png", title="aioswap tune: 64 MiB per point, /nvme")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread
    img = imread(str(out))
    h, w = img.shape[:2]
    assert 500 < w < 2500 and 300 < h < 2000, (w, h)   # two panels (parallelism 1, 2)
    red = (img[..., 0] > 0.9) & (img[..., 1] < 0.15) & (img[..., 2] < 0.15)
    assert red.sum() > 200  # the best cell's box (and the failed point's cross)
    with pytest.raises(ValueError, match="nothing to plot"):
        plot([], tmp_path / "empty.png")


def test_plot_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError, match=r"pip install 'aioswap\[plot\]'"):
        plot([], tmp_path / "x.png")


# -- a real sweep on the disk ------------------------------------------------------------------
def test_tune_argument_errors() -> None:
    with pytest.raises(ValueError, match="at least one directory"):
        tune([], MiB)
    with pytest.raises(ValueError, match="io_size must be positive"):
        tune(["."], 0)
    with pytest.raises(ValueError, match="smaller than the largest block size swept"):
        tune(["."], 1)  # the issue's --io-size 1, which recommended 4 MiB blocks
    with pytest.raises(ValueError, match="repeat must be at least 1"):
        tune(["."], MiB, repeat=0)
    with pytest.raises(ValueError, match="direction must be 'read', 'write' or 'both'"):
        recommend([], direction="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="search must be 'fast' or 'grid'"):
        tune(["."], MiB, search="random")  # type: ignore[arg-type]


needs_handle = pytest.mark.skipif(not hasattr(aioswap, "AioHandle"),
                                  reason="aioswap.AioHandle not built yet")


@needs_handle
@pytest.mark.parametrize("direction", ["both", "read", "write"])
def test_real_sweep_two_points(tmp_dir: Path, direction: Direction) -> None:
    dirs = [tmp_dir / "a", tmp_dir / "b"]  # two "drives": files moved concurrently
    for d in dirs:
        d.mkdir()
    grid = Grid(block_sizes=(256 << 10,), queue_depths=(8,), intra_op_parallelism=(1, 2),
                overlap_events=(True,), single_submit=(False,))
    report = tune(dirs, 4 * MiB, direction=direction, search="grid",
                  grid=grid, log_dir=tmp_dir / "logs")
    assert report.error is None, format_table(report.results)
    n = 2 * (2 if direction == "both" else 1)
    assert all(r.ok for r in report.results) and len(report.results) == n
    assert {r.direction for r in report.results} == \
        ({"read", "write"} if direction == "both" else {direction})
    assert all(r.nbytes == 4 * MiB for r in report.results)
    assert report.best is not None and report.best.block_size == 256 << 10
    assert all(not any(d.iterdir()) for d in dirs)  # data files removed
    assert len(parse_logs(tmp_dir / "logs")) == n


@needs_handle
def test_real_gds_point_without_gpu_is_a_failed_point(tmp_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from aioswap.tune import run_point
    p = SweepPoint.parse("block_overlap_bs1M_qd8_p1")
    results = run_point(p, [tmp_dir], 4 * MiB, use_gds=True)
    assert [r.direction for r in results] == ["write", "read"]
    assert all(not r.ok and r.error and r.use_gds for r in results)
    assert not any(tmp_dir.iterdir())


# -- measuring: honest figures, and reasons that fail every point ---------------------------------
@needs_handle
def test_run_point_repeats_and_keeps_every_round(tmp_dir: Path) -> None:
    p = SweepPoint.parse("block_overlap_bs256K_qd8_p1")
    results = run_point(p, [tmp_dir], 2 * MiB, repeat=3)
    assert [r.direction for r in results] == ["write", "read"]
    for r in results:
        assert r.ok and len(r.samples) == 3 and r.nbytes == 2 * MiB
        assert r.seconds == pytest.approx(sorted(r.samples)[1])
        assert r.spread is not None and r.spread >= 0
        rec = r.to_json_dict()
        assert len(rec["samples"]) == 3 and rec["spread"] == pytest.approx(r.spread, abs=1e-6)
        assert Result.from_json_dict(rec).samples == pytest.approx(r.samples)
    assert not any(tmp_dir.iterdir())


def test_tune_without_torch_stops_before_measuring(tmp_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(TuneError, match="tune needs torch: pip install torch"):
        check_environment(MiB)
    with pytest.raises(UsageError, match="tune needs torch"):
        run_tune(dirs=[str(tmp_dir)], io_size=8 * MiB, direction="both", progress=False,
                 log_dir=tmp_dir / "logs", stdout=io.StringIO(), stderr=io.StringIO())
    assert list(tmp_dir.iterdir()) == []


def test_gds_tune_without_a_gpu_stops_before_measuring() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(TuneError, match="--gds needs a CUDA device"):
        check_environment(MiB, use_gds=True)


def test_tune_refuses_more_memory_than_there_is() -> None:
    with pytest.raises(TuneError, match="of memory for its buffers .* use a smaller --io-size"):
        check_environment(1 << 50)
