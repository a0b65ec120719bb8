"""The engine behind ``aioswap tune``: sweep the ``"aio"`` knobs, keep logs, recommend a section.

The pieces, each usable on its own:

- :class:`SweepPoint` - one combination of knobs, named like
  ``single_overlap_bs1M_qd32_p8`` (:attr:`SweepPoint.name`, :meth:`SweepPoint.parse`).
- :class:`Grid` and :func:`default_grid` - the values swept along each axis.
- :func:`run_point` - measures one point on real files with :class:`~aioswap.handle.AioHandle`
  (or ``GdsHandle`` for ``--gds``); any failure becomes a failed :class:`Result`.
- :func:`sweep`, :func:`grid_search`, :func:`fast_search`, :func:`tune` - run points (every
  one, or a coordinate search that measures a small fraction of the grid), with a progress bar
  and one JSON log per point and direction.
- :func:`parse_logs`, :func:`recommend`, :func:`recommendation_json` - from logs back to the
  best section, printed as ``{"aio": {...}}`` that :meth:`AioConfig.from_dict` and DeepSpeed's
  loader read unchanged (``intra_op_parallelism``, JSON booleans, ``use_gds`` kept).
- :func:`format_table`, :func:`plot` - what the CLI shows.

Throughput is reported in decimal GB/s (10**9 bytes per second); logs also hold GiB/s.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Optional, Union

from aioswap.config import DEFAULT_CONFIG, AioConfig
from aioswap.errors import TuneError

if TYPE_CHECKING:
    import torch

__all__ = [
    "AXES",
    "DIRECTIONS",
    "Direction",
    "Grid",
    "Measure",
    "Measured",
    "Result",
    "Score",
    "SearchKind",
    "SearchResult",
    "SweepPoint",
    "TuneError",
    "TuneReport",
    "default_grid",
    "fast_search",
    "format_size",
    "format_table",
    "grid_search",
    "main_from_cli",
    "parse_logs",
    "parse_size",
    "plot",
    "recommend",
    "recommendation_json",
    "run_point",
    "score_of",
    "sweep",
    "tune",
    "write_log",
]

logger = logging.getLogger("aioswap")

Direction = Literal["read", "write", "both"]
Measured = Literal["read", "write"]
SearchKind = Literal["grid", "fast"]
PathArg = Union[str, "os.PathLike[str]"]
#: Measures one point and returns one :class:`Result` per direction measured.
Measure = Callable[["SweepPoint"], Sequence["Result"]]
#: Scores one point (higher is better); ``None`` when the point failed.
Score = Callable[["SweepPoint"], Optional[float]]

DIRECTIONS: tuple[Measured, ...] = ("read", "write")
GB = 10**9
GiB = 1 << 30
_UNITS = (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))


# -- sizes -------------------------------------------------------------------------------------
def format_size(nbytes: int) -> str:
    """``1048576`` → ``"1M"``: the largest binary unit (K, M, G) that divides exactly."""
    for unit, scale in _UNITS:
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"400M"`` → ``419430400``. K/M/G/T are powers of 1024 (``"1MiB"``, ``"1mb"`` alike).

    Raises
    ------
    ValueError
        The text is not a non-negative integer with an optional unit.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 512K, 400M, 2G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    return int(m.group(1)) * scale[m.group(2).lower()]


# -- sweep points --------------------------------------------------------------------------------
_NAME_RE = re.compile(r"^(single|block)_(overlap|sequential)_bs(\d+[KMG]?)_qd(\d+)_p(\d+)$",
                      re.IGNORECASE)


@dataclass(frozen=True, order=True)
class SweepPoint:
    """One combination of the swept knobs (``use_gds`` is a property of the whole sweep).

    Parameters
    ----------
    block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism
        As in :class:`~aioswap.config.AioConfig`, and checked by the same rules.

    Raises
    ------
    ConfigError
        A value is out of range or of the wrong type.
    """

    block_size: int
    queue_depth: int
    single_submit: bool
    overlap_events: bool
    intra_op_parallelism: int

    def __post_init__(self) -> None:
        cfg = self.to_config()  # validates with AioConfig's rules and normalises ints
        for name in ("block_size", "queue_depth", "intra_op_parallelism"):
            object.__setattr__(self, name, getattr(cfg, name))

    @property
    def name(self) -> str:
        """``{single|block}_{overlap|sequential}_bs{size}_qd{N}_p{N}``, e.g.
        ``single_overlap_bs1M_qd32_p8``."""
        return (f"{'single' if self.single_submit else 'block'}_"
                f"{'overlap' if self.overlap_events else 'sequential'}_"
                f"bs{format_size(self.block_size)}_qd{self.queue_depth}_"
                f"p{self.intra_op_parallelism}")

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> SweepPoint:
        """Read a point back from its :attr:`name` (a ``.json`` suffix is allowed).

        Raises
        ------
        ValueError
            The name does not have the form above (``ConfigError`` for bad values).
        """
        stem = name[:-5] if name.endswith(".json") else name
        m = _NAME_RE.match(stem)
        if not m:
            raise ValueError(f"not a sweep point name: {name!r} (expected e.g. "
                             f"'single_overlap_bs1M_qd32_p8')")
        submit, overlap, bs, qd, par = m.groups()
        return cls(block_size=parse_size(bs), queue_depth=int(qd),
                   single_submit=submit.lower() == "single",
                   overlap_events=overlap.lower() == "overlap",
                   intra_op_parallelism=int(par))

    @classmethod
    def from_config(cls, config: AioConfig) -> SweepPoint:
        """The point of a config (``use_gds`` dropped)."""
        return cls(config.block_size, config.queue_depth, config.single_submit,
                   config.overlap_events, config.intra_op_parallelism)

    def to_config(self, *, use_gds: bool = False) -> AioConfig:
        """The ``"aio"`` section of this point."""
        return AioConfig(block_size=self.block_size, queue_depth=self.queue_depth,
                         intra_op_parallelism=self.intra_op_parallelism,
                         single_submit=self.single_submit, overlap_events=self.overlap_events,
                         use_gds=use_gds)

    def with_(self, **changes: Any) -> SweepPoint:
        """A copy with some knobs changed."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SweepPoint(**values)


