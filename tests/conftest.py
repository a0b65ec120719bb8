"""Shared fixtures: kept small on purpose; each test module builds what else it needs."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests that need O_DIRECT must run on a real disk. pytest's tmp_path is fine where /tmp is
# a disk file system; set AIOSWAP_TEST_DIR to point the tests at a given drive (e.g. NVMe).
_ENV_DIR = "AIOSWAP_TEST_DIR"


@pytest.fixture(scope="session")
def disk_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Session-wide directory on a real disk (``$AIOSWAP_TEST_DIR`` or pytest's base temp)."""
    base = os.environ.get(_ENV_DIR)
    if not base:
        yield tmp_path_factory.getbasetemp()
        return
    d = Path(tempfile.mkdtemp(prefix="aioswap-test-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmp_dir(disk_root: Path, tmp_path: Path) -> Path:
    """A fresh, empty directory on a real disk, removed with the session."""
    if not os.environ.get(_ENV_DIR):
        return tmp_path
    return Path(tempfile.mkdtemp(dir=disk_root))
