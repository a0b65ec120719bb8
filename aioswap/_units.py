"""The package's one size parser and formatter, and its one throughput unit.

Sizes are binary: ``K``, ``M``, ``G``, ``T`` are powers of 1024 whether written ``4K``, ``4KB``
or ``4KiB`` (this is what ``ulimit``, ``fio`` and DeepSpeed's tools mean by them), a fraction is
allowed when it gives a whole number of bytes (``1.5G``), and a bare number is bytes.
Throughput is decimal: ``GB/s`` is 10**9 bytes per second everywhere (tools, benchmarks, logs).
"""
from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["GB", "UNITS_NOTE", "format_rate", "format_size", "parse_size", "shape_fits",
           "short_size"]

#: One GB/s is 10**9 bytes per second (fio, KvikIO and drive data sheets count this way).
GB = 10**9

#: What every table says about its numbers.
UNITS_NOTE = "GB/s = 10^9 bytes/s; ratio = aioswap / other (bigger is better)"

_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]?)(i?B)?\s*", re.IGNORECASE)


def parse_size(text: str | int, *, minimum: int = 1, what: str = "size") -> int:
    """Bytes from ``"4096"``, ``"4K"``, ``"1M"``, ``"1.5G"``, ``"1GiB"``, ``"64 MB"``.

    Parameters
    ----------
    text : str or int
        The size; an ``int`` is taken as bytes.
    minimum : int
        Smallest accepted value (default 1: sizes are positive).
    what : str
        How the message names the value (e.g. ``"--block-size"``).

    Returns
    -------
    int
        The size in bytes.

    Raises
    ------
    ValueError
        Not a size, not a whole number of bytes, or below ``minimum``; the message says which
        and shows the accepted forms.
    """
    if isinstance(text, bool):
        raise ValueError(f"{what} must be a size, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if m is None:
            raise ValueError(f"invalid {what} {text!r}: use bytes or a number with K, M, G or T "
                             f"(powers of 1024), e.g. 4096, 512K, 1M, 1.5G, 1GiB")
        exact = Fraction(m.group(1)) * _SCALE[m.group(2).upper()]
        if exact.denominator != 1:
            raise ValueError(f"invalid {what} {text!r}: not a whole number of bytes")
        value = int(exact)
    if value < minimum:
        floor = "positive" if minimum == 1 else f"at least {format_size(minimum)}"
        raise ValueError(f"{what} must be {floor}, got {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """``1073741824`` → ``"1 GiB"``, ``1536`` → ``"1.50 KiB"``, ``1000`` → ``"1000 B"``.

    Whole multiples print without decimals; :func:`parse_size` reads every output back
    (to the two decimals shown).
    """
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            if nbytes % scale == 0:
                return f"{nbytes // scale} {unit}"
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def short_size(nbytes: int) -> str:
    """``1048576`` → ``"1M"``: the largest unit that divides exactly, no space (for names)."""
    for unit in ("T", "G", "M", "K"):
        scale = _SCALE[unit]
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def format_rate(nbytes: float, seconds: float) -> str:
    """``"1.23 GB/s"`` (10**9 bytes per second); ``"-"`` when nothing was timed."""
    if seconds <= 0:
        return "-"
    return f"{nbytes / seconds / GB:.2f} GB/s"


def shape_fits(shape: list[int] | tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` can exist: every size and the product of the non-zero
    sizes below 2**63 (torch counts elements in int64 even when one size is 0)."""
    n = 1
    for v in shape:
        if v >= 1 << 63:
            return False
        if v:
            n *= v
    return n < 1 << 63