#: Axes in the order :func:`fast_search` visits them: the numeric knobs that matter most first.
AXES = ("block_size", "queue_depth", "intra_op_parallelism", "overlap_events", "single_submit")


@dataclass(frozen=True)
class Grid:
    """The values swept along each axis; the full grid is their Cartesian product."""

    block_sizes: tuple[int, ...]
    queue_depths: tuple[int, ...]
    intra_op_parallelism: tuple[int, ...]
    overlap_events: tuple[bool, ...] = (True, False)
    single_submit: tuple[bool, ...] = (False, True)

    def __post_init__(self) -> None:
        for axis in AXES:
            values = self.values(axis)
            if not values:
                raise ValueError(f"the grid has no values for {axis}")
            if len(set(values)) != len(values):
                raise ValueError(f"the grid repeats a value for {axis}: {values}")

    def values(self, axis: str) -> tuple[Any, ...]:
        """The values of one axis, named as in :data:`AXES`."""
        attr = {"block_size": "block_sizes", "queue_depth": "queue_depths"}.get(axis, axis)
        values: tuple[Any, ...] = getattr(self, attr)
        return values

    def __len__(self) -> int:
        return math.prod(len(self.values(a)) for a in AXES)

    def __iter__(self) -> Iterator[SweepPoint]:
        return iter(self.points())

    def points(self) -> list[SweepPoint]:
        """Every point, block size varying slowest."""
        return [SweepPoint(block_size=bs, queue_depth=qd, single_submit=ss, overlap_events=ov,
                           intra_op_parallelism=p)
                for bs in self.block_sizes for qd in self.queue_depths
                for p in self.intra_op_parallelism for ov in self.overlap_events
                for ss in self.single_submit]

    def nearest(self, config: AioConfig = DEFAULT_CONFIG) -> SweepPoint:
        """The grid point closest to ``config`` on every axis (log scale for numbers)."""
        chosen: dict[str, Any] = {}
        for axis in AXES:
            want = getattr(config, axis)
            values = self.values(axis)
            if isinstance(want, bool):
                chosen[axis] = want if want in values else values[0]
            else:
                chosen[axis] = min(values, key=lambda v: (abs(math.log2(v / want)), v))
        return SweepPoint(**chosen)


def default_grid(quick: bool = False) -> Grid:
    """The grid ``aioswap tune`` sweeps.

    Parameters
    ----------
    quick : bool
        A 72-point grid (block sizes 256K, 1M, 4M; queue depths 8, 32, 128; parallelism 1, 2;
        both booleans) that a 2-core box sweeps at ``--io-size 64M`` in a minute or two.
        Otherwise the full 672-point grid: block sizes 128K..8M (powers of two), queue depths
        4..128 (powers of two), parallelism 1, 2, 4, 8, both booleans.
    """
    if quick:
        return Grid(block_sizes=(256 << 10, 1 << 20, 4 << 20), queue_depths=(8, 32, 128),
                    intra_op_parallelism=(1, 2))
    return Grid(block_sizes=tuple((128 << 10) << i for i in range(7)),
                queue_depths=(4, 8, 16, 32, 64, 128), intra_op_parallelism=(1, 2, 4, 8))


