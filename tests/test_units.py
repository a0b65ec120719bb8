"""aioswap._units: the one size parser/formatter (powers of 1024) and the GB/s unit."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioswap._units import GB, UNITS_NOTE, format_rate, format_size, parse_size, short_size

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.parametrize("text, value", [
    ("1G", GiB), ("1g", GiB), ("1GiB", GiB), ("1 GB", GiB), ("400M", 400 * MiB),
    ("64K", 64 << 10), ("4096", 4096), ("1.5K", 1536), ("1.5G", 3 * GiB // 2), ("2T", 2 << 40),
    (" 8M ", 8 * MiB), ("64MiB", 64 * MiB), ("64m", 64 * MiB), ("4kb", 4096), (".5M", MiB // 2),
    (4096, 4096),
])
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text, why", [
    ("0", "size must be positive"), ("0K", "size must be positive"), ("12X", "invalid size"),
    ("", "invalid size"), ("-1M", "invalid size"), ("M", "invalid size"),
    ("1.2.3G", "invalid size"), ("1 G B", "invalid size"), ("1.3K", "not a whole number"),
    ("0.5", "not a whole number"),
])
def test_parse_size_rejects(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_size(text)


def test_parse_size_minimum_and_name() -> None:
    assert parse_size("0", minimum=0) == 0
    with pytest.raises(ValueError, match=r"--size must be at least 1 MiB, got '1000'"):
        parse_size("1000", minimum=MiB, what="--size")
    with pytest.raises(ValueError, match="must be a size"):
        parse_size(True)  # type: ignore[arg-type]


@pytest.mark.parametrize("n, text", [
    (GiB, "1 GiB"), (8 * MiB, "8 MiB"), (400 * MiB, "400 MiB"), (64 << 10, "64 KiB"),
    (1536, "1.50 KiB"), (1000, "1000 B"), (3 * GiB // 2, "1.50 GiB"), (1 << 40, "1 TiB"),
])
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@given(st.integers(0, 1 << 44).map(lambda n: n * 1024) | st.integers(1, 4096))
def test_format_size_parses_back(n: int) -> None:
    text = format_size(n)
    back = parse_size(text, minimum=0) if "." not in text else None
    if back is not None:
        assert back == n


def test_short_size() -> None:
    assert [short_size(n) for n in (4096, 128 << 10, MiB, 3 * MiB, GiB, 5000, 1 << 40)] == \
        ["4K", "128K", "1M", "3M", "1G", "5000", "1T"]
    for n in (4096, 8192, 3 * MiB, 5000):
        assert parse_size(short_size(n)) == n


def test_rate_unit_is_decimal() -> None:
    assert GB == 10**9
    assert format_rate(2 * 10**9, 1.0) == "2.00 GB/s" and format_rate(1, 0) == "-"
    assert "10^9" in UNITS_NOTE and "aioswap / other" in UNITS_NOTE
