"""The tuner behind ``aioswap tune``: sweep the ``"aio"`` knobs, keep logs, recommend a section.

- :mod:`~aioswap.tune.points`: :class:`SweepPoint` (one combination of knobs, named like
  ``single_overlap_bs1M_qd32_p8``), :class:`Grid` and :func:`default_grid`.
- :mod:`~aioswap.tune.search`: :func:`grid_search` and :func:`fast_search` (a coordinate search
  that measures a small fraction of the grid), :func:`sweep` and :func:`tune`.
- :mod:`~aioswap.tune.measure`: :func:`run_point` measures one point on real files: fsync'd
  writes, page cache dropped before reads, ``repeat`` rounds, median kept.
- :mod:`~aioswap.tune.results`: :class:`Result`, :func:`write_log`/:func:`parse_logs`,
  :func:`score_of` and :func:`recommend` (an :class:`~aioswap.AioConfig` that
  ``AioConfig.from_dict`` and DeepSpeed's loader read back unchanged).
- :mod:`~aioswap.tune.report`: :func:`format_table` and :func:`plot` (a heat map).

The command line around them lives in :mod:`aioswap.cli`. Throughput is decimal GB/s
(10**9 bytes per second) everywhere.
"""
from aioswap.errors import TuneError
from aioswap.tune.measure import drop_cache, run_point
from aioswap.tune.points import (AXES, DIRECTIONS, Direction, Grid, Measured, SearchKind,
                                 SweepPoint, default_grid)
from aioswap.tune.report import format_table, plot
from aioswap.tune.results import Result, parse_logs, recommend, score_of, write_log
from aioswap.tune.search import (Measure, OnPoint, Score, SearchResult, TuneReport, fast_search,
                                 grid_search, sweep, tune)

__all__ = [
    "AXES",
    "DIRECTIONS",
    "Direction",
    "Grid",
    "Measure",
    "Measured",
    "OnPoint",
    "Result",
    "Score",
    "SearchKind",
    "SearchResult",
    "SweepPoint",
    "TuneError",
    "TuneReport",
    "default_grid",
    "drop_cache",
    "fast_search",
    "format_table",
    "grid_search",
    "parse_logs",
    "plot",
    "recommend",
    "run_point",
    "score_of",
    "sweep",
    "tune",
    "write_log",
]