# -- results and logs ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    """One measurement: a point, one direction, how many bytes in how many seconds.

    ``error`` is ``None`` for a success and the reason otherwise (a failed point is kept and
    reported, never dropped). :attr:`gbps` is decimal GB/s (10**9 bytes/s).
    """

    point: SweepPoint
    direction: Measured
    io_size: int
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    use_gds: bool = False
    dirs: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether this measurement succeeded and moved bytes."""
        return self.error is None and self.nbytes > 0 and self.seconds > 0

    @property
    def gbps(self) -> float | None:
        """Throughput in GB/s (10**9 bytes per second), ``None`` when failed."""
        return self.nbytes / self.seconds / GB if self.ok else None

    @property
    def gibps(self) -> float | None:
        """Throughput in GiB/s (2**30 bytes per second), ``None`` when failed."""
        return self.nbytes / self.seconds / GiB if self.ok else None

    @classmethod
    def from_throughput(cls, point: SweepPoint, direction: Measured, gbps: float, *,
                        io_size: int = GiB, use_gds: bool = False) -> Result:
        """A successful result moving ``io_size`` bytes at ``gbps`` GB/s (for synthetic runs)."""
        return cls(point, direction, io_size, nbytes=io_size, seconds=io_size / (gbps * GB),
                   use_gds=use_gds)

    @classmethod
    def failed(cls, point: SweepPoint, direction: Measured, io_size: int, error: str, *,
               use_gds: bool = False, dirs: Sequence[str] = ()) -> Result:
        """A failed result carrying ``error``."""
        return cls(point, direction, io_size, error=error, use_gds=use_gds, dirs=tuple(dirs))

    def to_json_dict(self) -> dict[str, Any]:
        """The log record: the point's fields, direction, sizes, time, GB/s, GiB/s, error."""
        gbps, gibps = self.gbps, self.gibps
        return {
            "name": self.point.name,
            "block_size": self.point.block_size,
            "queue_depth": self.point.queue_depth,
            "intra_op_parallelism": self.point.intra_op_parallelism,
            "single_submit": self.point.single_submit,
            "overlap_events": self.point.overlap_events,
            "use_gds": self.use_gds,
            "direction": self.direction,
            "io_size": self.io_size,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "gbps": None if gbps is None else round(gbps, 6),
            "gibps": None if gibps is None else round(gibps, 6),
            "dirs": list(self.dirs),
            "error": self.error,
        }

    @classmethod
    def from_json_dict(cls, d: Mapping[str, Any], *, point: SweepPoint | None = None,
                       direction: Measured | None = None) -> Result:
        """Read a log record back (``point``/``direction`` fill in what the record lacks).

        Raises
        ------
        ValueError
            A field is missing or has the wrong type.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"a log record must be a JSON object, got {type(d).__name__}")
        knobs = ("block_size", "queue_depth", "single_submit", "overlap_events",
                 "intra_op_parallelism")
        if all(k in d for k in knobs):
            point = SweepPoint(**{k: d[k] for k in knobs})
        elif "name" in d:
            point = SweepPoint.parse(str(d["name"]))
        if point is None:
            raise ValueError("the record names no sweep point")
        direction = d.get("direction", direction)
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'read' or 'write', got {direction!r}")
        use_gds = d.get("use_gds", False)
        if not isinstance(use_gds, bool):
            raise ValueError(f"use_gds must be a JSON boolean, got {use_gds!r}")
        error = d.get("error")
        if error is not None and not isinstance(error, str):
            error = str(error)
        io_size, nbytes, seconds = d.get("io_size", 0), d.get("bytes", 0), d.get("seconds", 0.0)
        for key, value in (("io_size", io_size), ("bytes", nbytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0 \
                or not math.isfinite(seconds):
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
        if error is None and (nbytes == 0 or seconds == 0):
            raise ValueError("a successful record needs bytes > 0 and seconds > 0")
        dirs = d.get("dirs", [])
        return cls(point, direction, io_size, nbytes=nbytes, seconds=float(seconds),
                   error=error, use_gds=use_gds,
                   dirs=tuple(str(x) for x in dirs) if isinstance(dirs, list) else ())


def _log_path(log_dir: Path, point: SweepPoint, direction: Measured) -> Path:
    return log_dir / direction / f"{point.name}.json"


def write_log(result: Result, log_dir: PathArg) -> Path:
    """Write ``<log_dir>/<direction>/<point name>.json`` atomically; return its path."""
    path = _log_path(Path(log_dir), result.point, result.direction)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result.to_json_dict(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def parse_logs(log_dir: PathArg) -> list[Result]:
    """Read every ``<log_dir>/{read,write}/*.json`` log back.

    A corrupt or partial log (bad JSON, missing fields) becomes a failed :class:`Result`
    whose error says so, as long as its file name names a point; a file whose name and
    content both say nothing is skipped with a logged warning.

    Parameters
    ----------
    log_dir : path
        The directory :func:`sweep` / :func:`tune` wrote into.

    Returns
    -------
    list of Result
        Sorted by direction, then point name.

    Raises
    ------
    FileNotFoundError
        ``log_dir`` does not exist.
    """
    root = Path(log_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no sweep log directory at {str(root)!r}")
    out: list[Result] = []
    for direction in DIRECTIONS:
        sub = root / direction
        if not sub.is_dir():
            continue
        for path in sorted(sub.glob("*.json")):
            if path.name.startswith("."):
                continue  # a temporary file of an interrupted write_log
            try:
                point: SweepPoint | None = SweepPoint.parse(path.name)
            except ValueError:
                point = None
            try:
                with open(path, encoding="utf-8") as f:
                    record = json.load(f)
                out.append(Result.from_json_dict(record, point=point, direction=direction))
            except (ValueError, OSError) as e:
                if point is None:
                    logger.warning("skipping sweep log %s: %s", path, e)
                    continue
                out.append(Result.failed(point, direction, 0, f"corrupt log {path}: {e}"))
    return out


# -- recommendation ----------------------------------------------------------------------------
def _hmean(a: float, b: float) -> float:
    return 2.0 / (1.0 / a + 1.0 / b)


def score_of(results: Iterable[Result], direction: Direction) -> dict[SweepPoint, float]:
    """The score of every point measured in ``direction``, in GB/s.

    ``"read"``/``"write"``: that direction's throughput. ``"both"``: the harmonic mean of read
    and write throughput, which ranks points by the time to write and then read back the same
    bytes (``2 / (1/r + 1/w)``); a point counts only when both succeeded. Failed
    measurements never count. When a point was measured twice, the last measurement counts.
    """
    per: dict[SweepPoint, dict[str, float]] = {}
    for r in results:
        gbps = r.gbps
        slot = per.setdefault(r.point, {})
        if gbps is None:
            slot.pop(r.direction, None)
        else:
            slot[r.direction] = gbps
    scores: dict[SweepPoint, float] = {}
    for point, by_dir in per.items():
        if direction == "both":
            if "read" in by_dir and "write" in by_dir:
                scores[point] = _hmean(by_dir["read"], by_dir["write"])
        elif direction in by_dir:
            scores[point] = by_dir[direction]
    return scores


def _rank_key(item: tuple[SweepPoint, float]) -> tuple[float, int, int, int, str]:
    # Highest score first; on a tie the cheaper point (fewer threads, shallower queue,
    # smaller blocks) wins, and the name makes the order total.
    p, s = item
    return (-s, p.intra_op_parallelism, p.queue_depth, p.block_size, p.name)


def _check_direction(direction: str) -> None:
    if direction not in ("read", "write", "both"):
        raise ValueError(f"direction must be 'read', 'write' or 'both', got {direction!r}")


def recommend(results: Iterable[Result], *, direction: Direction = "both",
              use_gds: bool | None = None) -> AioConfig:
    """The best point of a sweep as an ``"aio"`` section.

    Parameters
    ----------
    results : iterable of Result
        From :func:`sweep`, :func:`tune` or :func:`parse_logs`.
    direction : {"read", "write", "both"}
        Pick by read throughput (``--no-write``), write throughput (``--no-read``), or by the
        harmonic mean of both (see :func:`score_of`). Only points measured in that direction
        count.
    use_gds : bool, optional
        The section's ``use_gds``; by default, whether the winning point was measured with
        GDS (so a sweep tuned with ``--gds`` recommends ``"use_gds": true``).

    Returns
    -------
    AioConfig

    Raises
    ------
    TuneError
        No point succeeded in that direction; the message gives the first errors seen.
    """
    _check_direction(direction)
    results = list(results)
    scores = score_of(results, direction)
    if not scores:
        wanted = DIRECTIONS if direction == "both" else (direction,)
        relevant = [r for r in results if r.direction in wanted]
        errors = sorted({r.error for r in relevant if r.error})
        detail = ("; errors: " + " | ".join(errors[:3]) + (" ..." if len(errors) > 3 else "")
                  if errors else "")
        what = "read and write" if direction == "both" else direction
        raise TuneError(f"no sweep point succeeded in {what} ({len(relevant)} measurement(s) "
                        f"in that direction, none usable){detail}")
    best, _ = min(scores.items(), key=_rank_key)
    if use_gds is None:
        use_gds = any(r.use_gds for r in results if r.point == best and r.ok)
    return best.to_config(use_gds=use_gds)


def recommendation_json(config: AioConfig, *, indent: int | None = 2) -> str:
    """``{"aio": {...}}`` with the six keys and JSON booleans (see :meth:`AioConfig.to_json`)."""
    return config.to_json(wrap=True, indent=indent)


# -- searching ---------------------------------------------------------------------------------
@dataclass
class SearchResult:
    """What a search found: the best point, its score, and every point it measured."""

    best: SweepPoint | None
    best_score: float | None
    history: list[tuple[SweepPoint, float | None]] = field(default_factory=list)

    @property
    def evaluations(self) -> int:
        """How many distinct points were measured."""
        return len(self.history)


class _Memo:
    """Measures each point once and keeps the order in which points were measured."""

    def __init__(self, score: Score) -> None:
        self._score = score
        self.cache: dict[SweepPoint, float | None] = {}
        self.history: list[tuple[SweepPoint, float | None]] = []

    def __call__(self, point: SweepPoint) -> float:
        if point not in self.cache:
            s = self._score(point)
            if s is not None and not (math.isfinite(s) and s >= 0):
                s = None
            self.cache[point] = s
            self.history.append((point, s))
        s = self.cache[point]
        return -math.inf if s is None else s

    def result(self) -> SearchResult:
        ok = [(p, s) for p, s in self.history if s is not None]
        if not ok:
            return SearchResult(None, None, self.history)
        best, score = min(ok, key=_rank_key)
        return SearchResult(best, score, self.history)


def grid_search(grid: Iterable[SweepPoint], score: Score) -> SearchResult:
    """Measure every point of ``grid``; ``score(point)`` returns GB/s or ``None`` if failed."""
    memo = _Memo(score)
    for point in grid:
        memo(point)
    return memo.result()


def fast_search(grid: Grid, score: Score, *, start: SweepPoint | AioConfig | None = None,
                rel_tol: float = 0.01, max_rounds: int = 6, beam: int = 3) -> SearchResult:
    """Coordinate search, then a best-first polish: a small fraction of the grid's runs.

    1. **Coordinate rounds.** From ``start`` (default: the grid point nearest the package
       defaults), scan one axis at a time (:data:`AXES`: block size, queue depth,
       parallelism, overlap, submit) over all of its values with the other knobs held, and
       move to the best value when it beats the current point by more than ``rel_tol``.
       Repeat until a round makes no move (or ``max_rounds``). Whole-axis scans step over
       dips along an axis; repeated rounds follow interactions between axes.
    2. **Polish.** Best-first local search: the ``beam`` best points measured so far get
       their grid neighbours measured (one step along one axis, or along two numeric axes
       at once to follow ridges such as "same bytes in flight, larger blocks, shallower
       queue"), until the ``beam`` best points have all been expanded. This escapes the
       local bumps a pure hill climb stops on.

    Every point is measured at most once. On the 672-point :func:`default_grid`, over 40
    synthetic drives with +-4% local ripple, this measured 63 points on average (at most
    113) and found the grid's best every time (see ``tests/test_tune.py``).

    Parameters
    ----------
    grid : Grid
    score : callable
        ``score(point) -> GB/s`` (higher is better), or ``None`` for a failed point.
    start : SweepPoint or AioConfig, optional
        Where the coordinate rounds begin.
    rel_tol : float
        Relative gain needed to move, so measurement noise does not steer the search.
    max_rounds : int
        Most coordinate rounds.
    beam : int
        Points kept in play by the polish; 1 is a plain hill climb.

    Returns
    -------
    SearchResult
        The best point measured, its score, and every point measured in order.
    """
    memo = _Memo(score)
    if start is None:
        current = grid.nearest(DEFAULT_CONFIG)
    elif isinstance(start, AioConfig):
        current = grid.nearest(start)
    else:
        current = start
    current_score = memo(current)

    def better(candidates: list[SweepPoint]) -> bool:
        nonlocal current, current_score
        scored = [(c, memo(c)) for c in candidates]
        if not scored:
            return False
        best, best_score = min(scored, key=_rank_key)
        threshold = current_score * (1.0 + rel_tol) if current_score > 0 else current_score
        if best_score > threshold:
            current, current_score = best, best_score
            return True
        return False

    for _ in range(max_rounds):
        moved = False
        for axis in AXES:
            here = getattr(current, axis)
            moved |= better([current.with_(**{axis: v}) for v in grid.values(axis)
                             if v != here])
        if not moved:
            break
    # Polish: a best-first local search. Measured points are ranked; the best `beam` of them
    # get their grid neighbours measured (one step along any axis, or along two numeric axes
    # at once, which follows ridges such as the same bytes in flight as larger blocks in a
    # shallower queue), until the best `beam` points all have been expanded. Keeping more
    # than one point in play steps over a local bump that would stop a pure hill climb.
    expanded: set[SweepPoint] = set()
    while True:
        ranked = sorted(((p, s) for p, s in memo.cache.items() if s is not None),
                        key=_rank_key)[:beam]
        todo = [p for p, _ in ranked if p not in expanded]
        if not todo:
            break
        expanded.add(todo[0])
        for n in _neighbours(grid, todo[0]):
            memo(n)
    return memo.result()


def _neighbours(grid: Grid, point: SweepPoint) -> list[SweepPoint]:
    """Grid points one step from ``point`` along one axis, or two numeric axes at once."""
    numeric = ("block_size", "queue_depth", "intra_op_parallelism")
    steps: dict[str, list[Any]] = {}
    for axis in numeric:
        values = sorted(grid.values(axis))
        here = getattr(point, axis)
        if here in values:
            i = values.index(here)
            steps[axis] = [values[i + d] for d in (-1, 1) if 0 <= i + d < len(values)]
        else:
            steps[axis] = []
    out: list[SweepPoint] = []
    for axis in numeric:
        out.extend(point.with_(**{axis: v}) for v in steps[axis])
    for axis in ("overlap_events", "single_submit"):
        out.extend(point.with_(**{axis: v}) for v in grid.values(axis)
                   if v != getattr(point, axis))
    for a_i, a in enumerate(numeric):
        for b in numeric[a_i + 1:]:
            out.extend(point.with_(**{a: va, b: vb}) for va in steps[a] for vb in steps[b])
    return out


# -- measuring on disk -------------------------------------------------------------------------
def _split(io_size: int, n: int) -> list[int]:
    """Split ``io_size`` into ``n`` parts, each a multiple of 4096 (the O_DIRECT unit)."""
    unit = 4096
    blocks = max(n, -(-io_size // unit))
    base, extra = divmod(blocks, n)
    return [(base + (1 if i < extra else 0)) * unit for i in range(n)]


def _new_handle(point: SweepPoint, use_gds: bool) -> Any:
    """An AioHandle (or GdsHandle) for ``point``, looked up at call time so that this module
    imports without torch or cuFile."""
    import aioswap
    cls: Any
    if use_gds:
        cls = getattr(aioswap, "GdsHandle", None)
        if cls is None:
            cls = importlib.import_module("aioswap.gds").GdsHandle
    else:
        from aioswap.handle import AioHandle
        cls = AioHandle
    return cls(block_size=point.block_size, queue_depth=point.queue_depth,
               single_submit=point.single_submit, overlap_events=point.overlap_events,
               intra_op_parallelism=point.intra_op_parallelism)


def _buffers(handle: Any, sizes: Sequence[int], use_gds: bool) -> list[torch.Tensor]:
    """One buffer per file: page-locked host memory, or device memory for GDS."""
    import torch
    if use_gds:
        if not torch.cuda.is_available():
            from aioswap.errors import CuFileUnavailable
            raise CuFileUnavailable("GDS tuning needs a CUDA device; torch sees none")
        bufs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
        for b in bufs:
            b.random_(0, 256)
        return bufs
    bufs = [handle.new_cpu_locked_tensor(n, torch.uint8) for n in sizes]
    for b in bufs:
        # Incompressible data: some drives compress or dedupe zeros.
        b.random_(0, 256)
    return bufs


class _SharedBuffers:
    """Buffers reused by every point of a sweep.

    Locking and filling hundreds of MB per point would cost more than measuring it.
    """

    def __init__(self, sizes: Sequence[int], use_gds: bool) -> None:
        self.sizes = list(sizes)
        self.use_gds = use_gds
        self._bufs: list[Any] | None = None
        self._owner: Any = None

    def get(self) -> list[Any]:
        if self._bufs is None:
            if self.use_gds:
                self._bufs = _buffers(None, self.sizes, True)
            else:
                from aioswap.handle import AioHandle
                self._owner = AioHandle()
                self._bufs = _buffers(self._owner, self.sizes, False)
        return self._bufs

    def close(self) -> None:
        bufs, self._bufs = self._bufs, None
        owner, self._owner = self._owner, None
        if owner is not None:
            for b in bufs or ():
                owner.free_cpu_locked_tensor(b)
            owner.close()


def _transfer(handle: Any, op: Measured, bufs: Sequence[Any], paths: Sequence[str],
              sizes: Sequence[int]) -> int:
    """Move every buffer to/from its file, concurrently when there are several."""
    method = handle.pwrite if op == "write" else handle.pread
    if len(paths) == 1:
        return int(method(bufs[0], paths[0], nbytes=sizes[0]))
    futures = [method(b, p, nbytes=n, async_op=True) for b, p, n in zip(bufs, paths, sizes)]
    handle.wait()
    return sum(int(f.result()) for f in futures)


def _wanted(direction: Direction) -> list[Measured]:
    """The directions reported for ``direction``, in the order they are measured."""
    if direction == "both":
        return ["write", "read"]
    return ["read"] if direction == "read" else ["write"]


def _describe_error(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def run_point(point: SweepPoint, dirs: Sequence[PathArg], io_size: int,
              direction: Direction = "both", *, use_gds: bool = False,
              buffers: Sequence[Any] | None = None) -> list[Result]:
    """Measure one point: write ``io_size`` bytes, then read them back, timing each.

    The bytes are split across one file per directory (each part a multiple of 4096), and
    the files of several directories are moved concurrently on one handle. The buffers are
    page-locked (:meth:`AioHandle.new_cpu_locked_tensor`), so the transfers go straight to
    the drive with ``O_DIRECT``; with ``use_gds`` they are CUDA buffers on a ``GdsHandle``,
    registered with cuFile when the handle offers it. The files are removed afterwards.

    Parameters
    ----------
    point : SweepPoint
    dirs : sequence of paths
        Directories on the drives to measure.
    io_size : int
        Total bytes per direction.
    direction : {"read", "write", "both"}
        What to report. ``"read"`` still writes the files first, untimed.
    use_gds : bool
        Measure the cuFile path.
    buffers : sequence of tensors, optional
        One buffer per directory of at least its share of ``io_size`` (page-locked host
        memory, or CUDA memory with ``use_gds``), reused across points by :func:`tune`;
        by default the point allocates and frees its own.

    Returns
    -------
    list of Result
        ``[write, read]`` for ``"both"``, else one. Any exception (no GPU, full disk, a
        refused parameter) gives failed results carrying its text; nothing is raised except
        ``KeyboardInterrupt``/``SystemExit``.
    """
    _check_direction(direction)
    if not dirs:
        raise ValueError("run_point needs at least one directory")
    if io_size <= 0:
        raise ValueError(f"io_size must be positive, got {io_size}")
    wanted = _wanted(direction)
    dir_names = tuple(os.fspath(d) for d in dirs)
    sizes = _split(io_size, len(dir_names))
    total = sum(sizes)
    tag = f"aioswap-tune-{os.getpid()}-{time.monotonic_ns()}"
    paths = [os.path.join(d, f"{tag}-{i}.bin") for i, d in enumerate(dir_names)]
    timings: dict[str, tuple[int, float]] = {}
    try:
        with _new_handle(point, use_gds) as handle:
            own = buffers is None
            bufs = _buffers(handle, sizes, use_gds) if buffers is None else list(buffers)
            if len(bufs) != len(sizes):
                raise ValueError(f"{len(bufs)} buffers for {len(sizes)} directories")
            registered: list[Any] = []
            pin = getattr(handle, "pin_device_tensor", None) if use_gds else None
            try:
                if pin is not None:
                    for b in bufs:
                        pin(b)
                        registered.append(b)
                for op in ("write", "read"):
                    if op == "read" and "read" not in wanted:
                        break
                    t0 = time.perf_counter()
                    moved = _transfer(handle, op, bufs, paths, sizes)
                    seconds = time.perf_counter() - t0
                    if moved != total:
                        raise OSError(f"{op} moved {moved} of {total} bytes")
                    timings[op] = (moved, seconds)
            finally:
                for b in registered:
                    handle.unpin_device_tensor(b)
                if own and not use_gds:
                    for b in bufs:
                        handle.free_cpu_locked_tensor(b)
    except Exception as exc:  # a failed point is reported, not raised
        error = _describe_error(exc)
        logger.info("sweep point %s failed: %s", point.name, error)
        return [Result(point, op, io_size, nbytes=timings[op][0], seconds=timings[op][1],
                       use_gds=use_gds, dirs=dir_names) if op in timings
                else Result.failed(point, op, io_size, error, use_gds=use_gds, dirs=dir_names)
                for op in wanted]
    finally:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    return [Result(point, op, io_size, nbytes=timings[op][0], seconds=timings[op][1],
                   use_gds=use_gds, dirs=dir_names) for op in wanted]


# -- sweeping ----------------------------------------------------------------------------------
def _progress_bar(total: int | None, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]
    return tqdm(total=total, desc=desc, unit="pt", disable=not enabled, leave=False,
                dynamic_ncols=True)


class _Runner:
    """Measures points: logs each result, advances the progress bar, scores by direction."""

    def __init__(self, measure: Measure, direction: Direction, log_dir: Path | None,
                 bar: Any) -> None:
        self.measure = measure
        self.direction = direction
        self.log_dir = log_dir
        self.bar = bar
        self.results: list[Result] = []
        self.best: float | None = None

    def measure_point(self, point: SweepPoint) -> list[Result]:
        try:
            results = list(self.measure(point))
        except Exception as exc:  # a measure function should not raise; tolerate it anyway
            wanted = _wanted(self.direction)
            results = [Result.failed(point, d, 0, _describe_error(exc)) for d in wanted]
        for r in results:
            if self.log_dir is not None:
                write_log(r, self.log_dir)
            if not r.ok:
                logger.warning("sweep point %s (%s) failed: %s", point.name, r.direction,
                               r.error)
        self.results.extend(results)
        score = score_of(results, self.direction).get(point)
        if score is not None and (self.best is None or score > self.best):
            self.best = score
        self.bar.update(1)
        if self.best is not None:
            self.bar.set_postfix_str(f"best {self.best:.2f} GB/s", refresh=False)
        return results

    def score(self, point: SweepPoint) -> float | None:
        return score_of(self.measure_point(point), self.direction).get(point)


def sweep(points: Iterable[SweepPoint], measure: Measure, *, direction: Direction = "both",
          log_dir: PathArg | None = None, progress: bool = True) -> list[Result]:
    """Measure every point, writing one log per point and direction.

    Parameters
    ----------
    points : iterable of SweepPoint
    measure : callable
        ``measure(point) -> [Result, ...]``, e.g.
        ``functools.partial(run_point, dirs=[...], io_size=..., direction=...)``.
    direction : {"read", "write", "both"}
        Used for the progress bar's best-so-far and for a measure that raises.
    log_dir : path, optional
        Where :func:`write_log` keeps the logs; ``None`` keeps none.
    progress : bool
        Show a tqdm progress bar (on stderr).

    Returns
    -------
    list of Result
        Every measurement, failed ones included.
    """
    _check_direction(direction)
    points = list(points)
    with _progress_bar(len(points), "aioswap tune", progress) as bar:
        runner = _Runner(measure, direction, None if log_dir is None else Path(log_dir), bar)
        for point in points:
            runner.measure_point(point)
    return runner.results


@dataclass
class TuneReport:
    """The outcome of :func:`tune`: every result, the recommendation, and the cost."""

    results: list[Result]
    best: AioConfig | None
    error: str | None
    evaluations: int
    grid_size: int
    search: SearchKind
    direction: Direction
    log_dir: Path | None

    def to_json_dict(self) -> dict[str, Any]:
        """``{"aio": best or null, "results": [...], ...}`` — ``AioConfig.from_dict`` reads it."""
        return {
            "aio": None if self.best is None else self.best.to_dict(),
            "error": self.error,
            "search": self.search,
            "direction": self.direction,
            "evaluations": self.evaluations,
            "grid_size": self.grid_size,
            "log_dir": None if self.log_dir is None else str(self.log_dir),
            "results": [r.to_json_dict() for r in self.results],
        }


def tune(dirs: Sequence[PathArg], io_size: int = 400 << 20, *, direction: Direction = "both",
         use_gds: bool = False, search: SearchKind = "fast", grid: Grid | None = None,
         log_dir: PathArg | None = None, progress: bool = True,
         measure: Measure | None = None) -> TuneReport:
    """Sweep a grid (all of it, or a :func:`fast_search` through it) and recommend a section.

    Parameters
    ----------
    dirs : sequence of paths
        Directories to measure in (ignored when ``measure`` is given).
    io_size : int
        Bytes per direction per point.
    direction : {"read", "write", "both"}
        What to measure and pick by.
    use_gds : bool
        Measure with ``GdsHandle``; the recommendation then has ``"use_gds": true``.
    search : {"fast", "grid"}
        ``"grid"`` measures every point; ``"fast"`` runs :func:`fast_search`.
    grid : Grid, optional
        Default :func:`default_grid`.
    log_dir : path, optional
        Keep one log per point and direction here.
    progress : bool
        Show a progress bar.
    measure : callable, optional
        Replaces :func:`run_point` (tests, or other measurement back ends).

    Returns
    -------
    TuneReport
        ``best`` is ``None`` and ``error`` says why when no point succeeded.
    """
    _check_direction(direction)
    if search not in ("fast", "grid"):
        raise ValueError(f"search must be 'fast' or 'grid', got {search!r}")
    grid = default_grid() if grid is None else grid
    stack = contextlib.ExitStack()
    if measure is None:
        dir_list = list(dirs)
        if not dir_list:
            raise ValueError("tune needs at least one directory to measure in")
        if io_size <= 0:
            raise ValueError(f"io_size must be positive, got {io_size}")
        shared = _SharedBuffers(_split(io_size, len(dir_list)), use_gds)
        stack.callback(shared.close)

        def measure_disk(point: SweepPoint) -> list[Result]:
            try:
                bufs: list[Any] | None = shared.get()
            except Exception:  # let the point allocate its own and record why it fails
                bufs = None
            return run_point(point, dir_list, io_size, direction, use_gds=use_gds,
                             buffers=bufs)

        measure = measure_disk
    log_path = None if log_dir is None else Path(log_dir)
    total = len(grid) if search == "grid" else None
    with stack, _progress_bar(total, f"aioswap tune ({search})", progress) as bar:
        runner = _Runner(measure, direction, log_path, bar)
        if search == "grid":
            found = grid_search(grid, runner.score)
        else:
            found = fast_search(grid, runner.score)
    best: AioConfig | None
    try:
        best = recommend(runner.results, direction=direction, use_gds=use_gds)
        error = None
    except TuneError as e:
        best, error = None, str(e)
    return TuneReport(runner.results, best, error, found.evaluations, len(grid), search,
                      direction, log_path)


# -- showing -----------------------------------------------------------------------------------
def format_table(results: Iterable[Result], *, direction: Direction | None = None) -> str:
    """A text table of the sweep: one row per point, best first, failed points last.

    Columns are read and write GB/s (decimal: 10**9 bytes/s, as the header says) for the
    directions measured, and for both directions their harmonic mean, which ranks the rows.
    The recommended row is marked ``*``.
    """
    results = list(results)
    per: dict[SweepPoint, dict[str, Result]] = {}
    for r in results:
        per.setdefault(r.point, {})[r.direction] = r
    measured = [d for d in DIRECTIONS if any(r.direction == d for r in results)]
    if direction is None:
        direction = "both" if len(measured) == 2 else (measured[0] if measured else "both")
    scores = score_of(results, direction)
    ranked = sorted(scores.items(), key=_rank_key)
    order = [p for p, _ in ranked] + sorted(p for p in per if p not in scores)
    cols = [d for d in measured]
    headers = [f"{d} GB/s" for d in cols]
    if direction == "both":
        headers.append("hmean GB/s")
    width = max([len("point")] + [len(p.name) for p in per]) + 2
    lines = [
        "  " + "point".ljust(width) + "".join(h.rjust(12) for h in headers) + "  status",
    ]
    for i, p in enumerate(order):
        mark = "* " if i == 0 and p in scores else "  "
        cells = []
        errors = []
        for d in cols:
            res = per[p].get(d)
            g = None if res is None else res.gbps
            cells.append("-" if g is None else f"{g:.3f}")
            if res is not None and res.error:
                errors.append(f"{d}: {res.error}")
        if direction == "both":
            cells.append(f"{scores[p]:.3f}" if p in scores else "-")
        if not errors:
            status = "ok"
        elif len(errors) == len(cols) and len({e.split(": ", 1)[1] for e in errors}) == 1:
            status = "FAILED: " + errors[0].split(": ", 1)[1]  # the same error both ways
        else:
            status = "FAILED " + "; ".join(errors)
        lines.append(mark + p.name.ljust(width) + "".join(c.rjust(12) for c in cells)
                     + "  " + status)
    n_failed = len(per) - len(scores)
    lines.append(f"{len(per)} point(s), {n_failed} failed. GB/s = 10^9 bytes per second "
                 f"(1 GB/s = 0.931 GiB/s)"
                 + ("; hmean = harmonic mean of read and write" if direction == "both" else ""))
    return "\n".join(lines)


def plot(results: Iterable[Result], path: PathArg, *, title: str | None = None) -> Path:
    """Draw throughput over the sweep points, in measurement order, to an image file.

    Needs matplotlib (``pip install aioswap[plot]``). It uses the Agg canvas directly, so it
    neither needs a display nor touches pyplot's global state.

    Raises
    ------
    ImportError
        matplotlib is not installed; the message names the extra to install.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("aioswap tune --plot needs matplotlib: pip install 'aioswap[plot]' "
                          "(or pip install matplotlib)") from e
    results = list(results)
    points: list[SweepPoint] = []
    for r in results:
        if r.point not in points:
            points.append(r.point)
    fig = Figure(figsize=(max(6.0, 0.25 * len(points) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(len(points)))
    for d, marker in (("write", "s"), ("read", "o")):
        by_point = {r.point: r.gbps for r in results if r.direction == d}
        if not by_point:
            continue
        ys = [by_point.get(p) for p in points]
        ax.plot(xs, [math.nan if y is None else y for y in ys], marker=marker, linestyle="-",
                label=f"{d} GB/s")
        failed = [x for x, p, y in zip(xs, points, ys) if p in by_point and y is None]
        if failed:
            ax.plot(failed, [0.0] * len(failed), "x", color="red",
                    label=f"{d} failed")
    ax.set_xticks(xs)
    ax.set_xticklabels([p.name for p in points], rotation=90, fontsize=6)
    ax.set_ylabel("GB/s (10^9 bytes/s)")
    ax.set_xlabel("sweep point (in measurement order)")
    ax.set_title(title or "aioswap tune")
    ax.grid(True, alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.savefig(out)
    return out


_plot_results = plot  # main_from_cli's ``plot`` argument shadows the function


def main_from_cli(*, dirs: Sequence[PathArg], io_size: int, direction: Direction,
                  use_gds: bool = False, search: SearchKind = "fast",
                  log_dir: PathArg | None = None, output: PathArg | None = None,
                  plot: PathArg | None = None, as_json: bool = False, progress: bool = True,
                  grid: Grid | None = None, measure: Measure | None = None,
                  stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Run ``aioswap tune`` and write what the command shows; return its exit status.

    This is the CLI's layer (the only place in this module that writes to streams): the
    results table then the best ``{"aio": {...}}`` section on ``stdout`` (or one JSON
    document with ``as_json``), notes on ``stderr``. Without ``log_dir`` the logs go to a
    fresh temporary directory, whose path is shown. Returns 0, or 1 when no point succeeded.
    """
    import sys
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    if log_dir is None:
        log_dir = tempfile.mkdtemp(prefix="aioswap-tune-")
    report = tune(dirs, io_size, direction=direction, use_gds=use_gds, search=search, grid=grid,
                  log_dir=log_dir, progress=progress, measure=measure)
    if as_json:
        out.write(json.dumps(report.to_json_dict(), indent=2) + "\n")
    else:
        out.write(format_table(report.results, direction=direction) + "\n")
        if report.best is not None:
            out.write(f"\nbest \"aio\" section ({report.evaluations} of {report.grid_size} "
                      f"grid points measured, picked by {_picked_by(direction)}):\n")
            out.write(recommendation_json(report.best) + "\n")
    err.write(f"aioswap tune: logs in {report.log_dir}\n")
    if report.best is None:
        err.write(f"aioswap tune: error: {report.error}\n")
        return 1
    if output is not None:
        Path(output).write_text(recommendation_json(report.best) + "\n", encoding="utf-8")
    if plot is not None:
        _plot_results(report.results, plot)
    return 0


def _picked_by(direction: Direction) -> str:
    return {"read": "read GB/s", "write": "write GB/s",
            "both": "harmonic mean of read and write GB/s"}[direction]

