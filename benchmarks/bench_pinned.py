"""Cost of ``aioswap.pinned.is_pinned`` on tensor views as the number of registered ranges grows.

One tensor from ``pinned.empty`` is the memory the views point into; the other ranges are
registered with ``pinned.register`` (bookkeeping only: they are never touched), half below and
half above it so that lookups do not all land at one end of the index. For each count the
script times batches of queries and prints the median and 90th percentile per query, then the
growth from the smallest to the largest count.

    python benchmarks/bench_pinned.py                      # 10, 1,000 and 100,000 ranges
    python benchmarks/bench_pinned.py --ranges 10 100 --batch 200 --repeat 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from aioswap import pinned

SPACING = 1 << 16          # distance between synthetic ranges
SIZE = 1 << 12             # bytes per synthetic range


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranges", type=int, nargs="+", default=[10, 1_000, 100_000],
                        help="registered range counts to measure (default: 10 1000 100000)")
    parser.add_argument("--batch", type=int, default=1_000,
                        help="queries timed together (default: 1000)")
    parser.add_argument("--repeat", type=int, default=51,
                        help="timed batches per count and view (default: 51)")
    args = parser.parse_args(argv)
    if min(args.ranges) < 1 or args.batch < 1 or args.repeat < 1:
        parser.error("--ranges, --batch and --repeat must be positive")
    return args


def time_queries(view: torch.Tensor, batch: int, repeat: int) -> list[float]:
    """Microseconds per is_pinned(view), one figure per batch."""
    is_pinned = pinned.is_pinned
    loop = range(batch)
    if not is_pinned(view):
        raise SystemExit("benchmark view is unexpectedly not pinned")
    figures = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for _ in loop:
            is_pinned(view)
        figures.append((time.perf_counter_ns() - start) / batch / 1e3)
    return figures


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = pinned.empty((1024, 256), torch.float32)          # 1 MiB, page aligned
    lo = base.data_ptr()
    hi = lo + base.numel() * base.element_size()
    views = {
        "slice": base[100:200],                # contiguous narrow view
        "strided": base[100:200, 8:250:3],     # non-contiguous 2-D view
    }
    registrations: list[pinned.Registration] = []

    def grow_to(count: int) -> None:
        # Keep the index balanced around `base`: even i below it, odd i above it.
        while len(registrations) + 1 < count:
            i = len(registrations)
            k = i // 2 + 1
            address = lo - k * SPACING if i % 2 == 0 else hi + k * SPACING
            registrations.append(pinned.register(address, SIZE))

    rows: list[tuple[str, int, float, float]] = []
    try:
        for count in sorted(set(args.ranges)):
            grow_to(count)
            ranges = pinned.stats().ranges
            for name, view in views.items():
                figures = time_queries(view, args.batch, args.repeat)
                rows.append((name, ranges, statistics.median(figures), percentile(figures, 0.9)))
    finally:
        for registration in reversed(registrations):
            registration.close()

    print(f"is_pinned per query ({args.batch} queries x {args.repeat} batches; microseconds, "
          f"smaller is better; growth = largest / smallest count)")
    print(f"{'view':<8} {'ranges':>8} {'median us':>10} {'p90 us':>8}")
    for name, ranges, median, p90 in rows:
        print(f"{name:<8} {ranges:>8} {median:>10.3f} {p90:>8.3f}")
    for name in views:
        mine = [r for r in rows if r[0] == name]
        first, last = mine[0], mine[-1]
        print(f"growth {name}: {first[1]} -> {last[1]} ranges: {last[2] / first[2]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
