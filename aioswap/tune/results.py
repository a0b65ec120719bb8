"""Measurements, their logs, scores and the recommendation.

Throughput is decimal GB/s (10**9 bytes per second); logs also hold GiB/s. A point measured
with ``repeat`` rounds keeps every round's time; its figure is the median round and its spread
is ``(slowest - fastest) / median`` of the rounds' throughput.
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from aioswap._units import GB
from aioswap.config import AioConfig
from aioswap.errors import TuneError
from aioswap.tune.points import DIRECTIONS, Direction, Measured, SweepPoint, check_direction

__all__ = ["PathArg", "Result", "parse_logs", "rank_key", "recommend", "score_of", "write_log"]

logger = logging.getLogger("aioswap")

PathArg = Union[str, "os.PathLike[str]"]
GiB = 1 << 30


@dataclass(frozen=True)
class Result:
    """One measurement: a point, one direction, how many bytes in how many seconds.

    ``seconds`` is the median of ``samples`` (one time per round) when there are several.
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
    samples: tuple[float, ...] = ()

    @classmethod
    def timed(cls, point: SweepPoint, direction: Measured, io_size: int, nbytes: int,
              samples: Sequence[float], *, use_gds: bool = False,
              dirs: Sequence[str] = ()) -> Result:
        """A success moving ``nbytes`` per round, ``samples`` seconds each (median kept)."""
        secs = tuple(float(s) for s in samples)
        return cls(point, direction, io_size, nbytes=nbytes, seconds=statistics.median(secs),
                   use_gds=use_gds, dirs=tuple(dirs), samples=secs)

    @classmethod
    def failed(cls, point: SweepPoint, direction: Measured, io_size: int, error: str, *,
               use_gds: bool = False, dirs: Sequence[str] = ()) -> Result:
        """A failed result carrying ``error``."""
        return cls(point, direction, io_size, error=error, use_gds=use_gds, dirs=tuple(dirs))

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

    @property
    def spread(self) -> float | None:
        """``(fastest - slowest) / median`` of the rounds' GB/s; ``None`` with under 2 rounds."""
        if not self.ok or len(self.samples) < 2 or min(self.samples) <= 0:
            return None
        rates = [self.nbytes / s for s in self.samples]
        return (max(rates) - min(rates)) / statistics.median(rates)

    def to_json_dict(self) -> dict[str, Any]:
        """The log record: the point's fields, direction, sizes, times, GB/s, GiB/s, error."""
        gbps, gibps, spread = self.gbps, self.gibps, self.spread
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
            "samples": list(self.samples),
            "gbps": None if gbps is None else round(gbps, 6),
            "gibps": None if gibps is None else round(gibps, 6),
            "spread": None if spread is None else round(spread, 6),
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
        samples = d.get("samples", [])
        if not isinstance(samples, list):
            raise ValueError(f"samples must be a list of seconds, got {samples!r}")
        for value in (seconds, *samples):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                    or not math.isfinite(value):
                raise ValueError(f"seconds must be non-negative numbers, got {value!r}")
        if error is None and (nbytes == 0 or seconds == 0):
            raise ValueError("a successful record needs bytes > 0 and seconds > 0")
        dirs = d.get("dirs", [])
        return cls(point, direction, io_size, nbytes=nbytes, seconds=float(seconds),
                   error=error, use_gds=use_gds,
                   dirs=tuple(str(x) for x in dirs) if isinstance(dirs, list) else (),
                   samples=tuple(float(s) for s in samples))


def _log_path(log_dir: Path, point: SweepPoint, direction: Measured) -> Path:
    return log_dir / direction / f"{point.name}.json"


def write_log(result: Result, log_dir: PathArg) -> Path:
    """Write ``<log_dir>/<direction>/<point name>.json`` atomically; return its path."""
    path = _log_path(Path(log_dir), result.point, result.direction)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(result.to_json_dict(), indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def parse_logs(log_dir: PathArg) -> list[Result]:
    """Read every ``<log_dir>/{read,write}/*.json`` log back.

    A corrupt or partial log (bad JSON, missing fields) becomes a failed :class:`Result`
    whose error says so, as long as its file name names a point; a file whose name and
    content both say nothing is skipped with a logged warning.

    Parameters
    ----------
    log_dir : path
        The directory :func:`~aioswap.tune.sweep` / :func:`~aioswap.tune.tune` wrote into.

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


def rank_key(item: tuple[SweepPoint, float]) -> tuple[float, int, int, int, str]:
    """Sort key of ``(point, score)``: highest score first; on a tie the cheaper point (fewer
    threads, shallower queue, smaller blocks) wins, and the name makes the order total."""
    p, s = item
    return (-s, p.intra_op_parallelism, p.queue_depth, p.block_size, p.name)


def recommend(results: Iterable[Result], *, direction: Direction = "both",
              use_gds: bool | None = None) -> AioConfig:
    """The best point of a sweep as an ``"aio"`` section.

    Parameters
    ----------
    results : iterable of Result
        From :func:`~aioswap.tune.sweep`, :func:`~aioswap.tune.tune` or :func:`parse_logs`.
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
    check_direction(direction)
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
    best, _ = min(scores.items(), key=rank_key)
    if use_gds is None:
        use_gds = any(r.use_gds for r in results if r.point == best and r.ok)
    return best.to_config(use_gds=use_gds)
