"""What ``aioswap tune`` shows: a table of the sweep and a heat map of it."""
from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path

from aioswap._units import short_size
from aioswap.tune.points import DIRECTIONS, Direction, SweepPoint
from aioswap.tune.results import PathArg, Result, rank_key, score_of

__all__ = ["format_table", "plot", "picked_by"]


def picked_by(direction: Direction) -> str:
    """How the best point is chosen, in words."""
    return {"read": "read GB/s", "write": "write GB/s",
            "both": "harmonic mean of read and write GB/s"}[direction]


def _infer_direction(results: Sequence[Result]) -> Direction:
    measured = [d for d in DIRECTIONS if any(r.direction == d for r in results)]
    if len(measured) == 1:
        return measured[0]
    return "both"


def format_table(results: Iterable[Result], *, direction: Direction | None = None) -> str:
    """A text table of the sweep: one row per point, best first, failed points last.

    Columns are read and write GB/s (decimal: 10**9 bytes/s, as the footer says) for the
    directions measured, each with its spread over the rounds (``±`` half the range, in
    percent of the median), and for both directions their harmonic mean, which ranks the
    rows. The recommended row is marked ``*``.
    """
    results = list(results)
    per: dict[SweepPoint, dict[str, Result]] = {}
    for r in results:
        per.setdefault(r.point, {})[r.direction] = r
    cols = [d for d in DIRECTIONS if any(r.direction == d for r in results)]
    if direction is None:
        direction = _infer_direction(results)
    scores = score_of(results, direction)
    ranked = sorted(scores.items(), key=rank_key)
    order = [p for p, _ in ranked] + sorted(p for p in per if p not in scores)
    headers: list[str] = []
    for d in cols:
        headers += [f"{d} GB/s", "spread"]
    if direction == "both":
        headers.append("hmean GB/s")
    width = max([len("point")] + [len(p.name) for p in per]) + 2
    lines = ["  " + "point".ljust(width) + "".join(h.rjust(12) for h in headers) + "  status"]
    for i, p in enumerate(order):
        mark = "* " if i == 0 and p in scores else "  "
        cells: list[str] = []
        errors = []
        for d in cols:
            res = per[p].get(d)
            g = None if res is None else res.gbps
            s = None if res is None else res.spread
            cells.append("-" if g is None else f"{g:.3f}")
            cells.append("-" if s is None else f"±{50 * s:.0f}%")
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
    rounds = max((len(r.samples) for r in results), default=0)
    lines.append(f"{len(per)} point(s), {n_failed} failed. GB/s = 10^9 bytes per second "
                 f"(1 GB/s = 0.931 GiB/s), bigger is better"
                 + (f"; median of {rounds} rounds, spread = ± half their range" if rounds > 1
                    else "")
                 + ("; hmean = harmonic mean of read and write" if direction == "both" else ""))
    return "\n".join(lines)


def plot(results: Iterable[Result], path: PathArg, *, title: str | None = None,
         direction: Direction | None = None) -> Path:
    """Draw the sweep as heat maps: block size × queue depth, one panel per parallelism.

    Each cell is the best score over the submit/overlap settings measured there (GB/s,
    10**9 bytes/s; the harmonic mean of read and write when both were measured), printed in
    the cell; cells not measured are blank, cells whose every measurement failed show ``×``.
    The best point is outlined and named under the title. One colour scale from 0 serves all
    panels. Needs matplotlib (``pip install 'aioswap[plot]'``); it uses the Agg canvas, so no
    display and no pyplot state.

    Raises
    ------
    ImportError
        matplotlib is not installed; the message names the extra to install.
    ValueError
        ``results`` is empty.
    """
    try:
        from matplotlib.backends import backend_agg  # type: ignore[import-not-found,unused-ignore]
        FigureCanvasAgg = backend_agg.FigureCanvasAgg
        from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]
        from matplotlib.patches import Rectangle  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ImportError("aioswap tune --plot needs matplotlib: pip install 'aioswap[plot]' "
                          "(or pip install matplotlib)") from e
    results = list(results)
    if not results:
        raise ValueError("nothing to plot: no results")
    if direction is None:
        direction = _infer_direction(results)
    scores = score_of(results, direction)
    points = {r.point for r in results}
    blocks = sorted({p.block_size for p in points})
    depths = sorted({p.queue_depth for p in points})
    pars = sorted({p.intra_op_parallelism for p in points})
    best = min(scores.items(), key=rank_key) if scores else None
    vmax = max(scores.values(), default=1.0) or 1.0

    ncols = len(pars) if len(pars) <= 3 else (2 if len(pars) == 4 else 3)
    nrows = -(-len(pars) // ncols)
    cell_w, cell_h = 0.75, 0.5
    fig = Figure(figsize=(max(5.5, ncols * (len(depths) * cell_w + 1.6) + 1.2),
                          nrows * (len(blocks) * cell_h + 1.3) + 1.4),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    cmap = "viridis"
    image = None
    for k, par in enumerate(pars):
        ax = axes[k // ncols][k % ncols]
        grid = [[math.nan] * len(depths) for _ in blocks]
        failed = [[False] * len(depths) for _ in blocks]
        for p in points:
            if p.intra_op_parallelism != par:
                continue
            i, j = blocks.index(p.block_size), depths.index(p.queue_depth)
            s = scores.get(p)
            if s is None:
                failed[i][j] = True
            elif math.isnan(grid[i][j]) or s > grid[i][j]:
                grid[i][j] = s
        image = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto",
                          origin="lower")
        for i in range(len(blocks)):
            for j in range(len(depths)):
                v = grid[i][j]
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                            color="white" if v < 0.6 * vmax else "black")
                elif failed[i][j]:
                    ax.text(j, i, "×", ha="center", va="center", fontsize=11, color="red")
        if best is not None and best[0].intra_op_parallelism == par:
            bi, bj = blocks.index(best[0].block_size), depths.index(best[0].queue_depth)
            ax.add_patch(Rectangle((bj - 0.5, bi - 0.5), 1, 1, fill=False, edgecolor="red",
                                   linewidth=2.5))
        ax.set_xticks(range(len(depths)), [str(d) for d in depths], fontsize=9)
        ax.set_yticks(range(len(blocks)), [short_size(b) for b in blocks], fontsize=9)
        ax.set_xlabel("queue depth", fontsize=10)
        ax.set_ylabel("block size", fontsize=10)
        ax.set_title(f"intra_op_parallelism = {par}", fontsize=10)
    for k in range(len(pars), nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.9)
        what = {"both": "hmean of read and write", "read": "read", "write": "write"}[direction]
        bar.set_label(f"{what}, GB/s (10^9 B/s)", fontsize=9)
    lines = [title or "aioswap tune"]
    if best is not None:
        p, s = best
        lines.append(f"best (red box): {p.name} = {s:.2f} GB/s")
    else:
        lines.append("no point succeeded")
    lines.append("cell = best over the submit/overlap settings; × = failed; blank = not measured")
    width = int(fig.get_figwidth() * 13)
    fig.suptitle("\n".join(textwrap.fill(x, width) for x in lines), fontsize=10)
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
