"""Sweep points and grids: one combination of the ``"aio"`` knobs, and the values swept."""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, Literal

from aioswap._units import parse_size, short_size
from aioswap.config import DEFAULT_CONFIG, AioConfig

__all__ = ["AXES", "DIRECTIONS", "Direction", "Grid", "Measured", "SearchKind", "SweepPoint",
           "check_direction", "default_grid", "wanted"]

Direction = Literal["read", "write", "both"]
Measured = Literal["read", "write"]
SearchKind = Literal["grid", "fast"]

DIRECTIONS: tuple[Measured, ...] = ("read", "write")

_NAME_RE = re.compile(r"^(single|block)_(overlap|sequential)_bs(\d+[KMGT]?)_qd(\d+)_p(\d+)$",
                      re.IGNORECASE)


def check_direction(direction: str) -> None:
    """Raise ``ValueError`` unless ``direction`` is ``"read"``, ``"write"`` or ``"both"``."""
    if direction not in ("read", "write", "both"):
        raise ValueError(f"direction must be 'read', 'write' or 'both', got {direction!r}")


def wanted(direction: Direction) -> list[Measured]:
    """The directions reported for ``direction``, in the order they are measured."""
    if direction == "both":
        return ["write", "read"]
    return ["read"] if direction == "read" else ["write"]


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
                f"bs{short_size(self.block_size)}_qd{self.queue_depth}_"
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
        return cls(block_size=parse_size(bs, minimum=0), queue_depth=int(qd),
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


#: Axes in the order :func:`~aioswap.tune.fast_search` visits them: the numeric knobs first.
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
        both booleans). Otherwise the full 672-point grid: block sizes 128K..8M (powers of
        two), queue depths 4..128 (powers of two), parallelism 1, 2, 4, 8, both booleans.
    """
    if quick:
        return Grid(block_sizes=(256 << 10, 1 << 20, 4 << 20), queue_depths=(8, 32, 128),
                    intra_op_parallelism=(1, 2))
    return Grid(block_sizes=tuple((128 << 10) << i for i in range(7)),
                queue_depths=(4, 8, 16, 32, 64, 128), intra_op_parallelism=(1, 2, 4, 8))
